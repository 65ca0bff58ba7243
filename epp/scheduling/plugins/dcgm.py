"""``dcgm-data-source`` and ``dcgm-extractor`` (llm-d-router v0.10.0,
pkg/epp/framework/plugins/datalayer/source/dcgm and .../extractor/dcgm): GPU utilization
from an NVIDIA DCGM exporter, as the endpoint attribute ``GPUUtilization/dcgm-extractor``
that ``endpoint-attribute-filter``/``-scorer`` read.

The source polls ``<scheme>://<pod IP>:<port><path>`` of every endpoint (the exporter as
a sidecar; epp/datalayer/polling.py runs it), or with ``useNodeAddress: true`` (a DCGM
exporter DaemonSet) ``<scheme>://<node IP>:<port><path>``: the node IP is the pod's
``status.hostIP``, which the Kubernetes discovery records on each endpoint
(``Endpoint.node_address``). An endpoint without one — static discovery
(``--endpoints``, ``--endpoints-file``) or llm-d's ``file-discovery``, which know no
node addresses — is scraped at its pod IP, as llm-d falls back when ``NodeAddress`` is
empty, with a warning once per endpoint. The endpoints of one node share the exporter;
its samples carry a ``pod`` label (``DCGM_EXPORTER_KUBERNETES=true``, the GPU Operator's
default) that keeps each endpoint to its own GPUs. The extractor takes the
``DCGM_FI_DEV_GPU_UTIL`` samples of the endpoint's pod (samples with a ``pod`` label of
another pod are skipped; unlabelled ones are kept), their maximum, divided by 100.
"""

from __future__ import annotations

import logging
import re
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

log = logging.getLogger(__name__)

DCGM_DATA_SOURCE = "dcgm-data-source"
DCGM_EXTRACTOR = "dcgm-extractor"
GPU_UTIL_METRIC = "DCGM_FI_DEV_GPU_UTIL"
POD_LABEL = "pod"
#: llm-d's attrgpu.GPUUtilizationDataKey ("GPUUtilization") with the extractor's type.
GPU_UTILIZATION_KEY = "GPUUtilization/dcgm-extractor"
_RANK_SUFFIX = re.compile(r"-rank-\d+$")


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


@dataclass(frozen=True)
class DCGMDataSourceParameters:
    scheme: str = param("scheme", "http", parse=_scheme)
    path: str = param("path", "/metrics", parse=_path)
    port: int = param("port", 9400, parse=_port)
    insecure_skip_verify: bool = param("insecureSkipVerify", True)
    use_node_address: bool = param("useNodeAddress", False)
    interval_s: float | None = param("interval", None, parse=_interval)


class DCGMDataSource:
    """Polls each endpoint's DCGM exporter (``GET <scheme>://<pod IP>:<port><path>``; the
    node IP instead with ``use_node_address``, when the endpoint has one)."""

    type_name = DCGM_DATA_SOURCE
    Parameters = DCGMDataSourceParameters
    data_output = DATA_PROMETHEUS

    def __init__(self, name: str, scheme: str = "http", path: str = "/metrics",
                 port: int = 9400, insecure_skip_verify: bool = True,
                 interval_s: float | None = None, use_node_address: bool = False) -> None:
        self.name = name
        self.scheme = scheme
        self.path = path
        self.port = port
        self.insecure_skip_verify = insecure_skip_verify
        self.interval_s = interval_s
        self.use_node_address = use_node_address
        self._no_node_address: set[str] = set()  # endpoints warned about (fallback)

    @classmethod
    def from_params(cls, name: str, params: DCGMDataSourceParameters,
                    handle: PluginHandle) -> DCGMDataSource:
        return cls(name, params.scheme, params.path, params.port,
                   params.insecure_skip_verify, params.interval_s, params.use_node_address)

    def target_ip(self, endpoint: Endpoint) -> str:
        """The node IP with ``use_node_address`` (when known), else the pod IP."""
        if not self.use_node_address:
            return endpoint.address
        if endpoint.node_address:
            return endpoint.node_address
        if endpoint.key not in self._no_node_address:
            self._no_node_address.add(endpoint.key)
            log.warning("%s %r: endpoint %s has no node address (useNodeAddress needs "
                        "Kubernetes discovery, which records the pod's status.hostIP); "
                        "scraping its pod IP %s instead", self.type_name, self.name,
                        endpoint.key, endpoint.address)
        return endpoint.address

    def url(self, endpoint: Endpoint) -> str:
        ip = self.target_ip(endpoint)
        host = f"[{ip}]" if ":" in ip else ip
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
        # Kubernetes discovery names endpoints <pod>-rank-<i>; the exporter's label is the
        # pod's name (llm-d compares the pod name, EndpointMetadata.Name).
        pods = {pod, _RANK_SUFFIX.sub("", pod)}
        values = [s.value for s in samples
                  if not pod or s.labels.get(POD_LABEL, pod) in pods]
        if not values:
            raise ValueError(f"metric {GPU_UTIL_METRIC!r} present but has no samples for "
                             f"pod {pod!r}")
        return {GPU_UTILIZATION_KEY: max(0.0, *values) / 100.0}
