"""OpenTelemetry tracing (``epp serve --tracing``; on by default, as in GIE).

One span per request (``epp.request``, from routing to the end of the response, a child of
the client's ``traceparent`` when it sends one), with a ``epp.scheduling`` child and one
child per plugin call (built after the fact from the plugin timings, so plugins stay plain
functions; only for sampled requests). The request span's context is propagated to the
model server in the ``traceparent`` header. The scheduling core gives each request a
:class:`TraceObserver` (a decision observer) that does all of this.

Set up as GIE v1.5.0's EPP sets it up (pkg/common/observability/tracing), through the
standard OTEL_* environment: ``OTEL_TRACES_EXPORTER`` ``console`` (the default: spans
printed to stdout) or ``otlp`` (OTLP over gRPC, plaintext, to
``OTEL_EXPORTER_OTLP_ENDPOINT``, default ``http://localhost:4317``);
``OTEL_TRACES_SAMPLER`` ``parentbased_traceidratio`` (the only one, as in GIE) with
``OTEL_TRACES_SAMPLER_ARG`` the ratio (default 0.1); ``OTEL_SERVICE_NAME`` (default
``gateway-api-inference-extension/epp``). Needs the ``tracing`` extra:
``pip install 'epp[tracing]'``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from epp import keys
from epp.errors import ConfigError
from epp.framework.interfaces import Plugin
from epp.observability.observer import Observer
from epp.parsing.usage import Usage
from epp.scheduling.types import Endpoint, LLMRequest, SchedulingResult

GIE_SERVICE_NAME = "gateway-api-inference-extension/epp"
DEFAULT_OTLP_ENDPOINT = "http://localhost:4317"
DEFAULT_SAMPLER_RATIO = 0.1

# xds-protos (Envoy's protos, a dependency) ships its own, older copy of
# opentelemetry/proto/*; installed after opentelemetry-proto it replaces that package's
# modules, and the OTLP exporter then fails to import. scripts/setup-venv.sh reinstalls
# opentelemetry-proto last; anyone else gets this fix in the error.
_PROTO_CLOBBERED_FIX = ("the opentelemetry-proto modules were overwritten by xds-protos' "
                        "older copy; fix: pip install --force-reinstall --no-deps "
                        "opentelemetry-proto==$(pip show opentelemetry-proto | sed -n "
                        "'s/^Version: //p')")


def sampler_ratio(log: Any = None) -> float:
    """GIE's sampler: parent-based trace-id ratio, from OTEL_TRACES_SAMPLER(_ARG); an
    unsupported sampler or a bad ratio falls back to 0.1 (logged), as GIE does."""
    kind = os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_traceidratio").strip()
    arg = os.environ.get("OTEL_TRACES_SAMPLER_ARG", str(DEFAULT_SAMPLER_RATIO)).strip()
    if kind != "parentbased_traceidratio":
        if log is not None:
            log.warning("tracing: unsupported sampler type %s, falling back to "
                        "parentbased_traceidratio with ratio 0.1 (as GIE)", kind)
        return DEFAULT_SAMPLER_RATIO
    try:
        ratio = float(arg)
    except ValueError:
        return DEFAULT_SAMPLER_RATIO
    return ratio if 0.0 <= ratio <= 1.0 else DEFAULT_SAMPLER_RATIO


class Tracing:
    def __init__(self, provider: Any = None, log: Any = None) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as e:
            raise ConfigError("--tracing needs OpenTelemetry: pip install 'epp[tracing]' "
                              f"({e})") from e
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        if provider is None:
            provider = TracerProvider(
                resource=Resource.create(
                    {"service.name": os.environ.get("OTEL_SERVICE_NAME", GIE_SERVICE_NAME)}),
                sampler=ParentBased(TraceIdRatioBased(sampler_ratio(log))))
            kind = os.environ.get("OTEL_TRACES_EXPORTER", "console").strip().lower()
            if kind == "console":
                exporter: Any = ConsoleSpanExporter()
            elif kind == "otlp":
                exporter = _otlp_grpc_exporter()
            else:
                raise ConfigError(f"OTEL_TRACES_EXPORTER={kind!r}: use console (the "
                                  "default) or otlp (OTLP over gRPC)")
            provider.add_span_processor(BatchSpanProcessor(exporter))
        self.provider = provider
        self.tracer = provider.get_tracer("epp")

    def start_request(self, headers: Mapping[str, str]) -> Any:
        """Start the request span, child of the incoming ``traceparent`` if any."""
        parent = self._propagator.extract(carrier=dict(headers))
        return self.tracer.start_span("epp.request", context=parent,
                                      kind=self._trace.SpanKind.SERVER)

    def child(self, span: Any, name: str, start_ns: int, end_ns: int,
              attributes: Mapping[str, Any] | None = None) -> None:
        ctx = self._trace.set_span_in_context(span)
        s = self.tracer.start_span(name, context=ctx, start_time=start_ns,
                                   attributes=dict(attributes or {}))
        s.end(end_time=end_ns)

    def traceparent(self, span: Any) -> str | None:
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier.get(keys.HEADER_TRACEPARENT)

    def shutdown(self) -> None:
        shutdown = getattr(self.provider, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _otlp_grpc_exporter() -> Any:
    """OTLP over gRPC, plaintext (GIE: otlptracegrpc.WithInsecure()), to
    OTEL_EXPORTER_OTLP_ENDPOINT (default http://localhost:4317)."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        fix = (_PROTO_CLOBBERED_FIX if "InstrumentationScope" in str(e)
               else "pip install 'epp[tracing]'")
        raise ConfigError(f"OTEL_TRACES_EXPORTER=otlp: {e}; {fix}") from e
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", DEFAULT_OTLP_ENDPOINT)
    return OTLPSpanExporter(endpoint=endpoint, insecure=True)


class TraceObserver(Observer):
    """The trace of one request (a DecisionObserver with ``timings``): the request span,
    started at construction; at the end of scheduling its ``epp.scheduling`` child and one
    child per plugin call; ``traceparent`` upstream once placed; ended with the status
    when the request fails or completes."""

    timings = True

    def __init__(self, tracing: Tracing, request: LLMRequest) -> None:
        self.tracing = tracing
        self.span = tracing.start_request(request.headers)
        self._start_ns = 0
        self._calls: list[tuple[str, Plugin, int, int]] = []

    def started(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> None:
        self._start_ns = time.time_ns()

    def plugin_timed(self, extension_point: str, plugin: Plugin, seconds: float) -> None:
        end = time.time_ns()
        self._calls.append((extension_point, plugin, end - int(seconds * 1e9), end))

    def scheduled(self, request: LLMRequest, result: SchedulingResult, seconds: float) -> None:
        span, tracing = self.span, self.tracing
        if not span.is_recording():  # not sampled: nothing to record
            self._calls = []
            return
        end = time.time_ns()
        span.set_attribute("gen_ai.request.model", request.target_model)
        span.set_attribute("epp.request_id", request.request_id)
        tracing.child(span, "epp.scheduling", self._start_ns, end, {
            "epp.primary_profile": result.primary_profile,
            "epp.endpoints": ",".join(e.key for e in result.primary.endpoints)})
        calls, self._calls = self._calls, []
        for ep, plugin, start, stop in calls:
            tracing.child(span, f"{ep} {plugin.name}", start, stop,
                          {"epp.plugin_type": plugin.type_name})

    def decided(self, request: LLMRequest, result: SchedulingResult,
                set_headers: dict[str, str], response_headers: dict[str, str]) -> None:
        tp = self.tracing.traceparent(self.span)
        if tp:
            set_headers[keys.HEADER_TRACEPARENT] = tp

    def failed(self, request: LLMRequest, status: int, message: str | None) -> None:
        self.span.set_attribute("http.status_code", status)
        if message is not None:
            self.span.set_attribute("error.message", message)
        self.span.end()

    def completed(self, request: LLMRequest, status: int, aborted: bool,
                  usage: Usage | None, seconds: float) -> None:
        self.span.set_attribute("http.status_code", status)
        self.span.set_attribute("epp.aborted", aborted)
        self.span.end()
