"""The bad-input corpus, through the real Envoy in both gateway shapes.

Every kind of input a client can send gets a 4xx from the EPP (with the JSON error body of
design.md §2) or is routed — never a 5xx, never a traceback in the EPP's log — and the
running-requests gauge is back to 0 after each one (every started request completed
exactly once). Each case names what it sends and what the client must see.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest
import pytest_asyncio

from tests.integration.conftest import (
    MAX_BODY,
    Stack,
    Upstreams,
    eventually,
    start_stack,
    stop_stack,
)

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
EMB = "/v1/embeddings"
RESP = "/v1/responses"
ROUTED = 0  # expected "status": routed to a pod (the pod's answer, any non-5xx)


def _j(**kw: object) -> bytes:
    return orjson.dumps(kw)


def _chat(**extra: object) -> bytes:
    return _j(model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
              **extra)


def _nest(depth: int, leaf: bytes = b"1") -> bytes:
    """``depth`` levels of JSON arrays around ``leaf``."""
    return b"[" * depth + leaf + b"]" * depth


def _chat_with(fragment_key: bytes, fragment: bytes) -> bytes:
    return (b'{"model":"sim-model","max_tokens":2,"messages":[{"role":"user","content":"hi"}],'
            + fragment_key + b":" + fragment + b"}")


@dataclass
class Case:
    name: str
    body: bytes | None
    status: int  # ROUTED, or the EPP's (or Envoy's) status
    path: str = CHAT
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None  # a substring of the JSON error message (EPP answers)


DEEP_PART = (b'{"model":"sim-model","max_tokens":2,"messages":[{"role":"user","content":'
             b'[{"type":"image_url","image_url":{"url":"x","detail":' + _nest(600) + b'}}]}]}')

CASES: list[Case] = [
    # --- not JSON / not an object
    Case("not-json", b"hello", 400, error="not valid JSON"),
    Case("truncated-json", b'{"model":"sim-model","messages":[', 400, error="not valid JSON"),
    Case("top-level-array", b"[1,2]", 400, error="JSON object"),
    Case("top-level-string", b'"model"', 400, error="JSON object"),
    Case("top-level-null", b"null", 400, error="JSON object"),
    Case("invalid-utf8", b'{"model":"sim-\xff\xfe","messages":[]}', 400, error="not valid JSON"),
    Case("utf8-bom", b"\xef\xbb\xbf" + _chat(), 400, error="not valid JSON"),
    Case("nan-literal", b'{"model":"sim-model","max_tokens":NaN}', 400, error="not valid JSON"),
    Case("infinite-number", b'{"model":"sim-model","temperature":1e999}', 400,
         error="not valid JSON"),
    Case("raw-control-char", b'{"model":"sim-\x01model"}', 400, error="not valid JSON"),
    Case("lone-surrogate", b'{"model":"sim-model","x":"\\ud800"}', 400, error="not valid JSON"),
    Case("nesting-beyond-1024", b'{"model":"sim-model","x":' + _nest(1100) + b"}", 400,
         error="not valid JSON"),
    # --- model
    Case("model-missing", _j(messages=[{"role": "user", "content": "hi"}]), 400,
         error="'model' is required"),
    Case("model-number", _j(model=7, messages=[]), 400, error="'model' must be a string"),
    Case("model-empty", _j(model="", messages=[]), 400, error="must not be empty"),
    Case("model-null", _j(model=None), 400, error="'model' is required"),
    Case("unknown-path-no-model", _j(foo=1), 400, path="/v1/unknown", error="'model'"),
    # --- chat shape
    Case("messages-missing", _j(model="sim-model"), 400, error="'messages' is required"),
    Case("messages-object", _j(model="sim-model", messages={}), 400, error="'messages' must be"),
    Case("messages-empty", _j(model="sim-model", messages=[]), 400, error="must not be empty"),
    Case("message-not-object", _j(model="sim-model", messages=["hi"]), 400,
         error="'messages[0]'"),
    Case("role-missing", _j(model="sim-model", messages=[{"content": "hi"}]), 400,
         error="'messages[0].role' is required"),
    Case("role-number", _j(model="sim-model", messages=[{"role": 1, "content": "hi"}]), 400,
         error="'messages[0].role' must be a string"),
    Case("content-number", _j(model="sim-model", messages=[{"role": "user", "content": 5}]),
         400, error="'messages[0].content'"),
    Case("content-missing-user", _j(model="sim-model", messages=[{"role": "user"}]), 400,
         error="'messages[0].content' is required"),
    Case("part-not-object", _j(model="sim-model", messages=[{"role": "user", "content": [1]}]),
         400, error="content part"),
    Case("part-type-missing",
         _j(model="sim-model", messages=[{"role": "user", "content": [{"text": "x"}]}]), 400,
         error=".type' must be a string"),
    Case("text-part-number",
         _j(model="sim-model", messages=[{"role": "user", "content": [{"type": "text",
                                                                       "text": 3}]}]),
         400, error=".text' must be a string"),
    Case("name-number", _j(model="sim-model", messages=[{"role": "user", "content": "hi",
                                                         "name": 3}]), 400, error=".name'"),
    Case("tool-calls-object", _j(model="sim-model", messages=[{"role": "assistant",
                                                               "tool_calls": {}}]), 400,
         error=".tool_calls' must be an array"),
    Case("stream-string", _chat(stream="yes"), 400, error="'stream' must be a boolean"),
    Case("stream-options-list", _chat(stream_options=[]), 400, error="'stream_options'"),
    Case("max-tokens-negative", _j(model="sim-model", messages=[{"role": "user",
                                                                 "content": "hi"}],
                                   max_tokens=-1), 400, error="'max_tokens' must be >= 0"),
    Case("max-tokens-string", _j(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                 max_tokens="5"), 400, error="'max_tokens' must be an integer"),
    Case("max-tokens-float", _j(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                max_tokens=2.5), 400, error="'max_tokens' must be an integer"),
    Case("cache-salt-number", _chat(cache_salt=1), 400, error="'cache_salt' must be a string"),
    Case("user-object", _chat(user={}), 400, error="'user' must be a string"),
    # --- completions / embeddings / responses shapes
    Case("prompt-missing", _j(model="sim-model"), 400, path=COMP, error="'prompt' is required"),
    Case("prompt-object", _j(model="sim-model", prompt={}), 400, path=COMP, error="'prompt'"),
    Case("prompt-empty-list", _j(model="sim-model", prompt=[]), 400, path=COMP,
         error="empty list"),
    Case("prompt-mixed-list", _j(model="sim-model", prompt=["a", 1]), 400, path=COMP,
         error="'prompt[1]'"),
    Case("token-ids-with-string", _j(model="sim-model", prompt=[1, "a"]), 400, path=COMP,
         error="'prompt[1]'"),
    Case("embeddings-input-missing", _j(model="sim-model"), 400, path=EMB,
         error="'input' is required"),
    Case("responses-input-missing", _j(model="sim-model"), 400, path=RESP,
         error="'input' is required"),
    Case("responses-input-number", _j(model="sim-model", input=3), 400, path=RESP,
         error="'input' must be"),
    Case("responses-item-untyped", _j(model="sim-model", input=[{"x": 1}]), 400, path=RESP,
         error="'input[0]'"),
    # --- size
    Case("body-over-limit", b'{"model":"sim-model","prompt":"' + b"a" * (MAX_BODY + 10) + b'"}',
         413, path=COMP, error="exceeds the limit"),
    # --- valid but hostile: routed
    Case("duplicate-keys", b'{"model":"x","model":"sim-model","prompt":"hi","max_tokens":2}',
         ROUTED, path=COMP),
    Case("huge-integer", b'{"model":"sim-model","prompt":"hi","max_tokens":2,"seed":'
         + b"9" * 40 + b"}", ROUTED, path=COMP),
    Case("deep-image-part", DEEP_PART, ROUTED),
    Case("deep-tools", _chat_with(b'"tools"', b'[{"type":"function","function":{"x":'
                                  + _nest(700) + b"}}]"), ROUTED),
    Case("deep-tool-calls",
         b'{"model":"sim-model","max_tokens":2,"messages":[{"role":"assistant","tool_calls":'
         b'[{"id":"1","function":' + _nest(800) + b'}]},{"role":"user","content":"hi"}]}',
         ROUTED),
    Case("deep-responses-item",
         b'{"model":"sim-model","max_output_tokens":2,"input":[{"type":"function_call",'
         b'"arguments":' + _nest(900) + b"}]}", ROUTED, path=RESP),
    Case("deep-with-model-rewrite", DEEP_PART, ROUTED,
         headers={"x-gateway-model-name-rewrite": "sim-model-b"}),
    Case("deepest-with-model-rewrite", b'{"model":"sim-model","prompt":"hi","max_tokens":2,'
         b'"x":' + _nest(1020) + b"}", ROUTED, path=COMP,
         headers={"x-gateway-model-name-rewrite": "sim-model-b"}),
    Case("forged-destination", _chat(), ROUTED,
         headers={"x-gateway-destination-endpoint": "10.255.255.1:1"}),
    Case("forged-prefiller", _chat(), ROUTED, headers={"x-prefiller-host-port": "10.255.255.1:1"}),
    Case("empty-body-post", b"", ROUTED, path=COMP),
    Case("get-models", None, ROUTED, path="/v1/models", method="GET"),
    Case("text-plain-content-type", _chat(), ROUTED, headers={"content-type": "text/plain"}),
    Case("odd-request-id", _chat(), ROUTED, headers={"x-request-id": "a" * 4000}),
    Case("empty-rewrite-header", _chat(), ROUTED, headers={"x-gateway-model-name-rewrite": ""}),
    Case("unknown-path-with-model", _j(model="sim-model", anything=[1, {"a": None}]), ROUTED,
         path="/v1/whatever"),
    Case("objective-and-fairness-headers", _chat(), ROUTED,
         headers={"x-gateway-inference-objective": "\u00e9" * 3,
                  "x-gateway-inference-fairness-id": "x" * 500}),
]


@pytest_asyncio.fixture(scope="module", params=[
    ("FULL_DUPLEX_STREAMED", "lean"), ("BUFFERED", "lean"),
    ("FULL_DUPLEX_STREAMED", "inline"), ("BUFFERED", "inline")], ids=lambda p: "-".join(p))
async def bstack(request: pytest.FixtureRequest, upstreams: Upstreams,
                 tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    # Both gateway shapes: the shipped lean one, and GIE's, where the response (and the
    # model-name rewrite-back) passes through the EPP too.
    mode, shape = request.param
    s = await start_stack(mode, upstreams, tmp_path_factory.mktemp(f"bad-{mode}-{shape}"),
                          response_path=shape)
    yield s
    await stop_stack(s)


async def _running(stack: Stack, session: aiohttp.ClientSession) -> float:
    return await stack.epp.metric(session, "inference_objective_running_requests")


async def _send(session: aiohttp.ClientSession, stack: Stack,
                case: Case) -> tuple[int, bytes]:
    headers = {"content-type": "application/json", **case.headers}
    async with session.request(case.method, stack.url + case.path, data=case.body,
                               headers=headers) as r:
        return r.status, await r.read()


def _log_problems(stack: Stack) -> list[str]:
    assert stack.epp.proc is not None
    text = stack.epp.proc.log_tail(1 << 22)
    return [line for line in text.splitlines()
            if "Traceback" in line or "Exception deserializing" in line]


async def test_bad_input_corpus(bstack: Stack, session: aiohttp.ClientSession) -> None:
    assert len(CASES) >= 40
    failures = []
    for case in CASES:
        status, body = await _send(session, bstack, case)
        if case.status == ROUTED:
            ok = status < 500 and b"endpoint picker" not in body
        else:
            ok = status == case.status
            if ok and case.error is not None:
                try:
                    err = orjson.loads(body)["error"]
                    ok = case.error in err["message"] and err["code"] == status
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    ok = False
        if not ok:
            failures.append(f"{case.name}: {status} {body[:200]!r}")
        # Every started request is completed: the gauge is back to 0 after each kind.
        try:
            await eventually(lambda: _zero(bstack, session), timeout=5)
        except AssertionError:
            failures.append(f"{case.name}: running gauge stuck at "
                            f"{await _running(bstack, session)}")
    assert not failures, "\n".join(failures)
    assert _log_problems(bstack) == []


async def _zero(stack: Stack, session: aiohttp.ClientSession) -> bool:
    return await _running(stack, session) == 0


async def test_headers_near_envoys_limit(bstack: Stack, session: aiohttp.ClientSession) -> None:
    """Envoy allows 100 request headers; the EPP adds its routing headers: never a bare 500."""
    seen = set()
    # aiohttp adds 6 headers and Envoy 5 (pseudo-headers, x-request-id, …); 95 fillers
    # make the client's request itself too large for Envoy (it closes the connection).
    for extra in range(84, 95):
        headers = {f"x-filler-{i}": "v" for i in range(extra)}
        case = Case(f"{extra}-headers", _chat(), ROUTED, headers=headers)
        status, body = await _send(session, bstack, case)
        seen.add(status)
        assert status in (200, 431), (extra, status, body[:200])
        if status == 431:
            err = orjson.loads(body)["error"]
            assert "max_headers_count" in err["message"] and err["code"] == 431, body
        await eventually(lambda: _zero(bstack, session), timeout=5)
    assert seen == {200, 431}


async def test_raw_http_garbage_and_client_aborts(bstack: Stack,
                                                  session: aiohttp.ClientSession) -> None:
    """Malformed HTTP is Envoy's to answer; a client that hangs up mid-body or mid-response
    leaves nothing running in the EPP."""
    async def raw(data: bytes, read: bool = True) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", bstack.port)
        writer.write(data)
        await writer.drain()
        out = b""
        if read:
            try:
                out = await asyncio.wait_for(reader.read(4096), timeout=5)
            except (TimeoutError, ConnectionError):
                pass
        writer.close()
        return out

    # Garbage request lines: Envoy answers 400 or closes the connection; nothing reaches
    # the EPP.
    for garbage in (b"\x00\x01garbage\r\n\r\n", b"POST /v1/completions HTTP/9.9\r\n\r\n",
                    b"GET / HTTP/1.1\r\nbad header line\r\n\r\n"):
        out = await raw(garbage)
        assert out == b"" or b" 400 " in out[:20], (garbage, out[:100])
    # Body promised but cut off: the client goes away mid-body.
    await raw(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 1000\r\n\r\n{\"model\":\"sim-model\",", read=False)
    # A streamed response abandoned after the first bytes.
    body = orjson.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 200, "stream": True})
    req = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    reader, writer = await asyncio.open_connection("127.0.0.1", bstack.port)
    writer.write(req)
    await asyncio.wait_for(reader.read(100), timeout=10)
    writer.transport.abort()
    # Chunked body with an invalid chunk size.
    await raw(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
              b"zz\r\nabc\r\n0\r\n\r\n")
    await eventually(lambda: _zero(bstack, session), timeout=10)
    assert _log_problems(bstack) == []


async def test_raw_grpc_misuse_leaks_nothing(bstack: Stack, session: aiohttp.ClientSession) -> None:
    """Straight to the ext_proc port: two request_headers on one stream, a body before any
    headers, and bytes that are not a ProcessingRequest."""
    import grpc
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    def headers_msg() -> pb.ProcessingRequest:
        hm = HeaderMap(headers=[HeaderValue(key=":path", raw_value=b"/v1/models"),
                                HeaderValue(key=":method", raw_value=b"GET")])
        return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm,
                                                                   end_of_stream=True))

    async with grpc.aio.insecure_channel(f"127.0.0.1:{bstack.epp.grpc_port}") as ch:
        process = ch.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=pb.ProcessingRequest.SerializeToString,
            response_deserializer=pb.ProcessingResponse.FromString)
        call = process(iter([headers_msg(), headers_msg()]))
        answers = [m async for m in call]
        assert answers[0].HasField("request_headers")
        assert answers[-1].immediate_response.status.code == 400
        call = process(iter([pb.ProcessingRequest(request_body=pb.HttpBody(
            body=b"{}", end_of_stream=True))]))
        answers = [m async for m in call]
        assert answers and answers[0].HasField("immediate_response")
        garbage = ch.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                                   request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        for _ in range(3):
            call = garbage(iter([b"\xff\xff\xff\xff\x0f not a protobuf"]))
            with pytest.raises(grpc.aio.AioRpcError):
                _ = [m async for m in call]
    await eventually(lambda: _zero(bstack, session), timeout=5)
    assert _log_problems(bstack) == []
