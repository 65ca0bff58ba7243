"""The EPP server: explicit lifecycle (``start()``, ``stop(grace)``), one event loop.

Startup order: build the config and the metric mappings (fail fast), load endpoints
(fails fast on a bad file), bind the metrics, health and ext_proc ports (a port in use is
a clear error), start the model-server metrics scraper, then report SERVING on the health
services once the endpoint source has synced. Shutdown (:func:`serve_forever`): drain
first (:meth:`EppServer.drain`, epp/server/drain.py: NOT_SERVING at once, ext_proc keeps
serving for the drain window), then stop: endpoint source, scraper, then the gRPC servers
(with grace) and the metrics port.
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
from epp.handlers.extproc import DEFAULT_MAX_HEADERS, ExtProcServicer
from epp.observability.explain import DecisionLog
from epp.observability.metrics import EppMetrics
from epp.observability.tracing import Tracing
from epp.requestcontrol.director import Director, SchedulingCore
from epp.scheduling.interfaces import Plugin
from epp.scheduling.plugins.prefix import ApproxPrefixCacheProducer
from epp.server.drain import (
    DEFAULT_DRAIN_QUIET_S,
    DEFAULT_DRAIN_TIMEOUT_S,
    StreamTracker,
    TrackedExtProc,
    drain_server,
)
from epp.server.leader import LeaderElectionOptions, LeaderElector, default_identity, lease_name
from epp.server.tls import load_key_pair, self_signed_key_pair
from epp.server.workers import CoreServer, FrontPool, check_port_free, front_argv
from epp.stack.procs import wait_port

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 64 << 20


class StartupError(Exception):
    """The server cannot start (port in use, bad endpoints, bad config)."""


def host_port(address: str, port: int) -> str:
    """``address:port`` as gRPC parses it (IPv6 addresses in brackets)."""
    if ":" in address and not address.startswith("["):
        return f"[{address}]:{port}"
    return f"{address}:{port}"


@dataclass
class ServeOptions:
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    bind_address: str = "0.0.0.0"  # the default for the three below
    grpc_bind_address: str | None = None  # ext_proc port (None: bind_address)
    grpc_health_bind_address: str | None = None  # gRPC health port
    metrics_bind_address: str | None = None  # Prometheus /metrics and /debug/* port
    config_file: str | None = None
    config_text: str | None = None
    endpoints: str | None = None
    endpoints_file: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY
    # The gateway's request header limit (Envoy's max_headers_count); 0 = no check.
    max_request_headers: int = DEFAULT_MAX_HEADERS
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
    # Shutdown (epp/server/drain.py): serve ext_proc for up to drain_timeout_s after
    # SIGTERM, less once no stream has been in flight for drain_quiet_s.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    drain_quiet_s: float = DEFAULT_DRAIN_QUIET_S

    @property
    def grpc_address(self) -> str:
        return self.grpc_bind_address or self.bind_address

    @property
    def health_address(self) -> str:
        return self.grpc_health_bind_address or self.bind_address

    @property
    def metrics_address(self) -> str:
        return self.metrics_bind_address or self.bind_address


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
        self.tracker = StreamTracker()  # ext_proc streams of this process (--workers 1)
        self.draining = False

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
            # Envoy's word that a pod refused the connection (response attributes): out
            # of the candidates now, back at the next scrape that gets an answer.
            self.core.on_upstream_failure = scraper.report_unreachable

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
        log.info("epp serving ext_proc on %s (health %s, metrics %s), %d endpoints",
                 host_port(o.grpc_address, o.grpc_port),
                 host_port(o.health_address, o.grpc_health_port),
                 host_port(o.metrics_address, o.metrics_port), len(self.store))

    def _grpc_server(self, max_message: int) -> grpc.aio.Server:
        """A grpc.aio server; ``max_message`` bounds messages both ways (-1: no bound)."""
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

    def _bind(self, server: grpc.aio.Server, address: str, port: int, what: str,
              credentials: grpc.ServerCredentials | None = None) -> None:
        addr = host_port(address, port)
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
        # No gRPC message limit: a BUFFERED body arrives as one message, and one over
        # --max-request-body-bytes must reach the handler to be answered with 413 (a gRPC
        # limit would fail the stream: RESOURCE_EXHAUSTED, an empty 500 from Envoy). What
        # bounds a message is Envoy's buffer (per_connection_buffer_limit_bytes); the
        # ext_proc port should be reachable by the gateway only (--grpc-bind-address).
        server = self._grpc_server(-1)
        pb_grpc.add_ExternalProcessorServicer_to_server(
            TrackedExtProc(ExtProcServicer(self.director, self.options.max_request_body_bytes,
                                           on_stream_end=self._stream_ended,
                                           max_headers=self.options.max_request_headers,
                                           body_consumers=self._body_consumers()),
                           self.tracker),
            server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        credentials: grpc.ServerCredentials | None = None
        if self.options.secure_serving:
            # GIE's EPP serves TLS (self-signed unless --cert-path); gateways built for it
            # connect with TLS and skip verification. Health stays plaintext (probes).
            key, chain = (load_key_pair(self.options.cert_path) if self.options.cert_path
                          else self_signed_key_pair())
            credentials = grpc.ssl_server_credentials([(key, chain)])
        self._bind(server, self.options.grpc_address, self.options.grpc_port, "ext_proc gRPC",
                   credentials)
        await server.start()
        self._grpc = server

    def _body_consumers(self) -> list[str]:
        """Configured plugins that declare they need response bodies."""
        assert self.built is not None
        return [name for name, p in self.built.plugins.items()
                if "body" in getattr(p, "response_needs", ())]

    async def _start_fronts(self, n: int) -> None:
        """``--workers N``: N front processes serve ext_proc; this process is the core."""
        assert self.core is not None
        o = self.options
        try:
            check_port_free(o.grpc_address, o.grpc_port)
        except OSError as e:
            raise StartupError(f"cannot listen for ext_proc gRPC on "
                               f"{host_port(o.grpc_address, o.grpc_port)}: {e.strerror or e} "
                               "(port in use? pick another with --grpc-port)") from e
        self._core_server = CoreServer(self.core, self._stream_ended)
        await self._core_server.start()
        self._fronts = FrontPool(n, front_argv(
            core_socket=self._core_server.path, grpc_port=o.grpc_port,
            bind_address=o.grpc_address, max_body=o.max_request_body_bytes,
            max_headers=o.max_request_headers,
            secure_serving=o.secure_serving, cert_path=o.cert_path,
            drain_timeout=o.drain_timeout_s, drain_quiet=o.drain_quiet_s,
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
        await wait_port("127.0.0.1" if o.grpc_address in ("0.0.0.0", "::") else o.grpc_address,
                        o.grpc_port, timeout=30)

    async def _start_health(self) -> None:
        server = self._grpc_server(4 << 20)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self._bind(server, self.options.health_address, self.options.grpc_health_port,
                   "gRPC health")
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
        address = self.options.metrics_address
        site = web.TCPSite(runner, address, self.options.metrics_port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise StartupError(f"cannot listen for metrics on "
                               f"{host_port(address, self.options.metrics_port)}: "
                               f"{e.strerror or e} (port in use? pick another with "
                               "--metrics-port)") from e
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
        ready_now = (not self.draining and self.store.synced
                     and (self.k8s_source is None or self.k8s_source.ready)
                     and (self.elector is None or self.elector.is_leader))
        ready = serving if ready_now else not_serving
        await self._health.set(keys.HEALTH_LIVENESS, serving)
        await self._health.set(keys.HEALTH_READINESS, ready)
        await self._health.set(keys.HEALTH_EXT_PROC, ready)
        await self._health.set("", ready)

    async def drain(self, timeout: float, quiet: float, stop_now: asyncio.Event) -> None:
        """The first step of a graceful shutdown (epp/server/drain.py); :meth:`stop` follows.

        Reports NOT_SERVING on readiness and the ext_proc health service at once (liveness
        stays SERVING), releases the leader Lease (a standby takes over), and keeps the
        ext_proc port serving — discovery and scraping keep running — until no stream has
        been in flight for ``quiet`` seconds or ``timeout`` has passed; then stops the
        ext_proc server, cancelling what still runs. With ``--workers N`` each worker
        drains its own streams and exits; this returns once all have exited. Setting
        ``stop_now`` ends it at once.
        """
        self.draining = True
        await self._update_health()
        release: asyncio.Future[None] | None = None
        if self.elector is not None:
            elector, self.elector = self.elector, None
            release = asyncio.ensure_future(elector.stop())
        try:
            if self._fronts is not None:
                await self._drain_fronts(timeout, quiet, stop_now)
            elif self._grpc is not None:
                await drain_server(self._grpc, self.tracker, timeout, quiet, stop_now)
                self._grpc = None
        finally:
            if release is not None:
                try:
                    await release
                except Exception:
                    log.exception("releasing the leader Lease failed")

    async def _drain_fronts(self, timeout: float, quiet: float, stop_now: asyncio.Event) -> None:
        assert self._fronts is not None and self._core_server is not None
        loop = asyncio.get_running_loop()
        start = loop.time()
        running = self._fronts.running()
        log.info("drain started: %d ext_proc workers keep serving for up to %.1fs (less once "
                 "none has a stream in flight for %.1fs); each logs its own counts", running,
                 timeout, quiet)
        # Workers that got the signal themselves (a process-group signal) already drain;
        # the message is for those that did not (a signal to this process alone).
        self._core_server.broadcast(["T", timeout, quiet])
        # Each worker ends its drain by its deadline; the margin covers its stop and exit.
        await self._fronts.wait_exited(timeout + 2.0, stop_now)
        if stop_now.is_set():
            self._core_server.broadcast(["S", None])
            await self._fronts.wait_exited(2.0)
        left = self._fronts.running()
        log.log(logging.WARNING if left else logging.INFO,
                "drain finished after %.1fs: %d of %d ext_proc workers exited%s",
                loop.time() - start, running - left, running,
                f", {left} still running are stopped now" if left else "")

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting streams, let running ones finish for ``grace`` seconds, close all.

        After :meth:`drain` there is nothing left to wait for. Called directly it is the
        immediate shutdown (no drain window)."""
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
            if self._core_server is not None:
                self._core_server.broadcast(["S", grace])
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


async def serve_forever(options: ServeOptions, stop_event: asyncio.Event,
                        stop_now: asyncio.Event | None = None) -> None:
    """Start, serve until ``stop_event``, drain (up to ``options.drain_timeout_s``), stop.

    ``stop_now`` (a second SIGTERM/SIGINT) cuts the drain short."""
    server = EppServer(options)
    await server.start()
    stop_now = stop_now if stop_now is not None else asyncio.Event()
    try:
        await stop_event.wait()
        await server.drain(options.drain_timeout_s, options.drain_quiet_s, stop_now)
    finally:
        log.info("shutting down")
        await server.stop(0)
