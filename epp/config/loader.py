"""EndpointPickerConfig loading in two phases (design.md §5, §9 rule 3), with GIE
v1.5.0's rules (pkg/epp/config/loader: configloader.go, defaults.go, validation.go;
apix/config/v1alpha1/endpointpickerconfig_types.go; cmd/epp/runner/runner.go).

Phase 1, :func:`parse_config`: YAML → validated frozen dataclasses. As GIE decodes the
document strictly, an unknown key anywhere in the structure (top level, a plugin entry, a
profile, ``dataLayer``, ``parser``, ``requestHandler``, ``saturationDetector``), a duplicate key, an unknown
feature gate or a value of the wrong type is an error.

Phase 2, :func:`build`: every plugin type is resolved first (an unknown type fails before
anything else, with a "did you mean"), then every plugin is created through the registry
(each decodes its own ``parameters``; an unknown parameter is ignored with a warning, as
GIE's ``json.Unmarshal`` ignores it, or is an error with ``strict=True``), the defaults GIE
injects are injected (a ``default`` profile, the profile handler, the picker, weight 1,
the saturation detector, the parser, the data layer), the references are checked, the
scheduler is assembled and, last, the plugins' data dependencies are checked as GIE's
runner checks them (epp/datalayer/dependencies.py). Both phases run at startup; any
problem raises :class:`ConfigError` naming the file, the path in it and the fix. Warnings
are logged and kept on :attr:`BuiltConfig.warnings`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from epp import keys
from epp.datalayer.config import DataLayerConfig, SourceConfig
from epp.datalayer.dependencies import DependencyError, check_data_dependencies
from epp.datalayer.polling import PollingExtractor, PollingSource
from epp.discovery.llmd_file import EndpointDiscovery
from epp.errors import ConfigError
from epp.flowcontrol.config import (
    FlowControlConfig,
    FlowControlSpec,
    build_flow_control,
    parse_flow_control,
)
from epp.flowcontrol.interfaces import FairnessPolicy
from epp.framework.handle import BindsPlugins, PluginHandle
from epp.framework.interfaces import (
    ChecksProfiles,
    DataExtractor,
    DataSource,
    EndpointExtractor,
    EndpointRemoved,
    Filter,
    NotificationExtractor,
    Picker,
    Plugin,
    PluginTimer,
    PreRequest,
    ProfileHandler,
    RequestHeaders,
    RequestParser,
    ResponseComplete,
    ResponseHeaders,
    ResponseUsageMetadata,
    SaturationDetector,
    Scorer,
    no_timer,
)
from epp.framework.params import DecodePolicy, decoding, parse_duration, suggest
from epp.framework.registry import Builder, Registry
from epp.parsing.dispatch import ParserRouter
from epp.parsing.parser import Parser
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.datalayer import EndpointNotificationSource, K8sNotificationSource
from epp.scheduling.scheduler import Scheduler, SchedulerProfile

DEFAULT_CONFIG_TEXT = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters: {blockSizeTokens: 16, maxPrefixBlocksToMatch: 256, lruCapacityPerServer: 31250,
               avoidQueueing: true, balancePopularOnly: true}
- type: prefix-cache-scorer
- type: active-request-scorer
- type: no-hit-lru-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: active-request-scorer, weight: 1}
  - {pluginRef: no-hit-lru-scorer, weight: 1}
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: kv-cache-utilization-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""

# --- feature gates (GIE v1.5.0 registers these three) ---
FEATURE_DATA_LAYER = "dataLayer"  # deprecated: the data layer is on by default
FEATURE_LEGACY_METRICS = "enableLegacyMetrics"  # the scraper from the flags alone
FEATURE_FLOW_CONTROL = "flowControl"
KNOWN_FEATURE_GATES = frozenset({FEATURE_DATA_LAYER, FEATURE_LEGACY_METRICS,
                                 FEATURE_FLOW_CONTROL})
# GIE v1.5.0's deprecated environment switch for the flowControl gate (cmd/epp/runner:
# applyDeprecatedEnvFeatureGate): a true value (Go's strconv.ParseBool) adds the gate.
ENV_FLOW_CONTROL = "ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER"
# llm-d-router v0.10.0's gate "haPopulateNonLeaderDatastore" (on by default there: replicas
# that are not the leader keep their datastore populated): this EPP's followers always do,
# so either value is accepted and changes nothing.
_LLMD_NOOP_GATES = frozenset({"haPopulateNonLeaderDatastore"})
_GATE_BOOLS = {"1": True, "t": True, "true": True, "0": False, "f": False, "false": False}
_REMOVED_FEATURE_GATES = {
    "prepareDataPlugins": "removed in GIE v1.5.0 (data-preparation plugins always run); "
                          "remove it",
}

# --- plugins the loader injects, by GIE's names ---
SINGLE_PROFILE_HANDLER = "single-profile-handler"
MAX_SCORE_PICKER = "max-score-picker"
UTILIZATION_DETECTOR = "utilization-detector"
OPENAI_PARSER = "openai-parser"
METRICS_DATA_SOURCE = "metrics-data-source"
CORE_METRICS_EXTRACTOR = "core-metrics-extractor"

_TOP_KEYS = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles",
             "saturationDetector", "dataLayer", "parser", "flowControl", "requestHandler"}
_RENAMED = {
    "data": "'data' is GIE v1.4's name of this section; GIE v1.5.0 reads only 'dataLayer' "
            "(and rejects 'data'): rename it to 'dataLayer'",
}
# Sections GIE reads that this EPP does not support yet (none at present).
_NOT_YET: dict[str, str] = {}


@dataclass(frozen=True)
class PluginSpec:
    name: str
    type: str
    parameters: Mapping[str, Any]
    path: str


@dataclass(frozen=True)
class PluginRef:
    plugin_ref: str
    weight: float | None
    path: str


@dataclass(frozen=True)
class ProfileSpec:
    name: str
    plugins: tuple[PluginRef, ...]
    path: str


@dataclass(frozen=True)
class DataLayerSourceSpec:
    """``dataLayer.sources[i]``: a source plugin and the extractors it feeds."""

    plugin_ref: str
    extractors: tuple[str, ...]
    path: str


@dataclass(frozen=True)
class DataLayerSpec:
    """The config's ``dataLayer`` section (present, possibly without sources)."""

    sources: tuple[DataLayerSourceSpec, ...]
    path: str = "dataLayer"
    # llm-d-router v0.10.0's keys (apix/config/v1alpha1 DataLayerConfig):
    discovery: str | None = None  # discovery.pluginRef: the EPP's endpoint source
    syncer: str | None = None  # crossReplicaSyncerPluginRef (llm-d registers no syncer)
    sync_interval_s: float | None = None  # crossReplicaSyncInterval
    inject_defaults: bool | None = None  # injectDefaults (None: not given)
    llmd_api: bool = False  # the document's apiVersion is llm-d.ai/v1alpha1

    @property
    def llmd(self) -> bool:
        """Whether llm-d-router's loader rules apply: the document says ``apiVersion:
        llm-d.ai/v1alpha1`` or sets an llm-d-only key. Then (ensureDataLayer) the default
        metrics source is added unless injectDefaults is false or a metrics-data-source
        is listed; GIE's rules otherwise (a section without sources fails)."""
        return (self.llmd_api or self.discovery is not None or self.syncer is not None
                or self.sync_interval_s is not None or self.inject_defaults is not None)


@dataclass(frozen=True)
class ParserSpec:
    """The config's ``parser: {pluginRef: NAME}`` (GIE's ParserConfig)."""

    plugin_ref: str
    path: str = "parser.pluginRef"


@dataclass(frozen=True)
class RequestHandlerSpec:
    """llm-d-router's ``requestHandler: {parsers: [{pluginRef: NAME}, …]}``
    (apix/config/v1alpha1 RequestHandlerConfig): the parsers, in order of precedence
    (epp/parsing/dispatch.py). Empty: no parsers listed (the default parser)."""

    parsers: tuple[ParserSpec, ...]
    path: str = "requestHandler"


@dataclass(frozen=True)
class EndpointPickerConfig:
    source: str
    plugins: tuple[PluginSpec, ...]
    profiles: tuple[ProfileSpec, ...]
    feature_gates: tuple[str, ...] = ()
    # ``saturationDetector.pluginRef``; None (absent or empty) = utilization-detector.
    saturation_detector: str | None = None
    data_layer: DataLayerSpec | None = None  # None: no ``dataLayer`` section
    parser: ParserSpec | None = None  # None: no ``parser`` section (openai-parser)
    warnings: tuple[str, ...] = ()  # from parsing; re-issued (logged) by build()
    # The ``flowControl`` section, decoded strictly whether or not the gate is on (None:
    # absent); built into :attr:`BuiltConfig.flow_control` only under the gate.
    flow_control: FlowControlSpec | None = None
    request_handler: RequestHandlerSpec | None = None  # None: no ``requestHandler``
    api_version: str = ""  # the document's apiVersion ("" when absent)

    @property
    def llmd_document(self) -> bool:
        """An llm-d-router document (``apiVersion: llm-d.ai/v1alpha1``): llm-d's rules
        that GIE does not have apply to it (the Alpha plugin gate)."""
        return self.api_version == LLMD_API_VERSION


@dataclass
class BuiltConfig:
    """Phase-2 output: live plugins and the scheduler assembled from them."""

    config: EndpointPickerConfig
    plugins: dict[str, Plugin]
    scheduler: Scheduler
    pre_request: list[PreRequest] = field(default_factory=list)
    response_complete: list[ResponseComplete] = field(default_factory=list)
    endpoint_removed: list[EndpointRemoved] = field(default_factory=list)
    request_headers: list[RequestHeaders] = field(default_factory=list)
    response_headers: list[ResponseHeaders] = field(default_factory=list)
    response_usage_metadata: list[ResponseUsageMetadata] = field(default_factory=list)
    # The plugin named by ``saturationDetector: {pluginRef: …}``, or the
    # utilization-detector GIE injects (with its defaults) when none is named.
    saturation_detector: SaturationDetector | None = None
    # The data layer: None under the ``enableLegacyMetrics`` feature gate (the scraper
    # from the flags alone); GIE's default when the config has no ``dataLayer`` section.
    data_layer: DataLayerConfig | None = None
    # The ``parser`` section as written (None: absent) and the parser plugin it resolves
    # to — the named one, or the openai-parser GIE injects.
    parser: ParserSpec | None = None
    parser_plugin: RequestParser | None = None
    # Flow control, ready to run: set under the ``flowControl`` feature gate (from the
    # ``flowControl`` section, or GIE's defaults without one); None without the gate,
    # when the Director applies GIE's legacy admission instead.
    flow_control: FlowControlConfig | None = None
    feature_gates: frozenset[str] = frozenset()
    warnings: list[str] = field(default_factory=list)
    # llm-d-router's dataLayer.discovery: the plugin that is the endpoint source (the EPP
    # then runs without Kubernetes and without --endpoints; epp/discovery/llmd_file.py).
    discovery: EndpointDiscovery | None = None


# The built-in catalog: plugins a config gets without declaring them (the single-profile
# handler, the max-score picker, …) come from it whatever registry builds the declared ones.
_BUILTINS = default_registry()


def _err(source: str, path: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {path}: {msg}" if path else f"{source}: {msg}")


def _check_keys(source: str, path: str, obj: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        hints = "".join(suggest(str(k), allowed) for k in unknown)
        raise _err(source, path or "(top level)",
                   f"unknown key(s) {', '.join(map(repr, unknown))}{hints}; allowed: "
                   f"{', '.join(sorted(allowed))}")


def _mapping(source: str, path: str, v: Any) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise _err(source, path, f"expected a mapping, got {type(v).__name__}")
    return v


def _list(source: str, path: str, v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise _err(source, path, f"expected a list, got {type(v).__name__}")
    return v


def _name(source: str, path: str, v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise _err(source, path, f"expected a non-empty string, got {v!r}")
    return v


# ------------------------------------------------------------------------------ YAML


class _StrictLoader(yaml.SafeLoader):
    """YAML that rejects a key given twice in one mapping (GIE decodes strictly)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode,
                       deep: bool = False) -> dict[Hashable, Any]:
    seen: dict[Hashable, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # '<<: *anchor' keys may be overridden
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, Hashable) and key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line "
                f"{seen[key].start_mark.line + 1})", mark)
        if isinstance(key, Hashable):
            seen[key] = key_node
    loader.flatten_mapping(node)
    return dict(loader.construct_pairs(node, deep=deep))


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                              _construct_mapping)


def _load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = " ".join(x for x in (e.context, e.problem) if x)
        raise ConfigError(f"{source}: not valid YAML{at}: {what}") from e
    except yaml.YAMLError as e:
        raise _err(source, "", f"not valid YAML: {e}") from e


# --------------------------------------------------------------------------- phase 1


def parse_config(text: str, source: str = "<config>") -> EndpointPickerConfig:
    """Phase 1: parse and validate the structure of an EndpointPickerConfig document.

    References between sections (``pluginRef``) are checked by :func:`build`, after the
    plugin types (GIE's order)."""
    doc = _load_yaml(text, source)
    if doc is None:
        doc = {}
    doc = _mapping(source, "(top level)", doc)
    for key, why in _RENAMED.items():
        if key in doc:
            raise _err(source, key, why)
    for key, why in _NOT_YET.items():
        if key in doc:
            raise _err(source, key, why)
    _check_keys(source, "", doc, _TOP_KEYS)
    warnings: list[str] = []

    api = doc.get("apiVersion")
    if api is not None and api not in keys.CONFIG_API_VERSIONS:
        raise _err(source, "apiVersion", f"unsupported {api!r}; use one of "
                   f"{', '.join(keys.CONFIG_API_VERSIONS)}")
    kind = doc.get("kind")
    if kind is not None and kind != keys.CONFIG_KIND:
        raise _err(source, "kind", f"expected {keys.CONFIG_KIND!r}, got {kind!r}")

    written = tuple(_name(source, f"featureGates[{i}]", g)
                    for i, g in enumerate(_list(source, "featureGates",
                                                doc.get("featureGates") or [])))
    gates_on: list[str] = []
    for i, entry in enumerate(written):
        # llm-d-router v0.10.0 (loader.loadFeatureConfig): "name=bool" sets a gate on or
        # off explicitly (Go's strconv.ParseBool on the trimmed, lower-cased value).
        g, sep, value = entry.partition("=")
        enabled = True
        if sep:
            v = value.strip().lower()
            if v not in _GATE_BOOLS:
                raise _err(source, f"featureGates[{i}]", f"{value!r} is not a valid value "
                           f"for the feature gate {g!r}; write {g}=true or {g}=false")
            enabled = _GATE_BOOLS[v]
        if g in _LLMD_NOOP_GATES:
            continue  # known to llm-d, nothing to switch here
        if enabled:
            gates_on.append(g)
        if g in _REMOVED_FEATURE_GATES:
            raise _err(source, f"featureGates[{i}]", f"feature gate {g!r} is "
                       f"{_REMOVED_FEATURE_GATES[g]}")
        if g not in KNOWN_FEATURE_GATES:
            raise _err(source, f"featureGates[{i}]", f"unknown feature gate {g!r}"
                       f"{suggest(g, KNOWN_FEATURE_GATES)}; known: "
                       f"{', '.join(sorted(KNOWN_FEATURE_GATES))}")
        if g == FEATURE_DATA_LAYER:
            warnings.append(f"featureGates[{i}]: 'dataLayer' is deprecated and has no effect "
                            "(the data layer is on by default); remove it")
    gates = tuple(dict.fromkeys(gates_on))

    plugins: list[PluginSpec] = []
    seen: set[str] = set()
    for i, raw in enumerate(_list(source, "plugins", doc.get("plugins") or [])):
        path = f"plugins[{i}]"
        raw = _mapping(source, path, raw)
        _check_keys(source, path, raw, {"name", "type", "parameters"})
        if "type" not in raw:
            raise _err(source, path, "missing 'type' (the plugin type, e.g. queue-scorer)")
        ptype = _name(source, f"{path}.type", raw["type"])
        name = raw.get("name")
        if name is None or name == "":
            name = ptype  # GIE: the name defaults to the type
        name = _name(source, f"{path}.name", name)
        if name in seen:
            raise _err(source, f"{path}.name", f"duplicate plugin name {name!r}; give each "
                       "instance its own 'name'")
        seen.add(name)
        params = raw.get("parameters") or {}
        _mapping(source, f"{path}.parameters", params)
        plugins.append(PluginSpec(name, ptype, params, path))

    profiles: list[ProfileSpec] = []
    pnames: set[str] = set()
    for i, raw in enumerate(_list(source, "schedulingProfiles", doc.get("schedulingProfiles") or [])):
        path = f"schedulingProfiles[{i}]"
        raw = _mapping(source, path, raw)
        _check_keys(source, path, raw, {"name", "plugins"})
        if "name" not in raw:
            raise _err(source, path, "missing 'name'")
        pname = _name(source, f"{path}.name", raw["name"])
        if pname in pnames:
            raise _err(source, f"{path}.name", f"duplicate profile name {pname!r}")
        pnames.add(pname)
        refs: list[PluginRef] = []
        for j, r in enumerate(_list(source, f"{path}.plugins", raw.get("plugins") or [])):
            rpath = f"{path}.plugins[{j}]"
            r = _mapping(source, rpath, r)
            _check_keys(source, rpath, r, {"pluginRef", "weight"})
            if "pluginRef" not in r:
                raise _err(source, rpath, "missing 'pluginRef' (the name of a plugin in 'plugins')")
            ref = _name(source, f"{rpath}.pluginRef", r["pluginRef"])
            w = r.get("weight")
            if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float))):
                raise _err(source, f"{rpath}.weight", f"expected a number, got {w!r}")
            refs.append(PluginRef(ref, None if w is None else float(w), rpath))
        profiles.append(ProfileSpec(pname, tuple(refs), path))

    sat_ref: str | None = None
    sat = doc.get("saturationDetector")
    if sat is not None:
        sat = _mapping(source, "saturationDetector", sat)
        _check_keys(source, "saturationDetector", sat, {"pluginRef"})
        ref_value = sat.get("pluginRef")
        if ref_value is not None and not isinstance(ref_value, str):
            raise _err(source, "saturationDetector.pluginRef",
                       f"expected a plugin name, got {ref_value!r}")
        sat_ref = ref_value or None  # empty: utilization-detector (GIE)

    data_layer: DataLayerSpec | None = None
    if "dataLayer" in doc and doc["dataLayer"] is not None:
        dl = _mapping(source, "dataLayer", doc["dataLayer"])
        _check_keys(source, "dataLayer", dl, {"sources", *_LLMD_DATA_LAYER_KEYS})
        sources: list[DataLayerSourceSpec] = []
        for i, raw in enumerate(_list(source, "dataLayer.sources", dl.get("sources") or [])):
            path = f"dataLayer.sources[{i}]"
            raw = _mapping(source, path, raw)
            _check_keys(source, path, raw, {"pluginRef", "extractors"})
            if "pluginRef" not in raw:
                raise _err(source, path, "missing 'pluginRef' (the name of a data source "
                           "plugin, e.g. metrics-data-source)")
            ref = _name(source, f"{path}.pluginRef", raw["pluginRef"])
            extractors: list[str] = []
            for j, e in enumerate(_list(source, f"{path}.extractors", raw.get("extractors") or [])):
                epath = f"{path}.extractors[{j}]"
                e = _mapping(source, epath, e)
                _check_keys(source, epath, e, {"pluginRef"})
                if "pluginRef" not in e:
                    raise _err(source, epath, "missing 'pluginRef' (the name of an extractor "
                               "plugin, e.g. core-metrics-extractor)")
                extractors.append(_name(source, f"{epath}.pluginRef", e["pluginRef"]))
            sources.append(DataLayerSourceSpec(ref, tuple(extractors), path))
        data_layer = DataLayerSpec(tuple(sources), **_llmd_data_layer(source, dl),
                                   llmd_api=doc.get("apiVersion") == LLMD_API_VERSION)

    parser: ParserSpec | None = None
    if doc.get("parser") is not None:
        p = _mapping(source, "parser", doc["parser"])
        _check_keys(source, "parser", p, {"pluginRef"})
        parser = ParserSpec(_name(source, "parser.pluginRef", p.get("pluginRef")))

    request_handler: RequestHandlerSpec | None = None
    if doc.get("requestHandler") is not None:
        request_handler = _request_handler(source, doc["requestHandler"])
        if parser is not None and request_handler.parsers:
            # llm-d-router: "If both are set, the new field is used."
            warnings.append("both 'parser' and 'requestHandler.parsers' are set: "
                            "'requestHandler.parsers' is used (llm-d-router deprecates "
                            "the top-level 'parser')")

    flow_control: FlowControlSpec | None = None
    if "flowControl" in doc:
        # Decoded (strictly: unknown keys, bad quantities and durations fail) even when
        # the feature gate is off, as GIE decodes it; used only under the gate.
        fc_raw = doc["flowControl"]
        if isinstance(fc_raw, Mapping) and "saturationDetector" in fc_raw:
            # llm-d-router v0.10.0's ``flowControl.saturationDetector`` (configloader.go:
            # it wins over the deprecated top-level one); read whatever the gate says.
            fsat = _mapping(source, "flowControl.saturationDetector",
                            fc_raw["saturationDetector"])
            _check_keys(source, "flowControl.saturationDetector", fsat, {"pluginRef"})
            fref = fsat.get("pluginRef")
            if fref is not None and not isinstance(fref, str):
                raise _err(source, "flowControl.saturationDetector.pluginRef",
                           f"expected a plugin name, got {fref!r}")
            sat_ref = fref or None  # empty: utilization-detector
            fc_raw = {k: v for k, v in fc_raw.items() if k != "saturationDetector"} or None
        if fc_raw is not None or doc["flowControl"] is None:
            # (only a saturationDetector: as no section, GIE's defaults under the gate)
            flow_control = parse_flow_control(fc_raw, source)
            warnings += flow_control.warnings

    api = doc.get("apiVersion")
    return EndpointPickerConfig(source, tuple(plugins), tuple(profiles), gates, sat_ref,
                                data_layer, parser, tuple(warnings), flow_control,
                                request_handler, api if isinstance(api, str) else "")


LLMD_API_VERSION = "llm-d.ai/v1alpha1"
_LLMD_DATA_LAYER_KEYS = {"discovery", "crossReplicaSyncerPluginRef", "crossReplicaSyncInterval",
                         "injectDefaults"}


def _llmd_data_layer(source: str, dl: Mapping[str, Any]) -> dict[str, Any]:
    """llm-d-router v0.10.0's ``dataLayer`` keys, decoded strictly (DataLayerConfig)."""
    out: dict[str, Any] = {}
    if dl.get("discovery") is not None:
        disc = _mapping(source, "dataLayer.discovery", dl["discovery"])
        _check_keys(source, "dataLayer.discovery", disc, {"pluginRef"})
        if "pluginRef" not in disc:
            raise _err(source, "dataLayer.discovery", "missing 'pluginRef' (the name of a "
                       "discovery plugin in 'plugins', e.g. file-discovery)")
        out["discovery"] = _name(source, "dataLayer.discovery.pluginRef", disc["pluginRef"])
    ref = dl.get("crossReplicaSyncerPluginRef")
    if ref is not None and ref != "":
        out["syncer"] = _name(source, "dataLayer.crossReplicaSyncerPluginRef", ref)
    interval = dl.get("crossReplicaSyncInterval")
    if interval is not None:
        if not isinstance(interval, str):
            raise _err(source, "dataLayer.crossReplicaSyncInterval", "expected a duration "
                       f"string like '200ms', got {interval!r}")
        out["sync_interval_s"] = parse_duration(interval, f"{source}: dataLayer."
                                                "crossReplicaSyncInterval")
    inject = dl.get("injectDefaults")
    if inject is not None:
        if not isinstance(inject, bool):
            raise _err(source, "dataLayer.injectDefaults", f"expected true or false, got "
                       f"{inject!r}")
        out["inject_defaults"] = inject
    return out


def _request_handler(source: str, raw: Any) -> RequestHandlerSpec:
    """Decode ``requestHandler`` strictly (llm-d-router v0.10.0 RequestHandlerConfig)."""
    rh = _mapping(source, "requestHandler", raw)
    _check_keys(source, "requestHandler", rh, {"parsers"})
    specs: list[ParserSpec] = []
    for i, e in enumerate(_list(source, "requestHandler.parsers", rh.get("parsers") or [])):
        epath = f"requestHandler.parsers[{i}]"
        e = _mapping(source, epath, e)
        _check_keys(source, epath, e, {"pluginRef"})
        if "pluginRef" not in e:
            raise _err(source, epath, "missing 'pluginRef' (the name of a parser plugin, "
                       "e.g. openai-parser)")
        specs.append(ParserSpec(_name(source, f"{epath}.pluginRef", e["pluginRef"]),
                                f"{epath}.pluginRef"))
    return RequestHandlerSpec(tuple(specs))


def apply_env_feature_gates(config: EndpointPickerConfig,
                            environ: Mapping[str, str]) -> EndpointPickerConfig:
    """GIE v1.5.0's deprecated environment switch: ``ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER``
    set to a true value (``1``, ``t``, ``true``, … as Go's ``strconv.ParseBool``) adds the
    ``flowControl`` feature gate. Setting it at all draws a deprecation warning; a value
    that is not a boolean counts as false, with a warning (GIE's ``env.GetEnvBool``)."""
    value = environ.get(ENV_FLOW_CONTROL)
    if value is None:
        return config
    deprecated = (f"{ENV_FLOW_CONTROL}: enabling the experimental flow control layer with "
                  "an environment variable is deprecated (GIE v1.5.0 removes it next); add "
                  "'featureGates: [flowControl]' to the config instead")
    warnings = [deprecated]
    enabled = _GO_BOOLS.get(value.strip())
    if enabled is None:
        warnings.append(f"{ENV_FLOW_CONTROL}={value!r} is not a boolean (use true or false); "
                        "read as false")
    gates = config.feature_gates
    if enabled and FEATURE_FLOW_CONTROL not in gates:
        gates = (*gates, FEATURE_FLOW_CONTROL)
    return dataclasses.replace(config, feature_gates=gates,
                               warnings=(*config.warnings, *warnings))


# Go's strconv.ParseBool.
_GO_BOOLS = {**dict.fromkeys(("1", "t", "T", "TRUE", "true", "True"), True),
             **dict.fromkeys(("0", "f", "F", "FALSE", "false", "False"), False)}


def load_config_file(path: str | Path) -> EndpointPickerConfig:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not a UTF-8 text file: {e}") from e
    return parse_config(text, str(p))


# --------------------------------------------------------------------------- phase 2


def build(
    config: EndpointPickerConfig,
    registry: Registry | None = None,
    timer: PluginTimer = no_timer,
    *,
    strict: bool = False,
) -> BuiltConfig:
    """Phase 2: create the plugins, inject defaults, check references, assemble the
    scheduler. ``strict``: an unknown plugin parameter is an error, not a warning."""
    with decoding(strict, config.source) as policy:
        for w in config.warnings:
            policy.warn(w)
        built = _Builder(config, registry or default_registry(), timer, policy).build()
        built.warnings = list(policy.warnings)
    return built


class _Builder:
    def __init__(self, config: EndpointPickerConfig, registry: Registry, timer: PluginTimer,
                 policy: DecodePolicy) -> None:
        src = config.source
        if not config.plugins and not config.profiles:
            # Nothing to schedule with: an empty document means the built-in default.
            default = parse_config(DEFAULT_CONFIG_TEXT, src)
            config = dataclasses.replace(config, plugins=default.plugins,
                                         profiles=default.profiles)
        self.config = config
        self.src = src
        self.registry = registry
        self.timer = timer
        self.policy = policy
        self.handle = PluginHandle()
        self.gates = frozenset(config.feature_gates)

    def err(self, path: str, msg: str) -> ConfigError:
        return _err(self.src, path, msg)

    def warn(self, path: str, msg: str) -> None:
        self.policy.warn(f"{path}: {msg}")

    def _no_plugin(self, path: str, ref: str, what: str = "") -> ConfigError:
        declared = ", ".join(sorted(self.declared)) or "none"
        return self.err(path, f"no plugin named {ref!r} in 'plugins'"
                        f"{suggest(ref, self.declared)}{what}; declared: {declared}")

    def build(self) -> BuiltConfig:
        cfg = self.config
        # Every type first: an unknown type is reported before any other problem.
        builders: list[Builder] = [self.registry.builder(spec.type, f"{self.src}: {spec.path}.type")
                                   for spec in cfg.plugins]
        for spec, builder in zip(cfg.plugins, builders, strict=True):
            self._instantiate(spec, builder)
        self.declared = {spec.name for spec in cfg.plugins}
        # Plugins that depend on others (a scorer on its data producer) bind now that all
        # are built; a bind may add the helper plugin it needs.
        for spec in cfg.plugins:
            plugin = self.handle.plugins[spec.name]
            if isinstance(plugin, BindsPlugins):
                try:
                    plugin.bind(self.handle)
                except ConfigError as e:
                    raise self.err(spec.path, str(e)) from e

        scheduler = self._scheduler()
        handle = self.handle
        built = BuiltConfig(
            config=cfg,
            plugins=handle.plugins,
            scheduler=scheduler,
            pre_request=handle.of_type(PreRequest),
            response_complete=handle.of_type(ResponseComplete),
            endpoint_removed=handle.of_type(EndpointRemoved),
            request_headers=handle.of_type(RequestHeaders),
            response_headers=handle.of_type(ResponseHeaders),
            response_usage_metadata=handle.of_type(ResponseUsageMetadata),
            saturation_detector=self._saturation_detector(),
            data_layer=self._data_layer(),
            flow_control=self._flow_control(),
            parser=cfg.parser,
            parser_plugin=self._parser(),
            feature_gates=self.gates,
            discovery=self._discovery(),
        )
        self._check_data_dependencies(built)
        return built

    def _instantiate(self, spec: PluginSpec, builder: Builder) -> None:
        try:
            plugin = builder(spec.name, spec.parameters, f"{spec.path}.parameters", self.handle)
        except ConfigError as e:
            raise ConfigError(f"{self.src}: {e}") from e
        except Exception as e:  # a user plugin's own bug: still name file and path
            raise self.err(spec.path, f"building {spec.type!r} failed: "
                           f"{type(e).__name__}: {e}") from e
        if not isinstance(plugin, Plugin):
            raise self.err(spec.path, f"{spec.type} did not build a plugin (needs name and "
                           "type_name attributes)")
        self.handle.plugins[spec.name] = plugin

    def _builtin(self, type_name: str) -> Plugin:
        """A plugin GIE injects, with default parameters, named by its type."""
        reg = self.registry if type_name in self.registry else _BUILTINS
        return reg.create(type_name, type_name, self.handle)

    # --- scheduling: GIE's ensureSchedulingLayer, validateSchedulingProfiles and
    # buildSchedulerConfig ---

    def _scheduler(self) -> Scheduler:
        handle = self.handle
        profile_specs = list(self.config.profiles)
        for pspec in profile_specs:
            for ref in pspec.plugins:
                if ref.plugin_ref not in handle.plugins:
                    raise self._no_plugin(f"{ref.path}.pluginRef", ref.plugin_ref)
        if not profile_specs:
            # No profiles: one 'default' profile with every filter, scorer and picker.
            refs = tuple(PluginRef(p.name, None, "plugins") for p in handle
                         if isinstance(p, (Filter, Scorer, Picker))
                         and not isinstance(p, (ProfileHandler, FairnessPolicy)))
            profile_specs = [ProfileSpec("default", refs, "schedulingProfiles")]

        handlers = handle.of_type(ProfileHandler)
        if len(handlers) > 1:
            raise self.err("plugins", "more than one profile handler declared: "
                           f"{', '.join(h.name for h in handlers)}; keep one")
        if handlers:
            handler = handlers[0]
        else:
            if len(profile_specs) > 1:
                raise self.err("plugins", f"{len(profile_specs)} scheduling profiles need a "
                               "profile handler plugin (e.g. disagg-profile-handler); "
                               "single-profile-handler runs one")
            default_handler = self._builtin(SINGLE_PROFILE_HANDLER)
            assert isinstance(default_handler, ProfileHandler)
            handler = default_handler
            handle.plugins.setdefault(handler.name, handler)
        if handler.type_name == SINGLE_PROFILE_HANDLER and len(profile_specs) > 1:
            raise self.err("schedulingProfiles", f"{handler.name!r} (single-profile-handler) "
                           f"runs one profile; {len(profile_specs)} are configured "
                           f"({', '.join(p.name for p in profile_specs)}): keep one, or "
                           "declare a multi-profile handler (e.g. disagg-profile-handler)")

        # A profile without a picker gets the config's (first declared) picker, else one
        # shared max-score-picker (GIE: "find or create a default picker").
        # (A flow-control fairness policy has a pick() too: it is no picker.)
        declared_pickers = [p for p in (handle.plugins[s.name] for s in self.config.plugins)
                            if isinstance(p, Picker) and not isinstance(p, ProfileHandler)
                            and not isinstance(p, FairnessPolicy)]
        default_picker: Picker | None = None
        if declared_pickers:
            first = declared_pickers[0]
            assert isinstance(first, Picker)
            default_picker = first

        profiles: dict[str, SchedulerProfile] = {}
        for pspec in profile_specs:
            filters: list[Filter] = []
            scorers: list[tuple[Scorer, float]] = []
            picker: Picker | None = None
            for ref in pspec.plugins:
                plugin = handle.plugins[ref.plugin_ref]
                if isinstance(plugin, ProfileHandler):
                    self.warn(ref.path, f"{ref.plugin_ref!r} is a profile handler; it runs the "
                              "profiles and is ignored inside one")
                    continue
                role_found = False
                if isinstance(plugin, Filter):
                    filters.append(plugin)
                    role_found = True
                if isinstance(plugin, Scorer):
                    scorers.append((plugin, 1.0 if ref.weight is None else ref.weight))
                    role_found = True
                elif ref.weight is not None:
                    self.warn(f"{ref.path}.weight", f"{ref.plugin_ref!r} is not a scorer; "
                              "its weight is ignored")
                if isinstance(plugin, Picker):
                    if picker is not None:
                        raise self.err(ref.path, f"profile {pspec.name!r} has two pickers "
                                       f"({picker.name!r}, {plugin.name!r}); keep one")
                    picker = plugin
                    role_found = True
                if not role_found:
                    self.warn(ref.path, f"{ref.plugin_ref!r} ({plugin.type_name}) is not a "
                              "filter, scorer or picker; ignored in the profile")
            if picker is None:
                if default_picker is None:
                    built_picker = self._builtin(MAX_SCORE_PICKER)
                    assert isinstance(built_picker, Picker)
                    default_picker = built_picker
                picker = default_picker
            profiles[pspec.name] = SchedulerProfile(pspec.name, filters, scorers, picker,
                                                    self.timer)

        if isinstance(handler, ChecksProfiles):
            try:
                handler.check_profiles(set(profiles))
            except ConfigError as e:
                raise self.err("schedulingProfiles", str(e)) from e
        return Scheduler(handler, profiles, self.timer)

    # --- saturation detector: ensureSaturationDetector, validateSaturationDetector ---

    def _saturation_detector(self) -> SaturationDetector:
        ref = self.config.saturation_detector
        path = "saturationDetector.pluginRef" if ref else "saturationDetector"
        name = ref or UTILIZATION_DETECTOR
        plugin = self.handle.get(name)
        if plugin is None:
            if name != UTILIZATION_DETECTOR:
                raise self._no_plugin(path, name, " (a saturation detector, e.g. "
                                      "utilization-detector or concurrency-detector)")
            plugin = self._builtin(UTILIZATION_DETECTOR)  # GIE's default, its defaults
        if not isinstance(plugin, SaturationDetector):
            raise self.err("saturationDetector", f"{name!r} is not a saturation detector "
                           "(use a utilization-detector or concurrency-detector plugin)")
        return plugin

    # --- flow control: ensureFlowControlLayer, flowcontrol.NewConfigFromAPI ---

    def _flow_control(self) -> FlowControlConfig | None:
        """Under the ``flowControl`` gate: the section's policy references resolved (the
        default policies the config does not declare are added under their type names);
        errors name the key (epp/flowcontrol/config.py). Without the gate: None (the
        section was only decoded)."""
        if FEATURE_FLOW_CONTROL not in self.gates:
            if self.config.flow_control is not None:
                self.warn("flowControl", "ignored: flow control is off without the "
                          "flowControl feature gate (add 'featureGates: [flowControl]'); "
                          "sheddable requests get GIE's legacy admission")
            return None
        return build_flow_control(self.config.flow_control, self.handle, self.src)

    # --- data layer: ensureDataLayer, buildDataLayerConfig, Runtime.Configure ---

    def _data_layer(self) -> DataLayerConfig | None:
        spec = self.config.data_layer
        self._cross_replica_syncer()
        if FEATURE_LEGACY_METRICS in self.gates:
            if spec is not None and spec.sources:
                self.warn("dataLayer", "ignored under the enableLegacyMetrics feature gate "
                          "(metrics are scraped as the --model-server-metrics-* flags say)")
            return None
        if spec is not None and spec.llmd and not spec.sources:
            if spec.inject_defaults is False:  # llm-d: no source at all, nothing scraped
                return DataLayerConfig(())
            spec = None  # llm-d's ensureDataLayer: the default source and extractor
        if spec is None:
            return DataLayerConfig((self._default_metrics_source("plugins"),), injected=True)
        if not spec.sources:
            raise self.err("dataLayer.sources", "the data layer is on but has no data source "
                           "(GIE fails at startup: 'data layer enabled but no data sources "
                           "configured'); add a source (metrics-data-source with "
                           "core-metrics-extractor), or remove the section for the default; to "
                           "scrape nothing use --no-metrics-scraping")
        listed = self._listed_sources(spec)
        if (spec.llmd and spec.inject_defaults is not False
                and not any(s.source.type_name == METRICS_DATA_SOURCE for s in listed)):
            # llm-d-router's ensureDataLayer is additive: the default pair joins the
            # listed sources unless injectDefaults is false or a metrics-data-source is
            # listed (llm-d compares the pluginRef with the type name; here the type, as
            # this EPP runs one metrics-data-source).
            listed.append(self._default_metrics_source("dataLayer.sources"))
        return DataLayerConfig(tuple(listed))

    def _default_metrics_source(self, path: str) -> SourceConfig:
        """The default pair: metrics-data-source → core-metrics-extractor, the declared
        plugins of those names when there are (GIE's and llm-d's ensureDataLayer)."""
        source = self.handle.get(METRICS_DATA_SOURCE) or self._builtin(METRICS_DATA_SOURCE)
        extractor = (self.handle.get(CORE_METRICS_EXTRACTOR)
                     or self._builtin(CORE_METRICS_EXTRACTOR))
        if not isinstance(source, DataSource):
            raise self.err("plugins", f"{METRICS_DATA_SOURCE!r} ({source.type_name}) is not "
                           "a data source; the default data layer reads the plugin of "
                           "that name: rename it, or add a dataLayer section")
        if not isinstance(extractor, DataExtractor):
            raise self.err("plugins", f"{CORE_METRICS_EXTRACTOR!r} ({extractor.type_name}) "
                           "is not a data extractor; the default data layer reads the "
                           "plugin of that name: rename it, or add a dataLayer section")
        self._check_pair(source, extractor, path)
        return SourceConfig(source, (extractor,))

    def _listed_sources(self, spec: DataLayerSpec) -> list[SourceConfig]:
        """``dataLayer.sources``, resolved and checked."""
        sources: list[SourceConfig] = []
        gvks: dict[str, str] = {}
        metrics_sources = 0
        for s in spec.sources:
            plugin = self.handle.get(s.plugin_ref)
            if plugin is None:
                raise self._no_plugin(f"{s.path}.pluginRef", s.plugin_ref)
            if not isinstance(plugin, DataSource):
                raise self.err(f"{s.path}.pluginRef", f"{s.plugin_ref!r} ({plugin.type_name}) "
                               "is not a data source (metrics-data-source, "
                               "endpoint-notification-source, k8s-notification-source, "
                               "dcgm-data-source, models-data-source)")
            extractors: list[DataExtractor] = []
            for j, ref in enumerate(s.extractors):
                epath = f"{s.path}.extractors[{j}].pluginRef"
                ext = self.handle.get(ref)
                if ext is None:
                    raise self._no_plugin(epath, ref)
                if not isinstance(ext, DataExtractor):
                    raise self.err(epath, f"{ref!r} ({ext.type_name}) is not a data extractor "
                                   "(e.g. core-metrics-extractor)")
                self._check_pair(plugin, ext, epath)
                extractors.append(ext)
            gvk = getattr(plugin, "gvk", None)
            if isinstance(gvk, str):
                if gvk in gvks:
                    raise self.err(f"{s.path}.pluginRef", f"duplicate notification source "
                                   f"GVK {gvk}: already used by source {gvks[gvk]!r}")
                gvks[gvk] = plugin.name
            if plugin.type_name == METRICS_DATA_SOURCE:
                metrics_sources += 1
                if metrics_sources > 1:
                    raise self.err(f"{s.path}.pluginRef", "more than one metrics-data-source "
                                   "is not supported: the EPP has one scraper; keep one")
                cores = [e for e in extractors if e.type_name == CORE_METRICS_EXTRACTOR]
                if len(cores) > 1:
                    raise self.err(f"{s.path}.extractors", "more than one "
                                   "core-metrics-extractor on one source is not supported; "
                                   "keep one (engineConfigs covers every engine)")
            sources.append(SourceConfig(plugin, tuple(extractors), f"{self.src}: {s.path}"))
        return sources

    def _cross_replica_syncer(self) -> None:
        """llm-d-router's ``crossReplicaSyncerPluginRef``: its loader requires a
        ``CrossReplicaSyncer`` plugin, and its binary (like this EPP) registers no such
        type, so any reference fails there as here. ``crossReplicaSyncInterval`` is read
        and, with no syncer, unused (as in llm-d)."""
        spec = self.config.data_layer
        if spec is None or spec.syncer is None:
            return
        plugin = self.handle.get(spec.syncer)
        what = ("no plugin of that name is declared" if plugin is None
                else f"it is a {plugin.type_name}")
        raise self.err("dataLayer.crossReplicaSyncerPluginRef",
                       f"the plugin {spec.syncer} is not a fwkdl.CrossReplicaSyncer ({what}; "
                       "llm-d-router v0.10.0 and this EPP register no cross-replica syncer "
                       "type): remove crossReplicaSyncerPluginRef")

    # --- discovery: llm-d-router's runner resolveDiscovery ---

    def _discovery(self) -> EndpointDiscovery | None:
        spec = self.config.data_layer
        if spec is None or spec.discovery is None:
            return None
        path = "dataLayer.discovery.pluginRef"
        plugin = self.handle.get(spec.discovery)
        if plugin is None:
            raise self._no_plugin(path, spec.discovery, " (discovery: the endpoint source, "
                                  "a file-discovery or multicluster-file-discovery plugin)")
        if not isinstance(plugin, EndpointDiscovery):
            raise self.err(path, f"discovery: plugin {spec.discovery!r} ({plugin.type_name}) "
                           "does not implement EndpointDiscovery; name a file-discovery or "
                           "multicluster-file-discovery plugin")
        return plugin

    def _check_pair(self, source: DataSource, extractor: DataExtractor, path: str) -> None:
        if extractor.data_input != source.data_output:
            raise self.err(path, f"extractor {extractor.name!r} ({extractor.type_name}) reads "
                           f"{extractor.data_input}, but source {source.name!r} "
                           f"({source.type_name}) produces {source.data_output}")
        # GIE's validateExtractorCompatible: the extractor implements the interface the
        # source calls.
        needs: tuple[type, str] | None = None
        if isinstance(source, K8sNotificationSource):
            needs = (NotificationExtractor, "gvk and extract_notification(event, obj)")
        elif isinstance(source, EndpointNotificationSource):
            needs = (EndpointExtractor, "extract_endpoint(event, endpoint)")
        elif isinstance(source, PollingSource):
            needs = (PollingExtractor, "extract_poll(payload, endpoint)")
        elif isinstance(extractor, PollingExtractor):
            raise self.err(path, f"extractor {extractor.name!r} ({extractor.type_name}) reads "
                           f"a polling source (dcgm-data-source); source {source.name!r} "
                           f"({source.type_name}) does not feed it: attach it to a "
                           "dcgm-data-source")
        if needs is not None and not isinstance(extractor, needs[0]):
            raise self.err(path, f"extractor {extractor.name!r} ({extractor.type_name}) is "
                           f"not a {source.type_name} extractor: it needs {needs[1]} "
                           "(docs/plugins.md, \"Data layer\")")
        sg, eg = getattr(source, "gvk", None), getattr(extractor, "gvk", None)
        if isinstance(sg, str) and isinstance(eg, str) and sg != eg:
            raise self.err(path, f"extractor {extractor.name!r} GVK {eg} does not match "
                           f"source {source.name!r} GVK {sg}")

    # --- data dependencies: the runner's ValidateAndOrderDataDependencies, after
    # InstantiateAndConfigure (so after every other config error) ---

    def _check_data_dependencies(self, built: BuiltConfig) -> None:
        """What plugins consume must be produced with the same type, by a plugin of an
        earlier layer, without a cycle (epp/datalayer/dependencies.py) — over every
        plugin of the config, the ones the loader injected included, as in GIE."""
        plugins: list[Plugin] = list(self.handle)
        plugins += [p.picker for p in built.scheduler.profiles.values()]
        for p in (built.saturation_detector, built.parser_plugin):
            if p is not None:
                plugins.append(p)
        for entry in built.data_layer.sources if built.data_layer is not None else ():
            plugins += [entry.source, *entry.extractors]
        try:
            check_data_dependencies(plugins)
        except DependencyError as e:
            paths = {spec.name: spec.path for spec in self.config.plugins}
            path = paths.get(e.plugin.name, "plugins") if e.plugin is not None else "plugins"
            raise self.err(path, str(e)) from e

    # --- parser: ensureParser, buildParserConfig ---

    def _parser(self) -> RequestParser | None:
        rh = self.config.request_handler
        if rh is not None and rh.parsers:
            return self._parsers(rh)
        spec = self.config.parser
        name = spec.plugin_ref if spec is not None else OPENAI_PARSER
        plugin = self.handle.get(name)
        if plugin is None:
            if spec is not None:
                raise self._no_plugin(spec.path, name, " (a parser, e.g. openai-parser)")
            if OPENAI_PARSER not in self.registry and OPENAI_PARSER not in _BUILTINS:
                return None
            plugin = self._builtin(OPENAI_PARSER)
        if not isinstance(plugin, RequestParser):
            raise self.err(spec.path if spec is not None else "plugins",
                           f"{name!r} ({plugin.type_name}) is not a parser plugin "
                           "(openai-parser, passthrough-parser, vllmgrpc-parser)")
        return plugin

    def _parsers(self, rh: RequestHandlerSpec) -> RequestParser:
        """llm-d-router's buildParserRegistry: every listed name must be a parser plugin
        declared in ``plugins`` (llm-d's validateParsers). One parser: it reads every request,
        as ``parser:`` does. Several: a ParserRouter picks one by path."""
        plugins: list[Parser] = []
        for spec in rh.parsers:
            plugin = self.handle.get(spec.plugin_ref)
            if plugin is None:  # llm-d's validateParsers: "references undefined plugin"
                raise self._no_plugin(spec.path, spec.plugin_ref,
                                      " (a parser plugin declared there, e.g. "
                                      "'- type: openai-parser')")
            if not isinstance(plugin, Parser):
                raise self.err(spec.path, f"{spec.plugin_ref!r} ({plugin.type_name}) is not a "
                               "parser plugin (openai-parser, anthropic-parser, "
                               "vllmhttp-parser, vllmgrpc-parser, vertexai-parser, "
                               "passthrough-parser)")
            plugins.append(plugin)
        if len(plugins) == 1:
            return plugins[0]
        router = ParserRouter(plugins)
        for w in router.warnings:
            self.warn(f"{rh.path}.parsers", w)
        return router


def load_and_build(path: str | None = None, text: str | None = None,
                   registry: Registry | None = None,
                   timer: PluginTimer = no_timer, *, strict: bool = False,
                   environ: Mapping[str, str] | None = None) -> BuiltConfig:
    """Load from a file, from inline text, or the built-in default; then build.
    ``strict``: unknown plugin parameters are errors (``--strict-config``). ``environ``
    (the server passes ``os.environ``): GIE's deprecated environment feature switch
    (:func:`apply_env_feature_gates`)."""
    if path is not None and text is not None:
        raise ConfigError("give --config-file or --config-text, not both")
    if path is not None:
        cfg = load_config_file(path)
    elif text is not None:
        cfg = parse_config(text, "--config-text")
    else:
        cfg = parse_config(DEFAULT_CONFIG_TEXT, "<default config>")
    if environ is not None:
        cfg = apply_env_feature_gates(cfg, environ)
    return build(cfg, registry, timer, strict=strict)
