"""llm-d-router v0.10.0's demand-driven in-flight eviction (``flowControl.enableEviction``):
its victim policies, tracker, reclamation controller (sizing, pacing, confirmation), the
``flowControl`` keys, and whole requests through ``epp serve``'s wiring and the ext_proc
servicer in memory: which in-flight request is evicted, when, what its client gets (429,
``request evicted by flow control``, ``x-llm-d-request-dropped-reason: evicted``) and
what is counted.

Go followed: pkg/epp/flowcontrol/eviction/*_test.go, controller/internal/reclamation.go,
pkg/epp/framework/plugins/flowcontrol/eviction/{filtering,ordering}/*_test.go,
pkg/epp/handlers/server.go (the evicted state).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
import pytest_asyncio
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.config.loader import load_and_build
from epp.datastore.objectives import Objective
from epp.errors import ConfigError
from epp.flowcontrol import FlowController, FlowControlRequest, QueueOutcome
from epp.flowcontrol.config import build_flow_control, parse_flow_control
from epp.flowcontrol.eviction import (
    EVICTED_BODY,
    HEADER_REQUEST_DROPPED_REASON,
    OUTCOME_CONFIRMED,
    OUTCOME_TIMED_OUT,
    EvictionItem,
    EvictionQueue,
    PriorityThenTimeEvictionOrdering,
    ReclamationController,
    RequestEvictor,
    SheddableEvictionFilter,
    confirmation_grace,
    enable_eviction,
    maybe_reclaim,
)
from epp.framework.handle import PluginHandle
from epp.scheduling.plugins.catalog import BUILTIN_PLUGINS
from epp.scheduling.types import (
    ApiType,
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    SchedulingResult,
)
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, ServerParts, wire
from tests.polling import eventually

FD = ProcessingMode.FULL_DUPLEX_STREAMED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def item(rid: str, priority: int, dispatched: float) -> EvictionItem:
    return EvictionItem(rid, priority, dispatched, "10.0.0.1:8000")


def req(rid: str, priority: int) -> LLMRequest:
    r = LLMRequest(request_id=rid, target_model="m", incoming_model="m",
                   api=ApiType.COMPLETIONS, prompt="p", headers={})
    r.priority = priority
    return r


def result(key: str = "10.0.0.1:8000") -> SchedulingResult:
    ip, port = key.split(":")
    ep = Endpoint(name="pod", address=ip, port=int(port))
    return SchedulingResult({"default": ProfileRunResult((ep,))}, "default")


# ============================================================== victim policies


def test_policies_are_registered_llm_d_types() -> None:
    assert SheddableEvictionFilter in BUILTIN_PLUGINS
    assert PriorityThenTimeEvictionOrdering in BUILTIN_PLUGINS
    assert SheddableEvictionFilter.type_name == "sheddable-eviction-filter"
    assert PriorityThenTimeEvictionOrdering.type_name == \
        "priority-then-time-eviction-order-policy"


@pytest.mark.parametrize(("priority", "accepted"), [(-10, True), (-1, True), (0, False),
                                                    (5, False)])
def test_sheddable_filter_accepts_only_negative_priorities(priority: int,
                                                           accepted: bool) -> None:
    assert SheddableEvictionFilter().accept(item("r", priority, 0.0)) is accepted


def test_ordering_lowest_priority_then_most_recently_dispatched() -> None:
    less = PriorityThenTimeEvictionOrdering().less
    assert less(item("a", -5, 1.0), item("b", -1, 2.0))  # lower priority first
    assert not less(item("b", -1, 2.0), item("a", -5, 1.0))
    assert less(item("new", -1, 2.0), item("old", -1, 1.0))  # newer first: least work lost
    assert not less(item("x", -1, 1.0), item("y", -1, 1.0))


def test_queue_tracks_all_and_orders_only_the_evictable() -> None:
    q = EvictionQueue(PriorityThenTimeEvictionOrdering(), SheddableEvictionFilter())
    q.track(item("keep", 0, 1.0))
    q.track(item("old", -1, 1.0))
    q.track(item("new", -1, 2.0))
    q.track(item("lowest", -3, 0.5))
    assert (q.in_flight_len, q.evictable_len) == (4, 3)
    assert q.peek() is not None and q.peek().request_id == "lowest"  # type: ignore[union-attr]
    q.untrack("lowest")
    assert [q.pop().request_id for _ in range(2)] == ["new", "old"]  # type: ignore[union-attr]
    assert q.pop() is None
    assert (q.in_flight_len, q.evictable_len) == (1, 0)
    # Re-tracking an ID replaces its entry.
    q.track(item("x", -1, 1.0))
    q.track(item("x", 0, 1.0))
    assert (q.in_flight_len, q.evictable_len) == (1 + 1, 0)


# ==================================================================== the evictor


def test_evictor_tracks_at_pre_request_and_untracks_at_completion() -> None:
    ev = RequestEvictor(clock=Clock())
    ev.pre_request(req("a", -1), result())
    ev.pre_request(req("b", 0), result())
    assert ev.stats() == (2, 1)
    assert ev.signal("a") is not None
    assert ev.signal("b") is None  # not evictable: its stream need not listen
    ev.response_complete(req("a", -1), "10.0.0.1:8000", aborted=False)
    assert ev.stats() == (1, 0)
    assert ev.signal("a") is None


def test_evict_n_stops_at_the_priority_bound_and_keeps_the_rest() -> None:
    clock = Clock()
    ev = RequestEvictor(clock=clock)
    for rid, prio in (("p-5", -5), ("p-2", -2), ("p-1", -1)):
        ev.pre_request(req(rid, prio), result())
        clock.now += 1
    fired: list[tuple[str, str]] = []
    for rid in ("p-5", "p-2", "p-1"):
        sig = ev.signal(rid)
        assert sig is not None
        sig.subscribe(lambda reason, rid=rid: fired.append((rid, reason)))
    # Bound -2: only victims strictly below it; p-2 stays tracked.
    assert ev.evict_n(3, -2) == ["p-5"]
    assert fired == [("p-5", "evicted")]
    assert ev.stats() == (2, 2)
    assert ev.peek_victim_priority() == -2


def test_termination_listener_is_told_once_and_only_for_evicted_requests() -> None:
    clock = Clock()
    ev = RequestEvictor(clock=clock)
    ended: list[str] = []
    ev.termination_listener = ended.append
    ev.pre_request(req("victim", -1), result())
    clock.now += 1
    ev.pre_request(req("other", -1), result())
    assert ev.evict_n(1, 0) == ["other"]  # the most recently dispatched
    ev.cleanup("victim")  # not evicted: no confirmation
    ev.cleanup("other")
    ev.cleanup("other")
    assert ended == ["other"]


# ============================================================ reclamation controller


class Recorded:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def revocations_issued(self, priority: int, n: int) -> None:
        self.calls.append(("issued", (priority, n)))

    def revocation_outcome(self, outcome: str, n: int) -> None:
        self.calls.append(("outcome", (outcome, n)))

    def reclaim_target(self, value: float) -> None:
        self.calls.append(("target", value))

    def pending_reclaim(self, value: float) -> None:
        self.calls.append(("pending", value))

    def confirmation_seconds(self, seconds: float) -> None:
        self.calls.append(("confirm_s", seconds))


def controller(n_sheddable: int, n_other: int = 0, **kw: Any) -> tuple[
        ReclamationController, RequestEvictor, Clock, Recorded]:
    clock = Clock()
    ev = RequestEvictor(clock=clock)
    for i in range(n_sheddable):
        ev.pre_request(req(f"s{i}", -1), result())
        clock.now += 0.001
    for i in range(n_other):
        ev.pre_request(req(f"o{i}", 0), result())
    rec = Recorded()
    rc = ReclamationController(ev, clock=clock, metrics=rec, **kw)
    return rc, ev, clock, rec


def test_sizing_deficit_over_mean_footprint_capped_at_two() -> None:
    # 10 in flight at saturation 1.5: credit 0.15; deficit 1.5 - 0.9 = 0.6 → 4, capped 2.
    rc, _, _, rec = controller(6, 4)
    assert rc.reclaim(1.5, 0.9, 10) == ["s5", "s4"]
    assert rc.stats.issued == {10: 2}
    assert ("issued", (10, 2)) in rec.calls
    assert rec.calls[0] == ("target", pytest.approx(0.6))
    # Deficit 0.2 with credit 0.2 (5 in flight at 1.0): one.
    rc2, _, _, _ = controller(5, max_revocations_per_decision=10)
    assert len(rc2.reclaim(1.0, 0.8, 1)) == 1


def test_at_the_boundary_one_revocation_is_issued() -> None:
    # saturation == ceiling: the band stays blocked unless something is reclaimed.
    rc, _, _, _ = controller(3)
    assert rc.reclaim(1.0, 1.0, 0) == ["s2"]


def test_capped_by_the_evictable_count_and_nothing_without_victims() -> None:
    rc, _, _, _ = controller(1, 9, max_revocations_per_decision=5)
    assert rc.reclaim(2.0, 0.5, 3) == ["s0"]
    rc2, _, _, _ = controller(0, 3)
    assert rc2.reclaim(2.0, 0.5, 3) == []


def test_pacing_gate_waits_for_confirmation_then_grace() -> None:
    rc, ev, clock, rec = controller(4, confirmation_grace=0.5)
    assert rc.gate_open(clock.now)
    evicted = rc.reclaim(1.0, 1.0, 0)
    assert evicted == ["s3"]
    assert not rc.gate_open(clock.now)  # outstanding
    clock.now += 0.2
    ev.cleanup("s3")  # its stream ended: confirmed, now cooling
    assert rc.stats.confirmed == 1
    assert ("outcome", (OUTCOME_CONFIRMED, 1)) in rec.calls
    assert ("confirm_s", pytest.approx(0.2)) in rec.calls
    clock.now += 0.49
    assert not rc.gate_open(clock.now)
    clock.now += 0.02
    assert rc.gate_open(clock.now)
    assert rc.stats.pending_reclaim == 0.0


def test_unconfirmed_revocation_times_out() -> None:
    rc, _, clock, rec = controller(2, confirmation_grace=0.0, confirmation_timeout=10.0)
    rc.reclaim(1.0, 1.0, 0)
    clock.now += 9.9
    assert not rc.gate_open(clock.now)
    clock.now += 0.2
    assert rc.gate_open(clock.now)
    assert rc.stats.timed_out == 1
    assert ("outcome", (OUTCOME_TIMED_OUT, 1)) in rec.calls


@pytest.mark.parametrize(("detector", "grace"), [
    ("concurrency-detector", 0.010),  # its gauge drops when the stream ends
    ("utilization-detector", 0.05 + 2.0 + 0.25),  # scrape + staleness + engine reclaim
    (None, 0.05 + 2.0 + 0.25),
])
def test_confirmation_grace_is_derived_from_the_detector(detector: str | None,
                                                         grace: float) -> None:
    assert confirmation_grace(detector, 0.05, 2.0) == pytest.approx(grace)


def test_maybe_reclaim_needs_queued_demand_strictly_above_the_victim() -> None:
    rc, _, clock, _ = controller(2)
    queued = {5: 1, 0: 3, -1: 4}
    # HoL break at band 5 (index 0): reclaims for it.
    assert maybe_reclaim(rc, clock.now, 1.0, [5, 0, -1], [1.0, 1.0, 1.0], 0,
                         lambda p: queued[p]) == ["s1"]
    # Gate closed now.
    assert maybe_reclaim(rc, clock.now, 1.0, [5, 0, -1], [1.0, 1.0, 1.0], 0,
                         lambda p: queued[p]) == []


def test_maybe_reclaim_skips_empty_unblocked_and_zero_ceiling_bands() -> None:
    rc, _, clock, _ = controller(2)
    prios = [9, 5, 1, -1]
    # 9: empty; 5: ceiling 0 (policy says never dispatch); 1: not blocked (0.8 < 0.9)...
    assert maybe_reclaim(rc, clock.now, 0.8, prios, [0.5, 0.0, 0.9, 0.5], 0,
                         lambda p: {9: 0, 5: 2, 1: 2, -1: 2}[p]) == []
    # ... same-band churn never happens: the victim's own band is not demand.
    assert maybe_reclaim(rc, clock.now, 1.0, [-1], [0.5], 0, lambda p: 5) == []
    # A blocked band with demand, below the break: reclaims for it.
    assert maybe_reclaim(rc, clock.now, 0.8, prios, [0.5, 0.0, 0.7, 0.5], 0,
                         lambda p: {9: 0, 5: 2, 1: 2, -1: 2}[p]) == ["s1"]
    assert rc.stats.issued == {1: 1}


# ================================================================== config keys


def test_keys_parse_and_default_off() -> None:
    assert parse_flow_control(None).enable_eviction is False
    spec = parse_flow_control({"enableEviction": True,
                               "defaultNegativePriorityBand": {"maxRequests": 2}}, "c.yaml")
    assert spec.enable_eviction is True
    assert spec.default_negative_priority_band is not None
    assert spec.default_negative_priority_band.max_requests == 2
    cfg = build_flow_control(spec, PluginHandle(), "c.yaml")
    assert cfg.enable_eviction is True
    assert cfg.template_for(-3).max_requests == 2
    assert cfg.template_for(-3).priority == -3
    assert cfg.template_for(0).max_requests == 0  # the default template


@pytest.mark.parametrize(("raw", "fragment"), [
    ({"enableEviction": "yes"}, "flowControl.enableEviction: expected true or false"),
    ({"defaultNegativePriorityBand": {"maxRequest": 1}},
     "flowControl.defaultNegativePriorityBand: unknown key(s) 'maxRequest'"),
    ({"defaultNegativePriorityBand": {"maxBytes": "-1"}},
     "flowControl.defaultNegativePriorityBand.maxBytes: must be non-negative"),
])
def test_bad_keys_name_the_problem(raw: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match="c.yaml") as info:
        parse_flow_control(raw, "c.yaml")
    assert fragment in str(info.value)


async def test_negative_priorities_are_provisioned_from_their_template() -> None:
    spec = parse_flow_control({"defaultNegativePriorityBand": {"maxRequests": 1}})
    cfg = build_flow_control(spec, PluginHandle())
    fc = FlowController(cfg, lambda subset: 1.0, dispatch_interval=3600)
    await fc.start()
    try:
        first = asyncio.ensure_future(fc.enqueue_and_wait(FlowControlRequest("f", -1, 1)))
        await asyncio.sleep(0)
        # The sheddable band holds one request; the next is refused at once.
        over = await fc.enqueue_and_wait(FlowControlRequest("f", -1, 1))
        assert over.outcome is QueueOutcome.REJECTED_CAPACITY
        zero = asyncio.ensure_future(fc.enqueue_and_wait(FlowControlRequest("f", 0, 1)))
        zero2 = asyncio.ensure_future(fc.enqueue_and_wait(FlowControlRequest("f", 0, 1)))
        await asyncio.sleep(0)
        assert fc.stats().bands[0].queued == 2  # priority 0: the default template
    finally:
        await fc.stop()
    for t in (first, zero, zero2):
        assert (await t).outcome is QueueOutcome.EVICTED_OTHER


# ========================================= whole requests: wiring + ext_proc servicer

CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: concurrency-detector
  parameters:
    maxConcurrency: 2
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
flowControl:
  enableEviction: {eviction}
  saturationDetector:
    pluginRef: concurrency-detector
"""
ONE = "10.0.0.1:8000"
BODY = orjson.dumps({"model": "llama", "prompt": "hi"})


def server(tmp_path: Path, eviction: bool = True) -> ServerParts:
    path = tmp_path / "epp.yaml"
    path.write_text(CONFIG.format(eviction="true" if eviction else "false"))
    timings = PluginTimings()
    built = load_and_build(str(path), timer=timings, strict=True)
    opts = ServeOptions(static=StaticSourceOptions(endpoints=ONE))
    parts = wire(validate(opts), built, timings, None)
    parts.objectives.replace([Objective("batch", -1), Objective("critical", 10)], [])
    return parts


@pytest_asyncio.fixture
async def running() -> AsyncIterator[list[ServerParts]]:
    started: list[ServerParts] = []
    yield started
    for parts in started:
        assert parts.flow_control is not None
        await parts.flow_control.stop()


class Stream:
    """One ext_proc stream into the servicer: the test feeds Envoy's messages."""

    def __init__(self, parts: ServerParts, rid: str, objective: str) -> None:
        self.queue: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self.written: list[pb.ProcessingResponse] = []
        hs = {":method": "POST", ":path": "/v1/completions", "x-request-id": rid,
              "content-type": "application/json",
              "x-gateway-inference-objective": objective}
        msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=HeaderMap(
            headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])))
        msg.protocol_config.request_body_mode = FD  # type: ignore[assignment]  # proto enum
        msg.protocol_config.response_body_mode = FD  # type: ignore[assignment]  # proto enum
        self.queue.put_nowait(msg)
        self.queue.put_nowait(pb.ProcessingRequest(
            request_body=pb.HttpBody(body=BODY, end_of_stream=True)))
        assert parts.ext_proc is not None
        self.task = asyncio.ensure_future(parts.ext_proc.Process(self, self))  # type: ignore[arg-type]  # a fake grpc context

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def read(self) -> Any:
        m = await self.queue.get()
        return grpc.aio.EOF if m is None else m

    async def write(self, msg: pb.ProcessingResponse) -> None:
        self.written.append(msg)

    def send(self, *msgs: pb.ProcessingRequest | None) -> None:
        for m in msgs:
            self.queue.put_nowait(m)

    @property
    def routed(self) -> bool:
        return any(w.HasField("request_headers") for w in self.written)

    def immediate(self) -> pb.ImmediateResponse | None:
        for w in self.written:
            if w.HasField("immediate_response"):
                return w.immediate_response
        return None


def resp_headers(status: int = 200) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=":status", raw_value=str(status).encode()),
        HeaderValue(key="content-type", raw_value=b"application/json")])))


def resp_body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


def errors(parts: ServerParts) -> float:
    total = 0.0
    for metric in parts.metrics.registry.collect():
        if metric.name == "inference_objective_request_error":
            total += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return total


def running_requests(parts: ServerParts) -> float | None:
    return parts.metrics.registry.get_sample_value("inference_objective_running_requests",
                                                   {"model_name": "llama"})


async def test_a_blocked_higher_band_evicts_the_newest_sheddable_request(
        tmp_path: Path, running: list[ServerParts]) -> None:
    parts = server(tmp_path)
    fc = parts.flow_control
    assert fc is not None and fc.reclamation is not None
    assert fc.reclamation.grace == pytest.approx(0.010)  # concurrency detector
    await fc.start()
    running.append(parts)
    old = Stream(parts, "old", "batch")
    await eventually(lambda: old.routed)
    new = Stream(parts, "new", "batch")
    await eventually(lambda: new.routed)
    # The pool (1 endpoint × maxConcurrency 2) is full: the critical request queues, and
    # the most recently dispatched sheddable request is evicted for it.
    critical = Stream(parts, "crit", "critical")
    await eventually(lambda: new.task.done())
    ir = new.immediate()
    assert ir is not None
    assert ir.status.code == 429
    assert ir.body == EVICTED_BODY == b"request evicted by flow control"
    assert [(h.header.key, h.header.raw_value) for h in ir.headers.set_headers] == [
        (HEADER_REQUEST_DROPPED_REASON, b"evicted")]
    # Its stream ended: confirmed; the critical request then goes to the freed slot.
    await eventually(lambda: critical.routed)
    assert fc.reclamation.stats.issued == {10: 1}
    assert fc.reclamation.stats.confirmed == 1
    assert not old.task.done() and old.immediate() is None  # one was enough
    # Counted: not an error; no longer running.
    assert errors(parts) == 0
    assert running_requests(parts) == 2  # old + critical
    assert fc.stats().outcomes[QueueOutcome.DISPATCHED] == 3
    for s in (old, critical):
        s.send(resp_headers(), resp_body(b"{}", True), None)
    await eventually(lambda: old.task.done() and critical.task.done())
    assert running_requests(parts) == 0
    assert errors(parts) == 0


async def test_non_sheddable_requests_are_never_evicted(
        tmp_path: Path, running: list[ServerParts]) -> None:
    parts = server(tmp_path)
    fc = parts.flow_control
    assert fc is not None and fc.reclamation is not None
    await fc.start()
    running.append(parts)
    a = Stream(parts, "a", "none")  # no such objective: priority 0
    b = Stream(parts, "b", "none")
    await eventually(lambda: a.routed and b.routed)
    critical = Stream(parts, "crit", "critical")
    await eventually(lambda: fc.stats().queued == 1)
    await asyncio.sleep(0.02)
    assert not critical.routed
    assert a.immediate() is None and b.immediate() is None
    assert fc.reclamation.stats.issued_total == 0
    a.send(resp_headers(), resp_body(b"{}", True), None)  # a slot frees: it dispatches
    await eventually(lambda: critical.routed)
    for s in (b, critical):
        s.send(None)
    await eventually(lambda: b.task.done() and critical.task.done())


async def test_eviction_while_the_response_streams_and_demand_of_equal_priority(
        tmp_path: Path, running: list[ServerParts]) -> None:
    parts = server(tmp_path)
    fc = parts.flow_control
    assert fc is not None and fc.reclamation is not None
    await fc.start()
    running.append(parts)
    a = Stream(parts, "a", "batch")
    b = Stream(parts, "b", "batch")
    await eventually(lambda: a.routed and b.routed)
    # Response started (full duplex echo) for both.
    for s in (a, b):
        s.send(resp_headers(), resp_body(b'{"x":', False))
    await eventually(lambda: len(a.written) >= 3 and len(b.written) >= 3)
    # Same-priority demand never evicts (no churn within a band).
    other = Stream(parts, "c", "batch")
    await eventually(lambda: fc.stats().queued == 1)
    await asyncio.sleep(0.02)
    assert fc.reclamation.stats.issued_total == 0
    # Higher demand does: b (newest) is cut mid-response with the 429 answer.
    critical = Stream(parts, "crit", "critical")
    await eventually(lambda: b.task.done())
    ir = b.immediate()
    assert ir is not None and ir.status.code == 429
    await eventually(lambda: critical.routed)
    for s in (a, critical, other):
        s.send(None)
    await eventually(lambda: a.task.done() and critical.task.done())
    await eventually(lambda: other.routed or other.task.done())
    other.send(None)
    await eventually(lambda: other.task.done())
    assert errors(parts) == 0


async def test_an_eviction_after_the_response_completed_is_ignored() -> None:
    from epp.handlers.extproc import ExtProcStream
    from epp.handlers.protocol import Routing

    class Director:
        def __init__(self) -> None:
            self.done: list[bool] = []

        async def route(self, headers: Any, body: bytes, has_body: bool,
                        subset: Sequence[str] | None) -> Routing:
            return Routing(ONE, context="ctx")

        def on_response_headers(self, context: Any, status: int, headers: Any) -> None:
            return None

        def on_response_body(self, context: Any, chunk: bytes, eos: bool) -> None:
            return None

        def on_done(self, context: Any, aborted: bool) -> None:
            self.done.append(aborted)

        def on_rejected(self, headers: Any, status: int) -> None:
            pass

        def on_upstream_failure(self, context: Any, address: str) -> None:
            pass

    d = Director()
    s = ExtProcStream(d, 1 << 20)  # type: ignore[arg-type]  # a minimal fake director
    hs = pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=True))
    await s.handle(hs)
    await s.handle(resp_headers())
    await s.handle(resp_body(b"{}", True))
    assert s.evict("evicted") is None
    assert d.done == [False]
    # Before completion it ends the request, reported aborted (not an error).
    s2 = ExtProcStream(d, 1 << 20)  # type: ignore[arg-type]  # a minimal fake director
    await s2.handle(hs)
    out = s2.evict("evicted")
    assert out is not None and out[0].immediate_response.status.code == 429
    assert s2.closed and d.done == [False, True]
    assert s2.finish() == "rejected"


def test_eviction_off_by_default_and_under_workers(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    parts = server(tmp_path, eviction=False)
    assert parts.flow_control is not None and parts.flow_control.reclamation is None
    fc = parts.flow_control
    with caplog.at_level(logging.WARNING):
        assert enable_eviction(fc, "concurrency-detector", 0.05, 2.0, workers=2) is None
    assert "enableEviction is ignored with --workers 2" in caplog.text
    assert fc.reclamation is None
