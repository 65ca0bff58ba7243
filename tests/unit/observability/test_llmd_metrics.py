"""llm-d-router v0.10.0's ``llm_d_epp_*`` metrics (issue 18): every name with Go's type,
label names, buckets and help text on the registry `epp serve` builds, and representative
series moving when requests are served through the wired Director.

``LLMD_METRICS`` below is copied by hand from llm-d-router v0.10.0 (tag ``v0.10.0``, commit
71f4f0999f95b96c49a9d0c4afbd18dfdb943c26): every metric whose Go definition uses the
``LLMDRouterEndpointPickerSubsystem`` (``llm_d_epp``) subsystem, plus the per-endpoint
queue descriptor, from the files named in its last column (copied unchanged under
tests/fixtures/llm-d-router-v0.10.0/). ``test_table_is_llm_d_router_v0_10_0`` re-reads those
files and fails when the table drifts from them. The ``llm_d_router_epp_kv_cache_*``
series of the embedded kv-cache index (another subsystem) are not part of it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epp.config.loader import DEFAULT_CONFIG_TEXT, load_and_build
from epp.datastore.objectives import ModelRewrite, RewriteRule, TargetModel
from epp.datastore.store import Datastore
from epp.flowcontrol.llmd import ProgramAwareFairness
from epp.latency.types import TrainingEntry
from epp.observability.metrics import (
    DECISION_DECODE_ONLY,
    DECISION_PREFILL_DECODE,
    REVOCATION_CONFIRMED,
    EppMetrics,
    LabelBounds,
)
from epp.requestcontrol.director import Director, SchedulingCore
from epp.scheduling.plugins.latency_producer import PredictedLatencyProducer
from epp.scheduling.plugins.reporter import response_metadata
from epp.scheduling.types import ApiType, Endpoint, LLMRequest, Metrics
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, ServerParts, wire

ROOT = Path(__file__).resolve().parents[3]
LLMD = ROOT / "tests" / "fixtures" / "llm-d-router-v0.10.0"

# --- Buckets, as llm-d-router v0.10.0 defines them ---
# generalLatencyBuckets (pkg/epp/metrics/metrics.go; the same values in predictedlatency)
GENERAL = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10,
           15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
REQ_SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144,
             524288, 1048576, 2097152, 4194304, 8388608, 16777216, 33554432, 67108864,
             134217728, 268435456, 536870912, 1073741824)
RESP_SIZES = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536)
TOKENS_IN = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536,
             131072, 262144, 524288, 1048576)
TOKENS_OUT = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
NTPOT = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
TTFT = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15,
        20, 30, 45, 60, 120)
STREAM_TPOT = (0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.6, 0.8, 1, 2)
ITL = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2)
SCHED = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
REQ_PROC = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.04, 0.06, 0.1, 0.25, 0.5, 1, 2.5,
            5, 10)
RESP_PROC = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
             1, 2.5, 5)
FC_QUEUE = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            10.0, 30.0, 60.0)
REVOCATION = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
RATIO = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
HIT_BYTES = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
TPOT = (0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4,
        0.5, 0.6, 0.8, 1, 1.5, 2, 3, 4.5, 6, 12, 18, 24, 30, 36, 48, 60, 90, 120, 180, 270,
        360)
PREDICTION = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
              5.0)
EXTPROC = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600)

REQ = ("model_name", "target_model_name", "fairness_id", "priority")
PLUGIN_MODEL = ("plugin_name", "plugin_type", "model_name", "target_model_name")
FLOW = ("fairness_id", "priority", "inference_pool", "model_name", "target_model_name")

# Go source files (under pkg/epp/), relative to the fixture root.
M = "pkg/epp/metrics/llm_d_router_metrics.go"
G = "pkg/epp/metrics/grpc_stream_metrics.go"
P = "pkg/epp/framework/plugins/"
PA = P + "flowcontrol/fairness/program-aware/prometheus.go"
LAS = P + "flowcontrol/fairness/program-aware/strategy_las.go"
AP = P + "requestcontrol/dataproducer/approximateprefix/metrics.go"
IF = P + "requestcontrol/dataproducer/inflightload/metrics.go"
MM = P + "requestcontrol/dataproducer/multimodal/metrics.go"
PL = P + "requestcontrol/dataproducer/predictedlatency/metrics.go"
DS = P + "requestcontrol/screener/disaggregatedsetrollout/metrics.go"
DG = P + "scheduling/profilehandler/disagg/metrics.go"
SOURCES = (M, G, PA, LAS, AP, IF, MM, PL, DS, DG)

# name (as exposed; counters with _total): (type, label names in Go's order, buckets, file)
LLMD_METRICS: dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None, str]] = {
    # request and latency (llm_d_router_metrics.go)
    "llm_d_epp_request_total": ("counter", REQ, None, M),
    "llm_d_epp_request_error_total": ("counter", (*REQ, "error_code"), None, M),
    "llm_d_epp_request_duration_seconds": ("histogram", REQ, GENERAL, M),
    "llm_d_epp_request_size_bytes": ("histogram", REQ, REQ_SIZES, M),
    "llm_d_epp_response_size_bytes": ("histogram", REQ, RESP_SIZES, M),
    "llm_d_epp_request_input_tokens": ("histogram", REQ, TOKENS_IN, M),
    "llm_d_epp_request_output_tokens": ("histogram", REQ, TOKENS_OUT, M),
    "llm_d_epp_request_cached_tokens": ("histogram", REQ, TOKENS_IN, M),
    "llm_d_epp_request_running": ("gauge", REQ, None, M),
    "llm_d_epp_request_ntpot_seconds": ("histogram", REQ, NTPOT, M),
    "llm_d_epp_request_ttft_seconds": ("histogram", (*REQ, "streaming"), TTFT, M),
    "llm_d_epp_request_streaming_tpot_seconds": ("histogram", REQ, STREAM_TPOT, M),
    "llm_d_epp_request_streaming_itl_seconds": ("histogram", REQ, ITL, M),
    # inference pool
    "llm_d_epp_average_kv_cache_utilization": ("gauge", ("name",), None, M),
    "llm_d_epp_average_queue_size": ("gauge", ("name",), None, M),
    "llm_d_epp_average_running_requests": ("gauge", ("name",), None, M),
    "llm_d_epp_std_dev_kv_cache_utilization": ("gauge", ("name",), None, M),
    "llm_d_epp_std_dev_queue_size": ("gauge", ("name",), None, M),
    "llm_d_epp_std_dev_running_requests": ("gauge", ("name",), None, M),
    "llm_d_epp_ready_endpoints": ("gauge", ("name",), None, M),
    "llm_d_epp_per_endpoint_queue_size": ("gauge", ("name", "model_server_endpoint"), None, M),
    # scheduler, EPP overhead, plugins, info, model rewrite, data layer
    "llm_d_epp_scheduler_e2e_duration_seconds": ("histogram", (), SCHED, M),
    "llm_d_epp_scheduler_attempts_total": (
        "counter", ("status", "target_model_name", "endpoint_name", "namespace", "port"), None,
        M),
    "llm_d_epp_plugin_duration_seconds": (
        "histogram", ("extension_point", "plugin_type", "plugin_name"), SCHED, M),
    "llm_d_epp_request_processing_duration_seconds": ("histogram", (), REQ_PROC, M),
    "llm_d_epp_response_processing_duration_seconds": ("histogram", (), RESP_PROC, M),
    "llm_d_epp_info": ("gauge", ("commit", "build_ref"), None, M),
    "llm_d_epp_model_rewrite_decisions_total": (
        "counter", ("model_rewrite_name", "model_name", "target_model"), None, M),
    "llm_d_epp_datalayer_poll_errors_total": ("counter", ("source_type",), None, M),
    "llm_d_epp_datalayer_extract_errors_total": (
        "counter", ("source_type", "extractor_type"), None, M),
    # flow control
    "llm_d_epp_flow_control_request_queue_duration_seconds": (
        "histogram", ("fairness_id", "priority", "outcome", "inference_pool", "model_name",
                      "target_model_name"), FC_QUEUE, M),
    "llm_d_epp_flow_control_dispatch_cycle_duration_seconds": ("histogram", (), SCHED, M),
    "llm_d_epp_flow_control_request_enqueue_duration_seconds": (
        "histogram", ("fairness_id", "priority", "outcome"), SCHED, M),
    "llm_d_epp_flow_control_queue_size": ("gauge", FLOW, None, M),
    "llm_d_epp_flow_control_queue_bytes": ("gauge", FLOW, None, M),
    "llm_d_epp_flow_control_pool_saturation": ("gauge", ("inference_pool",), None, M),
    "llm_d_epp_flow_control_stale_endpoints": ("gauge", ("detector",), None, M),
    "llm_d_epp_flow_control_requests_total": (
        "counter", ("outcome", "priority", "inference_pool"), None, M),
    "llm_d_epp_flow_control_revocations_issued_total": (
        "counter", ("priority", "inference_pool"), None, M),
    "llm_d_epp_flow_control_revocations_total": (
        "counter", ("outcome", "inference_pool"), None, M),
    "llm_d_epp_flow_control_reclaim_target": ("gauge", ("inference_pool",), None, M),
    "llm_d_epp_flow_control_pending_reclaim": ("gauge", ("inference_pool",), None, M),
    "llm_d_epp_flow_control_revocation_confirmation_seconds": (
        "histogram", ("inference_pool",), REVOCATION, M),
    # ext_proc streams (grpc_stream_metrics.go; llm-d: --enable-grpc-stream-metrics)
    "llm_d_epp_extproc_streams_inflight": ("gauge", (), None, G),
    "llm_d_epp_extproc_stream_duration_seconds": ("histogram", (), EXTPROC, G),
    "llm_d_epp_extproc_streams_total": ("counter", ("code",), None, G),
    # program-aware fairness
    "llm_d_epp_program_aware_jains_fairness_index": ("gauge", (), None, PA),
    "llm_d_epp_program_aware_avg_wait_time_milliseconds": ("gauge", ("program_id",), None, PA),
    "llm_d_epp_program_aware_attained_service_tokens": ("gauge", ("program_id",), None, LAS),
    # approximate prefix indexer
    "llm_d_epp_prefix_indexer_size": ("gauge", ("plugin_name", "plugin_type"), None, AP),
    "llm_d_epp_prefix_indexer_hit_ratio": (
        "histogram", ("plugin_name", "plugin_type"), RATIO, AP),
    "llm_d_epp_prefix_indexer_hit_bytes": (
        "histogram", ("plugin_name", "plugin_type"), HIT_BYTES, AP),
    # in-flight load producer
    "llm_d_epp_inflight_requests": (
        "gauge", ("endpoint_name", "namespace", "producer_name", "fairness_id", "priority"),
        None, IF),
    "llm_d_epp_inflight_tokens": (
        "gauge", ("endpoint_name", "namespace", "producer_name", "fairness_id", "priority"),
        None, IF),
    # multimodal encoder cache
    "llm_d_epp_encoder_cache_queries_total": (
        "counter", ("plugin_type", "plugin_name", "modality"), None, MM),
    "llm_d_epp_encoder_cache_hits_total": (
        "counter", ("plugin_type", "plugin_name", "pod", "modality"), None, MM),
    "llm_d_epp_encoder_cache_hit_ratio": ("histogram", ("plugin_type", "plugin_name"), RATIO,
                                          MM),
    # predicted latency
    "llm_d_epp_inference_request_metric": ("gauge", (*PLUGIN_MODEL, "type"), None, PL),
    "llm_d_epp_request_predicted_ttft_seconds": ("histogram", PLUGIN_MODEL, GENERAL, PL),
    "llm_d_epp_request_ttft_prediction_duration_seconds": (
        "histogram", PLUGIN_MODEL, PREDICTION, PL),
    "llm_d_epp_request_predicted_tpot_seconds": ("histogram", PLUGIN_MODEL, TPOT, PL),
    "llm_d_epp_request_tpot_prediction_duration_seconds": (
        "histogram", PLUGIN_MODEL, PREDICTION, PL),
    "llm_d_epp_request_slo_violation_total": ("counter", (*PLUGIN_MODEL, "type"), None, PL),
    # disaggregatedset rollout screener
    "llm_d_epp_disaggregatedset_strict_header_no_match_total": (
        "counter", ("plugin_type", "plugin_name", "selector"), None, DS),
    "llm_d_epp_disaggregatedset_revision_gating_share": (
        "gauge", ("plugin_type", "plugin_name", "mode", "revision"), None, DS),
    # disaggregation decisions
    "llm_d_epp_pd_decision_total": (
        "counter", ("plugin_name", "plugin_type", "model_name", "decision_type"), None, DG),
    "llm_d_epp_disagg_decision_total": (
        "counter", ("plugin_name", "plugin_type", "model_name", "decision_type"), None, DG),
}

# Registered only in some setups, as in llm-d: the flowControl gate (the six GIE twins and
# requests_total, which reads the queue-duration counts), a program-aware-fairness plugin,
# and llm-d's --enable-grpc-stream-metrics (EppMetrics.grpc_stream_metrics()).
FLOW_CONTROL_ONLY = {
    "llm_d_epp_flow_control_request_queue_duration_seconds",
    "llm_d_epp_flow_control_dispatch_cycle_duration_seconds",
    "llm_d_epp_flow_control_request_enqueue_duration_seconds",
    "llm_d_epp_flow_control_queue_size", "llm_d_epp_flow_control_queue_bytes",
    "llm_d_epp_flow_control_pool_saturation", "llm_d_epp_flow_control_requests_total"}
PROGRAM_AWARE_ONLY = {n for n in LLMD_METRICS if "program_aware" in n}
GRPC_STREAMS_ONLY = {n for n in LLMD_METRICS if "extproc" in n}


# ------------------------------------------------------------------ the Go sources

# Label lists and buckets the Go files use by name but define in pkg/epp/metrics/metrics.go
# (not copied): modelLabels, poolLabels, generalLatencyBuckets.
_GO_NAMES: dict[str, tuple[str, ...]] = {"modelLabels": ("model_name", "target_model_name"),
                                         "poolLabels": ("name",)}
_GO_BUCKETS: dict[str, tuple[float, ...]] = {"generalLatencyBuckets": GENERAL}
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _strings(expr: str, env: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """A Go []string expression's values: its literals and the named lists it appends."""
    out: list[str] = []
    for m in re.finditer(r'"([^"]*)"|\b([A-Za-z_]\w*)\b', expr):
        if m.group(1) is not None:
            out.append(m.group(1))
        elif m.group(2) in env:
            out.extend(env[m.group(2)])
    return tuple(out)


def _floats(text: str) -> tuple[float, ...]:
    text = re.sub(r"//[^\n]*", "", text)
    return tuple(float(x) for x in re.findall(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", text))


def go_metrics() -> dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None, str, str]]:
    """Every llm_d_epp metric of the copied Go files: type, labels, buckets, help, file."""
    names = dict(_GO_NAMES)
    buckets = dict(_GO_BUCKETS)
    texts = {f: (LLMD / f).read_text() for f in SOURCES}
    for text in texts.values():  # package-level label lists and bucket lists
        for m in re.finditer(r"^\s*(\w+)\s*=\s*(\[\]string\{[^}]*\}|append\([^\n]*\))\s*$",
                             text, re.MULTILINE):
            names[m.group(1)] = _strings(m.group(2), names)
        for m in re.finditer(r"^\s*(\w+)\s*=\s*\[\]float64\{(.*?)\}", text,
                             re.MULTILINE | re.DOTALL):
            buckets[m.group(1)] = _floats(m.group(2))
    out: dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None, str, str]] = {}
    ctor = re.compile(r"prometheus\.New(Counter|Gauge|Histogram)(Vec)?\(")
    for f, text in texts.items():
        starts = list(ctor.finditer(text))
        for i, c in enumerate(starts):
            block = text[c.start():starts[i + 1].start() if i + 1 < len(starts) else len(text)]
            opts = re.search(r'Subsystem:\s*[\w.]*LLMDRouterEndpointPickerSubsystem,\s*'
                             r'Name:\s*(metricsPrefix \+ )?"(\w+)"', block)
            if opts is None:
                continue
            name = ("llm_d_epp_" + ("disaggregatedset" if opts.group(1) else "")
                    + opts.group(2))
            kind = c.group(1).lower()
            help_part = block[block.index("Help:"):block.index("compbasemetrics.ALPHA")]
            help_text = "".join(_STRING.findall(help_part))
            b = re.search(r"Buckets:\s*(?:\[\]float64\{(.*?)\}|(\w+))", block, re.DOTALL)
            bucket_values = None
            if b is not None:
                bucket_values = _floats(b.group(1)) if b.group(1) is not None \
                    else buckets[b.group(2)]
            labels: tuple[str, ...] = ()
            if c.group(2):  # a …Vec: the label list follows the options
                rest = re.sub(r"Buckets:\s*\[\]float64\{.*?\}", "", block, flags=re.DOTALL)
                lm = re.search(r"\},\s*\n\s*([^\n]+?),\s*\n\s*\)", rest)
                assert lm is not None, name
                labels = _strings(lm.group(1), names)
            if kind == "counter":
                name += "" if name.endswith("_total") else "_total"
            out[name] = (kind, labels, bucket_values, help_text, f)
        for d in re.finditer(r'prometheus\.NewDesc\(\s*"(llm_d_epp_\w+)",\s*'
                             r'metricsutil\.HelpMsgWithStability\("([^"]*)".*?'
                             r'\[\]string\{(.*?)\}', text, re.DOTALL):
            out[d.group(1)] = ("gauge", _strings(d.group(3), {}), None, d.group(2), f)
    return out


def test_table_is_llm_d_router_v0_10_0() -> None:
    """The table above is what llm-d-router v0.10.0's Go files define: 67 names."""
    go = go_metrics()
    assert set(go) == set(LLMD_METRICS)
    assert len(go) == 67
    for name, (kind, labels, buckets, _help, f) in go.items():
        assert LLMD_METRICS[name] == (kind, labels, buckets, f), name


# ------------------------------------------------------------------ the registry

OPTIONS = StaticSourceOptions(endpoints="10.0.0.1:8000,10.0.0.2:8000")
H = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r1"}
# The default config with the latency predictor, flow control (program-aware fairness as
# its fairness policy, saturation from in-flight counts: nothing is scraped here).
FULL_CONFIG = DEFAULT_CONFIG_TEXT.replace(
    "plugins:\n", "featureGates: [flowControl]\nplugins:\n"
    "- type: concurrency-detector\n- type: program-aware-fairness\n"
    "- type: predicted-latency-producer\n  parameters: {streamingMode: true}\n", 1) + (
    "saturationDetector: {pluginRef: concurrency-detector}\n"
    "flowControl:\n  defaultPriorityBand:\n    fairnessPolicyRef: program-aware-fairness\n")


def _server(config: str | None = None) -> ServerParts:
    timings = PluginTimings()
    built = load_and_build(None, config, timer=timings)
    parts = wire(validate(ServeOptions(static=OPTIONS)), built, timings, None)
    producer = built.plugins.get("predicted-latency-producer")
    if isinstance(producer, PredictedLatencyProducer):
        # Past the in-process predictor's cold start, so requests get predictions.
        producer.predictor.add_training_data_bulk(
            [TrainingEntry(0.1, 10 + i, 0, 1, 0, 20.0 + i, 0.0, 0.0) for i in range(40)]
            + [TrainingEntry(0.1, 10 + i, 0, 1, 0, 0.0, 2.0 + i / 10, 0.0)
               for i in range(40)])
    return parts


def scrape(metrics: EppMetrics) -> dict[str, Any]:
    """Families by exposed name (counters with ``_total``), ``*_created`` left out."""
    out = {}
    for f in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        if not f.name.endswith("_created"):
            out[f.name + ("_total" if f.type == "counter" else "")] = f
    return out


def value(metrics: EppMetrics, metric: str, /, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(metric, labels)


def _chat(content: str = "hi", model: str = "llama", **extra: Any) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                         **extra})


def _sse(*events: dict[str, Any]) -> list[bytes]:
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


async def _serve(d: Director, headers: Mapping[str, str], body: bytes, status: int = 200,
                 stream: bool = False, parts: ServerParts | None = None) -> None:
    """One request through the Director and its response (JSON or SSE with usage); with
    ``parts``, the end of the response as the ext_proc handler has it: the config's
    ResponseUsageMetadata plugins then see the usage (program-aware fairness's service)."""
    r = await d.route(headers, body, True, None)
    if stream:
        d.on_response_headers(r.context, status, {"content-type": "text/event-stream"})
        chunks = _sse({"choices": [{"delta": {"content": "a"}}]},
                      {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
        for c in chunks[:-1]:
            d.on_response_body(r.context, c, False)
        d.on_response_body(r.context, chunks[-1], True)
    else:
        d.on_response_headers(r.context, status, {"content-type": "application/json"})
        body_out = (orjson.dumps({"usage": {"prompt_tokens": 9, "completion_tokens": 4,
                                            "prompt_tokens_details": {"cached_tokens": 2}}})
                    if status == 200 else b'{"error":"busy"}')
        d.on_response_body(r.context, body_out, True)
    d.on_done(r.context, aborted=False)
    if parts is not None:
        hook = response_metadata(parts.built.response_usage_metadata)
        if hook is not None:
            hook(r.context)


async def test_registry_has_llm_d_names_types_labels_buckets_and_help() -> None:
    """Every one of the 67, once recorded, with Go's type, help, label names and buckets."""
    parts = _server(FULL_CONFIG)
    m = parts.metrics
    assert parts.flow_control is not None
    await parts.flow_control.start()
    # An InferenceModelRewrite rule picks the target model: a rewrite decision.
    parts.objectives.set_rewrite(ModelRewrite("canary", (RewriteRule(
        ("llama-canary",), (TargetModel("llama"),)),)))
    try:
        await _serve(parts.director, {**H, "x-gateway-inference-fairness-id": "tenant-a"},
                     _chat(model="llama-canary"), parts=parts)
        # SLOs sure to be missed (the latency predictor's violation series).
        await _serve(parts.director, {**H, "x-slo-ttft-ms": "0.000001",
                                      "x-slo-tpot-ms": "0.000001"},
                     _chat(stream=True), stream=True)
        await _serve(parts.director, H, _chat(), status=503)
    finally:
        await parts.flow_control.stop()
    # What no request here records (plugins this config lacks, hooks not wired yet): their
    # recording functions, so that every series has a sample to check.
    producer = parts.built.plugins["approx-prefix-cache-producer"]
    m.record_inter_token_latency(_request(), 0.01)
    m.record_request_processing(0.002)
    m.record_response_processing(0.001)
    m.record_datalayer_poll_error("metrics-data-source")
    m.record_datalayer_extract_error("metrics-data-source", "core-metrics-extractor")
    m.record_stale_endpoints("utilization-detector", 1)
    m.record_revocations_issued(-1, 2)
    m.record_revocation_outcome(REVOCATION_CONFIRMED, confirmed_after_s=0.02)
    m.record_reclaim(target=0.5, pending=0.25)
    m.record_encoder_cache_item(producer, "image", ["pod-a"])
    m.record_encoder_cache_hit_ratio(producer, 1, 2)
    m.record_strict_header_no_match(producer, "canary")
    m.record_revision_gating_shares(producer, "weighted", {"rev-1": 0.5})
    m.record_inflight(producer, "pod-a", "ns", "tenant-a", 0, 1, 10)
    m.llmd_prefix_hit_ratio.labels(*m.prefix_identity).observe(0.5)
    m.llmd_prefix_hit_bytes.labels(*m.prefix_identity).observe(64)
    m.llmd_pd_decisions.labels("pd", "pd-profile-handler", "llama", DECISION_DECODE_ONLY).inc()
    m.llmd_disagg_decisions.labels("d", "disagg-profile-handler", "llama",
                                   DECISION_DECODE_ONLY).inc()
    streams = m.grpc_stream_metrics()
    streams.started()
    streams.finished("OK", 1.5)
    go = go_metrics()
    fams = scrape(m)
    for name, (kind, labels, buckets, _f) in LLMD_METRICS.items():
        assert name in fams, name
        f = fams[name]
        assert f.type == kind, name
        assert f.documentation == f"[ALPHA] {go[name][3]}", name
        assert f.samples, f"{name}: no series"
        for s in f.samples:
            assert set(s.labels) - {"le"} == set(labels), (name, s.labels)
        if buckets is not None:
            les = sorted({float(s.labels["le"]) for s in f.samples if s.name.endswith("_bucket")})
            assert les == sorted([*map(float, buckets), math.inf]), name
    assert {n for n in fams if n.startswith("llm_d_epp_")} == set(LLMD_METRICS)


def _request() -> LLMRequest:
    return LLMRequest("r1", "llama", "llama", ApiType.CHAT_COMPLETIONS, "hi", {},
                      fairness_id="tenant-a")


async def test_registration_follows_llm_d() -> None:
    """Without the flowControl gate, a program-aware plugin or the gRPC stream switch,
    their series are not registered (llm-d registers them only then); all others are."""
    m = _server().metrics
    fams = {n for n in scrape(m) if n.startswith("llm_d_epp_")}
    assert fams == set(LLMD_METRICS) - FLOW_CONTROL_ONLY - PROGRAM_AWARE_ONLY - GRPC_STREAMS_ONLY


# ------------------------------------------------------------------ behaviour


async def test_request_series_move_with_fairness_and_priority() -> None:
    """A served request moves the llm-d request series with its fairness ID (default-flow
    without one) and priority; running goes back to 0; TTFT is labelled streaming."""
    parts = _server()
    m, d = parts.metrics, parts.director
    tenant = {**H, "x-gateway-inference-fairness-id": "tenant-a"}
    await _serve(d, tenant, _chat())
    await _serve(d, H, _chat(stream=True), stream=True)
    await _serve(d, H, _chat(), status=503)
    a = {"model_name": "llama", "target_model_name": "llama", "priority": "0"}
    assert value(m, "llm_d_epp_request_total", **a, fairness_id="tenant-a") == 1
    assert value(m, "llm_d_epp_request_total", **a, fairness_id="default-flow") == 2
    # The GIE twin counts the same requests.
    assert value(m, "inference_objective_request_total", **a) == 3
    assert value(m, "llm_d_epp_request_running", **a, fairness_id="tenant-a") == 0
    assert value(m, "llm_d_epp_request_input_tokens_sum", **a, fairness_id="tenant-a") == 9
    assert value(m, "llm_d_epp_request_output_tokens_sum", **a, fairness_id="tenant-a") == 4
    assert value(m, "llm_d_epp_request_cached_tokens_sum", **a, fairness_id="tenant-a") == 2
    assert value(m, "llm_d_epp_request_duration_seconds_count", **a,
                 fairness_id="tenant-a") == 1
    assert value(m, "llm_d_epp_request_error_total", **a, fairness_id="default-flow",
                 error_code="ModelServerError") == 1
    assert value(m, "llm_d_epp_request_ttft_seconds_count", **a, fairness_id="default-flow",
                 streaming="true") == 1
    # Not streamed: TTFT is the request's duration (any status: the 503 too).
    assert value(m, "llm_d_epp_request_ttft_seconds_count", **a, fairness_id="tenant-a",
                 streaming="false") == 1
    assert value(m, "llm_d_epp_request_ttft_seconds_count", **a, fairness_id="default-flow",
                 streaming="false") == 1
    assert value(m, "llm_d_epp_request_streaming_tpot_seconds_count", **a,
                 fairness_id="default-flow") == 1
    assert value(m, "llm_d_epp_response_size_bytes_count", **a,
                 fairness_id="default-flow") == 2
    assert value(m, "llm_d_epp_request_size_bytes_sum", **a, fairness_id="tenant-a") == \
        len(_chat())
    # Scheduler twins: the GIE series under llm-d's names (pod_name → endpoint_name).
    e2e = value(m, "llm_d_epp_scheduler_e2e_duration_seconds_count")
    assert e2e == value(m, "inference_extension_scheduler_e2e_duration_seconds_count") == 3
    attempts = [s for s in scrape(m)["llm_d_epp_scheduler_attempts_total"].samples
                if s.name.endswith("_total")]
    assert sum(s.value for s in attempts) == 3
    assert all(s.labels["endpoint_name"] and s.labels["status"] == "success" for s in attempts)
    assert value(m, "llm_d_epp_info", commit="", build_ref=_build_ref(m)) == 1


def _build_ref(m: EppMetrics) -> str:
    return str(next(s.labels["build_ref"]
                    for s in scrape(m)["inference_extension_info"].samples))


async def test_rejected_request_counts_an_llm_d_error() -> None:
    """A request the EPP answers itself (a body that does not parse) is an error on both
    series, with llm-d's default fairness ID and priority 0."""
    parts = _server()
    parts.director.on_rejected(H, 400)
    assert value(parts.metrics, "llm_d_epp_request_error_total", model_name="",
                 target_model_name="", fairness_id="default-flow", priority="0",
                 error_code="BadRequest") == 1


def test_pool_gauges_average_and_standard_deviation() -> None:
    """llm-d's pool gauges: averages and sample standard deviations, rounded to 2 places."""
    store = Datastore()
    store.set_endpoints([Endpoint("a", "10.0.0.1", 8000), Endpoint("b", "10.0.0.2", 8000),
                         Endpoint("c", "10.0.0.3", 8000)])
    for e, q in zip(store.snapshot(), (1, 2, 6), strict=True):
        store.update_metrics(e.key, Metrics(waiting_queue_size=q, running_requests=2,
                                            kv_cache_usage=0.5))
    m = EppMetrics(store, "pool-x")
    assert value(m, "llm_d_epp_average_queue_size", name="pool-x") == 3.0
    assert value(m, "llm_d_epp_std_dev_queue_size", name="pool-x") == round(math.sqrt(7), 2)
    assert value(m, "llm_d_epp_std_dev_running_requests", name="pool-x") == 0
    assert value(m, "llm_d_epp_average_kv_cache_utilization", name="pool-x") == 0.5
    assert value(m, "llm_d_epp_ready_endpoints", name="pool-x") == 3
    assert value(m, "llm_d_epp_per_endpoint_queue_size", name="pool-x",
                 model_server_endpoint="c") == 6


PD_CONFIG = """
plugins:
- type: pd-profile-handler
  parameters: {threshold: 0}
- type: decode-filter
- type: prefill-filter
- type: max-score-picker
schedulingProfiles:
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}]
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: max-score-picker}]
"""


def _pd_director(config_text: str | None, config_path: str | None = None
                 ) -> tuple[Director, EppMetrics]:
    store = Datastore()
    roles = ["decode", "prefill"]
    store.set_endpoints(Endpoint(f"p{i}", f"10.0.0.{i}", 8000, namespace="ns",
                                 labels={"llm-d.ai/role": roles[i % 2]}) for i in range(2))
    built = load_and_build(config_path, config_text)
    metrics = EppMetrics(store)
    metrics.bind_plugins(built.plugins.values())
    core = SchedulingCore(store, built.scheduler, metrics, built.pre_request,
                          built.response_complete, built.request_headers,
                          built.response_headers)
    return Director(core), metrics


async def test_pd_profile_handler_counts_pd_decisions() -> None:
    """pd-profile-handler (threshold 0: always disaggregate): llm-d's pd_decision_total
    with the handler's name and type and the target model, beside epp_pd_decisions_total."""
    d, m = _pd_director(PD_CONFIG)
    r = await d.route(H, _chat("hello"), True, None)
    d.on_done(r.context, aborted=True)
    assert value(m, "llm_d_epp_pd_decision_total", plugin_name="pd-profile-handler",
                 plugin_type="pd-profile-handler", model_name="llama",
                 decision_type=DECISION_PREFILL_DECODE) == 1
    assert value(m, "epp_pd_decisions_total", decision_type="disaggregated") == 1
    assert scrape(m)["llm_d_epp_disagg_decision_total"].samples == []


async def test_disagg_profile_handler_counts_disagg_decisions() -> None:
    """config/pd.yaml's disagg-profile-handler: a short prompt stays decode-only, a long
    new one is prefill-decode (disagg_decision_total)."""
    d, m = _pd_director(None, str(ROOT / "config" / "pd.yaml"))
    for content in ("hi", " ".join(f"word{i}" for i in range(2000))):
        r = await d.route(H, _chat(content), True, None)
        d.on_done(r.context, aborted=True)
    lab = {"plugin_name": "disagg-profile-handler", "plugin_type": "disagg-profile-handler",
           "model_name": "llama"}
    assert value(m, "llm_d_epp_disagg_decision_total", **lab,
                 decision_type=DECISION_DECODE_ONLY) == 1
    assert value(m, "llm_d_epp_disagg_decision_total", **lab,
                 decision_type=DECISION_PREFILL_DECODE) == 1
    assert scrape(m)["llm_d_epp_pd_decision_total"].samples == []


async def test_flow_control_and_program_aware_series_move() -> None:
    """Under the flowControl gate: the six twins equal their GIE series,
    flow_control_requests_total counts each request's outcome once, and
    program-aware-fairness's gauges read its state (wait, service, fairness index)."""
    parts = _server(FULL_CONFIG)
    m = parts.metrics
    assert parts.flow_control is not None
    await parts.flow_control.start()
    try:
        for fid in ("tenant-a", "tenant-b", "tenant-a"):
            await _serve(parts.director, {**H, "x-gateway-inference-fairness-id": fid},
                         _chat(), parts=parts)
    finally:
        await parts.flow_control.stop()
    assert value(m, "llm_d_epp_flow_control_requests_total", outcome="Dispatched",
                 priority="0", inference_pool="static") == 3
    for gie, llmd in (("inference_extension_flow_control_request_queue_duration_seconds_count",
                       "llm_d_epp_flow_control_request_queue_duration_seconds_count"),
                      ("inference_extension_flow_control_dispatch_cycle_duration_seconds_count",
                       "llm_d_epp_flow_control_dispatch_cycle_duration_seconds_count")):
        g = sum(s.value for f in scrape(m).values() for s in f.samples if s.name == gie)
        assert g > 0
        assert sum(s.value for f in scrape(m).values() for s in f.samples if s.name == llmd) == g
    plugin = parts.built.plugins["program-aware-fairness"]
    assert isinstance(plugin, ProgramAwareFairness)
    assert value(m, "llm_d_epp_program_aware_jains_fairness_index") == plugin.fairness_index
    for pid in ("tenant-a", "tenant-b"):
        assert value(m, "llm_d_epp_program_aware_avg_wait_time_milliseconds",
                     program_id=pid) == plugin.programs[pid].average_wait_ms
        # As of its last completed response (llm-d sets the gauge there; it decays after).
        assert value(m, "llm_d_epp_program_aware_attained_service_tokens",
                     program_id=pid) == plugin.programs[pid].reported_service
    # 9 prompt + 2 × 4 completion tokens for tenant-b's one response (llm-d's LAS weights).
    assert value(m, "llm_d_epp_program_aware_attained_service_tokens",
                 program_id="tenant-b") == 17
    # A forgotten program loses its series (llm-d deletes them on eviction).
    del plugin.programs["tenant-b"]
    assert value(m, "llm_d_epp_program_aware_avg_wait_time_milliseconds",
                 program_id="tenant-b") is None


async def test_predicted_latency_series_carry_the_plugin() -> None:
    """The latency predictor's llm-d twins carry its name and type (plugin_name,
    plugin_type) and move with their GIE series."""
    parts = _server(FULL_CONFIG)
    m = parts.metrics
    assert m.latency_identity == ("predicted-latency-producer", "predicted-latency-producer")
    assert parts.flow_control is not None
    await parts.flow_control.start()
    try:
        await _serve(parts.director, H, _chat(stream=True), stream=True)
    finally:
        await parts.flow_control.stop()
    lab = {"plugin_name": "predicted-latency-producer",
           "plugin_type": "predicted-latency-producer", "model_name": "llama",
           "target_model_name": "llama"}
    gie = value(m, "inference_objective_request_predicted_ttft_seconds_count",
                model_name="llama", target_model_name="llama")
    assert value(m, "llm_d_epp_request_predicted_ttft_seconds_count", **lab) == gie == 1
    assert value(m, "llm_d_epp_inference_request_metric", **lab, type="ttft") is not None


def test_label_caps_fold_to_other() -> None:
    """llm-d's cardinality caps: past the cap, new model names and fairness IDs read
    "other"; values seen before keep theirs; the empty model name always passes."""
    b = LabelBounds(cap=2)
    assert b.request(("a", "b", None, 1)) == ("a", "b", "default-flow", "1")
    assert b.request(("c", "a", "x", 0)) == ("other", "a", "x", "0")
    assert b.request(("a", "b", "y", 0))[2] == "other"
    assert b.request(("", "b", "default-flow", 0))[:3] == ("", "b", "default-flow")


async def test_prefix_size_is_labelled_with_its_plugin() -> None:
    parts = _server()
    fam = scrape(parts.metrics)["llm_d_epp_prefix_indexer_size"]
    assert [s.labels for s in fam.samples] == [
        {"plugin_name": "approx-prefix-cache-producer",
         "plugin_type": "approx-prefix-cache-producer"}]
