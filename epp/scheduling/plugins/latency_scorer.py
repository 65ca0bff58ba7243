"""``latency-scorer`` (GIE v1.5.0 pkg/epp/framework/plugins/scheduling/scorer/latency):
scores endpoints by predicted latency headroom (SLO − predicted), from the
``LatencyPredictionInfo`` the ``predicted-latency-producer`` publishes.

- Some endpoints with positive headroom (TTFT and TPOT headroom >= 0): only they are
  scored (the others get 0), with ``headroomSelectionStrategy``.
- All negative: endpoints with no request dispatched by this EPP (idle) are scored alone
  when there are any; else only the least severe non-empty bucket — only TPOT negative,
  then only TTFT negative, then both — always with ``least``.
- Within the scored set, |TTFT headroom| and |TPOT headroom| are normalized to [0, 1]
  (0.5 when all are equal) and blended with ``ttftWeight``/``tpotWeight`` (normalized;
  when one dimension has no range the other gets all the weight). ``least`` scores
  (1 − blend), ``most`` the blend: ``int(x × 100) + 1`` hundredths (so in (0, 1.01],
  clamped to 1 by the scheduler).
- No predictions at all (predictor down, cold, or too slow): a composite of free KV
  cache, relative queue depth and prefix cache score, weighted by ``compositeKVWeight``,
  ``compositeQueueWeight``, ``compositePrefixWeight`` (normalized; all 0 → KV only).

Without SLO headers every headroom is 0 − predicted: the scorer prefers the lowest
predicted latency. Parameters: ``ttftWeight`` 0.8, ``tpotWeight`` 0.2,
``headroomSelectionStrategy`` ``least`` (or ``most``; anything else scores as ``least``,
as in GIE), ``compositeKVWeight``/``compositeQueueWeight``/``compositePrefixWeight`` 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

from epp.framework.handle import PluginHandle
from epp.framework.params import config_warning, param
from epp.latency.types import LatencyPredictionInfo, prediction_infos
from epp.scheduling.plugins.latency_common import (
    CONSUMES_LATENCY,
    CONSUMES_PREFIX,
    PrefixScores,
)
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

STRATEGY_LEAST = "least"
STRATEGY_MOST = "most"
_W_MAX = 100
_MIN_WEIGHT = 0
_EPS = 1e-9


@dataclass(frozen=True)
class LatencyScorerParameters:
    ttft_weight: float = param("ttftWeight", 0.8)
    tpot_weight: float = param("tpotWeight", 0.2)
    headroom_selection_strategy: str = param("headroomSelectionStrategy", STRATEGY_LEAST)
    composite_kv_weight: float = param("compositeKVWeight", 1.0)
    composite_queue_weight: float = param("compositeQueueWeight", 1.0)
    composite_prefix_weight: float = param("compositePrefixWeight", 1.0)


def normalized_weights(a: float, b: float) -> tuple[float, float]:
    total = a + b
    return (1.0, 0.0) if total <= 0 else (a / total, b / total)


class LatencyScorer:
    type_name = "latency-scorer"
    Parameters = LatencyScorerParameters
    consumes = MappingProxyType({**CONSUMES_LATENCY, **CONSUMES_PREFIX})

    def __init__(self, name: str, params: LatencyScorerParameters | None = None) -> None:
        self.name = name
        self.params = params or LatencyScorerParameters()
        self.prefix = PrefixScores()

    @classmethod
    def from_params(cls, name: str, params: LatencyScorerParameters,
                    handle: PluginHandle) -> LatencyScorer:
        if params.headroom_selection_strategy not in (STRATEGY_LEAST, STRATEGY_MOST):
            config_warning(f"{name}.headroomSelectionStrategy",
                           f"{params.headroom_selection_strategy!r} is neither 'least' nor "
                           "'most'; it scores as 'least' (as in GIE)")
        return cls(name, params)

    def bind(self, handle: PluginHandle) -> None:
        self.prefix.bind(handle)

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        infos = prediction_infos(request)
        data = [(i, infos.get(e.key)) for i, e in enumerate(endpoints)]
        if not any(info is not None for _, info in data):
            return self.composite(state, request, endpoints)
        scores = [0.0] * len(endpoints)
        positive = [(i, info) for i, info in data
                    if info is None or (info.ttft_headroom >= 0 and info.tpot_headroom >= 0)]
        if positive:
            self._score_bucket(positive, scores, force_least=False)
            return scores
        negative = [(i, info) for i, info in data if info is not None]
        idle = [(i, info) for i, info in negative if info.dispatched_request_count == 0]
        if idle:
            self._score_bucket(idle, scores, force_least=True)
            return scores
        tpot_only = [(i, n) for i, n in negative if n.tpot_headroom < 0 <= n.ttft_headroom]
        ttft_only = [(i, n) for i, n in negative if n.ttft_headroom < 0 <= n.tpot_headroom]
        both = [(i, n) for i, n in negative if n.ttft_headroom < 0 and n.tpot_headroom < 0]
        for bucket in (tpot_only, ttft_only, both):
            if bucket:
                self._score_bucket(bucket, scores, force_least=True)
                return scores
        self._score_bucket(negative, scores, force_least=True)
        return scores

    def _score_bucket(self, bucket: Sequence[tuple[int, LatencyPredictionInfo | None]],
                      scores: list[float], force_least: bool) -> None:
        p = self.params
        alpha, beta = normalized_weights(p.ttft_weight, p.tpot_weight)

        def heads(info: LatencyPredictionInfo | None) -> tuple[float, float]:
            # An endpoint without a prediction (only beside ones with) has headroom 0.
            return (abs(info.ttft_headroom), abs(info.tpot_headroom)) if info is not None \
                else (0.0, 0.0)

        values = [heads(info) for _, info in bucket]
        min_ttft = min(v[0] for v in values)
        max_ttft = max(v[0] for v in values)
        min_tpot = min(v[1] for v in values)
        max_tpot = max(v[1] for v in values)
        ttft_range, tpot_range = max_ttft - min_ttft, max_tpot - min_tpot
        if ttft_range <= _EPS < tpot_range:
            alpha, beta = 0.0, 1.0
        elif tpot_range <= _EPS < ttft_range:
            alpha, beta = 1.0, 0.0
        most = p.headroom_selection_strategy == STRATEGY_MOST and not force_least
        for (i, _), (h_ttft, h_tpot) in zip(bucket, values, strict=True):
            n_ttft = (h_ttft - min_ttft) / ttft_range if ttft_range > _EPS else 0.5
            n_tpot = (h_tpot - min_tpot) / tpot_range if tpot_range > _EPS else 0.5
            combined = alpha * n_ttft + beta * n_tpot
            x = combined if most else 1.0 - combined
            w = int(x * (_W_MAX - _MIN_WEIGHT)) + _MIN_WEIGHT + 1
            scores[i] = w / _W_MAX

    def composite(self, state: CycleState, request: LLMRequest,
                  endpoints: Sequence[Endpoint]) -> list[float]:
        """The fallback without predictions (module doc)."""
        p = self.params
        wkv, wq, wpref = (p.composite_kv_weight, p.composite_queue_weight,
                          p.composite_prefix_weight)
        total = wkv + wq + wpref
        if total <= 0:
            wkv, wq, wpref, total = 1.0, 0.0, 0.0, 1.0
        wkv, wq, wpref = wkv / total, wq / total, wpref / total
        max_q = max((e.metrics.waiting_queue_size for e in endpoints), default=0)
        max_q = max(max_q, 0)
        prefix = self.prefix.scores(state, request, endpoints) if wpref else {}
        out = []
        for e in endpoints:
            q = e.metrics.waiting_queue_size
            rel_queue = (max_q - q) / max_q if max_q > 0 else 1.0
            kv_free = 1.0 - e.metrics.kv_cache_usage
            composite = wkv * kv_free + wq * rel_queue + wpref * prefix.get(e.key, 0.0)
            w = _round_half_away(_MIN_WEIGHT + (_W_MAX - _MIN_WEIGHT) * composite)
            out.append(w / _W_MAX)
        return out


def _round_half_away(x: float) -> int:
    """Go's ``math.Round``: halves away from zero."""
    return math.floor(x + 0.5) if x >= 0 else -math.floor(-x + 0.5)
