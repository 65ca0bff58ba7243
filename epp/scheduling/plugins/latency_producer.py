"""``predicted-latency-producer`` (GIE v1.5.0
pkg/epp/framework/plugins/requestcontrol/requestdataproducer/predictedlatency): predicts
each candidate's TTFT and TPOT before scheduling and learns from every response.

Before scheduling (PrepareData) it predicts for every candidate in one bulk call and
publishes, per endpoint, GIE's ``LatencyPredictionInfo`` — predicted TTFT/TPOT, headroom
against the request's ``x-slo-ttft-ms``/``x-slo-tpot-ms`` and the requests this EPP has
running there — for ``latency-scorer``, ``slo-headroom-tier-filter``,
``latency-slo-admitter`` and ``prefix-cache-affinity-filter`` to read. TPOT is
neutralized (valid, headroom 0) outside ``streamingMode`` and on endpoints whose
``endpointRoleLabel`` is ``prefill``. After the response it trains the predictor and
records the predicted-latency metrics. epp/latency/tracking.py has the details;
epp/latency/predictor.py which predictor (GIE's sidecar or the in-process model).

Parameters (GIE's names and defaults): ``samplingMean`` (1000, > 0),
``maxDecodeTokenSamplesForPrediction`` (0, >= 0), ``sloBufferFactor`` (1, > 0),
``contextTTL`` (5m; accepted, no effect here: tracking.py), ``streamingMode`` (false),
``endpointRoleLabel`` (""), ``predictInPrepareData`` (true; false: train only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, param
from epp.latency.predictor import LatencyPredictor
from epp.latency.tracking import LatencyTracker, TrackingConfig
from epp.latency.types import set_prediction_infos
from epp.scheduling.plugins.latency_common import (
    CONSUMES_PREFIX,
    NEEDS_BODY,
    PRODUCES_LATENCY,
    PrefixScores,
    TrackedPredictor,
    make_predictor,
    parse_context_ttl,
)
from epp.scheduling.types import CycleState, Endpoint, LLMRequest


def check_tracking_parameters(sampling_mean: float, max_samples: int, max_samples_key: str,
                    slo_buffer_factor: float) -> None:
    if not sampling_mean > 0:
        raise ParameterError("samplingMean", f"must be > 0, got {sampling_mean:g}")
    if max_samples < 0:
        raise ParameterError(max_samples_key, f"must be >= 0, got {max_samples}")
    if not slo_buffer_factor > 0:
        raise ParameterError("sloBufferFactor", f"must be > 0, got {slo_buffer_factor:g}")


@dataclass(frozen=True)
class PredictedLatencyProducerParameters:
    sampling_mean: float = param("samplingMean", 1000.0)
    max_decode_token_samples_for_prediction: int = param(
        "maxDecodeTokenSamplesForPrediction", 0)
    slo_buffer_factor: float = param("sloBufferFactor", 1.0)
    context_ttl_s: float = param("contextTTL", 300.0, parse=parse_context_ttl)
    streaming_mode: bool = param("streamingMode", False)
    endpoint_role_label: str = param("endpointRoleLabel", "")
    predict_in_prepare_data: bool = param("predictInPrepareData", True)

    def __post_init__(self) -> None:
        check_tracking_parameters(self.sampling_mean, self.max_decode_token_samples_for_prediction,
                        "maxDecodeTokenSamplesForPrediction", self.slo_buffer_factor)


class PredictedLatencyProducer(TrackedPredictor):
    type_name = "predicted-latency-producer"
    Parameters = PredictedLatencyProducerParameters
    produces = MappingProxyType(PRODUCES_LATENCY)
    consumes = MappingProxyType(CONSUMES_PREFIX)
    response_needs = NEEDS_BODY

    def __init__(self, name: str, params: PredictedLatencyProducerParameters | None = None,
                 predictor: LatencyPredictor | None = None) -> None:
        self.name = name
        self.params = p = params or PredictedLatencyProducerParameters()
        self.predictor = make_predictor(predictor)
        self.tracker = LatencyTracker(name, TrackingConfig(
            streaming_mode=p.streaming_mode, endpoint_role_label=p.endpoint_role_label,
            slo_buffer_factor=p.slo_buffer_factor, sampling_mean=p.sampling_mean,
            max_decode_samples=p.max_decode_token_samples_for_prediction,
            neutralize_tpot=True, predict_in_prepare=p.predict_in_prepare_data),
            self.predictor)
        self.prefix = PrefixScores()

    @classmethod
    def from_params(cls, name: str, params: PredictedLatencyProducerParameters,
                    handle: PluginHandle) -> PredictedLatencyProducer:
        return cls(name, params)

    def bind(self, handle: PluginHandle) -> None:
        self.prefix.bind(handle)

    # --- PrepareData

    async def prepare_request_data(self, request: LLMRequest,
                                   endpoints: Sequence[Endpoint]) -> None:
        scores = self.prefix.scores(CycleState(), request, endpoints)
        predictions = await self.tracker.prepare(request, endpoints, scores)
        if predictions is not None:
            tracker = self.tracker
            set_prediction_infos(request, {
                p.endpoint.key: p.info(tracker.running_count(p.endpoint.key))
                for p in predictions})


    def running_requests(self) -> Mapping[str, int]:
        """Requests this plugin tracks as running, per endpoint key (tests, explain)."""
        return {k: len(q) for k, q in self.tracker.running.items()}
