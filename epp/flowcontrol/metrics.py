"""The flow-control metrics, with GIE v1.5.0's names, help texts, labels and buckets
(pkg/epp/metrics/metrics.go, "Flow Control Metrics"), recorded where GIE records them:

======================================================================  =========  ===========================================
metric                                                                  type       labels / when
======================================================================  =========  ===========================================
``inference_extension_flow_control_request_queue_duration_seconds``    histogram  fairness_id, priority, outcome,
                                                                                   inference_pool, model_name,
                                                                                   target_model_name — when a request's
                                                                                   outcome is final (enqueue → outcome)
``inference_extension_flow_control_dispatch_cycle_duration_seconds``   histogram  — every dispatch cycle
``inference_extension_flow_control_request_enqueue_duration_seconds``  histogram  fairness_id, priority, outcome — the
                                                                                   capacity check and queue insertion;
                                                                                   outcome ``NotYetFinalized`` once queued
``inference_extension_flow_control_queue_size``                        gauge      fairness_id, priority, inference_pool,
                                                                                   model_name, target_model_name —
                                                                                   requests waiting in flow control
``inference_extension_flow_control_queue_bytes``                       gauge      same labels — their bytes
``inference_extension_flow_control_pool_saturation``                   gauge      inference_pool — every dispatch cycle
======================================================================  =========  ===========================================

GIE raises the two gauges for the whole ``EnqueueAndWait`` call; here they count a
request from when it is queued until its outcome. On the one event loop a request that
is rejected or dispatched at once is never seen by a scrape in between, so the series
read the same while costing nothing on that path.

:class:`FlowControlMetrics` registers the six on the ``CollectorRegistry`` it is given (the
EPP's, ``EppMetrics.registry``) and caches labelled children, as
epp/observability/metrics.py does (``labels()`` costs about a microsecond). Create it when
flow control is on (the feature gate): GIE registers the six always, but its vectors
expose no series until recorded, while the label-less cycle histogram here would expose
a zero count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from prometheus_client import CollectorRegistry, Gauge, Histogram

QUEUE_DURATION_BUCKETS: Final = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CYCLE_BUCKETS: Final = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
ENQUEUE_BUCKETS: Final = CYCLE_BUCKETS

_FLOW_LABELS: Final = ("fairness_id", "priority", "inference_pool", "model_name",
                       "target_model_name")

# Distinct label sets cached before the caches are dropped (fairness IDs are client
# supplied; the Prometheus series themselves are as unbounded as in GIE).
_MAX_CACHED: Final = 10_000


def _alpha(text: str) -> str:
    return f"[ALPHA] {text}"


class FlowLabels:
    """The labelled children one flow (fairness ID, priority, model, target model)
    records into."""

    __slots__ = ("bytes", "durations", "enqueue", "size")

    def __init__(self, size: Gauge, bytes_: Gauge, durations: dict[str, Histogram],
                 enqueue: dict[str, Histogram]) -> None:
        self.size = size
        self.bytes = bytes_
        self.durations = durations
        self.enqueue = enqueue


class FlowControlMetrics:
    """GIE's six flow-control series on ``registry`` (a fresh one when None)."""

    def __init__(self, registry: CollectorRegistry | None = None, pool_name: str = "") -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.pool_name = pool_name
        self.request_queue_duration = Histogram(
            "inference_extension_flow_control_request_queue_duration_seconds",
            _alpha("Distribution of total time requests spend in the Flow Control layer "
                   "(from enqueue to final outcome)."),
            ["fairness_id", "priority", "outcome", "inference_pool", "model_name",
             "target_model_name"], buckets=QUEUE_DURATION_BUCKETS, registry=r)
        self.dispatch_cycle_duration = Histogram(
            "inference_extension_flow_control_dispatch_cycle_duration_seconds",
            _alpha("Distribution of time taken for each internal dispatch cycle in the Flow "
                   "Control layer."), buckets=CYCLE_BUCKETS, registry=r)
        self.request_enqueue_duration = Histogram(
            "inference_extension_flow_control_request_enqueue_duration_seconds",
            _alpha("Distribution of time taken to enqueue requests into the Flow Control "
                   "layer."), ["fairness_id", "priority", "outcome"],
            buckets=ENQUEUE_BUCKETS, registry=r)
        self.queue_size = Gauge(
            "inference_extension_flow_control_queue_size",
            _alpha("Current number of requests actively held in the Flow Control queue."),
            list(_FLOW_LABELS), registry=r)
        self.queue_bytes = Gauge(
            "inference_extension_flow_control_queue_bytes",
            _alpha("Current total size in bytes of requests actively held in the Flow "
                   "Control queue."), list(_FLOW_LABELS), registry=r)
        self.pool_saturation = Gauge(
            "inference_extension_flow_control_pool_saturation",
            _alpha("Current saturation level of the inference pool (0.0 = empty, 1.0 = fully "
                   "saturated)."), ["inference_pool"], registry=r)
        self._flows: dict[tuple[str, int, str, str], FlowLabels] = {}
        # Created on first use: like GIE's, no series exists until flow control records.
        self._pool_child: Gauge | None = None
        self._last_saturation: float | None = None

    def flow(self, fairness_id: str, priority: int, model: str, target: str) -> FlowLabels:
        """The cached children of one flow's label set."""
        key = (fairness_id, priority, model, target)
        labels = self._flows.get(key)
        if labels is None:
            if len(self._flows) >= _MAX_CACHED:
                self._flows.clear()
            labels = self._flows[key] = self._new_flow(*key)
        return labels

    def _new_flow(self, fairness_id: str, priority: int, model: str,
                  target: str) -> FlowLabels:
        prio = str(priority)
        pool = self.pool_name
        duration = self.request_queue_duration
        enqueue = self.request_enqueue_duration
        return FlowLabels(
            self.queue_size.labels(fairness_id, prio, pool, model, target),
            self.queue_bytes.labels(fairness_id, prio, pool, model, target),
            _LazyChildren(lambda o: duration.labels(fairness_id, prio, o, pool, model, target)),
            _LazyChildren(lambda o: enqueue.labels(fairness_id, prio, o)),
        )

    def set_pool_saturation(self, saturation: float) -> None:
        if saturation != self._last_saturation:  # the gauge already reads it otherwise
            self._last_saturation = saturation
            child = self._pool_child
            if child is None:
                child = self._pool_child = self.pool_saturation.labels(self.pool_name)
            child.set(saturation)

    def observe_cycle(self, seconds: float) -> None:
        self.dispatch_cycle_duration.observe(seconds)


class _LazyChildren(dict[str, Histogram]):
    """A histogram's children per outcome label (``QueueOutcome.value``), each created on
    first use."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[str], Histogram]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, outcome: str) -> Histogram:
        child = self[outcome] = self._make(outcome)
        return child
