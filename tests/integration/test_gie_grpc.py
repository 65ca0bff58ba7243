"""GIE v1.5.0 test/integration/epp/grpc_test.go (TestFullDuplexStreamed_GRPC_…, with
common_tests.go and harness.go) through real Envoy → `epp serve` → fake vLLM gRPC pods.

The harness (tests/integration/gie_harness.py, ``addresses`` layout) puts Go's pod
``192.168.1.{idx+1}:8000`` at ``127.0.0.{idx+1}:<port>``: a gRPC server (vLLM's
``VllmEngine`` Generate and Embed) on that port, its vLLM ``/metrics`` on another. The EPP
runs GIE's config with the ``vllmgrpc-parser`` (``testConfigWithVllmGRPCParser``, copied
under tests/fixtures/gie-v1.5.0). A gRPC client calls Envoy; where Go sends bytes no gRPC
client sends (a body split in two frames, a payload that is not a gRPC frame), an HTTP/1.1
client posts them with ``content-type: application/grpc``.

What Go checks on the ext_proc stream and what is checked here instead:

- ``ExpectGRPCRouteTo(endpoint, prompt, method)``: the request reaches pod ``idx`` with its
  message byte for byte, ``x-gateway-destination-endpoint`` naming the pod, and Go's
  ``hi: mom`` / ``x-request-id`` headers kept (Go also echoes ``:path``: a no-op).
- ``ExpectReject(code, "inference error: <Code> - <msg>")``: Envoy answers a gRPC request
  that the EPP refused with a gRPC status whose message is the EPP's body; the body is our
  JSON error (design.md §2, not Go's text) and its message names what Go's names.
- ``ExpectBufferResp`` / the response header answer: the client gets the pod's messages
  unchanged and ``x-went-into-resp-headers: true`` among the response headers.
- ``wantMetrics``: the EPP's /metrics. Go runs this suite in its standard mode with the
  base resources (``inference-objective-with-priority-4`` gives priority 4); here the
  EPP reads the same InferenceObjectives from ``--objectives-file``.

Differences from Go, each asserted as this EPP behaves:

- "no backend pods available": 503 (design.md §2: no candidate endpoints), Go 500
  ("Internal - no pods available in datastore"); test_gie_hermetic.py keeps the strict
  xfail for it.
- ``inference_pool_ready_pods`` is labelled ``name="static"`` (no InferencePool).
- Reject bodies: JSON ``{"error": {"message", "type", "code"}}``, not Go's text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import unquote

import aiohttp
import grpc
import pytest

from epp.parsing import vllm_grpc as g
from tests.integration.gie_harness import (
    EMBED,
    FIXTURES,
    GENERATE,
    INPUT_TOKEN_BOUNDS,
    MODEL_SQL_LORA_TARGET,
    OUTPUT_TOKEN_BOUNDS,
    SUBSET_HEADER,
    GrpcReply,
    P,
    Pod,
    Reply,
    Stack,
    Stacks,
    client_session,
    error_message,
    expect_error,
    expect_ready_pods,
    expect_request_total,
    expect_routed,
    expect_token_histogram,
    send,
    stacks,
)

pytestmark = pytest.mark.integration

# grpc_test.go's const testConfigWithVllmGRPCParser.
CONFIG = (FIXTURES / "test/integration/epp/inline/"
          "grpc_test.testConfigWithVllmGRPCParser.yaml").read_text()

OBJECTIVE_PRIORITY_4 = "inference-objective-with-priority-4"  # Go's hermetic_test.go
GRPC_HEADERS = {"content-type": "application/grpc", "te": "trailers"}

GenerateStreamChunk = g.message_class("GenerateStreamChunk")
GenerateComplete = g.message_class("GenerateComplete")
TokenizedInput = g.message_class("TokenizedInput")
EmbedResponse = g.message_class("EmbedResponse")

#: What the pods answer unless a case says otherwise.
CHUNK_1_TO_7 = g.GenerateResponse(
    chunk=GenerateStreamChunk(token_ids=[1, 2, 3, 4, 5, 6, 7])).SerializeToString()
COMPLETE_7_10 = g.GenerateResponse(
    complete=GenerateComplete(prompt_tokens=7, completion_tokens=10)).SerializeToString()
CHUNK_1_TO_3 = g.GenerateResponse(
    chunk=GenerateStreamChunk(token_ids=[1, 2, 3])).SerializeToString()
EMBEDDING = EmbedResponse(embedding=[0.5, 0.25], embedding_dim=2).SerializeToString()
REPLY = GrpcReply(generate=(CHUNK_1_TO_7,), embed=EMBEDDING)


def request_proto(prompt: str, method: str, stream: bool = False) -> bytes:
    """Go's integration.GRPCRequestProto, serialised (an empty message for any other
    method, as Go's CreateGrpcPayload of a nil message)."""
    if method == GENERATE:
        return g.GenerateRequest(text=prompt, stream=stream).SerializeToString()
    if method == EMBED:
        return g.EmbedRequest(tokenized=TokenizedInput(original_text=prompt)
                              ).SerializeToString()
    return b""


def metadata(objective: str = "") -> tuple[tuple[str, str], ...]:
    """Go's generateHeaders for gRPC requests: hi: mom, the request id, the objective."""
    md = [("hi", "mom"), ("x-request-id", "test-request-id")]
    if objective:
        md.append(("x-gateway-inference-objective", objective))
    return tuple(md)


class Starter:
    """``await stack(pods)``: gRPC pods; ``await stack.http(pods, reply)``: HTTP/1.1 pods
    (Go's response cases that no gRPC server answers). Both run the vllmgrpc config in
    Go's standard mode (GIE's hermetic InferenceObjectives, ``--objectives-file``)."""

    def __init__(self, stacks: Stacks) -> None:
        self._stacks = stacks

    async def __call__(self, pods: list[Pod], reply: GrpcReply = REPLY) -> Stack:
        return await self._stacks.start(pods, CONFIG, grpc_reply=reply, layout="addresses",
                                        objectives=True)

    async def http(self, pods: list[Pod], reply: Reply | None = None) -> Stack:
        return await self._stacks.start(pods, CONFIG, reply, layout="addresses",
                                        objectives=True)


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Starter]:
    async with stacks(tmp_path) as s:
        yield Starter(s)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with client_session() as s:
        yield s


async def call(h: Stack, method: str, message: bytes, *, objective: str = "",
               extra: tuple[tuple[str, str], ...] = ()) -> tuple[list[bytes], dict[str, str]]:
    """One gRPC call through Envoy: the response messages and the initial metadata."""
    async with grpc.aio.insecure_channel(h.target) as channel:
        md = metadata(objective) + extra
        if method == EMBED:
            unary_unary: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = \
                channel.unary_unary(method)
            unary = unary_unary(message, metadata=md, timeout=20)
            replies = [await unary]
            initial = await unary.initial_metadata()
        else:
            unary_stream: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = \
                channel.unary_stream(method)
            stream = unary_stream(message, metadata=md, timeout=20)
            replies = [r async for r in stream]
            initial = await stream.initial_metadata()
    return replies, {k: str(v) for k, v in initial or ()}


async def refused(h: Stack, method: str, message: bytes, *, objective: str = "",
                  extra: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call(h, method, message, objective=objective, extra=extra)
    return e.value


def refusal_message(e: grpc.aio.AioRpcError) -> str:
    """The EPP's message in a gRPC status Envoy made of its immediate response (the body,
    our JSON error, as the status message)."""
    return error_message(unquote(e.details() or "").encode())


def expect_grpc_routed(h: Stack, idx: int, message: bytes) -> None:
    """Go: ExpectGRPCRouteTo(endpoint, prompt, method)."""
    seen = expect_routed(h, idx, message)
    assert seen.path in (GENERATE, EMBED)


# --- standard routing logic --------------------------------------------------------------


@pytest.mark.parametrize("method", [GENERATE, EMBED], ids=["generate", "embed"])
async def test_select_lower_queue_and_kv_cache(stack: Starter, session: aiohttp.ClientSession,
                                               method: str) -> None:
    """Go: "select lower queue and kv cache" and "… for embedRequest"."""
    h = await stack([P(3, 0.2), P(0, 0.1), P(10, 0.2)])
    message = request_proto("test1", method)
    replies, _ = await call(h, method, message, objective=OBJECTIVE_PRIORITY_4)
    assert replies == ([EMBEDDING] if method == EMBED else [CHUNK_1_TO_7])
    expect_grpc_routed(h, 1, message)
    assert h.seen[0].headers["x-gateway-inference-objective"] == OBJECTIVE_PRIORITY_4
    await expect_request_total(session, h, "", "", priority=4)
    expect_ready_pods(await h.metrics(session), 3)


async def test_select_lower_queue_with_streaming_request(
        stack: Starter, session: aiohttp.ClientSession) -> None:
    h = await stack([P(3, 0.2), P(0, 0.1), P(10, 0.2)])
    message = request_proto("test-stream", GENERATE, stream=True)
    await call(h, GENERATE, message, objective=OBJECTIVE_PRIORITY_4)
    expect_grpc_routed(h, 1, message)
    await expect_request_total(session, h, "", "", priority=4)
    expect_ready_pods(await h.metrics(session), 3)


async def test_do_not_shed_requests_by_default(stack: Starter,
                                               session: aiohttp.ClientSession) -> None:
    h = await stack([P(6, 0.2, "foo", "bar"), P(0, 0.85, "foo"), P(10, 0.9, "foo")])
    message = request_proto("test2", GENERATE)
    await call(h, GENERATE, message)
    expect_grpc_routed(h, 0, message)  # the lowest saturated
    await expect_request_total(session, h, "", "")


# --- error handling & edge cases ---------------------------------------------------------


async def test_invalid_grpc_payload(stack: Starter, session: aiohttp.ClientSession) -> None:
    """Go: 400 "parsing gRPC payload for Generate: not able to parse payload". The body is
    not a gRPC frame (no gRPC client sends that): posted over HTTP/1.1; Envoy answers the
    gRPC request with a gRPC status carrying the EPP's body."""
    h = await stack([P(0, 0.2, "foo", "bar")])
    status, headers, body = await send(session, h, {"hi": "mom", **GRPC_HEADERS},
                                       b"plain text not grpc payload style", path=GENERATE)
    assert h.seen == []
    # Envoy's local reply to a gRPC request: HTTP 200, trailers-only, grpc-status from the
    # HTTP status (400 → 13 INTERNAL), grpc-message the EPP's body.
    assert status == 200 and body == b"", (status, headers, body)
    assert headers["grpc-status"] == str(grpc.StatusCode.INTERNAL.value[0])
    message = error_message(unquote(headers["grpc-message"]).encode())
    assert message.startswith("parsing gRPC payload for Generate: not able to parse payload")


async def test_invalid_grpc_payload_grpc_client(stack: Starter) -> None:
    """The same refusal as a gRPC client sees it (a frame whose message is not a
    GenerateRequest with an input)."""
    h = await stack([P(0, 0.2, "foo", "bar")])
    e = await refused(h, GENERATE, b"plain text not grpc payload style")
    assert e.code() is grpc.StatusCode.INTERNAL  # Envoy's mapping of the 400
    assert refusal_message(e).startswith("parsing gRPC payload for Generate")
    assert h.seen == []


async def test_unsupported_grpc_method(stack: Starter) -> None:
    """Go: 400 "unsupported gRPC path: unsupportedMethod" (Go's path has no leading
    slash, which no HTTP/2 client sends)."""
    h = await stack([P(0, 0.2, "foo", "bar")])
    e = await refused(h, "/unsupportedMethod", request_proto("test2", "/unsupportedMethod"))
    assert e.code() is grpc.StatusCode.INTERNAL
    assert refusal_message(e).startswith("unsupported gRPC path: /unsupportedMethod")
    assert h.seen == []


async def test_split_body_across_chunks(stack: Starter, session: aiohttp.ClientSession) -> None:
    """Go sends the framed GenerateRequest in two body messages; over HTTP/1.1 the client
    writes the two halves separately (Envoy may still coalesce them)."""
    h = await stack([P(4, 0.2, "foo", "bar"), P(4, 0.85, "foo")])
    message = request_proto("test3", GENERATE)
    framed = g.frame(message)
    status, headers, body = await send(
        session, h, {"hi": "mom", "x-request-id": "test-request-id", **GRPC_HEADERS},
        framed[:len(framed) // 2], framed[len(framed) // 2:], path=GENERATE)
    assert status == 200, (headers, body)
    assert body == g.frame(CHUNK_1_TO_7)
    expect_grpc_routed(h, 0, message)
    await expect_request_total(session, h, "", "")


async def test_no_backend_pods_available(stack: Starter, session: aiohttp.ClientSession) -> None:
    """Go: 500 "Internal - no pods available in datastore"; here 503 (design.md §2: no
    candidate endpoints), as test_gie_hermetic.py's strict xfail records."""
    h = await stack.http([])
    status, headers, body = await send(session, h, {"content-type": "application/json"},
                                       method="GET", path="/")
    await expect_error(status, headers, body, 503)
    assert error_message(body) == "no ready endpoints in the pool"


# --- subsetting & metadata ---------------------------------------------------------------


async def test_subsetting_select_best_from_subset(stack: Starter) -> None:
    h = await stack([P(0, 0.2, "foo"), P(0, 0.1, "foo", MODEL_SQL_LORA_TARGET),
                     P(10, 0.2, "foo")])
    message = request_proto("test2", GENERATE)
    await call(h, GENERATE, message, extra=((SUBSET_HEADER, ",".join(h.addresses)),))
    expect_grpc_routed(h, 1, message)


async def test_subsetting_partial_match(stack: Starter) -> None:
    h = await stack([P(0, 0.2, "foo"), P(0, 0.1, "foo", MODEL_SQL_LORA_TARGET),
                     P(10, 0.2, "foo")])
    message = request_proto("test2", GENERATE)
    await call(h, GENERATE, message, extra=((SUBSET_HEADER, h.key(2)),))
    expect_grpc_routed(h, 2, message)  # the only one in the subset, despite its load


async def test_subsetting_no_pods_match(stack: Starter) -> None:
    """Go: 503 "ServiceUnavailable - failed to find endpoint candidates for serving the
    request"."""
    h = await stack([P(0, 0.2, "foo"), P(0, 0.1, "foo", MODEL_SQL_LORA_TARGET)])
    e = await refused(h, GENERATE, request_proto("test2", GENERATE),
                      extra=((SUBSET_HEADER, "192.168.1.99:8000"),))
    assert e.code() is grpc.StatusCode.UNAVAILABLE  # Envoy's mapping of the 503
    assert refusal_message(e) == ("no ready endpoint matches the subset hint "
                                  "(192.168.1.99:8000)")
    assert h.seen == []


# --- response processing -----------------------------------------------------------------


async def test_response_buffering_multi_chunk(stack: Starter) -> None:
    """Go: ExpectBufferResp(payload, "application/grpc") — the message unchanged, the
    response headers with x-went-into-resp-headers (and the content type). Go's pod sends
    the message in two body frames; a gRPC server sends it as it likes."""
    h = await stack([P(4, 0.2)])
    replies, initial = await call(h, GENERATE, request_proto("test", GENERATE))
    assert replies == [CHUNK_1_TO_7]
    # (gRPC clients do not show content-type; the HTTP/1.1 case below checks it.)
    assert initial["x-went-into-resp-headers"] == "true"


async def test_response_buffering_invalid_grpc(stack: Starter,
                                               session: aiohttp.ClientSession) -> None:
    """Go: a response body that is no gRPC frame passes unchanged. No gRPC server answers
    that: an HTTP/1.1 pod does, to an HTTP/1.1 client."""
    h = await stack.http([P(4, 0.2)], Reply((b"no healthy upstream",),
                                            content_type="application/grpc"))
    status, headers, body = await send(session, h, {"hi": "mom", **GRPC_HEADERS},
                                       g.frame(request_proto("test", GENERATE)),
                                       path=GENERATE)
    assert status == 200
    assert body == b"no healthy upstream"
    assert headers["content-type"] == "application/grpc"
    assert headers["x-went-into-resp-headers"] == "true"


async def test_response_with_token_usage(stack: Starter, session: aiohttp.ClientSession) -> None:
    """Go: inference_objective_input_tokens observes 7 (labels empty: the gRPC request
    names no model, here as in Go)."""
    h = await stack([P(4, 0.2)], GrpcReply(generate=(COMPLETE_7_10,)))
    replies, _ = await call(h, GENERATE, request_proto("test", GENERATE))
    assert replies == [COMPLETE_7_10]
    labels = {"model_name": "", "target_model_name": ""}
    await expect_token_histogram(session, h, "inference_objective_input_tokens", labels,
                                 INPUT_TOKEN_BOUNDS, 7)


async def test_response_streaming_with_token_usage(stack: Starter,
                                                   session: aiohttp.ClientSession) -> None:
    h = await stack([P(4, 0.2)], GrpcReply(generate=(CHUNK_1_TO_3, COMPLETE_7_10)))
    message = request_proto("test-stream", GENERATE, stream=True)
    replies, initial = await call(h, GENERATE, message, objective=OBJECTIVE_PRIORITY_4)
    assert replies == [CHUNK_1_TO_3, COMPLETE_7_10]
    assert initial["x-went-into-resp-headers"] == "true"
    expect_grpc_routed(h, 0, message)
    labels = {"model_name": "", "target_model_name": ""}
    await expect_token_histogram(session, h, "inference_objective_input_tokens", labels,
                                 INPUT_TOKEN_BOUNDS, 7)
    await expect_token_histogram(session, h, "inference_objective_output_tokens", labels,
                                 OUTPUT_TOKEN_BOUNDS, 10)
