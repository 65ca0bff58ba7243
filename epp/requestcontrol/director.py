"""Request control, in two halves that may live in different processes.

:class:`Director` (the protocol front): parse the body once → the request's objective
and model rewrite (:func:`apply_objectives`: the priority of the InferenceObjective named
by ``x-gateway-inference-objective``; the target an InferenceModelRewrite rule picks for
the body's model, over ``x-gateway-model-name-rewrite``) → rewrite the body's model → ask
the core for a decision → return a :class:`Routing`; on the response it parses usage and
rewrites a rewritten model name back, then reports completion to the core exactly once.

:class:`SchedulingCore` (the single owner of scheduling state) first admits the request
(:meth:`SchedulingCore.admit`, GIE's admission controller: under the ``flowControl``
feature gate the request waits in the flow controller, epp/flowcontrol, until the pool
can take it; without it GIE's legacy rule refuses a sheddable request, priority < 0,
with 429 while the pool is saturated), then decides in four steps: candidates (the
endpoint snapshot, narrowed by Envoy's subset hint) → schedule (the scheduler) → place
(PreRequest plugins; headers for upstream and client) → account (the decision observer;
the ticket). One :class:`~epp.observability.observer.DecisionObserver`
sees every step and the completion: request metrics always, an explain record and a
trace span when they are asked for. ResponseHeaders plugins are asked once per request at
decision time (status 0), so a decision can travel to a front in another process in one
message. Configs with GIE's PrepareData plugins (the latency predictor) run them over the
candidates first (:meth:`SchedulingCore.decide_prepared`, asynchronous, 400 ms at most),
then its admission plugins; plugins that learn from responses get the front's
measurements at completion (``ResponseMeasured``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from epp import keys
from epp.datastore.objectives import ObjectiveStore
from epp.datastore.store import Datastore
from epp.errors import BadRequest, ConfigError, EppError, NoCapacity, ServiceUnavailable
from epp.flowcontrol import (
    DEFAULT_FAIRNESS_ID,
    FlowController,
    FlowControlRequest,
    SaturationFn,
)
from epp.framework.interfaces import (
    PREPARE_DATA_TIMEOUT_S,
    AdmissionPlugin,
    DecisionClassifier,
    Plugin,
    PrepareDataPlugin,
    PreRequest,
    RequestHeaderProcessor,
    RequestHeaders,
    ResponseComplete,
    ResponseHeaders,
    ResponseMeasured,
    ResponseTimings,
    Screener,
    TimeoutAwareProducer,
)
from epp.handlers.protocol import Routing
from epp.observability.explain import DecisionLog, ExplainObserver
from epp.observability.metrics import EppMetrics, MetricsObserver, gie_error_code
from epp.observability.observer import DecisionObserver, Fanout, ResponseStats
from epp.observability.tracing import TraceObserver, Tracing
from epp.parsing.parser import Parser, ResponseParser
from epp.parsing.parsers import OpenAIParser
from epp.parsing.request import ParsedRequest, api_type_for_path, rewrite_model
from epp.parsing.usage import Usage
from epp.requestcontrol.agent_identity import AGENT_IDENTITY_KEY
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import Endpoint, LLMRequest, SchedulingResult

log = logging.getLogger(__name__)

# request.plugin_state: the screened candidates, from decide_prepared to decide.
_SCREENED = "epp.screened-candidates"


@dataclass(slots=True)
class Decision:
    """What the scheduling core decided for one request.

    ``ticket`` identifies the request to the core until :meth:`SchedulingCore.complete`;
    ``response_headers`` are set on the response to the client (e.g. the session token,
    the explain JSON).
    """

    destination: str
    set_headers: dict[str, str]
    response_headers: dict[str, str]
    ticket: Any
    # llm-d's --emit-endpoint-scores: the primary profile's candidates, ip:port -> weighted
    # score (SchedulingCore.emit_endpoint_scores); None when off.
    scores: dict[str, float] | None = None


@dataclass(slots=True)
class _Ticket:
    request: LLMRequest
    endpoint_key: str
    started: float  # time.monotonic() when placed
    observer: DecisionObserver


@dataclass(slots=True)
class _Placement:
    """What placing a scheduled request produced (the plugins' part of the decision)."""

    endpoint_key: str
    set_headers: dict[str, str]
    response_headers: dict[str, str]


class SchedulingCore:
    """The single owner of scheduling state: endpoints snapshot, scheduler and plugins,
    request metrics, explain records and trace spans.

    ``decide`` runs synchronously over an immutable snapshot; ``complete`` is called exactly
    once per decided request. In single-process mode the :class:`Director` calls it directly;
    with several workers the protocol fronts reach it over local IPC
    (epp/server/workers.py) with the same calls.
    """

    def __init__(
        self,
        store: Datastore,
        scheduler: Scheduler,
        metrics: EppMetrics,
        pre_request: Sequence[PreRequest] = (),
        response_complete: Sequence[ResponseComplete] = (),
        request_headers: Sequence[RequestHeaders] = (),
        response_headers: Sequence[ResponseHeaders] = (),
        explain_header: bool = False,
        decisions: DecisionLog | None = None,
        tracing: Tracing | None = None,
        objectives: ObjectiveStore | None = None,
        prepare_data: Sequence[PrepareDataPlugin] = (),
        admission: Sequence[AdmissionPlugin] = (),
        response_measured: Sequence[ResponseMeasured] = (),
        flow_control: FlowController | None = None,
        saturation: SaturationFn | None = None,
        request_header_processors: Sequence[RequestHeaderProcessor] = (),
        screeners: Sequence[Screener] = (),
    ) -> None:
        self.store = store
        # llm-d-router's RequestHeaderProcessor plugins (first of all, decide_request)
        # and Screeners (over the candidates, before PrepareData: _screened).
        self.request_header_processors = tuple(request_header_processors)
        self.screeners = tuple(screeners)
        # Admission, before anything else of a decision (GIE's AdmissionController; see
        # admit()): the flow controller under the flowControl feature gate; otherwise
        # GIE's legacy rule over ``saturation`` (the config's saturation detector; None:
        # every request is admitted).
        self.flow_control = flow_control
        self.saturation = saturation
        # GIE's PrepareData and Admission plugins (before scheduling: decide_prepared,
        # decide) and what learns from measured responses (complete).
        self.prepare_data = tuple(prepare_data)
        # Their budget together: GIE's 400 ms, or more for llm-d's TimeoutAwareProducers.
        self._prepare_budget = max([PREPARE_DATA_TIMEOUT_S] + [
            p.produce_timeout() for p in self.prepare_data
            if isinstance(p, TimeoutAwareProducer)])
        self.admission = tuple(admission)
        self.response_measured = tuple(response_measured)
        # InferenceObjectives and InferenceModelRewrites: read by the Directors (in this
        # process, or replicated to the --workers fronts: epp/server/workers.py).
        self.objectives = objectives
        self.scheduler = scheduler
        self.metrics = metrics
        self.pre_request = tuple(pre_request)
        self.response_complete = tuple(response_complete)
        self.request_headers = tuple(request_headers)
        self.response_headers = tuple(response_headers)
        self.explain_header = explain_header
        self.decisions = decisions
        self.tracing = tracing
        self.on_upstream_failure: Callable[[str], None] | None = None
        # llm-d's --emit-endpoint-scores: decisions carry the primary profile's scores.
        self.emit_endpoint_scores = False
        handler = scheduler.handler
        # P/D handlers classify each decision ("disaggregated" / "decode-only").
        self._metrics_observer = MetricsObserver(
            metrics, handler.decision if isinstance(handler, DecisionClassifier) else None)
        # The observer of the decision being scheduled, while it wants plugin timings.
        self._timed: DecisionObserver | None = None

    async def decide_request(self, request: LLMRequest,
                             subset: Sequence[str] | None) -> Decision:
        """The whole decision, in GIE's Director's order: admission (:meth:`admit`), then
        :meth:`decide_prepared`. What the CoreClients call (in process and for the
        ``--workers`` fronts). Suspends only while flow control holds the request.
        llm-d's RequestHeaderProcessor plugins run first; a request without a fairness
        ID then takes the ``agent-identity`` one they left (llm-d's Director)."""
        if self.request_header_processors:
            for processor in self.request_header_processors:
                processor.request_header(request)
            if not request.fairness_id:
                agent = request.plugin_state.get(AGENT_IDENTITY_KEY)
                if isinstance(agent, str) and agent:
                    request.fairness_id = agent
        if self.flow_control is not None or (request.priority < 0
                                             and self.saturation is not None):
            await self.admit(request, subset)
        return await self.decide_prepared(request, subset)

    async def admit(self, request: LLMRequest, subset: Sequence[str] | None) -> None:
        """GIE's AdmissionController.Admit (pkg/epp/requestcontrol/admission.go); raises
        EppError (counted) when the request is refused.

        - Flow control on (``flow_control``): the request waits in its flow — fairness ID
          ``x-gateway-inference-fairness-id`` (``default-flow``), its priority, its body
          size — until dispatched; the outcome's error otherwise (GIE's
          ``translateFlowControlOutcome``: 429 over capacity, 503 TTL expired, 500
          controller not running). A request nothing could serve (no candidate
          endpoint) is answered 503 at once instead of waiting out its TTL. Cancelling
          the awaiting task (the client went away) removes it from its queue at once.
        - Off (GIE's LegacyAdmissionController): a sheddable request (priority < 0) is
          refused with 429 "system saturated, sheddable request dropped" while the
          saturation detector reads its candidates (the pool, or Envoy's subset) at or
          over 1.0 (no endpoints: saturated); any other request passes.
        """
        fc = self.flow_control
        try:
            if fc is None:
                saturation = self.saturation
                if request.priority < 0 and saturation is not None \
                        and saturation(subset) >= 1.0:
                    log.debug("request rejected: system saturated and request is sheddable",
                              extra={"request_id": request.request_id})
                    raise NoCapacity("system saturated, sheddable request dropped")
                return
            self._candidates(subset)
            result = await fc.enqueue_and_wait(FlowControlRequest(
                fairness_id=request.fairness_id or DEFAULT_FAIRNESS_ID,
                priority=request.priority, byte_size=request.request_size_bytes,
                request_id=request.request_id, model_name=request.incoming_model,
                target_model_name=request.target_model, headers=request.headers,
                subset=subset))
            if not result.dispatched:
                log.debug("flow control outcome %s: %s", result.label, result.reason,
                          extra={"request_id": request.request_id})
                result.raise_for_outcome()
        except EppError as e:
            self._refused(request, e.status)
            raise
        except asyncio.CancelledError:
            # The client went away while queued (EvictedContextCancelled): GIE answers
            # 503, which nobody receives, and counts it.
            self._refused(request, ServiceUnavailable.status)
            raise

    def _refused(self, request: LLMRequest, status: int) -> None:
        """Count a request admission refused: its error, and the model rewrite GIE's
        Director counted before admission (decide() counts it otherwise)."""
        if request.model_rewrite is not None:
            self.metrics.record_model_rewrite(request.model_rewrite, request.incoming_model,
                                              request.target_model)
        self.metrics.record_request_error(request.incoming_model, request.target_model,
                                          request.fairness_id, request.priority,
                                          gie_error_code(status))

    def decide(self, request: LLMRequest, subset: Sequence[str] | None) -> Decision:
        """Schedule ``request``; raises EppError (counted) when it cannot be placed."""
        if request.model_rewrite is not None:
            # GIE counts the rewrite where its Director applies it, whatever comes next.
            self.metrics.record_model_rewrite(request.model_rewrite, request.incoming_model,
                                              request.target_model)
        observer = self._observer(request)
        try:
            candidates = self._screened_once(request, subset)
            if self.admission:
                self._admit(request, candidates)
            result = self._schedule(request, candidates, observer)
        except EppError as e:
            observer.failed(request, e.status, e.message)
            raise
        except Exception as e:
            # A plugin bug: answer 500 (the handler turns EppError into an ImmediateResponse)
            # and count it like any other error.
            log.exception("scheduling failed")
            observer.failed(request, 500, None)
            raise EppError("internal error in the endpoint picker") from e
        placement = self._place(request, result)
        return self._account(request, result, placement, observer)

    async def decide_prepared(self, request: LLMRequest,
                              subset: Sequence[str] | None) -> Decision:
        """:meth:`decide`, after the PrepareData plugins ran over the candidates (GIE's
        order: candidates → PrepareData → admission → scheduling). They get
        :data:`PREPARE_DATA_TIMEOUT_S` together; a timeout or a failure is logged and the
        request is scheduled anyway. Without PrepareData plugins this is :meth:`decide`;
        with plugins that do no I/O it never suspends."""
        if self.prepare_data:
            try:
                candidates = self._candidates(subset)
            except EppError:
                candidates = ()  # decide() answers (and counts) it
            if candidates and self.screeners:
                try:
                    candidates = self._screened(request, candidates)
                except ServiceUnavailable:
                    candidates = ()
                # Screened once: decide() schedules over these (or answers 503).
                request.plugin_state[_SCREENED] = tuple(candidates)
            if candidates:
                await self._prepare_data(request, candidates)
        return self.decide(request, subset)

    def _screened_once(self, request: LLMRequest,
                       subset: Sequence[str] | None) -> Sequence[Endpoint]:
        """The candidates, screened — by decide_prepared already when it left them."""
        screened: Sequence[Endpoint] | None = request.plugin_state.pop(_SCREENED, None)
        if screened is None:
            return self._screened(request, self._candidates(subset))
        if not screened:
            raise ServiceUnavailable("screeners eliminated all endpoint candidates")
        return screened

    def _screened(self, request: LLMRequest,
                  candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """llm-d's runScreeners: the candidates every screener kept (each sees all of
        them), in their order; 503 when none is left."""
        if not self.screeners:
            return candidates
        kept = candidates
        for screener in self.screeners:
            allowed = {e.key for e in screener.screen(request, tuple(candidates))}
            kept = tuple(e for e in kept if e.key in allowed)
        if not kept:
            raise ServiceUnavailable("screeners eliminated all endpoint candidates")
        return kept

    async def _prepare_data(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> None:
        plugin: PrepareDataPlugin | None = None
        budget = self._prepare_budget
        try:
            async with asyncio.timeout(budget):
                for plugin in self.prepare_data:
                    await plugin.prepare_request_data(request, candidates)
        except TimeoutError:
            log.warning("prepare data plugins timed out after %gs (at %s)",
                        budget, plugin.name if plugin else "?",
                        extra={"request_id": request.request_id})
        except Exception:
            log.exception("PrepareData plugin %s failed", plugin.name if plugin else "?")

    def _admit(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> None:
        """GIE's admission plugins: the first refusal answers 500 "request cannot be
        admitted" (GIE's errcommon.Internal)."""
        for plugin in self.admission:
            reason = plugin.admit_request(request, candidates)
            if reason is not None:
                log.debug("admission plugin %s denied the request: %s", plugin.name, reason,
                          extra={"request_id": request.request_id})
                raise EppError("request cannot be admitted")

    def _observer(self, request: LLMRequest) -> DecisionObserver:
        """Who watches this decision: the metrics, plus a trace and an explain record when
        they are on for it (then in this order: the record shows the trace's header)."""
        if self.tracing is None and self.decisions is None and not self.explain_header:
            return self._metrics_observer
        observers: list[DecisionObserver] = []
        if self.tracing is not None:
            observers.append(TraceObserver(self.tracing, request))
        explain = ExplainObserver.for_request(request, self.decisions, self.explain_header)
        if explain is not None:
            observers.append(explain)
        if not observers:
            return self._metrics_observer
        observers.append(self._metrics_observer)
        return Fanout(observers)

    def _candidates(self, subset: Sequence[str] | None) -> Sequence[Endpoint]:
        """Step 1: the routable endpoints, narrowed by Envoy's subset hint; 503 if none."""
        candidates = self.store.routable()
        if subset is not None:
            allowed = set(subset)
            candidates = tuple(e for e in candidates if e.key in allowed) or tuple(
                # Fail open within the hint, as over the whole pool: when it names only
                # endpoints the scrape calls unreachable, they are still candidates.
                e for e in self.store.snapshot() if e.key in allowed)
            if not candidates:
                raise ServiceUnavailable(
                    "no ready endpoint matches the subset hint "
                    f"({', '.join(subset) or 'empty'})")
        if not candidates:
            raise ServiceUnavailable("no ready endpoints in the pool")
        return candidates

    def _schedule(self, request: LLMRequest, candidates: Sequence[Endpoint],
                  observer: DecisionObserver) -> SchedulingResult:
        """Step 2: run the scheduler; per-plugin outcomes and timings reach the observer
        only when it wants them."""
        observer.started(request, candidates)
        self._timed = observer if observer.timings else None
        t0 = time.perf_counter()
        try:
            result = self.scheduler.schedule(request, candidates,
                                             observer if observer.detail else None)
        except Exception:
            # GIE counts a scheduling attempt and its latency whatever the outcome.
            self._metrics_observer.record_attempt_failed(request, time.perf_counter() - t0)
            raise
        finally:
            self._timed = None
        seconds = time.perf_counter() - t0
        observer.scheduled(request, result, seconds)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("routed", extra={"request_id": request.request_id,
                                       "model": request.incoming_model,
                                       "target_model": request.target_model,
                                       "endpoints": [e.key for e in result.primary.endpoints],
                                       "profiles": {n: (r.endpoints[0].key if r else None)
                                                    for n, r in result.profile_results.items()},
                                       "scheduling_ms": round(1000 * seconds, 3)})
        return result

    def _place(self, request: LLMRequest, result: SchedulingResult) -> _Placement:
        """Step 3: tell the PreRequest plugins where the request goes; collect the
        headers for upstream (RequestHeaders plugins, ``x-request-id``) and for the client
        (ResponseHeaders plugins, asked now with status 0).

        From here on the request is placed: a failing plugin is logged and passed over (as
        ResponseComplete plugins are), so the decision and its accounting always complete
        together."""
        for pre in self.pre_request:
            try:
                pre.pre_request(request, result)
            except Exception:
                log.exception("PreRequest plugin %s failed", pre.name)
        set_headers: dict[str, str] = {}
        for hp in self.request_headers:
            try:
                set_headers.update(hp.request_headers(request, result))
            except Exception:
                log.exception("RequestHeaders plugin %s failed", hp.name)
        if keys.HEADER_REQUEST_ID not in request.headers:
            set_headers[keys.HEADER_REQUEST_ID] = request.request_id
        endpoint_key = result.primary.endpoints[0].key
        response_headers: dict[str, str] = {}
        for plugin in self.response_headers:
            try:
                extra = plugin.response_headers(request, endpoint_key, 0, {})
            except Exception:
                log.exception("ResponseHeaders plugin %s failed", plugin.name)
                continue
            if extra:
                response_headers.update(extra)
        return _Placement(endpoint_key, set_headers, response_headers)

    def _account(self, request: LLMRequest, result: SchedulingResult, placement: _Placement,
                 observer: DecisionObserver) -> Decision:
        """Step 4: the observer records the decision (and may add headers: the trace
        context, the explain record); the plugins' response headers go over its."""
        set_headers = placement.set_headers
        response_headers: dict[str, str] = {}
        observer.decided(request, result, set_headers, response_headers)
        if placement.response_headers:
            response_headers.update(placement.response_headers)
        ticket = _Ticket(request, placement.endpoint_key, time.monotonic(), observer)
        scores = None
        if self.emit_endpoint_scores:  # llm-d's Director.prepareRequest: ScoredCandidates
            primary = result.primary
            scores = ({s.endpoint.key: s.score for s in primary.candidates}
                      if primary.candidates else dict(primary.scores)) or None
        return Decision(result.destination(), set_headers, response_headers, ticket, scores)

    def complete(self, ticket: Any, status: int, aborted: bool, usage: Usage | None,
                 response: ResponseStats | None = None) -> None:
        """The decided request's response ended (or its stream aborted). Exactly once.
        ``response``: what the front measured of the response body, when it saw it."""
        t: _Ticket = ticket
        seconds = time.monotonic() - t.started
        if self.response_measured and response is not None and not aborted:
            timings = ResponseTimings(status, seconds, response.ttft, response.tpot,
                                      usage.completion_tokens if usage is not None else None)
            for measured in self.response_measured:
                try:
                    measured.response_measured(t.request, t.endpoint_key, timings)
                except Exception:
                    log.exception("ResponseMeasured plugin %s failed", measured.name)
        for plugin in self.response_complete:
            try:
                plugin.response_complete(t.request, t.endpoint_key, aborted)
            except Exception:
                log.exception("ResponseComplete plugin %s failed", plugin.name)
        if response is not None and not aborted:
            t.observer.responded(t.request, status, response)
        t.observer.completed(t.request, status, aborted, usage, seconds)
        if self.flow_control is not None:
            self.flow_control.notify()  # a request left a pod: saturation may have dropped

    def reject(self, incoming: str, target: str, status: int) -> None:
        """Count a request rejected before scheduling (bad body, body too large, …)."""
        self.metrics.record_request_error(incoming, target, None, 0, gie_error_code(status))

    def upstream_failed(self, address: str) -> None:
        """Envoy could not connect to the endpoint ``address`` (``ip:port``) it was sent
        to: hand it to ``on_upstream_failure`` (the metrics scraper marks it unreachable
        until a scrape succeeds again)."""
        ep = self.store.get(address)
        self.metrics.upstream_connect_failures.labels(ep.name if ep else address).inc()
        if self.on_upstream_failure is not None:
            self.on_upstream_failure(address)

    def plugin_timer(self, extension_point: str, plugin: Plugin, seconds: float) -> None:
        """Fan-in point for plugin timings (the scheduler's PluginTimer, or part of it):
        hands them to the observer of the decision being scheduled when it wants them
        (its trace spans)."""
        observer = self._timed
        if observer is not None:
            observer.plugin_timed(extension_point, plugin, seconds)


class CoreClient(Protocol):
    """How a Director reaches the scheduling core: in process, or over IPC."""

    async def decide(self, request: LLMRequest, subset: Sequence[str] | None) -> Decision: ...

    def complete(self, ticket: Any, status: int, aborted: bool, usage: Usage | None,
                 response: ResponseStats | None = None) -> None: ...

    def reject(self, incoming: str, target: str, status: int) -> None: ...

    def upstream_failed(self, address: str) -> None: ...


class LocalCore:
    """The in-process CoreClient (single-process mode)."""

    def __init__(self, core: SchedulingCore) -> None:
        self.core = core

    async def decide(self, request: LLMRequest, subset: Sequence[str] | None) -> Decision:
        return await self.core.decide_request(request, subset)

    def complete(self, ticket: Any, status: int, aborted: bool, usage: Usage | None,
                 response: ResponseStats | None = None) -> None:
        self.core.complete(ticket, status, aborted, usage, response)

    def reject(self, incoming: str, target: str, status: int) -> None:
        self.core.reject(incoming, target, status)

    def upstream_failed(self, address: str) -> None:
        self.core.upstream_failed(address)


@dataclass(slots=True)
class RequestContext:
    """Per-request state the Director keeps between routing and the end of the response."""

    request: LLMRequest
    ticket: Any
    response_headers: dict[str, str]
    status: int = 0
    usage: ResponseParser | None = None  # the parser's reader of this response
    model_back: tuple[bytes, bytes, bytes, bytes] | None = None  # rewrite-back patterns
    last: bytes = b""  # the last non-empty response body chunk seen (a reference, no copy)
    # Response metrics (GIE's response sizes, TTFT, TPOT): time.monotonic() of the decision
    # and of the first response body chunk, body bytes seen, end of the body seen.
    routed_at: float = 0.0
    first_at: float = 0.0
    sse: bool = False  # the response is a server-sent event stream
    resp_bytes: int = 0
    body_ended: bool = False
    # llm-d's response-path series (Director.metrics set): the ITL series of a streamed
    # response (None otherwise), time.perf_counter() of its last non-empty chunk and of
    # the response headers, and the EPP's own time on the response so far.
    itl: Any = None
    last_chunk_at: float = 0.0
    resp_at: float = 0.0
    resp_proc: float = 0.0


class Director:
    """The protocol-front half: parses, asks the core for a decision, follows the response.

    Implements the ext_proc handler's RequestDirector protocol. ``core`` is a
    :class:`SchedulingCore` (wrapped in :class:`LocalCore`) or any other CoreClient.
    """

    def __init__(self, core: SchedulingCore | CoreClient, parser: Plugin | None = None,
                 objectives: ObjectiveStore | None = None) -> None:
        """``parser``: the config's ``parser`` plugin (``BuiltConfig.parser_plugin``; None:
        the openai-parser). Raises ConfigError when it is not a :class:`Parser`.
        ``objectives``: the InferenceObjectives and model rewrites to apply (None: a
        :class:`SchedulingCore`'s own; none for another CoreClient)."""
        self.core: CoreClient = LocalCore(core) if isinstance(core, SchedulingCore) else core
        if objectives is None and isinstance(core, SchedulingCore):
            objectives = core.objectives
        self.objectives = objectives
        if parser is not None and not isinstance(parser, Parser):
            raise ConfigError(
                f"parser.pluginRef: {parser.name!r} ({parser.type_name}) cannot be the parser: "
                "it needs parse_request(headers, body) and response_parser(request, headers) "
                "(docs/plugins.md, \"Parsers\"); use openai-parser, passthrough-parser, "
                "vllmgrpc-parser or vllmhttp-parser")
        self.parser: Parser = parser if parser is not None else OpenAIParser()
        # llm-d's request/response processing and inter-token latency series: recorded
        # with an in-process core (a --workers front has no metrics of its own).
        self.metrics: EppMetrics | None = (core.metrics if isinstance(core, SchedulingCore)
                                           else None)

    async def route(
        self,
        headers: Mapping[str, str],
        body: bytes,
        has_body: bool,
        subset: Sequence[str] | None,
    ) -> Routing:
        # Everything that can fail on the client's input happens before the core counts
        # the request as running: a decided request is always handed back (on_done).
        t0 = time.perf_counter()
        try:
            new_body = None
            try:
                request, parsed = build_request(headers, body, has_body, self.parser)
                if self.objectives is not None:
                    apply_objectives(request, parsed, self.objectives)
                if parsed is not None and parsed.data is not None \
                        and request.target_model != request.incoming_model:
                    new_body = rewrite_model(parsed.data, request.target_model)
            except EppError as e:
                self.core.reject("", "", e.status)
                raise
            # GIE's request size: the body as sent upstream (after a model rewrite).
            request.request_size_bytes = len(body) if new_body is None else len(new_body)
            decision = await self.core.decide(request, subset)
            ctx = RequestContext(request, decision.ticket, decision.response_headers,
                                 routed_at=time.monotonic())
            if new_body is not None and request.incoming_model:
                ctx.model_back = _model_patterns(request.target_model, request.incoming_model)
            return Routing(destination=decision.destination, set_headers=decision.set_headers,
                           body=new_body, context=ctx, scores=decision.scores)
        finally:
            # llm-d's RecordRequestProcessingLatency: once per request, its failures
            # (a bad body, an admission refusal, flow control's wait) included.
            if self.metrics is not None:
                self.metrics.record_request_processing(time.perf_counter() - t0)

    def on_rejected(self, headers: Mapping[str, str], status: int) -> None:
        """The wire layer rejected the request itself (e.g. 413 before parsing)."""
        self.core.reject("", "", status)

    # --- response callbacks (RequestDirector protocol) ---

    def on_response_headers(self, context: Any, status: int,
                            headers: Mapping[str, str]) -> Mapping[str, str] | None:
        ctx: RequestContext = context
        t0 = time.perf_counter()
        ctx.status = status
        ctype = headers.get(keys.HEADER_CONTENT_TYPE, "")
        ctx.sse = ctype.startswith(keys.CONTENT_TYPE_SSE)
        ctx.usage = self.parser.response_parser(ctx.request, headers)
        m = self.metrics
        if m is not None:
            # llm-d's modelServerStreaming: the request asked for a stream, or the
            # response is SSE; its chunks' gaps are the inter-token latencies.
            if ctx.sse or ctx.request.stream:
                ctx.itl = m.inter_token_latency_child(ctx.request)
            ctx.resp_at = t0
            ctx.resp_proc = time.perf_counter() - t0
        return ctx.response_headers or None

    def on_response_body(self, context: Any, chunk: bytes, end_of_stream: bool) -> bytes | None:
        ctx: RequestContext = context
        itl = ctx.itl
        t0 = 0.0
        if itl is not None:  # a streamed response, metrics on (on_response_headers)
            t0 = time.perf_counter()
            if chunk:
                if ctx.last_chunk_at:
                    itl.observe(t0 - ctx.last_chunk_at)  # llm-d's RecordInterTokenLatency
                ctx.last_chunk_at = t0
        if ctx.usage is not None:
            ctx.usage.feed(chunk)
        if chunk:
            if not ctx.resp_bytes and not end_of_stream:
                ctx.first_at = time.monotonic()  # TTFT: the first chunk of a longer body
            ctx.resp_bytes += len(chunk)
            ctx.last = chunk
        if end_of_stream:
            ctx.body_ended = True
        out = None
        if ctx.model_back is not None and chunk:
            a, b, c, d = ctx.model_back
            if a in chunk or c in chunk:
                out = chunk.replace(a, b).replace(c, d)
        if itl is not None:
            ctx.resp_proc += time.perf_counter() - t0
        return out

    def on_upstream_failure(self, context: Any, address: str) -> None:
        self.core.upstream_failed(address)

    def on_done(self, context: Any, aborted: bool) -> bool:
        ctx: RequestContext = context
        t0 = time.perf_counter()
        usage = None
        if 200 <= ctx.status < 300 and ctx.usage is not None:
            usage = ctx.usage.finish()
            if aborted and (usage is not None or ctx.last[-32:].rstrip().endswith(b"[DONE]")):
                # Envoy closed the stream without the final end-of-stream message, but the
                # body is complete (its usage, or the SSE terminator, went through).
                aborted = False
        response = None
        if not aborted and (ctx.resp_bytes or ctx.body_ended):
            response = _response_stats(ctx, usage)
        self.core.complete(ctx.ticket, ctx.status, aborted, None if aborted else usage,
                           response)
        if ctx.resp_at and self.metrics is not None:
            self._record_response_processing(self.metrics, ctx, aborted, t0)
        return aborted

    @staticmethod
    def _record_response_processing(m: EppMetrics, ctx: RequestContext, aborted: bool,
                                    done_at: float) -> None:
        """llm-d's RecordResponseProcessingLatency, once per request that reached the
        response phase: a streamed response's (or one whose body the EPP did not see)
        per-message handling times, this last one included; a complete non-streamed
        one's interval from its response headers to now (an aborted one: the handling
        of its headers)."""
        now = time.perf_counter()
        if ctx.itl is not None or not ctx.body_ended:
            spent = ctx.resp_proc + (0.0 if aborted else now - done_at)
        else:
            spent = ctx.resp_proc if aborted else now - ctx.resp_at
        if spent > 0:
            m.record_response_processing(spent)


def _response_stats(ctx: RequestContext, usage: Usage | None) -> ResponseStats:
    """What the front measured of a response body it saw (see :class:`ResponseStats`)."""
    if not ctx.sse or not ctx.first_at or not 200 <= ctx.status < 300:
        return ResponseStats(ctx.resp_bytes)
    now = time.monotonic()
    tpot = None
    tokens = usage.completion_tokens if usage is not None else None
    if tokens is not None and tokens > 1:
        tpot = (now - ctx.first_at) / (tokens - 1)
    return ResponseStats(ctx.resp_bytes, ctx.first_at - ctx.routed_at, tpot)


def build_request(headers: Mapping[str, str], body: bytes, has_body: bool,
                  parser: Parser | None = None) -> tuple[LLMRequest, ParsedRequest | None]:
    """Parse the body (once, with ``parser``; default the openai-parser) and build the
    compact request the scheduler sees.

    As GIE's Director: the model is the body's (empty for bodies that name none, e.g.
    gRPC or passthrough), ``x-gateway-model-name-rewrite`` overrides it as the target;
    a JSON body the EPP rewrites must end up with a model (400 otherwise)."""
    path = headers.get(keys.HEADER_PATH, "/")
    parsed: ParsedRequest | None = None
    if has_body:
        parsed = (parser or _OPENAI).parse_request(headers, body)
        incoming, api, prompt = parsed.model, parsed.api, parsed.prompt
    else:
        incoming, api, prompt = "", api_type_for_path(path), ""
    target = keys.request_header(headers, keys.HEADER_MODEL_REWRITE) or incoming
    if parsed is not None and parsed.data is not None and not target:
        raise BadRequest("model not found in request body")
    request = LLMRequest(
        request_id=headers.get(keys.HEADER_REQUEST_ID) or uuid.uuid4().hex,
        target_model=target,
        incoming_model=incoming,
        api=api,
        prompt=prompt,
        headers=headers,
        stream=parsed.stream if parsed else False,
        max_tokens=parsed.max_tokens if parsed else None,
        cache_salt=parsed.cache_salt if parsed else None,
        user=parsed.user if parsed else None,
        objective=keys.request_header(headers, keys.HEADER_OBJECTIVE),
        fairness_id=keys.request_header(headers, keys.HEADER_FAIRNESS_ID),
        session_token=headers.get(keys.HEADER_SESSION_TOKEN),
    )
    if parsed is not None and parsed.data is not None:  # for token-producer (chat templates)
        request.plugin_state[keys.PLUGIN_STATE_REQUEST_BODY] = parsed.data
    return request, parsed


_OPENAI: Parser = OpenAIParser()


def apply_objectives(request: LLMRequest, parsed: ParsedRequest | None,
                     objectives: ObjectiveStore) -> None:
    """Set ``request.priority`` from its objective, and apply a model rewrite rule, as
    GIE's Director does (``getInferenceObjective``, ``applyWeightedModelRewrite``).

    The priority is the InferenceObjective's named by ``x-gateway-inference-objective``
    (``request.objective``), 0 without one. A rewrite applies to JSON bodies (GIE: the
    map payload; not the passthrough or gRPC parsers' bodies) whose ``model`` is a string:
    the rule that wins for that model (epp/datastore/objectives.py) picks the target,
    which replaces ``target_model`` (even one the ``x-gateway-model-name-rewrite`` header
    set, as in GIE), and ``model_rewrite`` names the rewrite (the core counts it in
    ``inference_extension_model_rewrite_decisions_total``). The caller rewrites the body.
    """
    request.priority = objectives.priority(request.objective)
    if parsed is None or parsed.data is None or not isinstance(parsed.data.get("model"), str):
        return
    chosen = objectives.rewrite(request.incoming_model)
    if chosen is not None:
        request.target_model, request.model_rewrite = chosen


def _model_patterns(target: str, incoming: str) -> tuple[bytes, bytes, bytes, bytes]:
    """Byte patterns that rewrite the target model name back to the client's name."""
    t, i = orjson.dumps(target), orjson.dumps(incoming)
    return (b'"model":' + t, b'"model":' + i, b'"model": ' + t, b'"model": ' + i)
