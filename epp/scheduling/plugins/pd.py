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

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol, Self, runtime_checkable

from epp import keys
from epp.errors import ConfigError, NoCapacity
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import Profile
from epp.framework.params import NoParameters, param
from epp.scheduling.plugins.prefix import (
    CHARS_PER_TOKEN,
    ApproxPrefixCacheProducer,
    PrefixCacheScorer,
)
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
    producers = handle.of_type(ApproxPrefixCacheProducer)
    if producers:
        return producers[0]
    for scorer in handle.of_type(PrefixCacheScorer):  # a prefix-cache-scorer's own producer
        if scorer.producer is not None:
            return scorer.producer
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

    @dataclass(frozen=True)
    class Parameters:
        non_cached_tokens: int = param("nonCachedTokens", 0, minimum=0)

    def __init__(self, name: str, non_cached_tokens: int) -> None:
        self.name = name
        self.non_cached_tokens = non_cached_tokens
        self._handle: PluginHandle | None = None

    @classmethod
    def from_params(cls, name: str, params: PrefixBasedPDDecider.Parameters,
                    handle: PluginHandle) -> PrefixBasedPDDecider:
        return cls(name, params.non_cached_tokens)

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
    Parameters = NoParameters

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> AlwaysDisaggPDDecider:
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
            if isinstance(p, PrefixCacheScorer) and p.producer is not None:
                return p.producer
        return _find_producer(self.handle)

    def disaggregate(self, state: CycleState, request: LLMRequest, decode: Endpoint) -> bool:
        return non_cached_tokens(self._producer(), state, request, decode) >= self.threshold


def _profiles_param(v: Any, path: str) -> Mapping[str, str]:
    if not isinstance(v, Mapping) or set(v) - {"decode", "prefill"}:
        raise ConfigError(f"{path}: expected {{decode: NAME, prefill: NAME}}")
    return v


def _deciders_param(v: Any, path: str) -> Mapping[str, str]:
    if not isinstance(v, Mapping) or set(v) - {"prefill"}:
        raise ConfigError(f"{path}: expected {{prefill: DECIDER-PLUGIN-NAME}}")
    return v


@dataclass(frozen=True)
class DisaggProfileHandlerParameters:
    profiles: Mapping[str, str] | None = param("profiles", None, parse=_profiles_param)
    deciders: Mapping[str, str] | None = param("deciders", None, parse=_deciders_param)
    # Deprecated flat names (older llm-d files).
    decode_profile: str | None = param("decodeProfile")
    prefill_profile: str | None = param("prefillProfile")
    decider_plugin_name: str | None = param("deciderPluginName")
    primary_port: int = param("primaryPort", 0, minimum=0, maximum=65535)


class DisaggProfileHandler:
    """Decode first, then prefill when the decider says so; primary = decode."""

    type_name = "disagg-profile-handler"
    Parameters = DisaggProfileHandlerParameters

    def __init__(self, name: str, decode_profile: str = "decode", prefill_profile: str = "prefill",
                 decider_name: str | None = None, primary_port: int | None = None) -> None:
        self.name = name
        self.decode_profile = decode_profile
        self.prefill_profile = prefill_profile
        self.decider_name = decider_name
        self.primary_port = primary_port
        self.decider: PrefillDecider | None = None

    @classmethod
    def from_params(cls, name: str, params: DisaggProfileHandlerParameters,
                    handle: PluginHandle) -> DisaggProfileHandler:
        profiles = params.profiles or {}
        deciders = params.deciders or {}
        decode = params.decode_profile or profiles.get("decode") or "decode"
        prefill = params.prefill_profile or profiles.get("prefill") or "prefill"
        decider = params.decider_plugin_name or deciders.get("prefill")
        return cls(name, str(decode), str(prefill), str(decider) if decider else None,
                   params.primary_port or None)

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

    def check_profiles(self, names: AbstractSet[str]) -> None:
        if self.decode_profile not in names:
            raise ConfigError(f"{self.name}: no scheduling profile named {self.decode_profile!r} "
                              "(the decode profile)")

    def pick(self, state: CycleState, request: LLMRequest,
             profiles: Mapping[str, Profile],
             results: Mapping[str, ProfileRunResult | None]) -> Mapping[str, Profile]:
        if not results:
            return {self.decode_profile: profiles[self.decode_profile]}
        if self.prefill_profile in results or self.prefill_profile not in profiles:
            return {}
        decode = results.get(self.decode_profile)
        if decode is None or not decode.endpoints:
            return {}
        chosen = decode.endpoints[0]
        assert self.decider is not None, "bind() not called"
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

    @dataclass(frozen=True)
    class Parameters:
        threshold: int = param("threshold", 0, minimum=0)
        decode_profile: str = param("decodeProfile", "decode")
        prefill_profile: str = param("prefillProfile", "prefill")
        prefix_plugin_name: str | None = param("prefixPluginName")
        # Accepted for compatibility; the prefix plugin's own type and block size are used.
        prefix_plugin_type: str | None = param("prefixPluginType")
        hash_block_size: int = param("hashBlockSize", 64, minimum=1)
        primary_port: int = param("primaryPort", 0, minimum=0, maximum=65535)

    def __init__(self, name: str, decode_profile: str, prefill_profile: str, threshold: int,
                 prefix_plugin: str | None, primary_port: int | None = None) -> None:
        super().__init__(name, decode_profile, prefill_profile, None, primary_port)
        self.threshold = threshold
        self.prefix_plugin = prefix_plugin

    @classmethod
    def from_params(cls, name: str,  # type: ignore[override]  # its own parameters
                    params: PdProfileHandler.Parameters,
                    handle: PluginHandle) -> PdProfileHandler:
        return cls(name, params.decode_profile or "decode", params.prefill_profile or "prefill",
                   params.threshold, params.prefix_plugin_name, params.primary_port or None)

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

    @dataclass(frozen=True)
    class Parameters:
        prefill_profile: str = param("prefillProfile", "prefill")

    def __init__(self, name: str, prefill_profile: str = "prefill") -> None:
        self.name = name
        self.prefill_profile = prefill_profile

    @classmethod
    def from_params(cls, name: str, params: PrefillHeaderHandler.Parameters,
                    handle: PluginHandle) -> Self:
        return cls(name, params.prefill_profile or "prefill")

    def request_headers(self, request: LLMRequest, result: SchedulingResult) -> Mapping[str, str]:
        prefill = result.profile_results.get(self.prefill_profile)
        if prefill is None or not prefill.endpoints:
            return {}
        return {keys.HEADER_PREFILLER: prefill.endpoints[0].key}


class DisaggHeadersHandler(PrefillHeaderHandler):
    type_name = "disagg-headers-handler"
