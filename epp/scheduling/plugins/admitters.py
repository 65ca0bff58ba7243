"""``probabilistic-admitter`` (llm-d-router v0.10.0
pkg/epp/framework/plugins/requestcontrol/admitter/probabilisticadmitter): sheds sheddable
requests with a probability that grows steeply with the candidates' saturation.

Requests with priority >= 0 are always admitted, and so is any request when there are no
candidates. For a sheddable one (priority < 0) the saturation is the mean over the
candidates of ``max(waiting queue / queueDepthThreshold, KV-cache use /
kvCacheUtilThreshold)``, and the request is refused with probability
``min(saturation^power · k, 1)``: with the defaults (5, 0.8, 5, 300) about 2.3 % at 0.15
and all of them from about 0.34. A refusal answers 429 (llm-d's ResourceExhausted), not
the 500 GIE's admission plugins answer.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from epp.errors import NoCapacity
from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, param
from epp.scheduling.types import Endpoint, LLMRequest


@dataclass(frozen=True)
class ProbabilisticAdmitterParameters:
    queue_depth_threshold: int = param("queueDepthThreshold", 5)
    kv_cache_util_threshold: float = param("kvCacheUtilThreshold", 0.8)
    power: float = param("power", 5.0)
    k: float = param("k", 300.0)

    def __post_init__(self) -> None:
        if self.queue_depth_threshold <= 0:
            raise ParameterError("queueDepthThreshold",
                                 f"must be > 0, got {self.queue_depth_threshold}")
        if self.kv_cache_util_threshold <= 0:
            raise ParameterError("kvCacheUtilThreshold",
                                 f"must be > 0, got {self.kv_cache_util_threshold:g}")
        if self.power <= 0:
            raise ParameterError("power", f"must be > 0, got {self.power:g}")
        if self.k <= 0:
            raise ParameterError("k", f"must be > 0, got {self.k:g}")


class ProbabilisticAdmitter:
    type_name = "probabilistic-admitter"
    Parameters = ProbabilisticAdmitterParameters

    def __init__(self, name: str = type_name,
                 params: ProbabilisticAdmitterParameters | None = None,
                 rand: Callable[[], float] = random.random) -> None:
        p = params or ProbabilisticAdmitterParameters()
        self.name = name
        self.queue_depth_threshold = float(p.queue_depth_threshold)
        self.kv_cache_util_threshold = p.kv_cache_util_threshold
        self.power = p.power
        self.k = p.k
        #: Uniform in [0, 1) (llm-d's randFn; tests pass a seeded generator's).
        self.rand = rand

    @classmethod
    def from_params(cls, name: str, params: ProbabilisticAdmitterParameters,
                    handle: PluginHandle) -> ProbabilisticAdmitter:
        return cls(name, params)

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        """The mean over ``endpoints`` of max(queue ratio, KV-cache ratio)."""
        total = 0.0
        for e in endpoints:
            m = e.metrics
            total += max(m.waiting_queue_size / self.queue_depth_threshold,
                         m.kv_cache_usage / self.kv_cache_util_threshold)
        return total / len(endpoints)

    def shed_probability(self, saturation: float) -> float:
        return min(float(saturation ** self.power) * self.k, 1.0)

    def admit_request(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> str | None:
        if request.priority >= 0 or not endpoints:
            return None
        saturation = self.saturation(endpoints)
        prob = self.shed_probability(saturation)
        if self.rand() < prob:
            # 429, as llm-d's ResourceExhausted (a returned reason would answer 500).
            raise NoCapacity(f"probabilistic-admitter: rejected, "
                             f"saturation={saturation:.3f} prob={prob:.2f}")
        return None
