"""The server's object graph, wired from validated options and the built config.

:func:`wire` is a plain function: it makes the objects and connects them — datastore,
metrics, health, the InferenceObjective/InferenceModelRewrite store, admission (the flow
controller under the ``flowControl`` feature gate, otherwise GIE's legacy rule over the
config's saturation detector), the scheduling core and its Director, the scraper, the
endpoints file and objectives file sources, the ext_proc servicer — and binds no port,
starts no task and reads no file.
Starting them, in order and each with its cleanup, is epp/server/app.py's job.

Plugins are reached only through the framework's Protocols (epp/framework/interfaces.py):
:class:`~epp.framework.interfaces.PrefixIndexOwner` feeds the prefix index gauge,
:class:`~epp.framework.interfaces.NeedsResponse` names the plugins that need response
bodies; the server names no plugin type.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import Counter

from epp.config.loader import BuiltConfig
from epp.datalayer.config import attach_sources, polling_sources, scraper_settings
from epp.datalayer.polling import PollingRunner
from epp.datalayer.scraper import MetricsScraper
from epp.datastore.objectives import ObjectiveStore
from epp.datastore.store import Datastore, RemovalListener
from epp.discovery.objectives_file import ObjectivesFileSource
from epp.discovery.static import StaticFileSource
from epp.flowcontrol import FlowController, detector_saturation
from epp.flowcontrol.eviction import RequestEvictor, enable_eviction
from epp.framework.interfaces import (
    AdmissionPlugin,
    EndpointRemoved,
    NeedsResponse,
    Plugin,
    PluginTimer,
    PrefixIndexOwner,
    PrepareDataPlugin,
    RequestHeaderProcessor,
    ResponseMeasured,
    Screener,
    no_timer,
)
from epp.handlers.extproc import ExtProcServicer
from epp.observability.explain import DecisionLog
from epp.observability.metrics import EppMetrics
from epp.observability.tracing import Tracing
from epp.requestcontrol.director import Decision, Director, SchedulingCore
from epp.scheduling.plugins.reporter import response_metadata
from epp.scheduling.types import Endpoint, LLMRequest, Metrics
from epp.server.drain import StreamTracker, TrackedExtProc
from epp.server.health import HealthReporter
from epp.server.options import (
    ConfigDiscovery,
    EndpointsFile,
    KubernetesDiscovery,
    ServePlan,
    StaticEndpoints,
)

T = TypeVar("T")

log = logging.getLogger(__name__)


class PluginTimings:
    """The :class:`PluginTimer` the config is built with.

    The config is built before what receives the timings exists (the scheduling core
    takes the built scheduler), so this starts as a no-op and :func:`wire` connects it.
    """

    def __init__(self) -> None:
        self._sink: PluginTimer = no_timer

    def connect(self, sink: PluginTimer) -> None:
        self._sink = sink

    def __call__(self, extension_point: str, plugin: Plugin, seconds: float) -> None:
        self._sink(extension_point, plugin, seconds)


class StreamOutcomes:
    """Counts ext_proc streams by outcome (``epp_extproc_streams_total``); the label
    children are cached, ``labels()`` is not free."""

    def __init__(self, metrics: EppMetrics) -> None:
        self._counter = metrics.extproc_streams
        self._children: dict[str, Counter] = {}

    def __call__(self, outcome: str) -> None:
        child = self._children.get(outcome)
        if child is None:
            child = self._children[outcome] = self._counter.labels(outcome)
        child.inc()


@dataclass(frozen=True)
class ServerParts:
    """What :func:`wire` makes; none of it started."""

    plan: ServePlan
    built: BuiltConfig
    store: Datastore
    metrics: EppMetrics
    health: HealthReporter
    decisions: DecisionLog | None  # --explain-history
    tracing: Tracing | None  # --tracing
    core: SchedulingCore
    director: Director
    scraper: MetricsScraper | None  # None with --no-metrics-scraping
    endpoints_file: StaticFileSource | None  # --endpoints-file
    # InferenceObjectives and model rewrites: filled by Kubernetes discovery (pool mode)
    # or the objectives file, read by the Directors.
    objectives: ObjectiveStore
    objectives_file: ObjectivesFileSource | None  # --objectives-file
    stream_ended: Callable[[str], None]  # ext_proc stream outcomes, local and from fronts
    tracker: StreamTracker  # ext_proc streams of this process
    ext_proc: TrackedExtProc | None  # the ext_proc servicer; None with --workers N
    # The flowControl feature gate's flow controller (the core's admission; not started);
    # None without the gate (legacy admission).
    flow_control: FlowController | None = None
    pollers: PollingRunner | None = None  # the data layer's polling sources (dcgm-data-source)


def wire(plan: ServePlan, built: BuiltConfig, timings: PluginTimings,
         tracing: Tracing | None) -> ServerParts:
    """The object graph for ``plan`` and ``built`` (made with ``timings`` as its timer).

    ``tracing`` is made by the caller, which owns its shutdown; Kubernetes discovery is
    not here either: it needs a connection to the API server (epp/server/app.py).
    """
    o = plan.options
    store = Datastore() if built.flow_control is None else NotifyingDatastore()
    metrics = EppMetrics(store, pool_label(plan))
    # llm-d series' plugin labels, and the plugins that record llm-d series (bind_metrics;
    # the saturation detector may be the loader's default, outside the plugins).
    metrics.bind_plugins([*built.plugins.values(), *_present(built.saturation_detector)])
    # Admission (SchedulingCore.admit): the config's saturation detector over the
    # routable endpoints (the subset hint's, per request) feeds GIE's legacy rule, or,
    # under the flowControl gate, the flow controller's dispatch.
    saturation = (detector_saturation(built.saturation_detector, store.routable)
                  if built.saturation_detector is not None else None)
    flow_control: FlowController | None = None
    if built.flow_control is not None:
        if saturation is None:  # the loader always sets a detector; a hand-made config
            saturation = _never_saturated
        flow_control = FlowController(built.flow_control, saturation,
                                      metrics=metrics.flow_control())
        # Endpoint metrics refreshed, endpoints added or removed: saturation may have
        # dropped (and the pool saturation gauge follows it).
        assert isinstance(store, NotifyingDatastore)
        store.on_change = flow_control.notify
    # llm-d's flowControl.enableEviction: sheddable in-flight requests evicted for blocked
    # higher bands (a PreRequest/ResponseComplete tracker + the streams' eviction signal).
    evictor = (enable_eviction(flow_control, getattr(built.saturation_detector, "type_name",
                                                     None),
                               o.scraping.scrape.interval_s,
                               o.scraping.scrape.staleness_threshold_s, plan.workers,
                               metrics=metrics.eviction_metrics())
               if flow_control is not None and flow_control.config.enable_eviction else None)
    evicting: tuple[RequestEvictor, ...] = (evictor,) if evictor is not None else ()
    health = HealthReporter(leader_election=isinstance(plan.source, KubernetesDiscovery)
                            and plan.source.election is not None)
    health.require(lambda: store.synced)
    endpoints_file: StaticFileSource | None = None
    if isinstance(plan.source, StaticEndpoints):
        store.set_endpoints(plan.source.endpoints)
    elif isinstance(plan.source, EndpointsFile):
        endpoints_file = StaticFileSource(plan.source.path, store, plan.source.poll_interval_s)
    elif isinstance(plan.source, ConfigDiscovery) and built.discovery is not None:
        # llm-d's file-discovery mode: the plugin feeds the datastore through the same
        # file source as --endpoints-file, with its own reader (epp/discovery/llmd_file.py).
        endpoints_file = built.discovery.endpoint_source(store, plan.source.poll_interval_s)
        log.info("EPP starting (file discovery mode): pool %s, namespace %s, discovery "
                 "plugin %s (%s)", plan.source.pool_name, plan.source.pool_namespace,
                 built.discovery.name, built.discovery.type_name)
        log.info("file-discovery mode: Kubernetes-only features are inactive "
                 "(InferenceModelRewrite, InferenceObjective reconciler, and any "
                 "k8s-notification-source data layer plugins); --objectives-file gives "
                 "objectives and rewrites without Kubernetes")
    for plugin in built.endpoint_removed:
        store.on_removed(_forget_removed(plugin))
    objectives = ObjectiveStore()
    objectives_file: ObjectivesFileSource | None = None
    if plan.objectives_file is not None:
        objectives_file = ObjectivesFileSource(plan.objectives_file.path, objectives,
                                               plan.objectives_file.poll_interval_s)
    history = o.observability.explain_history
    decisions = DecisionLog(history) if history > 0 else None
    owners = [p for p in built.plugins.values() if isinstance(p, PrefixIndexOwner)]
    if owners:
        metrics.track_prefix_index_size(
            lambda: float(sum(p.prefix_index_size() for p in owners)))
    for owner in built.plugins.values():  # plugins with their own series (precise prefix)
        collector = getattr(owner, "metrics_collector", None)
        if callable(collector):
            metrics.registry.register(collector())
    core_type = (SubsetIgnoringCore if o.routing.disable_endpoint_subset_filter
                 else SchedulingCore)
    core = core_type(store, built.scheduler, metrics, (*built.pre_request, *evicting),
                          (*built.response_complete, *evicting), built.request_headers,
                          built.response_headers,
                          explain_header=o.observability.enable_explain_header,
                          decisions=decisions, tracing=tracing, objectives=objectives,
                          prepare_data=_of(built, PrepareDataPlugin),
                          admission=_of(built, AdmissionPlugin),
                          response_measured=_of(built, ResponseMeasured),
                          flow_control=flow_control, saturation=saturation,
                          request_header_processors=_of(built, RequestHeaderProcessor),
                          screeners=_of(built, Screener))
    core.emit_endpoint_scores = o.routing.emit_endpoint_scores  # llm-d's flag
    timings.connect(metrics.observe_plugin if tracing is None
                    else _fan_out(metrics.observe_plugin, core.plugin_timer))
    director = Director(core, built.parser_plugin)
    scraper: MetricsScraper | None = None
    # The config's data layer (its metrics source and extractor) over the scrape flags.
    scraping = scraper_settings(built.data_layer, o.scraping.enabled, o.scraping.scrape,
                                o.scraping.metric_overrides)
    attach_sources(built.data_layer, store)  # endpoint-notification-source extractors
    polled = polling_sources(built.data_layer)  # dcgm-data-source
    pollers = (PollingRunner(store, polled, o.scraping.scrape.interval_s, metrics=metrics)
               if polled else None)
    if scraping is not None:
        scraper = MetricsScraper(store, *scraping, metrics=metrics)
        # Envoy's word that a pod refused the connection (response attributes): out of
        # the candidates now, back at the next scrape that gets an answer.
        core.on_upstream_failure = scraper.report_unreachable
    stream_ended = StreamOutcomes(metrics)
    tracker = StreamTracker()
    ext_proc: TrackedExtProc | None = None
    if plan.workers == 1:
        ext_proc = TrackedExtProc(
            ExtProcServicer(director, o.limits.max_request_body_bytes,
                            on_stream_end=stream_ended,
                            max_headers=o.limits.max_request_headers,
                            body_consumers=body_consumers(built),
                            response_metadata=response_metadata(built.response_usage_metadata),
                            evictions=evictor),
            tracker)
    return ServerParts(plan=plan, built=built, store=store, metrics=metrics, health=health,
                       decisions=decisions, tracing=tracing, core=core, director=director,
                       scraper=scraper, endpoints_file=endpoints_file,
                       objectives=objectives, objectives_file=objectives_file,
                       stream_ended=stream_ended, tracker=tracker, ext_proc=ext_proc,
                       flow_control=flow_control, pollers=pollers)


def _present(plugin: Plugin | None) -> tuple[Plugin, ...]:
    return (plugin,) if plugin is not None else ()


def pool_label(plan: ServePlan) -> str:
    """The ``name`` label of the ``inference_pool_*`` gauges: GIE's ``pool.Name`` — the
    InferencePool's name in pool mode; in standalone mode (``--endpoint-selector``) GIE
    names its endpoint pool after ``--pool-name``, so that when given; otherwise (and for
    ``--endpoints``/``--endpoints-file``) ``static``; with the config's discovery plugin
    (llm-d) ``--pool-name``, else ``epp``."""
    source = plan.source
    if isinstance(source, KubernetesDiscovery):
        return source.options.pool_name or plan.options.kubernetes.pool_name or "static"
    if isinstance(source, ConfigDiscovery):  # llm-d's file-discovery mode: default "epp"
        return source.pool_name
    return "static"


class SubsetIgnoringCore(SchedulingCore):
    """``--disable-endpoint-subset-filter`` (GIE's flag): Envoy's subset hint is ignored,
    every decision picks from the whole pool (with ``--workers N`` too: the fronts' hints
    reach this core's :meth:`decide`)."""

    def decide(self, request: LLMRequest, subset: Sequence[str] | None) -> Decision:
        return super().decide(request, None)

    async def decide_prepared(self, request: LLMRequest,
                              subset: Sequence[str] | None) -> Decision:
        return await super().decide_prepared(request, None)

    async def admit(self, request: LLMRequest, subset: Sequence[str] | None) -> None:
        await super().admit(request, None)


class NotifyingDatastore(Datastore):
    """A :class:`Datastore` that calls :attr:`on_change` after every change of endpoint
    metrics (the scraper's commits) or of the endpoint set — where flow control learns
    that saturation may have dropped (``FlowController.notify``: cheap, coalesced)."""

    def __init__(self) -> None:
        super().__init__()
        self.on_change: Callable[[], None] | None = None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> tuple[list[str], list[str]]:
        result = super().set_endpoints(endpoints)
        self._changed()
        return result

    def update_metrics(self, key: str, metrics: Metrics) -> bool:
        updated = super().update_metrics(key, metrics)
        if updated:
            self._changed()
        return updated

    def update_metrics_many(self, updates: Mapping[str, Metrics]) -> int:
        n = super().update_metrics_many(updates)
        if n:
            self._changed()
        return n


def _never_saturated(subset: Sequence[str] | None) -> float:
    return 0.0


def _of(built: BuiltConfig, kind: type[T]) -> list[T]:
    """The config's plugins that are a ``kind`` (a request-control hook), in order."""
    return [p for p in built.plugins.values() if isinstance(p, kind)]


def body_consumers(built: BuiltConfig) -> list[str]:
    """Configured plugins that declare they need response bodies."""
    return [name for name, p in built.plugins.items()
            if isinstance(p, NeedsResponse) and "body" in p.response_needs]


def _forget_removed(plugin: EndpointRemoved) -> RemovalListener:
    """Tells ``plugin`` when an endpoint leaves the pool (it drops what it kept for it)."""
    return lambda ep: plugin.endpoint_removed(ep.key)


def _fan_out(first: PluginTimer, second: PluginTimer) -> PluginTimer:
    def timer(extension_point: str, plugin: Plugin, seconds: float) -> None:
        first(extension_point, plugin, seconds)
        second(extension_point, plugin, seconds)

    return timer
