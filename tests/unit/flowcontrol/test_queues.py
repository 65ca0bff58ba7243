"""The per-flow queues (GIE's ListQueue and MaxMinHeap, framework/plugins/queue
functional_test.go): head order, removal from anywhere, length and byte accounting."""

from __future__ import annotations

import random

import pytest

from epp.flowcontrol.interfaces import QUEUE_HEAP, QUEUE_LIST
from epp.flowcontrol.plugins import EDFOrderingPolicy, FCFSOrderingPolicy
from epp.flowcontrol.queues import (
    FlowQueue,
    QueueItem,
    is_sorted,
    new_queue,
    sorted_insert,
    sorted_remove,
)
from epp.flowcontrol.types import FlowControlRequest, FlowKey


def item(seq: int, ttl: float = 0.0, size: int = 1, at: float | None = None) -> QueueItem:
    return QueueItem(FlowControlRequest(byte_size=size), float(seq) if at is None else at,
                     ttl, seq)


class Changes:
    def __init__(self) -> None:
        self.len = 0
        self.bytes = 0

    def __call__(self, q: FlowQueue, delta: int, size: int) -> None:
        self.len += delta
        self.bytes += size


@pytest.mark.parametrize("kind", [QUEUE_LIST, QUEUE_HEAP])
def test_randomized_against_a_reference(kind: str) -> None:
    """Adds, removals of random items and head removals: the head is always the reference
    order's first; lengths and bytes add up, here and in what the band is told."""
    rng = random.Random(7)
    ordering = EDFOrderingPolicy() if kind == QUEUE_HEAP else FCFSOrderingPolicy()
    changes = Changes()
    q = new_queue(kind, FlowKey("f", 0), ordering, changes, 0.0)
    assert q.kind == kind
    live: list[QueueItem] = []
    for seq in range(5000):
        roll = rng.random()
        if roll < 0.55 or not live:
            it = item(seq, ttl=rng.choice((0.0, rng.uniform(1, 500))), size=rng.randrange(100))
            q.add(it)
            live.append(it)
        elif roll < 0.8:
            victim = live.pop(rng.randrange(len(live)))
            assert q.remove(victim) and not q.remove(victim)
        else:
            head = q.peek_head()
            assert head is not None
            assert q.remove(head)
            live.remove(head)
        expected = min(live, key=ordering.sort_key) if live else None
        if kind == QUEUE_LIST:
            expected = live[0] if live else None  # FIFO: first added
        assert q.peek_head() is expected
        assert len(q) == len(live) == changes.len
        assert q.byte_size == sum(i.request.byte_size for i in live) == changes.bytes
    assert sorted(id(i) for i in q.items()) == sorted(id(i) for i in live)
    drained = q.drain()
    assert len(drained) == len(live) and len(q) == 0 and q.byte_size == 0
    assert q.peek_head() is None


def test_heap_memory_is_bounded_by_rebuilds() -> None:
    """Removals from the middle leave entries behind until the heap is rebuilt."""
    q = new_queue(QUEUE_HEAP, FlowKey("f", 0), EDFOrderingPolicy(), Changes(), 0.0)
    items = [item(i, ttl=1000 - i) for i in range(1000)]
    for it in items:
        q.add(it)
    for it in items[1:]:  # every one but the head (the last has the earliest deadline)
        if it is not q.peek_head():
            q.remove(it)
    assert len(q) == 1
    assert len(q._heap) <= 2 * 33 + 2  # type: ignore[attr-defined]  # internal: bounded


def test_remove_from_another_queue_is_refused() -> None:
    a = new_queue(QUEUE_LIST, FlowKey("a", 0), FCFSOrderingPolicy(), Changes(), 0.0)
    b = new_queue(QUEUE_LIST, FlowKey("b", 0), FCFSOrderingPolicy(), Changes(), 0.0)
    it = item(1)
    a.add(it)
    assert not b.remove(it)
    assert a.remove(it) and it.queue is None


def test_sorted_id_lists() -> None:
    rng = random.Random(1)
    ids: list[str] = []
    ref: set[str] = set()
    for _ in range(2000):
        x = f"t{rng.randrange(60)}"
        if rng.random() < 0.6:
            sorted_insert(ids, x)
            ref.add(x)
        else:
            sorted_remove(ids, x)
            ref.discard(x)
        assert ids == sorted(ref) and is_sorted(ids)
