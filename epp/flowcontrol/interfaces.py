"""Flow-control extension points (GIE v1.5.0 pkg/epp/framework/interface/flowcontrol).

Three kinds of plugin, each a small Protocol found with ``isinstance``:

- :class:`FairnessPolicy` — which flow of a priority band is served next
  (``global-strict-fairness-policy``, ``round-robin-fairness-policy``).
- :class:`OrderingPolicy` — which request of a flow's queue is served next
  (``fcfs-ordering-policy``, ``edf-ordering-policy``, ``slo-deadline-ordering-policy``).
- :class:`UsageLimitPolicy` — the saturation ceiling per priority band
  (``static-usage-limit-policy``).

Policies are singletons shared by every band that names them; a fairness policy keeps
its per-band state in the object its :meth:`FairnessPolicy.new_state` returns, which the
band hands back as :attr:`PriorityBandView.policy_state` (GIE's flyweight). They run on
the event loop inside the dispatch cycle: plain synchronous code, no I/O.

The views (:class:`QueueItemView`, :class:`FlowQueueView`, :class:`PriorityBandView`) are
what the controller shows a policy; a policy must not change them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Final, Protocol, runtime_checkable

from epp.flowcontrol.types import FlowControlRequest, FlowKey
from epp.framework.interfaces import Plugin

# Queue capabilities (GIE's QueueCapability): what an ordering policy needs of the queue.
CAPABILITY_FIFO: Final = "FIFO"
CAPABILITY_PRIORITY_CONFIGURABLE: Final = "PriorityConfigurable"

# The queue implementations: a FIFO list (O(1)) unless the ordering policy needs a
# priority-configurable queue (a heap, O(log n)) — GIE's ListQueue / MaxMinHeap choice.
QUEUE_LIST: Final = "ListQueue"
QUEUE_HEAP: Final = "MaxMinHeap"


class QueueItemView(Protocol):
    """A queued request (GIE's ``QueueItemAccessor``). ``enqueue_time``:
    ``time.monotonic()`` when :meth:`~epp.flowcontrol.FlowController.enqueue_and_wait` was
    called; ``effective_ttl``: its time-to-live in seconds (0 = none)."""

    @property
    def request(self) -> FlowControlRequest: ...

    @property
    def enqueue_time(self) -> float: ...

    @property
    def effective_ttl(self) -> float: ...


class FlowQueueView(Protocol):
    """One flow's queue (GIE's ``FlowQueueAccessor``)."""

    @property
    def key(self) -> FlowKey: ...

    @property
    def ordering_policy(self) -> OrderingPolicy: ...

    @property
    def byte_size(self) -> int: ...

    def __len__(self) -> int: ...

    def peek_head(self) -> QueueItemView | None:
        """The item its ordering policy serves next; None when empty."""
        ...


class PriorityBandView(Protocol):
    """The flows of one priority level (GIE's ``PriorityBandAccessor``)."""

    @property
    def priority(self) -> int: ...

    @property
    def policy_state(self) -> Any:
        """What the band's fairness policy's ``new_state()`` returned for this band."""
        ...

    def flow_ids(self) -> Sequence[str]:
        """Every flow of the band, empty ones included, sorted by ID."""
        ...

    def queue(self, flow_id: str) -> FlowQueueView | None:
        """The queue of the flow ``flow_id`` in this band, or None."""
        ...

    def active_ids(self) -> Sequence[str]:
        """The IDs of the flows with queued requests, sorted (a subset of
        :meth:`flow_ids`, kept up to date as queues fill and empty)."""
        ...

    def active_queues(self) -> Iterator[FlowQueueView]:
        """The non-empty queues, in :meth:`active_ids` order."""
        ...


@runtime_checkable
class FairnessPolicy(Plugin, Protocol):
    def new_state(self) -> Any:
        """The mutable state this policy keeps for one band (None if it keeps none)."""
        ...

    def pick(self, band: PriorityBandView) -> FlowQueueView | None:
        """The flow to serve next in ``band``; None when no flow has a request. Raising
        skips the band for this dispatch cycle (it is logged)."""
        ...


@runtime_checkable
class OrderingPolicy(Plugin, Protocol):
    #: The queue capabilities it needs: {CAPABILITY_PRIORITY_CONFIGURABLE} makes its
    #: flows use a heap ordered by :meth:`sort_key`; none (FCFS) a FIFO list.
    required_queue_capabilities: frozenset[str]

    def less(self, a: QueueItemView, b: QueueItemView) -> bool:
        """True when ``a`` is served before ``b`` (GIE's ``Less``)."""
        ...

    def sort_key(self, item: QueueItemView) -> Any:
        """A key whose ``<`` agrees with :meth:`less`; computed once when the item is
        queued, so it may only depend on what does not change while it waits."""
        ...


@runtime_checkable
class UsageLimitPolicy(Plugin, Protocol):
    def compute_limit(self, saturation: float, priorities: Sequence[int]) -> Sequence[float]:
        """One saturation ceiling per priority (highest first, aligned with
        ``priorities``): a band is held while ``saturation >= ceiling``; 1.0 = no gating
        before full saturation, 0.0 = always held."""
        ...
