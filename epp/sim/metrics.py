"""vLLM-named Prometheus metrics for one simulated server.

Each server gets its own :class:`prometheus_client.CollectorRegistry` holding one
:class:`EngineCollector`, which reads the engine at scrape time (no global registry, no
background updates). Every series carries ``model_name`` (the served base model).

Exported (names as vLLM exposes them; counters gain ``_total``):

- gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` and the older ``vllm:gpu_cache_usage_perc`` (0..1);
- ``vllm:cache_config_info{block_size, num_gpu_blocks, ...}`` = 1;
- ``vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}`` =
  wall-clock time the label set was last current (only when adapters are configured;
  up to :data:`epp.sim.engine.LORA_INFO_HISTORY` label sets, newest wins);
- counters ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``
  (prompt tokens looked up / found), ``vllm:prompt_tokens_total``,
  ``vllm:generation_tokens_total``, ``vllm:request_success_total{finished_reason}``,
  ``vllm:num_preemptions_total``;
- histograms (seconds) ``vllm:time_to_first_token_seconds``,
  ``vllm:time_per_output_token_seconds`` (each inter-token gap, also exported as
  ``vllm:inter_token_latency_seconds``), ``vllm:e2e_request_latency_seconds``,
  ``vllm:request_queue_time_seconds``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from epp.sim.engine import Engine
from epp.sim.stats import Histogram

__all__ = ["CONTENT_TYPE", "EngineCollector", "build_registry", "render"]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector(Collector):
    """Reads ``engine`` on every collect; ``model`` is the ``model_name`` label."""

    def __init__(self, engine: Engine, model: str) -> None:
        self._engine = engine
        self._model = model

    def collect(self) -> Iterator[Metric]:
        e, m = self._engine, self._model
        cfg, s = e.config, e.stats
        lab = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=lab)
            g.add_metric([m], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=lab)
            c.add_metric([m], value)
            return c

        def histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
            f = HistogramMetricFamily(name, doc, labels=lab)
            f.add_metric([m], h.cumulative(), h.sum)
            return f

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            e.num_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            e.num_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage
        )
        yield gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage (older name).",
            e.kv_usage,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            labels=[*lab, "block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"],
        )
        info.add_metric([m, str(cfg.block_size), str(cfg.num_gpu_blocks), "True", "auto"], 1.0)
        yield info
        if cfg.loras:
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=[*lab, "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )
            for (running, waiting), ts in e.lora_info.items():
                lora.add_metric([m, running, waiting, str(cfg.max_loras)], ts)
            yield lora
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.preemptions,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*lab, "finished_reason"],
        )
        for reason in sorted({"length", *s.success}):
            success.add_metric([m, reason], s.success[reason])
        yield success
        yield histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            s.ttft,
        )
        yield histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            s.tpot,
        )
        yield histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            s.tpot,
        )
        yield histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            s.e2e,
        )
        yield histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            s.queue_time,
        )


def build_registry(engine: Engine, model: str) -> CollectorRegistry:
    """A fresh registry (not the global one) exporting ``engine``'s metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text exposition (version 0.0.4) of ``registry``."""
    return generate_latest(registry)
