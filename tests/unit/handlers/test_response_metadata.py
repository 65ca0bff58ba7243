"""The response side GIE's handlers add (pkg/epp/handlers/response.go, server.go): the
``x-went-into-resp-headers`` header on every response-headers answer, and the response's
dynamic metadata on the answer to its last message only (in memory, no Envoy)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.handlers.extproc import ExtProcServicer, ExtProcStream
from tests.unit.handlers.test_extproc import (
    BODY,
    BUF,
    FD,
    FakeContext,
    FakeDirector,
    Feed,
    body_msg,
    drive,
    header_map,
    headers_msg,
    observed,
    resp_body_msg,
    resp_headers_msg,
)

COST = {"envoy.lb": {"x-gateway-inference-request-cost": 10.0}}


class Hook:
    """A ``response_metadata`` hook that records its calls."""

    def __init__(self, result: Mapping[str, Mapping[str, Any]] | None = COST,
                 director: FakeDirector | None = None) -> None:
        self.result = result
        self.director = director
        self.calls: list[Any] = []

    def __call__(self, context: Any) -> Mapping[str, Mapping[str, Any]] | None:
        if self.director is not None:  # asked after the Director heard of the end
            assert self.director.calls[-1][0] == "done"
        self.calls.append(context)
        return self.result


def cost(resp: pb.ProcessingResponse) -> float | None:
    """The reported cost on ``resp``; None without (the routing metadata of the
    request-headers answer has none)."""
    if not resp.HasField("dynamic_metadata"):
        return None
    fields = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    if "x-gateway-inference-request-cost" not in fields:
        return None
    return float(fields["x-gateway-inference-request-cost"].number_value)


async def routed(hook: Hook | None, mode: int = FD,
                 resp_mode: int | None = None) -> tuple[ExtProcStream, FakeDirector]:
    d = FakeDirector()
    if hook is not None:
        hook.director = d
    s = ExtProcStream(d, 1 << 20, response_metadata=hook)
    await s.handle(headers_msg(mode, resp_mode=resp_mode))
    await s.handle(body_msg(BODY, True))
    return s, d


async def test_response_headers_answer_sets_x_went_into_resp_headers() -> None:
    s, _ = await routed(None)
    out = await s.handle(resp_headers_msg())
    assert header_map(out[0], "response_headers") == {"x-went-into-resp-headers": "true"}
    opt = out[0].response_headers.response.header_mutation.set_headers[0]
    assert opt.append_action == opt.OVERWRITE_IF_EXISTS_OR_ADD
    assert not out[0].HasField("dynamic_metadata")


async def test_x_went_into_resp_headers_next_to_plugin_headers_and_unrouted() -> None:
    class Session(FakeDirector):
        def on_response_headers(self, context: Any, status: int,
                                headers: Mapping[str, str]) -> Mapping[str, str] | None:
            return {"x-session-token": "abc"}

    s = ExtProcStream(Session(), 1 << 20)
    await s.handle(headers_msg())
    await s.handle(body_msg(BODY, True))
    out = await s.handle(resp_headers_msg())
    assert header_map(out[0], "response_headers") == {"x-went-into-resp-headers": "true",
                                                      "x-session-token": "abc"}
    # GIE answers every response-headers message so, routed or not.
    out = await ExtProcStream(FakeDirector(), 1 << 20).handle(resp_headers_msg())
    assert header_map(out[0], "response_headers") == {"x-went-into-resp-headers": "true"}


async def test_full_duplex_metadata_on_the_end_of_stream_chunk_only() -> None:
    hook = Hook()
    s, _ = await routed(hook)
    answers = list(await s.handle(resp_headers_msg()))
    for chunk in (b"data: 1\n\n", b"data: 2\n\n"):
        answers += await s.handle(resp_body_msg(chunk, False))
    assert hook.calls == []  # nothing asked before the end
    answers += await s.handle(resp_body_msg(b"", True))
    assert [cost(a) for a in answers] == [None, None, None, 10.0]
    assert answers[-1].response_body.response.body_mutation.streamed_response.end_of_stream
    assert hook.calls == ["ctx"]
    assert s.finish(clean=True) == "completed"
    assert hook.calls == ["ctx"]  # once


async def test_streamed_response_metadata_on_the_last_continue() -> None:
    """BUFFERED request, STREAMED response (epp envoy-config's BUFFERED shape)."""
    hook = Hook()
    s, _ = await routed(hook, BUF, ProcessingMode.STREAMED)
    await s.handle(resp_headers_msg())
    first = await s.handle(resp_body_msg(b'{"usage":', False))
    last = await s.handle(resp_body_msg(b"{}}", True))
    assert cost(first[0]) is None and cost(last[0]) == 10.0
    assert not last[0].response_body.response.HasField("body_mutation")  # still CONTINUE


async def test_grpc_response_metadata_on_the_trailers_answer() -> None:
    hook = Hook()
    s, _ = await routed(hook)
    await s.handle(resp_headers_msg())
    chunk = await s.handle(resp_body_msg(b"\x00\x00\x00\x00\x02ab", False))
    trailers = await s.handle(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert cost(chunk[0]) is None
    assert trailers[0].HasField("response_trailers") and cost(trailers[0]) == 10.0


async def test_header_only_response_metadata_on_the_headers_answer() -> None:
    hook = Hook()
    s, _ = await routed(hook)
    out = await s.handle(resp_headers_msg(eos=True))
    assert cost(out[0]) == 10.0
    assert header_map(out[0], "response_headers") == {"x-went-into-resp-headers": "true"}


@pytest.mark.parametrize("hook", [None, Hook(result=None), Hook(result={})])
async def test_no_metadata_no_field(hook: Hook | None) -> None:
    """Nothing to report: no answer carries dynamic_metadata (no bytes on the wire)."""
    s, _ = await routed(hook)
    answers = [*await s.handle(resp_headers_msg()),
               *await s.handle(resp_body_msg(b"x", True))]
    assert not any(a.HasField("dynamic_metadata") for a in answers)


async def test_aborted_response_is_not_asked() -> None:
    hook = Hook()
    s, _ = await routed(hook)
    await s.handle(resp_headers_msg())
    await s.handle(resp_body_msg(b"partial", False))
    assert s.finish() == "aborted"
    assert hook.calls == []


async def test_failing_hook_is_logged_and_the_response_passes(
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(context: Any) -> Mapping[str, Mapping[str, Any]] | None:
        raise RuntimeError("bug")

    s = ExtProcStream(FakeDirector(), 1 << 20, response_metadata=broken)
    await s.handle(headers_msg())
    await s.handle(body_msg(BODY, True))
    await s.handle(resp_headers_msg())
    out = await s.handle(resp_body_msg(b"done", True))
    assert out[0].response_body.response.body_mutation.streamed_response.body == b"done"
    assert not out[0].HasField("dynamic_metadata")
    assert "dynamic metadata failed" in caplog.text


async def test_servicer_coalesced_echo_carries_metadata_on_its_last_write() -> None:
    """Through ExtProcServicer: the full-duplex echo path (chunks may be coalesced) puts
    the metadata on the write that ends the body, and on no other."""
    hook = Hook()
    svc = ExtProcServicer(FakeDirector(), 1 << 20, response_metadata=hook)
    feed = Feed()
    feed.put(headers_msg(FD), body_msg(BODY, True), resp_headers_msg(),
             *(resp_body_msg(b"data: %d\n\n" % i, False) for i in range(5)),
             resp_body_msg(b"", True), None)
    written = await drive(svc, feed, FakeContext())
    bodies = [w for w in written if w.HasField("response_body")]
    assert b"".join(w.response_body.response.body_mutation.streamed_response.body
                    for w in bodies) == b"".join(b"data: %d\n\n" % i for i in range(5))
    assert [cost(w) for w in written] == [None] * (len(written) - 1) + [10.0]
    assert [w.HasField("dynamic_metadata") for w in written[1:]] == \
        [False] * (len(written) - 2) + [True]  # (the first: the routing answer)
    assert bodies[-1].response_body.response.body_mutation.streamed_response.end_of_stream
    assert hook.calls == ["ctx"]


async def test_split_path_computes_no_metadata() -> None:
    """The observer stream cannot answer Envoy: nothing is computed for it."""
    hook = Hook()
    svc = ExtProcServicer(FakeDirector(), 1 << 20, response_metadata=hook)
    route = Feed()
    route.put(headers_msg(FD, resp_mode=ProcessingMode.NONE), body_msg(BODY, True), None)
    await drive(svc, route, FakeContext((("x-epp-response-path", "observer"),)))
    token = next(iter(svc._awaiting))
    obs = Feed()
    obs.put(observed(headers_msg(FD, extra={"x-epp-observe": token})),
            observed(resp_headers_msg()), observed(resp_body_msg(b"{}", True)), None)
    assert await drive(svc, obs, FakeContext()) == []
    assert hook.calls == []
