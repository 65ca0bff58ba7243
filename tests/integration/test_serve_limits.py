"""Limits and binding of `epp serve`: an oversized BUFFERED body gets its 413 (not a gRPC
message-size error), and each port listens on its own --*-bind-address."""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp
import grpc
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.stack.procs import ManagedProcess, free_port, wait_port
from tests.integration.conftest import MAX_BODY, ROOT, Upstreams, start_stack, stop_stack

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("workers", [1, 2])
async def test_buffered_body_far_over_the_limit_gets_413_json(
        workers: int, upstreams: Upstreams, session: aiohttp.ClientSession,
        tmp_path: Path) -> None:
    # The EPP's limit is MAX_BODY (4 MiB); Envoy buffers up to 16 MiB. A body of limit +
    # 2 MiB reaches the EPP as one gRPC message, which used to exceed the server's
    # receive limit (limit + 1 MiB): RESOURCE_EXHAUSTED, an empty 500 from Envoy.
    s = await start_stack("BUFFERED", upstreams, tmp_path, extra_args=["--workers", str(workers)])
    try:
        big = b'{"model":"m","prompt":"' + b"x" * (MAX_BODY + (2 << 20)) + b'"}'
        async with session.post(s.url + "/v1/completions", data=big) as r:
            assert r.status == 413
            err = orjson.loads(await r.read())["error"]
        assert err["code"] == 413 and "limit" in err["message"]
        # The stream is answered, not broken: the next request is routed as usual.
        async with session.post(s.url + "/v1/completions", data=orjson.dumps(
                {"model": "m", "prompt": "hi", "max_tokens": 2})) as r:
            assert r.status == 200
    finally:
        await stop_stack(s)


async def test_each_port_listens_on_its_own_bind_address(tmp_path: Path) -> None:
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    proc = ManagedProcess(
        [sys.executable, "-m", "epp.cli", "serve", "--drain-quiet-period", "0", "--bind-address", "127.0.0.1",
         "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
         "--metrics-port", str(metrics_port), "--grpc-health-bind-address", "127.0.0.3",
         "--metrics-bind-address", "127.0.0.2", "--endpoints", "127.0.0.1:1",
         "--no-metrics-scraping", "--drain-timeout", "0"],
        log_path=tmp_path / "epp.log", cwd=ROOT)
    await proc.start()
    try:
        await wait_port("127.0.0.2", metrics_port, timeout=20)
        await wait_port("127.0.0.1", grpc_port, timeout=20)
        for host, port in (("127.0.0.1", metrics_port), ("127.0.0.2", grpc_port),
                           ("127.0.0.1", health_port)):
            with pytest.raises(TimeoutError):
                await wait_port(host, port, timeout=0.2)
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.2:{metrics_port}/metrics") as r:
            assert r.status == 200
        async with grpc.aio.insecure_channel(f"127.0.0.3:{health_port}") as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        log = (tmp_path / "epp.log").read_text()
        assert (f"ext_proc on 127.0.0.1:{grpc_port} (health 127.0.0.3:{health_port}, "
                f"metrics 127.0.0.2:{metrics_port})") in log
    finally:
        await proc.stop()
    assert proc.returncode == 0
