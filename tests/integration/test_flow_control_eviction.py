"""llm-d's in-flight eviction (``flowControl.enableEviction``; docs/flow-control.md)
through real Envoy: a slow simulated pod, a pool that takes one request at a time
(concurrency-detector, ``maxConcurrency: 1``), InferenceObjectives ``batch`` (priority -1,
sheddable) and ``critical`` (10).

A sheddable request is being served when a critical one arrives: the critical one queues
(the pool is saturated), flow control evicts the sheddable one — its client gets llm-d's
answer, 429 ``request evicted by flow control`` with ``x-llm-d-request-dropped-reason:
evicted`` — and the critical one is served in the freed slot long before the sheddable
one would have finished. The eviction is not counted as a request error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
import pytest_asyncio
import yaml

from epp.stack.procs import free_port
from tests.integration.conftest import (
    Stack,
    Upstreams,
    eventually,
    start_sims,
    start_stack,
    stop_stack,
)
from tests.integration.test_flow_control import metrics_text, outcomes, total

pytestmark = pytest.mark.integration

MS_PER_TOKEN = 100
SLOW_TOKENS = 40  # the sheddable request would take ~4 s

OBJECTIVES = [
    {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
     "metadata": {"name": name, "namespace": "default"},
     "spec": {"priority": priority, "poolRef": {"name": "pool"}}}
    for name, priority in (("batch", -1), ("critical", 10))
]

CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: concurrency-detector
  parameters: {maxConcurrency: 1}
- type: queue-scorer
- type: max-score-picker
flowControl:
  enableEviction: true
  defaultRequestTTL: 60s
  saturationDetector:
    pluginRef: concurrency-detector
"""


@pytest_asyncio.fixture(scope="module")
async def slow_pod(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Upstreams]:
    ports = [free_port()]
    proc = await start_sims(ports, tmp_path_factory.mktemp("ev-sim") / "sim.log",
                            "--decode-base-ms", str(MS_PER_TOKEN))
    yield Upstreams(ports, proc)
    await proc.stop()


@pytest_asyncio.fixture(scope="module")
async def ev_stack(slow_pod: Upstreams,
                   tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    workdir: Path = tmp_path_factory.mktemp("ev")
    objectives = workdir / "objectives.yaml"
    objectives.write_text(yaml.safe_dump_all(OBJECTIVES, sort_keys=False))
    s = await start_stack("FULL_DUPLEX_STREAMED", slow_pod, workdir,
                          endpoint_ports=slow_pod.ports, config=CONFIG,
                          extra_args=["--objectives-file", str(objectives)],
                          response_path="inline")
    yield s
    await stop_stack(s)


async def post(session: aiohttp.ClientSession, s: Stack, objective: str,
               tokens: int) -> tuple[int, dict[str, str], bytes, float]:
    body = orjson.dumps({"model": "m", "prompt": "one two three", "max_tokens": tokens})
    t0 = time.monotonic()
    async with session.post(s.url + "/v1/completions", data=body, headers={
            "content-type": "application/json",
            "x-gateway-inference-objective": objective}) as r:
        return r.status, dict(r.headers), await r.read(), time.monotonic() - t0


async def test_critical_request_evicts_the_sheddable_one_in_flight(
        ev_stack: Stack, session: aiohttp.ClientSession) -> None:
    before = outcomes(await metrics_text(session, ev_stack))
    errors_before = total(await metrics_text(session, ev_stack),
                          "inference_objective_request_error_total")
    sheddable = asyncio.ensure_future(post(session, ev_stack, "batch", SLOW_TOKENS))

    async def in_flight() -> bool:
        text = await metrics_text(session, ev_stack)
        return (outcomes(text) - before)["Dispatched"] == 1

    await eventually(in_flight, timeout=10)
    status, _, body, seconds = await post(session, ev_stack, "critical", 2)
    assert status == 200, body
    s_status, s_headers, s_body, s_seconds = await sheddable
    assert s_status == 429, s_body
    assert s_body == b"request evicted by flow control"
    assert s_headers.get("x-llm-d-request-dropped-reason") == "evicted"
    # Evicted well before its ~4 s of decoding; the critical one ran in the freed slot.
    assert s_seconds < SLOW_TOKENS * MS_PER_TOKEN / 1000 / 2
    assert seconds < SLOW_TOKENS * MS_PER_TOKEN / 1000 / 2
    text = await metrics_text(session, ev_stack)
    assert (outcomes(text) - before)["Dispatched"] == 2
    # Not an error of the EPP's (llm-d counts none for an eviction).
    assert total(text, "inference_objective_request_error_total") == errors_before
