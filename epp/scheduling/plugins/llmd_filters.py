"""``utilization-filter`` and ``context-length-aware`` (llm-d-router v0.10.0,
pkg/epp/framework/plugins/scheduling/filter/utilization and
scheduling/scorer/contextlengthaware).

**utilization-filter** keeps the endpoints that satisfy every ``conditions`` entry
``{metric, maxValue}``: the metric is at most ``maxValue``. Metrics: ``active-requests``
(the requests this EPP routed there and has not seen complete, from
``inflight-load-producer``: the one named ``inFlightLoadProducerName``, else the config's,
else one created as ``<name>-producer``), ``running-requests``, ``waiting-queue`` (the
model server's) and ``kv-cache-utilization`` (0-1). A metric the endpoint lacks counts
as 0. With ``fallbackOnEmpty: true`` an empty result gives back every candidate.
Validation as llm-d: at least one condition; a known metric; ``maxValue`` given,
non-negative, at most 1 for ``kv-cache-utilization``.

**context-length-aware** is a scorer and a filter. Pods declare the context lengths they
serve in a label (``label``, default ``llm-d.ai/context-length-range``) as ``min-max``
(e.g. ``0-2048``). The request's context length is its token count from
``token-producer`` (``TokenizedPrompt``; one with the ``estimate`` backend is created when
the config declares none, as llm-d does), 0 when not tokenized. Score: a pod without the
label 0.5; an unparsable range 0; in range ``0.3 + 0.7 × (0.7 × 1/(1 + width/10000) + 0.3 ×
headroom/width)`` (1 for a zero-width range), so tighter ranges and more headroom win and
every in-range pod beats every out-of-range one; out of range ``0.3 / (1 + distance/1000)``
(the nearest range wins). With ``enableFiltering: true`` it also drops pods whose range
does not contain the length (unlabelled pods kept, unparsable ones dropped); otherwise
its filter keeps everything.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from epp.errors import ConfigError
from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, config_warning, param, report_unknown
from epp.scheduling.plugins.load import InFlightLoadProducer
from epp.scheduling.plugins.token_producer import TOKENIZED_PROMPT, TokenProducer, tokenized
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ utilization-filter

UTILIZATION_FILTER = "utilization-filter"
METRIC_ACTIVE_REQUESTS = "active-requests"
METRIC_RUNNING_REQUESTS = "running-requests"
METRIC_WAITING_QUEUE = "waiting-queue"
METRIC_KV_CACHE_UTILIZATION = "kv-cache-utilization"
METRICS = (METRIC_ACTIVE_REQUESTS, METRIC_RUNNING_REQUESTS, METRIC_WAITING_QUEUE,
           METRIC_KV_CACHE_UTILIZATION)


@dataclass(frozen=True)
class Condition:
    metric: str = ""
    max_value: float | None = None


def _conditions(value: Any, path: str) -> tuple[Condition, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of {{metric, maxValue}}, got {value!r}")
    out: list[Condition] = []
    for i, raw in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a mapping {{metric, maxValue}}, got {raw!r}")
        report_unknown(where, set(raw) - {"metric", "maxValue"}, ("maxValue", "metric"))
        metric = raw.get("metric")
        if metric is None:
            metric = ""
        if not isinstance(metric, str):
            raise ConfigError(f"{where}.metric: expected a string, got {metric!r}")
        mv = raw.get("maxValue")
        if mv is not None and (isinstance(mv, bool) or not isinstance(mv, (int, float))):
            raise ConfigError(f"{where}.maxValue: expected a number, got {mv!r}")
        out.append(Condition(metric, None if mv is None else float(mv)))
    return tuple(out)


@dataclass(frozen=True)
class UtilizationFilterParameters:
    conditions: tuple[Condition, ...] = param("conditions", (), parse=_conditions)
    fallback_on_empty: bool = param("fallbackOnEmpty", False)
    in_flight_load_producer_name: str = param("inFlightLoadProducerName", "")

    def check(self) -> None:
        """llm-d's NewUtilizationFilter checks (at build time: an empty block decodes)."""
        if not self.conditions:
            raise ParameterError("conditions", "utilization filter requires at least one "
                                 "condition (e.g. [{metric: waiting-queue, maxValue: 0}])")
        for i, c in enumerate(self.conditions):
            key = f"conditions[{i}]"
            if c.metric not in METRICS:
                raise ParameterError(f"{key}.metric", "utilization filter condition metric "
                                     f"must be one of {', '.join(METRICS)}, got {c.metric!r}")
            if c.max_value is None:
                raise ParameterError(f"{key}.maxValue", "utilization filter condition for "
                                     f"{c.metric!r} requires maxValue")
            if c.max_value < 0:
                raise ParameterError(f"{key}.maxValue", "utilization filter condition for "
                                     f"{c.metric!r} requires a non-negative maxValue, got "
                                     f"{c.max_value:g}")
            if c.metric == METRIC_KV_CACHE_UTILIZATION and c.max_value > 1:
                raise ParameterError(f"{key}.maxValue", "utilization filter maxValue for "
                                     f"{METRIC_KV_CACHE_UTILIZATION!r} is a fraction and must "
                                     f"be at most 1, got {c.max_value:g}")


class UtilizationFilter:
    """Drops the endpoints over any of the configured caps (module doc)."""

    type_name = UTILIZATION_FILTER
    Parameters = UtilizationFilterParameters

    def __init__(self, name: str, conditions: Sequence[tuple[str, float]], *,
                 fallback_on_empty: bool = False, producer_name: str = "") -> None:
        self.name = name or UTILIZATION_FILTER
        self.conditions = tuple(conditions)
        self.fallback_on_empty = fallback_on_empty
        self.producer_name = producer_name
        self.uses_active = any(m == METRIC_ACTIVE_REQUESTS for m, _ in self.conditions)
        self.consumes: Mapping[str, str] = MappingProxyType(
            {fw.DATA_KEY_IN_FLIGHT_LOAD: "InFlightLoad"} if self.uses_active else {})
        self.producer: InFlightLoadProducer | None = None

    @classmethod
    def from_params(cls, name: str, params: UtilizationFilterParameters,
                    handle: PluginHandle) -> UtilizationFilter:
        params.check()
        conds = [(c.metric, c.max_value) for c in params.conditions
                 if c.max_value is not None]
        return cls(name, conds, fallback_on_empty=params.fallback_on_empty,
                   producer_name=params.in_flight_load_producer_name)

    def bind(self, handle: PluginHandle) -> None:
        """``active-requests`` needs an inflight-load-producer: the named one, the
        config's, or one created here."""
        if not self.uses_active:
            return
        if self.producer_name:
            self.producer = handle.named(self.producer_name, InFlightLoadProducer)
            if self.producer is None:
                raise ConfigError(f"{self.name}.inFlightLoadProducerName: no "
                                  f"inflight-load-producer named {self.producer_name!r}; "
                                  "declare one or leave the parameter out")
            return
        producers = handle.of_type(InFlightLoadProducer)
        if len(producers) > 1:
            raise ConfigError(f"{self.name}: more than one inflight-load-producer; set "
                              "inFlightLoadProducerName to the one to read")
        if producers:
            self.producer = producers[0]
            return
        self.producer = InFlightLoadProducer(f"{self.name}-producer")
        handle.add(self.producer)

    def _value(self, e: Endpoint, metric: str) -> float:
        if metric == METRIC_ACTIVE_REQUESTS:
            if self.producer is None:
                return 0.0
            return float(self.producer.tracker.requests.get(e.key, 0))
        m = e.metrics
        if metric == METRIC_RUNNING_REQUESTS:
            return float(m.running_requests)
        if metric == METRIC_WAITING_QUEUE:
            return float(m.waiting_queue_size)
        return float(m.kv_cache_usage)

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        kept = [e for e in endpoints
                if all(self._value(e, m) <= cap for m, cap in self.conditions)]
        if not kept and self.fallback_on_empty:
            return endpoints
        return kept


# ---------------------------------------------------------------- context-length-aware

CONTEXT_LENGTH_AWARE = "context-length-aware"
DEFAULT_CONTEXT_LENGTH_LABEL = "llm-d.ai/context-length-range"
MAX_FALLBACK_SCORE = 0.3
NEUTRAL_SCORE = 0.5
_BOUND = re.compile(r"^[+-]?\d+$")


def parse_context_range(text: str) -> tuple[int, int]:
    """``"min-max"`` → (min, max); ValueError with llm-d's messages otherwise."""
    if text == "":
        raise ValueError("empty range string")
    bounds = text.split("-")
    if len(bounds) != 2:
        raise ValueError(f"invalid range format: {text} (expected 'min-max')")
    lo_s, hi_s = bounds[0].strip(), bounds[1].strip()
    if not _BOUND.match(lo_s):
        raise ValueError(f"invalid min value: {bounds[0]}")
    if not _BOUND.match(hi_s):
        raise ValueError(f"invalid max value: {bounds[1]}")
    lo, hi = int(lo_s), int(hi_s)
    if lo > hi:
        raise ValueError(f"min ({lo}) cannot be greater than max ({hi})")
    return lo, hi


def range_score(length: int, lo: int, hi: int) -> float:
    """llm-d's calculateRangeScore (module doc)."""
    if lo <= length <= hi:
        width = hi - lo
        if width == 0:
            return 1.0
        width_score = 1.0 / (1.0 + width / 10000.0)
        position_score = (hi - length) / width
        raw = 0.7 * width_score + 0.3 * position_score
        return MAX_FALLBACK_SCORE + raw * (1.0 - MAX_FALLBACK_SCORE)
    distance = length - hi if length > hi else lo - length
    return MAX_FALLBACK_SCORE / (1.0 + distance / 1000.0)


def context_length(request: LLMRequest) -> int:
    """The request's token count from token-producer; 0 when not tokenized."""
    tp = tokenized(request)
    return 0 if tp is None else tp.token_count


@dataclass(frozen=True)
class ContextLengthAwareParameters:
    label: str = param("label", DEFAULT_CONTEXT_LENGTH_LABEL)
    enable_filtering: bool = param("enableFiltering", False)

    def __post_init__(self) -> None:
        if not self.label:
            raise ParameterError("label", f"invalid configuration for "
                                 f"{CONTEXT_LENGTH_AWARE!r} plugin: 'label' must be specified")


class ContextLengthAware:
    """Scores (and with ``enableFiltering`` filters) pods by their context-length range."""

    type_name = CONTEXT_LENGTH_AWARE
    Parameters = ContextLengthAwareParameters
    consumes = MappingProxyType({TOKENIZED_PROMPT: "TokenizedPrompt"})

    def __init__(self, name: str, label: str = DEFAULT_CONTEXT_LENGTH_LABEL,
                 enable_filtering: bool = False) -> None:
        self.name = name or CONTEXT_LENGTH_AWARE
        self.label = label
        self.enable_filtering = enable_filtering
        self._bad_labels: set[tuple[str, str]] = set()

    @classmethod
    def from_params(cls, name: str, params: ContextLengthAwareParameters,
                    handle: PluginHandle) -> ContextLengthAware:
        return cls(name, params.label, params.enable_filtering)

    def bind(self, handle: PluginHandle) -> None:
        """llm-d auto-creates an ``estimate`` token-producer when none is declared."""
        if not handle.of_type(TokenProducer):
            from epp.kvcache.tokenization import EstimateTokenizer

            config_warning(self.name, "no token-producer declared: context lengths come "
                           "from the byte-packing estimate; declare a token-producer with "
                           "vllm.url (or local.path) for exact token counts")
            handle.add(TokenProducer(f"{self.name}-token-producer", EstimateTokenizer()))

    def _range(self, e: Endpoint) -> tuple[int, int] | None | ValueError:
        """The pod's range; None without the label; the parse error when unparsable."""
        text = e.labels.get(self.label)
        if text is None:
            return None
        try:
            return parse_context_range(text)
        except ValueError as err:
            if (e.key, text) not in self._bad_labels:  # logged once per endpoint and value
                self._bad_labels.add((e.key, text))
                log.error("%s: endpoint %s: cannot parse context range label %s=%r: %s",
                          self.name, e.key, self.label, text, err)
            return err

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        if not self.enable_filtering:
            return endpoints
        n = context_length(request)
        kept: list[Endpoint] = []
        for e in endpoints:
            r = self._range(e)
            if r is None or (not isinstance(r, ValueError) and r[0] <= n <= r[1]):
                kept.append(e)
        return kept

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        n = context_length(request)
        out: list[float] = []
        for e in endpoints:
            r = self._range(e)
            if r is None:
                out.append(NEUTRAL_SCORE)
            elif isinstance(r, ValueError):
                out.append(0.0)
            else:
                out.append(range_score(n, r[0], r[1]))
        return out
