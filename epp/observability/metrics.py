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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epp import __version__, keys
from epp.datastore.store import Datastore
from epp.flowcontrol.metrics import FlowControlMetrics
from epp.framework.interfaces import Plugin
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
        return [kv, q, running, ready, per_pod, *self._per_role(eps)]

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
            self._flow_control = FlowControlMetrics(self.registry, self.pool_name)
        return self._flow_control

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
            hit_bytes = state.get(keys.PLUGIN_STATE_PREFIX_HIT_BYTES)
            if hit_bytes is not None:
                m.prefix_hit_bytes.observe(hit_bytes)
        if self._classify is not None:
            m.pd_decisions.labels(self._classify(result)).inc()
        model, target = request.incoming_model, request.target_model
        self._total.get(model, target, str(request.priority)).inc()
        self._request_sizes.get(model, target).observe(request.request_size_bytes)
        if model:  # as GIE: no running-requests series for an empty model name
            self._running.get(model).inc()

    def failed(self, request: LLMRequest, status: int, message: str | None) -> None:
        if request.plugin_state:
            self._record_prediction_durations(request)
        self.metrics.request_error_total.labels(
            request.incoming_model, request.target_model, gie_error_code(status)).inc()

    def responded(self, request: LLMRequest, status: int, response: ResponseStats) -> None:
        model, target = request.incoming_model, request.target_model
        self._response_sizes.get(model, target).observe(response.size)
        if response.ttft is not None:
            self._ttft.get(model, target).observe(response.ttft)
            self._request_metric.get(model, target, TYPE_TTFT).set(response.ttft)
        if response.tpot is not None:
            self._tpot.get(model, target).observe(response.tpot)
            self._request_metric.get(model, target, TYPE_TPOT).set(response.tpot)

    def completed(self, request: LLMRequest, status: int, aborted: bool,
                  usage: Usage | None, seconds: float) -> None:
        model, target = request.incoming_model, request.target_model
        if request.plugin_state:
            self._record_latency_outcome(request)
        if model:
            self._running.get(model).dec()
        if not aborted and 200 <= status < 300:
            self._duration.get(model, target).observe(seconds)
            if usage is not None:
                # As GIE: token counts of 0 are not observed (cached tokens are).
                if usage.prompt_tokens:
                    self._input.get(model, target).observe(usage.prompt_tokens)
                out = usage.completion_tokens
                if out:
                    self._output.get(model, target).observe(out)
                    if seconds > 0:
                        self._ntpot.get(model, target).observe(seconds / out)
                if usage.cached_tokens is not None:
                    self._cached.get(model, target).observe(usage.cached_tokens)
        elif status >= 400:
            self.metrics.request_error_total.labels(model, target, ERROR_CODE_MODEL_SERVER).inc()

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
        for kind, seconds in durations:
            entry = self._prediction_durations.get(kind)
            if entry is None or seconds < 0:
                continue
            children, gauge_type = entry
            children.get(model, target).observe(seconds)
            self._request_metric.get(model, target, gauge_type).set(seconds)

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
        if outcome.predicted_ttft_s is not None and outcome.predicted_ttft_s >= 0:
            self._predicted_ttft.get(model, target).observe(outcome.predicted_ttft_s)
            self._request_metric.get(model, target, TYPE_PREDICTED_TTFT).set(
                outcome.predicted_ttft_s)
        if outcome.predicted_tpot_s is not None and outcome.predicted_tpot_s >= 0:
            self._predicted_tpot.get(model, target).observe(outcome.predicted_tpot_s)
            self._request_metric.get(model, target, TYPE_PREDICTED_TPOT).set(
                outcome.predicted_tpot_s)
        for violated, kind, gauge_type in (
                (outcome.ttft_violated, TYPE_TTFT, TYPE_TTFT_SLO_VIOLATION),
                (outcome.tpot_violated, TYPE_TPOT, TYPE_TPOT_SLO_VIOLATION)):
            if violated is None:
                continue
            self._request_metric.get(model, target, gauge_type).set(1 if violated else 0)
            if violated:
                self._slo_violations.get(model, target, kind).inc()
