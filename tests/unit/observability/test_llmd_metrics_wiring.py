"""llm-d-router v0.10.0's ``llm_d_epp_*`` series that plugins and hooks record (issue 18):
each moves when the thing it counts happens, recorded where llm-d-router records it.

Go call sites (tag v0.10.0): flow-control reclamation
(pkg/epp/flowcontrol/controller/internal/reclamation.go), the multimodal producer
(requestcontrol/dataproducer/multimodal/producer.go Produce), the DisaggregatedSet rollout
screener (screener/disaggregatedsetrollout/{plugin,screener}.go), the in-flight load
producer (dataproducer/inflightload/producer.go PreRequest / OnEvicted), the data layer
(pkg/epp/datalayer/collector.go, datalayer/source/http/datasource.go), the utilization
detector (saturationdetector/utilization/detector.go Saturation) and the ext_proc server
(pkg/epp/handlers/server.go, response.go: request/response processing, inter-token
latency). Plugins get the metrics object from ``EppMetrics.bind_plugins`` (their
``bind_metrics``); unbound they record nothing.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from aiohttp import web

from epp import keys
from epp.config.loader import load_and_build
from epp.datalayer.polling import PollingRunner
from epp.datalayer.scraper import MetricsScraper, ScrapeOptions
from epp.datastore.store import Datastore
from epp.errors import BadRequest
from epp.flowcontrol.eviction import OUTCOME_TIMED_OUT, ReclamationController, RequestEvictor
from epp.framework import interfaces as fw
from epp.observability.metrics import EppMetrics, EvictionRecorder
from epp.requestcontrol.director import Director
from epp.requestcontrol.rollout_screener import DisaggregatedSetRolloutScreener
from epp.scheduling.plugins.dcgm import DCGMDataSource, DCGMExtractor
from epp.scheduling.plugins.load import InFlightLoadProducer, estimate_tokens
from epp.scheduling.plugins.multimodal_cache import MMEmbeddingsCacheProducer
from epp.scheduling.plugins.saturation import UtilizationDetector
from epp.scheduling.types import (
    ApiType,
    Endpoint,
    LLMRequest,
    Metrics,
    ProfileRunResult,
    SchedulingResult,
)
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, ServerParts, wire
from tests.polling import eventually
from tests.unit.flowcontrol.test_eviction import Stream, resp_body, resp_headers
from tests.unit.flowcontrol.test_eviction import server as eviction_server
from tests.unit.requestcontrol.test_llmd_screener import params, pod, req, seed

PODS = [Endpoint(name=f"pod-{i}", address=f"10.0.0.{i}", port=8000, namespace="ns")
        for i in (1, 2, 3)]
H = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r1"}
BASE = """
plugins:
%s
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
%s
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""


def server(plugins: str = "", profile: str = "") -> ServerParts:
    """``epp serve`` over PODS with the given plugin entries (YAML list items) and profile
    references."""
    timings = PluginTimings()
    built = load_and_build(None, BASE % (plugins, profile), timer=timings, strict=True)
    parts = wire(validate(ServeOptions(static=StaticSourceOptions(
        endpoints=",".join(e.key for e in PODS)))), built, timings, None)
    parts.store.set_endpoints(PODS)
    return parts


def value(m: EppMetrics, name: str, /, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def chat(content: Any = "hi", **extra: Any) -> bytes:
    return orjson.dumps({"model": "llama", "messages": [{"role": "user", "content": content}],
                         **extra})


async def serve(d: Director, body: bytes, headers: Mapping[str, str] = H,
                chunks: tuple[bytes, ...] = (b"{}",), sse: bool = False) -> None:
    r = await d.route(headers, body, True, None)
    d.on_response_headers(r.context, 200, {"content-type": "text/event-stream" if sse
                                           else "application/json"})
    for c in chunks[:-1]:
        d.on_response_body(r.context, c, False)
    d.on_response_body(r.context, chunks[-1], True)
    d.on_done(r.context, aborted=False)


# ------------------------------------------------------------------ binding


def test_the_server_binds_every_recording_plugin() -> None:
    """EppMetrics.bind_plugins hands the metrics to each plugin with ``bind_metrics``,
    the loader's default saturation detector (not among the plugins) included; the
    Director of an in-process core and the eviction hook get them too."""
    parts = server("- type: inflight-load-producer\n- type: mm-embeddings-cache-producer")
    m = parts.metrics
    for name in ("inflight-load-producer", "mm-embeddings-cache-producer"):
        assert parts.built.plugins[name]._metrics is m
    detector = parts.built.saturation_detector
    assert isinstance(detector, UtilizationDetector)
    assert detector.name not in parts.built.plugins and detector._metrics is m
    assert parts.director.metrics is m
    # Unbound (unit tests, tools): nothing recorded, behaviour unchanged.
    assert InFlightLoadProducer("p")._metrics is None


# ------------------------------------------------------------------ flow-control eviction


async def test_eviction_records_issued_confirmed_reclaim_and_confirmation_time(
        tmp_path: Any) -> None:
    """llm-d's ReclamationController: revocations issued (by the demand's priority), the
    confirmation when the evicted stream ends (and how long it took), the reclaim target
    and the pending-reclaim debit."""
    parts = eviction_server(tmp_path)
    fc = parts.flow_control
    assert fc is not None and fc.reclamation is not None
    assert isinstance(fc.reclamation.metrics, EvictionRecorder)
    m = parts.metrics
    pool = {"inference_pool": m.pool_name}
    await fc.start()
    try:
        old = Stream(parts, "old", "batch")
        await eventually(lambda: old.routed)
        new = Stream(parts, "new", "batch")
        await eventually(lambda: new.routed)
        assert value(m, "llm_d_epp_flow_control_revocations_issued_total", priority="10",
                     **pool) is None
        critical = Stream(parts, "crit", "critical")  # blocked: the newest batch one goes
        await eventually(lambda: new.task.done() and critical.routed)
        assert value(m, "llm_d_epp_flow_control_revocations_issued_total", priority="10",
                     **pool) == 1
        assert value(m, "llm_d_epp_flow_control_revocations_total", outcome="confirmed",
                     **pool) == 1
        assert value(m, "llm_d_epp_flow_control_revocation_confirmation_seconds_count",
                     **pool) == 1
        # (saturation at the ceiling: a deficit of 0, one revocation)
        assert value(m, "llm_d_epp_flow_control_reclaim_target", **pool) == \
            pytest.approx(fc.reclamation.stats.reclaim_target)
        assert value(m, "llm_d_epp_flow_control_pending_reclaim", **pool) == \
            pytest.approx(fc.reclamation.stats.pending_reclaim)
        for s in (old, critical):
            s.send(resp_headers(), resp_body(b"{}", True), None)
        await eventually(lambda: old.task.done() and critical.task.done())
    finally:
        await fc.stop()


def test_an_unconfirmed_revocation_times_out() -> None:
    m = EppMetrics(Datastore())
    now = [100.0]
    ev = RequestEvictor(clock=lambda: now[0])
    r = LLMRequest("s0", "m", "m", ApiType.COMPLETIONS, "p", {})
    r.priority = -1
    ev.pre_request(r, SchedulingResult({"default": ProfileRunResult((PODS[0],))}, "default"))
    rc = ReclamationController(ev, clock=lambda: now[0], confirmation_grace=0.0,
                               confirmation_timeout=1.0, metrics=m.eviction_metrics())
    assert rc.reclaim(1.0, 1.0, 0) == ["s0"]
    assert value(m, "llm_d_epp_flow_control_pending_reclaim", inference_pool="static") == 1.0
    now[0] += 2
    assert rc.gate_open(now[0])
    assert value(m, "llm_d_epp_flow_control_revocations_total", outcome=OUTCOME_TIMED_OUT,
                 inference_pool="static") == 1
    assert value(m, "llm_d_epp_flow_control_revocation_confirmation_seconds_count",
                 inference_pool="static") is None
    assert value(m, "llm_d_epp_flow_control_pending_reclaim", inference_pool="static") == 0


# ------------------------------------------------------------------ mm-embeddings cache


async def test_encoder_cache_queries_hits_and_hit_ratio() -> None:
    """Per media item looked up: a query, and a hit for every endpoint whose LRU holds it
    (``pod``: its namespace/name); per candidate, the share of the request's items it
    holds."""
    parts = server("- type: mm-embeddings-cache-producer\n- type: mm-embeddings-cache-scorer",
                   "  - pluginRef: mm-embeddings-cache-scorer\n    weight: 10")
    m = parts.metrics
    ident = {"plugin_type": "mm-embeddings-cache-producer",
             "plugin_name": "mm-embeddings-cache-producer"}
    cat = [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]
    await serve(parts.director, chat(cat))  # nobody holds it yet
    assert value(m, "llm_d_epp_encoder_cache_queries_total", **ident, modality="image") == 1
    assert value(m, "llm_d_epp_encoder_cache_hit_ratio_count", **ident) == 3  # 3 candidates
    assert value(m, "llm_d_epp_encoder_cache_hit_ratio_sum", **ident) == 0
    producer = parts.built.plugins["mm-embeddings-cache-producer"]
    assert isinstance(producer, MMEmbeddingsCacheProducer)
    (holder,) = producer.caches
    await serve(parts.director, chat(cat))  # now one endpoint holds it
    assert value(m, "llm_d_epp_encoder_cache_queries_total", **ident, modality="image") == 2
    assert value(m, "llm_d_epp_encoder_cache_hits_total", **ident, modality="image",
                 pod=producer.pod_ids[holder]) == 1
    assert producer.pod_ids[holder] in {f"ns/{e.name}" for e in PODS}
    assert value(m, "llm_d_epp_encoder_cache_hit_ratio_count", **ident) == 6
    assert value(m, "llm_d_epp_encoder_cache_hit_ratio_sum", **ident) == 1.0
    await serve(parts.director, chat("text only"))  # no media: nothing looked up
    assert value(m, "llm_d_epp_encoder_cache_hit_ratio_count", **ident) == 6


# ------------------------------------------------------------------ rollout screener


def rollout_screener(m: EppMetrics) -> DisaggregatedSetRolloutScreener:
    s = load_and_build(None, orjson.dumps({"plugins": [{
        "type": "disaggregatedset-rollout-screener", "name": "rollout",
        "parameters": params()}]}).decode()).plugins["rollout"]
    assert isinstance(s, DisaggregatedSetRolloutScreener)
    m.bind_plugins([s])
    return s


def test_revision_gating_shares_follow_the_pods() -> None:
    """Every observed revision's share (an incomplete one at 0); a revision no longer
    observed loses its series."""
    m = EppMetrics(Datastore())
    s = rollout_screener(m)
    lab = {"plugin_type": "disaggregatedset-rollout-screener", "plugin_name": "rollout",
           "mode": "max-role"}
    seed(s, {"v1": {"prefill": 1, "decode": 3}, "v2": {"prefill": 1, "decode": 1}})
    assert value(m, "llm_d_epp_disaggregatedset_revision_gating_share", **lab,
                 revision="v1") == 0.75
    assert value(m, "llm_d_epp_disaggregatedset_revision_gating_share", **lab,
                 revision="v2") == 0.25
    s.pod_extractor.extract_notification(fw.EVENT_DELETE, pod("v2-prefill-0", "v2", "prefill"))
    assert value(m, "llm_d_epp_disaggregatedset_revision_gating_share", **lab,
                 revision="v2") == 0  # decode only: incomplete
    assert value(m, "llm_d_epp_disaggregatedset_revision_gating_share", **lab,
                 revision="v1") == 1
    s.pod_extractor.extract_notification(fw.EVENT_DELETE, pod("v2-decode-0", "v2", "decode"))
    assert value(m, "llm_d_epp_disaggregatedset_revision_gating_share", **lab,
                 revision="v2") is None


def test_a_strict_header_matching_nothing_is_counted() -> None:
    m = EppMetrics(Datastore())
    s = rollout_screener(m)
    seed(s, {"v1": {"prefill": 1, "decode": 1}})
    eps = [Endpoint(name="p", address="10.0.0.9", port=8000, labels={
        "disaggregatedset.x-k8s.io/revision": "v1", "disaggregatedset.x-k8s.io/role": "decode"})]
    lab = {"plugin_type": "disaggregatedset-rollout-screener", "plugin_name": "rollout",
           "selector": "revision"}
    assert s.screen(req(**{"x-disagg-revision": "v1"}), eps) == eps
    assert value(m, "llm_d_epp_disaggregatedset_strict_header_no_match_total", **lab) is None
    assert s.screen(req(**{"x-disagg-revision": "v9"}), eps) == []
    assert value(m, "llm_d_epp_disaggregatedset_strict_header_no_match_total", **lab) == 1
    s.screen(req(**{"x-disagg-revision": "v9"}), [])  # no candidates: nothing selected
    assert value(m, "llm_d_epp_disaggregatedset_strict_header_no_match_total", **lab) == 1


# ------------------------------------------------------------------ in-flight load


async def test_inflight_requests_and_tokens_rise_while_a_request_runs() -> None:
    parts = server("- type: inflight-load-producer")
    m, d = parts.metrics, parts.director
    body = chat("x" * 400)
    headers = {**H, "x-gateway-inference-fairness-id": "tenant-a"}
    r = await d.route(headers, body, True, None)
    ep = next(e for e in PODS if e.key == r.destination)
    lab = {"endpoint_name": ep.name, "namespace": "ns", "producer_name":
           "inflight-load-producer", "fairness_id": "tenant-a", "priority": "0"}
    tokens = estimate_tokens(r.context.request)
    assert value(m, "llm_d_epp_inflight_requests", **lab) == 1
    assert value(m, "llm_d_epp_inflight_tokens", **lab) == tokens > 0
    d.on_response_headers(r.context, 200, {})
    d.on_done(r.context, aborted=True)
    assert value(m, "llm_d_epp_inflight_requests", **lab) == 0
    assert value(m, "llm_d_epp_inflight_tokens", **lab) == 0


def test_an_expired_inflight_entry_is_released_from_the_gauges() -> None:
    now = [0.0]
    p = InFlightLoadProducer("ifl", request_timeout=1.0, clock=lambda: now[0])
    m = EppMetrics(Datastore())
    m.bind_plugins([p])
    r = LLMRequest("r", "m", "m", ApiType.COMPLETIONS, "hello", {})
    p.pre_request(r, SchedulingResult({"decode": ProfileRunResult((PODS[0],)),
                                       "prefill": ProfileRunResult((PODS[1],))}, "decode"))
    lab = {"namespace": "ns", "producer_name": "ifl", "fairness_id": keys.DEFAULT_FAIRNESS_ID,
           "priority": "0"}
    for e in PODS[:2]:  # the first endpoint of every profile, as llm-d
        assert value(m, "llm_d_epp_inflight_requests", endpoint_name=e.name, **lab) == 1
    now[0] = 5.0
    p.tracker.expire()
    for e in PODS[:2]:
        assert value(m, "llm_d_epp_inflight_requests", endpoint_name=e.name, **lab) == 0
        assert value(m, "llm_d_epp_inflight_tokens", endpoint_name=e.name, **lab) == 0
    p.response_complete(r, PODS[0].key, aborted=False)  # released once only
    assert value(m, "llm_d_epp_inflight_requests", endpoint_name="pod-1", **lab) == 0


# ------------------------------------------------------------------ data layer


@dataclass
class Exporter:
    port: int
    status: int = 200
    body: str = ""


@pytest.fixture
async def exporter() -> AsyncIterator[Exporter]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    ex = Exporter(sock.getsockname()[1])

    async def handler(_: web.Request) -> web.Response:
        return web.Response(text=ex.body, status=ex.status, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    try:
        yield ex
    finally:
        await runner.cleanup()


async def test_polling_source_counts_poll_and_extract_errors(exporter: Exporter) -> None:
    m = EppMetrics(Datastore())
    src, ext = DCGMDataSource("dcgm", port=exporter.port), DCGMExtractor()
    runner = PollingRunner(Datastore(), [(src, [ext])], 60.0, metrics=m)
    runner.start()  # (no endpoints in its store: no polls of its own)
    ep = Endpoint(name="pod-1", address="127.0.0.1", port=8000)
    try:
        exporter.status = 500
        await runner.poll(src, [ext], ep)
        assert value(m, "llm_d_epp_datalayer_poll_errors_total",
                     source_type="dcgm-data-source") == 1
        exporter.status, exporter.body = 200, "other_metric 1\n"  # nothing for the pod
        await runner.poll(src, [ext], ep)
        assert value(m, "llm_d_epp_datalayer_extract_errors_total",
                     source_type="dcgm-data-source", extractor_type="dcgm-extractor") == 1
        assert value(m, "llm_d_epp_datalayer_poll_errors_total",
                     source_type="dcgm-data-source") == 1
    finally:
        await runner.stop()


async def test_metrics_scraper_counts_poll_and_extract_errors(exporter: Exporter) -> None:
    """A poll that yields nothing (an error status) is a poll error; a body without the
    required signals (none, or some) an extract error, as llm-d's core-metrics-extractor
    fails on a missing metric."""
    m = EppMetrics(Datastore())
    store = Datastore()
    store.set_endpoints([Endpoint(name="pod-1", address="127.0.0.1", port=exporter.port)])
    exporter.status = 500
    scraper = MetricsScraper(store, ScrapeOptions(interval_s=0.01, timeout_s=0.5,
                                                  max_loop_lag_s=None), metrics=m, seed=1)
    poll = {"source_type": "metrics-data-source"}
    extract = {**poll, "extractor_type": "core-metrics-extractor"}
    scraper.start()
    try:
        await eventually(lambda: (value(m, "llm_d_epp_datalayer_poll_errors_total", **poll)
                                  or 0) >= 1, what="a poll error")
        assert value(m, "llm_d_epp_datalayer_extract_errors_total", **extract) is None
        exporter.status, exporter.body = 200, "unrelated 1\n"
        await eventually(lambda: (value(m, "llm_d_epp_datalayer_extract_errors_total",
                                        **extract) or 0) >= 1, what="an extract error")
        exporter.body = "vllm:num_requests_waiting 3\n"  # running and KV use missing
        seen = value(m, "llm_d_epp_datalayer_extract_errors_total", **extract) or 0
        await eventually(lambda: scraper.scrapes_ok >= 1, what="a partial scrape")
        await eventually(lambda: (value(m, "llm_d_epp_datalayer_extract_errors_total",
                                        **extract) or 0) > seen, what="another one")
        exporter.body = ("vllm:num_requests_waiting 3\nvllm:num_requests_running 1\n"
                         "vllm:kv_cache_usage_perc 0.5\n")
        ok = scraper.scrapes_ok
        await eventually(lambda: scraper.scrapes_ok > ok + 1, what="complete scrapes")
        settled = value(m, "llm_d_epp_datalayer_extract_errors_total", **extract)
        ok = scraper.scrapes_ok
        await eventually(lambda: scraper.scrapes_ok > ok + 1, what="more complete scrapes")
        assert value(m, "llm_d_epp_datalayer_extract_errors_total", **extract) == settled
    finally:
        await scraper.stop()


# ------------------------------------------------------------------ saturation detector


def test_stale_endpoints_of_each_saturation_evaluation() -> None:
    parts = server()
    m = parts.metrics
    detector = parts.built.saturation_detector
    assert isinstance(detector, UtilizationDetector)
    lab = {"detector": detector.name}
    eps = parts.store.snapshot()
    detector.saturation(eps)  # never scraped: all stale (fail-closed)
    assert value(m, "llm_d_epp_flow_control_stale_endpoints", **lab) == 3
    parts.store.update_metrics(PODS[0].key, Metrics(updated_at=time.monotonic()))
    detector.saturation(parts.store.snapshot())
    assert value(m, "llm_d_epp_flow_control_stale_endpoints", **lab) == 2
    detector.saturation([])  # no candidates: none stale
    assert value(m, "llm_d_epp_flow_control_stale_endpoints", **lab) == 0


# ------------------------------------------------------------------ response path


async def test_inter_token_latency_per_streamed_chunk() -> None:
    """Gaps between consecutive non-empty chunks of a streamed response, with the request
    labels; an empty end-of-stream chunk and responses not streamed record none."""
    parts = server()
    m, d = parts.metrics, parts.director
    lab = {"model_name": "llama", "target_model_name": "llama", "fairness_id": "tenant-a",
           "priority": "0"}
    headers = {**H, "x-gateway-inference-fairness-id": "tenant-a"}
    chunks = (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
              b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n', b"data: [DONE]\n\n", b"")
    await serve(d, chat(stream=True), headers, chunks, sse=True)
    assert value(m, "llm_d_epp_request_streaming_itl_seconds_count", **lab) == 2
    await serve(d, chat(), headers)
    assert value(m, "llm_d_epp_request_streaming_itl_seconds_count", **lab) == 2
    # stream=true in the request: streamed even without an SSE content type (llm-d).
    await serve(d, chat(stream=True), headers, chunks[:2], sse=False)
    assert value(m, "llm_d_epp_request_streaming_itl_seconds_count", **lab) == 3


async def test_request_and_response_processing_time() -> None:
    """Request processing: once per request that reached the Director, failures included.
    Response processing: once per request that reached the response phase."""
    parts = server()
    m, d = parts.metrics, parts.director
    req_count = "llm_d_epp_request_processing_duration_seconds_count"
    resp_count = "llm_d_epp_response_processing_duration_seconds_count"
    assert value(m, req_count) == 0 and value(m, resp_count) == 0
    await serve(d, chat())
    assert value(m, req_count) == 1 and value(m, resp_count) == 1
    await serve(d, chat(stream=True), chunks=(b"data: {}\n\n", b"data: [DONE]\n\n"), sse=True)
    assert value(m, req_count) == 2 and value(m, resp_count) == 2
    with pytest.raises(BadRequest):
        await d.route(H, b"{not json", True, None)
    assert value(m, req_count) == 3 and value(m, resp_count) == 2
    r = await d.route(H, chat(), True, None)  # the stream ends before any response
    d.on_done(r.context, aborted=True)
    assert value(m, req_count) == 4 and value(m, resp_count) == 2
    assert (value(m, "llm_d_epp_request_processing_duration_seconds_sum") or 0) > 0


def test_a_front_without_a_core_records_no_response_series() -> None:
    """A --workers front's Director reaches the core over IPC: it has no metrics."""

    class Remote:
        async def decide(self, request: Any, subset: Any) -> Any:
            raise AssertionError("not called")

        def complete(self, *args: Any) -> None: ...

        def reject(self, *args: Any) -> None: ...

        def upstream_failed(self, address: str) -> None: ...

    assert Director(Remote()).metrics is None
