"""Engine metric mappings: which Prometheus series carry which load signal (design.md §6).

A :class:`MetricSpec` names one series the way GIE's flags do: ``name`` or
``name{label=value,…}`` (a sample matches when it carries every listed label with that
value; more labels are fine). When several samples match, the one with the newest
timestamp wins, the first in the text on a tie or when there are none (GIE's
``getLatestMetric``).

An :class:`EngineMapping` lists, per signal, the sources to try in order (the first one
present wins, so vLLM's current KV metric falls back to the pre-v0.10 name). Block size
and block count come either from a sample's labels (vLLM, SGLang ``cache_config_info``)
or from a sample's value (trtllm-serve, Triton TensorRT-LLM); llm-d-router's ``triton``
engine (Triton's standard metrics) reads the queue and running counts only. LoRA state
comes from ``vllm:lora_requests_info``: every distinct adapter set is its own series whose
value is the time it was set, so the series with the largest value is the current state
— including a newest series with no adapters (GIE skips such series and so can keep
reporting adapters that are gone; this does not).

:class:`EngineMappings` picks a mapping per endpoint from its ``llm-d.ai/engine-type``
(or ``inference.networking.k8s.io/engine-type``) label, default vLLM.
:func:`mapping_from_config` builds a mapping from GIE's ``core-metrics-extractor``
``engineConfigs`` entry (every spec a string, ``""`` = not read).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from epp import keys
from epp.datalayer.promparse import Sample
from epp.errors import ConfigError
from epp.scheduling.types import Endpoint

log = logging.getLogger(__name__)

_NO_LABELS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """A metric name and the label values a sample must carry to match."""

    name: str
    labels: Mapping[str, str] = field(default_factory=lambda: _NO_LABELS)

    @classmethod
    def parse(cls, spec: str, where: str = "metric spec") -> MetricSpec | None:
        """Parse GIE's ``name`` / ``name{label=value,…}`` syntax; ``""`` means "none".

        Label values are taken verbatim (no quotes, no escapes, no ``,`` ``=`` ``}``
        inside), as GIE reads them. Raises :class:`ConfigError` naming ``where``.
        """
        s = spec.strip()
        if not s:
            return None
        name, labels = s, {}
        start, end = s.find("{"), s.find("}")
        if start != -1 or end != -1:
            if start == -1 or end == -1 or end <= start + 1:
                raise ConfigError(f"{where}: invalid metric spec {spec!r}: missing or malformed "
                                  "label block; use name or name{label=value,…}")
            if end != len(s) - 1:
                raise ConfigError(f"{where}: invalid metric spec {spec!r}: text after '}}'")
            name = s[:start].strip()
            for pair in s[start + 1:end].split(","):
                parts = pair.split("=")
                if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
                    raise ConfigError(f"{where}: invalid label pair {pair.strip()!r} in "
                                      f"metric spec {spec!r}; use label=value")
                labels[parts[0].strip()] = parts[1].strip().strip('"')
        if not name or not name.replace(":", "_").isidentifier():
            raise ConfigError(f"{where}: invalid metric name {name!r} in spec {spec!r}")
        return cls(name, MappingProxyType(labels) if labels else _NO_LABELS)

    def select(self, samples: Mapping[str, Sequence[Sample]]) -> Sample | None:
        """The matching sample with the newest timestamp (first on ties), or None."""
        best: Sample | None = None
        best_ts = -1 << 63
        want = self.labels.items()
        for s in samples.get(self.name, ()):
            if want and not all(s.labels.get(k) == v for k, v in want):
                continue
            ts = s.timestamp_ms if s.timestamp_ms is not None else 0
            if best is None or ts > best_ts:
                best, best_ts = s, ts
        return best

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        return self.name + "{" + ",".join(f"{k}={v}" for k, v in self.labels.items()) + "}"


@dataclass(frozen=True, slots=True)
class Source:
    """A number read from a matching sample: its value, or the value of ``label``."""

    spec: MetricSpec
    label: str | None = None

    def __str__(self) -> str:
        return f"{self.spec}[{self.label}]" if self.label else str(self.spec)


def _sources(*items: tuple[str, Mapping[str, str], str | None]) -> tuple[Source, ...]:
    return tuple(Source(MetricSpec(n, MappingProxyType(dict(lb)) if lb else _NO_LABELS), label)
                 for n, lb, label in items)


@dataclass(frozen=True, slots=True)
class Extracted:
    """What one scrape yielded. None = not found; ``missing`` names required signals
    (waiting, running, KV usage) that were configured but not found or not numbers."""

    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None
    active_loras: frozenset[str] | None = None
    waiting_loras: frozenset[str] | None = None
    max_loras: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    missing: tuple[str, ...] = ()


def _adapters(value: str | None) -> frozenset[str]:
    if not value:
        return frozenset()
    return frozenset(a for a in (x.strip() for x in value.split(",")) if a)


def _as_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        try:
            f = float(text)
        except ValueError:
            return None
        return int(f) if math.isfinite(f) else None


@dataclass(frozen=True, slots=True)
class EngineMapping:
    """Where one engine publishes each signal. Each tuple is tried in order; empty = not read."""

    engine: str
    waiting: tuple[Source, ...]
    running: tuple[Source, ...]
    kv_usage: tuple[Source, ...]
    lora_info: MetricSpec | None = None
    block_size: tuple[Source, ...] = ()
    num_blocks: tuple[Source, ...] = ()
    names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        srcs = (*self.waiting, *self.running, *self.kv_usage, *self.block_size,
                *self.num_blocks)
        names = {s.spec.name for s in srcs}
        if self.lora_info is not None:
            names.add(self.lora_info.name)
        object.__setattr__(self, "names", frozenset(names))

    @staticmethod
    def _read(sources: tuple[Source, ...],
              samples: Mapping[str, Sequence[Sample]]) -> float | None:
        for src in sources:
            s = src.spec.select(samples)
            if s is None:
                continue
            if src.label is None:
                v = s.value
            else:
                iv = _as_int(s.labels.get(src.label))
                if iv is None:
                    continue
                v = float(iv)
            if math.isfinite(v):
                return v
        return None

    def extract(self, samples: Mapping[str, Sequence[Sample]]) -> Extracted:
        """Read every signal from parsed samples (as :func:`promparse.parse` returns)."""
        missing: list[str] = []
        waiting = self._read(self.waiting, samples)
        running = self._read(self.running, samples)
        kv = self._read(self.kv_usage, samples)
        for label, got, srcs in (("waiting", waiting, self.waiting),
                                 ("running", running, self.running),
                                 ("kv-cache usage", kv, self.kv_usage)):
            if got is None and srcs:
                missing.append(f"{label} ({' or '.join(map(str, srcs))})")
        active: frozenset[str] | None = None
        waiting_l: frozenset[str] | None = None
        max_l: int | None = None
        if self.lora_info is not None:
            newest: Sample | None = None
            for s in samples.get(self.lora_info.name, ()):
                if self.lora_info.labels and not all(
                        s.labels.get(k) == v for k, v in self.lora_info.labels.items()):
                    continue
                if newest is None or s.value > newest.value:
                    newest = s
            if newest is None:
                active, waiting_l, max_l = frozenset(), frozenset(), 0
            else:
                active = _adapters(newest.labels.get(keys.LORA_RUNNING_LABEL))
                waiting_l = _adapters(newest.labels.get(keys.LORA_WAITING_LABEL))
                max_l = _as_int(newest.labels.get(keys.LORA_MAX_LABEL)) or 0
        bs = self._read(self.block_size, samples)
        nb = self._read(self.num_blocks, samples)
        return Extracted(
            waiting=None if waiting is None else int(waiting),
            running=None if running is None else int(running),
            kv_usage=kv,
            active_loras=active, waiting_loras=waiting_l, max_loras=max_l,
            block_size=None if bs is None or bs <= 0 else int(bs),
            num_blocks=None if nb is None or nb <= 0 else int(nb),
            missing=tuple(missing),
        )


#: llm-d-router v0.10.0's fifth built-in engine (core-metrics-extractor's
#: defaultEngineConfigs, pkg/epp/framework/plugins/datalayer/extractor/metrics/
#: factories.go): the Triton Inference Server's standard metrics, for models served
#: without the TensorRT-LLM backend (that one is ``triton-tensorrt-llm``). The queue is
#: the pending-request gauge, "running" the execution counter (llm-d's choice: a cumulative
#: count of model executions, not a gauge of requests in flight); KV usage, LoRA and cache
#: geometry are not read (Triton's standard metrics have none).
ENGINE_TRITON = "triton"
TRITON_PENDING_REQUESTS = "nv_inference_pending_request_count"
TRITON_EXEC_COUNT = "nv_inference_exec_count"


def builtin_mappings() -> dict[str, EngineMapping]:
    """The built-in engines, keyed by engine-type label value: the four of design.md §6
    (GIE v1.5.0's) and llm-d-router v0.10.0's ``triton``."""
    k = keys
    vllm = EngineMapping(
        engine=k.ENGINE_VLLM,
        waiting=_sources((k.VLLM_WAITING, {}, None)),
        running=_sources((k.VLLM_RUNNING, {}, None)),
        kv_usage=_sources((k.VLLM_KV_USAGE, {}, None), (k.VLLM_KV_USAGE_OLD, {}, None)),
        lora_info=MetricSpec(k.VLLM_LORA_INFO),
        block_size=_sources((k.VLLM_CACHE_CONFIG, {}, k.VLLM_BLOCK_SIZE_LABEL)),
        num_blocks=_sources((k.VLLM_CACHE_CONFIG, {}, k.VLLM_NUM_BLOCKS_LABEL)),
    )
    sglang = EngineMapping(
        engine=k.ENGINE_SGLANG,
        waiting=_sources((k.SGLANG_WAITING, {}, None)),
        running=_sources((k.SGLANG_RUNNING, {}, None)),
        kv_usage=_sources((k.SGLANG_KV_USAGE, {}, None)),
        block_size=_sources((k.SGLANG_CACHE_CONFIG, {}, k.SGLANG_PAGE_SIZE_LABEL)),
        num_blocks=_sources((k.SGLANG_CACHE_CONFIG, {}, k.SGLANG_NUM_PAGES_LABEL)),
    )
    trtllm = EngineMapping(
        engine=k.ENGINE_TRTLLM_SERVE,
        waiting=_sources((k.TRTLLM_WAITING, {}, None)),
        running=_sources((k.TRTLLM_RUNNING, {}, None)),
        kv_usage=_sources((k.TRTLLM_KV_USAGE, {}, None)),
        block_size=_sources((k.TRTLLM_TOKENS_PER_BLOCK, {}, None)),
        num_blocks=_sources((k.TRTLLM_MAX_BLOCKS, {}, None)),
    )
    req, kvb = k.TRITON_REQUEST_TYPE_LABEL, k.TRITON_KV_BLOCK_TYPE_LABEL
    triton = EngineMapping(
        engine=k.ENGINE_TRITON_TRTLLM,
        waiting=_sources((k.TRITON_REQUEST_METRICS, {req: k.TRITON_REQUEST_WAITING}, None)),
        running=_sources((k.TRITON_REQUEST_METRICS, {req: k.TRITON_REQUEST_SCHEDULED}, None)),
        kv_usage=_sources((k.TRITON_KV_BLOCK_METRICS, {kvb: k.TRITON_KV_FRACTION}, None)),
        block_size=_sources((k.TRITON_KV_BLOCK_METRICS, {kvb: k.TRITON_KV_TOKENS_PER_BLOCK}, None)),
        num_blocks=_sources((k.TRITON_KV_BLOCK_METRICS, {kvb: k.TRITON_KV_MAX_BLOCKS}, None)),
    )
    triton_std = EngineMapping(
        engine=ENGINE_TRITON,
        waiting=_sources((TRITON_PENDING_REQUESTS, {}, None)),
        running=_sources((TRITON_EXEC_COUNT, {}, None)),
        kv_usage=(),
    )
    return {m.engine: m for m in (vllm, sglang, trtllm, triton, triton_std)}


@dataclass(frozen=True)
class MappingOverrides:
    """GIE's metric flags, applied to the default engine's mapping.

    Each field is a GIE metric spec string; None = flag not given (keep the built-in,
    including vLLM's fallback to ``vllm:gpu_cache_usage_perc``); ``""`` = do not read
    that signal. ``cache_info`` replaces the ``cache_config_info`` metric whose labels
    give block size and block count (the label names stay the engine's).
    """

    total_queued_requests: str | None = None
    total_running_requests: str | None = None
    kv_cache_usage_percentage: str | None = None
    lora_info: str | None = None
    cache_info: str | None = None

    def apply(self, m: EngineMapping) -> EngineMapping:
        """A copy of ``m`` with the given flags applied; raises ConfigError on a bad spec."""
        def one(value: str | None, flag: str, current: tuple[Source, ...]) -> tuple[Source, ...]:
            if value is None:
                return current
            spec = MetricSpec.parse(value, flag)
            return () if spec is None else (Source(spec),)

        changes: dict[str, object] = {
            "waiting": one(self.total_queued_requests, "--total-queued-requests-metric",
                           m.waiting),
            "running": one(self.total_running_requests, "--total-running-requests-metric",
                           m.running),
            "kv_usage": one(self.kv_cache_usage_percentage,
                            "--kv-cache-usage-percentage-metric", m.kv_usage),
        }
        if self.lora_info is not None:
            changes["lora_info"] = MetricSpec.parse(self.lora_info, "--lora-info-metric")
        if self.cache_info is not None:
            spec = MetricSpec.parse(self.cache_info, "--cache-info-metric")
            label_sources = [s for s in (*m.block_size, *m.num_blocks) if s.label is not None]
            if spec is None:
                changes["block_size"] = tuple(s for s in m.block_size if s.label is None)
                changes["num_blocks"] = tuple(s for s in m.num_blocks if s.label is None)
            elif label_sources:
                changes["block_size"] = tuple(Source(spec, s.label) if s.label else s
                                              for s in m.block_size)
                changes["num_blocks"] = tuple(Source(spec, s.label) if s.label else s
                                              for s in m.num_blocks)
        return dataclasses.replace(m, **changes)  # type: ignore[arg-type]


def mapping_from_config(engine: str, *, queued: str = "", running: str = "",
                        kv_usage: str = "", lora: str = "", cache_info: str = "",
                        cache_block_size_label: str = "", cache_num_blocks_label: str = "",
                        cache_block_size: str = "", cache_num_blocks: str = "",
                        where: str = "engineConfigs") -> EngineMapping:
    """An :class:`EngineMapping` from GIE's ``engineConfigs`` fields (its
    ``NewMappingFromConfig``): each spec ``name`` or ``name{label=value,…}``, ``""`` for
    "not read"; block size and count come from the ``cache_info`` metric's labels
    (``block_size`` / ``num_gpu_blocks`` unless renamed) or from gauges of their own.
    Raises :class:`ConfigError` naming ``where`` and the field."""
    def one(value: str, field_name: str) -> tuple[Source, ...]:
        spec = MetricSpec.parse(value, f"{where}.{field_name}")
        return () if spec is None else (Source(spec),)

    info = MetricSpec.parse(cache_info, f"{where}.cacheInfoSpec")
    block_size = one(cache_block_size, "cacheBlockSizeSpec")
    num_blocks = one(cache_num_blocks, "cacheNumBlocksSpec")
    if info is not None:
        block_size = (Source(info, cache_block_size_label or keys.VLLM_BLOCK_SIZE_LABEL),
                      *block_size)
        num_blocks = (Source(info, cache_num_blocks_label or keys.VLLM_NUM_BLOCKS_LABEL),
                      *num_blocks)
    return EngineMapping(
        engine=engine,
        waiting=one(queued, "queuedRequestsSpec"),
        running=one(running, "runningRequestsSpec"),
        kv_usage=one(kv_usage, "kvUsageSpec"),
        lora_info=MetricSpec.parse(lora, f"{where}.loraSpec"),
        block_size=block_size,
        num_blocks=num_blocks,
    )


class EngineMappings:
    """Engine mapping per endpoint, from its engine-type label; default ``default``.

    Label values are matched case-insensitively. An unknown engine falls back to the
    default mapping, with one warning per unknown value (the instance remembers which
    values it has warned about; it is owned by one scraper, never shared module-wide).
    """

    #: The labels read for the engine type, first present wins (``core-metrics-extractor``
    #: with an ``engineLabelKey`` reads that one only).
    DEFAULT_LABEL_KEYS = (keys.LABEL_ENGINE, keys.LABEL_ENGINE_GIE)

    def __init__(self, mappings: Mapping[str, EngineMapping] | None = None,
                 default: str = keys.ENGINE_VLLM,
                 overrides: MappingOverrides | None = None,
                 label_keys: Sequence[str] = DEFAULT_LABEL_KEYS) -> None:
        table = dict(mappings if mappings is not None else builtin_mappings())
        if default not in table:
            raise ConfigError(f"unknown default engine {default!r}; known: "
                              f"{', '.join(sorted(table))}")
        if overrides is not None:
            table[default] = overrides.apply(table[default])
        self._table = {k.lower(): v for k, v in table.items()}
        self.default = self._table[default.lower()]
        self.label_keys = tuple(label_keys)
        self._warned: set[str] = set()

    @property
    def engines(self) -> list[str]:
        return sorted(self._table)

    def get(self, engine: str) -> EngineMapping | None:
        return self._table.get(engine.lower())

    def for_endpoint(self, ep: Endpoint) -> EngineMapping:
        value = next((v for v in (ep.labels.get(k) for k in self.label_keys) if v), None)
        if not value:
            return self.default
        m = self._table.get(value.lower())
        if m is not None:
            return m
        if value not in self._warned:
            self._warned.add(value)
            log.warning("unknown engine type %r (endpoint %s); scraping it with the %s "
                        "mapping. Known: %s", value, ep.key, self.default.engine,
                        ", ".join(self.engines))
        return self.default
