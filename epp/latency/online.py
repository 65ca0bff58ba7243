"""The in-process latency predictor: linear models learned online from the EPP's own
responses, the default when no sidecar is configured (epp/latency/predictor.py).

Inputs are GIE's (latencypredictor/ training and prediction servers, Bayesian-ridge
feature sets): for TTFT ``is_queued`` (waiting > 0), ``kv_cache_percentage``,
``input_token_length``, ``num_request_waiting``, ``num_request_running``,
``prefill_tokens_in_flight``, ``decode_tokens_in_flight``, ``prefix_cache_score`` and
``effective_input_tokens`` = (1 − prefix_cache_score) × input_token_length; for TPOT the
same load features with ``num_tokens_generated`` instead of the prefix terms. Each
feature is divided by a fixed scale (tokens by 1000, request counts by 10, generated
tokens by 100) so the prior weighs them alike; plus an intercept. GIE's ``pod_type``
(``""``, ``prefill``, ``decode``; anything else counts as ``""``) selects a model of its
own, as GIE's trees split on it.

Learning: recursive least squares (exponentially weighted, forgetting factor
``forgetting``, 0.999 by default: an effective memory of about 1000 samples, so the model
follows pods whose speed drifts). Each sample costs O(d²) with d ≤ 10 features; memory is
one d×d matrix and one weight vector per model — six models at most, whatever the
traffic. The covariance is kept symmetric, and forgetting never inflates it past the
prior along an input that does not vary (no wind-up).

Cold start: a model answers only after ``min_samples`` samples (20 by default); before
that a TTFT prediction raises :class:`PredictorNotReady` — as GIE's prediction server
answers 503 "Models not ready" — and the plugins fall back to their no-prediction
behaviour (the ``latency-scorer``'s composite score, admission fails open). A TPOT model
that is not ready predicts 0 ms (non-streaming traffic never trains it; GIE's producer
neutralizes TPOT then). Predictions are clipped at 0 ms, as the servers clip them.
The objective is the mean (GIE's servers default to the 0.9 quantile of tree models).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from epp.latency.types import (
    OBJECTIVE_MEAN,
    POD_TYPES,
    BulkPredictionResponse,
    PredictionRequest,
    PredictionResponse,
    PredictorNotReady,
    TrainingEntry,
    validate_prediction_request,
)

MODEL_TYPE = "online-linear"

TTFT_FEATURES = ("is_queued", "kv_cache_percentage", "input_token_length",
                 "num_request_waiting", "num_request_running", "prefill_tokens_in_flight",
                 "decode_tokens_in_flight", "prefix_cache_score", "effective_input_tokens")
TPOT_FEATURES = ("is_queued", "kv_cache_percentage", "input_token_length",
                 "num_request_waiting", "num_request_running", "prefill_tokens_in_flight",
                 "decode_tokens_in_flight", "num_tokens_generated")

_TOKENS = 1000.0
_REQUESTS = 10.0
_GENERATED = 100.0


def ttft_features(r: PredictionRequest) -> list[float]:
    """The scaled TTFT inputs of ``r`` and the intercept's 1."""
    return [1.0 if r.num_request_waiting > 0 else 0.0, r.kv_cache_percentage,
            r.input_token_length / _TOKENS, r.num_request_waiting / _REQUESTS,
            r.num_request_running / _REQUESTS, r.prefill_tokens_in_flight / _TOKENS,
            r.decode_tokens_in_flight / _TOKENS, r.prefix_cache_score,
            (1.0 - r.prefix_cache_score) * r.input_token_length / _TOKENS, 1.0]


def tpot_features(r: PredictionRequest) -> list[float]:
    """The scaled TPOT inputs of ``r`` and the intercept's 1."""
    return [1.0 if r.num_request_waiting > 0 else 0.0, r.kv_cache_percentage,
            r.input_token_length / _TOKENS, r.num_request_waiting / _REQUESTS,
            r.num_request_running / _REQUESTS, r.prefill_tokens_in_flight / _TOKENS,
            r.decode_tokens_in_flight / _TOKENS, r.num_tokens_generated / _GENERATED, 1.0]


class RecursiveLeastSquares:
    """Exponentially weighted recursive least squares over ``dim`` inputs.

    ``forgetting`` (λ ∈ (0, 1]): a sample's weight decays by λ per later sample.
    ``prior`` (δ): the initial covariance δ·I — a ridge penalty of 1/δ on the weights.
    Forgetting inflates the covariance only along inputs whose variance is below the
    prior (P ← D·P·D, D diagonal): an input that stops varying (or never varies, like
    GIE's decode tokens in flight) does not wind the covariance up.
    """

    __slots__ = ("dim", "forgetting", "p", "prior", "samples", "w")

    def __init__(self, dim: int, forgetting: float = 0.999, prior: float = 1000.0) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if prior <= 0:
            raise ValueError(f"prior must be > 0, got {prior}")
        self.dim = dim
        self.forgetting = forgetting
        self.prior = prior
        self.w = [0.0] * dim
        self.p = [[prior if i == j else 0.0 for j in range(dim)] for i in range(dim)]
        self.samples = 0

    def predict(self, x: Sequence[float]) -> float:
        return sum(wi * xi for wi, xi in zip(self.w, x, strict=True))

    def update(self, x: Sequence[float], y: float) -> None:
        """Learn one sample (x → y); a non-finite one is ignored."""
        if not math.isfinite(y) or not all(math.isfinite(v) for v in x):
            return
        p, dim, lam = self.p, self.dim, self.forgetting
        px = [math.fsum(row[j] * x[j] for j in range(dim)) for row in p]
        denom = lam + math.fsum(x[i] * px[i] for i in range(dim))
        if denom <= 0 or not math.isfinite(denom):
            return
        gain = [v / denom for v in px]
        err = y - self.predict(x)
        self.w = [wi + gi * err for wi, gi in zip(self.w, gain, strict=True)]
        for i in range(dim):
            row, gi = p[i], gain[i]
            for j in range(i, dim):
                v = row[j] - gi * px[j]
                row[j] = v
                p[j][i] = v
        if lam < 1.0:
            inflate = 1.0 / math.sqrt(lam)
            d = [inflate if p[i][i] * inflate * inflate <= self.prior else 1.0
                 for i in range(dim)]
            for i in range(dim):
                row, di = p[i], d[i]
                for j in range(dim):
                    row[j] *= di * d[j]
        self.samples += 1

    def size(self) -> int:
        """Numbers held (for the bounded-memory check): weights and covariance."""
        return len(self.w) + sum(len(row) for row in self.p)


class _Models:
    """The TTFT and TPOT models of one pod type."""

    __slots__ = ("tpot", "ttft")

    def __init__(self, forgetting: float, prior: float) -> None:
        self.ttft = RecursiveLeastSquares(len(TTFT_FEATURES) + 1, forgetting, prior)
        self.tpot = RecursiveLeastSquares(len(TPOT_FEATURES) + 1, forgetting, prior)


class OnlinePredictor:
    """The in-process :class:`~epp.latency.predictor.LatencyPredictor` (module doc)."""

    kind = "in-process"

    def __init__(self, min_samples: int = 20, forgetting: float = 0.999,
                 prior: float = 1000.0) -> None:
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        self.min_samples = min_samples
        self._models = {t: _Models(forgetting, prior) for t in POD_TYPES}

    def _for(self, pod_type: str) -> _Models:
        return self._models.get(pod_type) or self._models[""]

    # --- learning

    def add_training_data_bulk(self, entries: Sequence[TrainingEntry]) -> None:
        """Learn at once: a row with an actual TTFT trains the TTFT model, one with an
        actual TPOT the TPOT model (GIE's training server splits them the same way)."""
        for e in entries:
            row = e.as_prediction()
            models = self._for(e.pod_type)
            if e.actual_ttft_ms > 0:
                models.ttft.update(ttft_features(row), e.actual_ttft_ms)
            if e.actual_tpot_ms > 0:
                models.tpot.update(tpot_features(row), e.actual_tpot_ms)

    def samples(self, pod_type: str = "") -> tuple[int, int]:
        """(TTFT, TPOT) samples learned by the model of ``pod_type``."""
        m = self._for(pod_type)
        return m.ttft.samples, m.tpot.samples

    def size(self) -> int:
        """Numbers held by every model together (constant: bounded memory)."""
        return sum(m.ttft.size() + m.tpot.size() for m in self._models.values())

    # --- predicting

    def predict_local(self, request: PredictionRequest) -> PredictionResponse:
        """Predict now; raises :class:`PredictorNotReady` in the cold start."""
        validate_prediction_request(request)
        m = self._for(request.pod_type)
        if m.ttft.samples < self.min_samples:
            raise PredictorNotReady(
                f"model not ready: {m.ttft.samples} of {self.min_samples} TTFT samples "
                f"learned (pod type {request.pod_type!r})")
        ttft = max(0.0, m.ttft.predict(ttft_features(request)))
        tpot = (max(0.0, m.tpot.predict(tpot_features(request)))
                if m.tpot.samples >= self.min_samples else 0.0)
        return PredictionResponse(ttft, tpot, MODEL_TYPE, OBJECTIVE_MEAN, 0.0)

    async def predict(self, request: PredictionRequest) -> PredictionResponse:
        return self.predict_local(request)

    async def predict_bulk_strict(
            self, requests: Sequence[PredictionRequest]) -> BulkPredictionResponse:
        """Every row predicted, or :class:`PredictorNotReady` (never suspends)."""
        preds = tuple(self.predict_local(r) for r in requests)
        return BulkPredictionResponse(preds, len(preds), len(preds), 0, 0.0)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
