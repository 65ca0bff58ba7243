"""``request-attribute-reporter`` (GIE): compute a number from the response's ``usage``
object with a CEL expression and report it to the gateway as Envoy dynamic metadata.

Parameters (GIE's)::

    attributes:                         # exactly one entry
    - key:
        namespace: envoy.lb             # optional, default envoy.lb
        name: x-gateway-inference-request-cost
      expression: usage.completion_tokens          # CEL; must give a number
      condition: has(usage.completion_tokens)      # optional CEL; must give true

The expressions see ``usage`` as a ``google.protobuf.Struct`` (every number a double) and
are compiled at startup (epp/scheduling/plugins/cel.py has the supported subset). Per
response: if the condition is set and not true, nothing is reported; otherwise the
expression's value, truncated to an integer, goes to ``{namespace: {name: value}}``; 0, a
non-number and an evaluation error report nothing (GIE logs the error). The plugin needs
response bodies (the ``inline`` gateway shape): it declares so, and the EPP warns when a
stream gives it none.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, param, report_unknown
from epp.scheduling.plugins.cel import CelError, Program, compile_expression, struct_value
from epp.scheduling.types import LLMRequest

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "envoy.lb"
_VARIABLES = ("usage",)


@dataclass(frozen=True)
class Attribute:
    namespace: str
    name: str
    expression: Program
    condition: Program | None


def _compile(text: Any, path: str) -> Program:
    if not isinstance(text, str):
        raise ConfigError(f"{path}: expected a CEL expression (a string), got {text!r}")
    try:
        return compile_expression(text, _VARIABLES)
    except CelError as e:
        raise ConfigError(f"{path}: failed to compile: {e}") from None


def _attributes(value: Any, path: str) -> tuple[Attribute, ...]:
    if not isinstance(value, list) or len(value) != 1:
        raise ConfigError(f"{path}: attributes must contain exactly one entry")
    entry = value[0]
    where = f"{path}[0]"
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(entry).__name__}")
    report_unknown(where, set(entry) - {"key", "expression", "condition"},
                   ("key", "expression", "condition"))
    key = entry.get("key") or {}
    if not isinstance(key, Mapping):
        raise ConfigError(f"{where}.key: expected a mapping, got {type(key).__name__}")
    report_unknown(f"{where}.key", set(key) - {"namespace", "name"}, ("namespace", "name"))
    name = key.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.key.name: attributeKey.name cannot be empty")
    namespace = key.get("namespace") or DEFAULT_NAMESPACE
    if not isinstance(namespace, str):
        raise ConfigError(f"{where}.key.namespace: expected a string, got {namespace!r}")
    expression = entry.get("expression")
    if not expression:
        raise ConfigError(f"{where}.expression: attributes[0].expression cannot be empty")
    condition = entry.get("condition")
    return (Attribute(namespace, name, _compile(expression, f"{where}.expression"),
                      _compile(condition, f"{where}.condition") if condition else None),)


@dataclass(frozen=True)
class RequestAttributeReporterParameters:
    attributes: tuple[Attribute, ...] = param("attributes", (), parse=_attributes)


class RequestAttributeReporter:
    type_name = "request-attribute-reporter"
    Parameters = RequestAttributeReporterParameters
    response_needs = frozenset({"body"})

    def __init__(self, name: str, attribute: Attribute) -> None:
        self.name = name
        self.attribute = attribute

    @classmethod
    def from_params(cls, name: str, params: RequestAttributeReporterParameters,
                    handle: PluginHandle) -> RequestAttributeReporter:
        if not params.attributes:  # GIE's factory fails without parameters too
            raise ParameterError("attributes", "attributes must contain exactly one entry")
        return cls(name, params.attributes[0])

    def value(self, usage: Mapping[str, Any]) -> int | None:
        """The number to report for ``usage`` (None: nothing to report)."""
        attr = self.attribute
        env = {"usage": struct_value(usage)}
        try:
            if attr.condition is not None and attr.condition.eval(env) is not True:
                return None
            v = attr.expression.eval(env)
        except CelError as e:
            log.warning("%s: evaluating %r failed: %s", self.name, attr.expression.text, e)
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            log.warning("%s: expression %r gave %r, not a number", self.name,
                        attr.expression.text, v)
            return None
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return int(v) or None

    def usage_metadata(self, request: LLMRequest,
                       usage: Mapping[str, Any]) -> Mapping[str, Mapping[str, float]] | None:
        v = self.value(usage)
        if v is None:
            return None
        return {self.attribute.namespace: {self.attribute.name: float(v)}}
