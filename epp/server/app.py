"""The EPP server: explicit lifecycle (``start()``, ``drain()``, ``stop(grace)``), one loop.

:meth:`EppServer.start`:

1. build the config and validate the options (epp/server/options.py; the config's
   ``dataLayer.discovery`` plugin, when set, is the endpoint source) — fail fast;
2. wire the object graph (epp/server/wiring.py: no port, no task, no file);
3. start, through one :class:`contextlib.AsyncExitStack`, each resource followed at once
   by its cleanup: tracing; the endpoint source's fallible part (connect to Kubernetes,
   or read the endpoints file) and the objectives file; the flow controller (the
   ``flowControl`` feature gate); the metrics, health and ext_proc ports (a port in use
   is a clear :class:`StartupError`; with ``--workers N`` the core socket and the front
   processes instead of the ext_proc port); the model-server
   metrics scraper; polling of the endpoints and objectives files; health (NOT_SERVING
   until the endpoint source has synced); the Kubernetes source; the leader elector.

Teardown is that stack unwound, so it runs in reverse: elector (releases the Lease),
Kubernetes source, file polling, scraper, ext_proc (fronts, then the core socket), health
and metrics ports, the flow controller (``flowControl`` feature gate: what is still
queued ends with 500), the Kubernetes client, tracing (flushes spans). A startup that
fails halfway unwinds what had started. Shutdown (:func:`serve_forever`): drain first
(:meth:`EppServer.drain`, epp/server/drain.py: NOT_SERVING at once, ext_proc keeps
serving for the drain window), then :meth:`EppServer.stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from epp.config.loader import load_and_build
from epp.datalayer.notifications import NotificationWatches
from epp.datalayer.scraper import ScraperCollector
from epp.datastore.store import Datastore
from epp.discovery.kubeclient import KubeApi, connect
from epp.discovery.kubernetes import KubernetesSource
from epp.errors import ConfigError
from epp.framework.interfaces import BackgroundPlugin
from epp.framework.registry import check_plugin_stability
from epp.observability.tracing import Tracing
from epp.scheduling.plugins.catalog import default_registry
from epp.server.drain import TrackedExtProc
from epp.server.leader import LeaderElector
from epp.server.listeners import (
    ExtProcPort,
    InProcessExtProc,
    StartupError,
    bind,
    grpc_server,
    host_port,
)
from epp.server.llmd_flags import check_cipher_suites_applied, watch_metrics_cert
from epp.server.loop import tune_gc
from epp.server.metrics_auth import BearerToken, KubernetesAuth, MetricsAuth
from epp.server.metrics_http import metrics_app, serve_metrics
from epp.server.options import (
    DEFAULT_MAX_BODY,
    ConfigDiscovery,
    KubernetesDiscovery,
    ServeOptions,
    ServePlan,
    validate,
)
from epp.server.stream_metrics import StreamMetricsExtProc
from epp.server.tls import server_credentials
from epp.server.wiring import PluginTimings, ServerParts, wire
from epp.server.workers import CoreServer, FrontPool, FrontProcesses, check_port_free, front_argv

__all__ = ["DEFAULT_MAX_BODY", "EppServer", "ServeOptions", "StartupError", "host_port",
           "serve_forever"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Running:
    """What :meth:`EppServer.start` made and started."""

    parts: ServerParts
    ext_proc: ExtProcPort
    k8s_source: KubernetesSource | None
    elector: LeaderElector | None
    release_lease: Callable[[], Awaitable[None]] | None  # once: by the drain, else at stop


class EppServer:
    """One ``epp serve`` process: :meth:`start`, then :meth:`drain` and/or :meth:`stop`.

    What start() made is readable afterwards: :attr:`parts` (the wired graph),
    :attr:`store`, :attr:`k8s_source`, :attr:`elector`.
    """

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self._stack = AsyncExitStack()  # what start() started, with its cleanups
        self._grace = 0.0  # for the gRPC servers' cleanups: set by stop()
        self._running: Running | None = None

    # -- what start() made --------------------------------------------------------------
    @property
    def running(self) -> Running:
        if self._running is None:
            raise RuntimeError("EppServer.start() has not completed")
        return self._running

    @property
    def parts(self) -> ServerParts:
        return self.running.parts

    @property
    def store(self) -> Datastore:
        return self.running.parts.store

    @property
    def k8s_source(self) -> KubernetesSource | None:
        return self.running.k8s_source

    @property
    def elector(self) -> LeaderElector | None:
        return self.running.elector

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        o = self.options
        timings = PluginTimings()
        built = load_and_build(o.config.file, o.config.text, timer=timings, strict=o.config.strict,
                               environ=os.environ)
        # llm-d's ValidatePluginStability, for llm-d documents (apiVersion llm-d.ai/v1alpha1):
        # an Alpha plugin needs --allow-experimental-plugins (docs/configuration.md).
        if built.config.llmd_document:
            check_plugin_stability(built.plugins, default_registry(),
                                   o.config.allow_experimental_plugins)
        # The config's dataLayer.discovery plugin (llm-d), when set, is the endpoint source.
        plan = validate(o, built.discovery.name if built.discovery is not None else None)
        if plan.tls_cipher_list is not None:  # gRPC read GRPC_SSL_CIPHER_SUITES at import
            check_cipher_suites_applied(o.tls.tls_cipher_suites)
        for note in plan.notes:
            log.warning("%s", note)
        async with AsyncExitStack() as stack:
            tracing = _start_tracing(plan)
            if tracing is not None:
                stack.callback(tracing.shutdown)  # flushes spans still queued for export
            parts = wire(plan, built, timings, tracing)
            health = parts.health
            # The endpoint source's fallible part, before any port is bound.
            k8s_source: KubernetesSource | None = None
            elector: LeaderElector | None = None
            auth: MetricsAuth | None = None
            if isinstance(plan.source, KubernetesDiscovery):
                k8s_source, elector, api = await self._connect_kubernetes(stack, parts,
                                                                          plan.source)
                if plan.metrics_auth_kubernetes:
                    auth = KubernetesAuth(api)
            elif parts.endpoints_file is not None:
                parts.endpoints_file.load_initial()  # a bad file fails startup
            if parts.objectives_file is not None:
                parts.objectives_file.load_initial()  # a bad file fails startup
            if plan.metrics_auth_token is not None:
                auth = BearerToken(plan.metrics_auth_token)
            # k8s-notification-source watches (a ConfigError without Kubernetes discovery;
            # in llm-d's file-discovery mode inactive, as there: logged by wire()).
            notifications = NotificationWatches(
                None if isinstance(plan.source, ConfigDiscovery) else built.data_layer,
                k8s_source)
            # Flow control (the flowControl feature gate) before the ext_proc port, so its
            # stop comes after the port's: requests still queued then end EvictedOther.
            if parts.flow_control is not None:
                await parts.flow_control.start()
                stack.push_async_callback(parts.flow_control.stop)
                log.info("flow control on: requests wait in the EPP while the pool is "
                         "saturated (saturation detector %s)",
                         built.saturation_detector.name if built.saturation_detector
                         else "none")
            # The ports.
            await self._serve_metrics(stack, parts, auth)
            await self._serve_health(stack, parts)
            if parts.ext_proc is not None:
                ext_proc: ExtProcPort = await self._serve_ext_proc(stack, parts, parts.ext_proc)
            else:
                ext_proc = await self._start_fronts(stack, parts)
            # Background work.
            if parts.scraper is not None:
                parts.metrics.registry.register(ScraperCollector(parts.scraper))
                parts.scraper.start()
                stack.push_async_callback(parts.scraper.stop)
            if parts.pollers is not None:
                parts.pollers.start()
                stack.push_async_callback(parts.pollers.stop)
            if parts.endpoints_file is not None:
                parts.endpoints_file.start_polling()
                stack.push_async_callback(parts.endpoints_file.stop)
            if parts.objectives_file is not None:
                parts.objectives_file.start_polling()
                stack.push_async_callback(parts.objectives_file.stop)
            for plugin in built.plugins.values():  # e.g. the latency predictor's sidecar client
                if isinstance(plugin, BackgroundPlugin):
                    stack.push_async_callback(plugin.stop_background)
                    await plugin.start_background()
            await health.update()
            if k8s_source is not None:
                stack.push_async_callback(k8s_source.stop)  # also undoes a partial start
                await k8s_source.start()
            stack.push_async_callback(notifications.stop)
            await notifications.start()  # waits for their first lists; may fail startup
            release_lease: Callable[[], Awaitable[None]] | None = None
            if elector is not None:
                elector.start()
                # Releases the Lease (a standby takes over at once), unless the drain did.
                release_lease = _once(elector.stop)
                stack.push_async_callback(release_lease)
            self._running = Running(parts, ext_proc, k8s_source, elector, release_lease)
            self._stack = stack.pop_all()
        listen = o.listen
        log.info("epp serving ext_proc on %s (health %s, metrics %s), %d endpoints",
                 host_port(listen.grpc_address, listen.grpc_port),
                 host_port(listen.health_address, listen.grpc_health_port),
                 host_port(listen.metrics_address, listen.metrics_port), len(parts.store))

    async def _connect_kubernetes(
            self, stack: AsyncExitStack, parts: ServerParts, discovery: KubernetesDiscovery,
    ) -> tuple[KubernetesSource, LeaderElector | None, KubeApi]:
        """Connect (fails fast on a missing or bad kubeconfig) and make the source and,
        when enabled, the leader elector; both start after the ports are bound."""
        health = parts.health
        api = await connect(discovery.kubeconfig)
        stack.push_async_callback(api.close)
        source = KubernetesSource(api, parts.store, discovery.options,
                                  on_state_change=health.update, objectives=parts.objectives)
        health.require(lambda: source.ready)
        parts.metrics.gangs.tracker = source.gangs
        if discovery.election is None:
            return source, None, api
        elector = LeaderElector(api, discovery.election,
                                on_change=lambda _leader: health.update())
        health.require(lambda: elector.is_leader)
        return source, elector, api

    async def _serve_metrics(self, stack: AsyncExitStack, parts: ServerParts,
                             auth: MetricsAuth | None) -> None:
        listen = parts.plan.options.listen
        app = metrics_app(parts.metrics.registry, parts.decisions, auth=auth)
        mtls = parts.plan.metrics_tls  # llm-d's --metrics-cert-dir/--metrics-client-ca-file
        ctx = None if mtls is None else mtls.context()
        runner = await serve_metrics(app, listen.metrics_address, listen.metrics_port,
                                     ssl_context=ctx)
        stack.push_async_callback(runner.cleanup)
        if mtls is not None and ctx is not None:
            watcher = asyncio.ensure_future(watch_metrics_cert(mtls, ctx))
            stack.push_async_callback(_cancelled, watcher)

    async def _serve_health(self, stack: AsyncExitStack, parts: ServerParts) -> None:
        listen = parts.plan.options.listen
        server = grpc_server(4 << 20)
        health_pb2_grpc.add_HealthServicer_to_server(parts.health.servicer, server)
        bind(server, listen.health_address, listen.grpc_health_port, "gRPC health")
        await server.start()
        stack.push_async_callback(lambda: server.stop(self._grace))

    async def _serve_ext_proc(self, stack: AsyncExitStack, parts: ServerParts,
                              servicer: TrackedExtProc) -> InProcessExtProc:
        """The ext_proc port in this process (``--workers 1``), with gRPC health on it."""
        o = parts.plan.options
        # No gRPC message limit: a BUFFERED body arrives as one message, and one over
        # --max-request-body-bytes must reach the handler to be answered with 413 (a gRPC
        # limit would fail the stream: RESOURCE_EXHAUSTED, an empty 500 from Envoy). What
        # bounds a message is Envoy's buffer (per_connection_buffer_limit_bytes); the
        # ext_proc port should be reachable by the gateway only (--grpc-bind-address).
        # llm-d's --grpc-max-recv-msg-size/--grpc-max-send-msg-size, when given, bound
        # them as there (a larger message fails the stream with RESOURCE_EXHAUSTED).
        plan = parts.plan
        server = grpc_server(plan.grpc_max_recv_msg_size or -1,
                             max_send=plan.grpc_max_send_msg_size or -1)
        ext_proc: object = servicer
        if o.grpc.enable_stream_metrics:  # llm-d's --enable-grpc-stream-metrics
            ext_proc = StreamMetricsExtProc(servicer, parts.metrics.grpc_stream_metrics())
        pb_grpc.add_ExternalProcessorServicer_to_server(ext_proc, server)
        health_pb2_grpc.add_HealthServicer_to_server(parts.health.servicer, server)
        credentials: grpc.ServerCredentials | None = None
        if parts.plan.secure_serving:
            # GIE's EPP serves TLS (self-signed unless --cert-path); gateways built for it
            # connect with TLS and skip verification. Health stays plaintext (probes).
            credentials = server_credentials(o.tls.cert_path, o.tls.enable_cert_reload)
        bind(server, o.listen.grpc_address, o.listen.grpc_port, "ext_proc gRPC", credentials)
        await server.start()
        port = InProcessExtProc(server, parts.tracker)
        stack.push_async_callback(lambda: port.stop(self._grace))
        return port

    async def _start_fronts(self, stack: AsyncExitStack, parts: ServerParts) -> FrontProcesses:
        """``--workers N``: N front processes serve ext_proc; this process is the core."""
        o = parts.plan.options
        address, grpc_port = o.listen.grpc_address, o.listen.grpc_port
        try:
            check_port_free(address, grpc_port)
        except OSError as e:
            raise StartupError(f"cannot listen for ext_proc gRPC on "
                               f"{host_port(address, grpc_port)}: {e.strerror or e} "
                               "(port in use? pick another with --grpc-port)") from e
        core_server = CoreServer(parts.core, parts.stream_ended)
        stack.push_async_callback(core_server.stop)  # also removes its socket directory
        await core_server.start()
        pool = FrontPool(parts.plan.workers, front_argv(
            core_socket=core_server.path, grpc_port=grpc_port, bind_address=address,
            max_body=o.limits.max_request_body_bytes, max_headers=o.limits.max_request_headers,
            secure_serving=parts.plan.secure_serving, cert_path=o.tls.cert_path,
            cert_reload=o.tls.enable_cert_reload,
            drain_timeout=o.drain.timeout_s, drain_quiet=o.drain.quiet_period_s,
            log_level=o.observability.log_level, log_format=o.observability.log_format,
            parser_type=None if parts.built.parser_plugin is None
            else parts.built.parser_plugin.type_name))
        fronts = FrontProcesses(core_server, pool)
        # Entered before the processes start: one that started is stopped even if the
        # next one fails to.
        stack.push_async_callback(lambda: fronts.stop(self._grace))
        await pool.start()
        await fronts.wait_ready(address, grpc_port)
        return fronts

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
        running = self.running
        await running.parts.health.start_draining()
        release: asyncio.Future[None] | None = None
        if running.release_lease is not None:
            release = asyncio.ensure_future(running.release_lease())
        try:
            await running.ext_proc.drain(timeout, quiet, stop_now)
        finally:
            if release is not None:
                try:
                    await release
                except Exception:
                    log.exception("releasing the leader Lease failed")

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting streams, let running ones finish for ``grace`` seconds, close all.

        After :meth:`drain` there is nothing left to wait for. Called directly it is the
        immediate shutdown (no drain window). Unwinds what :meth:`start` started, in
        reverse order; a second call does nothing."""
        self._grace = grace
        stack, self._stack = self._stack, AsyncExitStack()
        await stack.aclose()


def _start_tracing(plan: ServePlan) -> Tracing | None:
    """``--tracing``: on, off, or GIE's default (on) when OpenTelemetry is installed."""
    if plan.tracing == "off":
        return None
    try:
        try:
            return Tracing(log=log)
        except ImportError as e:  # e.g. an exporter package not matching the SDK
            raise ConfigError(f"--tracing: OpenTelemetry does not load: {e}") from e
    except ConfigError as e:
        if plan.tracing == "on":
            raise
        log.warning("tracing is on by default (as GIE's) but cannot start, so this EPP "
                    "runs without it (--tracing=false says so explicitly): %s", e)
        return None


async def _cancelled(task: asyncio.Future[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _once(step: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """``step`` the first time it is called; later calls do nothing."""
    done = False

    async def run() -> None:
        nonlocal done
        if not done:
            done = True
            await step()

    return run


async def serve_forever(options: ServeOptions, stop_event: asyncio.Event,
                        stop_now: asyncio.Event | None = None) -> None:
    """Start, serve until ``stop_event``, drain (up to ``options.drain.timeout_s``), stop.

    ``stop_now`` (a second SIGTERM/SIGINT) cuts the drain short."""
    server = EppServer(options)
    await server.start()
    tune_gc()
    stop_now = stop_now if stop_now is not None else asyncio.Event()
    try:
        await stop_event.wait()
        await server.drain(options.drain.timeout_s, options.drain.quiet_period_s, stop_now)
    finally:
        log.info("shutting down")
        await server.stop(0)
