"""Scorers over endpoint metrics. Each returns a score in [0, 1] per endpoint."""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Self

from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters
from epp.scheduling.types import CycleState, Endpoint, LLMRequest


class _NoParams:
    type_name = ""
    Parameters = NoParameters

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters, handle: PluginHandle) -> Self:
        return cls(name)


class QueueScorer(_NoParams):
    """(max − q) / (max − min) over the candidates' waiting queues; 1 for all when equal."""

    type_name = "queue-scorer"
    consumes = MappingProxyType({fw.DATA_KEY_WAITING_QUEUE_SIZE: "int"})

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        queues = [e.metrics.waiting_queue_size for e in endpoints]
        lo, hi = min(queues), max(queues)
        if hi == lo:
            return [1.0] * len(queues)
        span = hi - lo
        return [(hi - q) / span for q in queues]


class KVCacheUtilizationScorer(_NoParams):
    """1 − KV-cache usage (usage in 0..1; endpoints never scraped count as empty)."""

    type_name = "kv-cache-utilization-scorer"
    consumes = MappingProxyType({fw.DATA_KEY_KV_CACHE_USAGE_PERCENT: "float64"})

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        out = []
        for e in endpoints:
            u = e.metrics.kv_cache_usage
            out.append(1.0 - (0.0 if u < 0.0 else min(u, 1.0)))
        return out


class RunningRequestsSizeScorer(_NoParams):
    """Fewer running requests scores higher: (max − r) / (max − min) over the candidates'
    running-request counts (GIE / llm-d ``running-requests-size-scorer``); 1 for all when
    they are equal. Normalized like :class:`QueueScorer`: relative to this cycle's
    candidates, and endpoints never scraped count as 0 running."""

    type_name = "running-requests-size-scorer"
    consumes = MappingProxyType({fw.DATA_KEY_RUNNING_REQUESTS_SIZE: "int"})

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        running = [e.metrics.running_requests for e in endpoints]
        lo, hi = min(running), max(running)
        if hi == lo:
            return [1.0] * len(running)
        span = hi - lo
        return [(hi - r) / span for r in running]
