"""The plugin framework: what a plugin is, how it is built, how it finds others.

- :mod:`epp.framework.interfaces` — the extension points (filter, scorer, picker, profile
  handler, request-lifecycle hooks) and the build-time hooks (bind, profile check), each
  a small Protocol a plugin implements by having the method.
- :mod:`epp.framework.params` — typed parameters: a frozen dataclass per plugin, decoded
  and validated in one place with the config file's path in every error.
- :mod:`epp.framework.handle` — what a plugin may use while it is built: the other
  plugins, looked up by name or by type.
- :mod:`epp.framework.registry` — config ``type`` name → how to build the plugin.

The framework imports no plugin and no config module; the built-in catalog
(:mod:`epp.scheduling.plugins.catalog`) registers the built-in plugins and only the
config loader imports it. docs/architecture.md ("Plugin framework") is the contract.
"""
