"""``label-selector-filter`` (llm-d; older name ``by-label-selector``).

Its parameters are a Kubernetes ``LabelSelector``, with Kubernetes' semantics:

```yaml
parameters:
  matchLabels: {app: vllm, llm-d.ai/role: decode}      # every pair must match
  matchExpressions:                                    # every expression must hold
  - {key: environment, operator: In, values: [production, staging]}
  - {key: tier, operator: NotIn, values: [test]}       # also true when the label is absent
  - {key: gpu, operator: Exists}
  - {key: deprecated, operator: DoesNotExist}
```

An empty selector keeps every endpoint. Endpoints whose labels do not match are dropped
(none left → the profile fails). Values must be strings (quote numbers: ``"0"``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import config_warning, param
from epp.scheduling.types import CycleState, Endpoint, LLMRequest


class Operator(enum.StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


_OPERATOR_NAMES: frozenset[str] = frozenset(op.value for op in Operator)


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: Operator
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        op = self.operator
        if op is Operator.IN:
            return labels.get(self.key) in self.values
        if op is Operator.NOT_IN:
            v = labels.get(self.key)
            return v is None or v not in self.values
        if op is Operator.EXISTS:
            return self.key in labels
        return self.key not in labels


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """A parsed Kubernetes LabelSelector: matchLabels become ``In`` requirements."""

    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)

    @classmethod
    def parse(cls, match_labels: Any, match_expressions: Any, path: str) -> LabelSelector:
        """Validate and parse; raises ConfigError naming ``path.<key>`` on a bad value."""
        reqs: list[Requirement] = []
        if match_labels is not None:
            if not isinstance(match_labels, Mapping):
                raise ConfigError(f"{path}.matchLabels: expected a mapping of label: value, "
                                  f"got {type(match_labels).__name__}")
            for k, v in match_labels.items():
                _label_key(k, f"{path}.matchLabels")
                if not isinstance(v, str):
                    raise ConfigError(f"{path}.matchLabels.{k}: expected a string value, got "
                                      f"{v!r} (quote it: \"{v}\")")
                reqs.append(Requirement(k, Operator.IN, frozenset({v})))
        if match_expressions is not None:
            if not isinstance(match_expressions, list):
                raise ConfigError(f"{path}.matchExpressions: expected a list, got "
                                  f"{type(match_expressions).__name__}")
            for i, raw in enumerate(match_expressions):
                reqs.append(_requirement(raw, f"{path}.matchExpressions[{i}]"))
        return cls(tuple(reqs))


def _label_key(k: Any, path: str) -> str:
    if not isinstance(k, str) or not k:
        raise ConfigError(f"{path}: label keys must be non-empty strings, got {k!r}")
    return k


def _requirement(raw: Any, path: str) -> Requirement:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping with key, operator, values; "
                          f"got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"key", "operator", "values"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; "
                          "allowed: key, operator, values")
    if "key" not in raw:
        raise ConfigError(f"{path}: missing 'key'")
    key = _label_key(raw["key"], f"{path}.key")
    op_raw = raw.get("operator")
    if not isinstance(op_raw, str) or op_raw not in _OPERATOR_NAMES:
        raise ConfigError(f"{path}.operator: expected one of In, NotIn, Exists, DoesNotExist; "
                          f"got {op_raw!r}")
    op = Operator(op_raw)
    values = raw.get("values")
    if op in (Operator.IN, Operator.NOT_IN):
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}.values: operator {op} needs a non-empty list of values")
        for j, v in enumerate(values):
            if not isinstance(v, str):
                raise ConfigError(f"{path}.values[{j}]: expected a string, got {v!r} "
                                  f"(quote it: \"{v}\")")
        return Requirement(key, op, frozenset(values))
    if values:
        raise ConfigError(f"{path}.values: operator {op} takes no values")
    return Requirement(key, op)


def _match_labels(v: Any, path: str) -> tuple[Requirement, ...]:
    return LabelSelector.parse(v, None, path.rpartition(".")[0]).requirements


def _match_expressions(v: Any, path: str) -> tuple[Requirement, ...]:
    return LabelSelector.parse(None, v, path.rpartition(".")[0]).requirements


@dataclass(frozen=True)
class LabelSelectorParameters:
    match_labels: tuple[Requirement, ...] = param("matchLabels", (), parse=_match_labels)
    match_expressions: tuple[Requirement, ...] = param("matchExpressions", (),
                                                       parse=_match_expressions)


class LabelSelectorFilter:
    """Keeps the endpoints whose labels match the selector (order kept)."""

    type_name = "label-selector-filter"
    Parameters = LabelSelectorParameters

    def __init__(self, name: str, selector: LabelSelector) -> None:
        self.name = name
        self.selector = selector

    @classmethod
    def from_params(cls, name: str, params: LabelSelectorParameters,
                    handle: PluginHandle) -> Self:
        return cls(name, LabelSelector(params.match_labels + params.match_expressions))

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        if not self.selector.requirements:
            return endpoints
        return [e for e in endpoints if self.selector.matches(e.labels)]


class ByLabelSelectorFilter(LabelSelectorFilter):
    """llm-d's deprecated name for :class:`LabelSelectorFilter`, kept so older configs load."""

    type_name = "by-label-selector"


def _strings(v: Any, path: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{path}: expected a list of strings (quote numbers: \"0\")")
    return tuple(v)


@dataclass(frozen=True)
class ByLabelParameters:
    label: str = param("label", "")
    valid_values: tuple[str, ...] = param("validValues", (), parse=_strings)
    allows_no_label: bool = param("allowsNoLabel", False)


class ByLabelFilter:
    """llm-d's deprecated ``by-label`` filter (llm-d-router v0.10.0
    ``filter/bylabel/filter.go``): keeps the endpoints whose label ``label`` has one of
    ``validValues``, and those without the label when ``allowsNoLabel`` is true. Use
    ``label-selector-filter`` or the role filters instead."""

    type_name = "by-label"
    Parameters = ByLabelParameters

    def __init__(self, name: str, label: str, valid_values: Sequence[str] = (),
                 allows_no_label: bool = False) -> None:
        self.name = name
        self.label = label
        self.valid_values = frozenset(valid_values)
        self.allows_no_label = allows_no_label

    @classmethod
    def from_params(cls, name: str, params: ByLabelParameters,
                    handle: PluginHandle) -> Self:
        config_warning(name, "plugin type 'by-label' is deprecated, use "
                       "'label-selector-filter' for generic label filtering or "
                       "'decode-filter'/'prefill-filter'/'encode-filter' for role-based "
                       "filtering")
        if not params.label:
            raise ConfigError(f"invalid configuration for '{cls.type_name}' filter ({name}): "
                              "'label' must be specified")
        if not params.valid_values and not params.allows_no_label:
            raise ConfigError(f"invalid configuration for '{cls.type_name}' filter ({name}): "
                              "either 'validValues' must be non-empty or 'allowsNoLabel' "
                              "must be true")
        return cls(name, params.label, params.valid_values, params.allows_no_label)

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        out = []
        for e in endpoints:
            v = e.labels.get(self.label)
            # as Go: an absent label reads as "" against validValues
            if (v is None and self.allows_no_label) or (v or "") in self.valid_values:
                out.append(e)
        return out
