"""What a plugin may use while it is built: the other plugins, by name or by type."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol, TypeVar, runtime_checkable

from epp.errors import ConfigError
from epp.framework.interfaces import Plugin

T = TypeVar("T")


class PluginHandle:
    """The plugins of one config, in declaration order.

    During the first build pass a factory sees the plugins declared before it; in the
    second pass (:class:`BindsPlugins`) every plugin is there.
    """

    def __init__(self, plugins: Mapping[str, Plugin] | None = None) -> None:
        self._plugins: dict[str, Plugin] = dict(plugins or {})

    @property
    def plugins(self) -> dict[str, Plugin]:
        """Every plugin by name (read it; add with :meth:`add`)."""
        return self._plugins

    def __iter__(self) -> Iterator[Plugin]:
        return iter(self._plugins.values())

    def __len__(self) -> int:
        return len(self._plugins)

    def get(self, name: str) -> Plugin | None:
        """The plugin named ``name``, or None."""
        return self._plugins.get(name)

    def named(self, name: str, kind: type[T]) -> T | None:
        """The plugin named ``name`` if it is a ``kind``; None when there is none.
        Raises ConfigError when the plugin exists but is of another type."""
        plugin = self._plugins.get(name)
        if plugin is None:
            return None
        if not isinstance(plugin, kind):
            raise ConfigError(f"plugin {name!r} ({plugin.type_name}) is not a "
                              f"{getattr(kind, 'type_name', kind.__name__)}")
        return plugin

    def of_type(self, kind: type[T]) -> list[T]:
        """Every plugin that is a ``kind`` (a class or a runtime-checkable Protocol)."""
        return [p for p in self._plugins.values() if isinstance(p, kind)]

    def add(self, plugin: Plugin) -> None:
        """Add a plugin built by another one (e.g. the producer a scorer creates when the
        config declares none). Names are unique."""
        if plugin.name in self._plugins:
            raise ConfigError(f"a plugin named {plugin.name!r} already exists")
        self._plugins[plugin.name] = plugin


@runtime_checkable
class BindsPlugins(Plugin, Protocol):
    """A plugin that uses other plugins (a scorer and its data producer)."""

    def bind(self, handle: PluginHandle) -> None:
        """Called once every plugin of the config is built, in declaration order: look up
        the plugins this one uses (:meth:`PluginHandle.named`, :meth:`PluginHandle.of_type`)
        and :meth:`PluginHandle.add` any helper it creates. Raise ``ConfigError``."""
        ...
