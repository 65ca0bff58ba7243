"""``header-label-affinity-scorer`` (llm-d-router v0.10.0,
pkg/epp/framework/plugins/scheduling/scorer/headerlabelaffinity): 1 for the endpoints whose
label ``labelKey`` equals the request header ``headerName``, 0 for the others (and 0
everywhere when the header is absent or empty). Both parameters are required.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, param
from epp.scheduling.types import CycleState, Endpoint, LLMRequest


@dataclass(frozen=True)
class HeaderLabelAffinityParameters:
    header_name: str = param("headerName", "")
    label_key: str = param("labelKey", "")

    def check_required(self) -> None:
        """Both are required (checked when the plugin is built, so an empty block still
        decodes, as the framework expects of every built-in)."""
        if not self.header_name:
            raise ParameterError("headerName", "required: the request header naming the "
                                 "wanted label value")
        if not self.label_key:
            raise ParameterError("labelKey", "required: the endpoint label compared with "
                                 "the header")


class HeaderLabelAffinityScorer:
    """1 where ``labels[labelKey]`` equals the request's ``headerName`` header."""

    type_name = "header-label-affinity-scorer"
    Parameters = HeaderLabelAffinityParameters

    def __init__(self, name: str, header_name: str, label_key: str) -> None:
        self.name = name
        self.header_name = header_name.lower()
        self.label_key = label_key

    @classmethod
    def from_params(cls, name: str, params: HeaderLabelAffinityParameters,
                    handle: PluginHandle) -> HeaderLabelAffinityScorer:
        params.check_required()
        return cls(name, params.header_name, params.label_key)

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        wanted = request.headers.get(self.header_name, "")
        if not wanted:
            return [0.0] * len(endpoints)
        return [1.0 if e.labels.get(self.label_key) == wanted else 0.0 for e in endpoints]
