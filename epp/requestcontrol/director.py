"""Request control, in two halves that may live in different processes.

:class:`Director` (the protocol front): parse the body once → apply the model rewrite
(``x-gateway-model-name-rewrite``) → ask the core for a decision → return a
:class:`Routing`; on the response it parses usage and rewrites a rewritten model name back,
then reports completion to the core exactly once.

:class:`SchedulingCore` (the single owner of scheduling state) decides in four steps:
candidates (the endpoint snapshot, narrowed by Envoy's subset hint) → schedule (the
scheduler) → place (PreRequest plugins; headers for upstream and client) → account (the
decision observer; the ticket). One :class:`~epp.observability.observer.DecisionObserver`
sees every step and the completion: request metrics always, an explain record and a
trace span when they are asked for. ResponseHeaders plugins are asked once per request at
decision time (status 0), so a decision can travel to a front in another process in one
message.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from epp import keys
from epp.datastore.store import Datastore
from epp.errors import BadRequest, ConfigError, EppError, ServiceUnavailable
from epp.framework.interfaces import (
    DecisionClassifier,
    Plugin,
    PreRequest,
    RequestHeaders,
    ResponseComplete,
    ResponseHeaders,
)
from epp.handlers.protocol import Routing
from epp.observability.explain import DecisionLog, ExplainObserver
from epp.observability.metrics import EppMetrics, MetricsObserver
from epp.observability.observer import DecisionObserver, Fanout, ResponseStats
from epp.observability.tracing import TraceObserver, Tracing
from epp.parsing.parser import Parser, ResponseParser
from epp.parsing.parsers import OpenAIParser
from epp.parsing.request import ParsedRequest, api_type_for_path, rewrite_model
from epp.parsing.usage import Usage
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import Endpoint, LLMRequest, SchedulingResult

log = logging.getLogger(__name__)


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
    ) -> None:
        self.store = store
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
        handler = scheduler.handler
        # P/D handlers classify each decision ("disaggregated" / "decode-only").
        self._metrics_observer = MetricsObserver(
            metrics, handler.decision if isinstance(handler, DecisionClassifier) else None)
        # The observer of the decision being scheduled, while it wants plugin timings.
        self._timed: DecisionObserver | None = None

    def decide(self, request: LLMRequest, subset: Sequence[str] | None) -> Decision:
        """Schedule ``request``; raises EppError (counted) when it cannot be placed."""
        observer = self._observer(request)
        try:
            candidates = self._candidates(subset)
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
        return Decision(result.destination(), set_headers, response_headers, ticket)

    def complete(self, ticket: Any, status: int, aborted: bool, usage: Usage | None,
                 response: ResponseStats | None = None) -> None:
        """The decided request's response ended (or its stream aborted). Exactly once.
        ``response``: what the front measured of the response body, when it saw it."""
        t: _Ticket = ticket
        seconds = time.monotonic() - t.started
        for plugin in self.response_complete:
            try:
                plugin.response_complete(t.request, t.endpoint_key, aborted)
            except Exception:
                log.exception("ResponseComplete plugin %s failed", plugin.name)
        if response is not None and not aborted:
            t.observer.responded(t.request, status, response)
        t.observer.completed(t.request, status, aborted, usage, seconds)

    def reject(self, incoming: str, target: str, status: int) -> None:
        """Count a request rejected before scheduling (bad body, body too large, …)."""
        self.metrics.request_error_total.labels(incoming, target, str(status)).inc()

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
        return self.core.decide(request, subset)

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


class Director:
    """The protocol-front half: parses, asks the core for a decision, follows the response.

    Implements the ext_proc handler's RequestDirector protocol. ``core`` is a
    :class:`SchedulingCore` (wrapped in :class:`LocalCore`) or any other CoreClient.
    """

    def __init__(self, core: SchedulingCore | CoreClient, parser: Plugin | None = None) -> None:
        """``parser``: the config's ``parser`` plugin (``BuiltConfig.parser_plugin``; None:
        the openai-parser). Raises ConfigError when it is not a :class:`Parser`."""
        self.core: CoreClient = LocalCore(core) if isinstance(core, SchedulingCore) else core
        if parser is not None and not isinstance(parser, Parser):
            raise ConfigError(
                f"parser.pluginRef: {parser.name!r} ({parser.type_name}) cannot be the parser: "
                "it needs parse_request(headers, body) and response_parser(request, headers) "
                "(docs/plugins.md, \"Parsers\"); use openai-parser, passthrough-parser, "
                "vllmgrpc-parser or vllmhttp-parser")
        self.parser: Parser = parser if parser is not None else OpenAIParser()

    async def route(
        self,
        headers: Mapping[str, str],
        body: bytes,
        has_body: bool,
        subset: Sequence[str] | None,
    ) -> Routing:
        # Everything that can fail on the client's input happens before the core counts
        # the request as running: a decided request is always handed back (on_done).
        new_body = None
        try:
            request, parsed = build_request(headers, body, has_body, self.parser)
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
                       body=new_body, context=ctx)

    def on_rejected(self, headers: Mapping[str, str], status: int) -> None:
        """The wire layer rejected the request itself (e.g. 413 before parsing)."""
        self.core.reject("", "", status)

    # --- response callbacks (RequestDirector protocol) ---

    def on_response_headers(self, context: Any, status: int,
                            headers: Mapping[str, str]) -> Mapping[str, str] | None:
        ctx: RequestContext = context
        ctx.status = status
        ctype = headers.get(keys.HEADER_CONTENT_TYPE, "")
        ctx.sse = ctype.startswith(keys.CONTENT_TYPE_SSE)
        ctx.usage = self.parser.response_parser(ctx.request, headers)
        return ctx.response_headers or None

    def on_response_body(self, context: Any, chunk: bytes, end_of_stream: bool) -> bytes | None:
        ctx: RequestContext = context
        if ctx.usage is not None:
            ctx.usage.feed(chunk)
        if chunk:
            if not ctx.resp_bytes and not end_of_stream:
                ctx.first_at = time.monotonic()  # TTFT: the first chunk of a longer body
            ctx.resp_bytes += len(chunk)
            ctx.last = chunk
        if end_of_stream:
            ctx.body_ended = True
        if ctx.model_back is not None and chunk:
            a, b, c, d = ctx.model_back
            if a in chunk or c in chunk:
                return chunk.replace(a, b).replace(c, d)
        return None

    def on_upstream_failure(self, context: Any, address: str) -> None:
        self.core.upstream_failed(address)

    def on_done(self, context: Any, aborted: bool) -> bool:
        ctx: RequestContext = context
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
        return aborted


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
    target = headers.get(keys.HEADER_MODEL_REWRITE) or incoming
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
        objective=headers.get(keys.HEADER_OBJECTIVE),
        fairness_id=headers.get(keys.HEADER_FAIRNESS_ID),
        session_token=headers.get(keys.HEADER_SESSION_TOKEN),
    )
    return request, parsed


_OPENAI: Parser = OpenAIParser()


def _model_patterns(target: str, incoming: str) -> tuple[bytes, bytes, bytes, bytes]:
    """Byte patterns that rewrite the target model name back to the client's name."""
    t, i = orjson.dumps(target), orjson.dumps(incoming)
    return (b'"model":' + t, b'"model":' + i, b'"model": ' + t, b'"model": ' + i)
