"""Prometheus metrics with GIE's names (design.md §8), on a registry owned by the server.

No module-level registry: each :class:`EppMetrics` owns a ``CollectorRegistry``, so tests
and several servers in one process do not collide. Pool-level gauges are computed from the
datastore when scraped, costing nothing per request. Request metrics are recorded by
:class:`MetricsObserver`, the scheduling core's always-on decision observer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epp import __version__, keys
from epp.datastore.store import Datastore
from epp.framework.interfaces import Plugin
from epp.observability.observer import Observer
from epp.parsing.usage import Usage
from epp.scheduling.plugins.roles import endpoint_role
from epp.scheduling.types import Endpoint, LLMRequest, SchedulingResult

_LATENCY_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5,
                    6, 8, 10, 15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900,
                    1200, 1800, 2700, 3600)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778,
                  65536, 131072, 262144, 524288, 1048576)
_SCHED_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


class _PoolCollector(Collector):
    def __init__(self, store: Datastore, pool_name: str) -> None:
        self._store = store
        self._pool = pool_name

    def collect(self) -> Iterable[GaugeMetricFamily]:
        eps = self._store.snapshot()
        n = len(eps)
        kv = GaugeMetricFamily("inference_pool_average_kv_cache_utilization",
                               "The average kv cache utilization for an inference server pool.",
                               labels=["name"])
        q = GaugeMetricFamily("inference_pool_average_queue_size",
                              "The average number of requests pending in the model server queue.",
                              labels=["name"])
        ready = GaugeMetricFamily("inference_pool_ready_pods",
                                  "The number of ready pods in the inference server pool.",
                                  labels=["name"])
        per_pod = GaugeMetricFamily("inference_pool_per_pod_queue_size",
                                    "The total number of requests pending in the model server "
                                    "queue for each underlying pod.",
                                    labels=["name", "model_server_pod"])
        kv.add_metric([self._pool], sum(e.metrics.kv_cache_usage for e in eps) / n if n else 0.0)
        q.add_metric([self._pool],
                     sum(e.metrics.waiting_queue_size for e in eps) / n if n else 0.0)
        ready.add_metric([self._pool], n)
        for e in eps:
            per_pod.add_metric([self._pool, e.name], e.metrics.waiting_queue_size)
        return [kv, q, ready, per_pod, *self._per_role(eps)]

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
    def __init__(self, store: Datastore, pool_name: str = "static") -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name", "target_model_name"]
        self.request_total = Counter(
            "inference_objective_request_total",
            "Counter of inference objective requests broken out for each model and target model.",
            labels, registry=r)
        self.request_error_total = Counter(
            "inference_objective_request_error_total",
            "Counter of inference objective requests errors broken out for each model and "
            "target model.", [*labels, "error_code"], registry=r)
        self.request_duration = Histogram(
            "inference_objective_request_duration_seconds",
            "Inference objective response latency distribution in seconds for each model and "
            "target model.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.input_tokens = Histogram(
            "inference_objective_input_tokens",
            "Inference objective input token count distribution for requests in each model.",
            labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram(
            "inference_objective_output_tokens",
            "Inference objective output token count distribution for requests in each model.",
            labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.cached_tokens = Histogram(
            "inference_objective_prompt_cached_tokens",
            "Inference objective prompt cached token count distribution for requests in each "
            "model.", labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.running_requests = Gauge(
            "inference_objective_running_requests",
            "Inference objective number of running requests in each model.",
            ["model_name"], registry=r)
        self.scheduler_e2e = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "End-to-end scheduling latency distribution in seconds.",
            buckets=_SCHED_BUCKETS, registry=r)
        self.plugin_duration = Histogram(
            "inference_extension_plugin_duration_seconds",
            "Plugin processing latency distribution in seconds for each extension point, "
            "plugin type and plugin name.",
            ["extension_point", "plugin_type", "plugin_name"], buckets=_SCHED_BUCKETS,
            registry=r)
        self.prefix_hit_ratio = Histogram(
            "inference_extension_prefix_indexer_hit_ratio",
            "Ratio of the prompt's prefix blocks found in the chosen endpoint's cache "
            "(approximate prefix index) to all its blocks.",
            buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), registry=r)
        self._prefix_size = Gauge(
            "inference_extension_prefix_indexer_size",
            "Number of prefix blocks held in the approximate prefix index, all endpoints.",
            registry=r)
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
        info = Info("inference_extension", "General information of the current build of the "
                    "endpoint picker.", registry=r)
        info.info({"commit": "", "build_ref": __version__})
        r.register(_PoolCollector(store, pool_name))
        self.gangs = GangCollector()
        r.register(self.gangs)
        self._plugin_children: dict[tuple[str, int], Histogram] = {}

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
    """The request metrics of every decision (a DecisionObserver shared by all requests):
    requests, errors, running requests, scheduling latency, the prefix hit ratio, P/D
    decisions (``classify``: the profile handler's ``decision``, when it has one) and, at
    completion, latency and token counts of successful responses.

    Plugin latencies are not taken from ``plugin_timed``: the server wires
    :meth:`EppMetrics.observe_plugin` as the scheduler's PluginTimer when it builds the
    configuration, so they are recorded for every scheduling run.
    """

    def __init__(self, metrics: EppMetrics,
                 classify: Callable[[SchedulingResult], str] | None = None) -> None:
        self.metrics = metrics
        self._classify = classify

    def scheduled(self, request: LLMRequest, result: SchedulingResult, seconds: float) -> None:
        self.metrics.scheduler_e2e.observe(seconds)

    def decided(self, request: LLMRequest, result: SchedulingResult,
                set_headers: dict[str, str], response_headers: dict[str, str]) -> None:
        m = self.metrics
        hit = request.plugin_state.get(keys.PLUGIN_STATE_PREFIX_HIT_RATIO)
        if hit is not None:
            m.prefix_hit_ratio.observe(hit)
        if self._classify is not None:
            m.pd_decisions.labels(self._classify(result)).inc()
        m.request_total.labels(request.incoming_model, request.target_model).inc()
        m.running_requests.labels(request.incoming_model).inc()

    def failed(self, request: LLMRequest, status: int, message: str | None) -> None:
        self.metrics.request_error_total.labels(
            request.incoming_model, request.target_model, str(status)).inc()

    def completed(self, request: LLMRequest, status: int, aborted: bool,
                  usage: Usage | None, seconds: float) -> None:
        m = self.metrics
        m.running_requests.labels(request.incoming_model).dec()
        labels = (request.incoming_model, request.target_model)
        if not aborted and 200 <= status < 300:
            m.request_duration.labels(*labels).observe(seconds)
            if usage is not None:
                if usage.prompt_tokens is not None:
                    m.input_tokens.labels(*labels).observe(usage.prompt_tokens)
                if usage.completion_tokens is not None:
                    m.output_tokens.labels(*labels).observe(usage.completion_tokens)
                if usage.cached_tokens is not None:
                    m.cached_tokens.labels(*labels).observe(usage.cached_tokens)
        elif status >= 400:
            m.request_error_total.labels(*labels, str(status)).inc()
