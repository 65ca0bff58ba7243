"""SIGTERM through real Envoy: readiness drops at once, the ext_proc port keeps serving,
long streams finish within --drain-timeout, and what outlives it is cut.

The model servers are `epp sim` pods slowed to ~100 ms per token, so a streamed response
of N tokens lasts about N/10 seconds and its ext_proc stream is in flight all that time
(in the default lean gateway shape too: Envoy ends the stream when the response ends).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import orjson
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.stack.procs import LOCAL_SERVE_FLAGS, ManagedProcess, free_port, wait_port
from tests.integration.conftest import (
    ROOT,
    Stack,
    Upstreams,
    eventually,
    start_sims,
    start_stack,
    stop_stack,
)

pytestmark = pytest.mark.integration

MS_PER_TOKEN = 100
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest_asyncio.fixture(scope="module")
async def slow_pods(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Upstreams]:
    ports = [free_port() for _ in range(2)]
    proc = await start_sims(ports, tmp_path_factory.mktemp("slow-sim") / "sim.log",
                            "--decode-base-ms", str(MS_PER_TOKEN))
    yield Upstreams(ports, proc)
    await proc.stop()


def chat(tokens: int, stream: bool = True) -> bytes:
    return orjson.dumps({"model": "m", "stream": stream, "max_tokens": tokens,
                         "messages": [{"role": "user", "content": "tell me a long story"}]})


async def stream_chat(session: aiohttp.ClientSession, url: str, tokens: int,
                      started: asyncio.Event) -> str:
    """A streamed chat completion; sets ``started`` at its first event. Returns the body
    read, ending in ``data: [DONE]`` when it was complete; raises if the stream is cut."""
    async with session.post(url + "/v1/chat/completions", data=chat(tokens)) as r:
        assert r.status == 200
        parts = [await r.content.readline()]
        started.set()
        parts.append(await r.content.read())
    return b"".join(parts).decode()


def complete(text: str, tokens: int) -> bool:
    return text.rstrip().endswith("data: [DONE]") and f"tok{tokens - 1}" in text


async def start_streams(s: Stack, session: aiohttp.ClientSession, n: int,
                        tokens: int) -> list[asyncio.Task[str]]:
    started = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.ensure_future(stream_chat(session, s.url, tokens, e)) for e in started]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 15)
    return tasks


async def health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2)
        return int(resp.status)


async def until_not_serving(port: int, limit_s: float = 2.0) -> float:
    """Seconds until readiness on ``port`` reports NOT_SERVING (polled back to back)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        async def not_serving() -> bool:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"),
                                    timeout=2)
            return resp.status == NOT_SERVING

        await eventually(not_serving, timeout=limit_s, interval=0,
                         what="readiness NOT_SERVING after the signal")
        return loop.time() - t0


async def wait_ready(port: int) -> None:
    async def ready() -> bool:
        return await health(port, "readiness") == SERVING

    # Not listening yet, or not answering yet: an RPC error means "not yet".
    await eventually(ready, timeout=20, retry_on=(grpc.aio.AioRpcError,),
                     what="readiness SERVING")


def epp_log(s: Stack) -> str:
    return (s.epp.workdir / f"epp-{s.epp.starts}.log").read_text()


async def _sigterm_during_streams(s: Stack, session: aiohttp.ClientSession, n: int,
                                  tokens: int) -> float:
    """Start ``n`` streams of ``tokens`` tokens, SIGTERM the EPP (its main process only, as
    Kubernetes does), check readiness drops at once and new requests are still served,
    that every stream completes and the EPP exits 0 by itself; the seconds it took."""
    assert s.epp.proc is not None and s.epp.proc.pid is not None
    await wait_ready(s.epp.health_port)
    streams = await start_streams(s, session, n, tokens)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    os.kill(s.epp.proc.pid, signal.SIGTERM)
    assert await until_not_serving(s.epp.health_port) < 0.1
    # New requests during the drain are routed and served (Envoy has not noticed).
    for _ in range(3):
        async with session.post(s.url + "/v1/chat/completions", data=chat(2, False)) as r:
            assert r.status == 200, await r.text()
    texts = await asyncio.wait_for(asyncio.gather(*streams), 20)
    assert all(complete(t, tokens) for t in texts)
    # The EPP exits by itself once idle (the stack passes --drain-quiet-period 0), well
    # before the 20 s drain timeout.
    assert await asyncio.wait_for(s.epp.proc.wait(), 10) == 0
    return loop.time() - t0


async def test_long_streams_survive_sigterm_and_new_requests_are_served(
        slow_pods: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    tokens = 65  # ~6.5 s: longer than the old hard-coded 5 s grace
    s = await start_stack("FULL_DUPLEX_STREAMED", slow_pods, tmp_path,
                          endpoint_ports=slow_pods.ports, extra_args=["--drain-timeout", "20s"])
    try:
        assert 5 < await _sigterm_during_streams(s, session, 2, tokens) < 15
        log = epp_log(s)
        assert "2 streams were in flight at the start, 3 started during the drain, 0 cut" in log
    finally:
        await stop_stack(s)


async def test_readiness_not_serving_within_100ms_liveness_stays(tmp_path: Path) -> None:
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    proc = ManagedProcess([sys.executable, "-m", "epp.cli", "serve", *LOCAL_SERVE_FLAGS, "--bind-address",
                           "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port",
                           str(health_port), "--metrics-port", str(metrics_port), "--endpoints",
                           "127.0.0.1:1", "--no-metrics-scraping",
                           "--drain-quiet-period", "2s"],
                          log_path=tmp_path / "epp.log", cwd=ROOT)
    await proc.start()
    try:
        await wait_ready(health_port)
        await wait_port("127.0.0.1", grpc_port, timeout=20)
        assert await health(grpc_port, "envoy.service.ext_proc.v3.ExternalProcessor") == SERVING
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGTERM)
        took = await until_not_serving(health_port)
        print(f"\n[drain] readiness NOT_SERVING {took * 1e3:.1f} ms after SIGTERM")
        assert took < 0.1, took
        # Liveness stays SERVING; the ext_proc port still answers (it is draining, not
        # closed), its health service NOT_SERVING like readiness.
        assert await health(health_port, "liveness") == SERVING
        assert await health(health_port, "envoy.service.ext_proc.v3.ExternalProcessor") \
            == NOT_SERVING
        assert await health(grpc_port, "envoy.service.ext_proc.v3.ExternalProcessor") \
            == NOT_SERVING
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        await proc.stop()


async def test_drain_timeout_cuts_what_remains_and_exits(
        slow_pods: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    s = await start_stack("FULL_DUPLEX_STREAMED", slow_pods, tmp_path,
                          endpoint_ports=slow_pods.ports, extra_args=["--drain-timeout", "2s"])
    try:
        assert s.epp.proc is not None and s.epp.proc.pid is not None
        await wait_ready(s.epp.health_port)
        (stream,) = await start_streams(s, session, 1, 150)  # ~15 s: outlives the drain
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        os.kill(s.epp.proc.pid, signal.SIGTERM)
        assert await asyncio.wait_for(s.epp.proc.wait(), 10) == 0
        took = loop.time() - t0
        assert 1.9 < took < 5, took
        try:
            text = await asyncio.wait_for(stream, 10)
        except aiohttp.ClientError:
            pass  # cut: the connection was reset mid-body
        else:
            assert not complete(text, 150)
        assert "1 streams were in flight at the start, 0 started during the drain, 1 cut" \
            in epp_log(s)
    finally:
        await stop_stack(s)


async def test_workers_drain_when_only_the_core_gets_sigterm(
        slow_pods: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    s = await start_stack("FULL_DUPLEX_STREAMED", slow_pods, tmp_path,
                          endpoint_ports=slow_pods.ports,
                          extra_args=["--workers", "2", "--drain-timeout", "20s"])
    try:
        # The signal reaches the core only; the core tells its workers.
        assert 4 < await _sigterm_during_streams(s, session, 3, 60) < 15
        log = epp_log(s)
        assert log.count("drain finished") == 3  # two workers and the core
        assert log.count(" 0 cut") == 2 and "2 of 2 ext_proc workers exited" in log
    finally:
        await stop_stack(s)
