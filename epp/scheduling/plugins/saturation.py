"""``utilization-detector``: GIE's saturation detector, usable two ways.

As the config's ``saturationDetector: {pluginRef: …}`` — :meth:`is_saturated` is True
when no endpoint has good capacity (GIE v1's rule), i.e. every endpoint is saturated:
an endpoint has good capacity when its metrics are fresh, its waiting queue is
``<= queueDepthThreshold`` and its KV-cache usage ``<= kvCacheUtilThreshold``. No
endpoints → saturated. :meth:`saturation` gives GIE's continuous signal, the average over
endpoints of ``max(queue / queueDepthThreshold, kv / kvCacheUtilThreshold)`` (stale = 1).

As a filter in a profile — drops endpoints that are stale or at/over the limits
``queue < queueDepthThreshold × (1 + headroom)`` and ``kv < kvCacheUtilThreshold ×
(1 + headroom)`` fail; if that would drop every endpoint it keeps them all (GIE's
fail-open: the scorers then pick the least bad one rather than failing the request).

Metrics are stale when the scraper marked them so, when they were never scraped, or when
the last scrape is older than ``metricsStalenessThreshold``. The datastore refreshes the
scrape stamp at its freshness resolution (100 ms at the scraper's defaults), so keep the
threshold well above that.

Parameters (GIE's): ``queueDepthThreshold`` (5, > 0), ``kvCacheUtilThreshold`` (0.8, in
(0, 1]), ``metricsStalenessThreshold`` (``200ms``, > 0), ``headroom`` (0.0, >= 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import param, positive_duration
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

if TYPE_CHECKING:
    from epp.observability.metrics import EppMetrics

DEFAULT_QUEUE_DEPTH = 5
DEFAULT_KV_UTIL = 0.8
DEFAULT_STALENESS = 0.2
DEFAULT_HEADROOM = 0.0


def _kv_threshold(v: Any, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{path}: expected a number, got {v!r}")
    if v > 1.0:
        raise ConfigError(f"{path}: must be <= 1.0, got {v}")
    if not v > 0:
        raise ConfigError(f"{path}: must be in (0, 1], got {v:g}")
    return float(v)


@dataclass(frozen=True)
class UtilizationDetectorParameters:
    queue_depth_threshold: int = param("queueDepthThreshold", DEFAULT_QUEUE_DEPTH, minimum=1)
    kv_cache_util_threshold: float = param("kvCacheUtilThreshold", DEFAULT_KV_UTIL,
                                           parse=_kv_threshold)
    metrics_staleness_threshold: float = param("metricsStalenessThreshold", DEFAULT_STALENESS,
                                               parse=positive_duration)
    headroom: float = param("headroom", DEFAULT_HEADROOM, minimum=0.0)


class UtilizationDetector:
    type_name = "utilization-detector"
    Parameters = UtilizationDetectorParameters
    DEFAULT_QUEUE_DEPTH = DEFAULT_QUEUE_DEPTH
    DEFAULT_KV_UTIL = DEFAULT_KV_UTIL
    DEFAULT_STALENESS = DEFAULT_STALENESS
    DEFAULT_HEADROOM = DEFAULT_HEADROOM

    def __init__(self, name: str, queue_depth_threshold: int = DEFAULT_QUEUE_DEPTH,
                 kv_cache_util_threshold: float = DEFAULT_KV_UTIL,
                 metrics_staleness_threshold: float = DEFAULT_STALENESS,
                 headroom: float = DEFAULT_HEADROOM,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.queue_depth_threshold = queue_depth_threshold
        self.kv_cache_util_threshold = kv_cache_util_threshold
        self.metrics_staleness_threshold = metrics_staleness_threshold
        self.headroom = headroom
        self._clock = clock
        self._metrics: EppMetrics | None = None

    @classmethod
    def from_params(cls, name: str, params: UtilizationDetectorParameters,
                    handle: PluginHandle) -> UtilizationDetector:
        return cls(name, params.queue_depth_threshold, params.kv_cache_util_threshold,
                   params.metrics_staleness_threshold, params.headroom)

    def bind_metrics(self, metrics: EppMetrics) -> None:
        """Report the stale endpoints of each :meth:`saturation` (llm-d's
        ``llm_d_epp_flow_control_stale_endpoints{detector}``)."""
        self._metrics = metrics

    def _stale(self, e: Endpoint, now: float) -> bool:
        return e.metrics.is_stale(now, self.metrics_staleness_threshold)

    # --- SaturationDetector ---

    def has_capacity(self, e: Endpoint, now: float | None = None) -> bool:
        """Fresh metrics, queue <= queueDepthThreshold and KV usage <= kvCacheUtilThreshold."""
        if self._stale(e, self._clock() if now is None else now):
            return False
        m = e.metrics
        return (m.waiting_queue_size <= self.queue_depth_threshold
                and m.kv_cache_usage <= self.kv_cache_util_threshold)

    def is_saturated(self, endpoints: Sequence[Endpoint]) -> bool:
        """True when no endpoint has capacity (every one is saturated, or there are none)."""
        now = self._clock()
        return not any(self.has_capacity(e, now) for e in endpoints)

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        """GIE's pool saturation gradient: mean per-endpoint roofline score; 1.0 if empty.
        Bound to metrics, it records how many endpoints scored 1.0 for stale metrics (0
        for none), as llm-d's detector does at every evaluation."""
        if not endpoints:
            if self._metrics is not None:
                self._metrics.record_stale_endpoints(self.name, 0)
            return 1.0
        now = self._clock()
        total = 0.0
        stale = 0
        for e in endpoints:
            if self._stale(e, now):
                total += 1.0
                stale += 1
                continue
            m = e.metrics
            total += max(m.waiting_queue_size / self.queue_depth_threshold,
                         m.kv_cache_usage / self.kv_cache_util_threshold)
        if self._metrics is not None:
            self._metrics.record_stale_endpoints(self.name, stale)
        return total / len(endpoints)

    # --- Filter ---

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        q_limit = self.queue_depth_threshold * (1.0 + self.headroom)
        kv_limit = self.kv_cache_util_threshold * (1.0 + self.headroom)
        now = self._clock()
        kept = [e for e in endpoints
                if not self._stale(e, now)
                and e.metrics.waiting_queue_size < q_limit
                and e.metrics.kv_cache_usage < kv_limit]
        return kept if kept else endpoints
