"""The ext_proc state machine, in memory (no gRPC, no Envoy)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Struct

from epp.errors import BadRequest, EppError, NoCapacity
from epp.handlers.extproc import MAX_CHUNK_BYTES, ExtProcServicer, ExtProcStream
from epp.handlers.protocol import Routing
from tests.polling import eventually

FD = ProcessingMode.FULL_DUPLEX_STREAMED
BUF = ProcessingMode.BUFFERED


class FakeDirector:
    def __init__(self, routing: Routing | None = None, error: Exception | None = None) -> None:
        self.routing = routing or Routing("10.0.0.1:8000", context="ctx")
        self.error = error
        self.calls: list[tuple[Any, ...]] = []

    async def route(self, headers: Mapping[str, str], body: bytes, has_body: bool,
                    subset: Sequence[str] | None) -> Routing:
        self.calls.append(("route", dict(headers), body, has_body, subset))
        if self.error:
            raise self.error
        return self.routing

    def on_response_headers(self, context: Any, status: int,
                            headers: Mapping[str, str]) -> Mapping[str, str] | None:
        self.calls.append(("resp_headers", context, status))
        return None

    def on_response_body(self, context: Any, chunk: bytes, end_of_stream: bool) -> bytes | None:
        self.calls.append(("resp_body", context, chunk, end_of_stream))
        return None

    def on_done(self, context: Any, aborted: bool) -> None:
        self.calls.append(("done", context, aborted))

    def on_rejected(self, headers: Mapping[str, str], status: int) -> None:
        self.calls.append(("rejected", status))

    def on_upstream_failure(self, context: Any, address: str) -> None:
        self.calls.append(("upstream_failure", context, address))


def headers_msg(mode: int = FD, eos: bool = False, extra: dict[str, str] | None = None,
                subset: list[str] | None = None, resp_mode: int | None = None) -> pb.ProcessingRequest:
    hs = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
    hs.update(extra or {})
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()]),
        end_of_stream=eos))
    msg.protocol_config.request_body_mode = mode  # type: ignore[assignment]
    msg.protocol_config.response_body_mode = resp_mode if resp_mode is not None else mode  # type: ignore[assignment]
    if subset is not None:
        st = Struct()
        st.update({"x-gateway-destination-endpoint-subset": subset})
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(st)
    return msg


def body_msg(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def header_map(resp: pb.ProcessingResponse, phase: str) -> dict[str, str]:
    common = getattr(resp, phase).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


BODY = orjson.dumps({"model": "m", "prompt": "hello"})


async def test_full_duplex_withholds_headers_until_body_complete() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    assert await s.handle(headers_msg()) == []
    assert await s.handle(body_msg(BODY[:10], False)) == []
    out = await s.handle(body_msg(BODY[10:], True))
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    hdr = out[0]
    assert hdr.request_headers.response.clear_route_cache
    assert header_map(hdr, "request_headers")["x-gateway-destination-endpoint"] == "10.0.0.1:8000"
    opts = hdr.request_headers.response.header_mutation.set_headers
    assert all(o.append_action == o.OVERWRITE_IF_EXISTS_OR_ADD for o in opts)
    assert "x-prefiller-host-port" in hdr.request_headers.response.header_mutation.remove_headers
    md = hdr.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert md["x-gateway-destination-endpoint"].string_value == "10.0.0.1:8000"
    sr = out[1].request_body.response.body_mutation.streamed_response
    assert sr.body == BODY and sr.end_of_stream
    assert d.calls[0][2] == BODY and d.calls[0][3] is True


async def test_full_duplex_large_body_is_chunked_at_62000() -> None:
    big = b"x" * (MAX_CHUNK_BYTES * 2 + 5)
    s = ExtProcStream(FakeDirector(), 1 << 20)
    await s.handle(headers_msg())
    out = await s.handle(body_msg(big, True))
    pieces = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert [len(p.body) for p in pieces] == [MAX_CHUNK_BYTES, MAX_CHUNK_BYTES, 5]
    assert [p.end_of_stream for p in pieces] == [False, False, True]
    assert b"".join(p.body for p in pieces) == big


async def test_full_duplex_rewritten_body_is_sent() -> None:
    d = FakeDirector(Routing("10.0.0.1:8000", body=b'{"model":"x"}', context=1))
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg())
    out = await s.handle(body_msg(BODY, True))
    assert out[1].request_body.response.body_mutation.streamed_response.body == b'{"model":"x"}'


async def test_full_duplex_trailers_end_the_body() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg())
    assert await s.handle(body_msg(BODY, False)) == []
    out = await s.handle(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert [r.WhichOneof("response") for r in out] == [
        "request_headers", "request_body", "request_trailers"]


async def test_header_only_request_routes_at_once() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    out = await s.handle(headers_msg(eos=True, extra={":method": "GET", ":path": "/v1/models"}))
    assert len(out) == 1 and header_map(out[0], "request_headers")[
        "x-gateway-destination-endpoint"] == "10.0.0.1:8000"
    assert d.calls[0][3] is False


async def test_buffered_answers_headers_then_routes_in_body() -> None:
    d = FakeDirector(Routing("10.0.0.2:8000", set_headers={"x-prefiller-host-port": "10.0.0.9:8000"},
                             context=1))
    s = ExtProcStream(d, 1 << 20)
    out = await s.handle(headers_msg(BUF))
    assert len(out) == 1 and out[0].WhichOneof("response") == "request_headers"
    removed = list(out[0].request_headers.response.header_mutation.remove_headers)
    assert "x-gateway-destination-endpoint" in removed
    # end_of_stream false (trailers follow): must not wait.
    out = await s.handle(body_msg(BODY, False))
    assert len(out) == 1
    hm = header_map(out[0], "request_body")
    assert hm == {"x-gateway-destination-endpoint": "10.0.0.2:8000",
                  "x-prefiller-host-port": "10.0.0.9:8000"}
    assert out[0].request_body.response.clear_route_cache
    assert out[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == "10.0.0.2:8000"


async def test_buffered_body_rewrite_sets_content_length() -> None:
    d = FakeDirector(Routing("10.0.0.2:8000", body=b'{"model":"longer"}', context=1))
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg(BUF))
    out = await s.handle(body_msg(BODY, True))
    assert out[0].request_body.response.body_mutation.body == b'{"model":"longer"}'
    assert header_map(out[0], "request_body")["content-length"] == str(len(b'{"model":"longer"}'))


@pytest.mark.parametrize("mode", [FD, BUF])
async def test_body_over_limit_is_413(mode: int) -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 100)
    await s.handle(headers_msg(mode))
    out = await s.handle(body_msg(b"x" * 101, mode == BUF))
    assert out[0].immediate_response.status.code == 413
    assert s.closed and d.calls == [("rejected", 413)]
    assert s.finish() == "rejected"
    err = orjson.loads(out[0].immediate_response.body)["error"]
    assert err["code"] == 413 and "100 bytes" in err["message"]


@pytest.mark.parametrize("exc,status", [(BadRequest("no model"), 400), (NoCapacity("full"), 429),
                                        (RuntimeError("boom"), 500)])
async def test_director_errors_become_immediate_responses(exc: Exception, status: int) -> None:
    s = ExtProcStream(FakeDirector(error=exc), 1 << 20)
    await s.handle(headers_msg())
    out = await s.handle(body_msg(BODY, True))
    ir = out[0].immediate_response
    assert ir.status.code == status and s.closed
    body = orjson.loads(ir.body)
    assert body["error"]["code"] == status and body["error"]["message"]
    assert any(h.header.key == "content-type" for h in ir.headers.set_headers)


async def test_subset_hint_is_passed() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg(subset=["10.0.0.1:8000", "10.0.0.3:8000"]))
    await s.handle(body_msg(BODY, True))
    assert d.calls[0][4] == ["10.0.0.1:8000", "10.0.0.3:8000"]


async def test_no_subset_hint_is_none() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg())
    await s.handle(body_msg(BODY, True))
    assert d.calls[0][4] is None


async def test_response_passthrough_full_duplex_and_done_once() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg())
    await s.handle(body_msg(BODY, True))
    rh = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=":status", raw_value=b"200"),
        HeaderValue(key="content-type", raw_value=b"text/event-stream")])))
    out = await s.handle(rh)
    assert out[0].WhichOneof("response") == "response_headers"
    out = await s.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1\n\n")))
    assert out[0].response_body.response.body_mutation.streamed_response.body == b"data: 1\n\n"
    out = await s.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
    assert out[0].response_body.response.body_mutation.streamed_response.end_of_stream
    assert s.finish() == "completed"
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", False)]
    assert ("resp_headers", "ctx", 200) in d.calls


async def test_response_buffered_mode_continues() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg(BUF, resp_mode=ProcessingMode.STREAMED))
    await s.handle(body_msg(BODY, True))
    out = await s.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True)))
    assert out[0].WhichOneof("response") == "response_body"
    assert not out[0].response_body.response.HasField("body_mutation")


async def test_stream_aborted_reports_aborted() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg())
    await s.handle(body_msg(BODY, True))
    assert s.finish() == "aborted"
    s.finish()
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", True)]


async def test_callback_failure_after_routing_passes_response_through() -> None:
    class Failing(FakeDirector):
        def on_response_body(self, context: Any, chunk: bytes, end_of_stream: bool) -> bytes | None:
            raise RuntimeError("bug")

    d = Failing()
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg())
    await s.handle(body_msg(BODY, True))
    out = await s.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"abc", end_of_stream=True)))
    assert out[0].response_body.response.body_mutation.streamed_response.body == b"abc"
    assert not s.closed
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", False)]


async def test_clean_end_after_full_declared_body_counts_as_completed() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg())
    await s.handle(body_msg(BODY, True))
    await s.handle(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=":status", raw_value=b"200"),
        HeaderValue(key="content-length", raw_value=b"5")]))))
    await s.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"hello")))
    assert s.finish(clean=True) == "completed"
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", False)]


async def test_clean_end_with_partial_body_is_aborted() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg())
    await s.handle(body_msg(BODY, True))
    await s.handle(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=":status", raw_value=b"200"),
        HeaderValue(key="content-length", raw_value=b"50")]))))
    await s.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"hello")))
    assert s.finish(clean=True) == "aborted"
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", True)]


# ------------------------------------------------------------ split response path
class FakeContext:
    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


SPLIT = FakeContext((("x-epp-response-path", "observer"),))


class Feed:
    """An async request iterator the test feeds message by message."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()

    def put(self, *msgs: pb.ProcessingRequest | None) -> None:
        for m in msgs:
            self.queue.put_nowait(m)

    def __aiter__(self) -> Feed:
        return self

    async def __anext__(self) -> pb.ProcessingRequest:
        m = await self.queue.get()
        if m is None:
            raise StopAsyncIteration
        return m


class StreamContext:
    """What grpc.aio gives a read()/write() handler: ``context``'s metadata, ``feed``'s
    messages (None = the end of the stream), the answers collected."""

    def __init__(self, context: FakeContext, feed: Feed) -> None:
        self._context, self._feed = context, feed
        self.written: list[pb.ProcessingResponse] = []

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._context.invocation_metadata()

    async def read(self) -> Any:
        m = await self._feed.queue.get()
        return grpc.aio.EOF if m is None else m

    async def write(self, msg: pb.ProcessingResponse) -> None:
        self.written.append(msg)


async def drive(servicer: Any, feed: Feed, context: FakeContext) -> list[pb.ProcessingResponse]:
    ctx = StreamContext(context, feed)
    await servicer.Process(feed, ctx)
    return ctx.written


def observed(msg: pb.ProcessingRequest) -> pb.ProcessingRequest:
    msg.observability_mode = True
    return msg


def resp_headers_msg(status: int = 200, eos: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=":status", raw_value=str(status).encode())]), end_of_stream=eos))


def resp_body_msg(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


async def test_split_path_routes_with_a_token_and_the_observer_completes_the_request() -> None:
    d = FakeDirector()
    outcomes: list[str] = []
    svc = ExtProcServicer(d, 1 << 20, on_stream_end=outcomes.append)
    route = Feed()
    route.put(headers_msg(FD, resp_mode=ProcessingMode.NONE), body_msg(BODY, True))
    task = asyncio.create_task(drive(svc, route, SPLIT))
    await eventually(lambda: svc._awaiting, interval=0)  # routed: waiting for its observer
    token = next(iter(svc._awaiting))
    route.put(None)  # Envoy ends the routing stream: the request is not over
    answers = await task
    hdrs = header_map(answers[0], "request_headers")
    assert hdrs["x-epp-observe"] == token and hdrs["x-gateway-destination-endpoint"] == "10.0.0.1:8000"
    assert "x-epp-observe" not in answers[0].request_headers.response.header_mutation.remove_headers
    assert outcomes == [] and not any(c[0] == "done" for c in d.calls)
    # The observer stream: request headers (with the token), then the response.
    obs = Feed()
    obs.put(observed(headers_msg(FD, extra={"x-epp-observe": token})),
            observed(resp_headers_msg()), observed(resp_body_msg(b'{"usage": {}}', False)),
            observed(resp_body_msg(b"", True)), None)
    assert await drive(svc, obs, FakeContext()) == []  # nothing is sent back
    assert [c[0] for c in d.calls] == ["route", "resp_headers", "resp_body", "resp_body", "done"]
    assert d.calls[-1] == ("done", "ctx", False) and outcomes == ["completed"]
    assert svc._awaiting == {}


async def test_split_path_without_an_observer_counts_the_request_aborted(
        caplog: pytest.LogCaptureFixture) -> None:
    d = FakeDirector()
    outcomes: list[str] = []
    svc = ExtProcServicer(d, 1 << 20, on_stream_end=outcomes.append, observer_grace_s=0.05)
    route = Feed()
    route.put(headers_msg(FD, resp_mode=ProcessingMode.NONE), body_msg(BODY, True), None)
    await drive(svc, route, SPLIT)
    assert outcomes == []
    await eventually(lambda: outcomes, what="the observer grace (50 ms) to run out")
    assert outcomes == ["aborted"] and d.calls[-1] == ("done", "ctx", True)
    assert "no response observer stream arrived" in caplog.text
    # An observer with an unknown (or forged) token is drained and changes nothing.
    obs = Feed()
    obs.put(observed(headers_msg(FD, extra={"x-epp-observe": "forged"})),
            observed(resp_body_msg(b"", True)), None)
    assert await drive(svc, obs, FakeContext()) == [] and outcomes == ["aborted"]


async def test_split_path_rejection_and_observer_abort() -> None:
    outcomes: list[str] = []
    # Rejected before routing: no token is registered, the stream ends as usual.
    svc = ExtProcServicer(FakeDirector(error=EppError("nope", status=429)), 1 << 20,
                          on_stream_end=outcomes.append)
    route = Feed()
    route.put(headers_msg(FD), body_msg(BODY, True), None)
    answers = await drive(svc, route, SPLIT)
    assert answers[0].HasField("immediate_response") and outcomes == ["rejected"]
    assert svc._awaiting == {}
    # The observer stream closes before the response ended (client gone): aborted.
    d = FakeDirector()
    svc = ExtProcServicer(d, 1 << 20, on_stream_end=outcomes.append)
    route = Feed()
    route.put(headers_msg(FD), body_msg(BODY, True), None)
    await drive(svc, route, SPLIT)
    token = next(iter(svc._awaiting))
    obs = Feed()
    obs.put(observed(headers_msg(FD, extra={"x-epp-observe": token})),
            observed(resp_headers_msg()), observed(resp_body_msg(b"data: x\n\n", False)), None)
    await drive(svc, obs, FakeContext())
    assert outcomes[-1] == "aborted" and d.calls[-1] == ("done", "ctx", True)


async def test_inline_path_sets_no_token() -> None:
    d = FakeDirector()
    svc = ExtProcServicer(d, 1 << 20)
    route = Feed()
    route.put(headers_msg(FD), body_msg(BODY, True), resp_headers_msg(),
              resp_body_msg(b"{}", True), None)
    answers = await drive(svc, route, FakeContext())
    assert "x-epp-observe" not in header_map(answers[0], "request_headers")
    assert "x-epp-observe" in answers[0].request_headers.response.header_mutation.remove_headers
    assert d.calls[-1] == ("done", "ctx", False)


async def test_split_path_warns_once_that_response_headers_cannot_be_set(
        caplog: pytest.LogCaptureFixture) -> None:
    class SessionDirector(FakeDirector):
        def on_response_headers(self, context: Any, status: int,
                                headers: Mapping[str, str]) -> Mapping[str, str] | None:
            return {"x-session-token": "abc"}

    svc = ExtProcServicer(SessionDirector(), 1 << 20)
    for _ in range(2):
        route = Feed()
        route.put(headers_msg(FD), body_msg(BODY, True), None)
        await drive(svc, route, SPLIT)
        token = next(iter(svc._awaiting))
        obs = Feed()
        obs.put(observed(headers_msg(FD, extra={"x-epp-observe": token})),
                observed(resp_headers_msg()), observed(resp_body_msg(b"{}", True)), None)
        await drive(svc, obs, FakeContext())
    assert caplog.text.count("cannot reach clients on the split response path") == 1


async def test_split_path_is_refused_where_observers_cannot_be_matched(
        caplog: pytest.LogCaptureFixture) -> None:
    """--workers N fronts: the routing stream is served as the whole request."""
    d = FakeDirector()
    outcomes: list[str] = []
    svc = ExtProcServicer(d, 1 << 20, on_stream_end=outcomes.append, observer_supported=False)
    for _ in range(2):
        route = Feed()
        route.put(headers_msg(FD), body_msg(BODY, True), None)
        answers = await drive(svc, route, SPLIT)
        assert "x-epp-observe" not in header_map(answers[0], "request_headers")
    assert svc._awaiting == {} and outcomes == ["aborted", "aborted"]
    assert caplog.text.count("which needs --workers 1") == 1


async def test_second_request_headers_ends_the_routed_request_once() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    first = await s.handle(headers_msg(eos=True))
    assert first[0].HasField("request_headers")
    second = await s.handle(headers_msg(eos=True))
    assert second[0].immediate_response.status.code == 400
    assert len([c for c in d.calls if c[0] == "route"]) == 1
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", True)]
    s.finish(clean=True)
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", True)]


@pytest.mark.parametrize("mode", [FD, BUF])
async def test_too_many_headers_for_envoy_is_431_not_routed(mode: int) -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20, max_headers=10)
    extra = {f"x-h{i}": "v" for i in range(8)}  # 3 base + 8 = 11 headers
    out = await s.handle(headers_msg(mode, extra=extra))
    assert out[0].immediate_response.status.code == 431
    assert b"max_headers_count" in out[0].immediate_response.body
    assert ("rejected", 431) in d.calls and not [c for c in d.calls if c[0] == "route"]


async def test_routing_header_that_would_cross_the_limit_is_431_and_completed() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20, max_headers=10)
    extra = {f"x-h{i}": "v" for i in range(7)}  # 10 headers: adding the destination crosses
    assert await s.handle(headers_msg(BUF, extra=extra))
    out = await s.handle(body_msg(BODY, eos=True))
    assert out[0].immediate_response.status.code == 431
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", True)]
    # Full duplex: Envoy strips content-length, which leaves room for the destination.
    s = ExtProcStream(FakeDirector(), 1 << 20, max_headers=10)
    extra = {f"x-h{i}": "v" for i in range(6)} | {"content-length": str(len(BODY))}
    assert await s.handle(headers_msg(FD, extra=extra)) == []
    out = await s.handle(body_msg(BODY, eos=True))
    assert out[0].HasField("request_headers")


def _response_headers(status: int, flags: int | None, address: str | None) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=HeaderMap(
        headers=[HeaderValue(key=":status", raw_value=str(status).encode())])))
    if flags is not None:
        attrs: dict[str, object] = {"response.flags": flags,
                                    "response.code_details": "upstream_reset_before_response_"
                                    "started{remote_connection_failure}"}
        if address is not None:
            attrs["upstream.address"] = address
        msg.attributes["envoy.filters.http.ext_proc"].update(attrs)
    return msg


async def test_envoy_connect_failure_attributes_name_the_endpoint() -> None:
    d = FakeDirector(Routing("10.0.0.1:8000,10.0.0.2:8000", context="ctx"))
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg(eos=True))
    await s.handle(_response_headers(503, 0x20, "10.0.0.2:8000"))
    assert ("upstream_failure", "ctx", "10.0.0.2:8000") in d.calls
    # Without the address: the primary. Other flags (e.g. 0x10, a remote reset): nothing.
    d2 = FakeDirector(Routing("10.0.0.1:8000,10.0.0.2:8000", context="c2"))
    s2 = ExtProcStream(d2, 1 << 20)
    await s2.handle(headers_msg(eos=True))
    await s2.handle(_response_headers(503, 0x20 | 0x4, None))
    assert ("upstream_failure", "c2", "10.0.0.1:8000") in d2.calls
    for flags in (None, 0x10, 0):
        d3 = FakeDirector()
        s3 = ExtProcStream(d3, 1 << 20)
        await s3.handle(headers_msg(eos=True))
        await s3.handle(_response_headers(200 if flags is None else 503, flags, "10.0.0.1:8000"))
        assert not [c for c in d3.calls if c[0] == "upstream_failure"]


def _lean_headers(eos: bool = False) -> pb.ProcessingRequest:
    msg = headers_msg(FD, eos=eos)
    msg.protocol_config.response_body_mode = ProcessingMode.NONE  # type: ignore[assignment]
    return msg


@pytest.mark.parametrize("clean", [True, False])
async def test_lean_shape_completes_at_stream_end_after_response_headers(clean: bool) -> None:
    """Lean shape (response body NONE): Envoy ends the stream when the HTTP request ends,
    cleanly or not; the request is completed exactly once, with its status."""
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    assert await s.handle(_lean_headers()) == []
    await s.handle(body_msg(BODY, eos=True))
    out = await s.handle(_response_headers(200, None, None))
    assert out[0].HasField("response_headers")
    assert not [c for c in d.calls if c[0] == "done"]
    assert s.finish(clean=clean) == "completed"
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", False)]
    s.finish(clean=clean)
    assert len([c for c in d.calls if c[0] == "done"]) == 1


async def test_lean_shape_without_a_response_is_aborted() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    await s.handle(_lean_headers())
    await s.handle(body_msg(BODY, eos=True))
    assert s.finish(clean=True) == "aborted"
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", True)]


async def test_gie_shape_stream_end_mid_response_is_still_aborted() -> None:
    d = FakeDirector()
    s = ExtProcStream(d, 1 << 20)
    await s.handle(headers_msg(FD))
    await s.handle(body_msg(BODY, eos=True))
    await s.handle(_response_headers(200, None, None))
    assert s.finish(clean=False) == "aborted"
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", True)]


async def test_queued_response_chunks_are_coalesced_into_one_answer() -> None:
    """GIE's shape: chunks that queued up while an answer was being written go back as
    one StreamedBodyResponse; bytes and order exact, end_of_stream once, at the end."""
    d = FakeDirector()
    outcomes: list[str] = []
    svc = ExtProcServicer(d, 1 << 20, on_stream_end=outcomes.append)
    feed = Feed()
    chunks = [f"data: {i}\n\n".encode() for i in range(5)]
    feed.put(headers_msg(FD), body_msg(BODY, eos=True), resp_headers_msg(),
             *[resp_body_msg(c, i == 4) for i, c in enumerate(chunks)],
             pb.ProcessingRequest(response_trailers=pb.HttpTrailers()), None)
    answers = await drive(svc, feed, FakeContext())
    echoes = [a.response_body.response.body_mutation.streamed_response for a in answers
              if a.HasField("response_body")]
    assert b"".join(e.body for e in echoes) == b"".join(chunks)
    assert [e.end_of_stream for e in echoes] == [False] * (len(echoes) - 1) + [True]
    assert len(echoes) < len(chunks)
    assert answers[-1].HasField("response_trailers")
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", False)]
    assert outcomes == ["completed"]


async def test_first_response_chunk_is_answered_before_the_next_arrives() -> None:
    d = FakeDirector()
    svc = ExtProcServicer(d, 1 << 20)
    feed = Feed()
    ctx = StreamContext(FakeContext(), feed)
    task = asyncio.create_task(svc.Process(feed, ctx))
    feed.put(headers_msg(FD), body_msg(BODY, eos=True), resp_headers_msg(),
             resp_body_msg(b"first", False))

    def bodies() -> list[bytes]:
        return [a.response_body.response.body_mutation.streamed_response.body
                for a in ctx.written if a.HasField("response_body")]

    # Answered while the next chunk has not even been sent.
    await eventually(bodies, interval=0)
    assert bodies() == [b"first"]
    feed.put(resp_body_msg(b"second", True), None)
    await task
    assert [c for c in d.calls if c[0] == "done"] == [("done", "ctx", False)]


async def test_first_lean_stream_names_plugins_that_need_response_bodies(
        caplog: pytest.LogCaptureFixture) -> None:
    svc = ExtProcServicer(FakeDirector(), 1 << 20, body_consumers=["usage-meter"])
    for _ in range(2):
        feed = Feed()
        feed.put(_lean_headers(), body_msg(BODY, eos=True), None)
        await drive(svc, feed, FakeContext())
    warnings = [r for r in caplog.records if "usage-meter" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"
