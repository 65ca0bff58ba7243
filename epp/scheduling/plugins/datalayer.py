"""GIE v1.5.0's data-layer plugins: ``metrics-data-source``, ``core-metrics-extractor``,
``endpoint-notification-source`` and ``k8s-notification-source``.

They are declared in ``plugins`` and wired by the config's ``dataLayer.sources`` (a
source and the extractors it feeds); without a ``dataLayer`` section the loader injects
GIE's default, ``metrics-data-source`` feeding ``core-metrics-extractor`` — the declared
ones when the config declares plugins of those names (as GIE's Helm chart does).

The metrics pair drives the EPP's one scraper (epp/datalayer/scraper.py,
epp/datalayer/config.py): the source gives the URL scheme, path and TLS verification
(each unset parameter falls back to its ``--model-server-metrics-*`` flag, whose
defaults are GIE's: ``http``, ``/metrics``, ``true``); the extractor gives the engine
mappings (GIE's ``engineConfigs``, ``defaultEngine``, ``engineLabelKey``).
``endpoint-notification-source`` tells its extractors (Python plugins implementing
``extract_endpoint``) when endpoints join or leave the pool; ``k8s-notification-source``
tells its extractors (``extract_notification``) about the objects of one Kubernetes kind
(the watch is epp/datalayer/notifications.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epp import keys
from epp.datalayer.engines import (
    EngineMapping,
    EngineMappings,
    MappingOverrides,
    builtin_mappings,
    mapping_from_config,
)
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import (
    DATA_ENDPOINT_EVENTS,
    DATA_K8S_NOTIFICATIONS,
    DATA_PROMETHEUS,
    gvk_string,
)
from epp.framework.params import NoParameters, ParameterError, param, report_unknown

# ------------------------------------------------------------------ metrics-data-source


def _scheme(value: Any, path: str) -> str:
    if value not in ("http", "https"):
        raise ConfigError(f"{path}: unsupported scheme {value!r}; use http or https")
    return str(value)


def _path(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path}: expected a URL path like /metrics, got {value!r}")
    return value if value.startswith("/") else "/" + value


@dataclass(frozen=True)
class MetricsDataSourceParameters:
    """Unset (None) = the ``--model-server-metrics-*`` flag (GIE: flag, else default)."""

    scheme: str | None = param("scheme", None, parse=_scheme)
    path: str | None = param("path", None, parse=_path)
    insecure_skip_verify: bool | None = param("insecureSkipVerify", None)


class MetricsDataSource:
    """Polls each endpoint's Prometheus ``/metrics`` (the EPP's scraper does the polling)."""

    type_name = "metrics-data-source"
    Parameters = MetricsDataSourceParameters
    data_output = DATA_PROMETHEUS

    def __init__(self, name: str, scheme: str | None = None, path: str | None = None,
                 insecure_skip_verify: bool | None = None) -> None:
        self.name = name
        self.scheme = scheme
        self.path = path
        self.insecure_skip_verify = insecure_skip_verify

    @classmethod
    def from_params(cls, name: str, params: MetricsDataSourceParameters,
                    handle: PluginHandle) -> MetricsDataSource:
        return cls(name, params.scheme, params.path, params.insecure_skip_verify)


# --------------------------------------------------------------- core-metrics-extractor

_ENGINE_FIELDS = {
    "queuedRequestsSpec": "queued",
    "runningRequestsSpec": "running",
    "kvUsageSpec": "kv_usage",
    "loraSpec": "lora",
    "cacheInfoSpec": "cache_info",
    "cacheBlockSizeLabelName": "cache_block_size_label",
    "cacheNumBlocksLabelName": "cache_num_blocks_label",
    "cacheBlockSizeSpec": "cache_block_size",
    "cacheNumBlocksSpec": "cache_num_blocks",
}
#: GIE's reserved registry key for the fallback mapping.
_RESERVED_ENGINE = "default"


def _engine_configs(value: Any, path: str) -> tuple[EngineMapping, ...]:
    """GIE's ``engineConfigs``: a list of ``{name, <spec fields>}``; an unset or empty
    spec is not read (GIE replaces a built-in engine's whole entry, no merging)."""
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of engine configs, got "
                          f"{type(value).__name__}")
    out: list[EngineMapping] = []
    seen: set[str] = set()
    for i, entry in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(entry).__name__}")
        report_unknown(where, set(entry) - {"name", *_ENGINE_FIELDS}, {"name", *_ENGINE_FIELDS})
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: engine config name cannot be empty")
        if name == _RESERVED_ENGINE:
            raise ConfigError(f"{where}.name: engine config name cannot be "
                              f"{_RESERVED_ENGINE!r} (reserved)")
        if name in seen:
            raise ConfigError(f"{where}.name: mapping for engine type {name!r} already exists")
        seen.add(name)
        specs: dict[str, str] = {}
        for key, arg in _ENGINE_FIELDS.items():
            v = entry.get(key)
            if v is None:
                continue
            if not isinstance(v, str):
                raise ConfigError(f"{where}.{key}: expected a string, got {v!r}")
            specs[arg] = v
        out.append(mapping_from_config(name, where=where, **specs))
    return tuple(out)


def _label_key(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a label key, got {value!r}")
    return value


@dataclass(frozen=True)
class CoreMetricsExtractorParameters:
    engine_label_key: str = param("engineLabelKey", "", parse=_label_key)
    default_engine: str = param("defaultEngine", "")
    engine_configs: tuple[EngineMapping, ...] = param("engineConfigs", (),
                                                      parse=_engine_configs)

    def __post_init__(self) -> None:
        names = {m.engine for m in self.engine_configs} | set(builtin_mappings())
        engine = self.default_engine or keys.ENGINE_VLLM
        if engine not in names:
            raise ParameterError("defaultEngine", f"{engine!r} not found in engineConfigs "
                                 f"(known: {', '.join(sorted(names))})")


class CoreMetricsExtractor:
    """Maps scraped samples to load signals per engine (GIE's model-server protocol
    extractor). The engine comes from the endpoint's ``engineLabelKey`` label (by default
    ``llm-d.ai/engine-type``, then ``inference.networking.k8s.io/engine-type``); an
    unlabelled or unknown engine gets ``defaultEngine``'s mapping (``vllm``).
    ``engineConfigs`` entries replace the built-in mapping of the same name whole and add
    new engines; the built-ins are vllm, sglang, trtllm-serve, triton-tensorrt-llm, triton."""

    type_name = "core-metrics-extractor"
    Parameters = CoreMetricsExtractorParameters
    data_input = DATA_PROMETHEUS

    def __init__(self, name: str, engine_label_key: str = "",
                 default_engine: str = "",
                 engine_configs: tuple[EngineMapping, ...] = ()) -> None:
        self.name = name
        self.engine_label_key = engine_label_key
        self.default_engine = default_engine or keys.ENGINE_VLLM
        table = builtin_mappings()
        table.update({m.engine: m for m in engine_configs})
        self.table: dict[str, EngineMapping] = table
        EngineMappings(table, self.default_engine)  # fails now, not at the first scrape

    @classmethod
    def from_params(cls, name: str, params: CoreMetricsExtractorParameters,
                    handle: PluginHandle) -> CoreMetricsExtractor:
        return cls(name, params.engine_label_key, params.default_engine,
                   params.engine_configs)

    def engine_mappings(self, overrides: MappingOverrides | None = None) -> EngineMappings:
        """A fresh mapping table for one scraper (it remembers which unknown engines it
        has warned about); ``overrides`` (the metric flags) apply to the default engine."""
        label_keys = ((self.engine_label_key,) if self.engine_label_key
                      else EngineMappings.DEFAULT_LABEL_KEYS)
        return EngineMappings(self.table, self.default_engine, overrides, label_keys)


# ------------------------------------------------------------------ notification sources


class EndpointNotificationSource:
    """Tells its extractors (``extract_endpoint(event, endpoint)``) when an endpoint joins
    the pool or changes (``add-or-update``) and when it leaves (``delete``)."""

    type_name = "endpoint-notification-source"
    Parameters = NoParameters
    data_output = DATA_ENDPOINT_EVENTS

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> EndpointNotificationSource:
        return cls(name)


def _required(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: required (a non-empty string), got {value!r}")
    return value


def _group(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a string ('' for the core API group), "
                          f"got {value!r}")
    return value


@dataclass(frozen=True)
class K8sNotificationSourceParameters:
    group: str = param("group", "", parse=_group)
    version: str = param("version", "", parse=_required)
    kind: str = param("kind", "", parse=_required)


class K8sNotificationSource:
    """Watches one Kubernetes kind (``group``, ``version``, ``kind``) for its extractors
    (:class:`~epp.framework.interfaces.NotificationExtractor`): each object created or
    changed is an ``add-or-update``, each one deleted a ``delete``. Validated as GIE does
    (two sources may not watch the same kind; an extractor must be a notification
    extractor of the same kind); watched with Kubernetes discovery only
    (epp/datalayer/notifications.py)."""

    type_name = "k8s-notification-source"
    Parameters = K8sNotificationSourceParameters
    data_output = DATA_K8S_NOTIFICATIONS

    def __init__(self, name: str, group: str, version: str, kind: str) -> None:
        self.name = name
        self.group = group
        self.version = version
        self.kind = kind

    @property
    def gvk(self) -> str:
        """``group/version, Kind=kind`` (Kubernetes' GroupVersionKind string)."""
        return gvk_string(self.group, self.version, self.kind)

    @classmethod
    def from_params(cls, name: str, params: K8sNotificationSourceParameters,
                    handle: PluginHandle) -> K8sNotificationSource:
        if not params.version or not params.kind:
            raise ParameterError("version" if not params.version else "kind",
                                 "version and kind are required for k8s-notification-source "
                                 "(group, version, kind)")
        return cls(name, params.group, params.version, params.kind)
