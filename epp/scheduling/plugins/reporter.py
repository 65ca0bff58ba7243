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

Sending it (GIE's pkg/epp/handlers/server.go, response.go): :func:`response_metadata` is
the ext_proc handler's hook (epp/server/wiring.py). When a response ends, the configured
reporters see its usage — GIE's ``requestcontrol.Usage`` as JSON, :func:`usage_object` —
and their metadata, merged, goes to Envoy as ``ProcessingResponse.dynamic_metadata`` on
the answer to the response's last message: the end-of-stream body chunk (GIE: its last
body answer, for JSON and SSE alike), or the trailers of a gRPC response (GIE: the body
answer it sends just before the trailers answer). Envoy accepts only the namespaces its
ext_proc filter lists in ``metadata_options.receiving_namespaces`` (``epp envoy-config``:
``envoy.lb``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import ResponseUsageMetadata
from epp.framework.params import ParameterError, param, report_unknown
from epp.handlers.protocol import ResponseMetadata
from epp.parsing.usage import Usage
from epp.scheduling.plugins.cel import CelError, Program, compile_expression, struct_value
from epp.scheduling.types import LLMRequest

if TYPE_CHECKING:
    from epp.requestcontrol.director import RequestContext

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


def usage_object(usage: Usage | None) -> dict[str, Any]:
    """The ``usage`` the expressions see: GIE's ``requestcontrol.Usage`` marshalled to
    JSON — ``prompt_tokens``, ``completion_tokens`` and ``total_tokens`` always (0 when the
    response reported none, so ``has(usage.completion_tokens)`` is true even then, as in
    GIE), ``prompt_token_details.cached_tokens`` when reported. ``total_tokens`` is
    prompt + completion (GIE copies the body's ``total_tokens``; model servers report
    that sum)."""
    prompt = usage.prompt_tokens if usage is not None and usage.prompt_tokens else 0
    completion = usage.completion_tokens if usage is not None and usage.completion_tokens \
        else 0
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if usage is not None and usage.cached_tokens is not None:
        out["prompt_token_details"] = {"cached_tokens": usage.cached_tokens}
    return out


def response_metadata(plugins: Sequence[ResponseUsageMetadata]) -> ResponseMetadata | None:
    """The ext_proc handler's ``response_metadata`` hook for ``plugins`` (the config's
    ResponseUsageMetadata plugins; None when there are none: nothing to ask per response).

    The hook takes the Director's request context (``Routing.context``) after
    ``on_done``: every plugin sees the response's usage (:func:`usage_object`, zeros when
    there was none, as GIE runs its ResponseBody plugins on every response); their
    ``{namespace: {name: value}}`` are merged, a later plugin's key over an earlier's. A
    failing plugin is logged and skipped."""
    reporters = tuple(plugins)
    if not reporters:
        return None

    def metadata(context: Any) -> dict[str, dict[str, Any]] | None:
        ctx: RequestContext = context
        parser = ctx.usage
        usage = usage_object(parser.finish() if parser is not None else None)
        out: dict[str, dict[str, Any]] = {}
        for plugin in reporters:
            try:
                found = plugin.usage_metadata(ctx.request, usage)
            except Exception:
                log.exception("%s: computing response metadata failed", plugin.name)
                continue
            for namespace, fields in (found or {}).items():
                out.setdefault(namespace, {}).update(fields)
        return out or None

    return metadata
