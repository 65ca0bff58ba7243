"""``dcgm-data-source`` and ``dcgm-extractor`` (llm-d-router v0.10.0,
pkg/epp/framework/plugins/datalayer/source/dcgm and .../extractor/dcgm): GPU utilization
from an NVIDIA DCGM exporter, as the endpoint attribute ``GPUUtilization/dcgm-extractor``
that ``endpoint-attribute-filter``/``-scorer`` read.

The source polls ``<scheme>://<pod IP>:<port><path>`` of every endpoint (the exporter as
a sidecar; epp/datalayer/polling.py runs it); the extractor takes the
``DCGM_FI_DEV_GPU_UTIL`` samples of the endpoint's pod (samples with a ``pod`` label of
another pod are skipped; unlabelled ones are kept), their maximum, divided by 100.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epp.datalayer.polling import Payload
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import DATA_PROMETHEUS
from epp.framework.params import NoParameters, param, parse_duration
from epp.scheduling.plugins.datalayer import _path, _scheme
from epp.scheduling.types import Endpoint

DCGM_DATA_SOURCE = "dcgm-data-source"
DCGM_EXTRACTOR = "dcgm-extractor"
GPU_UTIL_METRIC = "DCGM_FI_DEV_GPU_UTIL"
POD_LABEL = "pod"
#: llm-d's attrgpu.GPUUtilizationDataKey ("GPUUtilization") with the extractor's type.
GPU_UTILIZATION_KEY = "GPUUtilization/dcgm-extractor"


def _port(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(f"{path}: expected a port number 1-65535, got {value!r}")
    return value


def _interval(value: Any, path: str) -> float | None:
    if value in (None, ""):
        return None
    t = parse_duration(value, path)
    if t < 0:
        raise ConfigError(f"{path}: interval must be non-negative, got {value!r}")
    return t


def _node_address(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if value:
        raise ConfigError(f"{path}: scraping the node address (a DaemonSet DCGM exporter) "
                          "is not supported: this EPP does not know the pods' host IPs; run "
                          "the exporter as a sidecar and leave useNodeAddress false")
    return value


@dataclass(frozen=True)
class DCGMDataSourceParameters:
    scheme: str = param("scheme", "http", parse=_scheme)
    path: str = param("path", "/metrics", parse=_path)
    port: int = param("port", 9400, parse=_port)
    insecure_skip_verify: bool = param("insecureSkipVerify", True)
    use_node_address: bool = param("useNodeAddress", False, parse=_node_address)
    interval_s: float | None = param("interval", None, parse=_interval)


class DCGMDataSource:
    """Polls each endpoint's DCGM exporter (``GET <scheme>://<pod IP>:<port><path>``)."""

    type_name = DCGM_DATA_SOURCE
    Parameters = DCGMDataSourceParameters
    data_output = DATA_PROMETHEUS

    def __init__(self, name: str, scheme: str = "http", path: str = "/metrics",
                 port: int = 9400, insecure_skip_verify: bool = True,
                 interval_s: float | None = None) -> None:
        self.name = name
        self.scheme = scheme
        self.path = path
        self.port = port
        self.insecure_skip_verify = insecure_skip_verify
        self.interval_s = interval_s

    @classmethod
    def from_params(cls, name: str, params: DCGMDataSourceParameters,
                    handle: PluginHandle) -> DCGMDataSource:
        return cls(name, params.scheme, params.path, params.port,
                   params.insecure_skip_verify, params.interval_s)

    def url(self, endpoint: Endpoint) -> str:
        host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
        return f"{self.scheme}://{host}:{self.port}{self.path}"


class DCGMExtractor:
    """``DCGM_FI_DEV_GPU_UTIL`` (0-100) → ``GPUUtilization/dcgm-extractor`` in [0, 1]: the
    most utilized GPU of the endpoint's pod. No parameters."""

    type_name = DCGM_EXTRACTOR
    Parameters = NoParameters
    data_input = DATA_PROMETHEUS

    def __init__(self, name: str = DCGM_EXTRACTOR) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> DCGMExtractor:
        return cls(name)

    def extract_poll(self, payload: Payload, endpoint: Endpoint) -> Mapping[str, float]:
        samples = payload.get(GPU_UTIL_METRIC)
        if not samples:
            raise ValueError(f"metric {GPU_UTIL_METRIC!r} not found in DCGM response")
        pod = endpoint.name
        values = [s.value for s in samples
                  if not pod or s.labels.get(POD_LABEL) in (None, pod)]
        if not values:
            raise ValueError(f"metric {GPU_UTIL_METRIC!r} present but has no samples for "
                             f"pod {pod!r}")
        return {GPU_UTILIZATION_KEY: max(0.0, *values) / 100.0}
