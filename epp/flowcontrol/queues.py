"""The queued requests and the per-flow queues they wait in.

GIE v1.5.0: controller/internal/item.go (``FlowItem``), registry/managedqueue.go and
framework/plugins/queue (``ListQueue``, ``MaxMinHeap``). Everything here runs on the one
event loop, so there are no locks; every change of a queue's length or bytes goes
through the owning :class:`FlowQueue` (which reports it to its band and the controller's
totals through the callbacks it was built with).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from epp.flowcontrol.interfaces import QUEUE_HEAP, QUEUE_LIST, OrderingPolicy
from epp.flowcontrol.types import FlowControlRequest, FlowKey, QueueOutcome

if TYPE_CHECKING:
    import asyncio

    from epp.flowcontrol.types import FlowControlResult


class QueueItem:
    """One request inside the controller (GIE's ``FlowItem``); a
    :class:`~epp.flowcontrol.interfaces.QueueItemView` for the policies."""

    __slots__ = (
        "counted",
        "effective_ttl",
        "enqueue_time",
        "future",
        "metric_labels",
        "outcome",
        "queue",
        "request",
        "result",
        "seq",
        "sort_key",
        "timer",
    )

    def __init__(self, request: FlowControlRequest, enqueue_time: float, effective_ttl: float,
                 seq: int) -> None:
        self.request = request
        self.enqueue_time = enqueue_time
        self.effective_ttl = effective_ttl
        self.seq = seq
        self.sort_key: Any = None
        self.queue: FlowQueue | None = None  # set while the item is queued
        self.outcome: QueueOutcome | None = None  # set once, when finalized
        self.result: FlowControlResult | None = None  # likewise
        self.future: asyncio.Future[FlowControlResult] | None = None  # while awaited
        self.timer: asyncio.TimerHandle | None = None  # its TTL
        self.metric_labels: Any = None  # the metrics' cached children for its flow
        self.counted = False  # in the queue size / bytes gauges


class FlowQueue:
    """One flow's queue (GIE's ``ManagedQueue`` over a ``SafeQueue``); a
    :class:`~epp.flowcontrol.interfaces.FlowQueueView` for the policies.

    ``on_change(queue, delta_len, delta_bytes)`` is called after every add and remove.
    """

    __slots__ = ("_len", "_on_change", "byte_size", "idle_since", "key", "ordering_policy")

    kind = ""

    def __init__(self, key: FlowKey, ordering: OrderingPolicy,
                 on_change: Callable[[FlowQueue, int, int], None], now: float) -> None:
        self.key = key
        self.ordering_policy = ordering
        self.byte_size = 0
        self._len = 0
        self.idle_since = now  # when it last became empty (flow GC)
        self._on_change = on_change

    def __len__(self) -> int:
        return self._len

    def add(self, item: QueueItem) -> None:
        item.queue = self
        self._push(item)
        self._len += 1
        size = item.request.byte_size
        self.byte_size += size
        self._on_change(self, 1, size)

    def remove(self, item: QueueItem) -> bool:
        """Take ``item`` out of this queue; False when it is not in it."""
        if item.queue is not self:
            return False
        self._discard(item)
        item.queue = None
        self._len -= 1
        size = item.request.byte_size
        self.byte_size -= size
        self._on_change(self, -1, -size)
        return True

    def drain(self) -> list[QueueItem]:
        """Remove and return every item, head first."""
        out = []
        while (item := self.peek_head()) is not None:
            self.remove(item)
            out.append(item)
        return out

    # --- the discipline ---

    def _push(self, item: QueueItem) -> None:
        raise NotImplementedError

    def _discard(self, item: QueueItem) -> None:
        raise NotImplementedError

    def peek_head(self) -> QueueItem | None:
        raise NotImplementedError

    def items(self) -> Iterator[QueueItem]:
        """The queued items (in no promised order)."""
        raise NotImplementedError


class ListQueue(FlowQueue):
    """FIFO (GIE's ``ListQueue``): O(1) add, remove and peek, head = first added."""

    __slots__ = ("_items",)
    kind = QUEUE_LIST

    def __init__(self, key: FlowKey, ordering: OrderingPolicy,
                 on_change: Callable[[FlowQueue, int, int], None], now: float) -> None:
        super().__init__(key, ordering, on_change, now)
        self._items: OrderedDict[QueueItem, None] = OrderedDict()

    def _push(self, item: QueueItem) -> None:
        self._items[item] = None

    def _discard(self, item: QueueItem) -> None:
        del self._items[item]

    def peek_head(self) -> QueueItem | None:
        for item in self._items:
            return item
        return None

    def items(self) -> Iterator[QueueItem]:
        return iter(list(self._items))


class HeapQueue(FlowQueue):
    """Ordered by the ordering policy's ``sort_key`` (GIE's ``MaxMinHeap`` for EDF and
    SLO-deadline ordering): O(log n) add, O(1) peek. A removed item is dropped lazily
    when it reaches the top; the heap is rebuilt when dropped entries outnumber live
    ones, so memory stays bounded by twice the queue's length."""

    __slots__ = ("_dead", "_heap")
    kind = QUEUE_HEAP

    def __init__(self, key: FlowKey, ordering: OrderingPolicy,
                 on_change: Callable[[FlowQueue, int, int], None], now: float) -> None:
        super().__init__(key, ordering, on_change, now)
        self._heap: list[tuple[Any, int, QueueItem]] = []
        self._dead = 0

    def _push(self, item: QueueItem) -> None:
        if item.sort_key is None:
            item.sort_key = self.ordering_policy.sort_key(item)
        heapq.heappush(self._heap, (item.sort_key, item.seq, item))

    def _discard(self, item: QueueItem) -> None:
        heap = self._heap
        if heap and heap[0][2] is item:
            heapq.heappop(heap)
            self._prune()
            return
        self._dead += 1
        if self._dead > 32 and self._dead > len(heap) // 2:
            self._heap = [e for e in heap if e[2].queue is self and e[2] is not item]
            heapq.heapify(self._heap)
            self._dead = 0

    def _prune(self) -> None:
        heap = self._heap
        while heap and heap[0][2].queue is not self:
            heapq.heappop(heap)
            self._dead -= 1

    def peek_head(self) -> QueueItem | None:
        heap = self._heap
        if not heap:
            return None
        return heap[0][2]

    def items(self) -> Iterator[QueueItem]:
        return iter([e[2] for e in self._heap if e[2].queue is self])


def new_queue(kind: str, key: FlowKey, ordering: OrderingPolicy,
              on_change: Callable[[FlowQueue, int, int], None], now: float) -> FlowQueue:
    """A queue of the ``kind`` a band's config names."""
    if kind == QUEUE_HEAP:
        return HeapQueue(key, ordering, on_change, now)
    return ListQueue(key, ordering, on_change, now)


def sorted_insert(ids: list[str], flow_id: str) -> None:
    """Insert into a sorted list (no duplicate)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if ids[mid] < flow_id:
            lo = mid + 1
        else:
            hi = mid
    if lo == len(ids) or ids[lo] != flow_id:
        ids.insert(lo, flow_id)


def sorted_remove(ids: list[str], flow_id: str) -> None:
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if ids[mid] < flow_id:
            lo = mid + 1
        else:
            hi = mid
    if lo < len(ids) and ids[lo] == flow_id:
        del ids[lo]


def is_sorted(ids: Sequence[str]) -> bool:
    return all(ids[i] < ids[i + 1] for i in range(len(ids) - 1))
