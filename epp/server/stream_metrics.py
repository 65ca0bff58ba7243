"""llm-d's ``--enable-grpc-stream-metrics``: the ext_proc stream series around the
servicer (llm-d-router v0.10.0 pkg/epp/server/grpc_stream_metrics.go, a gRPC stream
interceptor; the series are epp.observability.metrics.GrpcStreamMetrics).

Each ``Process`` stream counts in ``llm_d_epp_extproc_streams_inflight`` while its handler
runs; when it ends, its duration goes to ``llm_d_epp_extproc_stream_duration_seconds`` and
``llm_d_epp_extproc_streams_total`` counts it under its gRPC status code, with Go's code
names (``OK``, ``Canceled``, ``ResourceExhausted``, …). Only ext_proc streams count: the
health service is registered on its own, as llm-d's interceptor skips it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Final, Protocol

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

#: grpc.StatusCode → Go's codes.Code.String().
GO_CODE_NAMES: Final = {
    grpc.StatusCode.OK: "OK",
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}


class StreamSeries(Protocol):
    """What is recorded (epp.observability.metrics.GrpcStreamMetrics)."""

    def started(self) -> None: ...

    def finished(self, code: str, seconds: float) -> None: ...


def _code(context: Any, default: grpc.StatusCode) -> str:
    """The stream's status code as Go names it: what the handler set, else ``default``."""
    code = None
    try:
        code = context.code()
    except (AttributeError, NotImplementedError):  # a stand-in context in tests
        pass
    if isinstance(code, int) and not isinstance(code, grpc.StatusCode):
        code = next((c for c in grpc.StatusCode if c.value[0] == code), None)
    if not isinstance(code, grpc.StatusCode):
        code = default
    return GO_CODE_NAMES.get(code, "Unknown")


class StreamMetricsExtProc:
    """An ExternalProcessor servicer recording the stream series around the one it
    wraps (whose ``Process`` is a coroutine: epp.server.drain.TrackedExtProc)."""

    def __init__(self, inner: Any, series: StreamSeries) -> None:
        self._inner = inner
        self._series = series

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> None:
        series = self._series
        series.started()
        start = time.perf_counter()
        default = grpc.StatusCode.UNKNOWN
        try:
            await self._inner.Process(request_iterator, context)
            default = grpc.StatusCode.OK
        except asyncio.CancelledError:  # the client went away: Go's status.FromContextError
            default = grpc.StatusCode.CANCELLED
            raise
        finally:
            series.finished(_code(context, default), time.perf_counter() - start)
