"""``predicted-latency-scorer`` (GIE v1.5.0
pkg/epp/framework/plugins/scheduling/scorer/predictedlatency): GIE's older, all-in-one
latency plugin — predictor, SLO admission and a scorer that picks one endpoint itself
(score 1 for it, 0 for the others; a profile of this scorer alone with the default
max-score picker routes where it chose).

Before scheduling it predicts like the ``predicted-latency-producer`` (epp/latency/
tracking.py; no TPOT neutralization, ``streamingMode`` true by default) and marks the
request as having no valid endpoint when it has a TTFT SLO (and a TPOT SLO in streaming
mode), every prediction violates them, every endpoint has requests this EPP dispatched,
none is cold (KV cache < 2 %) and none has a prefix cache score >= ``affinityGateTauGlobal``.
Admission then refuses such a request when it is sheddable (negative priority).

Scoring, per request (``headroomSelectionStrategy`` ``least`` by default):

1. Missing predictions for any candidate → a weighted random pick by composite score
   (free KV cache, relative queue, prefix score; ``composite*Weight``).
2. Global affinity gate: with probability 1 − ``epsilonExploreSticky``, keep only the
   endpoints whose prefix score >= ``affinityGateTauGlobal`` (0.99), unless none is, or
   the best of them is predicted more than ``affinityMaxTTFTPenaltyMs`` slower (TTFT)
   than the best of all.
3. Tiers: positive (TTFT and TPOT headroom >= 0) and negative; with both, the negative
   tier with probability ``epsilonExploreNeg``.
4. Positive tier: the gate again with ``affinityGateTau`` (0.80); then weights from the
   normalized headroom blended by ``headroomTTFTWeight``/``headroomTPOTWeight`` (TTFT
   only outside streaming mode) — ``least`` favours the tightest fit, ``most`` the most
   headroom; ``composite-least``/``composite-most`` use composite scores instead.
   Negative tier: endpoints with no request dispatched by this EPP first; the gate with
   ``affinityGateTau``; then deficit weights per bucket (both SLOs violated, TTFT only,
   TPOT only; blended by ``negHeadroom*Weight``). ``composite-only`` skips the tiers.
5. Pick: weighted random (``selectionMode: linear``) or the largest weight (``max``).

Other parameters as the producer's, named as GIE names them here: ``samplingMean``,
``maxSampledTokens``, ``sloBufferFactor``, ``contextTTL``, ``streamingMode``,
``endpointRoleLabel``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, config_warning, param
from epp.latency.predictor import LatencyPredictor
from epp.latency.tracking import EndpointPrediction, LatencyTracker, TrackingConfig
from epp.latency.types import set_prediction_infos
from epp.scheduling.plugins.latency_admitter import COLD_KV_CACHE
from epp.scheduling.plugins.latency_common import (
    CONSUMES_PREFIX,
    NEEDS_BODY,
    PRODUCES_LATENCY,
    PrefixScores,
    TrackedPredictor,
    make_predictor,
    parse_context_ttl,
)
from epp.scheduling.plugins.latency_producer import check_tracking_parameters
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

LEAST = "least"
MOST = "most"
COMPOSITE_LEAST = "composite-least"
COMPOSITE_MOST = "composite-most"
COMPOSITE_ONLY = "composite-only"
STRATEGIES = (LEAST, MOST, COMPOSITE_LEAST, COMPOSITE_MOST, COMPOSITE_ONLY)
SELECTION_LINEAR = "linear"
SELECTION_MAX = "max"

_W_MAX = 100
_MIN_WEIGHT = 1
_EPS = 1e-9
_NEG_RANGE = 80  # GIE's Wrange for negative-headroom deficits


@dataclass(frozen=True)
class PredictedLatencyScorerParameters:
    sampling_mean: float = param("samplingMean", 1000.0)
    max_sampled_tokens: int = param("maxSampledTokens", 0)
    slo_buffer_factor: float = param("sloBufferFactor", 1.0)
    neg_headroom_ttft_weight: float = param("negHeadroomTTFTWeight", 0.8)
    neg_headroom_tpot_weight: float = param("negHeadroomTPOTWeight", 0.2)
    headroom_ttft_weight: float = param("headroomTTFTWeight", 0.8)
    headroom_tpot_weight: float = param("headroomTPOTWeight", 0.2)
    headroom_selection_strategy: str = param("headroomSelectionStrategy", LEAST)
    composite_kv_weight: float = param("compositeKVWeight", 1.0)
    composite_queue_weight: float = param("compositeQueueWeight", 1.0)
    composite_prefix_weight: float = param("compositePrefixWeight", 1.0)
    epsilon_explore_sticky: float = param("epsilonExploreSticky", 0.01)
    epsilon_explore_neg: float = param("epsilonExploreNeg", 0.01)
    affinity_gate_tau: float = param("affinityGateTau", 0.80)
    affinity_gate_tau_global: float = param("affinityGateTauGlobal", 0.99)
    affinity_max_ttft_penalty_ms: float = param("affinityMaxTTFTPenaltyMs", 5000.0)
    context_ttl_s: float = param("contextTTL", 300.0, parse=parse_context_ttl)
    selection_mode: str = param("selectionMode", SELECTION_LINEAR)
    streaming_mode: bool = param("streamingMode", True)
    endpoint_role_label: str = param("endpointRoleLabel", "")

    def __post_init__(self) -> None:
        check_tracking_parameters(self.sampling_mean, self.max_sampled_tokens, "maxSampledTokens",
                        self.slo_buffer_factor)
        for key, v in (("negHeadroomTTFTWeight", self.neg_headroom_ttft_weight),
                       ("negHeadroomTPOTWeight", self.neg_headroom_tpot_weight),
                       ("headroomTTFTWeight", self.headroom_ttft_weight),
                       ("headroomTPOTWeight", self.headroom_tpot_weight)):
            if v < 0:
                raise ParameterError(key, f"all headroom weights must be >= 0, got {v:g}")
        for key, v in (("compositeKVWeight", self.composite_kv_weight),
                       ("compositeQueueWeight", self.composite_queue_weight),
                       ("compositePrefixWeight", self.composite_prefix_weight)):
            if v < 0:
                raise ParameterError(key, f"composite weights must be >= 0, got {v:g}")
        for key, v in (("epsilonExploreSticky", self.epsilon_explore_sticky),
                       ("epsilonExploreNeg", self.epsilon_explore_neg),
                       ("affinityGateTau", self.affinity_gate_tau),
                       ("affinityGateTauGlobal", self.affinity_gate_tau_global)):
            if not 0.0 <= v <= 1.0:
                raise ParameterError(key, f"must be in [0, 1], got {v:g}")
        if self.affinity_max_ttft_penalty_ms < 0:
            raise ParameterError("affinityMaxTTFTPenaltyMs",
                                 f"must be >= 0, got {self.affinity_max_ttft_penalty_ms:g}")


@dataclass(frozen=True, slots=True)
class _Choice:
    endpoint: Endpoint
    weight: int


class PredictedLatencyScorer(TrackedPredictor):
    type_name = "predicted-latency-scorer"
    Parameters = PredictedLatencyScorerParameters
    produces = MappingProxyType(PRODUCES_LATENCY)
    consumes = MappingProxyType(CONSUMES_PREFIX)
    response_needs = NEEDS_BODY

    def __init__(self, name: str, params: PredictedLatencyScorerParameters | None = None,
                 predictor: LatencyPredictor | None = None,
                 rng: random.Random | None = None) -> None:
        self.name = name
        self.params = p = params or PredictedLatencyScorerParameters()
        self.strategy = p.headroom_selection_strategy or LEAST
        self.predictor = make_predictor(predictor)
        self.tracker = LatencyTracker(name, TrackingConfig(
            streaming_mode=p.streaming_mode, endpoint_role_label=p.endpoint_role_label,
            slo_buffer_factor=p.slo_buffer_factor, sampling_mean=p.sampling_mean,
            max_decode_samples=p.max_sampled_tokens, neutralize_tpot=False),
            self.predictor)
        self.prefix = PrefixScores()
        self._rng = rng or random.Random()

    @classmethod
    def from_params(cls, name: str, params: PredictedLatencyScorerParameters,
                    handle: PluginHandle) -> PredictedLatencyScorer:
        if params.headroom_selection_strategy not in (*STRATEGIES, ""):
            config_warning(f"{name}.headroomSelectionStrategy",
                           f"{params.headroom_selection_strategy!r} is not one of "
                           f"{', '.join(STRATEGIES)}; it weighs as 'least' (as in GIE)")
        if params.selection_mode not in (SELECTION_LINEAR, SELECTION_MAX):
            config_warning(f"{name}.selectionMode",
                           f"{params.selection_mode!r} is neither 'linear' nor 'max'; it "
                           "selects as 'linear' (as in GIE)")
        return cls(name, params)

    def bind(self, handle: PluginHandle) -> None:
        self.prefix.bind(handle)

    # ------------------------------------------------------------------ PrepareData

    async def prepare_request_data(self, request: LLMRequest,
                                   endpoints: Sequence[Endpoint]) -> None:
        scores = self.prefix.scores(CycleState(), request, endpoints)
        predictions = await self.tracker.prepare(request, endpoints, scores)
        if predictions is None:
            return
        ctx = self.tracker.context(request)
        assert ctx is not None
        if self._no_valid_endpoint(ctx.ttft_slo, ctx.tpot_slo, predictions, endpoints):
            ctx.has_valid_endpoint = False
        set_prediction_infos(request, {p.endpoint.key: p.info() for p in predictions})

    def _no_valid_endpoint(self, ttft_slo: float, tpot_slo: float,
                           predictions: Sequence[EndpointPrediction],
                           endpoints: Sequence[Endpoint]) -> bool:
        """GIE's ``updateHasValidPod``."""
        p = self.params
        if not (ttft_slo > 0 and (tpot_slo > 0 or not p.streaming_mode)):
            return False  # no SLO to violate
        if any(pred.is_valid for pred in predictions):
            return False
        if any(self.tracker.running_count(pred.endpoint.key) == 0 for pred in predictions):
            return False
        if any(e.metrics.kv_cache_usage < COLD_KV_CACHE for e in endpoints):
            return False
        tau = p.affinity_gate_tau_global
        return not (tau > 0 and any(pred.prefix_cache_score >= tau for pred in predictions))

    # ------------------------------------------------------------------ admission

    def admit_request(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> str | None:
        ctx = self.tracker.context(request)
        if ctx is None:  # fail open
            return None
        if not ctx.has_valid_endpoint and request.priority < 0:
            return "no valid endpoint available to serve the request"
        return None

    # ------------------------------------------------------------------ scoring

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        ctx = self.tracker.context(request)
        if ctx is None:
            ctx = self.tracker.new_context(request)
            self.tracker.store(request, ctx)
        preds = [ctx.predictions[e.key] for e in endpoints if e.key in ctx.predictions]
        if len(preds) != len(endpoints):
            candidates = [EndpointPrediction(e, 0.0, 0.0, True, True, True, 0.0, 0.0,
                                             ctx.prefix_scores.get(e.key, 0.0))
                          for e in endpoints]
            chosen = self._composite_pick(candidates, COMPOSITE_ONLY)
        else:
            preds, _ = self._affinity_gate(preds, self.params.affinity_gate_tau_global)
            chosen = self._select(preds)
        return [1.0 if chosen is not None and e is chosen else 0.0 for e in endpoints]

    def _select(self, preds: list[EndpointPrediction]) -> Endpoint | None:
        """GIE's ``selectEndpointBasedOnStrategy``."""
        positive = [p for p in preds if p.tpot_headroom >= 0 and p.ttft_headroom >= 0]
        negative = [p for p in preds if not (p.tpot_headroom >= 0 and p.ttft_headroom >= 0)]
        if self.strategy == COMPOSITE_ONLY:
            return self._composite_pick(preds, COMPOSITE_ONLY)
        if positive and negative:
            if self._rng.random() < self.params.epsilon_explore_neg:
                return self._select_negative(negative)
            return self._select_positive(positive)
        if positive:
            return self._select_positive(positive)
        if negative:
            return self._select_negative(negative)
        if preds:
            return preds[self._rng.randrange(len(preds))].endpoint
        return None

    def _affinity_gate(self, candidates: list[EndpointPrediction],
                       threshold: float) -> tuple[list[EndpointPrediction], bool]:
        """GIE's ``epsilonGreedyAffinityGate``: (the candidates kept, gated?)."""
        if threshold <= 0:
            return candidates, False
        eligible = [p for p in candidates if p.prefix_cache_score >= threshold]
        if not eligible:
            return candidates, False
        if self._rng.random() < self.params.epsilon_explore_sticky:
            return candidates, False
        max_penalty = self.params.affinity_max_ttft_penalty_ms
        if max_penalty > 0:
            best_all = min((p.ttft for p in candidates if p.ttft > 0), default=math.inf)
            best_sticky = min((p.ttft for p in eligible if p.ttft > 0), default=math.inf)
            if math.isfinite(best_all) and math.isfinite(best_sticky) \
                    and best_sticky - best_all > max_penalty:
                return candidates, False
        return eligible, True

    def _select_positive(self, preds: list[EndpointPrediction]) -> Endpoint | None:
        if len(preds) == 1:
            return preds[0].endpoint
        candidates, sticky = self._affinity_gate(preds, self.params.affinity_gate_tau)
        if sticky and len(candidates) == 1:
            return candidates[0].endpoint
        if self.strategy in (COMPOSITE_MOST, COMPOSITE_LEAST):
            return self._composite_pick(candidates, self.strategy)
        p = self.params
        alpha, beta = p.headroom_ttft_weight, p.headroom_tpot_weight
        if not p.streaming_mode:
            alpha, beta = 1.0, 0.0
        if alpha + beta <= 0:
            alpha, beta = 1.0, 0.0
        total_w = alpha + beta
        alpha, beta = alpha / total_w, beta / total_w
        min_tpot = min(c.tpot_headroom for c in candidates)
        max_tpot = max(c.tpot_headroom for c in candidates)
        min_ttft = min(c.ttft_headroom for c in candidates)
        max_ttft = max(c.ttft_headroom for c in candidates)
        tpot_range, ttft_range = max_tpot - min_tpot, max_ttft - min_ttft
        choices = []
        for c in candidates:
            n_tpot = (c.tpot_headroom - min_tpot) / (tpot_range + _EPS) if tpot_range > _EPS \
                else 0.5
            n_ttft = (c.ttft_headroom - min_ttft) / (ttft_range + _EPS) if ttft_range > _EPS \
                else 0.5
            combined = alpha * n_ttft + beta * n_tpot
            x = combined if self.strategy == MOST else 1.0 - combined
            choices.append(_Choice(c.endpoint,
                                   int(x * (_W_MAX - _MIN_WEIGHT)) + _MIN_WEIGHT + 1))
        return self._weighted_pick(choices, sum(ch.weight for ch in choices), candidates)

    def _select_negative(self, preds: list[EndpointPrediction]) -> Endpoint | None:
        if len(preds) == 1:
            return preds[0].endpoint
        idle = [p for p in preds if self.tracker.running_count(p.endpoint.key) == 0]
        busy = [p for p in preds if self.tracker.running_count(p.endpoint.key) != 0]
        group = idle or busy
        if len(group) == 1:
            return group[0].endpoint
        candidates, sticky = self._affinity_gate(group, self.params.affinity_gate_tau)
        if sticky and len(candidates) == 1:
            return candidates[0].endpoint
        if self.strategy in (COMPOSITE_MOST, COMPOSITE_LEAST):
            return self._composite_pick(candidates, self.strategy)
        p = self.params
        alpha, beta = p.neg_headroom_ttft_weight, p.neg_headroom_tpot_weight
        if not p.streaming_mode:
            alpha, beta = 1.0, 0.0
        both = [c for c in candidates if c.ttft_headroom < 0 and c.tpot_headroom < 0]
        ttft_only = [c for c in candidates if c.ttft_headroom < 0 <= c.tpot_headroom]
        tpot_only = [c for c in candidates if c.tpot_headroom < 0 <= c.ttft_headroom]
        neither = [c for c in candidates if c.ttft_headroom >= 0 and c.tpot_headroom >= 0]
        choices: list[_Choice] = []
        for bucket in (both, ttft_only, tpot_only):
            choices.extend(self._deficit_choices(bucket, alpha, beta))
        choices.extend(_Choice(c.endpoint, _MIN_WEIGHT) for c in neither)
        return self._weighted_pick(choices, sum(ch.weight for ch in choices), candidates)

    @staticmethod
    def _deficit_choices(bucket: list[EndpointPrediction], alpha: float,
                         beta: float) -> list[_Choice]:
        """GIE's ``weightEndpointsByBlendedDeficit``: less deficit, more weight."""
        if not bucket:
            return []
        defs = [(max(0.0, -c.ttft_headroom), max(0.0, -c.tpot_headroom)) for c in bucket]
        min_ttft, max_ttft = min(d[0] for d in defs), max(d[0] for d in defs)
        min_tpot, max_tpot = min(d[1] for d in defs), max(d[1] for d in defs)
        ttft_range, tpot_range = max_ttft - min_ttft, max_tpot - min_tpot
        if alpha + beta <= 0:
            alpha, beta = 1.0, 0.0
        else:
            total = alpha + beta
            alpha, beta = alpha / total, beta / total
        out = []
        for c, (d_ttft, d_tpot) in zip(bucket, defs, strict=True):
            n_ttft = (d_ttft - min_ttft) / (ttft_range + _EPS) if ttft_range > _EPS else 0.0
            n_tpot = (d_tpot - min_tpot) / (tpot_range + _EPS) if tpot_range > _EPS else 0.0
            blended = alpha * n_ttft + beta * n_tpot
            out.append(_Choice(c.endpoint, int((1.0 - blended) * _NEG_RANGE) + _MIN_WEIGHT + 1))
        return out

    def _composite_pick(self, candidates: Sequence[EndpointPrediction],
                        strategy: str) -> Endpoint | None:
        """GIE's ``selectFromCompositeScores``: weights from free KV cache, relative
        queue and prefix score; ``composite-least`` inverts them (against the total of the
        uninverted weights, as GIE does)."""
        if not candidates:
            return None
        p = self.params
        wkv, wq, wpref = (p.composite_kv_weight, p.composite_queue_weight,
                          p.composite_prefix_weight)
        total_w = wkv + wq + wpref
        if total_w <= 0:
            wkv, wq, wpref = 1.0, 0.0, 0.0
        else:
            wkv, wq, wpref = wkv / total_w, wq / total_w, wpref / total_w
        queues = [c.endpoint.metrics.waiting_queue_size for c in candidates]
        low, high = min(queues), max(queues)
        den = high - low
        choices, total = [], 0
        for c, q in zip(candidates, queues, strict=True):
            rel_queue = (high - q) / den if den > 0 else 1.0
            composite = (wkv * (1.0 - c.endpoint.metrics.kv_cache_usage) + wq * rel_queue
                         + wpref * c.prefix_cache_score)
            w = math.floor(_MIN_WEIGHT + (_W_MAX - _MIN_WEIGHT) * composite + 0.5)
            total += w
            choices.append(_Choice(c.endpoint, w))
        if strategy == COMPOSITE_LEAST:
            choices = [_Choice(ch.endpoint, _MIN_WEIGHT + _W_MAX - ch.weight) for ch in choices]
        return self._weighted_pick(choices, total, candidates)

    def _weighted_pick(self, choices: Sequence[_Choice], total: int,
                       candidates: Sequence[EndpointPrediction]) -> Endpoint | None:
        """GIE's ``performWeightedRandomSelection`` (``selectionMode``)."""
        if total <= 0:
            return None
        if self.params.selection_mode == SELECTION_MAX:
            best, best_w = None, 0
            for ch in choices:
                if ch.weight > best_w:
                    best, best_w = ch.endpoint, ch.weight
            return best if best is not None else candidates[0].endpoint
        idx = self._rng.randrange(total)
        for ch in choices:
            if idx < ch.weight:
                return ch.endpoint
            idx -= ch.weight
        return candidates[0].endpoint

