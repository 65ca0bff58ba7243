"""GIE v1.5.0's EPP metrics: names, types, help texts, labels and buckets on the registry
`epp serve` builds, and when each series moves (issue 14, metrics).

The table below is derived from GIE v1.5.0's pkg/epp/metrics/metrics.go (the 36 metrics
its ``Register`` registers) and pkg/epp/metrics/collectors/inference_pool.go (the per-pod
queue collector the runner adds): 37 in all. ``test_table_is_gie_v1_5_0`` re-reads both
files (copied under tests/fixtures/gie-v1.5.0/) and fails when the table drifts from them.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from epp.config.loader import DEFAULT_CONFIG_TEXT, load_and_build
from epp.datastore.objectives import ModelRewrite, Objective, RewriteRule, TargetModel
from epp.datastore.store import Datastore
from epp.errors import EppError, NoCapacity, ServiceUnavailable
from epp.latency.types import TrainingEntry
from epp.observability.metrics import EppMetrics
from epp.observability.observer import ResponseStats
from epp.parsing.usage import Usage
from epp.requestcontrol.director import Director, SchedulingCore
from epp.scheduling.plugins.latency_producer import PredictedLatencyProducer
from epp.scheduling.types import ApiType, Endpoint, LLMRequest, Metrics
from epp.server.options import (
    KubernetesSourceOptions,
    ServeOptions,
    StaticSourceOptions,
    validate,
)
from epp.server.wiring import PluginTimings, ServerParts, pool_label, wire

ROOT = Path(__file__).resolve().parents[3]
GIE = ROOT / "tests" / "fixtures" / "gie-v1.5.0"
DOCS = ROOT / "docs" / "observability.md"

# --- GIE v1.5.0 buckets (pkg/epp/metrics/metrics.go) ---
GENERAL = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10,
           15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
TPOT = (0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4,
        0.5, 0.6, 0.8, 1, 1.5, 2, 3, 4.5, 6, 12, 18, 24, 30, 36, 48, 60, 90, 120, 180, 270,
        360)
PREDICTION = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
              5.0)
REQ_SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144,
             524288, 1048576, 2097152, 4194304, 8388608, 16777216, 33554432, 67108864,
             134217728, 268435456, 536870912, 1073741824)
RESP_SIZES = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536)
IN_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536,
             131072, 262144, 524288, 1048576)
OUT_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
NTPOT = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
SCHED = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
FC_QUEUE = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            10.0, 30.0, 60.0)
HIT_RATIO = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
HIT_BYTES = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

MODEL = ("model_name", "target_model_name")
FC = ("fairness_id", "priority")

# Whether this EPP exports each one:
EXPORTED = "exported"  # registered; series appear when GIE's would
NO_SERIES = "registered, no series"  # registered; nothing here records it (docs say why)

# name -> (type, labels, buckets, help without the "[ALPHA] " prefix, status)
GIE_METRICS: dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None, str, str]] = {
    # --- inference objective ---
    "inference_objective_request_total": (
        "counter", (*MODEL, "priority"), None,
        ("Counter of inference objective requests broken out for each model and target "
         "model."), EXPORTED),
    "inference_objective_request_error_total": (
        "counter", (*MODEL, "error_code"), None,
        ("Counter of inference objective requests errors broken out for each model and "
         "target model."), EXPORTED),
    "inference_objective_inference_request_metric": (
        "gauge", (*MODEL, "type"), None,
        ("Consolidated gauge for various inference request metrics including TTFT, TPOT, "
         "SLOs, and prediction durations."), EXPORTED),
    "inference_objective_request_ttft_seconds": (
        "histogram", MODEL, GENERAL,
        "Inference model TTFT distribution in seconds for each model and target model.",
        EXPORTED),
    "inference_objective_request_predicted_ttft_seconds": (
        "histogram", MODEL, GENERAL,
        ("Inference model Predicted TTFT distribution in seconds for each model and target "
         "model."), EXPORTED),
    "inference_objective_request_ttft_prediction_duration_seconds": (
        "histogram", MODEL, PREDICTION,
        ("Duration taken to generate TTFT predictions in seconds for each model and target "
         "model."), EXPORTED),
    "inference_objective_request_tpot_seconds": (
        "histogram", MODEL, TPOT,
        "Inference model TPOT distribution in seconds for each model and target model.",
        EXPORTED),
    "inference_objective_request_predicted_tpot_seconds": (
        "histogram", MODEL, TPOT,
        ("Inference model Predicted TPOT distribution in seconds for each model and target "
         "model."), EXPORTED),
    "inference_objective_request_tpot_prediction_duration_seconds": (
        "histogram", MODEL, PREDICTION,
        ("Duration taken to generate TPOT predictions in seconds for each model and target "
         "model."), EXPORTED),
    "inference_objective_request_slo_violation_total": (
        "counter", (*MODEL, "type"), None,
        "Counter of SLO violations for each model, target model, and violation type.",
        EXPORTED),
    "inference_objective_request_duration_seconds": (
        "histogram", MODEL, GENERAL,
        ("Inference objective response latency distribution in seconds for each model and "
         "target model."), EXPORTED),
    "inference_objective_request_sizes": (
        "histogram", MODEL, REQ_SIZES,
        ("Inference objective requests size distribution in bytes for each model and target "
         "model."), EXPORTED),
    "inference_objective_response_sizes": (
        "histogram", MODEL, RESP_SIZES,
        ("Inference objective responses size distribution in bytes for each model and "
         "target model."), EXPORTED),
    "inference_objective_input_tokens": (
        "histogram", MODEL, IN_TOKENS,
        "Inference objective input token count distribution for requests in each model.",
        EXPORTED),
    "inference_objective_output_tokens": (
        "histogram", MODEL, OUT_TOKENS,
        "Inference objective output token count distribution for requests in each model.",
        EXPORTED),
    "inference_objective_prompt_cached_tokens": (
        "histogram", MODEL, IN_TOKENS,
        ("Inference objective prompt cached token count distribution for requests in each "
         "model."), EXPORTED),
    "inference_objective_running_requests": (
        "gauge", ("model_name",), None,
        "Inference objective number of running requests in each model.", EXPORTED),
    "inference_objective_normalized_time_per_output_token_seconds": (
        "histogram", MODEL, NTPOT,
        ("Inference objective latency divided by number of output tokens in seconds for each "
         "model and target model."), EXPORTED),
    # --- inference pool ---
    "inference_pool_average_kv_cache_utilization": (
        "gauge", ("name",), None,
        "The average kv cache utilization for an inference server pool.", EXPORTED),
    "inference_pool_average_queue_size": (
        "gauge", ("name",), None,
        "The average number of requests pending in the model server queue.", EXPORTED),
    "inference_pool_average_running_requests": (
        "gauge", ("name",), None,
        "The average number of running requests across model servers in the pool.",
        EXPORTED),
    "inference_pool_ready_pods": (
        "gauge", ("name",), None,
        "The number of ready pods in the inference server pool.", EXPORTED),
    "inference_pool_per_pod_queue_size": (  # collectors/inference_pool.go
        "gauge", ("name", "model_server_pod"), None,
        ("The total number of requests pending in the model server queue for each underlying "
         "pod."), EXPORTED),
    # --- scheduling ---
    "inference_extension_scheduler_e2e_duration_seconds": (
        "histogram", (), SCHED, "End-to-end scheduling latency distribution in seconds.",
        EXPORTED),
    "inference_extension_scheduler_attempts_total": (
        "counter", ("status", "target_model_name", "pod_name", "namespace", "port"), None,
        "Total number of scheduling attempts.", EXPORTED),
    "inference_extension_plugin_duration_seconds": (
        "histogram", ("extension_point", "plugin_type", "plugin_name"), SCHED,
        ("Plugin processing latency distribution in seconds for each extension point, plugin "
         "type and plugin name."), EXPORTED),
    "inference_extension_prefix_indexer_size": (
        "gauge", (), None, "Size of the prefix indexer.", EXPORTED),
    "inference_extension_prefix_indexer_hit_ratio": (
        "histogram", (), HIT_RATIO,
        "Ratio of prefix length matched to total prefix length in the cache lookup.",
        EXPORTED),
    "inference_extension_prefix_indexer_hit_bytes": (
        "histogram", (), HIT_BYTES,
        "Length of the prefix match in number of bytes in the cache lookup.", EXPORTED),
    # --- info ---
    "inference_extension_info": (
        "gauge", ("commit", "build_ref"), None,
        "General information of the current build of Inference Extension.", EXPORTED),
    # --- flow control ---
    "inference_extension_flow_control_request_queue_duration_seconds": (
        "histogram", (*FC, "outcome", "inference_pool", *MODEL), FC_QUEUE,
        ("Distribution of total time requests spend in the Flow Control layer (from enqueue "
         "to final outcome)."), EXPORTED),
    "inference_extension_flow_control_dispatch_cycle_duration_seconds": (
        "histogram", (), SCHED,
        ("Distribution of time taken for each internal dispatch cycle in the Flow Control "
         "layer."), EXPORTED),
    "inference_extension_flow_control_request_enqueue_duration_seconds": (
        "histogram", (*FC, "outcome"), SCHED,
        "Distribution of time taken to enqueue requests into the Flow Control layer.",
        EXPORTED),
    "inference_extension_flow_control_queue_size": (
        "gauge", (*FC, "inference_pool", *MODEL), None,
        "Current number of requests actively held in the Flow Control queue.", EXPORTED),
    "inference_extension_flow_control_queue_bytes": (
        "gauge", (*FC, "inference_pool", *MODEL), None,
        "Current total size in bytes of requests actively held in the Flow Control queue.",
        EXPORTED),
    "inference_extension_flow_control_pool_saturation": (
        "gauge", ("inference_pool",), None,
        ("Current saturation level of the inference pool (0.0 = empty, 1.0 = fully "
         "saturated)."), EXPORTED),
    # --- model rewrite ---
    "inference_extension_model_rewrite_decisions_total": (
        "counter", ("model_rewrite_name", "model_name", "target_model"), None,
        "Total number of inference model rewrite decisions.", EXPORTED),
}


# ------------------------------------------------------------------ GIE's Go, re-read

def _balanced(text: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket matching ``text[start]`` (== open_)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    raise AssertionError(f"unbalanced {open_} at {start}")


def _go_strings(expr: str, names: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """A Go []string expression of metrics.go: a literal, a variable, or append(...)."""
    expr = expr.strip()
    if expr.startswith("append("):
        parts = [p.strip() for p in expr[len("append("):-1].split(",") if p.strip()]
        # the first argument may be a literal with commas inside: re-join it
        inner = expr[len("append("):-1]
        if inner.lstrip().startswith("[]string{"):
            end = inner.index("}") + 1
            head, rest = inner[:end], inner[end:].lstrip(", ")
            parts = [head, *[p.strip() for p in rest.split(",") if p.strip()]]
        out: list[str] = list(_go_strings(parts[0], names))
        for p in parts[1:]:
            out.extend(_go_strings(p[:-3], names) if p.endswith("...") else (p.strip('"'),))
        return tuple(out)
    if expr.startswith("[]string{"):
        return tuple(re.findall(r'"(\w+)"', expr))
    return names[expr]


def _go_floats(expr: str, names: Mapping[str, tuple[float, ...]]) -> tuple[float, ...]:
    expr = re.sub(r"//[^\n]*", "", expr).strip()
    if expr.startswith("[]float64{"):
        return tuple(float(x) for x in re.findall(r"[\d.]+", expr[len("[]float64"):]))
    return names[expr]


def _find(pattern: str, text: str) -> str:
    m = re.search(pattern, text)
    assert m is not None, pattern
    return m[1]


def gie_metrics() -> dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None, str]]:
    """Every metric GIE v1.5.0's EPP registers: name -> (type, labels, buckets, help)."""
    src = (GIE / "pkg/epp/metrics/metrics.go").read_text()
    consts = dict(re.findall(r'^\s*(\w+)\s*=\s*"(\w+)"', src, re.MULTILINE))
    label_vars = {k: tuple(re.findall(r'"(\w+)"', v))
                  for k, v in re.findall(r"^\s*(\w+)\s*=\s*(\[\]string\{[^}]*\})", src, re.MULTILINE)}
    bucket_vars = {k: _go_floats(v, {})
                   for k, v in re.findall(r"^\s*(\w+)\s*=\s*(\[\]float64\{[^}]*\})", src,
                                          re.MULTILINE)}
    out = {}
    for m in re.finditer(r"prometheus\.New(Counter|Gauge|Histogram)Vec\(", src):
        call = src[m.end() - 1:_balanced(src, m.end() - 1, "(", ")")]
        opts_start = call.index("{")
        opts_end = _balanced(call, opts_start, "{", "}")
        opts = call[opts_start:opts_end]
        name = consts[_find(r"Subsystem:\s*(\w+)", opts)] + "_" + _find(r'Name:\s*"(\w+)"', opts)
        help_ = _find(r'HelpMsgWithStability\("((?:[^"\\]|\\.)*)"', opts)
        b = re.search(r"Buckets:\s*(\[\]float64\{[^}]*\}|\w+)", opts)
        buckets = _go_floats(b[1], bucket_vars) if b else None
        labels = _go_strings(call[opts_end:-1].strip().strip(",").strip(), label_vars)
        out[name] = (m[1].lower(), labels, buckets, help_)
    # The runner's custom collector (cmd/epp/runner/runner.go registers it with the rest).
    pool = (GIE / "pkg/epp/metrics/collectors/inference_pool.go").read_text()
    d = re.search(r'NewDesc\(\s*"(\w+)",\s*metricsutil\.HelpMsgWithStability\("([^"]*)"'
                  r'[^)]*\),\s*(\[\]string\{[^}]*\})', pool)
    assert d is not None
    out[d[1]] = ("gauge", _go_strings(d[3], {}), None, d[2])
    # Counters are exposed with "_total" (GIE's names already end in it).
    return out


def test_table_is_gie_v1_5_0() -> None:
    go = gie_metrics()
    assert len(go) == 37
    assert set(go) == set(GIE_METRICS)
    for name, (kind, labels, buckets, help_) in go.items():
        assert GIE_METRICS[name][:4] == (kind, labels, buckets, help_), name
    # The counts docs/observability.md gives.
    statuses = [v[4] for v in GIE_METRICS.values()]
    assert [statuses.count(s) for s in (EXPORTED, NO_SERIES)] == [37, 0]


def test_docs_name_every_gie_metric() -> None:
    """docs/observability.md says, for each of the 37, whether it is exported and why not."""
    text = DOCS.read_text()
    missing = [n for n in GIE_METRICS if f"`{n}`" not in text]
    assert not missing, missing


# ------------------------------------------------------------------ the server's registry

TWO = StaticSourceOptions(endpoints="10.0.0.1:8000,10.0.0.2:8000")
H = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r1"}


def _chat(content: str = "hi", model: str = "llama", **extra: Any) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                         **extra})


def _server(options: ServeOptions | None = None, config: str | None = None) -> ServerParts:
    """The object graph `epp serve` wires (epp/server/wiring.py), nothing started."""
    timings = PluginTimings()
    built = load_and_build(None, config, timer=timings)
    return wire(validate(options or ServeOptions(static=TWO)), built, timings, None)


# The built-in default config with GIE's latency predictor (its metrics need it), in
# streaming mode: the streamed response of _traffic trains TTFT and TPOT.
LATENCY_CONFIG = DEFAULT_CONFIG_TEXT.replace(
    "plugins:\n", "plugins:\n- type: predicted-latency-producer\n"
    "  parameters: {streamingMode: true}\n", 1)
# … with flow control on (its six series), saturation from in-flight counts (no scrape
# here: the utilization detector would read the unscraped pool as saturated).
FLOW_CONTROL_CONFIG = LATENCY_CONFIG.replace(
    "plugins:\n", "featureGates: [flowControl]\nplugins:\n- type: concurrency-detector\n",
    1) + "saturationDetector: {pluginRef: concurrency-detector}\n"


def _warm_predictor(parts: ServerParts) -> None:
    """Past the in-process predictor's cold start, so requests get predictions."""
    producer = parts.built.plugins["predicted-latency-producer"]
    assert isinstance(producer, PredictedLatencyProducer)
    producer.predictor.add_training_data_bulk(
        [TrainingEntry(0.1, 10 + i, 0, 1, 0, 20.0 + i, 0.0, 0.0) for i in range(40)]
        + [TrainingEntry(0.1, 10 + i, 0, 1, 0, 0.0, 2.0 + i / 10, 0.0) for i in range(40)])


def scrape(metrics: EppMetrics) -> dict[str, Any]:
    """The exposition as Prometheus parses it: families by exposed name (counters with
    their ``_total``); the client's ``*_created`` families left out."""
    text = generate_latest(metrics.registry).decode()
    out = {}
    for f in text_string_to_metric_families(text):
        if f.name.endswith("_created"):
            continue
        out[f.name + ("_total" if f.type == "counter" else "")] = f
    return out


def samples(metrics: EppMetrics, name: str) -> list[Sample]:
    return [s for f in scrape(metrics).values() for s in f.samples if s.name == name]


def value(metrics: EppMetrics, metric: str, /, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(metric, labels)


def sse(*events: dict[str, Any]) -> list[bytes]:
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


async def _traffic(parts: ServerParts) -> None:
    """Requests through the wired Director, so every exportable series has a sample."""
    d = parts.director
    # An InferenceModelRewrite rule picks the target model: a rewrite decision.
    parts.objectives.set_rewrite(ModelRewrite("canary", (RewriteRule(
        ("llama-canary",), (TargetModel("llama"),)),)))
    r = await d.route(H, _chat(model="llama-canary"), True, None)
    d.on_response_headers(r.context, 200, {"content-type": "application/json"})
    d.on_response_body(r.context, b"{}", True)
    d.on_done(r.context, aborted=False)
    # A JSON response with usage.
    r = await d.route(H, _chat(), True, None)
    d.on_response_headers(r.context, 200, {"content-type": "application/json"})
    d.on_response_body(r.context, orjson.dumps({"usage": {
        "prompt_tokens": 9, "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0}}}), True)
    d.on_done(r.context, aborted=False)
    # A streamed response with usage (TTFT, TPOT); the same prompt (prefix hit). Its SLOs
    # (for a latency-predictor config) are sure to be violated.
    r = await d.route({**H, "x-slo-ttft-ms": "0.000001", "x-slo-tpot-ms": "0.000001"},
                      _chat(stream=True), True, None)
    d.on_response_headers(r.context, 200, {"content-type": "text/event-stream"})
    chunks = sse({"choices": [{"delta": {"content": "a"}}]},
                 {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
    for c in chunks[:-1]:
        d.on_response_body(r.context, c, False)
    d.on_response_body(r.context, chunks[-1], True)
    d.on_done(r.context, aborted=False)
    # An error from the model server.
    r = await d.route(H, _chat(), True, None)
    d.on_response_headers(r.context, 503, {"content-type": "application/json"})
    d.on_response_body(r.context, b'{"error":"busy"}', True)
    d.on_done(r.context, aborted=False)


async def test_registry_has_gie_names_types_labels_and_buckets() -> None:
    parts = _server(config=FLOW_CONTROL_CONFIG)
    _warm_predictor(parts)
    assert parts.flow_control is not None
    await parts.flow_control.start()
    try:
        await _traffic(parts)
    finally:
        await parts.flow_control.stop()
    fams = scrape(parts.metrics)
    for name, (kind, labels, buckets, help_, _status) in GIE_METRICS.items():
        assert name in fams, name
        f = fams[name]
        assert f.type == kind, name
        assert f.documentation == f"[ALPHA] {help_}", name
        if _status == NO_SERIES:
            assert f.samples == [], name
            continue
        assert f.samples, f"{name}: no series after traffic"
        for s in f.samples:
            assert set(s.labels) - {"le"} == set(labels), (name, s.labels)
        if buckets is not None:
            les = sorted({float(s.labels["le"]) for s in f.samples if s.name.endswith("_bucket")})
            assert les == sorted([*map(float, buckets), math.inf]), name
    # The GIE metrics this EPP registers, and no other name outside the project's epp_*.
    gie_like = {n for n in fams if not n.startswith(("epp_", "llm_d_epp_"))}
    assert gie_like == set(GIE_METRICS)


async def test_flow_control_series_only_under_the_gate() -> None:
    """GIE's six flow-control series are registered when the flowControl gate is on (the
    registry test above), and not at all without it (nothing would record them)."""
    parts = _server(config=LATENCY_CONFIG)
    assert parts.flow_control is None
    _warm_predictor(parts)
    await _traffic(parts)
    fams = scrape(parts.metrics)
    flow_control = {n for n in GIE_METRICS if n.startswith("inference_extension_flow_control_")}
    assert len(flow_control) == 6
    assert not flow_control & set(fams)
    assert {n for n in fams if not n.startswith(("epp_", "llm_d_epp_"))} == set(GIE_METRICS) - flow_control


async def test_model_rewrite_decisions_and_objective_priority() -> None:
    """GIE's Director: RecordInferenceModelRewriteDecision(rewrite name, incoming model,
    target model) for each rule-chosen target; the request counter's ``priority`` is the
    InferenceObjective's (x-gateway-inference-objective), 0 without one."""
    parts = _server()
    m = parts.metrics
    for ep in parts.store.snapshot():  # scraped now: not saturated (sheddable is admitted)
        parts.store.update_metrics(ep.key, Metrics(updated_at=time.monotonic()))
    parts.objectives.replace(
        [Objective("critical", 10), Objective("sheddable", -1)],
        [ModelRewrite("r", (RewriteRule(("m",), (TargetModel("t"),)),))])
    for objective in ("critical", "sheddable", "unknown"):
        await parts.director.route({**H, "x-gateway-inference-objective": objective},
                                   _chat(model="m"), True, None)
    assert value(m, "inference_extension_model_rewrite_decisions_total",
                 model_rewrite_name="r", model_name="m", target_model="t") == 3
    for priority in ("10", "-1", "0"):
        assert value(m, "inference_objective_request_total", model_name="m",
                     target_model_name="t", priority=priority) == 1


# ------------------------------------------------------------------ when series move

def _director(config: str | None = None, n: int = 3,
              **endpoint: Any) -> tuple[Director, SchedulingCore, Datastore]:
    store = Datastore()
    roles = ["decode", "decode", "prefill"]
    store.set_endpoints(Endpoint(f"p{i}", f"10.0.0.{i}", 8000, namespace="ns",
                                 labels={"llm-d.ai/role": roles[(i - 1) % 3]}, **endpoint)
                        for i in range(1, n + 1))
    built = load_and_build(None if config is None else str(ROOT / "config" / config))
    core = SchedulingCore(store, built.scheduler, EppMetrics(store), built.pre_request,
                          built.response_complete, built.request_headers,
                          built.response_headers)
    return Director(core), core, store


async def test_request_counter_priority_and_request_size() -> None:
    d, core, _ = _director()
    m = core.metrics
    body = _chat("hello there")
    await d.route(H, body, True, None)
    assert value(m, "inference_objective_request_total", model_name="llama",
                 target_model_name="llama", priority="0") == 1
    assert value(m, "inference_objective_request_sizes_sum", model_name="llama",
                 target_model_name="llama") == len(body)
    # A rewritten model: the size of the body sent upstream; both names on the series.
    r = await d.route({**H, "x-gateway-model-name-rewrite": "llama-v2"}, body, True, None)
    assert r.body is not None
    assert value(m, "inference_objective_request_total", model_name="llama",
                 target_model_name="llama-v2", priority="0") == 1
    assert value(m, "inference_objective_request_sizes_sum", model_name="llama",
                 target_model_name="llama-v2") == len(r.body)
    # The header rewrite is not a rewrite decision (GIE counts InferenceModelRewrite rules).
    assert samples(m, "inference_extension_model_rewrite_decisions_total") == []


async def test_rejected_requests_count_no_request_and_no_size() -> None:
    d, core, store = _director()
    store.set_endpoints([])
    with pytest.raises(ServiceUnavailable):
        await d.route(H, _chat(), True, None)
    m = core.metrics
    assert samples(m, "inference_objective_request_total") == []
    assert samples(m, "inference_objective_request_sizes_count") == []
    # No candidates: the scheduler never ran, so no attempt (as GIE).
    assert samples(m, "inference_extension_scheduler_attempts_total") == []
    assert value(m, "inference_objective_request_error_total", model_name="llama",
                 target_model_name="llama", error_code="ServiceUnavailable") == 1


async def test_scheduler_attempts_success_and_failure() -> None:
    d, core, _ = _director("pd.yaml")
    m = core.metrics
    r = await d.route(H, _chat(), True, None)
    pod = r.destination.split(",")[0]
    ep = core.store.get(pod)
    assert ep is not None
    assert value(m, "inference_extension_scheduler_attempts_total", status="success",
                 target_model_name="llama", pod_name=ep.name, namespace="ns",
                 port="8000") == 1
    # Only the prefill pod in the subset hint: every profile filters it out (429).
    with pytest.raises(NoCapacity):
        await d.route(H, _chat(), True, ["10.0.0.3:8000"])
    assert value(m, "inference_extension_scheduler_attempts_total", status="failure",
                 target_model_name="llama", pod_name="", namespace="", port="") == 1
    assert value(m, "inference_extension_scheduler_e2e_duration_seconds_count") == 2


async def test_a_crashing_plugin_is_a_failed_attempt() -> None:
    d, core, _ = _director()

    def boom(*args: object) -> None:
        raise RuntimeError("plugin bug")

    core.scheduler.handler.pick = boom  # type: ignore[method-assign,assignment]
    with pytest.raises(EppError):
        await d.route(H, _chat(), True, None)
    assert value(core.metrics, "inference_extension_scheduler_attempts_total",
                 status="failure", target_model_name="llama", pod_name="", namespace="",
                 port="") == 1


async def test_streamed_response_sizes_ttft_tpot_and_ntpot() -> None:
    d, core, _ = _director()
    m = core.metrics
    lab = {"model_name": "llama", "target_model_name": "llama"}
    r = await d.route(H, _chat(stream=True), True, None)
    d.on_response_headers(r.context, 200, {"content-type": "text/event-stream"})
    chunks = sse(*({"choices": [{"delta": {"content": "x"}}]} for _ in range(4)),
                 {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    for c in chunks[:-1]:
        d.on_response_body(r.context, c, False)
        await asyncio.sleep(0.002)
    d.on_response_body(r.context, chunks[-1], True)
    d.on_done(r.context, aborted=False)
    assert value(m, "inference_objective_response_sizes_sum", **lab) == sum(map(len, chunks))
    ttft = value(m, "inference_objective_request_ttft_seconds_sum", **lab)
    tpot = value(m, "inference_objective_request_tpot_seconds_sum", **lab)
    assert ttft is not None and 0 < ttft < 1
    assert tpot is not None and 0 < tpot < 1
    assert value(m, "inference_objective_inference_request_metric", **lab, type="ttft") == ttft
    assert value(m, "inference_objective_inference_request_metric", **lab, type="tpot") == tpot
    # NTPOT: request duration / completion tokens.
    duration = value(m, "inference_objective_request_duration_seconds_sum", **lab)
    ntpot = value(m, "inference_objective_normalized_time_per_output_token_seconds_sum", **lab)
    assert duration is not None and ntpot == pytest.approx(duration / 5)
    assert value(m, "inference_objective_output_tokens_sum", **lab) == 5


async def test_json_response_has_a_size_but_no_ttft() -> None:
    d, core, _ = _director()
    m = core.metrics
    lab = {"model_name": "llama", "target_model_name": "llama"}
    r = await d.route(H, _chat(), True, None)
    d.on_response_headers(r.context, 200, {"content-type": "application/json"})
    body = orjson.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 0}})
    d.on_response_body(r.context, body[:10], False)
    d.on_response_body(r.context, body[10:], True)
    d.on_done(r.context, aborted=False)
    assert value(m, "inference_objective_response_sizes_sum", **lab) == len(body)
    assert value(m, "inference_objective_request_ttft_seconds_count", **lab) is None
    # As GIE: zero output tokens are not observed, and give no NTPOT.
    assert value(m, "inference_objective_output_tokens_count", **lab) is None
    assert value(m, "inference_objective_normalized_time_per_output_token_seconds_count",
                 **lab) is None
    assert value(m, "inference_objective_input_tokens_sum", **lab) == 3


async def test_error_response_has_a_size_and_an_error() -> None:
    d, core, _ = _director()
    m = core.metrics
    lab = {"model_name": "llama", "target_model_name": "llama"}
    r = await d.route(H, _chat(stream=True), True, None)
    d.on_response_headers(r.context, 500, {"content-type": "text/event-stream"})
    d.on_response_body(r.context, b"data: oops\n\n", False)
    d.on_response_body(r.context, b"", True)
    d.on_done(r.context, aborted=False)
    assert value(m, "inference_objective_response_sizes_sum", **lab) == 12
    assert value(m, "inference_objective_request_ttft_seconds_count", **lab) is None
    # A model server's error response: GIE's ModelServerError.
    assert value(m, "inference_objective_request_error_total", **lab,
                 error_code="ModelServerError") == 1


async def test_lean_shape_and_aborts_record_no_response_metrics() -> None:
    d, core, _ = _director()
    m = core.metrics
    lab = {"model_name": "llama", "target_model_name": "llama"}
    # Lean shape: the response headers, then the end; no body ever reaches the EPP.
    r = await d.route(H, _chat(stream=True), True, None)
    d.on_response_headers(r.context, 200, {"content-type": "text/event-stream"})
    d.on_done(r.context, aborted=False)
    # An aborted stream.
    r = await d.route(H, _chat(stream=True), True, None)
    d.on_response_headers(r.context, 200, {"content-type": "text/event-stream"})
    d.on_response_body(r.context, b'data: {"choices":[]}\n\n', False)
    d.on_done(r.context, aborted=True)
    assert value(m, "inference_objective_response_sizes_count", **lab) is None
    assert value(m, "inference_objective_request_ttft_seconds_count", **lab) is None
    assert value(m, "inference_objective_request_duration_seconds_count", **lab) == 1
    assert value(m, "inference_objective_running_requests", model_name="llama") == 0


async def test_prefix_indexer_hit_bytes_and_ratio() -> None:
    d, core, _ = _director()
    m = core.metrics
    body = _chat("the same long prompt " * 40)
    await d.route(H, body, True, None)
    await d.route(H, body, True, None)
    # The first request found nothing; the second went where its blocks are.
    assert value(m, "inference_extension_prefix_indexer_hit_bytes_count") == 2
    assert value(m, "inference_extension_prefix_indexer_hit_bytes_bucket", le="0.0") == 1
    hit_bytes = value(m, "inference_extension_prefix_indexer_hit_bytes_sum")
    assert hit_bytes is not None and hit_bytes > 0
    assert hit_bytes % 64 == 0  # whole blocks of 16 tokens × 4 characters
    assert value(m, "inference_extension_prefix_indexer_hit_ratio_bucket", le="1.0") == 2
    assert value(m, "inference_extension_prefix_indexer_hit_ratio_sum") == 1.0


def test_pool_gauges_average_running_requests() -> None:
    store = Datastore()
    store.set_endpoints([Endpoint("a", "10.0.0.1", 8000), Endpoint("b", "10.0.0.2", 8000)])
    store.update_metrics("10.0.0.1:8000", Metrics(running_requests=2, waiting_queue_size=1))
    store.update_metrics("10.0.0.2:8000", Metrics(running_requests=5, waiting_queue_size=3))
    m = EppMetrics(store, "my-pool")
    assert value(m, "inference_pool_average_running_requests", name="my-pool") == 3.5
    assert value(m, "inference_pool_average_queue_size", name="my-pool") == 2
    assert value(m, "inference_pool_ready_pods", name="my-pool") == 2
    assert value(m, "inference_pool_per_pod_queue_size", name="my-pool",
                 model_server_pod="b") == 3


def test_pool_label_is_the_pool_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NAMESPACE", "ns")
    pool = ServeOptions(kubernetes=KubernetesSourceOptions(pool_name="my-pool"))
    assert pool_label(validate(pool)) == "my-pool"
    parts = _server(pool)
    assert value(parts.metrics, "inference_pool_ready_pods", name="my-pool") == 0
    # Standalone (GIE names its endpoint pool after --pool-name); static endpoints.
    standalone = KubernetesSourceOptions(endpoint_selector="app=x", endpoint_target_ports="8000")
    assert pool_label(validate(ServeOptions(kubernetes=standalone))) == "static"
    named = KubernetesSourceOptions(endpoint_selector="app=x", endpoint_target_ports="8000",
                                    pool_name="p")
    assert pool_label(validate(ServeOptions(kubernetes=named))) == "p"
    assert pool_label(validate(ServeOptions(static=TWO))) == "static"
    assert value(_server().metrics, "inference_pool_ready_pods", name="static") == 2


# ------------------------------------------------------------------ --workers N wire

class _Writer:
    """Collects what the core writes to a front."""

    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.transport = self

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes) -> None:
        self.frames.append(orjson.loads(data[4:]))

    def close(self) -> None:
        pass


async def test_request_size_and_response_stats_cross_the_worker_socket() -> None:
    from epp.server import workers

    request = LLMRequest("r1", "llama", "llama", ApiType.CHAT_COMPLETIONS, "hi", {},
                         request_size_bytes=123)
    assert workers._request_from_wire(workers._request_to_wire(request)).request_size_bytes \
        == 123
    _, core, _ = _director()
    server = workers.CoreServer(core, lambda outcome: None)
    reader = asyncio.StreamReader()
    writer = _Writer()
    usage = [3, 5, None]
    for frame in (["R", 1, workers._request_to_wire(request), None],
                  ["C", 1, 200, False, usage, [42, 0.25, 0.01]]):
        reader.feed_data(workers._frame(frame))
    reader.feed_eof()
    await server._serve(reader, writer)  # type: ignore[arg-type]
    assert writer.frames[0][0] == "D"
    m = core.metrics
    lab = {"model_name": "llama", "target_model_name": "llama"}
    assert value(m, "inference_objective_request_sizes_sum", **lab) == 123
    assert value(m, "inference_objective_response_sizes_sum", **lab) == 42
    assert value(m, "inference_objective_request_ttft_seconds_sum", **lab) == 0.25
    assert value(m, "inference_objective_request_tpot_seconds_sum", **lab) == 0.01
    assert value(m, "inference_objective_output_tokens_sum", **lab) == 5


def test_response_stats_reach_the_observers_only_when_not_aborted() -> None:
    """SchedulingCore.complete: ``responded`` before ``completed``, never for an abort."""
    _, core, _ = _director()
    seen: list[str] = []

    class Spy:
        detail = timings = False

        def __getattr__(self, name: str) -> Any:
            return lambda *a: seen.append(name)

    from epp.requestcontrol.director import _Ticket

    request = LLMRequest("r1", "m", "m", ApiType.CHAT_COMPLETIONS, "hi", {})
    core.complete(_Ticket(request, "10.0.0.1:8000", 0.0, Spy()), 200, False,  # type: ignore[arg-type]
                  Usage(1, 2, None), ResponseStats(10))
    core.complete(_Ticket(request, "10.0.0.1:8000", 0.0, Spy()), 0, True,  # type: ignore[arg-type]
                  None, ResponseStats(10))
    assert seen == ["responded", "completed", "completed"]
