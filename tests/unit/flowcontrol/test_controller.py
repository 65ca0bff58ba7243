"""The flow controller's behaviour, following GIE v1.5.0's controller_test.go and
processor_test.go: strict priority, fairness and ordering, capacity limits, TTL,
cancellation, saturation gating (head-of-line blocking) and wake-ups, sheddable traffic,
shutdown, garbage collection, outcomes and their accounting.

Dispatch is driven deterministically where order matters: the dispatcher ticks once an
hour (``dispatch_interval=3600``), so a cycle runs only on an enqueue or on
``notify()``; :func:`step` runs exactly the cycles that are due and lets the woken
waiters finish.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import pytest_asyncio

from epp.errors import NoCapacity, ServiceUnavailable
from epp.flowcontrol import (
    OUTCOME_STATUS,
    FlowControlConfig,
    FlowController,
    FlowControlRequest,
    FlowControlResult,
    QueueOutcome,
    default_config,
    is_sheddable,
)
from epp.flowcontrol.config import band_config
from epp.flowcontrol.interfaces import FlowQueueView, PriorityBandView
from epp.flowcontrol.plugins import (
    EDFOrderingPolicy,
    FCFSOrderingPolicy,
    GlobalStrictFairnessPolicy,
    RoundRobinFairnessPolicy,
    SLODeadlineOrderingPolicy,
    StaticUsageLimitPolicy,
)
from epp.flowcontrol.saturation import detector_saturation
from epp.flowcontrol.types import FINAL_OUTCOMES
from epp.scheduling.plugins.saturation import UtilizationDetector
from epp.scheduling.types import Endpoint, Metrics
from tests.polling import eventually

D = QueueOutcome.DISPATCHED
HOUR = 3600.0


class Saturation:
    """A saturation callback: ``pool`` for the pool, ``subsets[frozenset(subset)]`` for a
    request's candidates; counts its calls."""

    def __init__(self, pool: float = 0.0) -> None:
        self.pool = pool
        self.subsets: dict[frozenset[str], float] = {}
        self.calls = 0

    def __call__(self, subset: Sequence[str] | None) -> float:
        self.calls += 1
        if subset is None:
            return self.pool
        return self.subsets.get(frozenset(subset), self.pool)


class Harness:
    def __init__(self, config: FlowControlConfig, saturation: Saturation,
                 interval: float) -> None:
        self.sat = saturation
        self.fc = FlowController(config, saturation, dispatch_interval=interval)
        self.order: list[Any] = []  # payloads, in the order their waits ended
        self.results: dict[Any, FlowControlResult] = {}
        self.tasks: dict[Any, asyncio.Task[FlowControlResult]] = {}
        self.entered: set[Any] = set()  # payloads whose task reached enqueue_and_wait

    def submit(self, payload: Any, flow: str = "f", priority: int = 0, size: int = 1,
               **kw: Any) -> asyncio.Task[FlowControlResult]:
        req = FlowControlRequest(fairness_id=flow, priority=priority, byte_size=size,
                                 payload=payload, **kw)

        async def run() -> FlowControlResult:
            self.entered.add(payload)
            result = await self.fc.enqueue_and_wait(req)
            self.order.append(payload)
            self.results[payload] = result
            return result

        task = self.tasks[payload] = asyncio.ensure_future(run())
        return task

    async def settle(self) -> None:
        """Let every submitted task reach its wait (or its outcome)."""
        for _ in range(3):
            await asyncio.sleep(0)

    async def step(self, n: int = 1) -> None:
        """``n`` notify-driven dispatch cycles, each followed by the woken waiters."""
        for _ in range(n):
            self.fc.notify()
            await self.settle()

    async def drain(self, limit: int = 100_000) -> None:
        """Unsaturate and dispatch everything queued, one cycle at a time."""
        self.sat.pool = 0.0
        self.sat.subsets.clear()
        for _ in range(limit):
            if not self.fc.stats().queued:
                break
            await self.step()
        await self.settle()
        assert self.fc.stats().queued == 0


@pytest_asyncio.fixture
async def make() -> AsyncIterator[Callable[..., Any]]:
    made: list[Harness] = []

    async def factory(config: FlowControlConfig | None = None, saturation: float = 0.0,
                      interval: float = HOUR, start: bool = True) -> Harness:
        h = Harness(config or default_config(), Saturation(saturation), interval)
        if start:
            await h.fc.start()
        made.append(h)
        return h

    yield factory
    for h in made:
        await h.fc.stop()
        for t in h.tasks.values():
            t.cancel()
        await asyncio.gather(*h.tasks.values(), return_exceptions=True)


def accounted(h: Harness) -> None:
    s = h.fc.stats()
    assert s.enqueued == s.finalized + s.queued, s
    assert s.dispatched + s.rejected + s.evicted == s.finalized, s


# ================================================================ dispatch and priority


async def test_unsaturated_request_is_dispatched_without_waiting(make: Any) -> None:
    """processor_test: should dispatch item successfully — here in the enqueue's own step:
    the coroutine completes without suspending."""
    h = await make()
    coro = h.fc.enqueue_and_wait(FlowControlRequest("t", 0, 10))
    with pytest.raises(StopIteration) as done:
        coro.send(None)
    result = done.value.value
    assert result.dispatched and result.status is None and result.error() is None
    s = h.fc.stats()
    assert (s.enqueued, s.dispatched, s.queued) == (1, 1, 0)


async def test_strict_priority_starves_lower_bands(make: Any) -> None:
    """processor_test: should guarantee strict priority by starving lower priority items."""
    h = await make(saturation=1.0)
    for i in range(3):
        h.submit(f"low-{i}", "flow-low", priority=10)
        h.submit(f"high-{i}", "flow-high", priority=20)
    await h.settle()
    assert h.fc.stats().queued == 6
    h.sat.pool = 0.0
    await h.step(3)
    assert h.order == ["high-0", "high-1", "high-2"]
    band = h.fc.band(10)
    assert band is not None and band.len == 3
    await h.step(3)
    assert h.order[3:] == ["low-0", "low-1", "low-2"]
    accounted(h)


async def test_bands_are_served_highest_first_negative_included(make: Any) -> None:
    h = await make(saturation=1.0)
    for p in (0, -5, 7, -1, 100):
        h.submit(p, f"t{p}", priority=p)
    await h.settle()
    assert list(h.fc.priorities) == [100, 7, 0, -1, -5]
    await h.drain()
    assert h.order == [100, 7, 0, -1, -5]


async def test_fcfs_within_a_flow_and_global_strict_across_flows(make: Any) -> None:
    """The defaults: one band behaves as one FIFO queue across its flows."""
    h = await make(saturation=1.0)
    for i, flow in enumerate("abacbca"):
        h.submit(i, flow)
    await h.settle()
    await h.drain()
    assert h.order == list(range(7))


async def test_round_robin_gives_flows_equal_shares(make: Any) -> None:
    """round-robin-fairness-policy: flows take turns whatever their backlog; after 30
    dispatches of three busy flows, each got 10."""
    cfg = default_config(bands={0: (RoundRobinFairnessPolicy(), None)})
    h = await make(cfg, saturation=1.0)
    for i in range(60):
        h.submit(("heavy", i), "heavy")
    for i in range(20):
        h.submit(("medium", i), "medium")
        h.submit(("light", i), "light")
    await h.settle()
    h.sat.pool = 0.0
    await h.step(30)
    served = [flow for flow, _ in h.order]
    assert served[:6] == ["heavy", "light", "medium"] * 2  # flows sorted by ID
    assert {f: served.count(f) for f in set(served)} == {"heavy": 10, "medium": 10, "light": 10}
    # Within each flow: first come, first served.
    assert [i for f, i in h.order if f == "heavy"] == list(range(10))
    await h.drain()
    assert len(h.order) == 100
    accounted(h)


async def test_round_robin_versus_global_strict_under_a_burst(make: Any) -> None:
    """The difference that matters: a tenant's burst does not delay another tenant's
    request under round-robin; under global-strict (FCFS across flows) it does."""
    for fairness, expected_position in ((GlobalStrictFairnessPolicy(), 50),
                                        (RoundRobinFairnessPolicy(), 1)):
        h = await make(default_config(bands={0: (fairness, None)}), saturation=1.0)
        for i in range(50):
            h.submit(("burst", i), "burst")
        h.submit(("quiet", 0), "quiet")
        await h.settle()
        await h.drain()
        assert h.order.index(("quiet", 0)) == expected_position


async def test_edf_ordering_serves_the_earliest_deadline(make: Any) -> None:
    cfg = default_config(bands={0: (None, EDFOrderingPolicy())})
    h = await make(cfg, saturation=1.0)
    h.submit("no-ttl")
    h.submit("ttl-60", ttl=60)
    h.submit("ttl-30", ttl=30)
    h.submit("ttl-45", ttl=45)
    h.submit("ttl-30-later", ttl=30)
    await h.settle()
    await h.drain()
    assert h.order == ["ttl-30", "ttl-30-later", "ttl-45", "ttl-60", "no-ttl"]


async def test_slo_deadline_ordering_reads_the_header(make: Any) -> None:
    cfg = default_config(bands={0: (None, SLODeadlineOrderingPolicy())})
    h = await make(cfg, saturation=1.0)
    h.submit("none", received_at=0.0)
    h.submit("500ms", received_at=0.0, headers={"x-slo-ttft-ms": "500"})
    h.submit("100ms-late", received_at=0.3, headers={"x-slo-ttft-ms": "100"})  # 0.4
    h.submit("100ms", received_at=0.0, headers={"x-slo-ttft-ms": "100"})  # 0.1
    await h.settle()
    await h.drain()
    assert h.order == ["100ms", "100ms-late", "500ms", "none"]


async def test_edf_heap_survives_removals_from_the_middle(make: Any) -> None:
    """Cancelled requests leave a heap-ordered queue at once; the rest keep their order."""
    cfg = default_config(bands={0: (None, EDFOrderingPolicy())})
    h = await make(cfg, saturation=1.0)
    rng = random.Random(3)
    ttls = {i: rng.uniform(10, 100) for i in range(200)}
    for i, ttl in ttls.items():
        h.submit(i, ttl=ttl)
    await h.settle()
    cancelled = set(rng.sample(sorted(ttls), 120))
    for i in cancelled:
        h.tasks[i].cancel()
    await h.settle()
    assert h.fc.stats().queued == 80
    await h.drain()
    kept = [i for i in h.order if i not in cancelled]
    assert kept == sorted(kept, key=lambda i: ttls[i]) and len(kept) == 80
    accounted(h)


# ================================================================ saturation gating


async def test_saturated_pool_holds_everything_then_notify_dispatches(make: Any) -> None:
    """processor_test: should block dispatch on HoL saturation; a saturation change
    announced with notify() dispatches without waiting for a tick."""
    h = await make(saturation=1.0)  # ticks once an hour: only notify() can wake it
    h.submit("a")
    h.submit("b", priority=5)
    await h.settle()
    await h.step(5)
    assert h.order == [] and h.fc.stats().queued == 2
    h.sat.pool = 0.99
    await h.step()
    assert h.order == ["b"]
    await h.step()
    assert h.order == ["b", "a"]


async def test_saturation_over_one_still_holds(make: Any) -> None:
    h = await make(saturation=1.7)
    h.submit("a")
    await h.settle()
    await h.step(3)
    assert h.order == []


async def test_tick_dispatches_while_requests_wait(make: Any) -> None:
    """With nobody calling notify(), the dispatch ticker (GIE's 1 ms) retries."""
    h = await make(saturation=1.0, interval=0.002)
    task = h.submit("a")
    await h.settle()
    calls = h.sat.calls
    await eventually(lambda: h.sat.calls > calls + 3, what="ticks while queued")
    h.sat.pool = 0.0
    assert (await asyncio.wait_for(task, 5)).dispatched


async def test_no_polling_while_idle(make: Any) -> None:
    """Nothing queued: the dispatcher sleeps; the saturation signal is not read."""
    h = await make(saturation=0.0, interval=0.001)
    await h.submit("a")  # dispatched at once
    calls = h.sat.calls
    await asyncio.sleep(0.05)  # the passing time is the point: no tick may run in it
    assert h.sat.calls == calls
    h.fc.notify()  # a notify runs one cycle (the pool-saturation gauge stays fresh)
    await h.settle()
    assert h.sat.calls == calls + 1


async def test_notifications_coalesce(make: Any) -> None:
    h = await make(saturation=1.0)
    h.submit("a")
    await h.settle()
    calls = h.sat.calls
    for _ in range(50):
        h.fc.notify()
    await h.settle()
    assert h.sat.calls == calls + 1


async def test_candidate_subset_saturation_blocks_the_head_and_below(make: Any) -> None:
    """A request whose own candidates are saturated is held even though the pool is not,
    and — head-of-line — so is every lower band (GIE's dispatchCycle doc)."""
    h = await make(saturation=0.0)
    h.sat.subsets[frozenset({"10.0.0.1:8000"})] = 1.0
    h.sat.pool = 1.0
    h.submit("pinned", priority=10, subset=("10.0.0.1:8000",))
    h.submit("low", priority=5)
    h.submit("free", priority=10, subset=("10.0.0.2:8000",))
    await h.settle()
    h.sat.pool = 0.2
    await h.step(3)
    assert h.order == []  # the band's head (FCFS: "pinned") is blocked, so is all else
    h.sat.subsets.clear()
    await h.step(3)
    assert h.order == ["pinned", "free", "low"]


async def test_usage_limit_ceilings_gate_lower_bands(make: Any) -> None:
    """A usage-limit policy reserving headroom for high priority: at saturation 0.7 the
    high band (ceiling 1.0) flows, the low band (ceiling 0.5) waits."""

    class Tiered(StaticUsageLimitPolicy):
        def compute_limit(self, saturation: float, priorities: Sequence[int]) -> list[float]:
            return [1.0 if p >= 10 else 0.5 for p in priorities]

    cfg = default_config(usage_limit=Tiered("tiered"))
    h = await make(cfg, saturation=0.7)
    low = h.submit("low", priority=0)
    await h.settle()
    assert not low.done()
    assert (await h.submit("high", priority=10)).dispatched
    h.sat.pool = 0.4
    await h.step()
    assert h.order == ["high", "low"]


async def test_static_threshold_below_one_keeps_headroom(make: Any) -> None:
    h = await make(default_config(usage_limit=StaticUsageLimitPolicy(threshold=0.8)),
                   saturation=0.8)
    t = h.submit("a")
    await h.settle()
    assert not t.done()
    h.sat.pool = 0.79
    await h.step()
    assert h.order == ["a"]


async def test_a_failing_fairness_policy_skips_its_band(make: Any) -> None:
    """processor_test: should continue to lower priority band on FairnessPolicy error."""

    class Broken(GlobalStrictFairnessPolicy):
        def pick(self, band: PriorityBandView) -> FlowQueueView | None:
            raise RuntimeError("policy failure")

    cfg = default_config(bands={20: (Broken("broken"), None)})
    h = await make(cfg, saturation=1.0)
    h.submit("high", priority=20)
    h.submit("low", priority=10)
    await h.settle()
    h.sat.pool = 0.0
    await h.step(2)
    assert h.order == ["low"]


async def test_a_failing_saturation_callback_fails_open(make: Any) -> None:
    def broken(subset: Sequence[str] | None) -> float:
        raise RuntimeError("no signal")

    fc = FlowController(default_config(), broken)
    await fc.start()
    try:
        assert (await fc.enqueue_and_wait(FlowControlRequest())).dispatched
    finally:
        await fc.stop()


# ================================================================ capacity


@pytest.mark.parametrize(("limits", "sizes", "admitted"), [
    # band request limit: exactly at capacity is allowed, one over is not
    ({"band_max_requests": 3}, [1, 1, 1, 1], 3),
    # band byte limit
    ({"band_max_bytes": 100}, [40, 60, 1], 2),
    ({"band_max_bytes": 100}, [40, 61, 60], 2),
    # global limits
    ({"max_requests": 2}, [1, 1, 1], 2),
    ({"max_bytes": 10}, [5, 5, 1], 2),
    ({"max_bytes": 10}, [11], 0),
])
async def test_capacity_rejections(make: Any, limits: dict[str, Any], sizes: list[int],
                                   admitted: int) -> None:
    """processor_test hasCapacity: shard (global) and band limits, in requests and bytes;
    a request over a limit is rejected at once: RejectedCapacity, 429."""
    h = await make(default_config(**limits), saturation=1.0)
    for i, size in enumerate(sizes):
        h.submit(i, size=size)
    await h.settle()
    rejected = [p for p, r in h.results.items() if r.outcome is QueueOutcome.REJECTED_CAPACITY]
    assert h.fc.stats().queued == admitted
    assert len(rejected) == len(sizes) - admitted
    for p in rejected:
        r = h.results[p]
        assert r.status == 429 and r.reason == "request rejected pre-queue: queue at capacity"
        assert isinstance(r.error(), NoCapacity)
    await h.drain()
    accounted(h)


async def test_global_limit_spans_bands_and_band_limits_are_per_band(make: Any) -> None:
    cfg = default_config(max_requests=3, band_max_requests=2)
    h = await make(cfg, saturation=1.0)
    for i, p in enumerate((0, 0, 0, 5, 5, 9)):
        h.submit(i, priority=p)
    await h.settle()
    outcomes = [h.results[i].outcome if i in h.results else None for i in range(6)]
    cap = QueueOutcome.REJECTED_CAPACITY
    # band 0 takes 2 (its limit), band 5 one (the global limit of 3), the rest bounce.
    assert outcomes == [None, None, cap, None, cap, cap]


async def test_dispatched_requests_free_capacity(make: Any) -> None:
    h = await make(default_config(band_max_requests=1), saturation=1.0)
    h.submit("a")
    await h.settle()
    h.submit("b")
    await h.settle()
    assert h.results["b"].outcome is QueueOutcome.REJECTED_CAPACITY
    await h.drain()
    h.sat.pool = 1.0
    h.submit("c")
    await h.settle()
    assert "c" not in h.results and h.fc.stats().queued == 1


# ================================================================ TTL and cancellation


async def test_ttl_expiry_evicts_with_503(make: Any) -> None:
    """controller_test OnReqCtxTimeoutAfterDistribution: EvictedTTL."""
    h = await make(saturation=1.0)
    task = h.submit("a", ttl=0.03)
    h.submit("b")  # no TTL: waits
    result = await asyncio.wait_for(task, 5)
    assert result.outcome is QueueOutcome.EVICTED_TTL and result.status == 503
    assert result.reason == "request evicted from queue: request TTL expired"
    err = result.error()
    assert isinstance(err, ServiceUnavailable)
    assert str(err) == "request timed out in queue: request evicted from queue: request TTL expired"
    s = h.fc.stats()
    assert s.queued == 1 and s.outcomes[QueueOutcome.EVICTED_TTL] == 1


async def test_default_request_ttl_applies_to_requests_without_their_own(make: Any) -> None:
    h = await make(default_config(default_request_ttl=0.03), saturation=1.0)
    started = asyncio.get_running_loop().time()
    own = h.submit("own", ttl=HOUR)
    result = await asyncio.wait_for(h.submit("default"), 5)
    assert result.outcome is QueueOutcome.EVICTED_TTL
    assert asyncio.get_running_loop().time() - started >= 0.025
    assert not own.done()


async def test_dispatch_before_ttl_cancels_the_timer(make: Any) -> None:
    h = await make(saturation=1.0)
    task = h.submit("a", ttl=0.05)
    await h.settle()
    h.sat.pool = 0.0
    await h.step()
    assert (await task).dispatched
    await asyncio.sleep(0.08)  # past the TTL: the passing time is the point
    assert h.fc.stats().outcomes[QueueOutcome.EVICTED_TTL] == 0


async def test_cancellation_removes_the_request_at_once(make: Any) -> None:
    """controller_test OnReqCtxCancelledAfterDistribution: the client went away."""
    h = await make(default_config(band_max_requests=1), saturation=1.0)
    task = h.submit("gone", size=500)
    await h.settle()
    assert h.fc.stats().queued == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    s = h.fc.stats()
    assert s.queued == 0 and s.queued_bytes == 0
    assert s.outcomes[QueueOutcome.EVICTED_CONTEXT_CANCELLED] == 1
    assert OUTCOME_STATUS[QueueOutcome.EVICTED_CONTEXT_CANCELLED] == 503
    # Its capacity is free again, and it is never dispatched later.
    h.submit("next")
    await h.settle()
    assert "next" not in h.results and h.fc.stats().queued == 1
    await h.drain()
    assert h.order == ["next"]
    accounted(h)


async def test_cancelled_result_message() -> None:
    r = FlowControlResult(QueueOutcome.EVICTED_CONTEXT_CANCELLED, "x")
    err = r.error()
    assert isinstance(err, ServiceUnavailable) and str(err) == "client disconnected: x"


# ================================================================ sheddable traffic


async def test_sheddable_requests_queue_in_their_own_band(make: Any) -> None:
    """GIE v1.5.0 under flow control: a negative priority is queued, not dropped; it is
    served after every higher band and shed only by its band's capacity (429) or TTL."""
    assert is_sheddable(-1) and not is_sheddable(0)
    cfg = FlowControlConfig(
        default_priority_band=band_config(0, GlobalStrictFairnessPolicy(),
                                          FCFSOrderingPolicy()),
        usage_limit_policy=StaticUsageLimitPolicy(),
        priority_bands={-1: band_config(-1, GlobalStrictFairnessPolicy(), FCFSOrderingPolicy(),
                                        max_requests=2)})
    h = await make(cfg, saturation=1.0)
    for i in range(3):
        h.submit(("batch", i), "batch", priority=-1)
    h.submit(("chat", 0), "chat", priority=0)
    await h.settle()
    assert h.results[("batch", 2)].outcome is QueueOutcome.REJECTED_CAPACITY
    assert h.results[("batch", 2)].status == 429
    await h.drain()
    assert h.order[-3:] == [("chat", 0), ("batch", 0), ("batch", 1)]


# ================================================================ lifecycle


async def test_not_started_and_stopped_reject(make: Any) -> None:
    h = await make(start=False)
    r = await h.fc.enqueue_and_wait(FlowControlRequest())
    assert r.outcome is QueueOutcome.REJECTED_OTHER and r.status == 500
    assert r.reason == "request rejected pre-queue: flow controller is not running"
    assert str(r.error()) == ("internal flow control error: request rejected pre-queue: flow "
                              "controller is not running")
    await h.fc.start()
    assert (await h.fc.enqueue_and_wait(FlowControlRequest())).dispatched
    await h.fc.stop()
    assert (await h.fc.enqueue_and_wait(FlowControlRequest())).outcome \
        is QueueOutcome.REJECTED_OTHER
    accounted(h)


async def test_stop_evicts_queued_requests(make: Any) -> None:
    """processor_test: should evict a queued item on shutdown — EvictedOther (500)."""
    h = await make(default_config(default_request_ttl=HOUR), saturation=1.0)
    tasks = [h.submit(i, priority=i % 3) for i in range(5)]
    await h.settle()
    await h.fc.stop()
    results = await asyncio.gather(*tasks)
    assert {r.outcome for r in results} == {QueueOutcome.EVICTED_OTHER}
    assert results[0].reason == "request evicted from queue: flow controller is not running"
    s = h.fc.stats()
    assert s.queued == 0 and s.evicted == 5
    accounted(h)


async def test_empty_fairness_id_is_rejected(make: Any) -> None:
    """GIE: ErrFlowIDEmpty → RejectedOther."""
    h = await make()
    r = await h.fc.enqueue_and_wait(FlowControlRequest(fairness_id=""))
    assert r.outcome is QueueOutcome.REJECTED_OTHER
    assert r.reason == "request rejected pre-queue: flow ID cannot be empty"


async def test_idle_flows_and_dynamic_bands_are_collected(make: Any) -> None:
    """GIE's registry GC: a flow idle for flowGCTimeout goes, then a provisioned band with
    no flows for priorityBandGCTimeout; configured bands stay."""
    now = [1000.0]
    cfg = default_config(bands={5: (None, None)})
    fc = FlowController(cfg, Saturation(), clock=lambda: now[0])
    await fc.start()
    try:
        for p in (5, 9):
            assert (await fc.enqueue_and_wait(FlowControlRequest("t", p))).dispatched
        assert sorted(fc.priorities) == [5, 9]
        now[0] += 301  # past the flow GC timeout: the next enqueue collects
        await fc.enqueue_and_wait(FlowControlRequest("other", 0))
        band5, band9 = fc.band(5), fc.band(9)
        assert band5 is not None and band9 is not None
        assert list(band5.flow_ids()) == [] and list(band9.flow_ids()) == []
        now[0] += 601  # band 9 has had no flow for longer than the band GC timeout
        await fc.enqueue_and_wait(FlowControlRequest("other", 0))
        assert fc.band(9) is None and fc.band(5) is not None
        assert sorted(fc.priorities) == [0, 5]
    finally:
        await fc.stop()


# ================================================================ accounting


def test_outcome_statuses_and_labels() -> None:
    """admission.go translateFlowControlOutcome; outcomes.go String()."""
    assert {o.value: OUTCOME_STATUS[o] for o in QueueOutcome} == {
        "NotYetFinalized": 500, "Dispatched": None, "RejectedCapacity": 429,
        "RejectedOther": 500, "EvictedTTL": 503, "EvictedContextCancelled": 503,
        "EvictedOther": 500}
    assert FlowControlResult(QueueOutcome.REJECTED_CAPACITY).error() is not None
    assert str(FlowControlResult(QueueOutcome.REJECTED_CAPACITY).error()) == \
        "request rejected by flow control"
    assert str(FlowControlResult(QueueOutcome.EVICTED_OTHER, "internal error").error()) == \
        "internal flow control error: internal error"
    assert str(FlowControlResult(QueueOutcome.NOT_YET_FINALIZED).error()).startswith(
        "unhandled flow control outcome")
    with pytest.raises(NoCapacity):
        FlowControlResult(QueueOutcome.REJECTED_CAPACITY).raise_for_outcome()
    FlowControlResult(QueueOutcome.DISPATCHED).raise_for_outcome()


async def test_randomized_stress_accounts_for_every_request(make: Any) -> None:
    """A few thousand requests over bands, flows, policies and limits, with saturation
    flapping, TTLs expiring and clients leaving: every request ends in exactly one
    outcome, the counters add up, and nothing is left queued or waiting."""
    rng = random.Random(16)
    cfg = default_config(
        max_requests=400, max_bytes=400_000, band_max_requests=150, band_max_bytes=150_000,
        bands={10: (RoundRobinFairnessPolicy(), None), 5: (None, EDFOrderingPolicy()),
               0: (RoundRobinFairnessPolicy(), SLODeadlineOrderingPolicy())})
    h = await make(cfg, saturation=1.0, interval=0.0005)
    n = 3000
    for i in range(n):
        h.submit(i, flow=f"t{rng.randrange(12)}", priority=rng.choice((10, 5, 0, -1, 3)),
                 size=rng.randrange(0, 3000), ttl=rng.choice((0, 0, 0.002, 0.01, 0.05)),
                 headers={"x-slo-ttft-ms": str(rng.randrange(0, 500))},
                 subset=rng.choice((None, None, ("a",), ("b",))))
        roll = rng.random()
        if roll < 0.1 and h.tasks:
            victim = h.tasks[rng.randrange(i + 1)]
            victim.cancel()
        elif roll < 0.3:
            h.sat.pool = rng.choice((0.0, 0.5, 0.99, 1.0, 1.5))
            h.sat.subsets[frozenset({"a"})] = rng.choice((0.0, 1.0))
            h.fc.notify()
        if i % 50 == 0:
            await asyncio.sleep(0)
        accounted(h)
    await h.drain()
    done = dict(zip(h.tasks, await asyncio.gather(*h.tasks.values(), return_exceptions=True),
                    strict=True))
    s = h.fc.stats()
    # A task cancelled before its first step never reached the controller.
    entered = len(h.entered)
    assert n - 100 < entered <= n
    cancelled = sum(isinstance(r, asyncio.CancelledError) for p, r in done.items()
                    if p in h.entered)
    by_outcome = {o: sum(isinstance(r, FlowControlResult) and r.outcome is o
                         for r in done.values()) for o in QueueOutcome}
    assert s.enqueued == entered and s.queued == 0 and s.queued_bytes == 0
    assert s.dispatched + s.rejected + s.evicted == entered
    # Each waiter saw the outcome that was counted. A cancelled waiter was counted
    # EvictedContextCancelled — unless its outcome was final already (dispatched, say,
    # in the same loop iteration as the cancel): then that outcome counts.
    cancel = QueueOutcome.EVICTED_CONTEXT_CANCELLED
    unseen = 0
    for o in FINAL_OUTCOMES:
        if o is not cancel:
            assert s.outcomes[o] >= by_outcome[o], o
            unseen += s.outcomes[o] - by_outcome[o]
    assert s.outcomes[cancel] + unseen == cancelled
    assert s.outcomes[cancel] > cancelled // 2
    assert cancelled > 0 and s.outcomes[QueueOutcome.EVICTED_TTL] > 0
    assert s.outcomes[QueueOutcome.REJECTED_CAPACITY] > 0 and s.dispatched > n // 5
    for band in s.bands.values():
        assert band.queued == 0 and band.queued_bytes == 0


# ================================================================ the detector adapter


def test_detector_saturation_adapter() -> None:
    """detector_saturation: the utilization detector's gradient over the pool or a
    subset; a detector with only is_saturated reads 0 or 1."""
    now = time.monotonic()
    eps = (Endpoint("a", "10.0.0.1", 8000, metrics=Metrics(waiting_queue_size=5,
                                                            updated_at=now)),
           Endpoint("b", "10.0.0.2", 8000, metrics=Metrics(waiting_queue_size=0,
                                                            updated_at=now)))
    detector = UtilizationDetector("u", queue_depth_threshold=5, clock=lambda: now)
    sat = detector_saturation(detector, lambda: eps)
    assert sat(None) == 0.5  # mean of 1.0 and 0.0
    assert sat(["10.0.0.1:8000"]) == 1.0 and sat(["10.0.0.2:8000"]) == 0.0
    assert sat(["10.9.9.9:1"]) == 1.0  # no candidate: saturated

    class Binary:
        type_name = name = "binary"

        def is_saturated(self, endpoints: Sequence[Endpoint]) -> bool:
            return not endpoints

    binary = detector_saturation(Binary(), lambda: eps)
    assert binary(None) == 0.0 and binary([]) == 1.0
