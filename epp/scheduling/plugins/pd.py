"""Prefill/decode disaggregation (llm-d semantics).

``disagg-profile-handler`` runs the decode profile first; if a prefill decider says so, it
then runs the prefill profile. The primary profile is decode. The prefill endpoint goes to
the decode pod in ``x-prefiller-host-port``. A failed prefill profile falls back to
decode-only; a failed decode profile fails the request (429).

Deciders answer "disaggregate this request, given the decode endpoint chosen?":

- ``prefix-based-pd-decider`` {nonCachedTokens}: yes when the prompt tokens *not* cached
  on the chosen decode endpoint (estimated: prompt chars / 4 minus the prefix index's
  matched blocks × block size) are ≥ nonCachedTokens. **0 means never.**
- ``always-disagg-pd-decider``: always yes.

The legacy ``pd-profile-handler`` {threshold} applies the same non-cached-token test with
**the opposite meaning of 0**: disaggregate when non-cached tokens ≥ threshold, so
threshold 0 means *always* disaggregate.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

from epp import keys
from epp.config.params import Params
from epp.config.registry import PluginHandle
from epp.errors import ConfigError, NoCapacity
from epp.scheduling.plugins.prefix import CHARS_PER_TOKEN, ApproxPrefixCacheProducer
from epp.scheduling.scheduler import SchedulerProfile
from epp.scheduling.types import (
    CycleState,
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    SchedulingResult,
)

# CycleState key under which the handler leaves the chosen decode endpoint for the
# prefill profile's plugins (e.g. topology-affinity-scorer).
DECODE_ENDPOINT_KEY = "pd.decode-endpoint"


@runtime_checkable
class PrefillDecider(Protocol):
    name: str
    type_name: str

    def disaggregate(self, state: CycleState, request: LLMRequest, decode: Endpoint) -> bool: ...


def _find_producer(handle: PluginHandle) -> ApproxPrefixCacheProducer | None:
    for p in handle.plugins.values():
        if isinstance(p, ApproxPrefixCacheProducer):
            return p
    for p in handle.plugins.values():  # a prefix-cache-scorer's own producer
        prod = getattr(p, "producer", None)
        if isinstance(prod, ApproxPrefixCacheProducer):
            return prod
    return None


def non_cached_tokens(producer: ApproxPrefixCacheProducer | None, state: CycleState,
                      request: LLMRequest, decode: Endpoint) -> int:
    """Estimated prompt tokens not in the decode endpoint's cache."""
    total = len(request.prompt) // CHARS_PER_TOKEN
    if producer is None:
        return total
    hashes = producer.hashes(request)
    if not hashes:
        return total
    matched = producer.index.match(hashes, [decode.key]).get(decode.key, 0)
    cached_chars = matched * producer.block_chars
    return max(0, (len(request.prompt) - cached_chars) // CHARS_PER_TOKEN)


class PrefixBasedPDDecider:
    type_name = "prefix-based-pd-decider"

    def __init__(self, name: str, non_cached_tokens: int) -> None:
        self.name = name
        self.non_cached_tokens = non_cached_tokens
        self._handle: PluginHandle | None = None

    @classmethod
    def from_params(cls, name: str, params: Params, handle: PluginHandle) -> "PrefixBasedPDDecider":
        n = params.int("nonCachedTokens", 0, minimum=0)
        params.done()
        return cls(name, n)

    def bind(self, handle: PluginHandle) -> None:
        # Resolved at first use: a prefix-cache-scorer may create its producer in its own
        # bind, after this one.
        self._handle = handle

    def disaggregate(self, state: CycleState, request: LLMRequest, decode: Endpoint) -> bool:
        if self.non_cached_tokens == 0:
            return False
        producer = _find_producer(self._handle) if self._handle is not None else None
        return non_cached_tokens(producer, state, request, decode) >= self.non_cached_tokens


class AlwaysDisaggPDDecider:
    type_name = "always-disagg-pd-decider"

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: Params, handle: PluginHandle) -> "AlwaysDisaggPDDecider":
        params.done()
        return cls(name)

    def disaggregate(self, state: CycleState, request: LLMRequest, decode: Endpoint) -> bool:
        return True


class _ThresholdDecider:
    """The legacy pd-profile-handler's rule: non-cached tokens ≥ threshold (0 = always)."""

    type_name = "pd-profile-handler-threshold"

    def __init__(self, name: str, threshold: int) -> None:
        self.name = name
        self.threshold = threshold
        self.handle: PluginHandle | None = None
        self.prefix_plugin: str | None = None

    def _producer(self) -> ApproxPrefixCacheProducer | None:
        if self.handle is None:
            return None
        if self.prefix_plugin:
            p = self.handle.get(self.prefix_plugin)
            if isinstance(p, ApproxPrefixCacheProducer):
                return p
            prod = getattr(p, "producer", None)
            if isinstance(prod, ApproxPrefixCacheProducer):
                return prod
        return _find_producer(self.handle)

    def disaggregate(self, state: CycleState, request: LLMRequest, decode: Endpoint) -> bool:
        return non_cached_tokens(self._producer(), state, request, decode) >= self.threshold


class DisaggProfileHandler:
    """Decode first, then prefill when the decider says so; primary = decode."""

    type_name = "disagg-profile-handler"

    def __init__(self, name: str, decode_profile: str = "decode", prefill_profile: str = "prefill",
                 decider_name: str | None = None, primary_port: int | None = None) -> None:
        self.name = name
        self.decode_profile = decode_profile
        self.prefill_profile = prefill_profile
        self.decider_name = decider_name
        self.primary_port = primary_port
        self.decider: Any = None

    @classmethod
    def from_params(cls, name: str, params: Params, handle: PluginHandle) -> "DisaggProfileHandler":
        profiles = params.raw("profiles") or {}
        deciders = params.raw("deciders") or {}
        if not isinstance(profiles, Mapping) or set(profiles) - {"decode", "prefill"}:
            raise ConfigError(f"{params.path}.profiles: expected {{decode: NAME, prefill: NAME}}")
        if not isinstance(deciders, Mapping) or set(deciders) - {"prefill"}:
            raise ConfigError(f"{params.path}.deciders: expected {{prefill: DECIDER-PLUGIN-NAME}}")
        # Deprecated flat names (older llm-d files).
        decode = params.str("decodeProfile", None) or profiles.get("decode") or "decode"
        prefill = params.str("prefillProfile", None) or profiles.get("prefill") or "prefill"
        decider = params.str("deciderPluginName", None) or deciders.get("prefill")
        primary_port = params.int("primaryPort", 0, minimum=0, maximum=65535)
        params.done()
        return cls(name, str(decode), str(prefill), str(decider) if decider else None,
                   primary_port or None)

    def bind(self, handle: PluginHandle) -> None:
        if self.decider_name is None:
            self.decider = AlwaysDisaggPDDecider("always-disagg-pd-decider")
            return
        d = handle.get(self.decider_name)
        if d is None:
            raise ConfigError(f"deciders.prefill: no plugin named {self.decider_name!r}")
        if not isinstance(d, PrefillDecider):
            raise ConfigError(f"deciders.prefill: {self.decider_name!r} ({d.type_name}) is not "
                              "a prefill decider (prefix-based-pd-decider, "
                              "always-disagg-pd-decider)")
        self.decider = d

    def check_profiles(self, names: set[str]) -> None:
        if self.decode_profile not in names:
            raise ConfigError(f"{self.name}: no scheduling profile named {self.decode_profile!r} "
                              "(the decode profile)")

    def pick(self, state: CycleState, request: LLMRequest,
             profiles: Mapping[str, SchedulerProfile],
             results: Mapping[str, ProfileRunResult | None]) -> Mapping[str, SchedulerProfile]:
        if not results:
            return {self.decode_profile: profiles[self.decode_profile]}
        if self.prefill_profile in results or self.prefill_profile not in profiles:
            return {}
        decode = results.get(self.decode_profile)
        if decode is None or not decode.endpoints:
            return {}
        chosen = decode.endpoints[0]
        if not self.decider.disaggregate(state, request, chosen):
            return {}
        state[DECODE_ENDPOINT_KEY] = chosen
        return {self.prefill_profile: profiles[self.prefill_profile]}

    def process_results(self, state: CycleState, request: LLMRequest,
                        results: Mapping[str, ProfileRunResult | None]) -> SchedulingResult:
        decode = results.get(self.decode_profile)
        if decode is None or not decode.endpoints:
            raise NoCapacity(f"profile {self.decode_profile!r} filtered out every endpoint "
                             "(no decode endpoint)")
        return SchedulingResult(profile_results=dict(results), primary_profile=self.decode_profile,
                                destination_port=self.primary_port)

    def request_headers(self, request: LLMRequest, result: SchedulingResult) -> Mapping[str, str]:
        out: dict[str, str] = {}
        if self.primary_port is not None:
            out[keys.HEADER_DATA_PARALLEL] = result.primary.endpoints[0].key
        prefill = result.profile_results.get(self.prefill_profile)
        if prefill is not None and prefill.endpoints:
            out[keys.HEADER_PREFILLER] = prefill.endpoints[0].key
        return out

    def decision(self, result: SchedulingResult) -> str:
        """'disaggregated' or 'decode-only' (for the P/D decision metric)."""
        prefill = result.profile_results.get(self.prefill_profile)
        return "disaggregated" if prefill is not None and prefill.endpoints else "decode-only"


class PdProfileHandler(DisaggProfileHandler):
    """Legacy llm-d ``pd-profile-handler`` {threshold}: 0 means ALWAYS disaggregate."""

    type_name = "pd-profile-handler"

    def __init__(self, name: str, decode_profile: str, prefill_profile: str, threshold: int,
                 prefix_plugin: str | None, primary_port: int | None = None) -> None:
        super().__init__(name, decode_profile, prefill_profile, None, primary_port)
        self.threshold = threshold
        self.prefix_plugin = prefix_plugin

    @classmethod
    def from_params(cls, name: str, params: Params, handle: PluginHandle) -> "PdProfileHandler":
        threshold = params.int("threshold", 0, minimum=0)
        decode = params.str("decodeProfile", "decode") or "decode"
        prefill = params.str("prefillProfile", "prefill") or "prefill"
        prefix_name = params.str("prefixPluginName", None)
        params.str("prefixPluginType", None)  # accepted for compatibility; the type is fixed
        params.int("hashBlockSize", 64, minimum=1)  # the prefix plugin's own size is used
        primary_port = params.int("primaryPort", 0, minimum=0, maximum=65535)
        params.done()
        return cls(name, decode, prefill, threshold, prefix_name, primary_port or None)

    def bind(self, handle: PluginHandle) -> None:
        decider = _ThresholdDecider(f"{self.name}-threshold", self.threshold)
        decider.handle = handle
        decider.prefix_plugin = self.prefix_plugin
        self.decider = decider


class PrefillHeaderHandler:
    """llm-d's ``prefill-header-handler`` / ``disagg-headers-handler``: sets
    ``x-prefiller-host-port`` from the prefill profile's result (the disagg handlers also
    do this themselves; declaring it keeps llm-d files loading unchanged)."""

    type_name = "prefill-header-handler"

    def __init__(self, name: str, prefill_profile: str = "prefill") -> None:
        self.name = name
        self.prefill_profile = prefill_profile

    @classmethod
    def from_params(cls, name: str, params: Params, handle: PluginHandle) -> "PrefillHeaderHandler":
        prof = params.str("prefillProfile", "prefill") or "prefill"
        params.done()
        return cls(name, prof)

    def request_headers(self, request: LLMRequest, result: SchedulingResult) -> Mapping[str, str]:
        prefill = result.profile_results.get(self.prefill_profile)
        if prefill is None or not prefill.endpoints:
            return {}
        return {keys.HEADER_PREFILLER: prefill.endpoints[0].key}


class DisaggHeadersHandler(PrefillHeaderHandler):
    type_name = "disagg-headers-handler"
