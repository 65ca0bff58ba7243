"""Flow control through real Envoy (the ``flowControl`` feature gate; docs/flow-control.md):
simulated pods that answer slowly, a pool that takes one request at a time
(concurrency-detector, ``maxConcurrency: 1``) and a queue of three.

- A burst larger than the pool and the queue: one request is served at once, the queue's
  requests wait and are served in turn as capacity frees, the overflow is rejected at
  once with 429 and GIE's JSON error body.
- A client that disconnects while queued leaves the queue at once (the queue gauge is
  back to 0 while the pool is still busy) and its slot serves the next request.
- Accounting: dispatched + rejected + evicted = sent, from the EPP's flow-control metrics.

Each runs in one process and with ``--workers 2`` (the controller in the core, the fronts
forwarding their clients' disconnects).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
import pytest_asyncio

from epp.stack.procs import free_port
from tests.integration.conftest import (
    Stack,
    Upstreams,
    eventually,
    start_sims,
    start_stack,
    stop_stack,
)

pytestmark = pytest.mark.integration

MS_PER_TOKEN = 100  # the slow pod: 100 ms per decode step
CAPACITY = 3  # flowControl.maxRequests

CONFIG = f"""\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: concurrency-detector
  parameters: {{maxConcurrency: 1}}
- type: queue-scorer
- type: max-score-picker
saturationDetector:
  pluginRef: concurrency-detector
flowControl:
  maxRequests: {CAPACITY}
  defaultRequestTTL: 60s
"""

QUEUE_SIZE = "inference_extension_flow_control_queue_size"
OUTCOMES = "inference_extension_flow_control_request_queue_duration_seconds_count"


@pytest_asyncio.fixture(scope="module")
async def slow_pod(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Upstreams]:
    ports = [free_port()]
    proc = await start_sims(ports, tmp_path_factory.mktemp("fc-sim") / "sim.log",
                            "--decode-base-ms", str(MS_PER_TOKEN))
    yield Upstreams(ports, proc)
    await proc.stop()


@pytest_asyncio.fixture(scope="module", params=["1", "2"], ids=["one-process", "workers-2"])
async def fc_stack(request: pytest.FixtureRequest, slow_pod: Upstreams,
                   tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    s = await start_stack("FULL_DUPLEX_STREAMED", slow_pod,
                          tmp_path_factory.mktemp(f"fc-{request.param}"),
                          endpoint_ports=slow_pod.ports, config=CONFIG,
                          extra_args=["--workers", request.param])
    yield s
    await stop_stack(s)


def completion(tokens: int) -> bytes:
    return orjson.dumps({"model": "m", "prompt": "one two three", "max_tokens": tokens})


async def post(session: aiohttp.ClientSession, s: Stack, tokens: int) -> tuple[int, bytes]:
    async with session.post(s.url + "/v1/completions", data=completion(tokens),
                            headers={"content-type": "application/json"}) as r:
        return r.status, await r.read()


async def metrics_text(session: aiohttp.ClientSession, s: Stack) -> str:
    async with session.get(f"http://127.0.0.1:{s.epp.metrics_port}/metrics") as r:
        assert r.status == 200
        return await r.text()


def total(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(
        rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def outcomes(text: str) -> Counter[str]:
    """Requests by flow-control outcome (the queue-duration histogram's counts)."""
    out: Counter[str] = Counter()
    for labels, value in re.findall(rf"^{OUTCOMES}{{([^}}]*)}} (\S+)$", text, re.MULTILINE):
        outcome = re.search(r'outcome="([^"]*)"', labels)
        assert outcome is not None
        out[outcome.group(1)] += int(float(value))
    return out


async def test_burst_queued_then_served_overflow_rejected(
        fc_stack: Stack, session: aiohttp.ClientSession) -> None:
    before = outcomes(await metrics_text(session, fc_stack))
    n = 8
    started = time.monotonic()
    results = await asyncio.gather(*(post(session, fc_stack, 5) for _ in range(n)))
    elapsed = time.monotonic() - started
    statuses = Counter(status for status, _ in results)
    assert set(statuses) <= {200, 429}, statuses
    # One at a time on the pod, three waiting: four served, the rest over capacity.
    assert statuses[200] >= 1 + CAPACITY and statuses[429] >= 1, statuses
    for status, body in results:
        if status == 429:
            assert orjson.loads(body) == {"error": {
                "message": "request rejected pre-queue: queue at capacity",
                "type": "rate_limit_exceeded", "code": 429}}
    # The served ones went one after the other (5 tokens × 100 ms each).
    assert elapsed >= statuses[200] * 5 * MS_PER_TOKEN / 1000 * 0.8
    text = await metrics_text(session, fc_stack)
    got = outcomes(text) - before
    assert got == Counter({"Dispatched": statuses[200], "RejectedCapacity": statuses[429]})
    assert total(text, QUEUE_SIZE) == 0
    # Dispatched + rejected + evicted = sent.
    assert sum(got.values()) == n


async def test_client_gone_while_queued_leaves_the_queue(
        fc_stack: Stack, session: aiohttp.ClientSession) -> None:
    before = outcomes(await metrics_text(session, fc_stack))
    busy = asyncio.ensure_future(post(session, fc_stack, 40))  # holds the pod for ~4 s

    async def dispatched() -> bool:
        return (outcomes(await metrics_text(session, fc_stack)) - before)["Dispatched"] == 1

    await eventually(dispatched)
    # A client whose request waits in the queue, then hangs up.
    _, writer = await asyncio.open_connection("127.0.0.1", fc_stack.port)
    body = completion(2)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\n"
                 b"content-type: application/json\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()

    async def queue_size() -> float:
        return total(await metrics_text(session, fc_stack), QUEUE_SIZE)

    async def queue_empty() -> bool:
        return await queue_size() == 0

    await eventually(queue_size, what="the request to be queued")
    writer.close()
    await writer.wait_closed()
    # Out of the queue at once: long before the pod is free again.
    await eventually(queue_empty, timeout=2.0)
    assert not busy.done()
    got = outcomes(await metrics_text(session, fc_stack)) - before
    assert got == Counter({"Dispatched": 1, "EvictedContextCancelled": 1})
    assert (await busy)[0] == 200
    # The pool is free: the next request is served at once.
    assert (await post(session, fc_stack, 1))[0] == 200
    got = outcomes(await metrics_text(session, fc_stack)) - before
    assert sum(got.values()) == 3  # dispatched 2 + evicted 1 = sent 3
