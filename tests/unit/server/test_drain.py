"""The drain (epp/server/drain.py) on a real grpc.aio server over loopback, and the flags."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.cli import build_parser, main, serve_options
from epp.server.app import EppServer, ServeOptions, host_port
from epp.server.drain import StreamTracker, TrackedExtProc, drain_server
from epp.server.options import (
    HaOptions,
    KubernetesSourceOptions,
    ListenOptions,
    ScrapingOptions,
    TlsOptions,
)
from epp.stack.procs import free_port
from tests.polling import eventually

# What a client sees of a stream the server cancels while stopping.
CUT = (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


class HeldStreams(pb_grpc.ExternalProcessorServicer):
    """Answers each message once, then holds the stream until ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.closed = 0  # streams whose handler ran its clean-up

    async def Process(self, request_iterator: Any, context: Any) -> None:
        try:
            if await context.read() is not grpc.aio.EOF:
                await context.write(pb.ProcessingResponse())
                await self.release.wait()
        finally:
            self.closed += 1


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[tuple[grpc.aio.Server, HeldStreams, StreamTracker, Any]]:
    inner, tracker = HeldStreams(), StreamTracker()
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(TrackedExtProc(inner, tracker), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield server, inner, tracker, pb_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


async def open_stream(stub: Any) -> Any:
    """A stream that has had its first answer (so it is in flight on the server)."""
    call = stub.Process()
    await call.write(pb.ProcessingRequest())
    await call.read()
    return call


async def finish(call: Any) -> grpc.StatusCode:
    with contextlib.suppress(grpc.aio.AioRpcError):
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
    return await call.code()


async def test_tracker_counts_streams_until_their_handler_ends() -> None:
    async with served() as (_, inner, tracker, stub):
        calls = [await open_stream(stub) for _ in range(3)]
        assert tracker.in_flight == 3 and tracker.started == 3 and not tracker.idle.is_set()
        calls[0].cancel()  # the client goes away: the handler is cancelled, counted out
        await eventually(lambda: tracker.in_flight == 2)
        assert tracker.in_flight == 2 and inner.closed == 1
        inner.release.set()
        assert [await finish(c) for c in calls[1:]] == [grpc.StatusCode.OK] * 2
        assert tracker.in_flight == 0 and tracker.idle.is_set() and inner.closed == 3


async def test_drain_serves_new_streams_and_ends_once_idle() -> None:
    async with served() as (server, inner, tracker, stub):
        held = await open_stream(stub)
        stop_now = asyncio.Event()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        drain = asyncio.ensure_future(drain_server(server, tracker, 10.0, 0.3, stop_now))
        late = await open_stream(stub)  # accepted during the drain
        assert tracker.in_flight == 2
        # Not a wait: streams are held for these 0.2 s, and the drain must not end meanwhile.
        await asyncio.sleep(0.2)
        assert not drain.done()
        inner.release.set()
        assert await finish(held) == await finish(late) == grpc.StatusCode.OK
        report = await asyncio.wait_for(drain, 5)
        assert report.reason == "idle" and report.cut == 0
        assert report.in_flight_at_start == 1 and report.started_during == 1
        assert 0.5 <= loop.time() - t0 < 3  # 0.2 s held + 0.3 s quiet, not the 10 s timeout


async def test_drain_timeout_cuts_what_remains() -> None:
    async with served() as (server, _, tracker, stub):
        held = await open_stream(stub)
        report = await asyncio.wait_for(
            drain_server(server, tracker, 0.5, 0.1, asyncio.Event()), 5)
        assert report.reason == "timeout" and report.cut == 1 and 0.5 <= report.seconds < 2
        assert await finish(held) in CUT
        assert tracker.in_flight == 0


async def test_drain_timeout_zero_stops_at_once() -> None:
    async with served() as (server, _, tracker, stub):
        held = await open_stream(stub)
        report = await asyncio.wait_for(drain_server(server, tracker, 0, 1, asyncio.Event()), 5)
        assert report.reason == "timeout" and report.cut == 1 and report.seconds < 0.5
        assert await finish(held) in CUT


async def test_stop_now_ends_the_drain(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="epp.server.drain")
    async with served() as (server, _, tracker, stub):
        held = await open_stream(stub)
        stop_now = asyncio.Event()
        drain = asyncio.ensure_future(drain_server(server, tracker, 30, 30, stop_now))
        await eventually(lambda: "drain started" in caplog.text)  # now waiting for streams
        stop_now.set()
        report = await asyncio.wait_for(drain, 5)
        assert report.reason == "stopped" and report.cut == 1 and report.seconds < 2
        assert await finish(held) in CUT


async def test_idle_drain_waits_the_quiet_period_from_the_signal() -> None:
    async with served() as (server, _, tracker, _stub):
        report = await asyncio.wait_for(
            drain_server(server, tracker, 10, 0.3, asyncio.Event()), 5)
        assert report.reason == "idle" and report.cut == 0 and 0.3 <= report.seconds < 2


# ------------------------------------------------------------------------------- flags


def serve(*args: str) -> Any:
    return build_parser().parse_args(["serve", "--endpoints", "127.0.0.1:8000", *args])


def test_drain_flags_defaults_and_durations() -> None:
    a = serve()
    # No quiet period given: the whole --drain-timeout window is served (llm-d's router).
    assert a.drain_timeout == 30.0 and a.drain_quiet_period is None
    assert serve_options(serve("--drain-timeout", "45s")).drain.quiet_period_s == 45.0
    a = serve("--drain-timeout", "45s", "--drain-quiet-period", "500ms")
    assert a.drain_timeout == 45.0 and a.drain_quiet_period == 0.5
    assert serve_options(a).drain.quiet_period_s == 0.5
    assert serve("--drain-timeout", "0").drain_timeout == 0.0
    assert serve("--drain-timeout", "2m").drain_timeout == 120.0
    with pytest.raises(SystemExit):
        serve("--drain-timeout", "soon")


@pytest.mark.parametrize("flag", ["--drain-timeout", "--drain-quiet-period"])
def test_negative_drain_flags_are_rejected(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--endpoints", "127.0.0.1:8000", flag, "-1"]) == 1
    assert f"{flag} must be >= 0" in capsys.readouterr().err


def test_bind_address_flags_default_to_bind_address() -> None:
    a = serve()
    assert a.bind_address == "0.0.0.0"
    assert a.grpc_bind_address is a.grpc_health_bind_address is a.metrics_bind_address is None
    a = serve("--bind-address", "10.0.0.1", "--metrics-bind-address", "127.0.0.1",
              "--grpc-health-bind-address", "::")
    assert (a.grpc_bind_address, a.grpc_health_bind_address, a.metrics_bind_address) == (
        None, "::", "127.0.0.1")
    o = serve_options(serve("--bind-address", "10.0.0.1", "--metrics-bind-address",
                            "127.0.0.1", "--grpc-health-bind-address", "::")).listen
    assert (o.grpc_address, o.health_address, o.metrics_address) == (
        "10.0.0.1", "::", "127.0.0.1")
    o = ListenOptions(bind_address="10.0.0.1", grpc_bind_address="127.0.0.1")
    assert (o.grpc_address, o.health_address, o.metrics_address) == (
        "127.0.0.1", "10.0.0.1", "10.0.0.1")
    assert host_port("::", 9003) == "[::]:9003" and host_port("10.0.0.1", 9002) == "10.0.0.1:9002"
    assert host_port("[::1]", 1) == "[::1]:1"


def test_help_names_every_port_and_the_drain(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--bind-address", "--grpc-bind-address", "--grpc-health-bind-address",
                 "--metrics-bind-address", "--drain-timeout", "--drain-quiet-period"):
        assert flag in text
    assert "ext_proc port" in text and "probes" in text and "/metrics" in text
    assert "default 30s" in text


# ------------------------------------------------------ EppServer.drain, in-process


async def test_server_drain_drops_readiness_releases_the_lease_keeps_discovery(
        fake: Any, tmp_path: Any) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from epp import keys

    app = {"app": "vllm"}
    fake.put_pool("pool", app, [8000])
    fake.put_pod("a", "10.0.0.1", labels=app)
    health_port, grpc_port = free_port(), free_port()
    server = EppServer(ServeOptions(
        listen=ListenOptions(grpc_port=grpc_port, grpc_health_port=health_port,
                             metrics_port=free_port(), bind_address="127.0.0.1"),
        kubernetes=KubernetesSourceOptions(
            pool_name="pool", pool_namespace="default",
            kubeconfig=str(fake.write_kubeconfig(tmp_path / "kc"))),
        scraping=ScrapingOptions(enabled=False),
        tls=TlsOptions(secure_serving=False),
        ha=HaOptions(enable_leader_election=True, lease_duration_s=1.0, renew_deadline_s=0.6,
                     retry_period_s=0.1)))

    async def status(port: int, service: str) -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2)
            return int(r.status)

    serving = health_pb2.HealthCheckResponse.SERVING

    async def ready() -> bool:
        return await status(health_port, keys.HEALTH_READINESS) == serving

    async def not_ready() -> bool:
        return not await ready()

    await server.start()
    try:
        await eventually(ready)
        assert server.elector is not None
        lease_name = server.elector.options.name
        stop_now = asyncio.Event()
        drain = asyncio.ensure_future(server.drain(10.0, 0.5, stop_now))
        await eventually(not_ready)  # the drain's first step
        assert await status(health_port, keys.HEALTH_READINESS) != serving
        assert await status(health_port, keys.HEALTH_EXT_PROC) != serving
        assert await status(grpc_port, keys.HEALTH_EXT_PROC) != serving  # port still open
        assert await status(health_port, keys.HEALTH_LIVENESS) == serving
        # Discovery still runs: a pod added during the drain becomes an endpoint.
        fake.put_pod("b", "10.0.0.2", labels=app)
        await eventually(lambda: len(server.store) == 2)
        assert len(server.store) == 2
        await asyncio.wait_for(drain, 5)
        lease = fake.get("leases", lease_name)
        assert lease is not None and not lease["spec"].get("holderIdentity")  # released
        # Nothing may turn readiness back on (e.g. a discovery state change).
        await server.parts.health.update()
        assert await status(health_port, keys.HEALTH_READINESS) != serving
    finally:
        await server.stop(0)
