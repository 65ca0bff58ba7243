"""Plugin registry: config ``type`` name → factory(name, Params, handle) → plugin.

Built-in plugins register explicitly in :func:`default_registry`. A user's own plugin is
referenced by import path as its ``type`` (``mypkg.module:ClassName``); its class must
offer ``from_params(name, params, handle)``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from epp.config.params import Params
from epp.errors import ConfigError
from epp.scheduling.interfaces import Plugin


@dataclass
class PluginHandle:
    """What a plugin factory may use while it is built: the other plugins, by name."""

    plugins: dict[str, Plugin] = field(default_factory=dict)

    def get(self, name: str) -> Plugin | None:
        return self.plugins.get(name)


class PluginFactory(Protocol):
    def __call__(self, name: str, params: Params, handle: PluginHandle) -> Plugin: ...


class Registry:
    def __init__(self) -> None:
        self._factories: dict[str, PluginFactory] = {}

    def register(self, type_name: str, factory: PluginFactory) -> None:
        if type_name in self._factories:
            raise ValueError(f"plugin type {type_name!r} registered twice")
        self._factories[type_name] = factory

    def register_class(self, cls: Any) -> None:
        """Register a plugin class with a ``type_name`` and a ``from_params`` classmethod."""
        self.register(cls.type_name, cls.from_params)

    @property
    def types(self) -> list[str]:
        return sorted(self._factories)

    def factory(self, type_name: str, path: str) -> PluginFactory:
        f = self._factories.get(type_name)
        if f is not None:
            return f
        if ":" in type_name:
            return _import_factory(type_name, path)
        raise ConfigError(
            f"{path}: unknown plugin type {type_name!r}; known types: {', '.join(self.types)} "
            "(or a Python plugin as 'package.module:ClassName')"
        )


def _import_factory(ref: str, path: str) -> PluginFactory:
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{path}: cannot import plugin module {module_name!r}: {e}") from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigError(f"{path}: module {module_name!r} has no attribute {attr!r}")
    from_params: Callable[..., Plugin] | None = getattr(obj, "from_params", None)
    if from_params is None:
        raise ConfigError(
            f"{path}: {ref} has no from_params(name, params, handle) classmethod; "
            "see docs/plugins.md"
        )
    return from_params


def default_registry() -> Registry:
    """The built-in plugins, registered explicitly in one place."""
    from epp.scheduling.plugins import handlers, pd, pickers, prefix, roles, scorers, topology
    from epp.scheduling.plugins import filters, load, lora, nohit, saturation, session

    reg = Registry()
    for cls in (
        handlers.SingleProfileHandler,
        pickers.MaxScorePicker,
        pickers.RandomPicker,
        scorers.QueueScorer,
        scorers.KVCacheUtilizationScorer,
        scorers.RunningRequestsSizeScorer,
        prefix.PrefixCacheScorer,
        prefix.ApproxPrefixCacheProducer,
        pd.DisaggProfileHandler,
        pd.PdProfileHandler,
        pd.PrefixBasedPDDecider,
        pd.AlwaysDisaggPDDecider,
        pd.PrefillHeaderHandler,
        pd.DisaggHeadersHandler,
        roles.DecodeFilter,
        roles.PrefillFilter,
        roles.LeaderFilter,
        topology.TopologyAffinityScorer,
        pickers.WeightedRandomPicker,
        lora.LoraAffinityScorer,
        load.LoadAwareScorer,
        load.ActiveRequestScorer,
        load.TokenLoadScorer,
        load.InFlightLoadProducer,
        session.SessionAffinityScorer,
        nohit.NoHitLRUScorer,
        filters.LabelSelectorFilter,
        filters.ByLabelSelectorFilter,
        saturation.UtilizationDetector,
    ):
        reg.register_class(cls)
    return reg
