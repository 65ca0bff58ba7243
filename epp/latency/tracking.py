"""The request bookkeeping of GIE's predicted-latency plugins, shared by
``predicted-latency-producer`` (requestcontrol/requestdataproducer/predictedlatency) and
``predicted-latency-scorer`` (scheduling/scorer/predictedlatency, the older monolith).

Per request, in the order the scheduling core calls them:

1. :meth:`LatencyTracker.prepare` (PrepareData, before scheduling): read the SLO headers
   (``x-slo-ttft-ms``, ``x-slo-tpot-ms``; 0 when absent), take each candidate's prefix
   cache score, and predict TTFT and TPOT for every candidate in one bulk call. Each
   prediction is checked against the SLOs: TTFT headroom = TTFT SLO − predicted TTFT;
   in streaming mode TPOT headroom = buffered TPOT SLO − predicted TPOT, the buffered SLO
   being ``sloBufferFactor`` × the request's TPOT SLO, tightened to the smallest TPOT SLO
   of the requests already running on that endpoint; outside streaming mode TPOT is not
   checked (valid, headroom 0). Without SLO headers every headroom is negative (0 −
   predicted): the scorers then simply prefer the lowest predicted latency.
2. :meth:`LatencyTracker.pre_request` (after the decision): the request joins its
   endpoint's running requests (ordered by TPOT SLO) and its prompt's words join the
   endpoint's prefill tokens in flight (and the prefill endpoint's, when a ``prefill``
   profile chose one) — inputs of later predictions.
3. :meth:`LatencyTracker.response_measured` (the response ended; its body was seen):
   train and note what the metrics record. Streaming mode: TTFT is the time to the first
   body chunk of a streamed response (a response without one trains nothing), TPOT the
   average over the rest, (end − first chunk) / (output tokens − 1) — which needs the
   usage in the stream (``stream_options.include_usage``). Otherwise TTFT is the whole
   response time (GIE: "TTFT … represents the full e2e latency") and TPOT is not trained.
   A TTFT sample goes to the model with the prefill endpoint's inputs when there is one,
   else the target's; one TPOT sample per request with the target's. The inputs are the
   endpoint's metrics when the request was scheduled, as in GIE.
4. :meth:`LatencyTracker.response_complete` (always, aborted too): the request leaves its
   endpoint's running requests and the tokens-in-flight counters.

Where GIE's hooks run per response chunk (first-token time, sampled TPOT predictions),
this EPP's run once at the end with what the protocol front measured (the chunk times and
the usage). The outcome is the same, except that a prefill endpoint's tokens in flight
drop at the end of the response rather than at its first token, and sampled TPOT
predictions (``maxDecodeTokenSamplesForPrediction`` > 0) are made only where the predictor
needs no round trip (the in-process model, the sidecar's Bayesian ridge). Only 2xx
responses train (GIE trains on any response the model server ended). GIE keeps this state
in a cache that forgets a request after ``contextTTL`` without news; here the state is the
request's and the core reports the end of every request, aborted ones included, so
nothing is left to forget.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from epp.framework.interfaces import ResponseTimings
from epp.latency.predictor import LatencyPredictor
from epp.latency.sampler import DecodeTokenSampler
from epp.latency.types import (
    TYPE_TPOT,
    TYPE_TTFT,
    LatencyOutcome,
    LatencyPredictionInfo,
    PredictionRequest,
    PredictionResponse,
    PredictorError,
    TrainingEntry,
    add_prediction_duration,
    prompt_words,
    set_outcome,
    slo_headers,
)
from epp.scheduling.types import Endpoint, LLMRequest, Metrics, SchedulingResult

log = logging.getLogger(__name__)

#: GIE's ``Experimental_DefaultPrefillProfile``: the profile whose pick is the prefill
#: endpoint of a disaggregated request.
PREFILL_PROFILE = "prefill"
#: The role label value of a prefill endpoint (``endpointRoleLabel``).
PREFILL_ROLE = "prefill"


@dataclass(frozen=True)
class TrackingConfig:
    streaming_mode: bool
    endpoint_role_label: str = ""
    slo_buffer_factor: float = 1.0
    sampling_mean: float = 1000.0
    max_decode_samples: int = 0
    # The producer neutralizes TPOT outside streaming mode and on prefill endpoints
    # (TPOT valid, headroom 0); the monolith does not.
    neutralize_tpot: bool = True
    predict_in_prepare: bool = True


@dataclass(frozen=True, slots=True)
class EndpointPrediction:
    """GIE's ``endpointPredictionResult`` (``tpot_headroom`` is its ``Headroom``)."""

    endpoint: Endpoint
    ttft: float
    tpot: float
    ttft_valid: bool
    tpot_valid: bool
    is_valid: bool
    tpot_headroom: float
    ttft_headroom: float
    prefix_cache_score: float

    def info(self, dispatched: int = 0) -> LatencyPredictionInfo:
        return LatencyPredictionInfo(self.ttft_valid, self.tpot_valid, self.ttft_headroom,
                                     self.tpot_headroom, self.ttft, self.tpot, dispatched)


@dataclass(slots=True)
class RequestContext:
    """GIE's ``predictedLatencyCtx``: one request's state, kept in its plugin_state."""

    prompt_words: int
    ttft_slo: float = 0.0
    tpot_slo: float = 0.0
    prefix_scores: dict[str, float] = field(default_factory=dict)
    predictions: dict[str, EndpointPrediction] = field(default_factory=dict)
    # The monolith's admission: False when every endpoint violates the SLOs, has running
    # requests, none is cold and none is sticky.
    has_valid_endpoint: bool = True
    target: Endpoint | None = None
    prefill_target: Endpoint | None = None
    primary_profile: str = ""
    metrics_by_profile: dict[str, Metrics] = field(default_factory=dict)
    dispatched_at: float = 0.0
    prefill_tokens_at_dispatch: int = 0
    prefill_tokens_at_dispatch_on_prefill: int = 0
    predicted_ttft: float = 0.0
    finished: bool = False


class RunningRequests:
    """GIE's ``requestPriorityQueue``: the requests running on one endpoint, smallest
    TPOT SLO first; add and remove by request id."""

    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, int] = {}  # id -> its heap entry's sequence number
        self._seq = itertools.count()

    def add(self, request_id: str, tpot_slo: float) -> bool:
        """False (nothing added) for an empty id, a negative SLO or an id already in."""
        if not request_id or tpot_slo < 0 or request_id in self._live:
            return False
        seq = next(self._seq)
        self._live[request_id] = seq
        heapq.heappush(self._heap, (tpot_slo, seq, request_id))
        return True

    def remove(self, request_id: str) -> bool:
        if self._live.pop(request_id, None) is None:
            return False
        self._prune()
        if len(self._heap) > 2 * len(self._live) + 16:  # too many stale entries: rebuild
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)
        return True

    def _prune(self) -> None:
        heap = self._heap
        while heap and self._live.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)

    def peek(self) -> float | None:
        """The smallest TPOT SLO (None when empty)."""
        self._prune()
        return self._heap[0][0] if self._heap else None

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)


class LatencyTracker:
    """The per-request state machine (module doc). ``name`` keys the state in each
    request's plugin_state (two plugins keep separate state)."""

    def __init__(self, name: str, config: TrackingConfig, predictor: LatencyPredictor) -> None:
        self.config = config
        self.predictor = predictor
        self._state_key = f"latency-tracker/{name}"
        self.running: dict[str, RunningRequests] = {}
        self.prefill_tokens: dict[str, int] = {}

    # ------------------------------------------------------------------ state

    def context(self, request: LLMRequest) -> RequestContext | None:
        ctx: RequestContext | None = request.plugin_state.get(self._state_key)
        return ctx

    def new_context(self, request: LLMRequest) -> RequestContext:
        return RequestContext(prompt_words(request.prompt))

    def store(self, request: LLMRequest, ctx: RequestContext) -> None:
        request.plugin_state[self._state_key] = ctx

    def running_count(self, key: str) -> int:
        """Requests this EPP has running on endpoint ``key`` (GIE's dispatched count)."""
        queue = self.running.get(key)
        return len(queue) if queue is not None else 0

    def min_tpot_slo(self, key: str) -> float:
        """The smallest TPOT SLO of the requests running on ``key`` (0: none)."""
        queue = self.running.get(key)
        if queue is None:
            return 0.0
        low = queue.peek()
        return low if low is not None else 0.0

    def pod_type(self, endpoint: Endpoint) -> str:
        label = self.config.endpoint_role_label
        return endpoint.labels.get(label, "") if label else ""

    def has_prefill_role(self, endpoint: Endpoint) -> bool:
        return bool(self.config.endpoint_role_label) and self.pod_type(endpoint) == PREFILL_ROLE

    # ------------------------------------------------------------------ 1. prepare

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint],
                      prefix_scores: Mapping[str, float]) -> list[EndpointPrediction] | None:
        """Parse the SLOs, predict for ``endpoints`` (None: no predictions — disabled or
        failed), then store the context. A cancelled call stores nothing (GIE: no context
        published after the PrepareData budget ran out)."""
        ctx = self.context(request) or self.new_context(request)
        ctx.ttft_slo, ctx.tpot_slo = slo_headers(request)
        for e in endpoints:
            ctx.prefix_scores[e.key] = prefix_scores.get(e.key, 0.0)
        predictions: list[EndpointPrediction] | None = None
        if self.config.predict_in_prepare:
            predictions = await self.generate(request, ctx, endpoints)
            if predictions is not None and len(predictions) == len(endpoints):
                ctx.predictions = {p.endpoint.key: p for p in predictions}
            else:
                predictions = None
        self.store(request, ctx)
        return predictions

    async def generate(self, request: LLMRequest, ctx: RequestContext,
                       endpoints: Sequence[Endpoint]) -> list[EndpointPrediction] | None:
        """GIE's ``generatePredictions``: one bulk prediction, each checked against the
        SLOs. None when the predictor failed."""
        if not endpoints:
            return []
        rows = [PredictionRequest(
            kv_cache_percentage=e.metrics.kv_cache_usage,
            input_token_length=ctx.prompt_words,
            num_request_waiting=e.metrics.waiting_queue_size,
            num_request_running=e.metrics.running_requests,
            num_tokens_generated=1,
            prefix_cache_score=ctx.prefix_scores.get(e.key, 0.0),
            pod_type=self.pod_type(e),
            prefill_tokens_in_flight=self.prefill_tokens.get(e.key, 0),
        ) for e in endpoints]
        t0 = time.perf_counter()
        try:
            bulk = await self.predictor.predict_bulk_strict(rows)
        except PredictorError as err:
            log.debug("bulk prediction failed: %s", err,
                      extra={"request_id": request.request_id})
            return None
        seconds = time.perf_counter() - t0
        add_prediction_duration(request, TYPE_TTFT, seconds)
        add_prediction_duration(request, TYPE_TPOT, seconds)
        if len(bulk.predictions) != len(rows):
            log.debug("bulk prediction returned %d predictions for %d endpoints",
                      len(bulk.predictions), len(rows))
            return None
        out = []
        for e, p in zip(endpoints, bulk.predictions, strict=True):
            ttft_ok, tpot_ok, valid, tpot_headroom, ttft_headroom = self.validate(
                p, ctx, self.min_tpot_slo(e.key))
            if self.config.neutralize_tpot and (not self.config.streaming_mode
                                                or self.has_prefill_role(e)):
                # TPOT is untrained outside streaming mode, meaningless on prefill pods.
                tpot_ok, tpot_headroom, valid = True, 0.0, ttft_ok
            out.append(EndpointPrediction(e, p.ttft_ms, p.tpot_ms, ttft_ok, tpot_ok, valid,
                                          tpot_headroom, ttft_headroom,
                                          ctx.prefix_scores.get(e.key, 0.0)))
        return out

    def validate(self, p: PredictionResponse, ctx: RequestContext,
                 pod_min_tpot_slo: float) -> tuple[bool, bool, bool, float, float]:
        """GIE's ``validatePrediction``: (TTFT ok, TPOT ok, both, TPOT headroom, TTFT
        headroom)."""
        ttft_ok = p.ttft_ms < ctx.ttft_slo
        ttft_headroom = ctx.ttft_slo - p.ttft_ms
        tpot_ok, tpot_headroom = True, 0.0
        if self.config.streaming_mode:
            factor = self.config.slo_buffer_factor
            buffered = ctx.tpot_slo * factor
            if pod_min_tpot_slo > 0:
                buffered = min(buffered, pod_min_tpot_slo * factor)
            tpot_ok = p.tpot_ms < buffered
            tpot_headroom = buffered - p.tpot_ms
        return ttft_ok, tpot_ok, ttft_ok and tpot_ok, tpot_headroom, ttft_headroom

    # ------------------------------------------------------------------ 2. pre-request

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        primary = result.profile_results.get(result.primary_profile)
        if primary is None or not primary.endpoints:
            return
        ctx = self.context(request)
        if ctx is None:  # PrepareData did not run (or ran out of time): nothing to track
            return
        target = primary.endpoints[0]
        self.running.setdefault(target.key, RunningRequests()).add(request.request_id,
                                                                   ctx.tpot_slo)
        ctx.target = target
        prefill = result.profile_results.get(PREFILL_PROFILE)
        ctx.prefill_target = prefill.endpoints[0] if prefill is not None and prefill.endpoints \
            else None
        ctx.primary_profile = result.primary_profile
        ctx.metrics_by_profile = {name: r.endpoints[0].metrics
                                  for name, r in result.profile_results.items()
                                  if r is not None and r.endpoints}
        ctx.dispatched_at = time.monotonic()
        words = ctx.prompt_words
        if ctx.prefill_target is not None:
            key = ctx.prefill_target.key
            self.prefill_tokens[key] = self.prefill_tokens.get(key, 0) + words
            ctx.prefill_tokens_at_dispatch_on_prefill = self.prefill_tokens[key]
        self.prefill_tokens[target.key] = self.prefill_tokens.get(target.key, 0) + words
        ctx.prefill_tokens_at_dispatch = self.prefill_tokens[target.key]
        stored = ctx.predictions.get((ctx.prefill_target or target).key)
        ctx.predicted_ttft = stored.ttft if stored is not None else 0.0

    # ------------------------------------------------------------------ 3. measured

    def response_measured(self, request: LLMRequest, endpoint_key: str,
                          timings: ResponseTimings) -> None:
        ctx = self.context(request)
        if ctx is None or ctx.target is None or ctx.finished:
            return
        if not 200 <= timings.status < 300:
            return
        cfg = self.config
        ttft_ms = 0.0
        generated = 0
        predicted_tpots: list[float] = []
        if cfg.streaming_mode:
            if timings.ttft is not None:
                ttft_ms = 1000.0 * timings.ttft
                generated = max(1, timings.output_tokens or 1)
                self._train_ttft(ctx, ttft_ms)
                stored = ctx.predictions.get(ctx.target.key)
                predicted_tpots.append(stored.tpot if stored is not None else 0.0)
                predicted_tpots.extend(self._sampled_tpot_predictions(request, ctx, generated))
        else:
            ttft_ms = 1000.0 * timings.seconds
            generated = 1
            self._train_ttft(ctx, ttft_ms)
        predicted_ttft_s = ttft_violated = None
        if ttft_ms > 0:
            predicted_ttft_s = ctx.predicted_ttft / 1000.0
            if ctx.ttft_slo > 0:
                ttft_violated = ttft_ms > ctx.ttft_slo
        avg_tpot_ms = 0.0
        if ttft_ms > 0 and generated > 1 and timings.tpot is not None:
            avg_tpot_ms = 1000.0 * timings.tpot
        predicted_tpot_s = tpot_violated = None
        if avg_tpot_ms > 0:
            avg_predicted = sum(predicted_tpots) / len(predicted_tpots) if predicted_tpots \
                else 0.0
            predicted_tpot_s = avg_predicted / 1000.0
            if ctx.tpot_slo > 0:
                tpot_violated = avg_tpot_ms > ctx.tpot_slo
            self._train_tpot(ctx, avg_tpot_ms)
        if predicted_ttft_s is not None or predicted_tpot_s is not None:
            set_outcome(request, LatencyOutcome(predicted_ttft_s, predicted_tpot_s,
                                                ttft_violated, tpot_violated))

    def _sampled_tpot_predictions(self, request: LLMRequest, ctx: RequestContext,
                                  generated: int) -> list[float]:
        """GIE's sampled TPOT predictions (tokens picked by the decode-token sampler),
        made now with the target's inputs at scheduling time."""
        cfg = self.config
        if cfg.max_decode_samples <= 0 or generated < 2 or ctx.target is None:
            return []
        m = ctx.metrics_by_profile.get(ctx.primary_profile)
        if m is None:
            return []
        sampler = DecodeTokenSampler(request.request_id, cfg.sampling_mean,
                                     cfg.max_decode_samples)
        out = []
        for token in sampler.sampled_tokens(generated):
            row = PredictionRequest(m.kv_cache_usage, ctx.prompt_words, m.waiting_queue_size,
                                    m.running_requests, token, 0.0, self.pod_type(ctx.target))
            t0 = time.perf_counter()
            try:
                p = self.predictor.predict_local(row)
            except PredictorError:
                p = PredictionResponse(0.0, 0.0)  # GIE averages a failed prediction as 0
            if p is None:  # needs a round trip: not made here (module doc)
                continue
            add_prediction_duration(request, TYPE_TPOT, time.perf_counter() - t0)
            out.append(p.tpot_ms)
        return out

    def _train_ttft(self, ctx: RequestContext, ttft_ms: float) -> None:
        assert ctx.target is not None
        if ctx.prefill_target is not None:
            endpoint, m = ctx.prefill_target, ctx.metrics_by_profile.get(PREFILL_PROFILE)
        else:
            endpoint, m = ctx.target, ctx.metrics_by_profile.get(ctx.primary_profile)
        if m is None:
            return
        tokens = (ctx.prefill_tokens_at_dispatch_on_prefill
                  if ctx.prefill_tokens_at_dispatch_on_prefill > 0
                  else ctx.prefill_tokens_at_dispatch)
        self.predictor.add_training_data_bulk([TrainingEntry(
            kv_cache_percentage=m.kv_cache_usage, input_token_length=ctx.prompt_words,
            num_request_waiting=m.waiting_queue_size, num_request_running=m.running_requests,
            num_tokens_generated=0, actual_ttft_ms=ttft_ms, actual_tpot_ms=0.0,
            prefix_cache_score=ctx.prefix_scores.get(endpoint.key, 0.0),
            pod_type=self.pod_type(endpoint), prefill_tokens_in_flight=tokens,
            decode_tokens_in_flight=0)])

    def _train_tpot(self, ctx: RequestContext, avg_tpot_ms: float) -> None:
        assert ctx.target is not None
        m = ctx.metrics_by_profile.get(ctx.primary_profile)
        if m is None:
            return
        self.predictor.add_training_data_bulk([TrainingEntry(
            kv_cache_percentage=m.kv_cache_usage, input_token_length=ctx.prompt_words,
            num_request_waiting=m.waiting_queue_size, num_request_running=m.running_requests,
            num_tokens_generated=0, actual_ttft_ms=0.0, actual_tpot_ms=avg_tpot_ms,
            prefix_cache_score=0.0, pod_type=self.pod_type(ctx.target),
            prefill_tokens_in_flight=ctx.prefill_tokens_at_dispatch,
            decode_tokens_in_flight=0)])

    # ------------------------------------------------------------------ 4. complete

    def response_complete(self, request: LLMRequest, endpoint_key: str, aborted: bool) -> None:
        ctx = self.context(request)
        if ctx is None or ctx.target is None or ctx.finished:
            return
        ctx.finished = True
        if ctx.prefill_target is not None and ctx.prefill_tokens_at_dispatch_on_prefill > 0:
            self._decrement(ctx.prefill_target.key, ctx.prompt_words)
        if ctx.prefill_tokens_at_dispatch > 0:
            self._decrement(ctx.target.key, ctx.prompt_words)
        queue = self.running.get(ctx.target.key)
        if queue is not None:
            queue.remove(request.request_id)
            if not len(queue):
                del self.running[ctx.target.key]

    def _decrement(self, key: str, delta: int) -> None:
        """GIE's ``decrementEndpointCounter``: floor at 0, drop the entry at 0; a missing
        key stays missing."""
        current = self.prefill_tokens.get(key)
        if current is None or current <= 0:
            return
        left = max(0, current - delta)
        if left:
            self.prefill_tokens[key] = left
        else:
            del self.prefill_tokens[key]

    def endpoint_removed(self, key: str) -> None:
        self.running.pop(key, None)
        self.prefill_tokens.pop(key, None)


def prefix_score(total: int, matched: int) -> float:
    """matched / total prompt blocks (0 without blocks)."""
    return matched / total if total > 0 else 0.0
