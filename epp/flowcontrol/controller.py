"""The flow controller: priority bands, per-flow queues, the dispatch cycle.

GIE v1.5.0: pkg/epp/flowcontrol/controller (``FlowController.EnqueueAndWait``),
controller/internal/processor.go (``ShardProcessor``: enqueue, hasCapacity,
dispatchCycle), registry/ (bands provisioned on first use, idle flows and bands collected).
One event loop replaces GIE's shards and actor goroutines: every state change happens
in a synchronous step on the loop, so capacity checks and dispatch are atomic without
locks, and a queued request's waiter is a future.

Dispatch cycle (``_dispatch_cycle``, GIE's ``dispatchCycle``): read the pool's saturation
(the ``saturation`` callback with ``None``), ask the usage-limit policy for one ceiling
per band, then walk the bands from the highest priority down:

- ``saturation >= ceiling`` → stop: nothing is dispatched this cycle, lower bands
  included (head-of-line blocking keeps lower priorities from taking the capacity a
  higher one waits for);
- an empty band, or one whose fairness policy picks nothing (or raises), is skipped;
- otherwise the picked flow's head request is dispatched — unless it carries a candidate
  subset whose own saturation (the callback with that subset) is at or over the ceiling,
  which stops the cycle the same way. One request per cycle.

Cycles run: right after each enqueue (in the caller's step: a request that finds the
pool unsaturated is dispatched without ever waiting), on :meth:`FlowController.notify`
(coalesced: a request completed, metrics were refreshed), and every
``dispatch_interval`` (1 ms, GIE's dispatch ticker) while any request is queued. With
nothing queued the dispatcher task sleeps until notified: no polling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from epp.flowcontrol.config import BandConfig, FlowControlConfig
from epp.flowcontrol.eviction import ReclamationController, maybe_reclaim
from epp.flowcontrol.interfaces import FairnessPolicy, OrderingPolicy
from epp.flowcontrol.metrics import FlowControlMetrics
from epp.flowcontrol.queues import FlowQueue, QueueItem, new_queue, sorted_insert, sorted_remove
from epp.flowcontrol.types import (
    DISPATCHED,
    ERR_CONTEXT_CANCELLED,
    ERR_EVICTED,
    ERR_FLOW_ID_EMPTY,
    ERR_NOT_RUNNING,
    ERR_QUEUE_AT_CAPACITY,
    ERR_REJECTED,
    ERR_TTL_EXPIRED,
    FINAL_OUTCOMES,
    FlowControlRequest,
    FlowControlResult,
    FlowKey,
    QueueOutcome,
)

log = logging.getLogger(__name__)

#: ``saturation(subset)``: the saturation of the candidate endpoints — the whole pool when
#: ``subset`` is None, else the endpoints whose ``ip:port`` are in ``subset`` — on GIE's
#: scale (0 idle … 1 saturated, > 1 overloaded; a detector's ``saturation(endpoints)``).
SaturationFn = Callable[[Sequence[str] | None], float]

DEFAULT_DISPATCH_INTERVAL: Final = 0.001  # GIE's dispatch ticker

_REJECT_CAPACITY: Final = FlowControlResult(QueueOutcome.REJECTED_CAPACITY,
                                            f"{ERR_REJECTED}: {ERR_QUEUE_AT_CAPACITY}")
_REJECT_NOT_RUNNING: Final = FlowControlResult(QueueOutcome.REJECTED_OTHER,
                                               f"{ERR_REJECTED}: {ERR_NOT_RUNNING}")
_REJECT_EMPTY_ID: Final = FlowControlResult(QueueOutcome.REJECTED_OTHER,
                                            f"{ERR_REJECTED}: {ERR_FLOW_ID_EMPTY}")
_EVICT_TTL: Final = FlowControlResult(QueueOutcome.EVICTED_TTL,
                                      f"{ERR_EVICTED}: {ERR_TTL_EXPIRED}")
_EVICT_CANCELLED: Final = FlowControlResult(
    QueueOutcome.EVICTED_CONTEXT_CANCELLED,
    f"{ERR_EVICTED}: {ERR_CONTEXT_CANCELLED}: context canceled")
_EVICT_SHUTDOWN: Final = FlowControlResult(QueueOutcome.EVICTED_OTHER,
                                           f"{ERR_EVICTED}: {ERR_NOT_RUNNING}")

_LABEL_REJECTED_CAPACITY: Final = QueueOutcome.REJECTED_CAPACITY.value
_LABEL_NOT_YET_FINALIZED: Final = QueueOutcome.NOT_YET_FINALIZED.value

# Why the dispatcher task woke up.
_TICK: Final = "tick"
_KICK: Final = "kick"
_RESCHEDULE: Final = "reschedule"  # start (or stop) ticking; no cycle of its own

_LOG_EVERY: Final = 60.0  # seconds between two logs of the same recurring failure


class PriorityBand:
    """The flows of one priority (GIE's priority band); a
    :class:`~epp.flowcontrol.interfaces.PriorityBandView` for the policies."""

    __slots__ = (
        "_active",
        "_ids",
        "_totals",
        "byte_size",
        "config",
        "dynamic",
        "fairness_policy",
        "flows",
        "idle_since",
        "len",
        "ordering_policy",
        "policy_state",
        "priority",
    )

    def __init__(self, config: BandConfig, dynamic: bool, totals: _Totals, now: float) -> None:
        self.priority = config.priority
        self.config = config
        self.fairness_policy: FairnessPolicy = config.fairness_policy
        self.ordering_policy: OrderingPolicy = config.ordering_policy
        self.policy_state: Any = config.fairness_policy.new_state()
        self.flows: dict[str, FlowQueue] = {}
        self._ids: list[str] = []  # every flow, sorted
        self._active: list[str] = []  # flows with queued requests, sorted
        self.len = 0
        self.byte_size = 0
        self.dynamic = dynamic  # provisioned from the default band (GC-able)
        self.idle_since = now
        self._totals = totals

    # --- PriorityBandView ---

    def flow_ids(self) -> Sequence[str]:
        return self._ids

    def queue(self, flow_id: str) -> FlowQueue | None:
        return self.flows.get(flow_id)

    def active_ids(self) -> Sequence[str]:
        return self._active

    def active_queues(self) -> Iterator[FlowQueue]:
        flows = self.flows
        return (flows[i] for i in self._active)

    # --- bookkeeping ---

    def flow(self, flow_id: str, now: float) -> FlowQueue:
        q = self.flows.get(flow_id)
        if q is None:
            q = self.flows[flow_id] = new_queue(self.config.queue, FlowKey(flow_id, self.priority),
                                                self.ordering_policy, self._changed, now)
            sorted_insert(self._ids, flow_id)
        return q

    def drop_flow(self, flow_id: str, now: float) -> None:
        if self.flows.pop(flow_id, None) is not None:
            sorted_remove(self._ids, flow_id)
            sorted_remove(self._active, flow_id)
            if not self.flows:
                self.idle_since = now

    def _changed(self, q: FlowQueue, delta: int, size: int) -> None:
        self.len += delta
        self.byte_size += size
        totals = self._totals
        totals.len += delta
        totals.byte_size += size
        n = len(q)
        if delta > 0:
            if n == 1:
                sorted_insert(self._active, q.key.id)
        elif n == 0:
            sorted_remove(self._active, q.key.id)
            q.idle_since = totals.clock()


class _Totals:
    __slots__ = ("byte_size", "clock", "len")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.len = 0
        self.byte_size = 0
        self.clock = clock


@dataclass(frozen=True)
class BandStats:
    """One band's queue and limits (``max_requests`` 0: none)."""

    priority: int
    queued: int
    queued_bytes: int
    flows: int
    max_bytes: int
    max_requests: int
    dynamic: bool


@dataclass(frozen=True)
class FlowControlStats:
    """A snapshot of the controller's accounting. ``enqueued`` counts every
    :meth:`FlowController.enqueue_and_wait` call (rejected ones included); ``outcomes``
    the final outcome of each. Invariant: ``enqueued == finalized + queued``."""

    enqueued: int
    outcomes: Mapping[QueueOutcome, int]
    queued: int
    queued_bytes: int
    bands: Mapping[int, BandStats]

    @property
    def finalized(self) -> int:
        return sum(self.outcomes.values())

    @property
    def dispatched(self) -> int:
        return self.outcomes[QueueOutcome.DISPATCHED]

    @property
    def rejected(self) -> int:
        return sum(n for o, n in self.outcomes.items() if o.rejected)

    @property
    def evicted(self) -> int:
        return sum(n for o, n in self.outcomes.items() if o.evicted)


class FlowController:
    """Admission by queueing (GIE's ``FlowController``); see the package docstring for
    the contract. ``saturation``: :data:`SaturationFn`. ``pool_name``: the metrics'
    ``inference_pool`` label. ``metrics``: where to record GIE's flow-control series
    (None: nowhere). ``dispatch_interval``: seconds between dispatch attempts while
    requests are queued. ``clock``: monotonic seconds (tests may replace it)."""

    def __init__(self, config: FlowControlConfig, saturation: SaturationFn, *,
                 metrics: FlowControlMetrics | None = None,
                 dispatch_interval: float = DEFAULT_DISPATCH_INTERVAL,
                 clock: Callable[[], float] = time.monotonic,
                 reclamation: ReclamationController | None = None) -> None:
        if not dispatch_interval > 0:
            raise ValueError(f"dispatch_interval must be > 0, got {dispatch_interval}")
        self.config = config
        self._saturation = saturation
        self._metrics = metrics
        self._interval = dispatch_interval
        self._clock = clock
        self._perf = time.perf_counter
        self._totals = _Totals(clock)
        now = clock()
        self._bands: dict[int, PriorityBand] = {
            p: PriorityBand(b, False, self._totals, now) for p, b in config.priority_bands.items()}
        self._priorities: list[int] = sorted(self._bands, reverse=True)
        self._usage = config.usage_limit_policy
        self._default_ttl = config.default_request_ttl
        self._max_bytes = config.max_bytes
        self._max_requests = config.max_requests
        self._next_gc = now + config.flow_gc_timeout
        self._seq = 0
        self._enqueued = 0
        self._counts: dict[str, int] = {o.value: 0 for o in FINAL_OUTCOMES}
        self._running = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[str] | None = None
        self._waiter_ticks = False
        self._kicked = False
        self._logged: dict[str, float] = {}
        # llm-d's in-flight eviction (flowControl.enableEviction; epp/flowcontrol/
        # eviction.py): asked on every head-of-line break. None: off.
        self.reclamation = reclamation

    # ------------------------------------------------------------------ lifecycle

    @property
    def running(self) -> bool:
        return self._running

    @property
    def clock_fn(self) -> Callable[[], float]:
        """The controller's clock (monotonic seconds)."""
        return self._clock

    async def start(self) -> None:
        """Start the dispatcher task on the running loop; requests are rejected
        (``RejectedOther``) before this."""
        if self._running:
            return
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._task = self._loop.create_task(self._run(), name="flow-control-dispatcher")

    async def stop(self) -> None:
        """Stop dispatching: every queued request ends ``EvictedOther`` (500, "flow
        controller is not running"), later ones are rejected (``RejectedOther``) — GIE's
        shutdown. Call it once the server has drained."""
        if not self._running:
            return
        self._running = False
        for band in self._bands.values():
            for q in list(band.flows.values()):
                for item in q.drain():
                    self._finalize(item, _EVICT_SHUTDOWN)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # our caller is being cancelled, not just the dispatcher

    # ------------------------------------------------------------------ the request path

    async def enqueue_and_wait(self, request: FlowControlRequest) -> FlowControlResult:
        """Queue ``request`` and wait for its outcome (GIE's ``EnqueueAndWait``).

        Returns at once when the request is dispatched by the cycle its own enqueue runs
        (the pool is not saturated) or is rejected (capacity: ``RejectedCapacity``);
        otherwise when it is dispatched, its TTL expires (``EvictedTTL``) or the
        controller stops (``EvictedOther``). If the awaiting task is cancelled (the client
        went away), the request leaves its queue at once, is counted
        ``EvictedContextCancelled``, and the ``CancelledError`` propagates.
        """
        item = self._submit(request)
        if item.result is not None:
            return item.result
        loop = self._loop
        assert loop is not None  # _submit rejects before start()
        fut: asyncio.Future[FlowControlResult] = loop.create_future()
        item.future = fut
        ttl = item.effective_ttl
        if ttl > 0:
            delay = item.enqueue_time + ttl - self._clock()
            item.timer = loop.call_later(delay if delay > 0 else 0.0, self._expire, item)
        labels = item.metric_labels
        if labels is not None:
            labels.size.inc()
            labels.bytes.inc(request.byte_size)
            item.counted = True
        waiter = self._waiter
        if waiter is not None and not self._waiter_ticks and not waiter.done():
            waiter.set_result(_RESCHEDULE)  # something is queued now: start ticking
        try:
            return await fut
        except asyncio.CancelledError:
            if item.outcome is None:
                self._evict(item, _EVICT_CANCELLED)
            raise

    def notify(self) -> None:
        """Something that changes saturation happened (a request finished, endpoint
        metrics were refreshed): run a dispatch cycle soon. Cheap; calls coalesce into one
        cycle per loop iteration."""
        self._kicked = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(_KICK)

    def _submit(self, request: FlowControlRequest) -> QueueItem:
        """Everything of an enqueue that does not wait: capacity check, queue insertion,
        one dispatch cycle. The returned item may already be finalized."""
        self._enqueued += 1
        clock = self._clock
        now = clock()
        self._seq += 1
        ttl = request.ttl
        item = QueueItem(request, now, ttl if ttl > 0 else self._default_ttl, self._seq)
        # Refused before reaching a queue: counted, but (as in GIE, where no queue item
        # exists yet) not in the per-flow metrics.
        if not self._running:
            self._finalize(item, _REJECT_NOT_RUNNING)
            return item
        flow_id = request.fairness_id
        if not flow_id:
            self._finalize(item, _REJECT_EMPTY_ID)
            return item
        priority = request.priority
        metrics = self._metrics
        if metrics is not None:
            item.metric_labels = metrics.flow(flow_id, priority, request.model_name,
                                              request.target_model_name)
        if now >= self._next_gc:
            self._collect_garbage(now)
        t0 = self._perf() if metrics is not None else 0.0
        band = self._bands.get(priority)
        if band is None:
            band = self._provision(priority, now)
        # GIE's hasCapacity: global and band limits, in bytes and requests (0: none).
        size = request.byte_size
        totals = self._totals
        cfg = band.config
        if ((self._max_bytes and totals.byte_size + size > self._max_bytes)
                or (self._max_requests and totals.len + 1 > self._max_requests)
                or (cfg.max_bytes and band.byte_size + size > cfg.max_bytes)
                or (cfg.max_requests and band.len + 1 > cfg.max_requests)):
            if item.metric_labels is not None:
                item.metric_labels.enqueue[_LABEL_REJECTED_CAPACITY].observe(
                    self._perf() - t0)
            self._finalize(item, _REJECT_CAPACITY)
            self._dispatch_cycle()  # GIE runs a cycle after every enqueue
            return item
        band.flow(flow_id, now).add(item)
        if item.metric_labels is not None:
            item.metric_labels.enqueue[_LABEL_NOT_YET_FINALIZED].observe(
                self._perf() - t0)
        self._dispatch_cycle()
        return item

    def _provision(self, priority: int, now: float) -> PriorityBand:
        """A band for a priority the config does not name, from the default band."""
        band = self._bands[priority] = PriorityBand(
            self.config.template_for(priority), True, self._totals, now)
        self._priorities = sorted(self._bands, reverse=True)
        log.debug("flow control: provisioned priority band %d", priority)
        return band

    # ------------------------------------------------------------------ outcomes

    def _finalize(self, item: QueueItem, result: FlowControlResult) -> None:
        """Record ``item``'s one outcome (it must be out of its queue) and wake its waiter."""
        item.outcome = result.outcome
        item.result = result
        label = result.label
        self._counts[label] += 1
        timer = item.timer
        if timer is not None:
            timer.cancel()
            item.timer = None
        labels = item.metric_labels
        if labels is not None:
            labels.durations[label].observe(self._clock() - item.enqueue_time)
            if item.counted:
                labels.size.dec()
                labels.bytes.dec(item.request.byte_size)
                item.counted = False
        fut = item.future
        if fut is not None and not fut.done():
            fut.set_result(result)

    def _evict(self, item: QueueItem, result: FlowControlResult) -> None:
        q = item.queue
        if q is not None:
            q.remove(item)
        self._finalize(item, result)

    def _expire(self, item: QueueItem) -> None:
        item.timer = None
        if item.outcome is None:
            self._evict(item, _EVICT_TTL)

    # ------------------------------------------------------------------ dispatch

    def _saturation_of(self, subset: Sequence[str] | None) -> float:
        try:
            return float(self._saturation(subset))
        except Exception:  # noqa: BLE001 - a broken signal is logged and fails open
            # Fail open, as GIE's filters do: a broken signal must not hold every request.
            self._log_limited("saturation", "flow control: the saturation callback failed; "
                              "treating the pool as not saturated", exc_info=True)
            return 0.0

    def _dispatch_cycle(self) -> bool:
        """One dispatch attempt (module docstring); True when a request was dispatched."""
        self._kicked = False
        metrics = self._metrics
        t0 = self._perf() if metrics is not None else 0.0
        try:
            saturation = self._saturation_of(None)
            if metrics is not None:
                metrics.set_pool_saturation(saturation)
            priorities = self._priorities
            try:
                ceilings = self._usage.compute_limit(saturation, priorities)
                if len(ceilings) != len(priorities):
                    raise ValueError(f"{len(ceilings)} ceilings for {len(priorities)} bands")
            except Exception:  # noqa: BLE001 - a plugin's bug is logged; no gating then
                self._log_limited("usage", f"flow control: usage limit policy "
                                  f"{self._usage.name!r} failed; no band limit this cycle",
                                  exc_info=True)
                ceilings = [1.0] * len(priorities)
            bands = self._bands
            for i, priority in enumerate(priorities):
                ceiling = ceilings[i]
                if saturation >= ceiling:
                    if self.reclamation is not None:
                        self._maybe_reclaim(saturation, priorities, ceilings, i)
                    return False  # head-of-line blocking: nothing below goes either
                band = bands[priority]
                if not band.len:
                    continue
                try:
                    picked = band.fairness_policy.pick(band)
                except Exception:  # noqa: BLE001 - GIE skips the band on a policy error
                    self._log_limited(f"pick:{priority}", "flow control: fairness policy "
                                      f"{band.fairness_policy.name!r} failed on band "
                                      f"{priority}; skipping the band", exc_info=True)
                    continue
                if picked is None:
                    continue
                head = picked.peek_head()
                if not isinstance(head, QueueItem) or head.queue is None:
                    continue
                subset = head.request.subset
                if subset is not None and self._saturation_of(subset) >= ceiling:
                    return False  # its candidates are saturated: hold it, and what is below
                head.queue.remove(head)
                self._finalize(head, DISPATCHED)
                return True
            return False
        finally:
            if metrics is not None:
                metrics.observe_cycle(self._perf() - t0)

    def _maybe_reclaim(self, saturation: float, priorities: Sequence[int],
                       ceilings: Sequence[float], index: int) -> None:
        reclamation = self.reclamation
        assert reclamation is not None
        bands = self._bands
        try:
            maybe_reclaim(reclamation, reclamation.clock(), saturation, priorities, ceilings,
                          index, lambda p: bands[p].len)
        except Exception:  # noqa: BLE001 - eviction must not break dispatching
            self._log_limited("reclaim", "flow control: in-flight eviction failed",
                              exc_info=True)

    async def _run(self) -> None:
        """The dispatcher: a cycle per tick while requests are queued, one per
        :meth:`notify`; asleep otherwise."""
        loop = asyncio.get_running_loop()
        totals = self._totals
        while True:
            # A notify() that came while no waiter was set (before this task first ran)
            # is a cycle due now.
            if not self._kicked:
                waiter: asyncio.Future[str] = loop.create_future()
                ticking = totals.len > 0
                timer = (loop.call_later(self._interval, _wake, waiter, _TICK) if ticking
                         else None)
                self._waiter, self._waiter_ticks = waiter, ticking
                try:
                    reason = await waiter
                finally:
                    self._waiter = None
                    if timer is not None:
                        timer.cancel()
                if reason is _RESCHEDULE and not self._kicked:
                    continue
                if reason is _TICK and not totals.len and not self._kicked:
                    continue
            try:
                self._dispatch_cycle()
            except Exception:  # noqa: BLE001 - the dispatcher must outlive a bug in a cycle
                self._log_limited("cycle", "flow control: dispatch cycle failed",
                                  exc_info=True)

    # ------------------------------------------------------------------ housekeeping

    def _collect_garbage(self, now: float) -> None:
        """Drop flows idle for ``flow_gc_timeout`` and dynamic bands idle (no flows) for
        ``priority_band_gc_timeout`` (GIE's registry GC)."""
        cfg = self.config
        self._next_gc = now + cfg.flow_gc_timeout
        dropped = False
        for priority, band in list(self._bands.items()):
            for flow_id, q in list(band.flows.items()):
                if not len(q) and now - q.idle_since >= cfg.flow_gc_timeout:
                    band.drop_flow(flow_id, now)
            if (band.dynamic and not band.flows
                    and now - band.idle_since >= cfg.priority_band_gc_timeout):
                del self._bands[priority]
                dropped = True
        if dropped:
            self._priorities = sorted(self._bands, reverse=True)

    def _log_limited(self, key: str, message: str, exc_info: bool = False) -> None:
        now = self._clock()
        last = self._logged.get(key)
        if last is None or now - last >= _LOG_EVERY:
            self._logged[key] = now
            log.error("%s", message, exc_info=exc_info)

    # ------------------------------------------------------------------ inspection

    def stats(self) -> FlowControlStats:
        """The accounting now (see :class:`FlowControlStats`)."""
        return FlowControlStats(
            enqueued=self._enqueued,
            outcomes={o: self._counts[o.value] for o in FINAL_OUTCOMES},
            queued=self._totals.len,
            queued_bytes=self._totals.byte_size,
            bands={p: BandStats(p, b.len, b.byte_size, len(b.flows), b.config.max_bytes,
                                b.config.max_requests, b.dynamic)
                   for p, b in self._bands.items()},
        )

    def band(self, priority: int) -> PriorityBand | None:
        """The band of ``priority`` (None until a request of that priority came, unless
        the config names it)."""
        return self._bands.get(priority)

    @property
    def priorities(self) -> Sequence[int]:
        """The bands' priorities, highest first."""
        return tuple(self._priorities)


def _wake(waiter: asyncio.Future[str], reason: str) -> None:
    if not waiter.done():
        waiter.set_result(reason)
