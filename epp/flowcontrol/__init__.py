"""Flow control: admission by priority, fairness and saturation (GIE v1.5.0's flow
control layer, pkg/epp/flowcontrol; docs/flow-control.md).

Every request is queued in a **flow** — its fairness ID (``x-gateway-inference-fairness-id``,
``default-flow`` when absent) at its priority — and leaves it with exactly one outcome.
Priority bands are served strictly in order (higher first); within a band the fairness
policy picks the flow and the flow's ordering policy the request; nothing is dispatched
while the pool (or the request's candidate subset) is saturated. Bounded queues, in
requests and in bytes, per band and in total; a TTL per request; a client that goes away
leaves its queue at once.

Integration (``SchedulingCore.admit`` in epp/requestcontrol/director.py, wired by
epp/server/wiring.py and started by epp/server/app.py; one controller per EPP, in the
scheduling core's process and loop — with ``--workers N`` too)::

    from epp.flowcontrol import (DEFAULT_FAIRNESS_ID, FEATURE_GATE, FlowControlMetrics,
                                 FlowController, FlowControlRequest, build_flow_control,
                                 detector_saturation, parse_flow_control)

    # config loading — phase 1 (parse_config), always: the section is decoded strictly
    spec = parse_flow_control(doc.get("flowControl"), source)           # FlowControlSpec
    # phase 2 (build), only under the "flowControl" feature gate
    config = build_flow_control(spec, handle, source)                  # FlowControlConfig

    # server start
    metrics = FlowControlMetrics(epp_metrics.registry, epp_metrics.pool_name)
    fc = FlowController(config, detector_saturation(built.saturation_detector,
                                                    store.routable), metrics=metrics)
    await fc.start()
    ...
    await fc.stop()              # after the drain: queued requests end EvictedOther (500)

    # per request, before scheduling
    result = await fc.enqueue_and_wait(FlowControlRequest(
        fairness_id=request.fairness_id or DEFAULT_FAIRNESS_ID, priority=request.priority,
        byte_size=request.request_size_bytes, request_id=request.request_id,
        model_name=request.incoming_model, target_model_name=request.target_model,
        headers=request.headers, subset=subset))
    result.raise_for_outcome()   # 429 RejectedCapacity; 503 EvictedTTL; 500 *Other

    # whenever saturation may have dropped: a response completed, metrics were scraped
    fc.notify()

Contract of :meth:`FlowController.enqueue_and_wait`:

- Returns a :class:`FlowControlResult` (``outcome``, ``reason``, ``status``, ``error()``).
  A request that finds the pool unsaturated and nothing ahead of it is dispatched in the
  same step (no suspension, no timer). Rejections (``RejectedCapacity``, or
  ``RejectedOther`` before :meth:`~FlowController.start` / after
  :meth:`~FlowController.stop` / for an empty fairness ID) also return at once.
- Cancelling the awaiting task (the client disconnected) removes the request from its
  queue at once and counts it ``EvictedContextCancelled``; the ``CancelledError``
  propagates (there is nobody to answer; its status would be 503).
- ``saturation(subset)`` is called once per dispatch cycle with ``None`` (the pool; the
  ``inference_extension_flow_control_pool_saturation`` gauge) and, for a request that
  carries a ``subset``, with that subset before it is dispatched. It must be cheap and
  synchronous (GIE caches the candidate lookup for 50 ms). An exception is logged and
  read as 0 (fail open). A subset matching no endpoint reads as saturated (a detector's
  rule), so such a request waits for its TTL: answer 503 for an empty subset *before*
  enqueueing, as design.md's error table says.
- Sheddable requests (negative priority, :func:`is_sheddable`) are queued like any other
  under flow control (GIE v1.5.0): they wait in their own low band and are shed only by
  its capacity limits or their TTL. Rejecting them at once when saturated is the legacy
  admission, used when the feature gate is off.
- Per request on the fast path: one capacity check, one queue insert and remove, one
  dispatch cycle (``bench/flowcontrol_overhead.py`` measures it).

Outcome → HTTP status (GIE's ``translateFlowControlOutcome``; design.md): Dispatched →
schedule; RejectedCapacity → 429; EvictedTTL, EvictedContextCancelled → 503;
RejectedOther, EvictedOther → 500.
"""

from epp.flowcontrol.config import (
    DEFAULT_BAND_MAX_BYTES,
    DEFAULT_FAIRNESS_POLICY,
    DEFAULT_ORDERING_POLICY,
    DEFAULT_USAGE_LIMIT_POLICY,
    FEATURE_GATE,
    BandConfig,
    FlowControlConfig,
    FlowControlSpec,
    PriorityBandSpec,
    build_flow_control,
    default_config,
    parse_flow_control,
)
from epp.flowcontrol.controller import (
    BandStats,
    FlowController,
    FlowControlStats,
    SaturationFn,
)
from epp.flowcontrol.interfaces import FairnessPolicy, OrderingPolicy, UsageLimitPolicy
from epp.flowcontrol.metrics import FlowControlMetrics
from epp.flowcontrol.plugins import FLOW_CONTROL_PLUGINS
from epp.flowcontrol.saturation import detector_saturation
from epp.flowcontrol.types import (
    DEFAULT_FAIRNESS_ID,
    OUTCOME_STATUS,
    FlowControlRequest,
    FlowControlResult,
    FlowKey,
    QueueOutcome,
    is_sheddable,
)

__all__ = [
    "DEFAULT_BAND_MAX_BYTES",
    "DEFAULT_FAIRNESS_ID",
    "DEFAULT_FAIRNESS_POLICY",
    "DEFAULT_ORDERING_POLICY",
    "DEFAULT_USAGE_LIMIT_POLICY",
    "FEATURE_GATE",
    "FLOW_CONTROL_PLUGINS",
    "OUTCOME_STATUS",
    "BandConfig",
    "BandStats",
    "FairnessPolicy",
    "FlowControlConfig",
    "FlowControlMetrics",
    "FlowControlRequest",
    "FlowControlResult",
    "FlowControlSpec",
    "FlowControlStats",
    "FlowController",
    "FlowKey",
    "OrderingPolicy",
    "PriorityBandSpec",
    "QueueOutcome",
    "SaturationFn",
    "UsageLimitPolicy",
    "build_flow_control",
    "default_config",
    "detector_saturation",
    "is_sheddable",
    "parse_flow_control",
]
