"""Tracing: request span, scheduling and plugin child spans, traceparent propagation."""

from __future__ import annotations

import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from epp.config.loader import load_and_build
from epp.datastore.store import Datastore
from epp.errors import ServiceUnavailable
from epp.observability.metrics import EppMetrics
from epp.observability.tracing import Tracing
from epp.requestcontrol.director import Director, SchedulingCore
from epp.scheduling.types import Endpoint

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


async def test_request_span_with_children_and_propagation() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    store = Datastore()
    store.set_endpoints([Endpoint("p1", "10.0.0.1", 8000), Endpoint("p2", "10.0.0.2", 8000)])
    holder: dict[str, SchedulingCore] = {}

    def timer(ep, plugin, seconds):  # type: ignore[no-untyped-def]
        holder["d"].plugin_timer(ep, plugin, seconds)

    built = load_and_build(timer=timer)
    core = SchedulingCore(store, built.scheduler, EppMetrics(store), built.pre_request,
                          built.response_complete, tracing=tracing)
    d = Director(core)
    holder["d"] = core  # type: ignore[assignment]
    body = orjson.dumps({"model": "m", "prompt": "hello"})
    r = await d.route({":path": "/v1/completions", "traceparent": PARENT}, body, True, None)
    tp = r.set_headers["traceparent"]
    assert tp.split("-")[1] == TRACE_ID and tp.split("-")[2] != "00f067aa0ba902b7"
    d.on_response_headers(r.context, 200, {})
    d.on_done(r.context, aborted=False)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    req = spans["epp.request"]
    assert format(req.context.trace_id, "032x") == TRACE_ID
    assert format(req.context.span_id, "016x") == tp.split("-")[2]
    assert req.attributes["http.status_code"] == 200
    assert spans["epp.scheduling"].parent.span_id == req.context.span_id
    assert spans["epp.scheduling"].attributes["epp.endpoints"] == r.destination
    plugin_spans = [n for n in spans if n.startswith(("Scorer ", "Picker ", "ProfilePicker "))]
    assert {"Scorer queue-scorer", "Scorer prefix-cache-scorer",
            "Picker max-score-picker"} <= set(plugin_spans)


async def test_rejected_request_span_records_status() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    store = Datastore()
    store.set_endpoints([])
    built = load_and_build()
    d = Director(SchedulingCore(store, built.scheduler, EppMetrics(store),
                                tracing=Tracing(provider)))
    with pytest.raises(ServiceUnavailable):
        await d.route({":path": "/v1/completions"}, orjson.dumps({"model": "m", "prompt": "x"}),
                      True, None)
    (span,) = exporter.get_finished_spans()
    assert span.name == "epp.request" and span.attributes["http.status_code"] == 503
    assert span.attributes["error.message"] == "no ready endpoints in the pool"


async def test_plugin_timings_outside_a_decision_make_no_spans() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    store = Datastore()
    store.set_endpoints([Endpoint("p1", "10.0.0.1", 8000)])
    built = load_and_build()
    core = SchedulingCore(store, built.scheduler, EppMetrics(store), tracing=Tracing(provider))
    scorer = next(iter(built.scheduler.profiles.values())).scorers[0][0]
    core.plugin_timer("Scorer", scorer, 0.001)  # nobody is being decided: dropped
    d = Director(core)
    r = await d.route({":path": "/v1/completions"}, orjson.dumps({"model": "m", "prompt": "x"}),
                      True, None)
    d.on_done(r.context, aborted=True)
    spans = exporter.get_finished_spans()
    assert not [s for s in spans if s.name.startswith("Scorer ")]
    (req,) = [s for s in spans if s.name == "epp.request"]
    assert req.attributes["epp.aborted"] is True and req.attributes["http.status_code"] == 0


# --- set up as GIE's EPP sets it up (pkg/common/observability/tracing/telemetry.go) ---


@pytest.mark.parametrize(("env", "want"), [
    ({}, 0.1),
    ({"OTEL_TRACES_SAMPLER_ARG": "0.5"}, 0.5),
    ({"OTEL_TRACES_SAMPLER_ARG": "1"}, 1.0),
    ({"OTEL_TRACES_SAMPLER_ARG": "lots"}, 0.1),
    ({"OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "1"}, 0.1),
])
def test_sampler_ratio_as_gie(env: dict[str, str], want: float,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    from epp.observability.tracing import sampler_ratio
    for k in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert sampler_ratio() == want


def _processor_exporter(tracing: Tracing) -> object:
    # The SDK keeps its processors on a multi-processor; the BatchSpanProcessor wraps the
    # exporter. Both are stable public-ish attributes of opentelemetry-sdk 1.x.
    processors = tracing.provider._active_span_processor._span_processors
    (batch,) = processors
    return batch._batch_processor._exporter


def test_default_exporter_is_console_with_gie_service_name_and_ratio(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter
    for k in ("OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER",
              "OTEL_TRACES_SAMPLER_ARG"):
        monkeypatch.delenv(k, raising=False)
    tracing = Tracing()
    try:
        assert isinstance(_processor_exporter(tracing), ConsoleSpanExporter)
        attrs = tracing.provider.resource.attributes
        assert attrs["service.name"] == "gateway-api-inference-extension/epp"
        assert "TraceIdRatioBased{0.1}" in tracing.provider.sampler.get_description()
    finally:
        tracing.shutdown()


def test_otlp_exporter_is_grpc_to_gie_default_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    tracing = Tracing()
    try:
        exporter = _processor_exporter(tracing)
        assert isinstance(exporter, OTLPSpanExporter)
        assert exporter._endpoint == "localhost:4317"
    finally:
        tracing.shutdown()


def test_unknown_exporter_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from epp.errors import ConfigError
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        Tracing()


async def test_unsampled_request_records_no_children() -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    store = Datastore()
    store.set_endpoints([Endpoint("p1", "10.0.0.1", 8000)])
    built = load_and_build()
    core = SchedulingCore(store, built.scheduler, EppMetrics(store), tracing=Tracing(provider))
    d = Director(core)
    r = await d.route({":path": "/v1/completions"}, orjson.dumps({"model": "m", "prompt": "x"}),
                      True, None)
    d.on_done(r.context, aborted=False)
    tp = r.set_headers["traceparent"]  # the context still propagates, unsampled
    assert int(tp.rsplit("-", 1)[1], 16) & 1 == 0  # the sampled flag is off
    assert exporter.get_finished_spans() == ()
