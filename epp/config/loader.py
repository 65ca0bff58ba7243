"""EndpointPickerConfig loading in two phases (design.md §5, §9 rule 3).

Phase 1, :func:`parse_config`: YAML → validated frozen dataclasses (structure, keys,
references). Phase 2, :func:`build`: create every plugin through the registry (each
validates its own parameters) and assemble the :class:`Scheduler`. Both run at startup;
any problem raises :class:`ConfigError` naming the file, the path in it and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from epp import keys
from epp.errors import ConfigError
from epp.framework.handle import BindsPlugins, PluginHandle
from epp.framework.interfaces import (
    ChecksProfiles,
    EndpointRemoved,
    Filter,
    Picker,
    Plugin,
    PluginTimer,
    PreRequest,
    ProfileHandler,
    RequestHeaders,
    ResponseComplete,
    ResponseHeaders,
    SaturationDetector,
    Scorer,
    no_timer,
)
from epp.framework.registry import Registry
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.scheduler import Scheduler, SchedulerProfile

DEFAULT_CONFIG_TEXT = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters: {blockSizeTokens: 16, maxPrefixBlocksToMatch: 256, lruCapacityPerServer: 31250}
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

_TOP_KEYS = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles",
             "saturationDetector"}
_NOT_YET = {
    "data": "the data-layer section is not supported yet; remove it (metrics are scraped "
            "with the built-in engine mappings)",
    "flowControl": "flow control is not supported yet; remove the section",
}
KNOWN_FEATURE_GATES = {"flowControl", "dataLayer", "prepareDataPlugins"}


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
class EndpointPickerConfig:
    source: str
    plugins: tuple[PluginSpec, ...]
    profiles: tuple[ProfileSpec, ...]
    feature_gates: tuple[str, ...] = ()
    saturation_detector: str | None = None


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
    # The plugin named by ``saturationDetector: {pluginRef: …}``, if any.
    saturation_detector: SaturationDetector | None = None


# The built-in catalog: plugins a config gets without declaring them (the single-profile
# handler, the max-score picker) come from it whatever registry builds the declared ones.
_BUILTINS = default_registry()


def _err(source: str, path: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {path}: {msg}" if path else f"{source}: {msg}")


def _check_keys(source: str, path: str, obj: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise _err(source, path or "(top level)",
                   f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
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


def parse_config(text: str, source: str = "<config>") -> EndpointPickerConfig:
    """Phase 1: parse and validate the structure of an EndpointPickerConfig document."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _err(source, "", f"not valid YAML: {e}") from e
    if doc is None:
        doc = {}
    doc = _mapping(source, "(top level)", doc)
    for key, why in _NOT_YET.items():
        if key in doc:
            raise _err(source, key, why)
    _check_keys(source, "", doc, _TOP_KEYS)

    api = doc.get("apiVersion")
    if api is not None and api not in keys.CONFIG_API_VERSIONS:
        raise _err(source, "apiVersion", f"unsupported {api!r}; use one of "
                   f"{', '.join(keys.CONFIG_API_VERSIONS)}")
    kind = doc.get("kind")
    if kind is not None and kind != keys.CONFIG_KIND:
        raise _err(source, "kind", f"expected {keys.CONFIG_KIND!r}, got {kind!r}")

    gates = tuple(_name(source, f"featureGates[{i}]", g)
                  for i, g in enumerate(_list(source, "featureGates", doc.get("featureGates") or [])))
    for i, g in enumerate(gates):
        if g not in KNOWN_FEATURE_GATES:
            raise _err(source, f"featureGates[{i}]", f"unknown feature gate {g!r}; known: "
                       f"{', '.join(sorted(KNOWN_FEATURE_GATES))}")

    plugins: list[PluginSpec] = []
    seen: set[str] = set()
    for i, raw in enumerate(_list(source, "plugins", doc.get("plugins") or [])):
        path = f"plugins[{i}]"
        raw = _mapping(source, path, raw)
        _check_keys(source, path, raw, {"name", "type", "parameters"})
        if "type" not in raw:
            raise _err(source, path, "missing 'type' (the plugin type, e.g. queue-scorer)")
        ptype = _name(source, f"{path}.type", raw["type"])
        name = _name(source, f"{path}.name", raw.get("name", ptype))
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
            if ref not in seen:
                raise _err(source, f"{rpath}.pluginRef", f"no plugin named {ref!r} in 'plugins'; "
                           f"declared: {', '.join(sorted(seen)) or 'none'}")
            w = r.get("weight")
            if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0):
                raise _err(source, f"{rpath}.weight", f"expected a number >= 0, got {w!r}")
            refs.append(PluginRef(ref, None if w is None else float(w), rpath))
        profiles.append(ProfileSpec(pname, tuple(refs), path))

    sat = doc.get("saturationDetector")
    sat_ref: str | None = None
    if sat is not None:
        sat = _mapping(source, "saturationDetector", sat)
        _check_keys(source, "saturationDetector", sat, {"pluginRef"})
        sat_ref = _name(source, "saturationDetector.pluginRef", sat.get("pluginRef"))
        if sat_ref not in seen:
            raise _err(source, "saturationDetector.pluginRef", f"no plugin named {sat_ref!r}")

    return EndpointPickerConfig(source, tuple(plugins), tuple(profiles), gates, sat_ref)


def load_config_file(path: str | Path) -> EndpointPickerConfig:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror or e}") from e
    return parse_config(text, str(p))


def build(
    config: EndpointPickerConfig,
    registry: Registry | None = None,
    timer: PluginTimer = no_timer,
) -> BuiltConfig:
    """Phase 2: create the plugins, inject defaults, assemble the scheduler."""
    registry = registry or default_registry()
    src = config.source
    if not config.plugins and not config.profiles:
        # Nothing to schedule with: an empty document means the built-in default.
        default = parse_config(DEFAULT_CONFIG_TEXT, src)
        config = EndpointPickerConfig(src, default.plugins, default.profiles,
                                      config.feature_gates, config.saturation_detector)
    handle = PluginHandle()
    for spec in config.plugins:
        builder = registry.builder(spec.type, f"{src}: {spec.path}.type")
        try:
            plugin = builder(spec.name, spec.parameters, f"{spec.path}.parameters", handle)
        except ConfigError as e:
            raise ConfigError(f"{src}: {e}") from e
        except Exception as e:  # a user plugin's own bug: still name file and path
            raise _err(src, spec.path, f"building {spec.type!r} failed: "
                       f"{type(e).__name__}: {e}") from e
        if not isinstance(plugin, Plugin):
            raise _err(src, spec.path, f"{spec.type} did not build a plugin (needs name and "
                       "type_name attributes)")
        handle.plugins[spec.name] = plugin

    # Second pass: plugins that depend on others (e.g. a scorer on its data producer) bind
    # now that all are built; a bind may add the helper plugin it needs.
    for spec in config.plugins:
        plugin = handle.plugins[spec.name]
        if isinstance(plugin, BindsPlugins):
            try:
                plugin.bind(handle)
            except ConfigError as e:
                raise _err(src, spec.path, str(e)) from e

    handlers = handle.of_type(ProfileHandler)
    if len(handlers) > 1:
        raise _err(src, "plugins", "more than one profile handler declared: "
                   f"{', '.join(h.name for h in handlers)}; keep one")

    profile_specs = list(config.profiles)
    if not profile_specs:
        # No profiles: one 'default' profile with every filter, scorer and picker declared.
        refs = tuple(PluginRef(p.name, None, "plugins") for p in handle
                     if isinstance(p, (Filter, Scorer, Picker))
                     and not isinstance(p, ProfileHandler))
        profile_specs = [ProfileSpec("default", refs, "schedulingProfiles")]

    if handlers:
        handler = handlers[0]
    else:
        if len(profile_specs) > 1:
            raise _err(src, "plugins", f"{len(profile_specs)} scheduling profiles need a profile handler "
                       "plugin (e.g. disagg-profile-handler); single-profile-handler runs one")
        default_handler = _BUILTINS.create("single-profile-handler", "single-profile-handler",
                                          handle)
        assert isinstance(default_handler, ProfileHandler)
        handler = default_handler
        handle.plugins.setdefault(handler.name, handler)

    default_picker: Picker | None = None
    profiles: dict[str, SchedulerProfile] = {}
    for pspec in profile_specs:
        filters: list[Filter] = []
        scorers: list[tuple[Scorer, float]] = []
        picker: Picker | None = None
        for ref in pspec.plugins:
            plugin = handle.plugins[ref.plugin_ref]
            if isinstance(plugin, ProfileHandler):
                raise _err(src, ref.path, f"{ref.plugin_ref!r} is a profile handler; it runs "
                           "the profiles and cannot be used inside one")
            role_found = False
            if isinstance(plugin, Filter):
                filters.append(plugin)
                role_found = True
            if isinstance(plugin, Scorer):
                scorers.append((plugin, 1.0 if ref.weight is None else ref.weight))
                role_found = True
            elif ref.weight is not None:
                raise _err(src, f"{ref.path}.weight", f"{ref.plugin_ref!r} is not a scorer; only "
                           "scorers take a weight")
            if isinstance(plugin, Picker):
                if picker is not None:
                    raise _err(src, ref.path, f"profile {pspec.name!r} has two pickers "
                               f"({picker.name!r}, {plugin.name!r}); keep one")
                picker = plugin
                role_found = True
            if not role_found:
                raise _err(src, ref.path, f"{ref.plugin_ref!r} ({plugin.type_name}) is not a "
                           "filter, scorer or picker and cannot be used in a profile")
        if picker is None:
            if default_picker is None:
                built_picker = _BUILTINS.create("max-score-picker", "max-score-picker", handle)
                assert isinstance(built_picker, Picker)
                default_picker = built_picker
            picker = default_picker
        profiles[pspec.name] = SchedulerProfile(pspec.name, filters, scorers, picker, timer)

    if isinstance(handler, ChecksProfiles):
        try:
            handler.check_profiles(set(profiles))
        except ConfigError as e:
            raise _err(src, "schedulingProfiles", str(e)) from e
    built = BuiltConfig(
        config=config,
        plugins=handle.plugins,
        scheduler=Scheduler(handler, profiles, timer),
        pre_request=handle.of_type(PreRequest),
        response_complete=handle.of_type(ResponseComplete),
        endpoint_removed=handle.of_type(EndpointRemoved),
        request_headers=handle.of_type(RequestHeaders),
        response_headers=handle.of_type(ResponseHeaders),
    )
    if config.saturation_detector is not None:
        detector = handle.plugins[config.saturation_detector]
        if not isinstance(detector, SaturationDetector):
            raise _err(src, "saturationDetector", f"{config.saturation_detector!r} is not a "
                       "saturation detector (use a utilization-detector plugin)")
        built.saturation_detector = detector
    return built


def load_and_build(path: str | None = None, text: str | None = None,
                   registry: Registry | None = None,
                   timer: PluginTimer = no_timer) -> BuiltConfig:
    """Load from a file, from inline text, or the built-in default; then build."""
    if path is not None and text is not None:
        raise ConfigError("give --config-file or --config-text, not both")
    if path is not None:
        cfg = load_config_file(path)
    elif text is not None:
        cfg = parse_config(text, "--config-text")
    else:
        cfg = parse_config(DEFAULT_CONFIG_TEXT, "<default config>")
    return build(cfg, registry, timer)
