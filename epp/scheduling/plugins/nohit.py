"""``no-hit-lru-scorer`` (llm-d): spread cold requests over the least recently used endpoints.

A request is *cold* when no candidate holds any of its prompt's prefix blocks (read from
the prefix producer's match for this cycle; a prompt shorter than one block is cold too).
Cold requests create the most new KV blocks, so sending each to the endpoint that least
recently received a cold request spreads cache growth evenly.

- Warm request (some candidate has a prefix hit): 0.5 for every candidate — neutral.
- Cold request: candidates that never received a cold request share the first rank,
  then the others follow one rank each, from least to most recently used; with ``g``
  ranks, the candidates at rank ``r`` (0-based) score ``1 − r / (g − 1)`` (1 for all when
  ``g == 1``).
- After the Director's decision, for a cold request the primary profile's endpoint, and
  the ``prefillProfile``'s endpoint when that profile ran, become the most recently used.

Ranks are among the candidates (llm-d ranks by the position in its whole LRU, which can
push every candidate to 0 when the LRU holds endpoints filtered out of this profile).
llm-d ranks never-used candidates one by one in its candidate order — in GIE an order
that follows its datastore's map, so no pod is favoured for long; here the candidate
order is the same on every request, so the first pods would always win a cold start
over a real load difference (GIE's hermetic case "least queue" under this project's
default): they share the top score and the load scorers, or the picker's random
tie-break, decide between them.

``preferFastEndpoints`` (this project's addition, off by default as in llm-d, and off in
the built-in default, why at the end): cold requests rotate only over the candidates whose
mean time per request, as this EPP measured it (from routing to the end of the response;
an exponential average over about the last ten responses from that pod), is at most twice
the fastest candidate's; the others score 0 on a cold request. A group of requests that
share a prefix stays where its first request went, so where a slow pod's share of the
traffic is decided is that first, cold request (issue 17, docs/benchmarks.md "Where the
held-out target stands"). A pod four times slower has no rotation credit until the faster
ones, loaded, take half as long as it does; between equal pods, whose times differ by
their momentary load, nothing changes — the rotation still spreads new prefixes so no
pod's cache grows alone. Until every candidate has a measured time, all rotate. The
average lags by about ten responses, seconds each with long outputs; with 300-token
answers (``epp demo``) cold requests herded onto one pod in some runs, so the built-in
default does not set it.

Parameters: ``prefixPluginName`` (the ``prefix-cache-scorer`` or
``approx-prefix-cache-producer`` to read; default ``prefix-cache-scorer``, falling back to
the only prefix plugin declared), ``prefillProfile`` (``prefill``), ``lruSize`` (1024
endpoints remembered), ``preferFastEndpoints`` (false).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import Plugin
from epp.framework.params import param
from epp.scheduling.plugins.prefix import (
    DURATION_ALPHA,  # the same mean as avoidQueueing's per-pod duration
    ApproxPrefixCacheProducer,
    PrefixCacheScorer,
)
from epp.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult

NEUTRAL = 0.5
SLOW_FACTOR = 2.0  # preferFastEndpoints: slower than this × the fastest gets no cold request


def _plugin_name(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{path}: expected a string, got {v!r}")
    if not v:
        raise ConfigError(f"{path}: must not be empty")
    return v


@dataclass(frozen=True)
class NoHitLRUParameters:
    prefix_plugin_name: str | None = param("prefixPluginName", None, parse=_plugin_name)
    # llm-d v0.10.0's name for it (e.g. a precise-prefix-cache-producer)
    prefix_match_info_producer_name: str | None = param("prefixMatchInfoProducerName", None,
                                                        parse=_plugin_name)
    prefill_profile: str = param("prefillProfile", "prefill")
    lru_size: int = param("lruSize", 1024, minimum=1)
    prefer_fast_endpoints: bool = param("preferFastEndpoints", False)


class NoHitLRUScorer:
    type_name = "no-hit-lru-scorer"
    Parameters = NoHitLRUParameters
    DEFAULT_PREFIX_PLUGIN = "prefix-cache-scorer"
    DEFAULT_PREFILL_PROFILE = "prefill"
    DEFAULT_LRU_SIZE = 1024

    def __init__(self, name: str, prefix_plugin_name: str | None = None,
                 prefill_profile: str = DEFAULT_PREFILL_PROFILE,
                 lru_size: int = DEFAULT_LRU_SIZE, prefer_fast_endpoints: bool = False) -> None:
        self.name = name
        self.prefix_plugin_name = prefix_plugin_name  # None: the default, resolved in bind()
        self.prefill_profile = prefill_profile
        self.lru_size = lru_size
        self._prefix: Plugin | None = None
        # endpoint key -> None, least recently used first
        self._lru: OrderedDict[str, None] = OrderedDict()
        self.prefer_fast_endpoints = prefer_fast_endpoints
        self.duration: dict[str, float] = {}  # endpoint key -> mean ms per request
        self._started = f"{name}/started"
        self.clock = time.monotonic

    @classmethod
    def from_params(cls, name: str, params: NoHitLRUParameters,
                    handle: PluginHandle) -> NoHitLRUScorer:
        return cls(name, params.prefix_plugin_name or params.prefix_match_info_producer_name,
                   params.prefill_profile or cls.DEFAULT_PREFILL_PROFILE, params.lru_size,
                   params.prefer_fast_endpoints)

    def bind(self, handle: PluginHandle) -> None:
        """Find the prefix plugin to read (by name; the default name falls back to the only
        prefix plugin declared). Without one every request counts as cold, as in llm-d."""
        wanted = self.prefix_plugin_name or self.DEFAULT_PREFIX_PLUGIN
        found = handle.get(wanted)
        if found is not None:
            if not isinstance(found, (PrefixCacheScorer, ApproxPrefixCacheProducer)) and not (
                    callable(getattr(found, "match", None))):  # precise-prefix-cache-producer
                raise ConfigError(f"{self.name}: prefixPluginName {wanted!r} is a "
                                  f"{found.type_name}, not a prefix-cache-scorer or "
                                  "approx-prefix-cache-producer")
            self._prefix = found
            return
        if self.prefix_plugin_name is not None:
            raise ConfigError(f"{self.name}: prefixPluginName {wanted!r}: no such plugin; "
                              "declare the prefix-cache-scorer it reads")
        for kind in (PrefixCacheScorer, ApproxPrefixCacheProducer):
            candidates: Sequence[Plugin] = handle.of_type(kind)
            if len(candidates) == 1:
                self._prefix = candidates[0]
                return
            if len(candidates) > 1:
                raise ConfigError(f"{self.name}: several {kind.type_name} plugins; name the one "
                                  "to read with prefixPluginName")

    def _producer(self) -> ApproxPrefixCacheProducer | None:
        p = self._prefix
        if isinstance(p, PrefixCacheScorer):
            return p.producer
        if isinstance(p, ApproxPrefixCacheProducer):
            return p
        if p is not None and callable(getattr(p, "match", None)):
            return p  # type: ignore[return-value]  # duck-typed match() (precise producer)
        return None

    def is_cold(self, state: CycleState, request: LLMRequest,
                endpoints: Sequence[Endpoint]) -> bool:
        """True when no candidate holds any prefix block of the request's prompt."""
        producer = self._producer()
        if producer is None:
            return True
        _, matched = producer.match(state, request, endpoints)
        return not any(n > 0 for n in matched.values())

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        cold = self.is_cold(state, request, endpoints)
        request.plugin_state[self.name] = cold
        n = len(endpoints)
        if not cold:
            return [NEUTRAL] * n
        if n == 1:
            return [1.0]
        ranked: Sequence[int] = range(n)
        if self.prefer_fast_endpoints:
            ranked = self.fast(endpoints)
        lru = self._lru
        never = [i for i in ranked if endpoints[i].key not in lru]
        used = [i for i in ranked if endpoints[i].key in lru]
        if used:
            position = {k: p for p, k in enumerate(lru)}
            used.sort(key=lambda i: position[endpoints[i].key])
        # Never-used candidates share the first rank: ranking them in candidate order
        # would make the list order, not the load, decide a cold start (issue 17).
        groups = ([never] if never else []) + [[i] for i in used]
        out = [0.0] * n  # with preferFastEndpoints, a slow candidate keeps 0
        last = len(groups) - 1
        for rank, group in enumerate(groups):
            for i in group:
                out[i] = 1.0 - rank / last if last else 1.0
        return out

    def fast(self, endpoints: Sequence[Endpoint]) -> Sequence[int]:
        """``preferFastEndpoints``: the indices of the candidates whose mean time per
        request is at most ``SLOW_FACTOR`` times the fastest one's (all of them until
        every candidate has a measured time)."""
        durations = [self.duration.get(e.key) for e in endpoints]
        known = [d for d in durations if d is not None]
        if len(known) < len(durations):
            return range(len(endpoints))
        limit = SLOW_FACTOR * min(known)
        return [i for i, d in enumerate(known) if d <= limit]

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """For a cold request, mark the chosen endpoints as most recently used; with
        ``preferFastEndpoints``, note when any request was routed, and where."""
        if self.prefer_fast_endpoints:
            primary = result.profile_results.get(result.primary_profile)
            if primary is not None and primary.endpoints:
                request.plugin_state[self._started] = (primary.endpoints[0].key, self.clock())
        if not request.plugin_state.pop(self.name, False):
            return
        for profile in (result.primary_profile, self.prefill_profile):
            r = result.profile_results.get(profile)
            if r is not None and r.endpoints:
                self._touch(r.endpoints[0].key)

    def _touch(self, key: str) -> None:
        self._lru[key] = None
        self._lru.move_to_end(key)
        while len(self._lru) > self.lru_size:
            self._lru.popitem(last=False)

    def response_complete(self, request: LLMRequest, endpoint_key: str, aborted: bool) -> None:
        """With ``preferFastEndpoints``: a completed (not aborted) response's duration
        updates its endpoint's mean."""
        if not self.prefer_fast_endpoints:
            return
        started = request.plugin_state.pop(self._started, None)
        if started is None or aborted or started[0] != endpoint_key:
            return
        ms = 1000.0 * (self.clock() - started[1])
        old = self.duration.get(endpoint_key)
        self.duration[endpoint_key] = ms if old is None else old + DURATION_ALPHA * (ms - old)

    def endpoint_removed(self, key: str) -> None:
        self._lru.pop(key, None)
        self.duration.pop(key, None)
