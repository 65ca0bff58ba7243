"""Plugin registry: config ``type`` name → how to build the plugin.

A plugin class is registered by its ``type_name``; building one decodes the config's
``parameters`` into the class's ``Parameters`` dataclass (epp/framework/params.py) and
calls ``from_params(name, parameters, handle)`` (which may raise ``ParameterError`` for a
parameter that must be given; the error then names its path). The built-in plugins register in one
place, :mod:`epp.scheduling.plugins.catalog`. A user's own plugin is referenced by import
path as its ``type`` (``mypkg.module:ClassName``, docs/plugins.md); a class without a
``Parameters`` dataclass gets the older :class:`~epp.framework.params.Params` reader.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final, Literal, Protocol, runtime_checkable

from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import Plugin
from epp.framework.params import ParameterError, Params, decode_params, suggest

# (name, raw ``parameters`` mapping, its path in the file, handle) → plugin
Builder = Callable[[str, Mapping[str, Any] | None, str, PluginHandle], Plugin]


@runtime_checkable
class PluginClass(Protocol):
    """A plugin class with typed parameters (every built-in plugin)."""

    type_name: ClassVar[str]
    Parameters: ClassVar[type[Any]]

    @classmethod
    def from_params(cls, name: str, params: Any, handle: PluginHandle) -> Plugin: ...


@runtime_checkable
class LegacyPluginClass(Protocol):
    """A plugin class that reads its parameters with :class:`Params`."""

    @classmethod
    def from_params(cls, name: str, params: Params, handle: PluginHandle) -> Plugin: ...


def builder_for(cls: Any, ref: str) -> Builder:
    """How to build instances of the plugin class ``cls`` (``ref`` names it in errors)."""
    if isinstance(cls, PluginClass):
        typed = cls

        def build(name: str, raw: Mapping[str, Any] | None, path: str,
                  handle: PluginHandle) -> Plugin:
            params = decode_params(typed.Parameters, raw, path)
            try:
                return typed.from_params(name, params, handle)
            except ParameterError as e:  # e.g. a required parameter left out
                raise ConfigError(f"{path}.{e.key}: {e.message}") from None
        return build
    if isinstance(cls, LegacyPluginClass):
        legacy = cls

        def build_legacy(name: str, raw: Mapping[str, Any] | None, path: str,
                         handle: PluginHandle) -> Plugin:
            return legacy.from_params(name, Params(raw, path), handle)
        return build_legacy
    raise ConfigError(f"{ref} has no from_params(name, params, handle) classmethod; "
                      "see docs/plugins.md")


#: llm-d-router v0.10.0's Alpha plugin types: registered with ``fwkplugin.StabilityAlpha``
#: in cmd/epp/runner/runner.go ``registerInTreePlugins``. llm-d refuses to start with one
#: of them configured unless ``--allow-experimental-plugins`` is set; ``epp serve`` does the
#: same (:func:`check_plugin_stability`). Every other type — llm-d's Beta ones, GIE's, this
#: EPP's own, and Python plugins given by import path — is not gated (llm-d's
#: GetPluginStability calls a type it has not registered Stable).
LLMD_ALPHA_TYPES: Final = frozenset({
    "agent-identity",
    "burst-prefix-cache-producer",
    "dcgm-data-source",
    "dcgm-extractor",
    "disaggregatedset-rollout-screener",
    "endpoint-attribute-filter",
    "endpoint-attribute-scorer",
    "header-label-affinity-scorer",
    "header-profile-handler",
    "multicluster-approx-prefix-cache-producer",
    "multicluster-file-discovery",
    "multicluster-kv-cache-utilization-scorer",
    "multicluster-metrics-data-source",
    "multicluster-metrics-extractor",
    "multicluster-prefix-cache-scorer",
    "multicluster-queue-scorer",
    "multicluster-session-affinity-filter",
    "p2p-source-producer",
    "priority-holdback-policy",
    "priority-then-time-eviction-order-policy",
    "session-affinity-filter",
    "session-affinity-scorer",
    "sheddable-eviction-filter",
    "soft-reflective-ceiling-policy",
    "topology-affinity-filter",
    "topology-affinity-scorer",
    "topology-extractor",
    "utilization-filter",
})

Stability = Literal["alpha", "stable"]


class Registry:
    def __init__(self) -> None:
        self._builders: dict[str, Builder] = {}
        self._alpha: set[str] = set()

    def register(self, type_name: str, builder: Builder,
                 stability: Stability | None = None) -> None:
        """``stability`` None: alpha when llm-d marks the type so (:data:`LLMD_ALPHA_TYPES`),
        else stable."""
        if type_name in self._builders:
            raise ValueError(f"plugin type {type_name!r} registered twice")
        self._builders[type_name] = builder
        if stability is None:
            stability = "alpha" if type_name in LLMD_ALPHA_TYPES else "stable"
        if stability == "alpha":
            self._alpha.add(type_name)

    def stability(self, type_name: str) -> Stability:
        """A type's stability level (an unregistered or import-path type: stable)."""
        return "alpha" if type_name in self._alpha else "stable"

    def register_class(self, cls: type[Any]) -> None:
        """Register a plugin class (``type_name``, ``Parameters``, ``from_params``)."""
        type_name: str = cls.type_name
        self.register(type_name, builder_for(cls, type_name))

    @property
    def types(self) -> list[str]:
        return sorted(self._builders)

    def __contains__(self, type_name: object) -> bool:
        return type_name in self._builders

    def builder(self, type_name: str, path: str) -> Builder:
        """The builder for a config ``type`` (``path`` locates it in errors): a registered
        name, or a Python plugin as ``package.module:ClassName``."""
        b = self._builders.get(type_name)
        if b is not None:
            return b
        if ":" in type_name:
            return _import_builder(type_name, path)
        raise ConfigError(
            f"{path}: unknown plugin type {type_name!r}{suggest(type_name, self.types)}; "
            f"known types: {', '.join(self.types)} "
            "(or a Python plugin as 'package.module:ClassName')"
        )

    def create(self, type_name: str, name: str, handle: PluginHandle) -> Plugin:
        """Build a registered plugin with default parameters (e.g. the single-profile
        handler a config without one gets)."""
        return self.builder(type_name, type_name)(name, None, f"{name}.parameters", handle)


def _import_builder(ref: str, path: str) -> Builder:
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{path}: cannot import plugin module {module_name!r}: {e}") from e
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{path}: module {module_name!r} has no attribute {attr!r}") from None
    try:
        return builder_for(obj, ref)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def check_plugin_stability(plugins: Mapping[str, Plugin], registry: Registry,
                           allow_experimental: bool) -> None:
    """llm-d's ValidatePluginStability: with ``allow_experimental`` off, the first plugin
    (by name) of an Alpha type fails startup with llm-d's message."""
    if allow_experimental:
        return
    for name in sorted(plugins):
        type_name = getattr(plugins[name], "type_name", "")
        if registry.stability(type_name) == "alpha":
            raise ConfigError(f"plugin '{name}' (type: '{type_name}') has Alpha stability "
                              "level, but command line flag --allow-experimental-plugins "
                              "is not set")
