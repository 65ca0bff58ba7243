"""Admission before scheduling, as GIE v1.5.0's Director runs it
(pkg/epp/requestcontrol/admission.go, director.go; admission_test.go's cases).

- Without the ``flowControl`` feature gate, GIE's LegacyAdmissionController: a sheddable
  request (priority < 0) is refused with 429 "system saturated, sheddable request
  dropped" while the config's saturation detector reads its candidates at or over 1.0;
  every other request passes.
- With the gate, GIE's FlowControlAdmissionController: every request waits in the flow
  controller until the pool can take it, then is scheduled; the outcome's status
  otherwise (429 capacity, 503 TTL, 503 client gone, 500 not running).

The graph is the one ``epp serve`` wires (epp/server/wiring.py), driven through the
Director as the ext_proc handler drives it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import pytest_asyncio

from epp.config.loader import load_and_build
from epp.datastore.objectives import Objective
from epp.errors import EppError, NoCapacity, ServiceUnavailable
from epp.flowcontrol import QueueOutcome
from epp.handlers.protocol import Routing
from epp.scheduling.types import Metrics
from epp.server.options import (
    RoutingOptions,
    ServeOptions,
    StaticSourceOptions,
    validate,
)
from epp.server.wiring import NotifyingDatastore, PluginTimings, ServerParts, wire
from tests.polling import eventually

ONE = "10.0.0.1:8000"
TWO = f"{ONE},10.0.0.2:8000"
H = {":method": "POST", ":path": "/v1/chat/completions"}


def body(model: str = "llama") -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})


def headers(rid: str, **extra: str) -> dict[str, str]:
    return {**H, "x-request-id": rid, **extra}


def server(config: str, endpoints: str = ONE, **options: Any) -> ServerParts:
    """The wired graph of ``epp serve --endpoints …`` with ``config``; nothing started."""
    timings = PluginTimings()
    built = load_and_build(None, config, timer=timings)
    return wire(validate(ServeOptions(static=StaticSourceOptions(endpoints=endpoints),
                                      **options)), built, timings, None)


def scraped(parts: ServerParts, waiting: int = 0) -> None:
    """Every endpoint scraped just now, ``waiting`` requests queued on each."""
    for ep in parts.store.snapshot():
        parts.store.update_metrics(ep.key, Metrics(waiting_queue_size=waiting,
                                                   updated_at=time.monotonic()))


def errors(parts: ServerParts, code: str) -> float | None:
    return parts.metrics.registry.get_sample_value(
        "inference_objective_request_error_total",
        {"model_name": "llama", "target_model_name": "llama", "error_code": code})


def finish(parts: ServerParts, routing: Routing) -> None:
    """The response of a routed request ends (200)."""
    d = parts.director
    d.on_response_headers(routing.context, 200, {"content-type": "application/json"})
    d.on_response_body(routing.context, b"{}", True)
    d.on_done(routing.context, aborted=False)


# ======================================================== legacy admission (no gate)

# The built-in default config (utilization-detector with GIE's defaults: a queue of 5)
# and two objectives.
LEGACY = """\
plugins:
- type: queue-scorer
- type: max-score-picker
"""


def legacy(endpoints: str = ONE) -> ServerParts:
    parts = server(LEGACY, endpoints)
    parts.objectives.replace([Objective("batch", -1), Objective("critical", 10)], [])
    assert parts.flow_control is None and not isinstance(parts.store, NotifyingDatastore)
    return parts


async def test_legacy_sheddable_is_rejected_with_429_while_saturated() -> None:
    parts = legacy()
    scraped(parts, waiting=50)  # queue 50 > 5: saturated
    with pytest.raises(NoCapacity) as info:
        await parts.director.route(headers("r1", **{"x-gateway-inference-objective": "batch"}),
                                   body(), True, None)
    assert (info.value.status, info.value.message) == (
        429, "system saturated, sheddable request dropped")
    assert errors(parts, "ResourceExhausted") == 1
    # Not counted as a request (GIE counts those it schedules).
    assert parts.metrics.registry.get_sample_value(
        "inference_objective_request_total",
        {"model_name": "llama", "target_model_name": "llama", "priority": "-1"}) is None


@pytest.mark.parametrize("objective", ["critical", "unknown", None])
async def test_legacy_non_sheddable_passes_while_saturated(objective: str | None) -> None:
    parts = legacy()
    scraped(parts, waiting=50)
    extra = {"x-gateway-inference-objective": objective} if objective else {}
    r = await parts.director.route(headers("r1", **extra), body(), True, None)
    assert r.destination == ONE


async def test_legacy_sheddable_passes_when_not_saturated() -> None:
    parts = legacy()
    scraped(parts, waiting=1)
    r = await parts.director.route(
        headers("r1", **{"x-gateway-inference-objective": "batch"}), body(), True, None)
    assert r.destination == ONE


async def test_legacy_unscraped_pool_reads_saturated() -> None:
    """GIE's utilization detector: stale (never scraped) metrics count as saturated."""
    parts = legacy()
    with pytest.raises(NoCapacity):
        await parts.director.route(
            headers("r1", **{"x-gateway-inference-objective": "batch"}), body(), True, None)


async def test_legacy_reads_the_subset_hints_endpoints() -> None:
    parts = legacy(TWO)
    scraped(parts, waiting=0)
    parts.store.update_metrics("10.0.0.2:8000", Metrics(waiting_queue_size=50,
                                                        updated_at=time.monotonic()))
    sheddable = headers("r1", **{"x-gateway-inference-objective": "batch"})
    # The pool as a whole is at 0.5 + 10 / 2 … the subset decides.
    with pytest.raises(NoCapacity):
        await parts.director.route(sheddable, body(), True, ["10.0.0.2:8000"])
    r = await parts.director.route(sheddable, body(), True, [ONE])
    assert r.destination == ONE


async def test_legacy_no_endpoints() -> None:
    """GIE: admission first (sheddable, no pods: saturated → 429), then the candidates
    (none → 503)."""
    parts = legacy()
    parts.store.set_endpoints([])
    with pytest.raises(NoCapacity):
        await parts.director.route(
            headers("r1", **{"x-gateway-inference-objective": "batch"}), body(), True, None)
    with pytest.raises(ServiceUnavailable):
        await parts.director.route(headers("r2"), body(), True, None)


# =================================================== flow control (the feature gate)

# By default one endpoint that takes one request at a time (concurrency-detector:
# saturation is the in-flight count over maxConcurrency), so the test decides when the
# pool is saturated.
CONCURRENCY = "{type: concurrency-detector, parameters: {maxConcurrency: 1}}"


def fc_config(flow_control: str = "{}", detector: str = CONCURRENCY) -> str:
    return f"""\
featureGates: [flowControl]
plugins:
- {detector}
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: queue-scorer}}, {{pluginRef: max-score-picker}}]
saturationDetector: {{pluginRef: {detector.split(",")[0].split(": ")[1]}}}
flowControl: {flow_control}
"""


@pytest_asyncio.fixture
async def fc() -> AsyncIterator[ServerParts]:
    parts = server(fc_config("{maxRequests: 2, defaultRequestTTL: 10s}"))
    assert parts.flow_control is not None
    await parts.flow_control.start()
    try:
        yield parts
    finally:
        await parts.flow_control.stop()


def queued(parts: ServerParts) -> int:
    assert parts.flow_control is not None
    return parts.flow_control.stats().queued


def outcomes(parts: ServerParts) -> dict[QueueOutcome, int]:
    assert parts.flow_control is not None
    return {o: n for o, n in parts.flow_control.stats().outcomes.items() if n}


async def test_flow_control_queues_while_saturated_then_dispatches(fc: ServerParts) -> None:
    d = fc.director
    first = await d.route(headers("r1"), body(), True, None)  # in flight: saturated
    assert first.destination == ONE
    second = asyncio.ensure_future(d.route(headers("r2"), body(), True, None))
    await eventually(lambda: queued(fc) == 1)
    await asyncio.sleep(0.02)  # the point: nothing is dispatched while saturated
    assert not second.done()
    assert fc.metrics.registry.get_sample_value(
        "inference_extension_flow_control_queue_size",
        {"fairness_id": "default-flow", "priority": "0", "inference_pool": "static",
         "model_name": "llama", "target_model_name": "llama"}) == 1
    finish(fc, first)  # the response ended: notify() → dispatched
    r2 = await asyncio.wait_for(second, 5)
    assert r2.destination == ONE and queued(fc) == 0
    assert outcomes(fc) == {QueueOutcome.DISPATCHED: 2}
    finish(fc, r2)


async def test_flow_control_capacity_429(fc: ServerParts) -> None:
    d = fc.director
    first = await d.route(headers("r1"), body(), True, None)
    waiting = [asyncio.ensure_future(d.route(headers(f"w{i}"), body(), True, None))
               for i in range(2)]
    await eventually(lambda: queued(fc) == 2)
    with pytest.raises(NoCapacity) as info:  # maxRequests: 2
        await d.route(headers("r4"), body(), True, None)
    assert (info.value.status, info.value.message) == (
        429, "request rejected pre-queue: queue at capacity")
    assert errors(fc, "ResourceExhausted") == 1
    finish(fc, first)
    for w in waiting:  # each dispatched in turn as the one before it completes
        finish(fc, await asyncio.wait_for(w, 5))
    assert outcomes(fc) == {QueueOutcome.DISPATCHED: 3, QueueOutcome.REJECTED_CAPACITY: 1}


async def test_flow_control_ttl_503() -> None:
    parts = server(fc_config("{defaultRequestTTL: 50ms}"))
    assert parts.flow_control is not None
    await parts.flow_control.start()
    try:
        first = await parts.director.route(headers("r1"), body(), True, None)
        with pytest.raises(ServiceUnavailable) as info:
            await asyncio.wait_for(parts.director.route(headers("r2"), body(), True, None), 5)
        assert info.value.status == 503
        assert info.value.message == ("request timed out in queue: request evicted from "
                                      "queue: request TTL expired")
        assert errors(parts, "ServiceUnavailable") == 1
        finish(parts, first)
    finally:
        await parts.flow_control.stop()


async def test_flow_control_client_gone_leaves_the_queue_at_once(fc: ServerParts) -> None:
    d = fc.director
    first = await d.route(headers("r1"), body(), True, None)
    gone = asyncio.ensure_future(d.route(headers("r2"), body(), True, None))
    await eventually(lambda: queued(fc) == 1)
    gone.cancel()  # the ext_proc stream's task is cancelled when Envoy resets it
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert queued(fc) == 0  # at once, not at the next cycle
    assert outcomes(fc) == {QueueOutcome.DISPATCHED: 1,
                            QueueOutcome.EVICTED_CONTEXT_CANCELLED: 1}
    assert errors(fc, "ServiceUnavailable") == 1
    assert fc.metrics.registry.get_sample_value(
        "inference_extension_flow_control_queue_size",
        {"fairness_id": "default-flow", "priority": "0", "inference_pool": "static",
         "model_name": "llama", "target_model_name": "llama"}) == 0
    # Its slot is free: the next request is served as soon as the first completes.
    finish(fc, first)
    finish(fc, await d.route(headers("r3"), body(), True, None))


async def test_flow_control_fairness_id_and_priority_name_the_flow(fc: ServerParts) -> None:
    fc.objectives.replace([Objective("batch", -1)], [])
    d = fc.director
    first = await d.route(headers("r1"), body(), True, None)
    # Sheddable under flow control: queued in its own band, not rejected.
    shed = asyncio.ensure_future(d.route(headers("r2", **{
        "x-gateway-inference-objective": "batch",
        "x-gateway-inference-fairness-id": "tenant-a"}), body(), True, None))
    await eventually(lambda: queued(fc) == 1)
    assert fc.flow_control is not None
    band = fc.flow_control.band(-1)
    assert band is not None and band.flow_ids() == ["tenant-a"]
    assert fc.metrics.registry.get_sample_value(
        "inference_extension_flow_control_queue_bytes",
        {"fairness_id": "tenant-a", "priority": "-1", "inference_pool": "static",
         "model_name": "llama", "target_model_name": "llama"}) == len(body())
    finish(fc, first)
    finish(fc, await asyncio.wait_for(shed, 5))


async def test_flow_control_no_candidates_503_at_once(fc: ServerParts) -> None:
    fc.store.set_endpoints([])
    with pytest.raises(ServiceUnavailable) as info:
        await fc.director.route(headers("r1"), body(), True, None)
    assert info.value.message == "no ready endpoints in the pool"
    with pytest.raises(ServiceUnavailable):
        await fc.director.route(headers("r2"), body(), True, ["10.9.9.9:8000"])
    assert queued(fc) == 0 and not outcomes(fc)  # never reached the controller


async def test_flow_control_not_running_500() -> None:
    parts = server(fc_config())
    with pytest.raises(EppError) as info:
        await parts.director.route(headers("r1"), body(), True, None)
    assert info.value.status == 500
    assert info.value.message == ("internal flow control error: request rejected pre-queue: "
                                  "flow controller is not running")


async def test_metrics_refresh_notifies_the_controller() -> None:
    """After each endpoint-metrics refresh the controller runs a dispatch cycle, so the
    pool saturation gauge follows the pool with nothing queued."""
    parts = server(fc_config(detector="{type: utilization-detector, parameters: "
                                      "{queueDepthThreshold: 4}}"))
    assert parts.flow_control is not None and isinstance(parts.store, NotifyingDatastore)
    gauge = ("inference_extension_flow_control_pool_saturation", {"inference_pool": "static"})
    await parts.flow_control.start()
    try:
        scraped(parts, waiting=2)
        await eventually(lambda: parts.metrics.registry.get_sample_value(*gauge) == 0.5)
        scraped(parts, waiting=8)
        await eventually(lambda: parts.metrics.registry.get_sample_value(*gauge) == 2.0)
    finally:
        await parts.flow_control.stop()


async def test_subset_filter_disabled_ignores_the_hint_in_admission() -> None:
    parts = server(fc_config(), routing=RoutingOptions(disable_endpoint_subset_filter=True))
    assert parts.flow_control is not None
    await parts.flow_control.start()
    try:
        r = await parts.director.route(headers("r1"), body(), True, ["10.9.9.9:8000"])
        assert r.destination == ONE
    finally:
        await parts.flow_control.stop()


async def test_stop_ends_queued_requests_with_500(fc: ServerParts) -> None:
    d = fc.director
    await d.route(headers("r1"), body(), True, None)
    waiting = asyncio.ensure_future(d.route(headers("r2"), body(), True, None))
    await eventually(lambda: queued(fc) == 1)
    assert fc.flow_control is not None
    await fc.flow_control.stop()
    with pytest.raises(EppError) as info:
        await waiting
    assert info.value.status == 500
    assert "flow controller is not running" in info.value.message
