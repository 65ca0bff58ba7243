"""Prometheus metrics with GIE's names (design.md §8), on a registry owned by the server.

GIE v1.5.0's EPP defines 37 metrics (pkg/epp/metrics/metrics.go and
pkg/epp/metrics/collectors/inference_pool.go); :class:`EppMetrics` registers the ones this
EPP can record with GIE's names, types, help texts, label names and buckets, plus the
project's own (``epp_`` prefix). docs/observability.md lists which GIE metrics are not
exported and why; GIE's flow-control series are registered by :meth:`EppMetrics.flow_control`
when flow control is on.

No module-level registry: each :class:`EppMetrics` owns a ``CollectorRegistry``, so tests
and several servers in one process do not collide. Pool-level gauges are computed from the
datastore when scraped, costing nothing per request. Request metrics are recorded by
:class:`MetricsObserver`, the scheduling core's always-on decision observer, which caches
the labelled children it uses (``labels()`` costs about a microsecond; a dict hit a tenth).

llm-d-router v0.10.0's 67 ``llm_d_epp_*`` metrics are exported too (docs/metrics.md is
the inventory): twins with the GIE series' label names are re-exposed from them when
scraped (:class:`_Twin`); the request, prefix, latency-predictor and P/D ones are recorded
by the same :class:`MetricsObserver` hooks into :class:`_FastFamily` series (a bisect and
two additions per observation); the rest have ``EppMetrics.record_*`` functions for the
plugins and hooks that record them.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from epp import __version__, keys
from epp.datastore.store import Datastore
from epp.flowcontrol.metrics import FlowControlMetrics
from epp.framework.interfaces import Plugin, PrefixIndexOwner
from epp.latency.types import TYPE_TPOT as LATENCY_TPOT
from epp.latency.types import TYPE_TTFT as LATENCY_TTFT
from epp.latency.types import LatencyOutcome
from epp.observability.observer import Observer, ResponseStats
from epp.parsing.usage import Usage
from epp.scheduling.plugins.roles import endpoint_role
from epp.scheduling.types import Endpoint, LLMRequest, SchedulingResult


def _alpha(text: str) -> str:
    """GIE's help texts carry the metric's stability level (metricsutil.HelpMsgWithStability)."""
    return f"[ALPHA] {text}"


# Buckets, as GIE v1.5.0 defines them (pkg/epp/metrics/metrics.go).
GENERAL_LATENCY_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3,
                           4, 5, 6, 8, 10, 15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480,
                           600, 900, 1200, 1800, 2700, 3600)
TPOT_BUCKETS = (0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.6, 0.8, 1, 1.5, 2, 3, 4.5, 6, 12, 18, 24, 30, 36, 48, 60,
                90, 120, 180, 270, 360)
REQUEST_SIZE_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
                        131072, 262144, 524288, 1048576, 2097152, 4194304, 8388608,
                        16777216, 33554432, 67108864, 134217728, 268435456, 536870912,
                        1073741824)
RESPONSE_SIZE_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                         32778, 65536)
INPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778,
                       65536, 131072, 262144, 524288, 1048576)
OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
# GIE's predictionLatencyBuckets: how long a latency prediction took, 100 µs to 5 s.
PREDICTION_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
                      1.0, 2.0, 5.0)
SCHEDULER_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
HIT_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
HIT_BYTES_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

# The ``priority`` label of inference_objective_request_total is the request's
# LLMRequest.priority: its InferenceObjective's priority, 0 when it names none (GIE's
# Director.getInferenceObjective; epp/datastore/objectives.py).

# scheduler_attempts_total ``status`` values (GIE's SchedulerStatusSuccess / Failure).
SCHEDULER_SUCCESS = "success"
SCHEDULER_FAILURE = "failure"

# inference_objective_inference_request_metric ``type`` values this EPP sets.
# inference_objective_request_error_total's error_code: GIE's canonical error codes
# (pkg/common/error), not HTTP statuses. An error the EPP answered is named by the status
# it answered with; a model-server response that is not a success is ModelServerError
# (GIE means to record that too, but compares the header "status" where Envoy sends
# ":status", so its Go build rarely does).
GIE_ERROR_CODES: Final = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden",
                          404: "NotFound", 413: "BadRequest", 429: "ResourceExhausted",
                          500: "Internal", 503: "ServiceUnavailable"}
ERROR_CODE_UNKNOWN: Final = "Unknown"
ERROR_CODE_MODEL_SERVER: Final = "ModelServerError"


def gie_error_code(status: int) -> str:
    """GIE's error code for an error the EPP answered with HTTP ``status``."""
    return GIE_ERROR_CODES.get(status, ERROR_CODE_UNKNOWN)


TYPE_TTFT = "ttft"
TYPE_TPOT = "tpot"
# … and those the latency-predictor plugins set (GIE's typePredictedTTFT, …).
TYPE_PREDICTED_TTFT = "predicted_ttft"
TYPE_PREDICTED_TPOT = "predicted_tpot"
TYPE_TTFT_PREDICTION_DURATION = "ttft_prediction_duration"
TYPE_TPOT_PREDICTION_DURATION = "tpot_prediction_duration"
TYPE_TTFT_SLO_VIOLATION = "ttft_slo_violation"
TYPE_TPOT_SLO_VIOLATION = "tpot_slo_violation"

_M = TypeVar("_M", Counter, Gauge, Histogram)


class _Children(Generic[_M]):
    """A labelled metric's children, cached by label values (``labels()`` is not free)."""

    __slots__ = ("_cache", "_metric")

    def __init__(self, metric: _M) -> None:
        self._metric: _M = metric
        self._cache: dict[tuple[str, ...], _M] = {}

    def get(self, *values: str) -> _M:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._metric.labels(*values)
        return child


# ------------------------------------------------------------------ llm-d-router v0.10.0
#
# llm-d-router v0.10.0 exports every EPP metric under the ``llm_d_epp_`` subsystem
# (pkg/epp/metrics/llm_d_router_metrics.go, grpc_stream_metrics.go and the plugins'
# metrics.go files; docs/metrics.md lists all 67 with their Go sources). Where a GIE metric
# has an llm-d twin with the same label names, the twin is re-exposed from the GIE series
# when scraped (:class:`_Twin`: no per-request cost, the same values Go's dual emission
# records); twins with more labels (fairness_id, priority, plugin identity) are recorded
# beside their GIE series, through one cached child lookup each.

LLMD_SUBSYSTEM: Final = "llm_d_epp"
LLMD_TTFT_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5,
                     6, 8, 10, 15, 20, 30, 45, 60, 120)
LLMD_STREAMING_TPOT_BUCKETS = (0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125,
                               0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1, 2)
LLMD_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1, 2)
LLMD_REQUEST_PROCESSING_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.04, 0.06,
                                   0.1, 0.25, 0.5, 1, 2.5, 5, 10)
LLMD_RESPONSE_PROCESSING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                    0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
EXTPROC_STREAM_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600)
REVOCATION_CONFIRMATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# llm-d's request label set (modelLabelsWithFairnessPriority).
LLMD_REQUEST_LABELS: Final = ("model_name", "target_model_name", "fairness_id", "priority")
_PLUGIN_MODEL: Final = ("plugin_name", "plugin_type", "model_name", "target_model_name")

# llm-d's label caps (pkg/epp/metrics/cardinality.go): model and target model names share
# 1000 distinct values, fairness IDs 1000; later new values are reported as "other".
LABEL_CAP: Final = 1000
LABEL_OVERFLOW: Final = "other"

# disagg_decision_total / pd_decision_total ``decision_type`` values (llm-d's disagg
# metrics.go) and the ``model_name`` of a request without a target model.
DECISION_DECODE_ONLY: Final = "decode-only"
DECISION_PREFILL_DECODE: Final = "prefill-decode"
DECISION_ENCODE_DECODE: Final = "encode-decode"
DECISION_ENCODE_PREFILL_DECODE: Final = "encode-prefill-decode"
DECISION_UNKNOWN_MODEL: Final = "unknown"
PD_HANDLER_TYPE: Final = "pd-profile-handler"  # records pd_decision_total (deprecated)
DISAGG_HANDLER_TYPE: Final = "disagg-profile-handler"  # records disagg_decision_total

# flow_control_revocations_total ``outcome`` values (RevocationOutcome*).
REVOCATION_CONFIRMED: Final = "confirmed"
REVOCATION_TIMED_OUT: Final = "timed_out"

# Plugin types whose identity labels the llm-d twins they cause (bind_plugins).
_LATENCY_PLUGIN_TYPES: Final = ("predicted-latency-producer", "predicted-latency-scorer")
_PROGRAM_AWARE_TYPE: Final = "program-aware-fairness"

# Distinct label sets cached before a cache is dropped (client-chosen values).
_MAX_CACHED: Final = 10_000


class _FastChild:
    """One labelled series of a :class:`_FastFamily`: a value (counter, gauge) or bucket
    counts and a sum (histogram). Plain attribute updates, no lock: the EPP records and
    serves ``/metrics`` on one event loop (a scrape in another thread may see a sum one
    observation ahead of its counts, as with any lock-free read)."""

    __slots__ = ("bounds", "counts", "sum", "value")

    def __init__(self, bounds: tuple[float, ...], histogram: bool) -> None:
        self.value = 0.0
        self.sum = 0.0
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1) if histogram else []

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value

    def observe(self, amount: float) -> None:
        # bounds are upper-inclusive (Prometheus ``le``): the first bound >= amount.
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class _FastFamily(Collector):
    """A labelled counter, gauge or histogram exposed like prometheus_client's, recorded
    at a fraction of its cost (an observation is a bisect and two additions, against about
    a microsecond for prometheus_client's locked child): the llm-d request series, which
    every request records beside their GIE twins. ``labels()`` returns the child to cache."""

    def __init__(self, name: str, help_text: str, kind: str, labelnames: Sequence[str],
                 registry: CollectorRegistry, buckets: Sequence[float] | None = None) -> None:
        self.name = name.removesuffix("_total") if kind == "counter" else name
        self.help = help_text
        self.kind = kind
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets or ())
        self._les = [_go_float(b) for b in self.bounds] + ["+Inf"]
        self._children: dict[tuple[str, ...], _FastChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _FastChild:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, "
                             f"got {len(values)}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _FastChild(self.bounds, self.kind == "histogram")
        return child

    def remove(self, *values: str) -> None:
        self._children.pop(tuple(values), None)

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.help, self.kind)]

    def collect(self) -> Iterable[Metric]:
        labels = list(self.labelnames)
        children = list(self._children.items())
        if self.kind == "histogram":
            h = HistogramMetricFamily(self.name, self.help, labels=labels)
            for values, c in children:
                acc = 0
                buckets = []
                for le, n in zip(self._les, c.counts, strict=True):
                    acc += n
                    buckets.append((le, float(acc)))
                h.add_metric(list(values), buckets, c.sum)
            return [h]
        fam = (CounterMetricFamily(self.name, self.help, labels=labels)
               if self.kind == "counter" else GaugeMetricFamily(self.name, self.help,
                                                                 labels=labels))
        for values, c in children:
            fam.add_metric(list(values), c.value)
        return [fam]


# prometheus_client's ``le`` formatting (untyped there).
_go_float: Callable[[float], str] = floatToGoString


def _fast_counter(name: str, documentation: str, labelnames: Sequence[str], *,
                  registry: CollectorRegistry) -> _FastFamily:
    return _FastFamily(name, documentation, "counter", labelnames, registry)


def _fast_gauge(name: str, documentation: str, labelnames: Sequence[str], *,
                registry: CollectorRegistry) -> _FastFamily:
    return _FastFamily(name, documentation, "gauge", labelnames, registry)


def _fast_histogram(name: str, documentation: str, labelnames: Sequence[str], *,
                    buckets: Sequence[float], registry: CollectorRegistry) -> _FastFamily:
    return _FastFamily(name, documentation, "histogram", labelnames, registry, buckets)


class LabelBounds:
    """llm-d's caps on client-derived label values (boundModels, boundFairnessID): the
    first 1000 distinct values of each kind pass, later new ones read ``other``; the empty
    string always passes. Consulted only when a new label set is first cached."""

    __slots__ = ("fairness", "models")

    def __init__(self, cap: int = LABEL_CAP) -> None:
        self.models = _Bound(cap)
        self.fairness = _Bound(cap)

    def request(self, key: tuple[str, str, str | None, int]) -> tuple[str, str, str, str]:
        """The llm-d label values of a request key (model, target, fairness ID, priority)."""
        model, target, fairness, priority = key
        return (self.models(model), self.models(target),
                self.fairness(fairness or keys.DEFAULT_FAIRNESS_ID), str(priority))


class _Bound:
    __slots__ = ("_cap", "_seen")

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if not value or value in self._seen:
            return value
        if len(self._seen) >= self._cap:
            return LABEL_OVERFLOW
        self._seen.add(value)
        return value


class _RequestChildren:
    """An llm-d request metric's children by request key (model, target, fairness ID,
    priority) plus any extra label value; label values bounded on first use."""

    __slots__ = ("_bounds", "_cache", "_metric")

    def __init__(self, metric: _FastFamily, bounds: LabelBounds) -> None:
        self._metric = metric
        self._bounds = bounds
        self._cache: dict[tuple[Any, ...], _FastChild] = {}

    def get(self, key: tuple[str, str, str | None, int]) -> _FastChild:
        child = self._cache.get(key)
        if child is None:
            if len(self._cache) >= _MAX_CACHED:
                self._cache.clear()
            child = self._cache[key] = self._metric.labels(*self._bounds.request(key))
        return child

    def get_with(self, key: tuple[str, str, str | None, int], extra: str) -> _FastChild:
        k = (*key, extra)
        child = self._cache.get(k)
        if child is None:
            if len(self._cache) >= _MAX_CACHED:
                self._cache.clear()
            child = self._cache[k] = self._metric.labels(*self._bounds.request(key), extra)
        return child


class _Twin(Collector):
    """An llm-d name for a GIE series with the same label names (``rename``: llm-d's name
    for a renamed label, e.g. ``pod_name`` → ``endpoint_name``): the GIE metric's samples,
    renamed when scraped. Go records both in the same function, so they always agree."""

    def __init__(self, source: Counter | Gauge | Histogram, name: str, help_text: str,
                 kind: str, rename: Mapping[str, str] | None = None) -> None:
        self._source = source
        self._name = name
        self._help = _alpha(help_text)
        self._kind = kind
        self._rename = dict(rename or {})

    def describe(self) -> Iterable[Metric]:
        return [Metric(self._name, self._help, self._kind)]

    def collect(self) -> Iterable[Metric]:
        out = []
        rename = self._rename
        for fam in self._source.collect():
            twin = Metric(self._name, self._help, self._kind)
            cut = len(fam.name)
            for s in fam.samples:
                labels = ({rename.get(k, k): v for k, v in s.labels.items()} if rename
                          else s.labels)
                twin.samples.append(s._replace(name=self._name + s.name[cut:], labels=labels))
            out.append(twin)
        return out


class _FlowRequestsCollector(Collector):
    """``llm_d_epp_flow_control_requests_total{outcome, priority, inference_pool}``: each
    request's terminal flow-control outcome, read when scraped from the queue-duration
    histogram's counts (the controller observes it exactly once per request, at the same
    point Go increments this counter), summed over the other labels."""

    NAME: Final = "llm_d_epp_flow_control_requests"

    def __init__(self, fc: FlowControlMetrics) -> None:
        self._fc = fc

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(self.NAME, _HELP_FC_REQUESTS, labels=_FC_REQUESTS_LABELS)]

    def collect(self) -> Iterable[Metric]:
        totals: dict[tuple[str, str, str], float] = {}
        for fam in self._fc.request_queue_duration.collect():
            for s in fam.samples:
                if s.name.endswith("_count"):
                    lab = s.labels
                    k = (lab["outcome"], lab["priority"], lab["inference_pool"])
                    totals[k] = totals.get(k, 0.0) + s.value
        c = CounterMetricFamily(self.NAME, _HELP_FC_REQUESTS, labels=_FC_REQUESTS_LABELS)
        for k, v in sorted(totals.items()):
            c.add_metric(list(k), v)
        return [c]


_HELP_FC_REQUESTS: Final = _alpha("Total number of requests processed by the Flow Control "
                                  "layer.")
_FC_REQUESTS_LABELS: Final = ["outcome", "priority", "inference_pool"]


class _PrefixSizeCollector(Collector):
    """``llm_d_epp_prefix_indexer_size{plugin_name, plugin_type}``: each prefix index's
    entries, read when scraped (llm-d's producer sets it as its index changes)."""

    NAME: Final = "llm_d_epp_prefix_indexer_size"
    HELP: Final = _alpha("Size of the prefix indexer.")

    def __init__(self) -> None:
        self.owners: list[Any] = []

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(self.NAME, self.HELP, labels=["plugin_name", "plugin_type"])]

    def collect(self) -> Iterable[Metric]:
        g = GaugeMetricFamily(self.NAME, self.HELP, labels=["plugin_name", "plugin_type"])
        for p in self.owners:
            g.add_metric([p.name, p.type_name], float(p.prefix_index_size()))
        return [g]


class ProgramAwareCollector(Collector):
    """program-aware-fairness's three series (llm-d's fairness/program-aware
    prometheus.go and strategy_las.go), read when scraped from the plugins' state
    (epp/flowcontrol/llmd.py): ``…_jains_fairness_index`` (set at each pick),
    ``…_avg_wait_time_milliseconds{program_id}`` (a program's mean queue wait, set when
    one of its requests is dispatched) and ``…_attained_service_tokens{program_id}`` (its
    attained service as of its last completed response); a forgotten program's series
    go with it, as llm-d deletes them."""

    def __init__(self, plugins: Sequence[Any]) -> None:
        self.plugins = list(plugins)

    def collect(self) -> Iterable[Metric]:
        idx = GaugeMetricFamily(
            "llm_d_epp_program_aware_jains_fairness_index",
            _alpha("Jain's fairness index over average wait time across active programs."))
        wait = GaugeMetricFamily(
            "llm_d_epp_program_aware_avg_wait_time_milliseconds",
            _alpha("Cumulative mean of flow-control queue wait time per program in "
                   "milliseconds."), labels=["program_id"])
        service = GaugeMetricFamily(
            "llm_d_epp_program_aware_attained_service_tokens",
            _alpha("Time-decayed attained service (weighted tokens consumed) per program."),
            labels=["program_id"])
        if self.plugins:  # llm-d's gauges are process-wide: the last writer wins
            idx.add_metric([], float(self.plugins[-1].fairness_index))
        waits: dict[str, float] = {}
        services: dict[str, float] = {}
        for p in self.plugins:
            for pid, m in list(p.programs.items()):
                if m.dispatched:
                    waits[pid] = m.average_wait_ms
                reported = getattr(m, "reported_service", None)
                if reported is not None:
                    services[pid] = reported
        for pid, v in sorted(waits.items()):
            wait.add_metric([pid], v)
        for pid, v in sorted(services.items()):
            service.add_metric([pid], v)
        return [idx, wait, service]


class _PoolCollector(Collector):
    """GIE's pool gauges, computed from the datastore at scrape time. ``name`` is the
    pool's name (see :func:`EppMetrics`); averages are over the pool's endpoints."""

    def __init__(self, store: Datastore, pool_name: str) -> None:
        self._store = store
        self._pool = pool_name

    def collect(self) -> Iterable[GaugeMetricFamily]:
        eps = self._store.snapshot()
        n = len(eps)
        kv = GaugeMetricFamily("inference_pool_average_kv_cache_utilization",
                               _alpha("The average kv cache utilization for an inference "
                                      "server pool."), labels=["name"])
        q = GaugeMetricFamily("inference_pool_average_queue_size",
                              _alpha("The average number of requests pending in the model "
                                     "server queue."), labels=["name"])
        running = GaugeMetricFamily("inference_pool_average_running_requests",
                                    _alpha("The average number of running requests across "
                                           "model servers in the pool."), labels=["name"])
        ready = GaugeMetricFamily("inference_pool_ready_pods",
                                  _alpha("The number of ready pods in the inference server "
                                         "pool."), labels=["name"])
        per_pod = GaugeMetricFamily("inference_pool_per_pod_queue_size",
                                    _alpha("The total number of requests pending in the model "
                                           "server queue for each underlying pod."),
                                    labels=["name", "model_server_pod"])
        lab = [self._pool]
        kv.add_metric(lab, sum(e.metrics.kv_cache_usage for e in eps) / n if n else 0.0)
        q.add_metric(lab, sum(e.metrics.waiting_queue_size for e in eps) / n if n else 0.0)
        running.add_metric(lab, sum(e.metrics.running_requests for e in eps) / n if n else 0.0)
        ready.add_metric(lab, n)
        for e in eps:
            per_pod.add_metric([self._pool, e.name], e.metrics.waiting_queue_size)
        return [kv, q, running, ready, per_pod, *self._llmd(eps), *self._per_role(eps)]

    def _llmd(self, eps: Sequence[Endpoint]) -> list[GaugeMetricFamily]:
        """llm-d's pool gauges (llm_d_router_metrics.go; set by its datalayer logger's
        calculateSummary): averages and sample standard deviations (n − 1, at least 1) of
        the pool's endpoints' KV use, queue and running requests, rounded to two decimals,
        the ready endpoints, and the per-endpoint queue (its pool collector)."""
        lab = [self._pool]
        n = len(eps)
        out: list[GaugeMetricFamily] = []
        series = (("kv_cache_utilization", "kv cache utilization for an inference server pool",
                   [e.metrics.kv_cache_usage for e in eps]),
                  ("queue_size", "number of requests pending in the model server queue",
                   [float(e.metrics.waiting_queue_size) for e in eps]),
                  ("running_requests",
                   "number of running requests across model servers in the pool",
                   [float(e.metrics.running_requests) for e in eps]))
        stds = []
        for suffix, what, values in series:
            mean = sum(values) / n if n else 0.0
            ss = sum((v - mean) * (v - mean) for v in values)
            avg = GaugeMetricFamily(f"llm_d_epp_average_{suffix}",
                                    _alpha(f"The average {what}."), labels=["name"])
            avg.add_metric(lab, round(mean, 2))
            out.append(avg)
            std = GaugeMetricFamily(f"llm_d_epp_std_dev_{suffix}",
                                    _alpha(f"The standard deviation {what}."), labels=["name"])
            std.add_metric(lab, round(math.sqrt(ss / max(1.0, n - 1.0)), 2) if n else 0.0)
            stds.append(std)
        ready = GaugeMetricFamily("llm_d_epp_ready_endpoints",
                                  _alpha("The number of ready endpoints in the inference server "
                                         "pool."), labels=["name"])
        ready.add_metric(lab, n)
        per_ep = GaugeMetricFamily("llm_d_epp_per_endpoint_queue_size",
                                   _alpha("The total number of requests pending in the model "
                                          "server queue for each underlying endpoint."),
                                   labels=["name", "model_server_endpoint"])
        for e in eps:
            per_ep.add_metric([self._pool, e.name], e.metrics.waiting_queue_size)
        return [*out, *stds, ready, per_ep]

    def _per_role(self, eps: Sequence[Endpoint]) -> list[GaugeMetricFamily]:
        """P/D signals for autoscaling each role's pods (e.g. a Grove PodClique): the
        average queue and KV use of the pods of each role (``llm-d.ai/role``, else Dynamo's
        sub-component type; lower-cased; ``unlabelled`` when absent). The ``prefill`` and
        ``decode`` series are always exported (0 pods: averages 0)."""
        groups: dict[str, list[Endpoint]] = {keys.ROLE_PREFILL: [], keys.ROLE_DECODE: []}
        for e in eps:
            groups.setdefault(endpoint_role(e, keys.LABEL_ROLE) or "unlabelled", []).append(e)
        q = GaugeMetricFamily("epp_role_average_queue_size",
                              "Average number of requests waiting in the model-server queue, "
                              "over the pool's pods of each P/D role.", labels=["name", "role"])
        kv = GaugeMetricFamily("epp_role_average_kv_cache_utilization",
                               "Average KV-cache utilization (0..1) over the pool's pods of "
                               "each P/D role.", labels=["name", "role"])
        running = GaugeMetricFamily("epp_role_average_running_requests",
                                    "Average number of running requests over the pool's pods "
                                    "of each P/D role.", labels=["name", "role"])
        ready = GaugeMetricFamily("epp_role_ready_pods",
                                  "Number of ready pods of each P/D role in the pool.",
                                  labels=["name", "role"])
        for role, members in sorted(groups.items()):
            m = len(members)
            lab = [self._pool, role]
            q.add_metric(lab, sum(e.metrics.waiting_queue_size for e in members) / m if m else 0)
            kv.add_metric(lab, sum(e.metrics.kv_cache_usage for e in members) / m if m else 0)
            running.add_metric(lab, sum(e.metrics.running_requests for e in members) / m
                               if m else 0)
            ready.add_metric(lab, m)
        return [q, kv, running, ready]


class GangCollector(Collector):
    """``epp_gang_excluded_pods``: Ready pool pods that take no traffic because their
    multi-node gang (LeaderWorkerSet group, Grove PodGang) is not complete — read at
    scrape time from discovery's gang tracker (Kubernetes mode; 0 without one)."""

    def __init__(self) -> None:
        self.tracker: Any = None

    def collect(self) -> Iterable[GaugeMetricFamily]:
        g = GaugeMetricFamily("epp_gang_excluded_pods",
                              "Ready pool pods taking no traffic because their multi-node "
                              "gang is incomplete.")
        g.add_metric([], len(self.tracker.excluded) if self.tracker is not None else 0)
        return [g]


class EppMetrics:
    """The EPP's metrics on their own registry.

    ``pool_name``: the ``name`` label of the pool gauges — the InferencePool's name
    (``--pool-name``; GIE's ``pool.Name``), ``static`` for endpoints given on the command
    line or in a file (no pool exists then).
    """

    def __init__(self, store: Datastore, pool_name: str = "static") -> None:
        self.registry = r = CollectorRegistry()
        self.pool_name = pool_name
        model = ["model_name", "target_model_name"]
        # --- GIE: inference objective (pkg/epp/metrics/metrics.go) ---
        self.request_total = Counter(
            "inference_objective_request_total",
            _alpha("Counter of inference objective requests broken out for each model and "
                   "target model."), [*model, "priority"], registry=r)
        self.request_error_total = Counter(
            "inference_objective_request_error_total",
            _alpha("Counter of inference objective requests errors broken out for each model "
                   "and target model."), [*model, "error_code"], registry=r)
        self.request_metric = Gauge(
            "inference_objective_inference_request_metric",
            _alpha("Consolidated gauge for various inference request metrics including TTFT, "
                   "TPOT, SLOs, and prediction durations."), [*model, "type"], registry=r)
        self.request_ttft = Histogram(
            "inference_objective_request_ttft_seconds",
            _alpha("Inference model TTFT distribution in seconds for each model and target "
                   "model."), model, buckets=GENERAL_LATENCY_BUCKETS, registry=r)
        self.request_tpot = Histogram(
            "inference_objective_request_tpot_seconds",
            _alpha("Inference model TPOT distribution in seconds for each model and target "
                   "model."), model, buckets=TPOT_BUCKETS, registry=r)
        self.request_duration = Histogram(
            "inference_objective_request_duration_seconds",
            _alpha("Inference objective response latency distribution in seconds for each "
                   "model and target model."), model, buckets=GENERAL_LATENCY_BUCKETS,
            registry=r)
        self.request_sizes = Histogram(
            "inference_objective_request_sizes",
            _alpha("Inference objective requests size distribution in bytes for each model "
                   "and target model."), model, buckets=REQUEST_SIZE_BUCKETS, registry=r)
        self.response_sizes = Histogram(
            "inference_objective_response_sizes",
            _alpha("Inference objective responses size distribution in bytes for each model "
                   "and target model."), model, buckets=RESPONSE_SIZE_BUCKETS, registry=r)
        self.input_tokens = Histogram(
            "inference_objective_input_tokens",
            _alpha("Inference objective input token count distribution for requests in each "
                   "model."), model, buckets=INPUT_TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram(
            "inference_objective_output_tokens",
            _alpha("Inference objective output token count distribution for requests in each "
                   "model."), model, buckets=OUTPUT_TOKEN_BUCKETS, registry=r)
        self.cached_tokens = Histogram(
            "inference_objective_prompt_cached_tokens",
            _alpha("Inference objective prompt cached token count distribution for requests "
                   "in each model."), model, buckets=INPUT_TOKEN_BUCKETS, registry=r)
        self.running_requests = Gauge(
            "inference_objective_running_requests",
            _alpha("Inference objective number of running requests in each model."),
            ["model_name"], registry=r)
        self.ntpot = Histogram(
            "inference_objective_normalized_time_per_output_token_seconds",
            _alpha("Inference objective latency divided by number of output tokens in "
                   "seconds for each model and target model."), model,
            buckets=NTPOT_BUCKETS, registry=r)
        # --- GIE: the latency predictor's (recorded from what the predicted-latency
        # plugins leave in the request's plugin_state: MetricsObserver) ---
        self.request_predicted_ttft = Histogram(
            "inference_objective_request_predicted_ttft_seconds",
            _alpha("Inference model Predicted TTFT distribution in seconds for each model and "
                   "target model."), model, buckets=GENERAL_LATENCY_BUCKETS, registry=r)
        self.request_ttft_prediction_duration = Histogram(
            "inference_objective_request_ttft_prediction_duration_seconds",
            _alpha("Duration taken to generate TTFT predictions in seconds for each model and "
                   "target model."), model, buckets=PREDICTION_BUCKETS, registry=r)
        self.request_predicted_tpot = Histogram(
            "inference_objective_request_predicted_tpot_seconds",
            _alpha("Inference model Predicted TPOT distribution in seconds for each model and "
                   "target model."), model, buckets=TPOT_BUCKETS, registry=r)
        self.request_tpot_prediction_duration = Histogram(
            "inference_objective_request_tpot_prediction_duration_seconds",
            _alpha("Duration taken to generate TPOT predictions in seconds for each model and "
                   "target model."), model, buckets=PREDICTION_BUCKETS, registry=r)
        self.slo_violations = Counter(
            "inference_objective_request_slo_violation_total",
            _alpha("Counter of SLO violations for each model, target model, and violation "
                   "type."), [*model, "type"], registry=r)
        # --- GIE: scheduling ---
        self.scheduler_e2e = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            _alpha("End-to-end scheduling latency distribution in seconds."),
            buckets=SCHEDULER_BUCKETS, registry=r)
        self.scheduler_attempts = Counter(
            "inference_extension_scheduler_attempts_total",
            _alpha("Total number of scheduling attempts."),
            ["status", "target_model_name", "pod_name", "namespace", "port"], registry=r)
        self.plugin_duration = Histogram(
            "inference_extension_plugin_duration_seconds",
            _alpha("Plugin processing latency distribution in seconds for each extension "
                   "point, plugin type and plugin name."),
            ["extension_point", "plugin_type", "plugin_name"], buckets=SCHEDULER_BUCKETS,
            registry=r)
        self._prefix_size = Gauge(
            "inference_extension_prefix_indexer_size",
            _alpha("Size of the prefix indexer."), registry=r)
        self.prefix_hit_ratio = Histogram(
            "inference_extension_prefix_indexer_hit_ratio",
            _alpha("Ratio of prefix length matched to total prefix length in the cache "
                   "lookup."), buckets=HIT_RATIO_BUCKETS, registry=r)
        self.prefix_hit_bytes = Histogram(
            "inference_extension_prefix_indexer_hit_bytes",
            _alpha("Length of the prefix match in number of bytes in the cache lookup."),
            buckets=HIT_BYTES_BUCKETS, registry=r)
        info = Gauge("inference_extension_info",
                     _alpha("General information of the current build of Inference "
                            "Extension."), ["commit", "build_ref"], registry=r)
        info.labels("", __version__).set(1)
        # --- GIE: model rewrite (registered as GIE does; see docs/observability.md) ---
        self.model_rewrite_decisions = Counter(
            "inference_extension_model_rewrite_decisions_total",
            _alpha("Total number of inference model rewrite decisions."),
            ["model_rewrite_name", "model_name", "target_model"], registry=r)
        self._model_rewrites = _Children(self.model_rewrite_decisions)
        # --- the project's own ---
        self.pd_decisions = Counter(
            "epp_pd_decisions_total",
            "Prefill/decode decisions of a disaggregating profile handler, by type "
            "(disaggregated, decode-only).", ["decision_type"], registry=r)
        self.upstream_connect_failures = Counter(
            "epp_gateway_upstream_connect_failures_total",
            "Requests the gateway could not connect to the chosen endpoint for (Envoy's "
            "connect-failure flag in the response attributes; docs/operations.md).",
            ["model_server_pod"], registry=r)
        self.extproc_streams = Counter(
            "epp_extproc_streams_total",
            "ext_proc streams by outcome: completed (response ended), rejected (answered "
            "with an error), aborted (the stream ended before the response did).",
            ["outcome"], registry=r)
        # --- llm-d-router v0.10.0 (llm_d_epp_; see the section above _PoolCollector) ---
        self._init_llmd(r, info)
        r.register(_PoolCollector(store, pool_name))
        self.gangs = GangCollector()
        r.register(self.gangs)
        self._plugin_children: dict[tuple[str, int], Histogram] = {}
        self._flow_control: FlowControlMetrics | None = None

    def flow_control(self) -> FlowControlMetrics:
        """GIE's six flow-control series (``inference_extension_flow_control_*``,
        epp/flowcontrol/metrics.py) on this registry, labelled with this pool's name;
        registered on the first call, which the server makes only under the
        ``flowControl`` feature gate (without it nothing records them)."""
        if self._flow_control is None:
            fc = self._flow_control = FlowControlMetrics(self.registry, self.pool_name)
            self._register_flow_control_twins(fc)
        return self._flow_control

    def _register_flow_control_twins(self, fc: FlowControlMetrics) -> None:
        """llm-d's names for the six (llm_d_router_metrics.go: RecordFlowControl* record
        both), and flow_control_requests_total from the queue-duration counts."""
        r = self.registry
        fcn = "llm_d_epp_flow_control_"
        r.register(_Twin(fc.request_queue_duration, fcn + "request_queue_duration_seconds",
                         ("Distribution of total time requests spend in the Flow Control layer "
                          "(from enqueue to final outcome)."), "histogram"))
        r.register(_Twin(fc.dispatch_cycle_duration, fcn + "dispatch_cycle_duration_seconds",
                         ("Distribution of time taken for each internal dispatch cycle in the "
                          "Flow Control layer."), "histogram"))
        r.register(_Twin(fc.request_enqueue_duration, fcn + "request_enqueue_duration_seconds",
                         ("Distribution of time taken to enqueue requests into the Flow Control "
                          "layer."), "histogram"))
        r.register(_Twin(fc.queue_size, fcn + "queue_size",
                         "Current number of requests actively held in the Flow Control queue.",
                         "gauge"))
        r.register(_Twin(fc.queue_bytes, fcn + "queue_bytes",
                         ("Current total size in bytes of requests actively held in the Flow "
                          "Control queue."), "gauge"))
        r.register(_Twin(fc.pool_saturation, fcn + "pool_saturation",
                         ("Pool saturation signal gating Flow Control dispatch. 1.0 is the "
                          "gating set point; values above 1.0 indicate the magnitude of "
                          "oversubscription past it. An empty pool reads as 1.0. With the "
                          "default utilization detector, endpoints with missing or stale "
                          "metrics score as fully saturated (fail-closed; see "
                          "flow_control_stale_endpoints)."), "gauge"))
        r.register(_FlowRequestsCollector(fc))

    def record_model_rewrite(self, rewrite_name: str, model: str, target: str) -> None:
        """An InferenceModelRewrite rule chose ``target`` for a request for ``model``
        (GIE's RecordInferenceModelRewriteDecision, called where GIE's Director applies
        the rewrite: before admission and scheduling, whatever their outcome)."""
        self._model_rewrites.get(rewrite_name, model, target).inc()

    def track_prefix_index_size(self, size: Callable[[], float]) -> None:
        """Report the prefix index size at scrape time (no per-request cost)."""
        self._prefix_size.set_function(size)

    def observe_plugin(self, extension_point: str, plugin: Plugin, seconds: float) -> None:
        """PluginTimer: per-plugin latency (children cached: labels() is not free)."""
        key = (extension_point, id(plugin))
        child = self._plugin_children.get(key)
        if child is None:
            child = self.plugin_duration.labels(extension_point, plugin.type_name, plugin.name)
            self._plugin_children[key] = child
        child.observe(seconds)

    # ------------------------------------------------------------ llm-d-router v0.10.0

    def _init_llmd(self, r: CollectorRegistry, info: Gauge) -> None:
        """llm-d-router v0.10.0's ``llm_d_epp_*`` metrics (llm_d_router_metrics.go and the
        plugins' metrics.go files), with Go's names, types, help texts, label names and
        buckets. The flow-control twins come with :meth:`flow_control`, the ext_proc stream
        ones with :meth:`grpc_stream_metrics`, program-aware fairness's with
        :meth:`bind_plugins`."""
        req = list(LLMD_REQUEST_LABELS)
        self.llmd_bounds = LabelBounds()
        # Request and latency (RecordRequestCounter, …: the GIE twins' recording points).
        self.llmd_request_total = _fast_counter(
            "llm_d_epp_request_total", _alpha("Total number of processed requests."), req,
            registry=r)
        self.llmd_request_error_total = _fast_counter(
            "llm_d_epp_request_error_total", _alpha("Total number of request errors."),
            [*req, "error_code"], registry=r)
        self.llmd_request_duration = _fast_histogram(
            "llm_d_epp_request_duration_seconds",
            _alpha("End-to-end request latency distribution in seconds."), req,
            buckets=GENERAL_LATENCY_BUCKETS, registry=r)
        self.llmd_request_sizes = _fast_histogram(
            "llm_d_epp_request_size_bytes",
            _alpha("Incoming request body size distribution in bytes."), req,
            buckets=REQUEST_SIZE_BUCKETS, registry=r)
        self.llmd_response_sizes = _fast_histogram(
            "llm_d_epp_response_size_bytes",
            _alpha("Outgoing response body size distribution in bytes."), req,
            buckets=RESPONSE_SIZE_BUCKETS, registry=r)
        self.llmd_input_tokens = _fast_histogram(
            "llm_d_epp_request_input_tokens",
            _alpha("Input token count distribution per request."), req,
            buckets=INPUT_TOKEN_BUCKETS, registry=r)
        self.llmd_output_tokens = _fast_histogram(
            "llm_d_epp_request_output_tokens",
            _alpha("Output token count distribution per request."), req,
            buckets=OUTPUT_TOKEN_BUCKETS, registry=r)
        self.llmd_cached_tokens = _fast_histogram(
            "llm_d_epp_request_cached_tokens",
            _alpha("Distribution of prompt tokens read from cache per request, as reported by "
                   "the model server in the response."), req,
            buckets=INPUT_TOKEN_BUCKETS, registry=r)
        self.llmd_running_requests = _fast_gauge(
            "llm_d_epp_request_running", _alpha("Current number of active running requests."),
            req, registry=r)
        self.llmd_ntpot = _fast_histogram(
            "llm_d_epp_request_ntpot_seconds",
            _alpha("Normalized time per output token in seconds (end-to-end latency divided by "
                   "output token count)."), req, buckets=NTPOT_BUCKETS, registry=r)
        self.llmd_request_ttft = _fast_histogram(
            "llm_d_epp_request_ttft_seconds",
            _alpha("Time to first token in seconds, measured from request received to first "
                   "response byte. For non-streaming requests, this equals total request "
                   "duration."), [*req, "streaming"], buckets=LLMD_TTFT_BUCKETS, registry=r)
        self.llmd_request_tpot = _fast_histogram(
            "llm_d_epp_request_streaming_tpot_seconds",
            _alpha("Average time per output token in seconds for streaming requests, computed "
                   "as (e2e - TTFT) / (output_tokens - 1)."), req,
            buckets=LLMD_STREAMING_TPOT_BUCKETS, registry=r)
        self.llmd_inter_token_latency = _fast_histogram(
            "llm_d_epp_request_streaming_itl_seconds",
            _alpha("Inter-token latency in seconds for streaming requests, measured as the "
                   "time between consecutive response body chunks."), req,
            buckets=LLMD_ITL_BUCKETS, registry=r)
        # Scheduler, plugins, info, model rewrites: the GIE series under llm-d's names.
        r.register(_Twin(self.scheduler_e2e, "llm_d_epp_scheduler_e2e_duration_seconds",
                         "End-to-end scheduling latency distribution in seconds.", "histogram"))
        r.register(_Twin(self.scheduler_attempts, "llm_d_epp_scheduler_attempts",
                         "Total number of scheduling attempts.", "counter",
                         rename={"pod_name": "endpoint_name"}))
        r.register(_Twin(self.plugin_duration, "llm_d_epp_plugin_duration_seconds",
                         "Plugin processing latency distribution in seconds for each extension "
                         "point, plugin type and plugin name.", "histogram"))
        r.register(_Twin(info, "llm_d_epp_info", "General information of the current build of "
                         "Inference Extension.", "gauge"))
        r.register(_Twin(self.model_rewrite_decisions, "llm_d_epp_model_rewrite_decisions",
                         "Total number of inference model rewrite decisions.", "counter"))
        # EPP processing overhead (RecordRequestProcessingLatency / …Response…): observed
        # once per request each, so recorded as fast series (unlabelled: their one child
        # exists from the start, exposed with a zero count as Go's always-registered ones).
        self.llmd_request_processing = _fast_histogram(
            "llm_d_epp_request_processing_duration_seconds",
            _alpha("EPP request processing latency distribution in seconds, from request "
                   "receipt until the request body has been handled, including admission "
                   "control."), [], buckets=LLMD_REQUEST_PROCESSING_BUCKETS, registry=r)
        self._request_processing = self.llmd_request_processing.labels()
        self.llmd_response_processing = _fast_histogram(
            "llm_d_epp_response_processing_duration_seconds",
            _alpha("EPP response processing latency distribution in seconds: the sum of "
                   "per-chunk handler time for a streamed response, or the interval from "
                   "response headers to completion for a non-streaming response."), [],
            buckets=LLMD_RESPONSE_PROCESSING_BUCKETS, registry=r)
        self._response_processing = self.llmd_response_processing.labels()
        # Data layer (RecordDataLayerPollError / …ExtractError).
        self.llmd_datalayer_poll_errors = Counter(
            "llm_d_epp_datalayer_poll_errors_total",
            _alpha("Data-source poll errors per source type."), ["source_type"], registry=r)
        self.llmd_datalayer_extract_errors = Counter(
            "llm_d_epp_datalayer_extract_errors_total",
            _alpha("Extract errors per source/extractor type."),
            ["source_type", "extractor_type"], registry=r)
        # Approximate prefix indexer (approximateprefix/metrics.go).
        self._llmd_prefix_size = _PrefixSizeCollector()
        r.register(self._llmd_prefix_size)
        self.llmd_prefix_hit_ratio = _fast_histogram(
            "llm_d_epp_prefix_indexer_hit_ratio",
            _alpha("Ratio of prefix length matched to total prefix length in the cache "
                   "lookup."), ["plugin_name", "plugin_type"], buckets=HIT_RATIO_BUCKETS,
            registry=r)
        self.llmd_prefix_hit_bytes = _fast_histogram(
            "llm_d_epp_prefix_indexer_hit_bytes",
            _alpha("Length of the prefix match in number of bytes in the cache lookup."),
            ["plugin_name", "plugin_type"], buckets=HIT_BYTES_BUCKETS, registry=r)
        # Predicted latency (predictedlatency/metrics.go).
        self.llmd_request_metric = _fast_gauge(
            "llm_d_epp_inference_request_metric",
            _alpha("Consolidated gauge for various inference request metrics including TTFT, "
                   "TPOT, SLOs, and prediction durations."), [*_PLUGIN_MODEL, "type"],
            registry=r)
        self.llmd_predicted_ttft = _fast_histogram(
            "llm_d_epp_request_predicted_ttft_seconds",
            _alpha("Inference model Predicted TTFT distribution in seconds for each model and "
                   "target model."), list(_PLUGIN_MODEL), buckets=GENERAL_LATENCY_BUCKETS,
            registry=r)
        self.llmd_ttft_prediction_duration = _fast_histogram(
            "llm_d_epp_request_ttft_prediction_duration_seconds",
            _alpha("Duration taken to generate TTFT predictions in seconds for each model and "
                   "target model."), list(_PLUGIN_MODEL), buckets=PREDICTION_BUCKETS,
            registry=r)
        self.llmd_predicted_tpot = _fast_histogram(
            "llm_d_epp_request_predicted_tpot_seconds",
            _alpha("Inference model Predicted TPOT distribution in seconds for each model and "
                   "target model."), list(_PLUGIN_MODEL), buckets=TPOT_BUCKETS, registry=r)
        self.llmd_tpot_prediction_duration = _fast_histogram(
            "llm_d_epp_request_tpot_prediction_duration_seconds",
            _alpha("Duration taken to generate TPOT predictions in seconds for each model and "
                   "target model."), list(_PLUGIN_MODEL), buckets=PREDICTION_BUCKETS,
            registry=r)
        self.llmd_slo_violations = _fast_counter(
            "llm_d_epp_request_slo_violation_total",
            _alpha("Counter of SLO violations for each model, target model, and violation "
                   "type."), [*_PLUGIN_MODEL, "type"], registry=r)
        # Disaggregation (disagg/metrics.go): recorded by MetricsObserver for a
        # disagg-profile-handler / pd-profile-handler.
        pd_labels = ["plugin_name", "plugin_type", "model_name", "decision_type"]
        self.llmd_pd_decisions = _fast_counter(
            "llm_d_epp_pd_decision_total",
            _alpha("Total number of P/D disaggregation decisions made"), pd_labels,
            registry=r)
        self.llmd_disagg_decisions = _fast_counter(
            "llm_d_epp_disagg_decision_total",
            _alpha("Total number of disaggregation routing decisions made"), pd_labels,
            registry=r)
        # Multimodal encoder cache (multimodal/metrics.go): record_encoder_cache_item and
        # record_encoder_cache_hit_ratio, called by the mm-embeddings cache producer.
        self.llmd_encoder_cache_queries = Counter(
            "llm_d_epp_encoder_cache_queries_total",
            _alpha("Total number of multimodal item hash lookups made against the "
                   "encoder-cache affinity LRU."), ["plugin_type", "plugin_name", "modality"],
            registry=r)
        self.llmd_encoder_cache_hits = Counter(
            "llm_d_epp_encoder_cache_hits_total",
            _alpha("Total number of multimodal item hash lookups that found a match in the "
                   "encoder-cache affinity LRU, by endpoint."),
            ["plugin_type", "plugin_name", "pod", "modality"], registry=r)
        self.llmd_encoder_cache_hit_ratio = Histogram(
            "llm_d_epp_encoder_cache_hit_ratio",
            _alpha("Ratio of matched multimodal items to total items per endpoint in an "
                   "encoder-cache lookup."), ["plugin_type", "plugin_name"],
            buckets=HIT_RATIO_BUCKETS, registry=r)
        # DisaggregatedSet rollout screener (disaggregatedsetrollout/metrics.go).
        self.llmd_strict_header_no_match = Counter(
            "llm_d_epp_disaggregatedset_strict_header_no_match_total",
            _alpha("Strict header selections that matched no endpoint and failed closed."),
            ["plugin_type", "plugin_name", "selector"], registry=r)
        self.llmd_revision_gating_share = Gauge(
            "llm_d_epp_disaggregatedset_revision_gating_share",
            _alpha("Current weighted revision gating share from 0 to 1; incomplete revisions "
                   "have share 0."), ["plugin_type", "plugin_name", "mode", "revision"],
            registry=r)
        # In-flight load producer (inflightload/metrics.go).
        inflight = ["endpoint_name", "namespace", "producer_name", "fairness_id", "priority"]
        self.llmd_inflight_requests = _fast_gauge(  # changed twice per request: fast
            "llm_d_epp_inflight_requests",
            _alpha("Current number of in-flight requests per endpoint, as tracked by the "
                   "in-flight load producer."), inflight, registry=r)
        self.llmd_inflight_tokens = _fast_gauge(
            "llm_d_epp_inflight_tokens",
            _alpha("Current number of in-flight tokens per endpoint (uncached prompt tokens, "
                   "optionally plus estimated output), as tracked by the in-flight load "
                   "producer."), inflight, registry=r)
        # Flow control's llm-d-only series (labelled: no series until recorded, as Go's
        # always-registered vectors); the six GIE twins come with flow_control().
        self.llmd_fc_stale_endpoints = Gauge(
            "llm_d_epp_flow_control_stale_endpoints",
            _alpha("Number of candidate endpoints whose metrics are missing or older than the "
                   "staleness threshold, as of the most recent saturation evaluation. "
                   "Recorded by the utilization saturation detector, which scores these "
                   "endpoints as fully saturated in flow_control_pool_saturation "
                   "(fail-closed): a nonzero value during a dispatch stall indicates a metrics "
                   "collection problem rather than genuine overload."), ["detector"],
            registry=r)
        self.llmd_fc_revocations_issued = Counter(
            "llm_d_epp_flow_control_revocations_issued_total",
            _alpha("Total number of in-flight eviction revocations issued, labeled by the "
                   "demand band's priority."), ["priority", "inference_pool"], registry=r)
        self.llmd_fc_revocations = Counter(
            "llm_d_epp_flow_control_revocations_total",
            _alpha("Total number of in-flight eviction revocations by terminal outcome "
                   "(confirmed, timed_out). Every issued revocation eventually increments "
                   "exactly one outcome."), ["outcome", "inference_pool"], registry=r)
        self.llmd_fc_reclaim_target = Gauge(
            "llm_d_epp_flow_control_reclaim_target",
            _alpha("Last computed reclamation deficit, in saturation-gauge units."),
            ["inference_pool"], registry=r)
        self.llmd_fc_pending_reclaim = Gauge(
            "llm_d_epp_flow_control_pending_reclaim",
            _alpha("Sum of outstanding and cooling pending-reclaim debits, in saturation-gauge "
                   "units."), ["inference_pool"], registry=r)
        self.llmd_fc_revocation_confirmation = Histogram(
            "llm_d_epp_flow_control_revocation_confirmation_seconds",
            _alpha("Time from revocation issue to confirmed stream termination."),
            ["inference_pool"], buckets=REVOCATION_CONFIRMATION_BUCKETS, registry=r)
        # Cached children of the series recorded per request or per evaluation.
        self._itl = _RequestChildren(self.llmd_inter_token_latency, self.llmd_bounds)
        self._stale = _Children(self.llmd_fc_stale_endpoints)
        self._encoder_queries = _Children(self.llmd_encoder_cache_queries)
        self._encoder_hits = _Children(self.llmd_encoder_cache_hits)
        self._encoder_ratio = _Children(self.llmd_encoder_cache_hit_ratio)
        # Set by bind_plugins (the config's plugins, before traffic).
        self.prefix_identity: tuple[str, str] = ("", "")
        self.latency_identity: tuple[str, str] | None = None
        self.program_aware: ProgramAwareCollector | None = None
        self._grpc_streams: GrpcStreamMetrics | None = None

    def bind_plugins(self, plugins: Iterable[Plugin]) -> None:
        """Learn the config's plugins whose identity labels llm-d series (called by the
        server's wiring before traffic): the prefix index owners
        (``llm_d_epp_prefix_indexer_*{plugin_name, plugin_type}``), the latency predictor
        plugin (the predicted-latency series), and program-aware-fairness instances (their
        three gauges, registered only when one is configured, as llm-d's plugin does).

        Plugins that record llm-d series themselves (the in-flight load producer, the
        mm-embeddings cache producer, the rollout screener, the utilization detector)
        have a ``bind_metrics(metrics)`` method: it is called here with this object, once
        per plugin. Unbound (unit tests, tools), they record nothing."""
        owners: list[Plugin] = []
        aware: list[Plugin] = []
        seen: set[int] = set()
        for p in plugins:
            if id(p) in seen:
                continue
            seen.add(id(p))
            bind = getattr(p, "bind_metrics", None)
            if callable(bind):
                bind(self)
            if isinstance(p, PrefixIndexOwner):
                owners.append(p)
            if p.type_name in _LATENCY_PLUGIN_TYPES and self.latency_identity is None:
                self.latency_identity = (p.name, p.type_name)
            if p.type_name == _PROGRAM_AWARE_TYPE:
                aware.append(p)
        self._llmd_prefix_size.owners = owners
        if owners:
            self.prefix_identity = (owners[0].name, owners[0].type_name)
        if aware:
            if self.program_aware is None:
                self.program_aware = ProgramAwareCollector(aware)
                self.registry.register(self.program_aware)
            else:
                self.program_aware.plugins = aware

    def grpc_stream_metrics(self) -> GrpcStreamMetrics:
        """llm-d's three ext_proc gRPC stream series (grpc_stream_metrics.go), registered on
        the first call: llm-d registers them only with ``--enable-grpc-stream-metrics``."""
        if self._grpc_streams is None:
            self._grpc_streams = GrpcStreamMetrics(self.registry)
        return self._grpc_streams

    def record_request_error(self, model: str, target: str, fairness_id: str | None,
                             priority: int, code: str) -> None:
        """An error with GIE's ``code`` for a request (RecordRequestErrCounter: both
        series); for errors outside a decision (e.g. a body that does not parse)."""
        self.request_error_total.labels(model, target, code).inc()
        self.llmd_request_error_total.labels(
            *self.llmd_bounds.request((model, target, fairness_id, priority)), code).inc()

    def record_request_processing(self, seconds: float) -> None:
        """llm-d's RecordRequestProcessingLatency: request receipt → request body handled
        (admission included), once per request, failures included."""
        self._request_processing.observe(seconds)

    def record_response_processing(self, seconds: float) -> None:
        """llm-d's RecordResponseProcessingLatency: the EPP's own time on a response (the
        sum of its per-chunk handling of a streamed one), once per stream that reached the
        response phase."""
        self._response_processing.observe(seconds)

    def record_inter_token_latency(self, request: LLMRequest, seconds: float) -> None:
        """llm-d's RecordInterTokenLatency: the gap between two consecutive non-empty body
        chunks of a streamed (SSE) response; negative gaps are dropped."""
        if seconds >= 0:
            self.inter_token_latency_child(request).observe(seconds)

    def inter_token_latency_child(self, request: LLMRequest) -> _FastChild:
        """The ITL series of ``request``'s labels, for a caller that observes many gaps of
        one response (the Director takes it once per streamed response)."""
        return self._itl.get((request.incoming_model, request.target_model,
                              request.fairness_id, request.priority))

    def record_datalayer_poll_error(self, source_type: str) -> None:
        """A data source's poll failed (RecordDataLayerPollError)."""
        self.llmd_datalayer_poll_errors.labels(source_type).inc()

    def record_datalayer_extract_error(self, source_type: str, extractor_type: str) -> None:
        """An extractor failed on a source's payload (RecordDataLayerExtractError)."""
        self.llmd_datalayer_extract_errors.labels(source_type, extractor_type).inc()

    def record_stale_endpoints(self, detector: str, count: int) -> None:
        """The utilization saturation detector scored ``count`` candidates as saturated
        because their metrics were missing or stale (RecordFlowControlStaleEndpoints)."""
        self._stale.get(detector).set(count)

    def record_revocations_issued(self, priority: int, n: int) -> None:
        """Flow control issued ``n`` in-flight eviction revocations for the demand band of
        ``priority`` (RecordFlowControlRevocationsIssued)."""
        self.llmd_fc_revocations_issued.labels(str(priority), self.pool_name).inc(n)

    def record_revocation_outcome(self, outcome: str, n: int = 1,
                                  confirmed_after_s: float | None = None) -> None:
        """``n`` revocations reached ``outcome`` (REVOCATION_CONFIRMED / _TIMED_OUT;
        RecordFlowControlRevocations), a confirmed one ``confirmed_after_s`` after it was
        issued (RecordFlowControlRevocationConfirmationDuration)."""
        self.llmd_fc_revocations.labels(outcome, self.pool_name).inc(n)
        if confirmed_after_s is not None:
            self.llmd_fc_revocation_confirmation.labels(self.pool_name).observe(
                confirmed_after_s)

    def record_reclaim(self, target: float | None = None, pending: float | None = None) -> None:
        """The last reclamation deficit and the pending-reclaim debits, in saturation units
        (RecordFlowControlReclaimTarget / …PendingReclaim); None leaves one as it is."""
        if target is not None:
            self.llmd_fc_reclaim_target.labels(self.pool_name).set(target)
        if pending is not None:
            self.llmd_fc_pending_reclaim.labels(self.pool_name).set(pending)

    def record_encoder_cache_item(self, plugin: Plugin, modality: str,
                                  hit_pods: Iterable[str]) -> None:
        """One multimodal item looked up in the mm-embeddings (encoder cache) affinity
        LRUs (llm-d's recordItemLookups): a query, and a hit for each endpoint whose LRU
        holds the item's hash."""
        ptype, pname = plugin.type_name, plugin.name
        self._encoder_queries.get(ptype, pname, modality).inc()
        for pod in hit_pods:
            self._encoder_hits.get(ptype, pname, pod, modality).inc()

    def record_encoder_cache_hit_ratio(self, plugin: Plugin, matched: int, total: int) -> None:
        """The share of a request's multimodal items one endpoint's LRU matched (llm-d's
        recordHitRatio); a request without items is not observed."""
        if total > 0:
            self._encoder_ratio.get(plugin.type_name, plugin.name).observe(matched / total)

    def record_strict_header_no_match(self, plugin: Plugin, selector: str) -> None:
        """A disaggregatedset-rollout strict header selection matched no endpoint."""
        self.llmd_strict_header_no_match.labels(plugin.type_name, plugin.name, selector).inc()

    def record_revision_gating_shares(self, plugin: Plugin, mode: str,
                                      shares: Mapping[str, float],
                                      previous: Iterable[str] = ()) -> None:
        """The disaggregatedset-rollout screener's gating share per revision; the
        ``previous`` revisions no longer in ``shares`` lose their series."""
        g = self.llmd_revision_gating_share
        for revision in previous:
            if revision not in shares:
                try:
                    g.remove(plugin.type_name, plugin.name, mode, revision)
                except KeyError:
                    pass
        for revision, share in shares.items():
            g.labels(plugin.type_name, plugin.name, mode, revision).set(share)

    def record_inflight(self, producer: Plugin, endpoint_name: str, namespace: str,
                        fairness_id: str, priority: int, requests: int,
                        tokens: float) -> None:
        """An in-flight load producer's change for one endpoint and flow (llm-d's
        inflightload producer: +1 request and its tokens when a request is admitted to an
        endpoint, −1 and −tokens when it is released). Fairness IDs are capped as the
        request series' are (a new one past the cap reads ``other``, at both ends)."""
        lab = (endpoint_name, namespace, producer.name,
               self.llmd_bounds.fairness(fairness_id), str(priority))
        if requests:
            self.llmd_inflight_requests.labels(*lab).inc(requests)
        if tokens:
            self.llmd_inflight_tokens.labels(*lab).inc(tokens)

    def eviction_metrics(self) -> EvictionRecorder:
        """The flow-control reclamation controller's metrics hook
        (epp/flowcontrol/eviction.py ``EvictionMetrics``) recording llm-d's revocation
        series through :meth:`record_revocations_issued`, :meth:`record_revocation_outcome`
        and :meth:`record_reclaim`."""
        return EvictionRecorder(self)


class EvictionRecorder:
    """epp/flowcontrol/eviction.py's ``EvictionMetrics`` onto :class:`EppMetrics`: where
    llm-d's ReclamationController calls ``RecordFlowControl*`` (reclamation.go)."""

    __slots__ = ("_m",)

    def __init__(self, metrics: EppMetrics) -> None:
        self._m = metrics

    def revocations_issued(self, priority: int, n: int) -> None:
        self._m.record_revocations_issued(priority, n)

    def revocation_outcome(self, outcome: str, n: int) -> None:
        self._m.record_revocation_outcome(outcome, n)

    def reclaim_target(self, value: float) -> None:
        self._m.record_reclaim(target=value)

    def pending_reclaim(self, value: float) -> None:
        self._m.record_reclaim(pending=value)

    def confirmation_seconds(self, seconds: float) -> None:
        self._m.llmd_fc_revocation_confirmation.labels(self._m.pool_name).observe(seconds)


class GrpcStreamMetrics:
    """llm-d's ext_proc gRPC stream series (pkg/epp/metrics/grpc_stream_metrics.go):
    ``started()`` when a stream opens, ``finished(code, seconds)`` when it closes with a
    gRPC status code name (``OK``, ``Canceled``, …)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.inflight = Gauge(
            "llm_d_epp_extproc_streams_inflight",
            _alpha("Number of ext_proc gRPC streams currently open."), registry=r)
        self.duration = Histogram(
            "llm_d_epp_extproc_stream_duration_seconds",
            _alpha("Duration an ext_proc gRPC stream stays open, in seconds."),
            buckets=EXTPROC_STREAM_BUCKETS, registry=r)
        self.total = Counter(
            "llm_d_epp_extproc_streams_total",
            _alpha("Total ext_proc gRPC streams completed, by gRPC status code."), ["code"],
            registry=r)
        self._codes = _Children(self.total)

    def started(self) -> None:
        self.inflight.inc()

    def finished(self, code: str, seconds: float) -> None:
        self.inflight.dec()
        self.duration.observe(seconds)
        self._codes.get(code).inc()


def _identity(value: object) -> tuple[str, str] | None:
    """A bound plugin identity (name, type), or None (unbound, or a stand-in metrics
    object such as bench/metrics_cost.py's)."""
    if isinstance(value, tuple) and len(value) == 2:
        return (str(value[0]), str(value[1]))
    return None


class MetricsObserver(Observer):
    """The request metrics of every decision (a DecisionObserver shared by all requests),
    recorded where GIE's EPP records them:

    - ``scheduled``: scheduling latency and a successful scheduling attempt (labelled with
      the primary profile's first endpoint, the one the request goes to); a failed attempt
      is recorded by the scheduling core itself (:meth:`record_attempt_failed`);
    - ``decided``: the request counter (with its ``priority``), the request size, running
      requests, the prefix indexer's hit ratio and hit bytes, P/D decisions
      (``classify``: the profile handler's ``decision``, when it has one);
    - ``responded`` (only when the protocol front saw the response body): the response
      size, and for streamed responses TTFT and TPOT;
    - ``completed``: running requests, and for successful responses latency, token counts
      and normalized time per output token.

    Each also records the ``llm_d_epp_`` twin of what it records (llm-d-router v0.10.0
    records both in one function), with llm-d's extra labels: ``fairness_id`` (the
    request's fairness ID, ``default-flow`` without one) and ``priority`` on the request
    series, the plugin's name and type on the prefix, latency-predictor and P/D ones;
    plus llm-d's own ``request_ttft_seconds{streaming}`` and
    ``request_streaming_tpot_seconds`` when a response body was seen, and
    ``disagg_decision_total`` / ``pd_decision_total`` for a disagg-profile-handler /
    pd-profile-handler. Each twin costs one cached-child lookup (the request key is one
    tuple per hook).

    Plugin latencies are not taken from ``plugin_timed``: the server wires
    :meth:`EppMetrics.observe_plugin` as the scheduler's PluginTimer when it builds the
    configuration, so they are recorded for every scheduling run.
    """

    def __init__(self, metrics: EppMetrics,
                 classify: Callable[[SchedulingResult], str] | None = None) -> None:
        self.metrics = m = metrics
        self._classify = classify
        self._total = _Children(m.request_total)
        self._request_sizes = _Children(m.request_sizes)
        self._running = _Children(m.running_requests)
        self._attempts = _Children(m.scheduler_attempts)
        self._duration = _Children(m.request_duration)
        self._input = _Children(m.input_tokens)
        self._output = _Children(m.output_tokens)
        self._cached = _Children(m.cached_tokens)
        self._ntpot = _Children(m.ntpot)
        self._response_sizes = _Children(m.response_sizes)
        self._ttft = _Children(m.request_ttft)
        self._tpot = _Children(m.request_tpot)
        self._request_metric = _Children(m.request_metric)
        self._predicted_ttft = _Children(m.request_predicted_ttft)
        self._predicted_tpot = _Children(m.request_predicted_tpot)
        self._prediction_durations = {
            LATENCY_TTFT: (_Children(m.request_ttft_prediction_duration),
                           TYPE_TTFT_PREDICTION_DURATION),
            LATENCY_TPOT: (_Children(m.request_tpot_prediction_duration),
                           TYPE_TPOT_PREDICTION_DURATION)}
        self._slo_violations = _Children(m.slo_violations)
        # --- llm-d twins ---
        bounds = getattr(m, "llmd_bounds", None)
        b = bounds if isinstance(bounds, LabelBounds) else LabelBounds()
        self._l_total = _RequestChildren(m.llmd_request_total, b)
        self._l_errors = _RequestChildren(m.llmd_request_error_total, b)
        self._l_sizes = _RequestChildren(m.llmd_request_sizes, b)
        self._l_running = _RequestChildren(m.llmd_running_requests, b)
        self._l_duration = _RequestChildren(m.llmd_request_duration, b)
        self._l_input = _RequestChildren(m.llmd_input_tokens, b)
        self._l_output = _RequestChildren(m.llmd_output_tokens, b)
        self._l_cached = _RequestChildren(m.llmd_cached_tokens, b)
        self._l_ntpot = _RequestChildren(m.llmd_ntpot, b)
        self._l_response_sizes = _RequestChildren(m.llmd_response_sizes, b)
        self._l_ttft = _RequestChildren(m.llmd_request_ttft, b)
        self._l_tpot = _RequestChildren(m.llmd_request_tpot, b)
        self._l_prefix: tuple[_FastChild, _FastChild] | None = None
        self._l_latency: dict[tuple[str, ...], _FastChild] = {}
        # The request whose response body was just seen (responded() runs right before
        # completed(), in one call): its TTFT, when not streamed, is its duration.
        self._seen_unstreamed: LLMRequest | None = None
        # llm-d's P/D decision counters (disagg/metrics.go): the handler behind classify.
        self._pd: Callable[[LLMRequest, SchedulingResult], None] | None = None
        handler = getattr(classify, "__self__", None)
        htype = getattr(handler, "type_name", None)
        if htype in (PD_HANDLER_TYPE, DISAGG_HANDLER_TYPE):
            self._pd = self._pd_recorder(handler, m, b)

    @staticmethod
    def _pd_recorder(handler: Any, m: EppMetrics,
                     bounds: LabelBounds) -> Callable[[LLMRequest, SchedulingResult], None]:
        """llm-d's RecordPDDecision (pd-profile-handler: prefill-decode when its decider
        ran the prefill profile) or RecordDisaggDecision (disagg-profile-handler: by the
        encode and prefill profiles that ran and produced a result)."""
        name, htype = str(handler.name), str(handler.type_name)
        prefill, encode = str(handler.prefill_profile), str(handler.encode_profile)
        counter = m.llmd_pd_decisions if htype == PD_HANDLER_TYPE else m.llmd_disagg_decisions
        children: dict[tuple[str, str], _FastChild] = {}

        def record(request: LLMRequest, result: SchedulingResult) -> None:
            results = result.profile_results
            if htype == PD_HANDLER_TYPE:
                decision = (DECISION_PREFILL_DECODE if prefill in results
                            else DECISION_DECODE_ONLY)
            else:
                p = results.get(prefill) is not None
                if results.get(encode) is not None:
                    decision = DECISION_ENCODE_PREFILL_DECODE if p else DECISION_ENCODE_DECODE
                else:
                    decision = DECISION_PREFILL_DECODE if p else DECISION_DECODE_ONLY
            key = (request.target_model or DECISION_UNKNOWN_MODEL, decision)
            child = children.get(key)
            if child is None:
                if len(children) >= _MAX_CACHED:
                    children.clear()
                child = children[key] = counter.labels(
                    name, htype, bounds.models(key[0]), decision)
            child.inc()

        return record

    def scheduled(self, request: LLMRequest, result: SchedulingResult, seconds: float) -> None:
        m = self.metrics
        m.scheduler_e2e.observe(seconds)
        e = result.primary.endpoints[0]
        self._attempts.get(SCHEDULER_SUCCESS, request.target_model, e.name, e.namespace,
                           str(e.port)).inc()

    def record_attempt_failed(self, request: LLMRequest, seconds: float) -> None:
        """The scheduler raised: a failed attempt (no endpoint labels), and its latency."""
        self.metrics.scheduler_e2e.observe(seconds)
        self._attempts.get(SCHEDULER_FAILURE, request.target_model, "", "", "").inc()

    def decided(self, request: LLMRequest, result: SchedulingResult,
                set_headers: dict[str, str], response_headers: dict[str, str]) -> None:
        m = self.metrics
        state = request.plugin_state
        if state:
            self._record_prediction_durations(request)
            hit = state.get(keys.PLUGIN_STATE_PREFIX_HIT_RATIO)
            if hit is not None:
                m.prefix_hit_ratio.observe(hit)
                self._prefix_children()[0].observe(hit)
            hit_bytes = state.get(keys.PLUGIN_STATE_PREFIX_HIT_BYTES)
            if hit_bytes is not None:
                m.prefix_hit_bytes.observe(hit_bytes)
                self._prefix_children()[1].observe(hit_bytes)
        if self._classify is not None:
            m.pd_decisions.labels(self._classify(result)).inc()
            if self._pd is not None:
                self._pd(request, result)
        model, target = request.incoming_model, request.target_model
        key = (model, target, request.fairness_id, request.priority)
        self._total.get(model, target, str(request.priority)).inc()
        self._l_total.get(key).inc()
        size = request.request_size_bytes
        self._request_sizes.get(model, target).observe(size)
        self._l_sizes.get(key).observe(size)
        if model:  # as GIE: no running-requests series for an empty model name
            self._running.get(model).inc()
            self._l_running.get(key).inc()

    def failed(self, request: LLMRequest, status: int, message: str | None) -> None:
        if request.plugin_state:
            self._record_prediction_durations(request)
        code = gie_error_code(status)
        self.metrics.request_error_total.labels(
            request.incoming_model, request.target_model, code).inc()
        self._l_errors.get_with((request.incoming_model, request.target_model,
                                 request.fairness_id, request.priority), code).inc()

    def responded(self, request: LLMRequest, status: int, response: ResponseStats) -> None:
        model, target = request.incoming_model, request.target_model
        key = (model, target, request.fairness_id, request.priority)
        self._response_sizes.get(model, target).observe(response.size)
        self._l_response_sizes.get(key).observe(response.size)
        ttft = response.ttft
        if ttft is not None:
            self._ttft.get(model, target).observe(ttft)
            self._request_metric.get(model, target, TYPE_TTFT).set(ttft)
            self._l_ttft.get_with(key, "true").observe(ttft)
        elif response.size:
            # llm-d: a response that is not streamed has its first byte at its end.
            self._seen_unstreamed = request
        if response.tpot is not None:
            self._tpot.get(model, target).observe(response.tpot)
            self._request_metric.get(model, target, TYPE_TPOT).set(response.tpot)
            self._l_tpot.get(key).observe(response.tpot)
        latency = _identity(self.metrics.latency_identity)
        if latency is not None and (ttft is not None or response.tpot is not None):
            if ttft is not None:
                self._latency_gauge(latency, model, target, TYPE_TTFT).set(ttft)
            if response.tpot is not None:
                self._latency_gauge(latency, model, target, TYPE_TPOT).set(response.tpot)

    def completed(self, request: LLMRequest, status: int, aborted: bool,
                  usage: Usage | None, seconds: float) -> None:
        model, target = request.incoming_model, request.target_model
        key = (model, target, request.fairness_id, request.priority)
        if self._seen_unstreamed is not None:
            if self._seen_unstreamed is request and seconds > 0:
                self._l_ttft.get_with(key, "true" if request.stream else "false").observe(
                    seconds)
            self._seen_unstreamed = None
        if request.plugin_state:
            self._record_latency_outcome(request)
        if model:
            self._running.get(model).dec()
            self._l_running.get(key).dec()
        if not aborted and 200 <= status < 300:
            self._duration.get(model, target).observe(seconds)
            self._l_duration.get(key).observe(seconds)
            if usage is not None:
                # As GIE: token counts of 0 are not observed (cached tokens are).
                if usage.prompt_tokens:
                    self._input.get(model, target).observe(usage.prompt_tokens)
                    self._l_input.get(key).observe(usage.prompt_tokens)
                out = usage.completion_tokens
                if out:
                    self._output.get(model, target).observe(out)
                    self._l_output.get(key).observe(out)
                    if seconds > 0:
                        self._ntpot.get(model, target).observe(seconds / out)
                        self._l_ntpot.get(key).observe(seconds / out)
                if usage.cached_tokens is not None:
                    self._cached.get(model, target).observe(usage.cached_tokens)
                    self._l_cached.get(key).observe(usage.cached_tokens)
        elif status >= 400:
            self.metrics.request_error_total.labels(model, target, ERROR_CODE_MODEL_SERVER).inc()
            self._l_errors.get_with(key, ERROR_CODE_MODEL_SERVER).inc()

    def _prefix_children(self) -> tuple[_FastChild, _FastChild]:
        """llm-d's prefix hit ratio / bytes children, labelled with the prefix plugin."""
        c = self._l_prefix
        if c is None:
            m = self.metrics
            ident = _identity(m.prefix_identity) or ("", "")
            c = self._l_prefix = (m.llmd_prefix_hit_ratio.labels(*ident),
                                  m.llmd_prefix_hit_bytes.labels(*ident))
        return c

    def _latency_gauge(self, ident: tuple[str, str], model: str, target: str,
                       kind: str) -> _FastChild:
        """llm-d's inference_request_metric child of the latency plugin ``ident``."""
        k = ("g", model, target, kind)
        child = self._l_latency.get(k)
        if child is None:
            child = self._l_latency[k] = self.metrics.llmd_request_metric.labels(
                *ident, model, target, kind)
        return child

    def _latency_child(self, metric: _FastFamily, tag: str, ident: tuple[str, str],
                       *values: str) -> _FastChild:
        k = (tag, *values)
        child = self._l_latency.get(k)
        if child is None:
            child = self._l_latency[k] = metric.labels(*ident, *values)
        return child

    # --- the latency predictor's metrics (GIE records them in its predicted-latency
    # plugins; here the plugins leave them in plugin_state: epp/latency/types.py) ---

    def _record_prediction_durations(self, request: LLMRequest) -> None:
        """How long the request's predictions took (GIE's
        RecordRequestTTFTPredictionDuration / …TPOT…, and the gauge's
        ``*_prediction_duration`` types), once each."""
        durations = request.plugin_state.pop(keys.PLUGIN_STATE_LATENCY_DURATIONS, None)
        if not durations:
            return
        model, target = request.incoming_model, request.target_model
        m = self.metrics
        ident = _identity(m.latency_identity) or ("", "")
        for kind, seconds in durations:
            entry = self._prediction_durations.get(kind)
            if entry is None or seconds < 0:
                continue
            children, gauge_type = entry
            children.get(model, target).observe(seconds)
            self._request_metric.get(model, target, gauge_type).set(seconds)
            llmd = (m.llmd_ttft_prediction_duration if kind == LATENCY_TTFT
                    else m.llmd_tpot_prediction_duration)
            self._latency_child(llmd, kind, ident, model, target).observe(seconds)
            self._latency_gauge(ident, model, target, gauge_type).set(seconds)

    def _record_latency_outcome(self, request: LLMRequest) -> None:
        """Predicted latencies and SLO checks of a finished request (GIE's
        RecordRequestPredictedTTFT / …TPOT and RecordRequest{TTFT,TPOT}WithSLO), and any
        prediction durations not yet recorded (sampled TPOT predictions)."""
        self._record_prediction_durations(request)
        outcome: LatencyOutcome | None = request.plugin_state.pop(
            keys.PLUGIN_STATE_LATENCY_OUTCOME, None)
        if outcome is None:
            return
        model, target = request.incoming_model, request.target_model
        m = self.metrics
        ident = _identity(m.latency_identity) or ("", "")
        if outcome.predicted_ttft_s is not None and outcome.predicted_ttft_s >= 0:
            self._predicted_ttft.get(model, target).observe(outcome.predicted_ttft_s)
            self._request_metric.get(model, target, TYPE_PREDICTED_TTFT).set(
                outcome.predicted_ttft_s)
            self._latency_child(m.llmd_predicted_ttft, "pttft", ident, model, target).observe(
                outcome.predicted_ttft_s)
            self._latency_gauge(ident, model, target, TYPE_PREDICTED_TTFT).set(
                outcome.predicted_ttft_s)
        if outcome.predicted_tpot_s is not None and outcome.predicted_tpot_s >= 0:
            self._predicted_tpot.get(model, target).observe(outcome.predicted_tpot_s)
            self._request_metric.get(model, target, TYPE_PREDICTED_TPOT).set(
                outcome.predicted_tpot_s)
            self._latency_child(m.llmd_predicted_tpot, "ptpot", ident, model, target).observe(
                outcome.predicted_tpot_s)
            self._latency_gauge(ident, model, target, TYPE_PREDICTED_TPOT).set(
                outcome.predicted_tpot_s)
        for violated, kind, gauge_type in (
                (outcome.ttft_violated, TYPE_TTFT, TYPE_TTFT_SLO_VIOLATION),
                (outcome.tpot_violated, TYPE_TPOT, TYPE_TPOT_SLO_VIOLATION)):
            if violated is None:
                continue
            self._request_metric.get(model, target, gauge_type).set(1 if violated else 0)
            self._latency_gauge(ident, model, target, gauge_type).set(1 if violated else 0)
            if violated:
                self._slo_violations.get(model, target, kind).inc()
                self._latency_child(m.llmd_slo_violations, "slo", ident, model, target,
                                    kind).inc()
