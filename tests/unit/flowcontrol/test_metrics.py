"""The six flow-control series: GIE v1.5.0's names, types, help texts, labels and buckets
(the table in tests/unit/gie/test_metrics.py), and what the controller records in them
(pkg/epp/metrics/metrics.go; where controller.go, processor.go and item.go record)."""

from __future__ import annotations

import asyncio
import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from epp.flowcontrol import (
    FlowController,
    FlowControlMetrics,
    FlowControlRequest,
    FlowControlResult,
    QueueOutcome,
    default_config,
)
from tests.unit.gie.test_metrics import GIE_METRICS

POOL = "pool-a"


def families(registry: CollectorRegistry) -> dict[str, Metric]:
    """Families by name, the client's ``*_created`` ones left out (as
    tests/unit/gie/test_metrics.py scrapes)."""
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)
            if not f.name.endswith("_created")}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def traffic(saturation: list[float]) -> tuple[
        FlowControlMetrics, FlowController, asyncio.Future[FlowControlResult]]:
    """One dispatched, one capacity-rejected, one TTL-expired, one still queued."""
    metrics = FlowControlMetrics(CollectorRegistry(), POOL)
    fc = FlowController(default_config(band_max_requests=2),
                        lambda subset: saturation[0], metrics=metrics, dispatch_interval=3600)
    await fc.start()
    req = FlowControlRequest(fairness_id="tenant", priority=3, byte_size=100, model_name="m",
                             target_model_name="t")
    assert (await fc.enqueue_and_wait(req)).dispatched
    saturation[0] = 1.0
    ttl = FlowControlRequest("tenant", 3, 100, model_name="m", target_model_name="t", ttl=0.01)
    expiring = asyncio.ensure_future(fc.enqueue_and_wait(ttl))
    waiting = asyncio.ensure_future(fc.enqueue_and_wait(req))
    await asyncio.sleep(0)
    assert (await fc.enqueue_and_wait(req)).outcome is QueueOutcome.REJECTED_CAPACITY
    assert (await expiring).outcome is QueueOutcome.EVICTED_TTL
    assert not waiting.done()
    return metrics, fc, waiting


def flow_labels(outcome: str | None = None) -> dict[str, str]:
    labels = {"fairness_id": "tenant", "priority": "3", "inference_pool": POOL,
              "model_name": "m", "target_model_name": "t"}
    if outcome is not None:
        labels["outcome"] = outcome
    return labels


async def test_names_types_help_labels_and_buckets_are_gie_s() -> None:
    saturation = [0.0]
    metrics, fc, _ = await traffic(saturation)
    try:
        fams = families(metrics.registry)
        expected = {n: v for n, v in GIE_METRICS.items()
                    if n.startswith("inference_extension_flow_control_")}
        assert len(expected) == 6
        assert set(fams) == set(expected)
        for name, (kind, labels, buckets, help_, _) in expected.items():
            f = fams[name]
            assert f.type == kind, name
            assert f.documentation == f"[ALPHA] {help_}", name
            assert f.samples, f"{name}: no series after traffic"
            for s in f.samples:
                assert set(s.labels) - {"le"} == set(labels), (name, s.labels)
            if buckets is not None:
                les = sorted({float(s.labels["le"]) for s in f.samples
                              if s.name.endswith("_bucket")})
                assert les == sorted([*map(float, buckets), math.inf]), name
    finally:
        await fc.stop()


async def test_recorded_values() -> None:
    saturation = [0.0]
    metrics, fc, waiting = await traffic(saturation)
    r = metrics.registry
    try:
        duration = "inference_extension_flow_control_request_queue_duration_seconds_count"
        for outcome, n in (("Dispatched", 1), ("RejectedCapacity", 1), ("EvictedTTL", 1)):
            assert value(r, duration, **flow_labels(outcome)) == n, outcome
        # Queued now: one request of 100 bytes (the TTL'd one has left).
        assert value(r, "inference_extension_flow_control_queue_size", **flow_labels()) == 1
        assert value(r, "inference_extension_flow_control_queue_bytes", **flow_labels()) == 100
        # The enqueue step: three queued (NotYetFinalized), one bounced at capacity.
        enqueue = "inference_extension_flow_control_request_enqueue_duration_seconds_count"
        ids = {"fairness_id": "tenant", "priority": "3"}
        assert value(r, enqueue, **ids, outcome="NotYetFinalized") == 3
        assert value(r, enqueue, **ids, outcome="RejectedCapacity") == 1
        cycles = value(r, "inference_extension_flow_control_dispatch_cycle_duration_seconds_count")
        assert cycles is not None and cycles >= 4  # one per enqueue at least
        assert value(r, "inference_extension_flow_control_pool_saturation",
                     inference_pool=POOL) == 1.0
        saturation[0] = 0.25
        fc.notify()
        assert (await waiting).dispatched
        assert value(r, "inference_extension_flow_control_pool_saturation",
                     inference_pool=POOL) == 0.25
        assert value(r, "inference_extension_flow_control_queue_size", **flow_labels()) == 0
        assert value(r, "inference_extension_flow_control_queue_bytes", **flow_labels()) == 0
        assert value(r, duration, **flow_labels("Dispatched")) == 2
    finally:
        await fc.stop()


async def test_cancelled_and_shutdown_outcomes_are_recorded() -> None:
    metrics = FlowControlMetrics(CollectorRegistry(), POOL)
    fc = FlowController(default_config(), lambda subset: 1.0, metrics=metrics,
                        dispatch_interval=3600)
    await fc.start()
    req = FlowControlRequest("tenant", 3, 7, model_name="m", target_model_name="t")
    gone = asyncio.ensure_future(fc.enqueue_and_wait(req))
    stays = asyncio.ensure_future(fc.enqueue_and_wait(req))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    await fc.stop()
    assert (await stays).outcome is QueueOutcome.EVICTED_OTHER
    r = metrics.registry
    duration = "inference_extension_flow_control_request_queue_duration_seconds_count"
    assert value(r, duration, **flow_labels("EvictedContextCancelled")) == 1
    assert value(r, duration, **flow_labels("EvictedOther")) == 1
    assert value(r, "inference_extension_flow_control_queue_size", **flow_labels()) == 0
    assert value(r, "inference_extension_flow_control_queue_bytes", **flow_labels()) == 0


def test_no_series_until_flow_control_records() -> None:
    """The labelled series appear once flow control records (as GIE's vectors); the
    label-less cycle histogram reads 0 until then."""
    metrics = FlowControlMetrics(CollectorRegistry(), POOL)
    fams = families(metrics.registry)
    cycle = "inference_extension_flow_control_dispatch_cycle_duration_seconds"
    assert len(fams) == 6
    assert all(not f.samples for n, f in fams.items() if n != cycle)
    assert value(metrics.registry, f"{cycle}_count") == 0
    metrics.set_pool_saturation(0.5)
    assert value(metrics.registry, "inference_extension_flow_control_pool_saturation",
                 inference_pool=POOL) == 0.5


def test_label_cache_is_bounded() -> None:
    metrics = FlowControlMetrics()
    first = metrics.flow("a", 0, "m", "t")
    assert metrics.flow("a", 0, "m", "t") is first
    for i in range(10_001):
        metrics.flow(f"id-{i}", 0, "m", "t")
    assert len(metrics._flows) <= 10_000
