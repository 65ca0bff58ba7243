"""Prometheus series of the precise prefix cache, with llm-d-router v0.10.0's names
(``pkg/kvcache/metrics/collector.go``: subsystem ``llm_d_router_epp``) where llm-d has
one, computed at scrape time from the producer's counters.

llm-d has no series for the index's size or memory; this project's are
``llm_d_router_epp_kv_cache_index_entries`` (key, pod, medium entries),
``llm_d_router_epp_kv_cache_index_blocks`` (per pod) and
``llm_d_router_epp_kv_cache_index_memory_bytes`` (an estimate).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.kvcache.index import BlockIndex
from epp.kvcache.subscriber import SubscriberManager

SUBSYSTEM = "llm_d_router_epp"


class IndexOwner(Protocol):
    """What the collector reads (the ``precise-prefix-cache-producer``)."""

    index: BlockIndex
    manager: SubscriberManager
    lookups: int
    lookup_hits: int


class KVCacheCollector(Collector):
    def __init__(self, producer: IndexOwner) -> None:
        self.producer = producer

    def collect(self) -> Iterator[Metric]:
        p = self.producer
        s = p.index.stats()
        st = p.manager.stats

        def counter(name: str, help_: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{SUBSYSTEM}_{name}", help_)
            c.add_metric([], value)
            return c

        yield counter("kv_cache_index_admissions_total", "Total number of KV-block admissions",
                      s.admissions)
        yield counter("kv_cache_index_evictions_total", "Total number of KV-block evictions",
                      s.evictions)
        yield counter("kv_cache_index_lookup_requests_total", "Total number of lookup calls",
                      p.lookups)
        yield counter("kv_cache_index_lookup_hits_total",
                      "Number of lookups that found a cached block on some candidate",
                      p.lookup_hits)
        msgs = CounterMetricFamily(f"{SUBSYSTEM}_kv_cache_events_messages_received_total",
                                   "Total number of KV-event messages received")
        msgs.add_metric([], st.messages)
        yield msgs
        yield counter("kv_cache_events_subscriber_reconnections_total",
                      "Total number of KV-event subscriber reconnections", st.reconnections)
        errs = CounterMetricFamily(f"{SUBSYSTEM}_kv_cache_events_zmq_errors_total",
                                   "Total number of ZMQ errors by kind", labels=["type"])
        for kind, n in sorted(st.errors.items()):
            errs.add_metric([kind], n)
        yield errs
        g = GaugeMetricFamily(f"{SUBSYSTEM}_kv_cache_events_active_subscribers",
                              "Number of active KV-event subscribers")
        g.add_metric([], len(p.manager.active()))
        yield g
        e = GaugeMetricFamily(f"{SUBSYSTEM}_kv_cache_index_entries",
                              "KV-block index entries (block key, pod, medium)")
        e.add_metric([], s.entries)
        yield e
        b = GaugeMetricFamily(f"{SUBSYSTEM}_kv_cache_index_blocks",
                              "KV-block index entries per pod", labels=["pod"])
        for pod in sorted(p.index.pods()):
            b.add_metric([pod], p.index.blocks_of(pod))
        yield b
        m = GaugeMetricFamily(f"{SUBSYSTEM}_kv_cache_index_memory_bytes",
                              "Estimated memory of the KV-block index in bytes")
        m.add_metric([], s.approx_bytes)
        yield m
