"""``slo-headroom-tier-filter`` (GIE v1.5.0
pkg/epp/framework/plugins/scheduling/filter/sloheadroomtier): keeps one headroom tier of
the candidates, from the ``LatencyPredictionInfo`` the ``predicted-latency-producer``
publishes.

An endpoint is in the positive tier when its TTFT and TPOT headroom (SLO − predicted) are
both >= 0, else in the negative tier; an endpoint without a prediction counts as negative
(its SLO cannot be confirmed). No prediction at all, or one candidate or less: every
candidate stays. Both tiers present: the negative tier with probability
``epsilonExploreNeg`` (default 0.01, in [0, 1] — so endpoints recovering from overload
still get some traffic and their state is re-evaluated), else the positive tier. One tier
only: that tier. Validity flags are not read: an invalid prediction has negative
headroom. Without SLO headers every headroom is negative and the filter keeps everything.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, param
from epp.latency.types import prediction_infos
from epp.scheduling.plugins.latency_common import CONSUMES_LATENCY
from epp.scheduling.types import CycleState, Endpoint, LLMRequest


@dataclass(frozen=True)
class SloHeadroomTierParameters:
    epsilon_explore_neg: float = param("epsilonExploreNeg", 0.01)

    def __post_init__(self) -> None:
        if not 0.0 <= self.epsilon_explore_neg <= 1.0:
            raise ParameterError("epsilonExploreNeg",
                                 f"must be in [0, 1], got {self.epsilon_explore_neg:g}")


class SloHeadroomTierFilter:
    type_name = "slo-headroom-tier-filter"
    Parameters = SloHeadroomTierParameters
    consumes = MappingProxyType(CONSUMES_LATENCY)

    def __init__(self, name: str, epsilon_explore_neg: float = 0.01,
                 rng: random.Random | None = None) -> None:
        self.name = name
        self.epsilon_explore_neg = epsilon_explore_neg
        self._rng = rng or random.Random()

    @classmethod
    def from_params(cls, name: str, params: SloHeadroomTierParameters,
                    handle: PluginHandle) -> SloHeadroomTierFilter:
        return cls(name, params.epsilon_explore_neg)

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        if len(endpoints) <= 1:
            return endpoints
        infos = prediction_infos(request)
        positive: list[Endpoint] = []
        negative: list[Endpoint] = []
        unknown: list[Endpoint] = []
        for e in endpoints:
            info = infos.get(e.key)
            if info is None:
                unknown.append(e)
            elif info.ttft_headroom >= 0 and info.tpot_headroom >= 0:
                positive.append(e)
            else:
                negative.append(e)
        if not positive and not negative:
            return endpoints
        negative.extend(unknown)
        if positive and negative:
            return negative if self._rng.random() < self.epsilon_explore_neg else positive
        return positive or negative
