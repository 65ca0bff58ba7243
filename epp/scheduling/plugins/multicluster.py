"""llm-d-router's multicluster plugin family (v0.10.0, registered in
cmd/epp/runner/runner.go as "multicluster variants"): an EPP whose endpoints are peer
clusters (``multicluster-file-discovery``, epp/discovery/llmd_file.py) and whose load
signal is each cluster's pool aggregate, scraped from the cluster's EPP.

- ``multicluster-metrics-data-source`` (.../datalayer/source/metrics/multicluster.go):
  polls each cluster endpoint's metrics host (its ``metricsAddress``/``metricsPort``
  labels, else ``address:port``) like ``metrics-data-source``, but ``https`` with the
  peer certificate verified by default (``caCertPath`` for a private CA,
  ``insecureSkipVerify`` to opt out; ``clientCertPath``/``clientKeyPath`` for mTLS); the
  payload read is capped at 8 MiB. epp/datalayer/polling.py runs it.
- ``multicluster-metrics-extractor`` (.../datalayer/extractor/metrics/multicluster.go):
  the pool aggregates ``llm_d_epp_average_kv_cache_utilization`` and
  ``llm_d_epp_average_queue_size`` (``kvCacheUtilizationMetric``, ``queueSizeMetric``:
  other metric specs) into the endpoint attributes
  ``llm-d.ai/multicluster-kv-cache-utilization`` and ``llm-d.ai/multicluster-queue-size``.
  A missing metric is reported; the other is still written.
- ``multicluster-queue-scorer`` / ``multicluster-kv-cache-utilization-scorer``
  (.../scorer/queuedepth, .../kvcacheutilization multicluster.go): min-max normalized
  pool queue (shortest 1, longest 0, all equal 1) / 1 − pool KV utilization; an endpoint
  without the attribute scores 0 (llm-d leaves it unscored) and is left out of the
  queue normalization. Both require the attribute's producer: a config without a
  ``multicluster-metrics-extractor`` fails at load (llm-d's ErrNoDefaultProducer).
- ``multicluster-prefix-cache-scorer``, ``multicluster-approx-prefix-cache-producer``,
  ``multicluster-session-affinity-filter``: llm-d's thin variants — the stock plugins
  already key on endpoint identity, which is the cluster here — under their own type
  names, with the stock parameters and behaviour.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Self

from epp.datalayer import promparse
from epp.datalayer.engines import MetricSpec
from epp.datalayer.polling import Payload, client_tls_context
from epp.discovery.llmd_file import metrics_host
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import DATA_PROMETHEUS, ProducesData
from epp.framework.params import NoParameters, config_warning, param
from epp.scheduling.plugins.datalayer import _path, _scheme
from epp.scheduling.plugins.dcgm import _interval
from epp.scheduling.plugins.prefix import ApproxPrefixCacheProducer, PrefixCacheScorer
from epp.scheduling.plugins.session import SessionAffinityFilter
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

log = logging.getLogger(__name__)

MULTICLUSTER_METRICS_DATA_SOURCE = "multicluster-metrics-data-source"
MULTICLUSTER_METRICS_EXTRACTOR = "multicluster-metrics-extractor"
#: llm-d's attrmetrics.MultiClusterKVCacheUtilizationKey / MultiClusterQueueSizeKey.
KV_CACHE_UTILIZATION_KEY = "llm-d.ai/multicluster-kv-cache-utilization"
QUEUE_SIZE_KEY = "llm-d.ai/multicluster-queue-size"
DEFAULT_KV_CACHE_UTILIZATION_METRIC = "llm_d_epp_average_kv_cache_utilization"
DEFAULT_QUEUE_SIZE_METRIC = "llm_d_epp_average_queue_size"
#: llm-d's maxResponseBytes: what is read of a peer's metrics payload.
MAX_RESPONSE_BYTES = 8 << 20
#: The data type the extractor produces and the scorers consume (llm-d's
#: attrmetrics.ScalarMetricValue).
SCALAR = "ScalarMetricValue"


# ----------------------------------------------------- multicluster-metrics-data-source


def _any_port(value: Any, path: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: expected a port number, got {value!r}")
    config_warning(path, "ignored by multicluster-metrics-data-source (as in llm-d): the "
                   "scrape target is each cluster's metricsAddress/metricsPort labels")
    return value


@dataclass(frozen=True)
class MultiClusterMetricsDataSourceParameters:
    scheme: str = param("scheme", "https", parse=_scheme)
    path: str = param("path", "/metrics", parse=_path)
    port: int | None = param("port", None, parse=_any_port)  # decoded, unused (llm-d)
    insecure_skip_verify: bool = param("insecureSkipVerify", False)
    ca_cert_path: str = param("caCertPath", "")
    client_cert_path: str = param("clientCertPath", "")
    client_key_path: str = param("clientKeyPath", "")
    interval_s: float | None = param("interval", None, parse=_interval)


class MultiClusterMetricsDataSource:
    """Polls each cluster endpoint's metrics host (a peer cluster's EPP) over https."""

    type_name = MULTICLUSTER_METRICS_DATA_SOURCE
    Parameters = MultiClusterMetricsDataSourceParameters
    data_output = DATA_PROMETHEUS

    def __init__(self, name: str, scheme: str = "https", path: str = "/metrics",
                 insecure_skip_verify: bool = False, interval_s: float | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.name = name
        self.scheme = scheme
        self.path = path
        self.port = 0  # the endpoint's metrics host decides (PollingSource attribute)
        self.insecure_skip_verify = insecure_skip_verify
        self.interval_s = interval_s
        if tls is None and scheme == "https":
            tls = client_tls_context(insecure_skip_verify)
        self._tls = tls

    @classmethod
    def from_params(cls, name: str, params: MultiClusterMetricsDataSourceParameters,
                    handle: PluginHandle) -> MultiClusterMetricsDataSource:
        tls = None
        if params.scheme == "https":  # llm-d loads the CA and client pair for https only
            tls = client_tls_context(params.insecure_skip_verify, params.ca_cert_path,
                                     params.client_cert_path, params.client_key_path)
        return cls(name, params.scheme, params.path, params.insecure_skip_verify,
                   params.interval_s, tls)

    def url(self, endpoint: Endpoint) -> str:
        return f"{self.scheme}://{metrics_host(endpoint)}{self.path}"

    def ssl_context(self) -> ssl.SSLContext | bool:
        """The TLS settings the poller uses (epp/datalayer/polling.py)."""
        return self._tls if self._tls is not None else False

    def parse(self, text: str) -> Payload:
        """Prometheus text, of which at most the first 8 MiB are read (llm-d's
        parseBoundedMetrics)."""
        return promparse.parse(text[:MAX_RESPONSE_BYTES])


# ------------------------------------------------------ multicluster-metrics-extractor


def _metric_spec(value: Any, path: str) -> str:
    """A metric spec (``name`` or ``name{label=value,…}``), checked now; empty: default."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a metric spec like name{{label=value}}, got "
                          f"{value!r}")
    MetricSpec.parse(value, path)
    return value


@dataclass(frozen=True)
class MultiClusterMetricsExtractorParameters:
    """Unset or empty: the default metric names (llm-d's ``cmp.Or``)."""

    kv_cache_utilization_metric: str = param("kvCacheUtilizationMetric", "",
                                             parse=_metric_spec)
    queue_size_metric: str = param("queueSizeMetric", "", parse=_metric_spec)


class MultiClusterMetricsExtractor:
    """A peer pool's aggregate KV-cache utilization and queue size → the attributes the
    multicluster scorers read."""

    type_name = MULTICLUSTER_METRICS_EXTRACTOR
    Parameters = MultiClusterMetricsExtractorParameters
    data_input = DATA_PROMETHEUS
    produces = MappingProxyType({KV_CACHE_UTILIZATION_KEY: SCALAR, QUEUE_SIZE_KEY: SCALAR})

    def __init__(self, name: str = MULTICLUSTER_METRICS_EXTRACTOR,
                 kv_cache_utilization_metric: MetricSpec | None = None,
                 queue_size_metric: MetricSpec | None = None) -> None:
        self.name = name
        self.metrics: tuple[tuple[MetricSpec, str], ...] = (
            (kv_cache_utilization_metric or MetricSpec(DEFAULT_KV_CACHE_UTILIZATION_METRIC),
             KV_CACHE_UTILIZATION_KEY),
            (queue_size_metric or MetricSpec(DEFAULT_QUEUE_SIZE_METRIC), QUEUE_SIZE_KEY),
        )
        self._missing: dict[str, str] = {}  # endpoint key -> last partial-miss message

    @classmethod
    def from_params(cls, name: str, params: MultiClusterMetricsExtractorParameters,
                    handle: PluginHandle) -> MultiClusterMetricsExtractor:
        return cls(name, MetricSpec.parse(params.kv_cache_utilization_metric),
                   MetricSpec.parse(params.queue_size_metric))

    def extract(self, payload: Payload) -> tuple[dict[str, float], list[str]]:
        """(the attributes found, an error per metric not found)."""
        out: dict[str, float] = {}
        errors: list[str] = []
        for spec, key in self.metrics:
            sample = spec.select(payload)
            if sample is None:
                what = (f"metric family {spec.name!r} not found" if not payload.get(spec.name)
                        else f"no matching metric found for {spec}")
                errors.append(f"{key}: {what}")
                continue
            out[key] = sample.value
        return out, errors

    def extract_poll(self, payload: Payload, endpoint: Endpoint) -> Mapping[str, float]:
        found, errors = self.extract(payload)
        if not found:
            raise ValueError("; ".join(errors))
        problem = "; ".join(errors)
        if problem != self._missing.get(endpoint.key, ""):
            if problem:
                log.warning("data layer: %s %r on %s: %s (the other aggregate is used; "
                            "logged again only if this changes)", self.type_name, self.name,
                            endpoint.key, problem)
                self._missing[endpoint.key] = problem
            else:
                self._missing.pop(endpoint.key, None)
        return found


# --------------------------------------------------------------------------- scorers


class _PoolAttributeScorer:
    """Reads one pool attribute the multicluster extractor writes; needs its producer."""

    type_name = ""
    Parameters = NoParameters
    key = ""

    def __init__(self, name: str) -> None:
        self.name = name
        self.consumes = MappingProxyType({self.key: SCALAR})

    @classmethod
    def from_params(cls, name: str, params: NoParameters, handle: PluginHandle) -> Self:
        return cls(name)

    def bind(self, handle: PluginHandle) -> None:
        """llm-d marks the attribute Required: without a plugin producing it the config
        fails at load (ErrNoDefaultProducer), rather than silently scoring nothing."""
        for p in handle.of_type(ProducesData):
            if self.key in (p.produces or {}):
                return
        raise ConfigError(f"no default producer found for missing data key {self.key}, "
                          f"consumed by {self.name}: declare a multicluster-metrics-extractor "
                          "and attach it to a multicluster-metrics-data-source in "
                          "dataLayer.sources")

    def values(self, endpoints: Sequence[Endpoint]) -> list[float | None]:
        return [e.metrics.attributes.get(self.key) for e in endpoints]


class MultiClusterQueueScorer(_PoolAttributeScorer):
    """Shortest pool queue 1, longest 0 (min-max over the scored clusters; all equal: 1);
    a cluster without the attribute 0."""

    type_name = "multicluster-queue-scorer"
    key = QUEUE_SIZE_KEY

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        queues = self.values(endpoints)
        known = [q for q in queues if q is not None]
        if not known:
            return [0.0] * len(endpoints)
        lo, hi = min(known), max(known)
        return [0.0 if q is None else 1.0 if hi == lo else (hi - q) / (hi - lo)
                for q in queues]


class MultiClusterKVCacheUtilizationScorer(_PoolAttributeScorer):
    """1 − the pool's KV-cache utilization; a cluster without the attribute 0."""

    type_name = "multicluster-kv-cache-utilization-scorer"
    key = KV_CACHE_UTILIZATION_KEY

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        return [0.0 if u is None else 1.0 - u for u in self.values(endpoints)]


# ------------------------------------------------------------------- thin variants


class MultiClusterPrefixCacheScorer(PrefixCacheScorer):
    """``prefix-cache-scorer`` over cluster endpoints (a repeated prefix goes back to the
    cluster that served it); same parameters."""

    type_name = "multicluster-prefix-cache-scorer"


class MultiClusterApproxPrefixCacheProducer(ApproxPrefixCacheProducer):
    """``approx-prefix-cache-producer`` indexing (cluster, block); same parameters. A
    prefix scorer binds to it as to the stock producer."""

    type_name = "multicluster-approx-prefix-cache-producer"


class MultiClusterSessionAffinityFilter(SessionAffinityFilter):
    """``session-affinity-filter`` pinning a session to its cluster endpoint; same
    parameters."""

    type_name = "multicluster-session-affinity-filter"


MULTICLUSTER_PLUGINS: tuple[type, ...] = (
    MultiClusterMetricsDataSource,
    MultiClusterMetricsExtractor,
    MultiClusterQueueScorer,
    MultiClusterKVCacheUtilizationScorer,
    MultiClusterPrefixCacheScorer,
    MultiClusterApproxPrefixCacheProducer,
    MultiClusterSessionAffinityFilter,
)
