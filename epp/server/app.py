"""The EPP server: explicit lifecycle (``start()``, ``stop(grace)``), one event loop.

Startup order: build the config and the metric mappings (fail fast), load endpoints
(fails fast on a bad file), bind the metrics, health and ext_proc ports (a port in use is
a clear error), start the model-server metrics scraper, then report SERVING on the health
services once the endpoint source has synced. Stop: endpoint source, scraper, then the
gRPC servers (with grace) and the metrics port.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import orjson
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp import keys
from epp.config.loader import BuiltConfig, load_and_build
from epp.datalayer.engines import EngineMappings, MappingOverrides
from epp.datalayer.scraper import MetricsScraper, ScrapeOptions, ScraperCollector
from epp.datastore.store import Datastore
from epp.discovery.kubeclient import KubeApi, connect
from epp.discovery.kubernetes import (
    KubernetesOptions,
    KubernetesSource,
    PoolSpec,
    parse_selector,
    parse_target_ports,
    resolve_namespace,
)
from epp.discovery.reflector import ReflectorOptions
from epp.discovery.static import StaticFileSource, parse_endpoints_arg
from epp.errors import ConfigError
from epp.handlers.extproc import ExtProcServicer
from epp.observability.explain import DecisionLog
from epp.observability.metrics import EppMetrics
from epp.observability.tracing import Tracing
from epp.scheduling.interfaces import Plugin
from epp.scheduling.plugins.prefix import ApproxPrefixCacheProducer
from epp.requestcontrol.director import Director, SchedulingCore
from epp.server.workers import CoreServer, FrontPool, check_port_free, front_argv
from epp.stack.procs import wait_port
from epp.server.leader import LeaderElectionOptions, LeaderElector, default_identity, lease_name
from epp.server.tls import load_key_pair, self_signed_key_pair

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 64 << 20


class StartupError(Exception):
    """The server cannot start (port in use, bad endpoints, bad config)."""


@dataclass
class ServeOptions:
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    bind_address: str = "0.0.0.0"
    config_file: str | None = None
    config_text: str | None = None
    endpoints: str | None = None
    endpoints_file: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY
    endpoints_poll_interval_s: float = 0.5
    # Kubernetes discovery (docs/kubernetes.md): an InferencePool, or standalone.
    pool_name: str | None = None
    pool_namespace: str | None = None
    pool_group: str = keys.K8S_POOL_GROUP
    endpoint_selector: str | None = None
    endpoint_target_ports: str | None = None
    kubeconfig: str | None = None
    watch_nodes: bool = True
    k8s_debounce_s: float = 0.05
    k8s_reflector: ReflectorOptions = field(default_factory=ReflectorOptions)
    # TLS on the ext_proc port (GIE serves it by default; here it is opt-in).
    secure_serving: bool = False
    cert_path: str | None = None
    # Leader election (active-passive); client-go's default timings.
    ha_enable_leader_election: bool = False
    ha_lease_duration_s: float = 15.0
    ha_renew_deadline_s: float = 10.0
    ha_retry_period_s: float = 2.0
    scrape_metrics: bool = True
    scrape: ScrapeOptions = field(default_factory=ScrapeOptions)
    metric_overrides: MappingOverrides = field(default_factory=MappingOverrides)
    # Observability (docs/observability.md).
    enable_explain_header: bool = False
    explain_history: int = 0
    metrics_auth_token: str | None = None  # bearer token required on /metrics and /debug/*
    tracing: bool = False
    # Protocol-front processes around this scheduling core (1 = all in this process).
    workers: int = 1
    log_level: str = "info"


class EppServer:
    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.store = Datastore()
        self.metrics = EppMetrics(self.store)
        self.built: BuiltConfig | None = None
        self.decisions: DecisionLog | None = None
        self.tracing: Tracing | None = None
        self._stream_outcomes: dict[str, Any] = {}
        self.director: Director | None = None
        self.core: SchedulingCore | None = None
        self._core_server: CoreServer | None = None
        self._fronts: FrontPool | None = None
        self._static_file: StaticFileSource | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._metrics_runner: web.AppRunner | None = None
        self._kube_api: KubeApi | None = None
        self.k8s_source: KubernetesSource | None = None
        self.elector: LeaderElector | None = None
        self.scraper: MetricsScraper | None = None

    async def start(self) -> None:
        o = self.options
        # Phase 1: everything that can be validated without binding a port.
        self.built = load_and_build(o.config_file, o.config_text, timer=self._plugin_timer)
        kube = self._kubernetes_options()
        if sum(x is not None for x in (o.endpoints, o.endpoints_file, kube)) != 1:
            raise ConfigError("give exactly one endpoint source: --endpoints ip:port[,…], "
                              "--endpoints-file FILE, --pool-name NAME (an InferencePool), or "
                              "--endpoint-selector k=v[,…] with --endpoint-target-ports "
                              "PORT[,…] (pods without the CRD)")
        if o.ha_enable_leader_election and kube is None:
            raise ConfigError("--ha-enable-leader-election needs a Kubernetes endpoint "
                              "source (--pool-name or --endpoint-selector)")
        if o.endpoints is not None:
            self.store.set_endpoints(parse_endpoints_arg(o.endpoints))
        elif kube is not None:
            await self._setup_kubernetes(kube)
        else:
            self._static_file = StaticFileSource(Path(o.endpoints_file or ""), self.store,
                                                 o.endpoints_poll_interval_s)
            self._static_file.load_initial()
        for plugin in self.built.endpoint_removed:
            self.store.on_removed(lambda ep, p=plugin: p.endpoint_removed(ep.key))
        self.decisions = DecisionLog(o.explain_history) if o.explain_history > 0 else None
        producers = [p for p in self.built.plugins.values()
                     if isinstance(p, ApproxPrefixCacheProducer)]
        if producers:
            self.metrics.track_prefix_index_size(
                lambda: float(sum(p.index.size() for p in producers)))
        self.tracing = Tracing() if o.tracing else None
        self.core = SchedulingCore(self.store, self.built.scheduler, self.metrics,
                                   self.built.pre_request, self.built.response_complete,
                                   self.built.request_headers, self.built.response_headers,
                                   explain_header=o.enable_explain_header,
                                   decisions=self.decisions, tracing=self.tracing)
        self.director = Director(self.core)
        scraper: MetricsScraper | None = None
        if o.scrape_metrics:
            scraper = MetricsScraper(self.store, o.scrape,
                                     EngineMappings(overrides=o.metric_overrides))

        # Phase 2: bind ports.
        try:
            await self._start_metrics()
            await self._start_health()
            if o.workers > 1:
                await self._start_fronts(o.workers)
            else:
                await self._start_ext_proc()
        except BaseException:
            await self.stop(0)
            raise
        if scraper is not None:
            self.metrics.registry.register(ScraperCollector(scraper))
            scraper.start()
            self.scraper = scraper
        if self._static_file is not None:
            self._static_file.start_polling()
        await self._update_health()
        if self.k8s_source is not None:
            await self.k8s_source.start()
        if self.elector is not None:
            self.elector.start()
        log.info("epp serving ext_proc on %s:%d (health %d, metrics %d), %d endpoints",
                 o.bind_address, o.grpc_port, o.grpc_health_port, o.metrics_port,
                 len(self.store))

    def _grpc_server(self, max_message: int) -> grpc.aio.Server:
        return grpc.aio.server(options=[
            # Without this a second process could bind the same port silently.
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
            # Accept Envoy's HTTP/2 keepalive PINGs (the shipped Envoy config sends them so
            # a hung EPP fails requests instead of hanging full-duplex streams forever).
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 1000),
            ("grpc.http2.max_ping_strikes", 0),
        ])

    def _bind(self, server: grpc.aio.Server, port: int, what: str,
              credentials: grpc.ServerCredentials | None = None) -> None:
        addr = f"{self.options.bind_address}:{port}"
        try:
            if credentials is not None:
                bound = server.add_secure_port(addr, credentials)
            else:
                bound = server.add_insecure_port(addr)
        except RuntimeError as e:
            raise StartupError(f"cannot listen for {what} on {addr}: {e} (port in use? pick "
                               "another with the matching --*-port flag)") from e
        if bound == 0:
            raise StartupError(f"cannot listen for {what} on {addr} (port in use?)")

    async def _start_ext_proc(self) -> None:
        assert self.director is not None
        # BUFFERED bodies arrive as one message: allow the body limit plus headroom, so an
        # oversized body is answered with 413 rather than a gRPC error.
        max_msg = self.options.max_request_body_bytes + (1 << 20)
        server = self._grpc_server(max_msg)
        pb_grpc.add_ExternalProcessorServicer_to_server(
            ExtProcServicer(self.director, self.options.max_request_body_bytes,
                            on_stream_end=self._stream_ended), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        credentials: grpc.ServerCredentials | None = None
        if self.options.secure_serving:
            # GIE's EPP serves TLS (self-signed unless --cert-path); gateways built for it
            # connect with TLS and skip verification. Health stays plaintext (probes).
            key, chain = (load_key_pair(self.options.cert_path) if self.options.cert_path
                          else self_signed_key_pair())
            credentials = grpc.ssl_server_credentials([(key, chain)])
        self._bind(server, self.options.grpc_port, "ext_proc gRPC", credentials)
        await server.start()
        self._grpc = server

    async def _start_fronts(self, n: int) -> None:
        """``--workers N``: N front processes serve ext_proc; this process is the core."""
        assert self.core is not None
        o = self.options
        try:
            check_port_free(o.bind_address, o.grpc_port)
        except OSError as e:
            raise StartupError(f"cannot listen for ext_proc gRPC on {o.bind_address}:"
                               f"{o.grpc_port}: {e.strerror or e} (port in use? pick another "
                               "with --grpc-port)") from e
        self._core_server = CoreServer(self.core, self._stream_ended)
        await self._core_server.start()
        self._fronts = FrontPool(n, front_argv(
            core_socket=self._core_server.path, grpc_port=o.grpc_port,
            bind_address=o.bind_address, max_body=o.max_request_body_bytes,
            secure_serving=o.secure_serving, cert_path=o.cert_path, grace=5.0,
            log_level=o.log_level))
        await self._fronts.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while self._core_server.fronts < n:
            if self._fronts.exited():
                raise StartupError(f"an ext_proc worker process exited with status "
                                   f"{self._fronts.exited()[0]} at startup (see its log above)")
            if loop.time() > deadline:
                raise StartupError(f"only {self._core_server.fronts} of {n} ext_proc workers "
                                   "connected within 30s")
            await asyncio.sleep(0.05)
        # A front connects before its gRPC server starts; wait until the port answers.
        await wait_port("127.0.0.1" if o.bind_address in ("0.0.0.0", "::") else o.bind_address,
                        o.grpc_port, timeout=30)

    async def _start_health(self) -> None:
        server = self._grpc_server(4 << 20)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self._bind(server, self.options.grpc_health_port, "gRPC health")
        await server.start()
        self._health_server = server

    def _plugin_timer(self, extension_point: str, plugin: Plugin, seconds: float) -> None:
        self.metrics.observe_plugin(extension_point, plugin, seconds)
        if self.tracing is not None and self.core is not None:
            self.core.plugin_timer(extension_point, plugin, seconds)

    def _stream_ended(self, outcome: str) -> None:
        child = self._stream_outcomes.get(outcome)
        if child is None:
            child = self._stream_outcomes[outcome] = self.metrics.extproc_streams.labels(outcome)
        child.inc()

    async def _start_metrics(self) -> None:
        registry = self.metrics.registry
        token = self.options.metrics_auth_token
        expected = f"Bearer {token}" if token else None

        def authorized(request: web.Request) -> bool:
            return expected is None or hmac.compare_digest(
                request.headers.get("Authorization", ""), expected)

        async def metrics(request: web.Request) -> web.Response:
            if not authorized(request):
                return web.Response(status=401, text="missing or wrong bearer token\n",
                                    headers={"WWW-Authenticate": "Bearer"})
            return web.Response(body=generate_latest(registry),
                                headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def decisions(request: web.Request) -> web.Response:
            if not authorized(request):
                return web.Response(status=401, text="missing or wrong bearer token\n",
                                    headers={"WWW-Authenticate": "Bearer"})
            if self.decisions is None:
                return web.json_response({"error": "decision history is off; start epp serve "
                                          "with --explain-history N"}, status=404)
            try:
                limit = int(request.query.get("limit", "20"))
            except ValueError:
                return web.json_response({"error": "limit must be an integer"}, status=400)
            return web.Response(body=orjson.dumps(self.decisions.last(limit)),
                                content_type="application/json")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/debug/decisions", decisions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.options.bind_address, self.options.metrics_port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise StartupError(f"cannot listen for metrics on {self.options.bind_address}:"
                               f"{self.options.metrics_port}: {e.strerror or e} (port in use? "
                               "pick another with --metrics-port)") from e
        self._metrics_runner = runner

    def _kubernetes_options(self) -> KubernetesOptions | None:
        """Kubernetes discovery options from the flags; None when none were given."""
        o = self.options
        if o.endpoint_target_ports is not None and o.endpoint_selector is None:
            raise ConfigError("--endpoint-target-ports needs --endpoint-selector")
        if o.endpoint_selector is not None:
            if o.endpoint_target_ports is None:
                raise ConfigError("--endpoint-selector needs --endpoint-target-ports "
                                  "PORT[,PORT…]")
            standalone = PoolSpec(parse_selector(o.endpoint_selector),
                                  parse_target_ports(o.endpoint_target_ports))
            return KubernetesOptions(namespace=resolve_namespace(o.pool_namespace),
                                     standalone=standalone, watch_nodes=o.watch_nodes,
                                     debounce_s=o.k8s_debounce_s, reflector=o.k8s_reflector)
        if o.pool_name is not None:
            if not o.pool_name:
                raise ConfigError("--pool-name: empty name")
            return KubernetesOptions(namespace=resolve_namespace(o.pool_namespace),
                                     pool_name=o.pool_name, pool_group=o.pool_group,
                                     watch_nodes=o.watch_nodes, debounce_s=o.k8s_debounce_s,
                                     reflector=o.k8s_reflector)
        if o.pool_namespace is not None or o.kubeconfig is not None:
            raise ConfigError("--pool-namespace/--kubeconfig need --pool-name or "
                              "--endpoint-selector")
        return None

    async def _setup_kubernetes(self, kube: KubernetesOptions) -> None:
        """Connect (fails fast on a missing or bad kubeconfig) and build the source and,
        when enabled, the leader elector; both start after the ports are bound."""
        o = self.options
        election: LeaderElectionOptions | None = None
        if o.ha_enable_leader_election:
            name = kube.pool_name or o.pool_name
            if not name:
                raise ConfigError("--ha-enable-leader-election in standalone mode needs "
                                  "--pool-name NAME to name the Lease")
            election = LeaderElectionOptions(
                namespace=kube.namespace, name=lease_name(kube.namespace, name),
                identity=default_identity(), lease_duration_s=o.ha_lease_duration_s,
                renew_deadline_s=o.ha_renew_deadline_s, retry_period_s=o.ha_retry_period_s)
        self._kube_api = await connect(o.kubeconfig)
        self.k8s_source = KubernetesSource(self._kube_api, self.store, kube,
                                           on_state_change=self._update_health)
        self.metrics.gangs.tracker = self.k8s_source.gangs
        if election is not None:
            self.elector = LeaderElector(self._kube_api, election,
                                         on_change=lambda _leader: self._update_health())

    async def _update_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        ready_now = (self.store.synced
                     and (self.k8s_source is None or self.k8s_source.ready)
                     and (self.elector is None or self.elector.is_leader))
        ready = serving if ready_now else not_serving
        await self._health.set(keys.HEALTH_LIVENESS, serving)
        await self._health.set(keys.HEALTH_READINESS, ready)
        await self._health.set(keys.HEALTH_EXT_PROC, ready)
        await self._health.set("", ready)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting streams, let running ones finish for ``grace`` seconds, close all."""
        if self.elector is not None:
            await self.elector.stop()  # releases the Lease: a standby takes over at once
            self.elector = None
        if self.k8s_source is not None:
            await self.k8s_source.stop()
            self.k8s_source = None
        if self._kube_api is not None:
            await self._kube_api.close()
            self._kube_api = None
        if self._static_file is not None:
            await self._static_file.stop()
        if self.scraper is not None:
            await self.scraper.stop()
            self.scraper = None
        if self._fronts is not None:
            await self._fronts.stop(grace)
            self._fronts = None
        if self._core_server is not None:
            await self._core_server.stop()
            self._core_server = None
        for server in (self._grpc, self._health_server):
            if server is not None:
                await server.stop(grace)
        self._grpc = self._health_server = None
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        if self.tracing is not None:
            self.tracing.shutdown()  # flushes spans still queued for export
            self.tracing = None


async def serve_forever(options: ServeOptions, stop_event: asyncio.Event) -> None:
    server = EppServer(options)
    await server.start()
    try:
        await stop_event.wait()
    finally:
        log.info("shutting down")
        await server.stop()
