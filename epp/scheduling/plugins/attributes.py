"""``endpoint-attribute-filter`` and ``endpoint-attribute-scorer`` (llm-d-router v0.10.0,
pkg/epp/framework/plugins/scheduling/{filter,scorer}/endpointattribute).

Both read one named numeric endpoint attribute: ``endpoint.metrics.attributes[key]``
(llm-d's ``ScalarMetricValue`` endpoint attributes, e.g. ``GPUUtilization/dcgm-extractor``
or a custom engine metric). An endpoint without it is "missing".

- The filter keeps endpoints whose value satisfies ``algorithm.threshold`` (``operator``
  one of LessThan, LessThanOrEqual, GreaterThan, GreaterThanOrEqual, Equal, NotEqual,
  against ``value``); ``onMissing`` ``Pass`` (default) keeps endpoints missing the
  attribute, ``Fail`` drops them; with ``fallbackOnEmpty: true`` an empty result gives
  back every candidate.
- The scorer maps the value linearly to [0, 1] (``algorithm.type``
  ``linear_lower_is_better`` or ``linear_higher_is_better``) over a range that is either
  ``algorithm.normalization.fixedRange`` ``{min, max}`` (values clamped) or, by default
  (``adaptiveRange``), the min..max of the candidates that have the attribute (all equal:
  every one scores 1). An endpoint missing the attribute scores 0.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, param, report_unknown
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

ON_MISSING_PASS = "Pass"
ON_MISSING_FAIL = "Fail"
ALGORITHM_THRESHOLD = "threshold"
OPERATORS: Mapping[str, Callable[[float, float], bool]] = {
    "LessThan": operator.lt,
    "LessThanOrEqual": operator.le,
    "GreaterThan": operator.gt,
    "GreaterThanOrEqual": operator.ge,
    "Equal": operator.eq,
    "NotEqual": operator.ne,
}
LOWER_IS_BETTER = "linear_lower_is_better"
HIGHER_IS_BETTER = "linear_higher_is_better"


def read_attribute(endpoint: Endpoint, key: str) -> float | None:
    """The endpoint's scalar attribute ``key``; None when it has none."""
    v = endpoint.metrics.attributes.get(key)
    return None if v is None else float(v)


def _mapping(v: Any, path: str, accepted: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{path}: expected a mapping with keys {', '.join(accepted)}, "
                          f"got {v!r}")
    report_unknown(path, set(v) - set(accepted), accepted)
    return v


def _number(raw: Mapping[str, Any], key: str, path: str) -> float:
    v = raw.get(key)
    if v is None:
        return 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{path}.{key}: expected a number, got {v!r}")
    return float(v)


def _string(raw: Mapping[str, Any], key: str, path: str) -> str:
    v = raw.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ConfigError(f"{path}.{key}: expected a string, got {v!r}")
    return v


# ---------------------------------------------------------------------------- filter


@dataclass(frozen=True)
class Threshold:
    operator: str
    value: float


@dataclass(frozen=True)
class FilterAlgorithm:
    type: str = ""
    threshold: Threshold | None = None


def _filter_algorithm(v: Any, path: str) -> FilterAlgorithm:
    raw = _mapping(v, path, ("threshold", "type"))
    t = raw.get("threshold")
    threshold = None
    if t is not None:
        traw = _mapping(t, f"{path}.threshold", ("operator", "value"))
        threshold = Threshold(_string(traw, "operator", f"{path}.threshold"),
                              _number(traw, "value", f"{path}.threshold"))
    return FilterAlgorithm(_string(raw, "type", path), threshold)


@dataclass(frozen=True)
class EndpointAttributeFilterParameters:
    attribute: str = param("attribute", "")
    on_missing: str = param("onMissing", "")
    fallback_on_empty: bool = param("fallbackOnEmpty", False)
    algorithm: FilterAlgorithm = param(  # noqa: RUF009 -- param() is the framework's field(); frozen default
        "algorithm", FilterAlgorithm(), parse=_filter_algorithm)

    def __post_init__(self) -> None:
        if self.on_missing not in ("", ON_MISSING_PASS, ON_MISSING_FAIL):
            raise ParameterError("onMissing", f"must be {ON_MISSING_PASS!r} or "
                                 f"{ON_MISSING_FAIL!r}, got {self.on_missing!r}")
        if self.algorithm.threshold is not None and \
                self.algorithm.threshold.operator not in OPERATORS:
            raise ParameterError("algorithm.threshold.operator", "must be one of "
                                 f"{', '.join(OPERATORS)}, got "
                                 f"{self.algorithm.threshold.operator!r}")

    def check_required(self) -> None:
        """The parameters llm-d requires (checked when the plugin is built, so an empty
        block still decodes, as the framework expects of every built-in)."""
        if not self.attribute:
            raise ParameterError("attribute", "required: the endpoint attribute to read "
                                 "(e.g. GPUUtilization/dcgm-extractor)")
        if self.algorithm.type != ALGORITHM_THRESHOLD:
            raise ParameterError("algorithm.type", f"must be {ALGORITHM_THRESHOLD!r}, got "
                                 f"{self.algorithm.type!r}")
        if self.algorithm.threshold is None:
            raise ParameterError("algorithm.threshold", "required when algorithm.type is "
                                 f"{ALGORITHM_THRESHOLD!r} ({{operator: ..., value: ...}})")


class EndpointAttributeFilter:
    """Keeps the endpoints whose attribute passes the threshold."""

    type_name = "endpoint-attribute-filter"
    Parameters = EndpointAttributeFilterParameters

    def __init__(self, name: str, attribute: str, op: str, value: float, *,
                 pass_on_missing: bool = True, fallback_on_empty: bool = False) -> None:
        self.name = name
        self.attribute = attribute
        self.operator = op
        self.value = value
        self._matches = OPERATORS[op]
        self.pass_on_missing = pass_on_missing
        self.fallback_on_empty = fallback_on_empty

    @classmethod
    def from_params(cls, name: str, params: EndpointAttributeFilterParameters,
                    handle: PluginHandle) -> EndpointAttributeFilter:
        params.check_required()
        t = params.algorithm.threshold
        assert t is not None  # checked just above
        return cls(name, params.attribute, t.operator, t.value,
                   pass_on_missing=params.on_missing != ON_MISSING_FAIL,
                   fallback_on_empty=params.fallback_on_empty)

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        kept = []
        for e in endpoints:
            v = read_attribute(e, self.attribute)
            if v is None:
                if self.pass_on_missing:
                    kept.append(e)
            elif self._matches(v, self.value):
                kept.append(e)
        if not kept and self.fallback_on_empty:
            return endpoints
        return kept


# ---------------------------------------------------------------------------- scorer


@dataclass(frozen=True)
class ScorerAlgorithm:
    type: str = ""
    fixed_range: tuple[float, float] | None = None
    adaptive_range: bool = False


def _scorer_algorithm(v: Any, path: str) -> ScorerAlgorithm:
    raw = _mapping(v, path, ("normalization", "type"))
    fixed: tuple[float, float] | None = None
    adaptive = False
    n = raw.get("normalization")
    if n is not None:
        npath = f"{path}.normalization"
        nraw = _mapping(n, npath, ("adaptiveRange", "fixedRange"))
        if nraw.get("fixedRange") is not None:
            fraw = _mapping(nraw["fixedRange"], f"{npath}.fixedRange", ("max", "min"))
            fixed = (_number(fraw, "min", f"{npath}.fixedRange"),
                     _number(fraw, "max", f"{npath}.fixedRange"))
        if nraw.get("adaptiveRange") is not None:
            _mapping(nraw["adaptiveRange"], f"{npath}.adaptiveRange", ())
            adaptive = True
    return ScorerAlgorithm(_string(raw, "type", path), fixed, adaptive)


@dataclass(frozen=True)
class EndpointAttributeScorerParameters:
    attribute_key: str = param("attributeKey", "")
    algorithm: ScorerAlgorithm = param(  # noqa: RUF009 -- param() is the framework's field(); frozen default
        "algorithm", ScorerAlgorithm(), parse=_scorer_algorithm)

    def check_required(self) -> None:
        """llm-d's required parameters (checked when the plugin is built, so an empty
        block still decodes, as the framework expects of every built-in)."""
        if not self.attribute_key:
            raise ParameterError("attributeKey", "required: the endpoint attribute to read "
                                 "(e.g. GPUUtilization/dcgm-extractor)")
        if self.algorithm.type not in (LOWER_IS_BETTER, HIGHER_IS_BETTER):
            raise ParameterError("algorithm.type", f"must be {LOWER_IS_BETTER!r} or "
                                 f"{HIGHER_IS_BETTER!r}, got {self.algorithm.type!r}")

    def __post_init__(self) -> None:
        if self.algorithm.fixed_range is not None and self.algorithm.adaptive_range:
            raise ParameterError("algorithm.normalization", "at most one normalization "
                                 "strategy, got both fixedRange and adaptiveRange")
        fixed = self.algorithm.fixed_range
        if fixed is not None and fixed[0] >= fixed[1]:
            raise ParameterError("algorithm.normalization.fixedRange",
                                 f"requires min < max, got min {fixed[0]:g}, max {fixed[1]:g}")


class EndpointAttributeScorer:
    """The attribute mapped linearly to [0, 1] over a fixed or the candidates' range."""

    type_name = "endpoint-attribute-scorer"
    Parameters = EndpointAttributeScorerParameters

    def __init__(self, name: str, attribute_key: str, *, lower_is_better: bool = True,
                 fixed_range: tuple[float, float] | None = None) -> None:
        self.name = name
        self.attribute_key = attribute_key
        self.lower_is_better = lower_is_better
        self.fixed_range = fixed_range

    @classmethod
    def from_params(cls, name: str, params: EndpointAttributeScorerParameters,
                    handle: PluginHandle) -> EndpointAttributeScorer:
        params.check_required()
        return cls(name, params.attribute_key,
                   lower_is_better=params.algorithm.type == LOWER_IS_BETTER,
                   fixed_range=params.algorithm.fixed_range)

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        values = [read_attribute(e, self.attribute_key) for e in endpoints]
        if self.fixed_range is not None:
            lo, hi = self.fixed_range
            clamp = True
        else:
            present = [v for v in values if v is not None]
            lo, hi = (min(present), max(present)) if present else (math.inf, -math.inf)
            clamp = False
        out = []
        for v in values:
            if v is None:
                out.append(0.0)
                continue
            if not clamp and hi == lo:
                out.append(1.0)
                continue
            x = (v - lo) / (hi - lo)
            if clamp:
                x = max(0.0, min(1.0, x))
            out.append(1.0 - x if self.lower_is_better else x)
        return out
