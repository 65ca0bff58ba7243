"""``latency-slo-admitter`` (GIE v1.5.0
pkg/epp/framework/plugins/requestcontrol/admitter/latencyslo): refuses sheddable requests
no endpoint can serve within their latency SLOs.

A request is sheddable when its priority (its InferenceObjective's) is negative; others
are always admitted. A sheddable request is admitted when it has no SLO header
(``x-slo-ttft-ms``/``x-slo-tpot-ms`` > 0), when no candidate has a prediction (fail
open), or when any candidate has a valid prediction (both SLOs met), is idle (no running
requests, as scraped) or is cold (KV cache below 2 %: its predictions are unreliable).
Otherwise it is refused: GIE answers 500 "request cannot be admitted". No parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters
from epp.latency.types import prediction_infos, slo_headers
from epp.scheduling.plugins.latency_common import CONSUMES_LATENCY
from epp.scheduling.types import Endpoint, LLMRequest

#: Below this KV-cache use an endpoint is cold (GIE's 0.02).
COLD_KV_CACHE = 0.02


class LatencySloAdmitter:
    type_name = "latency-slo-admitter"
    Parameters = NoParameters
    consumes = MappingProxyType(CONSUMES_LATENCY)

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> LatencySloAdmitter:
        return cls(name)

    def admit_request(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> str | None:
        if request.priority >= 0:
            return None
        ttft_slo, tpot_slo = slo_headers(request)
        if not (ttft_slo > 0 or tpot_slo > 0):
            return None
        infos = prediction_infos(request)
        has_valid = has_idle = has_cold = has_predictions = False
        for e in endpoints:
            if e.metrics.kv_cache_usage < COLD_KV_CACHE:
                has_cold = True
            if e.metrics.running_requests == 0:
                has_idle = True
            info = infos.get(e.key)
            if info is not None:
                has_predictions = True
                if info.is_valid:
                    has_valid = True
        if not has_predictions or has_valid or has_idle or has_cold:
            return None
        return "no valid endpoint available to serve the request"
