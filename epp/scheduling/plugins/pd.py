"""Encode/prefill/decode disaggregation (llm-d semantics).

``disagg-profile-handler`` (llm-d-router v0.10.0 ``pkg/epp/framework/plugins/scheduling/
profilehandler/disagg/disagg_profile_handler.go``) runs the decode profile first; then,
if an encode decider is configured (``deciders.encode``) and says so, the encode profile;
then, if a prefill decider says so, the prefill profile. The primary profile is decode.
The prefill endpoint goes to the decode pod in ``x-prefiller-host-port``, the encode
endpoints (every endpoint the encode profile picked, ``ip:port`` comma-separated) in
``x-encoder-hosts-ports`` — llm-d's sidecar convention. A failed encode or prefill
profile drops that stage; a failed decode profile fails the request (429).

Deciders answer "disaggregate this request, given the decode endpoint chosen?":

- ``prefix-based-pd-decider`` {nonCachedTokens}: yes when the prompt tokens *not* cached
  on the chosen decode endpoint (estimated: prompt chars / 4 minus the prefix index's
  matched blocks × block size) are ≥ nonCachedTokens. **0 means never.**
- ``always-disagg-pd-decider``: always yes.
- ``always-disagg-multimodal-decider`` (for ``deciders.encode``): yes when the request
  carries media — a chat message content part of type ``image_url``, ``video_url``,
  ``input_audio`` or ``audio_url`` (:func:`epp.parsing.request.multimodal_items`).

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
from epp.parsing.request import multimodal_items
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
# CycleState key: the encode decider was asked this cycle (so it is asked once).
_ENCODE_DECIDED_KEY = "pd.encode-decided"


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


class AlwaysDisaggMultimodalDecider:
    """llm-d's encode decider: disaggregate the encode stage for requests with media."""

    type_name = "always-disagg-multimodal-decider"
    Parameters = NoParameters

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> AlwaysDisaggMultimodalDecider:
        return cls(name)

    def disaggregate(self, state: CycleState, request: LLMRequest, decode: Endpoint) -> bool:
        body = request.plugin_state.get(keys.PLUGIN_STATE_REQUEST_BODY)
        return isinstance(body, Mapping) and bool(multimodal_items(body))


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
    if not isinstance(v, Mapping) or set(v) - {"decode", "prefill", "encode"}:
        raise ConfigError(f"{path}: expected {{decode: NAME, prefill: NAME, encode: NAME}}")
    return v


def _deciders_param(v: Any, path: str) -> Mapping[str, str]:
    if not isinstance(v, Mapping) or set(v) - {"prefill", "encode"}:
        raise ConfigError(f"{path}: expected {{prefill: DECIDER-PLUGIN-NAME, "
                          "encode: DECIDER-PLUGIN-NAME}}")
    return v


@dataclass(frozen=True)
class DisaggProfileHandlerParameters:
    profiles: Mapping[str, str] | None = param("profiles", None, parse=_profiles_param)
    deciders: Mapping[str, str] | None = param("deciders", None, parse=_deciders_param)
    # Deprecated flat names (older llm-d files).
    decode_profile: str | None = param("decodeProfile")
    prefill_profile: str | None = param("prefillProfile")
    encode_profile: str | None = param("encodeProfile")
    prefill_decider_plugin_name: str | None = param("prefillDeciderPluginName")
    encode_decider_plugin_name: str | None = param("encodeDeciderPluginName")
    decider_plugin_name: str | None = param("deciderPluginName")
    primary_port: int = param("primaryPort", 0, minimum=0, maximum=65535)


class DisaggProfileHandler:
    """Decode first, then encode and prefill when their deciders say so; primary = decode."""

    type_name = "disagg-profile-handler"
    Parameters = DisaggProfileHandlerParameters

    def __init__(self, name: str, decode_profile: str = "decode", prefill_profile: str = "prefill",
                 decider_name: str | None = None, primary_port: int | None = None,
                 encode_profile: str = "encode", encode_decider_name: str | None = None) -> None:
        self.name = name
        self.decode_profile = decode_profile
        self.prefill_profile = prefill_profile
        self.encode_profile = encode_profile
        self.decider_name = decider_name
        self.encode_decider_name = encode_decider_name
        self.primary_port = primary_port
        self.decider: PrefillDecider | None = None
        # None: the encode stage is off (no deciders.encode), as llm-d.
        self.encode_decider: PrefillDecider | None = None

    @classmethod
    def from_params(cls, name: str, params: DisaggProfileHandlerParameters,
                    handle: PluginHandle) -> DisaggProfileHandler:
        profiles = params.profiles or {}
        deciders = params.deciders or {}
        decode = params.decode_profile or profiles.get("decode") or "decode"
        prefill = params.prefill_profile or profiles.get("prefill") or "prefill"
        encode = params.encode_profile or profiles.get("encode") or "encode"
        decider = (params.prefill_decider_plugin_name or params.decider_plugin_name
                   or deciders.get("prefill"))
        encode_decider = params.encode_decider_plugin_name or deciders.get("encode")
        return cls(name, str(decode), str(prefill), str(decider) if decider else None,
                   params.primary_port or None, str(encode),
                   str(encode_decider) if encode_decider else None)

    @staticmethod
    def _decider(handle: PluginHandle, key: str, name: str) -> PrefillDecider:
        d = handle.get(name)
        if d is None:
            raise ConfigError(f"deciders.{key}: no plugin named {name!r}; declare the decider "
                              "under plugins")
        if not isinstance(d, PrefillDecider):
            article = "an" if key == "encode" else "a"
            raise ConfigError(f"deciders.{key}: {name!r} ({d.type_name}) is not {article} "
                              f"{key} decider (prefix-based-pd-decider, "
                              "always-disagg-pd-decider, always-disagg-multimodal-decider)")
        return d

    def bind(self, handle: PluginHandle) -> None:
        if self.encode_decider_name is not None:
            self.encode_decider = self._decider(handle, "encode", self.encode_decider_name)
        if self.decider_name is None:
            self.decider = AlwaysDisaggPDDecider("always-disagg-pd-decider")
            return
        self.decider = self._decider(handle, "prefill", self.decider_name)

    def check_profiles(self, names: AbstractSet[str]) -> None:
        if self.decode_profile not in names:
            raise ConfigError(f"{self.name}: no scheduling profile named {self.decode_profile!r} "
                              "(the decode profile)")

    def pick(self, state: CycleState, request: LLMRequest,
             profiles: Mapping[str, Profile],
             results: Mapping[str, ProfileRunResult | None]) -> Mapping[str, Profile]:
        if not results:
            return {self.decode_profile: profiles[self.decode_profile]}
        decode = results.get(self.decode_profile)
        if decode is None or not decode.endpoints:
            return {}
        chosen = decode.endpoints[0]
        # Encode (llm-d: only with deciders.encode and an encode profile; asked once).
        if (self.encode_decider is not None and self.encode_profile in profiles
                and self.encode_profile not in results
                and not state.get(_ENCODE_DECIDED_KEY)):
            state[_ENCODE_DECIDED_KEY] = True
            if self.encode_decider.disaggregate(state, request, chosen):
                return {self.encode_profile: profiles[self.encode_profile]}
        if self.prefill_profile in results or self.prefill_profile not in profiles:
            return {}
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

    def _used(self, result: SchedulingResult, profile: str) -> bool:
        r = result.profile_results.get(profile)
        return r is not None and bool(r.endpoints)

    def request_headers(self, request: LLMRequest, result: SchedulingResult) -> Mapping[str, str]:
        out: dict[str, str] = {}
        if self.primary_port is not None:
            out[keys.HEADER_DATA_PARALLEL] = result.primary.endpoints[0].key
        prefill = result.profile_results.get(self.prefill_profile)
        if prefill is not None and prefill.endpoints:
            out[keys.HEADER_PREFILLER] = prefill.endpoints[0].key
        out.update(encode_headers(result, self.encode_profile))
        return out

    def decision(self, result: SchedulingResult) -> str:
        """The P/D decision metric's label: 'disaggregated' or 'decode-only'; with an encode
        stage, llm-d's 'encode-decode' or 'encode-prefill-decode'."""
        prefill = self._used(result, self.prefill_profile)
        if self._used(result, self.encode_profile):
            return "encode-prefill-decode" if prefill else "encode-decode"
        return "disaggregated" if prefill else "decode-only"


def encode_headers(result: SchedulingResult, encode_profile: str) -> Mapping[str, str]:
    """``x-encoder-hosts-ports``: every endpoint the encode profile picked, comma-separated
    (llm-d's ``PreRequest``); nothing when the encode stage did not run or picked none."""
    encode = result.profile_results.get(encode_profile)
    if encode is None or not encode.endpoints:
        return {}
    return {keys.HEADER_ENCODERS: ",".join(e.key for e in encode.endpoints)}


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
    ``x-prefiller-host-port`` from the prefill profile's result and
    ``x-encoder-hosts-ports`` from the encode profile's (the disagg handlers also do this
    themselves; declaring it keeps llm-d files loading unchanged)."""

    type_name = "prefill-header-handler"

    @dataclass(frozen=True)
    class Parameters:
        prefill_profile: str = param("prefillProfile", "prefill")
        encode_profile: str = param("encodeProfile", "encode")

    def __init__(self, name: str, prefill_profile: str = "prefill",
                 encode_profile: str = "encode") -> None:
        self.name = name
        self.prefill_profile = prefill_profile
        self.encode_profile = encode_profile

    @classmethod
    def from_params(cls, name: str, params: PrefillHeaderHandler.Parameters,
                    handle: PluginHandle) -> Self:
        return cls(name, params.prefill_profile or "prefill", params.encode_profile or "encode")

    def request_headers(self, request: LLMRequest, result: SchedulingResult) -> Mapping[str, str]:
        out = dict(encode_headers(result, self.encode_profile))
        prefill = result.profile_results.get(self.prefill_profile)
        if prefill is not None and prefill.endpoints:
            out[keys.HEADER_PREFILLER] = prefill.endpoints[0].key
        return out


class DisaggHeadersHandler(PrefillHeaderHandler):
    type_name = "disagg-headers-handler"
