"""The flow-control policy plugins GIE v1.5.0 registers (cmd/epp/runner/runner.go,
registerInTreePlugins; pkg/epp/framework/plugins/flowcontrol/{fairness,ordering,usagelimits}).

==================================  ==========  ==============================================
type                                parameters  behaviour
==================================  ==========  ==============================================
``global-strict-fairness-policy``   none        the flow whose head request its ordering
                                                policy ranks first: the band behaves as one
                                                queue (default fairness policy)
``round-robin-fairness-policy``     none        the next non-empty flow after the one served
                                                last, flows sorted by ID
``fcfs-ordering-policy``            none        earliest enqueue first; FIFO queue (default)
``edf-ordering-policy``             none        earliest deadline (enqueue + TTL) first; no
                                                TTL sorts last; ties FCFS; heap queue
``slo-deadline-ordering-policy``    none        earliest received + ``x-slo-ttft-ms`` first;
                                                no/invalid header sorts last; ties by
                                                received time; heap queue
``static-usage-limit-policy``       threshold   the same ceiling (``threshold``, 1.0) for
                                                every band (default usage limit policy)
==================================  ==========  ==============================================
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epp import keys
from epp.flowcontrol.interfaces import (
    CAPABILITY_PRIORITY_CONFIGURABLE,
    FlowQueueView,
    PriorityBandView,
    QueueItemView,
)
from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters, param

_INF = math.inf

# --------------------------------------------------------------------------- fairness


class GlobalStrictFairnessPolicy:
    """``global-strict-fairness-policy``: serve the best head across every flow of the
    band, by the flows' ordering policy — fairness ignored, one logical queue."""

    type_name = "global-strict-fairness-policy"
    Parameters = NoParameters

    def __init__(self, name: str = type_name) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> GlobalStrictFairnessPolicy:
        return cls(name)

    def new_state(self) -> None:
        return None

    def pick(self, band: PriorityBandView) -> FlowQueueView | None:
        ids = band.active_ids()
        if len(ids) == 1:  # the common case under light load: nothing to compare
            return band.queue(ids[0])
        best: FlowQueueView | None = None
        best_item: QueueItemView | None = None
        for queue in band.active_queues():
            item = queue.peek_head()
            if item is None:
                continue
            if best_item is None or queue.ordering_policy.less(item, best_item):
                best, best_item = queue, item
        return best


class _Cursor:
    """round-robin's per-band state: the flow served last."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: str | None = None


class RoundRobinFairnessPolicy:
    """``round-robin-fairness-policy``: the next flow after the one served last (flows
    sorted by ID, wrapping), skipping empty ones."""

    type_name = "round-robin-fairness-policy"
    Parameters = NoParameters

    def __init__(self, name: str = type_name) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> RoundRobinFairnessPolicy:
        return cls(name)

    def new_state(self) -> _Cursor:
        return _Cursor()

    def pick(self, band: PriorityBandView) -> FlowQueueView | None:
        cursor = band.policy_state
        if not isinstance(cursor, _Cursor):
            raise TypeError(f"{self.name}: band state is {type(cursor).__name__}, "
                            "not this policy's cursor")
        ids = band.active_ids()
        if not ids:
            cursor.last = None
            return None
        # The first non-empty flow after the last one served: the active IDs are sorted,
        # so that is the first one greater than it, wrapping to the start.
        start = 0
        if cursor.last is not None:
            start = _bisect_right(ids, cursor.last)
            if start == len(ids):
                start = 0
        n = len(ids)
        for i in range(n):
            flow_id = ids[(start + i) % n]
            queue = band.queue(flow_id)
            if queue is not None and len(queue):
                cursor.last = flow_id
                return queue
        cursor.last = None
        return None


def _bisect_right(ids: Sequence[str], x: str) -> int:
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if x < ids[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


# --------------------------------------------------------------------------- ordering


class FCFSOrderingPolicy:
    """``fcfs-ordering-policy``: earliest enqueue first. Needs no capability, so its
    flows use a FIFO list: arrival order on the one event loop is enqueue order."""

    type_name = "fcfs-ordering-policy"
    Parameters = NoParameters
    required_queue_capabilities: frozenset[str] = frozenset()

    def __init__(self, name: str = type_name) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> FCFSOrderingPolicy:
        return cls(name)

    def less(self, a: QueueItemView, b: QueueItemView) -> bool:
        return a.enqueue_time < b.enqueue_time

    def sort_key(self, item: QueueItemView) -> Any:
        return item.enqueue_time


def edf_deadline(item: QueueItemView) -> float:
    """EDF's deadline: enqueue time + effective TTL; infinity without a TTL."""
    ttl = item.effective_ttl
    return item.enqueue_time + ttl if ttl > 0 else _INF


class EDFOrderingPolicy:
    """``edf-ordering-policy``: earliest deadline (enqueue time + TTL) first; a request
    without TTL sorts after every time-bound one; ties first-come first-served."""

    type_name = "edf-ordering-policy"
    Parameters = NoParameters
    required_queue_capabilities: frozenset[str] = frozenset({CAPABILITY_PRIORITY_CONFIGURABLE})

    def __init__(self, name: str = type_name) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> EDFOrderingPolicy:
        return cls(name)

    def less(self, a: QueueItemView, b: QueueItemView) -> bool:
        da, db = edf_deadline(a), edf_deadline(b)
        if da != db:
            return da < db
        return a.enqueue_time < b.enqueue_time

    def sort_key(self, item: QueueItemView) -> Any:
        return (edf_deadline(item), item.enqueue_time)


def received_time(item: QueueItemView) -> float:
    """When the EPP received the request (its enqueue time when the caller gave none)."""
    at = item.request.received_at
    return item.enqueue_time if at is None else at


def slo_deadline(item: QueueItemView) -> float:
    """Received time + ``x-slo-ttft-ms`` milliseconds; infinity when the header is
    missing, empty, not an integer or negative (GIE's ``calculateSLODeadline``)."""
    raw = keys.request_header(item.request.headers, keys.HEADER_SLO_TTFT_MS)
    if not raw:
        return _INF
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not digits.isascii() or not digits.isdigit():
        return _INF  # Go's strconv.ParseInt: optional sign, decimal digits only
    ms = int(text)
    if ms < 0 or ms >= 1 << 63:
        return _INF
    return received_time(item) + ms / 1000.0


class SLODeadlineOrderingPolicy:
    """``slo-deadline-ordering-policy``: earliest received time + ``x-slo-ttft-ms`` first;
    requests without a valid header after every SLO-bound one; ties by received time."""

    type_name = "slo-deadline-ordering-policy"
    Parameters = NoParameters
    required_queue_capabilities: frozenset[str] = frozenset({CAPABILITY_PRIORITY_CONFIGURABLE})

    def __init__(self, name: str = type_name) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> SLODeadlineOrderingPolicy:
        return cls(name)

    def less(self, a: QueueItemView, b: QueueItemView) -> bool:
        da, db = slo_deadline(a), slo_deadline(b)
        if da != db:
            return da < db
        return received_time(a) < received_time(b)

    def sort_key(self, item: QueueItemView) -> Any:
        return (slo_deadline(item), received_time(item))


# -------------------------------------------------------------------------- usage limit


@dataclass(frozen=True)
class StaticUsageLimitParameters:
    threshold: float = param("threshold", 1.0, minimum=0.0)


class StaticUsageLimitPolicy:
    """``static-usage-limit-policy``: every band's ceiling is ``threshold`` (1.0: dispatch
    until the pool is saturated; 0.8 keeps 20 % headroom; 0 holds everything)."""

    type_name = "static-usage-limit-policy"
    Parameters = StaticUsageLimitParameters

    def __init__(self, name: str = type_name, threshold: float = 1.0) -> None:
        self.name = name
        self.threshold = threshold

    @classmethod
    def from_params(cls, name: str, params: StaticUsageLimitParameters,
                    handle: PluginHandle) -> StaticUsageLimitPolicy:
        return cls(name, params.threshold)

    def compute_limit(self, saturation: float, priorities: Sequence[int]) -> Sequence[float]:
        return [self.threshold] * len(priorities)


#: Every flow-control plugin class, for the built-in catalog.
FLOW_CONTROL_PLUGINS: tuple[type, ...] = (
    GlobalStrictFairnessPolicy,
    RoundRobinFairnessPolicy,
    FCFSOrderingPolicy,
    EDFOrderingPolicy,
    SLODeadlineOrderingPolicy,
    StaticUsageLimitPolicy,
)
