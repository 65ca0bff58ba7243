"""llm-d-router v0.10.0's demand-driven in-flight eviction (``flowControl.enableEviction``).

Go source followed: pkg/epp/flowcontrol/eviction/{request_evictor.go, queue.go,
evictor.go, eviction_registry.go}, pkg/epp/flowcontrol/controller/internal/reclamation.go
(``ReclamationController``, ``maybeReclaim``), the victim policies
pkg/epp/framework/plugins/flowcontrol/eviction/{filtering/sheddable.go,
ordering/priority_time.go}, the ext_proc side of pkg/epp/handlers/server.go and
cmd/epp/runner/runner.go (``buildRequestEvictor``, ``deriveEvictionConfirmationGrace``).

Which requests: every request the EPP dispatches is tracked from PreRequest until its
stream ends (:class:`RequestEvictor`); only those the victim filter accepts — the
``sheddable-eviction-filter``: priority < 0 — can be evicted, lowest priority first and,
within a priority, the most recently dispatched first (``priority-then-time-eviction-
order-policy``: least work lost).

When: a dispatch cycle stops on head-of-line blocking (``saturation >= ceiling`` of a band)
while a blocked band with a ceiling above 0 holds queued requests whose priority is
strictly above the next victim's (:func:`maybe_reclaim`), and the pacing gate is open:
no earlier eviction is still unconfirmed (its stream has not ended; at most
``confirmation_timeout``, 10 s) or cooling (``confirmation_grace`` after it ended:
10 ms with the ``concurrency-detector``, whose counts drop when the stream ends; with a
scraped detector the refresh interval + the staleness threshold + 250 ms).

How many: ``n = max(1, ceil((saturation - ceiling - pending) / (saturation / in_flight)))``,
at most 2 per decision and at most the evictable count; victims at or above the demand
band's priority are never taken.

What the client sees: an ImmediateResponse, HTTP 429, body ``request evicted by flow
control`` (plain text), header ``x-llm-d-request-dropped-reason: evicted``; Envoy resets
the upstream request. An eviction that arrives after the response completed is ignored.
Counted: the request is not an error (no ``request_error_total``); its running count
drops and ResponseComplete plugins see it aborted; :class:`EvictionStats` counts
revocations issued, confirmed and timed out (llm-d's ``flow_control_revocations_*``),
reported to an optional :class:`EvictionMetrics`.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters
from epp.scheduling.types import LLMRequest, SchedulingResult

log = logging.getLogger(__name__)

#: llm-d's errcommon.RequestDroppedReasonHeaderKey and the reason ImmediateResponseEvictor
#: records.
HEADER_REQUEST_DROPPED_REASON: Final = "x-llm-d-request-dropped-reason"
REASON_EVICTED: Final = "evicted"
#: What the evicted request's client gets (llm-d's handlers/server.go).
EVICTED_STATUS: Final = 429
EVICTED_BODY: Final = b"request evicted by flow control"

# llm-d's controller/config.go and runner.go defaults (not config keys).
DEFAULT_MAX_REVOCATIONS_PER_DECISION: Final = 2
DEFAULT_CONFIRMATION_GRACE: Final = 0.5
DEFAULT_CONFIRMATION_TIMEOUT: Final = 10.0
ENGINE_RECLAIM_BUDGET: Final = 0.25
LEADING_SENSOR_GRACE: Final = 0.010
CONCURRENCY_DETECTOR: Final = "concurrency-detector"

Clock = Callable[[], float]


def confirmation_grace(detector_type: str | None, refresh_interval_s: float,
                       staleness_threshold_s: float) -> float:
    """llm-d's ``deriveEvictionConfirmationGrace``: 10 ms for the concurrency detector
    (its gauge drops when the stream ends); otherwise the scrape interval + the staleness
    threshold + 250 ms of engine reclaim time."""
    if detector_type == CONCURRENCY_DETECTOR:
        return LEADING_SENSOR_GRACE
    return refresh_interval_s + staleness_threshold_s + ENGINE_RECLAIM_BUDGET


# ------------------------------------------------------------------ items and policies


class EvictionSignal:
    """One tracked request's eviction channel (llm-d's ``EvictCh``): fired at most once;
    subscribers (the request's ext_proc stream) are called with the reason."""

    __slots__ = ("_subscribers", "reason")

    def __init__(self) -> None:
        self.reason: str | None = None
        self._subscribers: list[Callable[[str], None]] = []

    @property
    def fired(self) -> bool:
        return self.reason is not None

    def subscribe(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` when fired (at once if fired already)."""
        if self.reason is not None:
            callback(self.reason)
        else:
            self._subscribers.append(callback)

    def fire(self, reason: str = REASON_EVICTED) -> bool:
        """Fire once; False if it had fired already."""
        if self.reason is not None:
            return False
        self.reason = reason
        subscribers, self._subscribers = self._subscribers, []
        for callback in subscribers:
            try:
                callback(reason)
            except Exception:
                log.exception("eviction subscriber failed")
        return True


@dataclass(eq=False)
class EvictionItem:
    """A dispatched request (llm-d's ``EvictionItem``). ``dispatch_time``: the clock's
    seconds at PreRequest; ``target``: the endpoint's ``ip:port``."""

    request_id: str
    priority: int
    dispatch_time: float
    target: str = ""
    request: LLMRequest | None = None
    signal: EvictionSignal = field(default_factory=EvictionSignal)


class SheddableEvictionFilter:
    """``sheddable-eviction-filter`` (llm-d eviction/filtering): only sheddable requests,
    priority < 0, may be evicted."""

    type_name = "sheddable-eviction-filter"
    Parameters = NoParameters

    def __init__(self, name: str = type_name) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> SheddableEvictionFilter:
        return cls(name)

    def accept(self, item: EvictionItem) -> bool:
        return item.priority < 0


class PriorityThenTimeEvictionOrdering:
    """``priority-then-time-eviction-order-policy`` (llm-d eviction/ordering): the lowest
    priority first; within a priority the most recently dispatched first."""

    type_name = "priority-then-time-eviction-order-policy"
    Parameters = NoParameters

    def __init__(self, name: str = type_name) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> PriorityThenTimeEvictionOrdering:
        return cls(name)

    def less(self, a: EvictionItem, b: EvictionItem) -> bool:
        """True when ``a`` is evicted before ``b``."""
        if a.priority != b.priority:
            return a.priority < b.priority
        return a.dispatch_time > b.dispatch_time


class EvictionFilterPolicy(Protocol):
    name: str

    def accept(self, item: EvictionItem) -> bool: ...


class EvictionOrderingPolicy(Protocol):
    name: str

    def less(self, a: EvictionItem, b: EvictionItem) -> bool: ...


# ------------------------------------------------------------------------ the queue


class _Entry:
    __slots__ = ("item", "less", "removed")

    def __init__(self, item: EvictionItem, less: Callable[[EvictionItem, EvictionItem], bool]):
        self.item = item
        self.less = less
        self.removed = False

    def __lt__(self, other: _Entry) -> bool:
        return self.less(self.item, other.item)


class EvictionQueue:
    """Every in-flight request, and a heap of the evictable ones in victim order (llm-d's
    ``EvictionQueue``; removal is lazy)."""

    def __init__(self, ordering: EvictionOrderingPolicy, filter_: EvictionFilterPolicy) -> None:
        self._less = ordering.less
        self._filter = filter_
        self._heap: list[_Entry] = []
        self._handles: dict[str, _Entry] = {}
        self._in_flight: dict[str, EvictionItem] = {}

    def track(self, item: EvictionItem) -> None:
        old = self._handles.pop(item.request_id, None)
        if old is not None:
            old.removed = True
        self._in_flight[item.request_id] = item
        if self._filter.accept(item):
            entry = _Entry(item, self._less)
            heapq.heappush(self._heap, entry)
            self._handles[item.request_id] = entry

    def untrack(self, request_id: str) -> None:
        entry = self._handles.pop(request_id, None)
        if entry is not None:
            entry.removed = True
        self._in_flight.pop(request_id, None)

    def _prune(self) -> None:
        heap = self._heap
        while heap and heap[0].removed:
            heapq.heappop(heap)

    def pop(self) -> EvictionItem | None:
        self._prune()
        if not self._heap:
            return None
        entry = heapq.heappop(self._heap)
        del self._handles[entry.item.request_id]
        self._in_flight.pop(entry.item.request_id, None)
        return entry.item

    def peek(self) -> EvictionItem | None:
        self._prune()
        return self._heap[0].item if self._heap else None

    def evictable(self, request_id: str) -> bool:
        return request_id in self._handles

    @property
    def evictable_len(self) -> int:
        return len(self._handles)

    @property
    def in_flight_len(self) -> int:
        return len(self._in_flight)


# --------------------------------------------------------------------- the evictor


class RequestEvictor:
    """Tracks dispatched requests and evicts them on demand (llm-d's ``RequestEvictor``
    with the ``ImmediateResponseEvictor``). A PreRequest plugin (tracks the request) and
    a ResponseComplete plugin (its stream ended: untracked; if it had been evicted, the
    termination listener — the reclamation controller's ``confirm`` — is told)."""

    type_name = "request-evictor"  # internal: never in a config
    name = "request-evictor"

    def __init__(self, ordering: EvictionOrderingPolicy | None = None,
                 filter_: EvictionFilterPolicy | None = None,
                 clock: Clock = time.monotonic) -> None:
        self.ordering = ordering or PriorityThenTimeEvictionOrdering()
        self.filter = filter_ or SheddableEvictionFilter()
        self.queue = EvictionQueue(self.ordering, self.filter)
        self.clock = clock
        self._signals: dict[str, EvictionSignal] = {}
        self._pending: set[str] = set()
        self.termination_listener: Callable[[str], None] | None = None

    # --- request lifecycle (PreRequest, ResponseComplete) ---

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        if not request.request_id:
            return
        primary = result.profile_results.get(result.primary_profile)
        if primary is None or not primary.endpoints:
            return
        item = EvictionItem(request.request_id, request.priority, self.clock(),
                            primary.endpoints[0].key, request)
        self.queue.track(item)
        self._signals[item.request_id] = item.signal

    def response_complete(self, request: LLMRequest, endpoint_key: str,
                          aborted: bool) -> None:
        self.cleanup(request.request_id)

    def cleanup(self, request_id: str) -> None:
        """The request's stream ended (llm-d's ``cleanupRequest``)."""
        self.queue.untrack(request_id)
        self._signals.pop(request_id, None)
        if request_id in self._pending:
            self._pending.discard(request_id)
            listener = self.termination_listener
            if listener is not None:
                listener(request_id)

    # --- the lookup the ext_proc streams use ---

    def signal(self, request_id: str) -> EvictionSignal | None:
        """The eviction signal of a tracked request that may be evicted (None otherwise:
        its stream need not listen)."""
        if not self.queue.evictable(request_id):
            return None
        return self._signals.get(request_id)

    # --- what the reclamation controller uses ---

    def peek_victim_priority(self) -> int | None:
        item = self.queue.peek()
        return None if item is None else item.priority

    def stats(self) -> tuple[int, int]:
        """(in flight, evictable)."""
        return self.queue.in_flight_len, self.queue.evictable_len

    def evict_n(self, n: int, priority_bound: int) -> list[str]:
        """Evict up to ``n`` victims in order, stopping at the first whose priority is not
        strictly below ``priority_bound``; the IDs evicted."""
        evicted: list[str] = []
        for _ in range(n):
            item = self.queue.pop()
            if item is None:
                break
            if item.priority >= priority_bound:
                self.queue.track(item)
                break
            self._pending.add(item.request_id)
            item.signal.fire(REASON_EVICTED)
            log.info("eviction signal sent", extra={"request_id": item.request_id,
                                                    "priority": item.priority,
                                                    "target": item.target})
            evicted.append(item.request_id)
        return evicted


# ------------------------------------------------------------------ reclamation


class EvictionMetrics(Protocol):
    """Where the reclamation controller reports (llm-d's ``RecordFlowControl*``)."""

    def revocations_issued(self, priority: int, n: int) -> None: ...

    def revocation_outcome(self, outcome: str, n: int) -> None: ...

    def reclaim_target(self, value: float) -> None: ...

    def pending_reclaim(self, value: float) -> None: ...

    def confirmation_seconds(self, seconds: float) -> None: ...


OUTCOME_CONFIRMED: Final = "confirmed"
OUTCOME_TIMED_OUT: Final = "timed_out"


@dataclass
class EvictionStats:
    """What the reclamation controller did: revocations issued (per demand priority),
    confirmed, timed out; the last reclaim target; the pending-reclaim debit."""

    issued: dict[int, int] = field(default_factory=dict)
    confirmed: int = 0
    timed_out: int = 0
    decisions: int = 0
    reclaim_target: float = 0.0
    pending_reclaim: float = 0.0

    @property
    def issued_total(self) -> int:
        return sum(self.issued.values())


class ReclamationController:
    """When eviction fires and how many requests it revokes (llm-d's
    ``ReclamationController``): sizing by the saturation deficit over a mean-footprint
    credit, stop-and-wait pacing on confirmations (module docstring)."""

    def __init__(self, evictor: RequestEvictor, *,
                 max_revocations_per_decision: int = DEFAULT_MAX_REVOCATIONS_PER_DECISION,
                 confirmation_grace: float = DEFAULT_CONFIRMATION_GRACE,
                 confirmation_timeout: float = DEFAULT_CONFIRMATION_TIMEOUT,
                 clock: Clock = time.monotonic,
                 metrics: EvictionMetrics | None = None) -> None:
        if max_revocations_per_decision < 1:
            raise ValueError("max_revocations_per_decision must be >= 1")
        if confirmation_grace < 0:
            raise ValueError(f"confirmation_grace cannot be negative, got {confirmation_grace}")
        if not confirmation_timeout > 0:
            raise ValueError(f"confirmation_timeout must be positive, got "
                             f"{confirmation_timeout}")
        self.evictor = evictor
        self.max_revocations = max_revocations_per_decision
        self.grace = confirmation_grace
        self.timeout = confirmation_timeout
        self.clock = clock
        self.metrics = metrics
        self.stats = EvictionStats()
        self._outstanding: dict[str, tuple[float, float]] = {}  # id → (credit, issued at)
        self._cooling: list[tuple[float, float]] = []  # (credit, expires at)
        self._pending = 0.0
        evictor.termination_listener = self.confirm

    def gate_open(self, now: float) -> bool:
        """No revocation outstanding or cooling (after retiring timed-out ones and
        expired debits)."""
        self._sweep_timeouts(now)
        self._expire_cooling(now)
        return not self._outstanding and not self._cooling

    def victim_priority(self) -> int | None:
        return self.evictor.peek_victim_priority()

    def reclaim(self, saturation: float, ceiling: float, demand_priority: int) -> list[str]:
        """One sizing decision; the request IDs evicted."""
        in_flight, evictable = self.evictor.stats()
        if in_flight <= 0 or evictable <= 0:
            return []
        credit = saturation / in_flight
        if credit <= 0 or math.isnan(credit) or math.isinf(credit):
            return []
        target = saturation - ceiling
        net = target - self._pending
        self.stats.reclaim_target = target
        if self.metrics is not None:
            self.metrics.reclaim_target(target)
        if net < 0 or (net == 0 and self._pending > 0):
            return []
        n = min(max(1, math.ceil(net / credit)), self.max_revocations, evictable)
        evicted = self.evictor.evict_n(n, demand_priority)
        now = self.clock()
        for request_id in evicted:
            self._outstanding[request_id] = (credit, now)
            self._pending += credit
        self.stats.decisions += 1
        self.stats.issued[demand_priority] = (self.stats.issued.get(demand_priority, 0)
                                              + len(evicted))
        self.stats.pending_reclaim = self._pending
        if self.metrics is not None:
            self.metrics.revocations_issued(demand_priority, len(evicted))
            self.metrics.pending_reclaim(self._pending)
        log.debug("revocations issued: saturation %.3f, ceiling %.3f, target %.3f, credit "
                  "%.3f, requested %d, issued %d", saturation, ceiling, target, credit, n,
                  len(evicted))
        return evicted

    def confirm(self, request_id: str) -> None:
        """An evicted request's stream ended."""
        entry = self._outstanding.pop(request_id, None)
        if entry is None:
            return
        credit, issued_at = entry
        now = self.clock()
        self._cooling.append((credit, now + self.grace))
        self.stats.confirmed += 1
        if self.metrics is not None:
            self.metrics.revocation_outcome(OUTCOME_CONFIRMED, 1)
            self.metrics.confirmation_seconds(now - issued_at)

    def _sweep_timeouts(self, now: float) -> None:
        for request_id, (credit, issued_at) in list(self._outstanding.items()):
            if now - issued_at < self.timeout:
                continue
            del self._outstanding[request_id]
            self._cooling.append((credit, now + self.grace))
            self.stats.timed_out += 1
            if self.metrics is not None:
                self.metrics.revocation_outcome(OUTCOME_TIMED_OUT, 1)
            log.info("revocation confirmation timed out after %gs; treating it as confirmed",
                     self.timeout, extra={"request_id": request_id})

    def _expire_cooling(self, now: float) -> None:
        if not self._cooling:
            return
        kept = [(c, exp) for c, exp in self._cooling if now < exp]
        if len(kept) == len(self._cooling):
            return
        for c, exp in self._cooling:
            if now >= exp:
                self._pending -= c
        self._cooling = kept
        if self._pending < 0 or not (kept or self._outstanding):
            self._pending = 0.0  # (and no float residue once every debit is gone)
        self.stats.pending_reclaim = self._pending
        if self.metrics is not None:
            self.metrics.pending_reclaim(self._pending)


def maybe_reclaim(reclamation: ReclamationController, now: float, saturation: float,
                  priorities: Sequence[int], ceilings: Sequence[float], break_index: int,
                  queued: Callable[[int], int]) -> list[str]:
    """llm-d's ``maybeReclaim``, on a head-of-line break at ``priorities[break_index]``
    (highest first): reclaim for the first blocked band, from there down, whose priority
    is strictly above the next victim's, whose ceiling is above 0, and that has queued
    requests (``queued(priority)``)."""
    if not reclamation.gate_open(now):
        return []
    victim = reclamation.victim_priority()
    if victim is None:
        return []
    for j in range(break_index, len(priorities)):
        priority = priorities[j]
        if priority <= victim:
            return []
        ceiling = ceilings[j]
        if ceiling <= 0 or saturation < ceiling:
            continue
        if not queued(priority):
            continue
        return reclamation.reclaim(saturation, ceiling, priority)
    return []


#: The eviction policy plugins, for the built-in catalog (llm-d registers both types).
EVICTION_PLUGINS: tuple[type[Any], ...] = (
    SheddableEvictionFilter,
    PriorityThenTimeEvictionOrdering,
)


def enable_eviction(controller: Any, detector_type: str | None, refresh_interval_s: float,
                    staleness_threshold_s: float, workers: int = 1,
                    metrics: EvictionMetrics | None = None) -> RequestEvictor | None:
    """Wire in-flight eviction into a :class:`~epp.flowcontrol.FlowController` (llm-d's
    ``buildRequestEvictor`` + the reclamation controller): the returned evictor is to be
    added to the core's PreRequest and ResponseComplete plugins and handed to the
    ext_proc servicer. None (with a warning) under ``--workers N`` > 1, where the stream
    of a request lives in another process than the flow controller."""
    if workers != 1:
        log.warning("flowControl.enableEviction is ignored with --workers %d: evicting a "
                    "request needs its ext_proc stream in the flow controller's process "
                    "(use --workers 1)", workers)
        return None
    evictor = RequestEvictor(clock=controller.clock_fn)
    grace = confirmation_grace(detector_type, refresh_interval_s, staleness_threshold_s)
    controller.reclamation = ReclamationController(evictor, confirmation_grace=grace,
                                                   clock=controller.clock_fn,
                                                   metrics=metrics)
    log.info("in-flight eviction enabled (filter %s, ordering %s, confirmation grace %gs)",
             evictor.filter.name, evictor.ordering.name, grace)
    return evictor
