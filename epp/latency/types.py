"""The latency predictor's data, with GIE's names and JSON shapes.

Prediction and training rows are GIE's ``PredictionRequest`` / ``TrainingEntry``
(sidecars/latencypredictorasync/types.go), serialized exactly as its client sends them
and as the sidecar servers (latencypredictor/prediction_server.py, training_server.py)
read them. :class:`LatencyPredictionInfo` is GIE's endpoint attribute
(pkg/epp/framework/plugins/datalayer/attribute/latency), kept per request in
``LLMRequest.plugin_state`` (:func:`prediction_infos`). Latencies are milliseconds, as in
GIE, except where a name says seconds.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from epp import keys
from epp.scheduling.types import LLMRequest

# Model types the sidecar reports (types.go).
MODEL_BAYESIAN_RIDGE = "bayesian_ridge"
MODEL_XGBOOST = "xgboost"
MODEL_LIGHTGBM = "lightgbm"
OBJECTIVE_QUANTILE = "quantile"
OBJECTIVE_MEAN = "mean"

# GIE's pod types (the role label's value; "" for a monolithic pod).
POD_TYPES = ("", "prefill", "decode")


class PredictorError(Exception):
    """A prediction could not be made (sidecar down, bad answer, model not ready): the
    plugins go on without predictions, as GIE's do."""


class PredictorNotReady(PredictorError):
    """The model has not learned enough yet (the sidecar's 503 "Models not ready")."""


@dataclass(frozen=True, slots=True)
class PredictionRequest:
    """One row to predict (GIE's ``PredictionRequest``)."""

    kv_cache_percentage: float
    input_token_length: int
    num_request_waiting: int
    num_request_running: int
    num_tokens_generated: int
    prefix_cache_score: float
    pod_type: str = ""
    prefill_tokens_in_flight: int = 0
    decode_tokens_in_flight: int = 0

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kv_cache_percentage": self.kv_cache_percentage,
            "input_token_length": self.input_token_length,
            "num_request_waiting": self.num_request_waiting,
            "num_request_running": self.num_request_running,
            "num_tokens_generated": self.num_tokens_generated,
            "prefix_cache_score": self.prefix_cache_score,
        }
        if self.pod_type:  # Go: `json:"pod_type,omitempty"`
            d["pod_type"] = self.pod_type
        d["prefill_tokens_in_flight"] = self.prefill_tokens_in_flight
        d["decode_tokens_in_flight"] = self.decode_tokens_in_flight
        return d


def validate_prediction_request(r: PredictionRequest) -> None:
    """GIE's ``ValidatePredictionRequest``: raises :class:`PredictorError`."""
    if not 0.0 <= r.kv_cache_percentage <= 1.0:
        raise PredictorError(
            f"kv_cache_percentage must be between 0.0 and 1.0, got {r.kv_cache_percentage:f}")
    for name in ("input_token_length", "num_request_waiting", "num_request_running",
                 "num_tokens_generated"):
        v = getattr(r, name)
        if v < 0:
            raise PredictorError(f"{name} must be non-negative, got {v}")
    if not 0.0 <= r.prefix_cache_score <= 1.0:
        raise PredictorError(
            f"prefix_cache_score must be between 0.0 and 1.0, got {r.prefix_cache_score:f}")


@dataclass(frozen=True, slots=True)
class PredictionResponse:
    """One prediction (GIE's ``PredictionResponse``; the fields the EPP uses)."""

    ttft_ms: float
    tpot_ms: float
    model_type: str = ""
    objective_type: str = ""
    quantile: float = 0.0

    @classmethod
    def from_json(cls, d: Any) -> PredictionResponse:
        """From the sidecar's JSON; raises :class:`PredictorError` on a bad shape."""
        if not isinstance(d, Mapping):
            raise PredictorError(f"prediction is not an object: {d!r}")
        try:
            ttft = float(d["ttft_ms"])
            tpot = float(d["tpot_ms"])
        except (KeyError, TypeError, ValueError) as e:
            raise PredictorError(f"prediction without numeric ttft_ms/tpot_ms: {d!r}") from e
        if not (math.isfinite(ttft) and math.isfinite(tpot)):
            raise PredictorError(f"prediction is not finite: {d!r}")
        q = d.get("quantile")
        return cls(ttft, tpot, str(d.get("model_type") or ""),
                   str(d.get("objective_type") or ""),
                   float(q) if isinstance(q, (int, float)) else 0.0)


@dataclass(frozen=True, slots=True)
class BulkPredictionResponse:
    """GIE's ``BulkPredictionResponse``: predictions in request order."""

    predictions: tuple[PredictionResponse, ...]
    total_requests: int = 0
    successful_predictions: int = 0
    failed_predictions: int = 0
    processing_time_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class TrainingEntry:
    """One observed latency (GIE's ``TrainingEntry``): a TTFT sample has
    ``actual_ttft_ms`` > 0 and ``actual_tpot_ms`` 0; a TPOT sample the reverse."""

    kv_cache_percentage: float
    input_token_length: int
    num_request_waiting: int
    num_request_running: int
    num_tokens_generated: int
    actual_ttft_ms: float
    actual_tpot_ms: float
    prefix_cache_score: float
    pod_type: str = ""
    prefill_tokens_in_flight: int = 0
    decode_tokens_in_flight: int = 0
    timestamp: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kv_cache_percentage": self.kv_cache_percentage,
            "input_token_length": self.input_token_length,
            "num_request_waiting": self.num_request_waiting,
            "num_request_running": self.num_request_running,
            "num_tokens_generated": self.num_tokens_generated,
            "actual_ttft_ms": self.actual_ttft_ms,
            "actual_tpot_ms": self.actual_tpot_ms,
            "prefix_cache_score": self.prefix_cache_score,
        }
        if self.pod_type:
            d["pod_type"] = self.pod_type
        d["prefill_tokens_in_flight"] = self.prefill_tokens_in_flight
        d["decode_tokens_in_flight"] = self.decode_tokens_in_flight
        d["timestamp"] = self.timestamp.isoformat().replace("+00:00", "Z")
        return d

    def as_prediction(self) -> PredictionRequest:
        """The features of this entry, as a prediction row."""
        return PredictionRequest(self.kv_cache_percentage, self.input_token_length,
                                 self.num_request_waiting, self.num_request_running,
                                 self.num_tokens_generated, self.prefix_cache_score,
                                 self.pod_type, self.prefill_tokens_in_flight,
                                 self.decode_tokens_in_flight)


# ------------------------------------------------------------- per-endpoint predictions


@dataclass(frozen=True, slots=True)
class LatencyPredictionInfo:
    """GIE's ``LatencyPredictionInfo`` attribute of one endpoint, for one request.

    Headroom is SLO − predicted (ms): positive meets the SLO, negative violates it.
    ``dispatched_request_count``: the requests this EPP has running on the endpoint (its
    own tracking, more current than the scraped running requests)."""

    ttft_valid: bool
    tpot_valid: bool
    ttft_headroom: float
    tpot_headroom: float
    ttft: float
    tpot: float
    dispatched_request_count: int = 0

    @property
    def is_valid(self) -> bool:
        return self.ttft_valid and self.tpot_valid


_NO_INFOS: Mapping[str, LatencyPredictionInfo] = {}


def prediction_infos(request: LLMRequest) -> Mapping[str, LatencyPredictionInfo]:
    """The request's predictions by endpoint key (empty: none were made)."""
    infos: Mapping[str, LatencyPredictionInfo] | None = request.plugin_state.get(
        keys.PLUGIN_STATE_LATENCY_PREDICTIONS)
    return infos if infos is not None else _NO_INFOS


def set_prediction_infos(request: LLMRequest,
                         infos: Mapping[str, LatencyPredictionInfo]) -> None:
    """Publish the request's predictions (the producer, before scheduling)."""
    request.plugin_state[keys.PLUGIN_STATE_LATENCY_PREDICTIONS] = infos


# ------------------------------------------------------ what the metrics observer records

TYPE_TTFT = "ttft"
TYPE_TPOT = "tpot"


@dataclass(frozen=True, slots=True)
class LatencyOutcome:
    """A finished request's predicted latencies and SLO checks, in seconds, as GIE's
    producer records them at the end of the response (``RecordRequestPredictedTTFT``,
    ``RecordRequestTTFTWithSLO``, …); None: not recorded. ``*_violated``: the actual
    latency exceeded the request's SLO header (None: no SLO)."""

    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    ttft_violated: bool | None = None
    tpot_violated: bool | None = None


def add_prediction_duration(request: LLMRequest, kind: str, seconds: float) -> None:
    """Note that a ``kind`` (``ttft``/``tpot``) prediction took ``seconds`` (the metrics
    observer drains these into the prediction-duration histograms)."""
    durations: list[tuple[str, float]] | None = request.plugin_state.get(
        keys.PLUGIN_STATE_LATENCY_DURATIONS)
    if durations is None:
        durations = request.plugin_state[keys.PLUGIN_STATE_LATENCY_DURATIONS] = []
    durations.append((kind, seconds))


def set_outcome(request: LLMRequest, outcome: LatencyOutcome) -> None:
    request.plugin_state[keys.PLUGIN_STATE_LATENCY_OUTCOME] = outcome


# ---------------------------------------------------------------------- SLO headers


def parse_slo_header(headers: Mapping[str, str], name: str) -> float:
    """A request's SLO header in ms: 0 when absent, when not a number (GIE logs that and
    goes on with 0), or not finite."""
    raw = keys.request_header(headers, name)
    if raw is None:
        return 0.0
    try:
        v = float(raw.strip())
    except ValueError:
        return 0.0
    return v if math.isfinite(v) else 0.0


def slo_headers(request: LLMRequest) -> tuple[float, float]:
    """(TTFT SLO, TPOT SLO) in ms from ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` (0: none)."""
    return (parse_slo_header(request.headers, keys.HEADER_SLO_TTFT_MS),
            parse_slo_header(request.headers, keys.HEADER_SLO_TPOT_MS))


def prompt_words(prompt: str) -> int:
    """GIE's input token length: the prompt's whitespace-separated words
    (``len(strings.Fields(prompt))``)."""
    return len(prompt.split())
