"""``prefix-cache-affinity-filter`` (GIE): narrow the candidates to the "sticky" ones —
those holding at least ``affinityThreshold`` of the prompt in their prefix cache.

Per request: with probability ``explorationProbability`` keep every candidate
(exploration); otherwise an endpoint is sticky when matched / total prompt blocks (the
``approx-prefix-cache-producer``'s index, the same ratio ``prefix-cache-scorer`` gives) is
``>= affinityThreshold``. No sticky endpoint, one candidate or less, or a threshold <= 0:
every candidate stays. As in GIE, stickiness is broken (every candidate stays) when the
best sticky endpoint's predicted TTFT exceeds the best other one's by more than
``maxTTFTPenaltyMs`` (> 0). The predictions are the ``predicted-latency-producer``'s (or
``predicted-latency-scorer``'s) for this request; a group without any prediction counts
as infinitely slow, as GIE's ``bestTTFT`` does — so without a predictor configured the gate
never breaks.

The filter reads the config's ``approx-prefix-cache-producer`` (the one declared, or the
one ``prefix-cache-scorer`` creates); without any producer nothing is sticky. Declared
twice with different thresholds it gives GIE's two-gate pattern (0.99 before the SLO tier
filter, 0.80 after).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, param
from epp.latency.types import LatencyPredictionInfo, prediction_infos
from epp.scheduling.plugins.prefix import ApproxPrefixCacheProducer
from epp.scheduling.types import CycleState, Endpoint, LLMRequest


@dataclass(frozen=True)
class PrefixCacheAffinityParameters:
    affinity_threshold: float = param("affinityThreshold", 0.80, maximum=1.0)
    exploration_probability: float = param("explorationProbability", 0.01)
    max_ttft_penalty_ms: float = param("maxTTFTPenaltyMs", 5000.0)

    def __post_init__(self) -> None:
        if not 0.0 <= self.exploration_probability <= 1.0:
            raise ParameterError("explorationProbability",
                                 f"must be in [0, 1], got {self.exploration_probability:g}")
        if self.max_ttft_penalty_ms < 0:
            raise ParameterError("maxTTFTPenaltyMs",
                                 f"must be >= 0, got {self.max_ttft_penalty_ms:g}")


class PrefixCacheAffinityFilter:
    type_name = "prefix-cache-affinity-filter"
    consumes = MappingProxyType({
        fw.DATA_KEY_LATENCY_PREDICTION_INFO: "LatencyPredictionInfo",
        fw.DATA_KEY_PREFIX_CACHE_MATCH_INFO: "PrefixCacheMatchInfo"})
    Parameters = PrefixCacheAffinityParameters

    def __init__(self, name: str, affinity_threshold: float = 0.80,
                 exploration_probability: float = 0.01, max_ttft_penalty_ms: float = 5000.0,
                 rng: random.Random | None = None) -> None:
        self.name = name
        self.affinity_threshold = affinity_threshold
        self.exploration_probability = exploration_probability
        self.max_ttft_penalty_ms = max_ttft_penalty_ms
        self._rng = rng or random.Random()
        self._handle: PluginHandle | None = None
        self.producer: ApproxPrefixCacheProducer | None = None

    @classmethod
    def from_params(cls, name: str, params: PrefixCacheAffinityParameters,
                    handle: PluginHandle) -> PrefixCacheAffinityFilter:
        return cls(name, params.affinity_threshold, params.exploration_probability,
                   params.max_ttft_penalty_ms)

    def bind(self, handle: PluginHandle) -> None:
        # The producer may be created by a prefix-cache-scorer bound after this filter:
        # look it up at the first request.
        self._handle = handle

    def _producer(self) -> ApproxPrefixCacheProducer | None:
        if self.producer is None and self._handle is not None:
            found = self._handle.of_type(ApproxPrefixCacheProducer)
            self.producer = found[0] if found else None
        return self.producer

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        if len(endpoints) <= 1 or self.affinity_threshold <= 0:
            return endpoints
        if self._rng.random() < self.exploration_probability:
            return endpoints
        producer = self._producer()
        if producer is None:
            return endpoints
        total, matched = producer.match(state, request, endpoints)
        if not total:
            return endpoints
        sticky = [e for e in endpoints
                  if matched.get(e.key, 0) / total >= self.affinity_threshold]
        if not sticky:
            return endpoints
        if self.max_ttft_penalty_ms > 0 and len(sticky) < len(endpoints):
            infos = prediction_infos(request)
            if infos:
                sticky_keys = {e.key for e in sticky}
                others = [e for e in endpoints if e.key not in sticky_keys]
                penalty = _best_ttft(infos, sticky) - _best_ttft(infos, others)
                if penalty > self.max_ttft_penalty_ms:  # the sticky ones are too slow
                    return endpoints
        return sticky


def _best_ttft(infos: Mapping[str, LatencyPredictionInfo],
               endpoints: Sequence[Endpoint]) -> float:
    """The lowest predicted TTFT (ms) among ``endpoints``; +inf when none has one (GIE
    uses the largest float there: a gap between two unpredicted groups is 0)."""
    best = math.inf
    for e in endpoints:
        info = infos.get(e.key)
        if info is not None and info.ttft < best:
            best = info.ttft
    return best
