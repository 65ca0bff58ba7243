"""The vocabulary of flow control: flow keys, the request the controller queues, outcomes.

Follows GIE v1.5.0's pkg/epp/flowcontrol/types (outcomes.go, errors.go) and the
request adapter of pkg/epp/requestcontrol/admission.go:

- A **flow** is one fairness ID at one priority (:class:`FlowKey`); each has its own queue.
  The fairness ID comes from the ``x-gateway-inference-fairness-id`` header
  (``default-flow`` when absent); the priority from the request's InferenceObjective (0
  when none). Negative priorities are *sheddable* (:func:`is_sheddable`).
- Every request handed to the controller ends in exactly one :class:`QueueOutcome`; its
  label values are Go's ``QueueOutcome.String()`` names, used as the ``outcome`` label of
  the flow-control metrics.
- :data:`OUTCOME_STATUS` maps each outcome to the HTTP status the client gets, as GIE's
  ``translateFlowControlOutcome`` maps it to an errcommon code (design.md's error table):
  capacity → 429, TTL expiry and client gone → 503, anything else → 500.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from epp import keys
from epp.errors import EppError, NoCapacity, ServiceUnavailable

DEFAULT_FAIRNESS_ID: Final = keys.DEFAULT_FAIRNESS_ID


def is_sheddable(priority: int) -> bool:
    """GIE's ``requtil.IsSheddable``: a negative priority. Without flow control the legacy
    admission drops such a request when the pool is saturated (429); under flow control
    it is queued in its own (low) band like any other and dispatched after every
    higher band is empty."""
    return priority < 0


class FlowKey(NamedTuple):
    """One flow: a fairness ID at one priority (GIE's ``FlowKey``). The same ID at two
    priorities is two independent flows."""

    id: str
    priority: int

    def __str__(self) -> str:
        return f"{self.id}:{self.priority}"


class QueueOutcome(enum.Enum):
    """The final state of a request in flow control; ``value`` is GIE's label string."""

    NOT_YET_FINALIZED = "NotYetFinalized"  # only as the enqueue-duration label of a queued item
    DISPATCHED = "Dispatched"
    REJECTED_CAPACITY = "RejectedCapacity"
    REJECTED_OTHER = "RejectedOther"
    EVICTED_TTL = "EvictedTTL"
    EVICTED_CONTEXT_CANCELLED = "EvictedContextCancelled"
    EVICTED_OTHER = "EvictedOther"

    @property
    def rejected(self) -> bool:
        """Never entered a queue (GIE: the error wraps ``ErrRejected``)."""
        return self in (QueueOutcome.REJECTED_CAPACITY, QueueOutcome.REJECTED_OTHER)

    @property
    def evicted(self) -> bool:
        """Left a queue without being dispatched (GIE: wraps ``ErrEvicted``)."""
        return self in (QueueOutcome.EVICTED_TTL, QueueOutcome.EVICTED_CONTEXT_CANCELLED,
                        QueueOutcome.EVICTED_OTHER)


#: The terminal outcomes, in GIE's order.
FINAL_OUTCOMES: Final = (QueueOutcome.DISPATCHED, QueueOutcome.REJECTED_CAPACITY,
                         QueueOutcome.REJECTED_OTHER, QueueOutcome.EVICTED_TTL,
                         QueueOutcome.EVICTED_CONTEXT_CANCELLED, QueueOutcome.EVICTED_OTHER)

#: HTTP status per outcome (None: go on and schedule). GIE: ResourceExhausted → 429,
#: ServiceUnavailable → 503, Internal → 500.
OUTCOME_STATUS: Final[Mapping[QueueOutcome, int | None]] = {
    QueueOutcome.DISPATCHED: None,
    QueueOutcome.REJECTED_CAPACITY: 429,
    QueueOutcome.EVICTED_TTL: 503,
    QueueOutcome.EVICTED_CONTEXT_CANCELLED: 503,
    QueueOutcome.REJECTED_OTHER: 500,
    QueueOutcome.EVICTED_OTHER: 500,
    QueueOutcome.NOT_YET_FINALIZED: 500,
}

# GIE's sentinel error texts (types/errors.go), joined as Go's "%w: %w" does.
ERR_REJECTED: Final = "request rejected pre-queue"
ERR_EVICTED: Final = "request evicted from queue"
ERR_QUEUE_AT_CAPACITY: Final = "queue at capacity"
ERR_TTL_EXPIRED: Final = "request TTL expired"
ERR_CONTEXT_CANCELLED: Final = "request context cancelled"
ERR_NOT_RUNNING: Final = "flow controller is not running"
ERR_FLOW_ID_EMPTY: Final = "flow ID cannot be empty"


@dataclass(frozen=True, slots=True)
class FlowControlResult:
    """What :meth:`FlowController.enqueue_and_wait` returns: the outcome and, for any
    outcome but ``DISPATCHED``, GIE's error text (``reason``)."""

    outcome: QueueOutcome
    reason: str = ""
    #: ``outcome.value``, kept as a plain string: the metrics' label and the controller's
    #: counter key (an Enum's hash and ``value`` are Python-level calls).
    label: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "label", self.outcome.value)

    @property
    def dispatched(self) -> bool:
        return self.outcome is QueueOutcome.DISPATCHED

    @property
    def status(self) -> int | None:
        """The HTTP status the client gets (None when dispatched)."""
        return OUTCOME_STATUS[self.outcome]

    def error(self) -> EppError | None:
        """The error the Director raises for this outcome (None when dispatched), with
        GIE's messages (``translateFlowControlOutcome``)."""
        o = self.outcome
        msg = self.reason or "request rejected by flow control"
        if o is QueueOutcome.DISPATCHED:
            return None
        if o is QueueOutcome.REJECTED_CAPACITY:
            return NoCapacity(msg)
        if o is QueueOutcome.EVICTED_TTL:
            return ServiceUnavailable("request timed out in queue: " + msg)
        if o is QueueOutcome.EVICTED_CONTEXT_CANCELLED:
            return ServiceUnavailable("client disconnected: " + msg)
        if o in (QueueOutcome.REJECTED_OTHER, QueueOutcome.EVICTED_OTHER):
            return EppError("internal flow control error: " + msg)
        return EppError("unhandled flow control outcome: " + msg)

    def raise_for_outcome(self) -> None:
        """Raise :meth:`error` unless the request was dispatched."""
        err = self.error()
        if err is not None:
            raise err


DISPATCHED: Final = FlowControlResult(QueueOutcome.DISPATCHED)

_NO_HEADERS: Final[Mapping[str, str]] = {}


@dataclass(slots=True)
class FlowControlRequest:
    """A request as the controller sees it (GIE's ``FlowControlRequest``).

    ``fairness_id``: the ``x-gateway-inference-fairness-id`` header, or
    :data:`DEFAULT_FAIRNESS_ID`; must not be empty. ``priority``: the InferenceObjective's
    priority (0 by default; negative = sheddable). ``byte_size``: the request body's size
    as sent upstream (capacity limits count these bytes). ``ttl``: this request's own
    time-to-live in seconds (GIE's ``InitialEffectiveTTL``; 0 = the config's
    ``defaultRequestTTL``). ``received_at``: ``time.monotonic()`` when the EPP received the
    request (slo-deadline ordering counts from it; None = when it was enqueued).
    ``headers``: the request headers (slo-deadline ordering reads ``x-slo-ttft-ms``).
    ``subset``: the request's candidate endpoints (Envoy's subset hint), handed to the
    saturation callback when the request is about to be dispatched; None = the whole pool.
    ``model_name`` / ``target_model_name``: metric labels. ``payload``: anything the caller
    wants to keep with the request; the controller never reads it.
    """

    fairness_id: str = DEFAULT_FAIRNESS_ID
    priority: int = 0
    byte_size: int = 0
    request_id: str = ""
    model_name: str = ""
    target_model_name: str = ""
    ttl: float = 0.0
    received_at: float | None = None
    headers: Mapping[str, str] = field(default_factory=lambda: _NO_HEADERS)
    subset: Sequence[str] | None = None
    payload: Any = None

    @property
    def flow_key(self) -> FlowKey:
        return FlowKey(self.fairness_id, self.priority)
