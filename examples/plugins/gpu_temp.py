"""An example user plugin: prefer endpoints whose GPUs run cooler.

Referenced from a config by import path (see docs/plugins.md and gpu-temp.yaml here):

    PYTHONPATH=examples epp serve --config-file examples/plugins/gpu-temp.yaml ...

with ``type: plugins.gpu_temp:GpuTempScorer``. The temperature comes from a label on the
pod or its node (``example.com/gpu-temp-celsius`` by default) that something outside the
EPP keeps current — for example a job that rewrites the ``--endpoints-file`` (re-read on
change) from DCGM readings. The scorer itself does no I/O: it reads the immutable endpoint
snapshot it is given, as every scorer must.

Score: 1 at or below ``coolCelsius``, 0 at or above ``hotCelsius``, linear in between;
endpoints without a readable temperature score ``unknownScore``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, param
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

DEFAULT_LABEL = "example.com/gpu-temp-celsius"


@dataclass(frozen=True)
class GpuTempParameters:
    """One field per config key: its key, default and bounds. The EPP decodes and checks
    them (type, range, unknown keys) with the key's path in every error."""

    label: str = param("label", DEFAULT_LABEL)
    cool: float = param("coolCelsius", 60.0)
    hot: float = param("hotCelsius", 85.0)
    unknown: float = param("unknownScore", 0.5, minimum=0.0, maximum=1.0)

    def __post_init__(self) -> None:
        # Checks across fields: ParameterError names the key at fault.
        if not self.hot > self.cool:
            raise ParameterError("hotCelsius", f"must be above coolCelsius ({self.cool:g}), "
                                 f"got {self.hot:g}")


class GpuTempScorer:
    """Cooler GPUs score higher. A plugin needs ``type_name``, ``name``, its ``Parameters``
    dataclass, a ``from_params`` classmethod, and the method of its extension point (here
    ``score``)."""

    type_name = "gpu-temp-scorer"
    Parameters = GpuTempParameters

    def __init__(self, name: str, label: str = DEFAULT_LABEL,
                 cool: float = 60.0, hot: float = 85.0, unknown: float = 0.5) -> None:
        self.name = name
        self.label = label
        self.cool = cool
        self.hot = hot
        self.unknown = unknown

    @classmethod
    def from_params(cls, name: str, params: GpuTempParameters,
                    handle: PluginHandle) -> GpuTempScorer:
        """Build from decoded, validated parameters; ``handle`` finds other plugins."""
        return cls(name, params.label or DEFAULT_LABEL, params.cool, params.hot,
                   params.unknown)

    def temperature(self, e: Endpoint) -> float | None:
        raw = e.labels.get(self.label) or e.node_labels.get(self.label)
        try:
            return float(raw) if raw is not None else None
        except ValueError:
            return None

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        """One score in [0, 1] per endpoint, in the same order."""
        out: list[float] = []
        span = self.hot - self.cool
        for e in endpoints:
            t = self.temperature(e)
            if t is None:
                out.append(self.unknown)
            else:
                out.append(min(1.0, max(0.0, (self.hot - t) / span)))
        return out
