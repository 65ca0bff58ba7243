"""The EPP server: explicit lifecycle (``start()``, ``stop(grace)``), one event loop.

Startup order: build the config (fails fast), load endpoints (fails fast on a bad file),
bind the metrics, health and ext_proc ports (a port in use is a clear error), then report
SERVING on the health services once the endpoint source has synced.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp import keys
from epp.config.loader import BuiltConfig, load_and_build
from epp.datastore.store import Datastore
from epp.discovery.static import StaticFileSource, parse_endpoints_arg
from epp.errors import ConfigError
from epp.handlers.extproc import ExtProcServicer
from epp.observability.metrics import EppMetrics
from epp.requestcontrol.director import Director

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


class EppServer:
    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.store = Datastore()
        self.metrics = EppMetrics(self.store)
        self.built: BuiltConfig | None = None
        self.director: Director | None = None
        self._static_file: StaticFileSource | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._metrics_runner: web.AppRunner | None = None

    async def start(self) -> None:
        o = self.options
        # Phase 1: everything that can be validated without binding a port.
        self.built = load_and_build(o.config_file, o.config_text,
                                    timer=self.metrics.observe_plugin)
        if (o.endpoints is None) == (o.endpoints_file is None):
            raise ConfigError("give exactly one endpoint source: --endpoints ip:port[,…] or "
                              "--endpoints-file FILE")
        if o.endpoints is not None:
            self.store.set_endpoints(parse_endpoints_arg(o.endpoints))
        else:
            self._static_file = StaticFileSource(Path(o.endpoints_file or ""), self.store,
                                                 o.endpoints_poll_interval_s)
            self._static_file.load_initial()
        for plugin in self.built.endpoint_removed:
            self.store.on_removed(lambda ep, p=plugin: p.endpoint_removed(ep.key))
        self.director = Director(self.store, self.built.scheduler, self.metrics,
                                 self.built.pre_request, self.built.response_complete)

        # Phase 2: bind ports.
        try:
            await self._start_metrics()
            await self._start_health()
            await self._start_ext_proc()
        except BaseException:
            await self.stop(0)
            raise
        if self._static_file is not None:
            self._static_file.start_polling()
        await self._update_health()
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

    def _bind(self, server: grpc.aio.Server, port: int, what: str) -> None:
        addr = f"{self.options.bind_address}:{port}"
        try:
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
            ExtProcServicer(self.director, self.options.max_request_body_bytes), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self._bind(server, self.options.grpc_port, "ext_proc gRPC")
        await server.start()
        self._grpc = server

    async def _start_health(self) -> None:
        server = self._grpc_server(4 << 20)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self._bind(server, self.options.grpc_health_port, "gRPC health")
        await server.start()
        self._health_server = server

    async def _start_metrics(self) -> None:
        registry = self.metrics.registry

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=generate_latest(registry),
                                headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
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

    async def _update_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        ready = serving if self.store.synced else not_serving
        await self._health.set(keys.HEALTH_LIVENESS, serving)
        await self._health.set(keys.HEALTH_READINESS, ready)
        await self._health.set(keys.HEALTH_EXT_PROC, ready)
        await self._health.set("", ready)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting streams, let running ones finish for ``grace`` seconds, close all."""
        if self._static_file is not None:
            await self._static_file.stop()
        for server in (self._grpc, self._health_server):
            if server is not None:
                await server.stop(grace)
        self._grpc = self._health_server = None
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None


async def serve_forever(options: ServeOptions, stop_event: asyncio.Event) -> None:
    server = EppServer(options)
    await server.start()
    try:
        await stop_event.wait()
    finally:
        log.info("shutting down")
        await server.stop()
