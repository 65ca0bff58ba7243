"""The gateway shapes through real Envoy (docs/architecture.md, "Gateway shapes").

What the suite holds for each shape, so a regression fails CI rather than a benchmark:

- **ext_proc messages per request**, counted by Envoy itself: its ext_proc filter's
  counters on the admin ``/stats`` endpoint (``http.gateway.ext_proc.stream_msgs_sent``:
  Envoy → EPP, ``…stream_msgs_received``: EPP → Envoy, ``…streams_started`` /
  ``…streams_closed``). The lean shape (the shipped default) sends the EPP no message per
  response chunk: a 100-event SSE answer costs exactly what a one-event answer and a short
  JSON answer cost. GIE's shape (``inline``) costs one message pair per response chunk.
- **exact in-flight accounting**: ``inference_objective_running_requests`` is back to
  exactly 0 after clients that hang up mid-stream, upstreams that reset the connection
  mid-body or before answering, and normal requests, in both shapes and both request body
  modes; every routed request ends exactly once (stream outcomes add up).
- **byte-exact bodies** in the lean shape: a multi-megabyte request body reaches the pod
  unchanged, and a binary response body, its content-length and an SSE stream reach the
  client unchanged.
- what the lean shape gives up, stated as behaviour: no token usage metrics and no
  model-name rewrite-back (the client sees the target model's name).

The upstream is a small aiohttp server in the test's event loop, so each test decides
exactly what the "pod" does (events and their spacing, a reset mid-body, a binary body).
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from aiohttp import web

from epp.stack.procs import free_port
from tests.integration.conftest import (
    Stack,
    Upstreams,
    eventually,
    start_stack,
    stop_stack,
)

pytestmark = pytest.mark.integration

#: Envoy's ext_proc filter counters (HTTP connection manager stat_prefix "gateway" in
#: epp/stack/envoy.yaml.tmpl; the filter itself sets no stat_prefix).
STAT_PREFIX = "http.gateway.ext_proc."
SENT = STAT_PREFIX + "stream_msgs_sent"  # Envoy → EPP
RECEIVED = STAT_PREFIX + "stream_msgs_received"  # EPP → Envoy
STARTED = STAT_PREFIX + "streams_started"
CLOSED = STAT_PREFIX + "streams_closed"

#: Messages of one short request (HTTP/1.1, body with content-length, JSON answer), by
#: (request body mode, shape): (Envoy → EPP, EPP → Envoy). FULL_DUPLEX_STREAMED: Envoy
#: sends request headers, the body, an empty end-of-stream body chunk, then the response
#: headers; the EPP answers headers, the body (one piece), response headers. GIE's shape
#: adds the response body (one chunk, an empty end-of-stream chunk), each echoed.
#: BUFFERED: request headers, the whole body, response headers, each answered; GIE's
#: shape adds the response body (STREAMED, one chunk).
SHORT_REQUEST_MESSAGES = {
    ("FULL_DUPLEX_STREAMED", "lean"): (4, 3),
    ("BUFFERED", "lean"): (3, 3),
    ("FULL_DUPLEX_STREAMED", "inline"): (6, 5),
    ("BUFFERED", "inline"): (4, 4),
}

MODEL = "shape-model"
SSE_GAP_S = 0.002  # model-server-like spacing: each event its own chunk at Envoy


# ----------------------------------------------------------------- the upstream "pod"


@dataclass
class Pod:
    """An OpenAI-ish upstream whose behaviour each request chooses (``x-test-upstream``):

    - ``json`` (default without ``stream``): a completion with usage, content-length set;
    - ``sse`` (default with ``stream``): ``max_tokens`` events ``SSE_GAP_S`` apart, then a
      usage event and ``[DONE]``;
    - ``slow-sse``: as ``sse`` with 20 ms between events (long enough to hang up mid-way);
    - ``blob``: ``max_tokens`` bytes of binary data derived from the request body, in
      uneven writes, content-length set;
    - ``reset-mid-body``: response headers and three events, then a TCP reset;
    - ``reset-before-headers``: a TCP reset before any response byte.

    Every request's body length and sha256 are recorded.
    """

    port: int = field(default_factory=free_port)
    seen: list[dict[str, Any]] = field(default_factory=list)
    runner: web.AppRunner | None = None

    @property
    def key(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.seen.append({"len": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                          "headers": dict(request.headers)})
        body = orjson.loads(raw)
        n = int(body.get("max_tokens", 1))
        mode = request.headers.get("x-test-upstream") or ("sse" if body.get("stream") else "json")
        if mode == "reset-before-headers":
            _reset(request)
            return web.Response()  # never sent: the connection is gone
        if mode == "json":
            return web.json_response(completion(body["model"], n))
        if mode == "blob":
            data = blob(raw, n)
            resp = web.StreamResponse(headers={"content-type": "application/octet-stream"})
            resp.content_length = len(data)
            await resp.prepare(request)
            for i, j in _uneven(len(data)):
                await resp.write(data[i:j])
            await resp.write_eof()
            return resp
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        gap = 0.02 if mode == "slow-sse" else SSE_GAP_S
        try:
            for i in range(n):
                await resp.write(sse_event(body["model"], i))
                if mode == "reset-mid-body" and i == 2:
                    # The scenario, not a wait (a pod cannot see its client): events reach
                    # the client, then the connection resets.
                    await asyncio.sleep(0.05)
                    _reset(request)
                    return resp
                await asyncio.sleep(gap)  # pacing: the pod's token rate
            await resp.write(sse_tail(body["model"], n))
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client (through Envoy) went away: expected in the abort tests
        return resp


def _reset(request: web.Request) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0), as a crashing pod would."""
    transport = request.transport
    assert transport is not None
    sock = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _uneven(n: int) -> list[tuple[int, int]]:
    out, i, step = [], 0, 1
    while i < n:
        out.append((i, min(n, i + step)))
        i += step
        step = step * 7 % 65_521 + 1  # 1, 8, 57, 400, … wrapping: odd sizes, some large
    return out


def completion(model: str, n: int) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok " * n}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}


def sse_event(model: str, i: int) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "chat-1", "object": "chat.completion.chunk", "model": model,
        "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}) + b"\n\n"


def sse_tail(model: str, n: int) -> bytes:
    return (b"data: " + orjson.dumps({
        "id": "chat-1", "object": "chat.completion.chunk", "model": model, "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}})
        + b"\n\ndata: [DONE]\n\n")


def blob(seed: bytes, n: int) -> bytes:
    """``n`` bytes (every byte value, not UTF-8) derived from ``seed``."""
    out, block = bytearray(), hashlib.sha256(seed).digest()
    while len(out) < n:
        out += block
        block = hashlib.sha256(block).digest()
    return bytes(out[:n])


# ----------------------------------------------------------------- fixtures and helpers


@pytest_asyncio.fixture(scope="module")
async def pod() -> AsyncIterator[Pod]:
    p = Pod()
    await p.start()
    yield p
    await p.stop()


SHAPES = [("FULL_DUPLEX_STREAMED", "lean"), ("BUFFERED", "lean"),
          ("FULL_DUPLEX_STREAMED", "inline"), ("BUFFERED", "inline")]


@pytest_asyncio.fixture(scope="module", params=SHAPES, ids=lambda p: f"{p[0]}-{p[1]}")
async def shape_stack(request: pytest.FixtureRequest, pod: Pod,
                      tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """Envoy + EPP in one (body mode, shape), routing to the in-process pod only."""
    mode, shape = request.param
    workdir = tmp_path_factory.mktemp(f"shape-{mode}-{shape}")
    # No `epp sim` processes: the in-process pod is the only endpoint.
    ups = Upstreams([pod.port], None)  # type: ignore[arg-type]
    s = await start_stack(mode, ups, workdir, endpoint_ports=[pod.port], config=None,
                          extra_args=["--no-metrics-scraping"], response_path=shape)
    yield s
    await stop_stack(s)


async def envoy_stats(session: aiohttp.ClientSession, stack: Stack) -> dict[str, int]:
    """Envoy's ext_proc filter counters."""
    url = f"http://127.0.0.1:{stack.envoy.admin_port}/stats?filter=^http\\.gateway\\.ext_proc\\."
    async with session.get(url) as r:
        assert r.status == 200
        text = await r.text()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


async def messages_of(session: aiohttp.ClientSession, stack: Stack,
                      send: Any) -> tuple[int, int]:
    """(Envoy → EPP, EPP → Envoy) messages of the one request ``send()`` makes, from
    Envoy's counters once its ext_proc stream has closed."""
    before = await envoy_stats(session, stack)
    await send()

    async def closed() -> dict[str, int] | None:
        now = await envoy_stats(session, stack)
        started = now[STARTED] - before[STARTED]
        return now if started == 1 and now[CLOSED] - before[CLOSED] == 1 else None
    after = await eventually(closed, timeout=10, interval=0.05)
    return after[SENT] - before[SENT], after[RECEIVED] - before[RECEIVED]


def chat(n: int, stream: bool, model: str = MODEL, content: str = "hi") -> bytes:
    return orjson.dumps({"model": model, "stream": stream, "max_tokens": n,
                         "stream_options": {"include_usage": True},
                         "messages": [{"role": "user", "content": content}]})


async def post(session: aiohttp.ClientSession, stack: Stack, body: bytes,
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    async with session.post(stack.url + "/v1/chat/completions", data=body, headers={
            "content-type": "application/json", **(headers or {})}) as r:
        return r.status, dict(r.headers), await r.read()


async def running(session: aiohttp.ClientSession, stack: Stack) -> float:
    return await stack.epp.metric(session, "inference_objective_running_requests")


async def outcomes(session: aiohttp.ClientSession, stack: Stack) -> float:
    """Routed streams that ended (completed or aborted)."""
    return (await stack.epp.metric(session, 'epp_extproc_streams_total{outcome="completed"}')
            + await stack.epp.metric(session, 'epp_extproc_streams_total{outcome="aborted"}'))


# ----------------------------------------------------------------- messages per request


async def test_messages_per_request(shape_stack: Stack, session: aiohttp.ClientSession
                                    ) -> None:
    s = shape_stack
    lean = s.response_path == "lean"

    async def ok(body: bytes, events: int | None) -> None:
        status, _, data = await post(session, s, body)
        assert status == 200, data[:300]
        if events is not None:
            assert data.count(b"data: ") == events + 2 and data.endswith(b"data: [DONE]\n\n")

    short = await messages_of(session, s, lambda: ok(chat(1, False), None))
    sse1 = await messages_of(session, s, lambda: ok(chat(1, True), 1))
    sse100 = await messages_of(session, s, lambda: ok(chat(100, True), 100))
    print(f"{s.mode} {s.response_path}: short {short}, 1-event SSE {sse1}, "
          f"100-event SSE {sse100} (Envoy → EPP, EPP → Envoy)")
    assert short == SHORT_REQUEST_MESSAGES[(s.mode, s.response_path)]
    if lean:
        # No message per response chunk: the answer's length costs nothing.
        assert sse100 == sse1 == short
    else:
        # GIE's shape: every response chunk is one more message pair (upstream writes
        # ~2 ms apart arrive as their own chunks, a few may coalesce on a busy machine).
        extra_sent, extra_received = sse100[0] - sse1[0], sse100[1] - sse1[1]
        assert extra_sent == extra_received, (sse1, sse100)
        assert 50 <= extra_sent <= 110, (sse1, sse100)


async def test_what_the_lean_shape_gives_up(shape_stack: Stack,
                                            session: aiohttp.ClientSession) -> None:
    """Token usage metrics and the model-name rewrite-back need the response body: GIE's
    shape has them, the lean shape does not (the client still gets the usage itself)."""
    s = shape_stack
    lean = s.response_path == "lean"
    before = await s.epp.metric(session, "inference_objective_output_tokens_sum")
    status, headers, data = await post(session, s, chat(7, False),
                                       headers={"x-gateway-model-name-rewrite": "target-model"})
    assert status == 200
    answer = orjson.loads(data)
    assert answer["usage"]["completion_tokens"] == 7  # what the pod said, either way
    # The pod was asked for the target model; only GIE's shape renames it back.
    assert answer["model"] == ("target-model" if lean else MODEL)
    if lean:
        assert int(headers["Content-Length"]) == len(data)  # the body was not touched
    status, _, data = await post(session, s, chat(5, True))
    assert status == 200 and data.endswith(b"data: [DONE]\n\n")

    async def counted() -> tuple[float] | None:  # a tuple: 0 tokens is an answer too
        if await running(session, s) != 0:
            return None
        got = await s.epp.metric(session, "inference_objective_output_tokens_sum") - before
        return (got,) if lean or got == 7 + 5 else None
    assert await eventually(counted, timeout=10) == (0 if lean else 7 + 5,)
    await asyncio.sleep(0.3)  # not a wait: nothing arrives late either
    after = await s.epp.metric(session, "inference_objective_output_tokens_sum") - before
    assert after == (0 if lean else 7 + 5)


# ----------------------------------------------------------------- in-flight accounting


async def test_a_streamed_response_is_in_flight_until_it_ends(
        shape_stack: Stack, session: aiohttp.ClientSession) -> None:
    """The ext_proc stream — and so the EPP's count of the request — lasts as long as the
    response, in every shape. (In the lean shape this needs response_trailer_mode SEND:
    with SKIP, Envoy 1.40 closes a FULL_DUPLEX_STREAMED stream right after the response
    headers, and a streamed answer would count as done at its first byte.)"""
    s = shape_stack
    assert await eventually(lambda: _zero(session, s), timeout=10)
    before = await envoy_stats(session, s)
    async with session.post(s.url + "/v1/chat/completions", data=chat(40, True), headers={
            "content-type": "application/json", "x-test-upstream": "slow-sse"}) as r:
        assert r.status == 200
        for i in range(20):  # ~0.4 s into a ~0.8 s answer
            line = await r.content.readline()
            assert line.startswith(b"data: "), line
            await r.content.readline()  # the blank line after each event
            if i in (0, 19):
                now = await envoy_stats(session, s)
                assert now[STARTED] - before[STARTED] == 1
                assert now[CLOSED] - before[CLOSED] == 0, f"stream closed at event {i}"
                assert await running(session, s) == 1, f"not in flight at event {i}"
        rest = await r.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    assert await eventually(lambda: _zero(session, s), timeout=10)


async def test_in_flight_is_exact_under_aborts_and_resets(
        shape_stack: Stack, session: aiohttp.ClientSession) -> None:
    s = shape_stack
    assert await eventually(lambda: _zero(session, s), timeout=10)
    ended_before = await outcomes(session, s)

    async def hang_up_mid_stream() -> None:
        # Its own connection pool: closing the response closes the connection.
        async with (
            aiohttp.ClientSession() as own,
            own.post(s.url + "/v1/chat/completions", data=chat(200, True),
                     headers={"content-type": "application/json",
                              "x-test-upstream": "slow-sse"}) as r,
        ):
            assert r.status == 200
            first = await r.content.readany()
            assert first.startswith(b"data: ")
            r.close()

    async def upstream_resets_mid_body() -> None:
        async with aiohttp.ClientSession() as own:
            try:
                async with own.post(s.url + "/v1/chat/completions", data=chat(50, True),
                                    headers={"content-type": "application/json",
                                             "x-test-upstream": "reset-mid-body"}) as r:
                    # Usually the response has started (200, then cut short); when the
                    # reset overtakes the response headers still held for the EPP (GIE's
                    # shape on a busy machine), Envoy answers it with a 502 itself.
                    assert r.status in (200, 502), r.status
                    data = await r.read()
                    # Never the whole stream.
                    assert not data.endswith(b"data: [DONE]\n\n")
            except aiohttp.ClientPayloadError:
                pass  # the truncated chunked body is reported as such

    async def upstream_resets_before_headers() -> None:
        status, _, _ = await post(session, s, chat(3, False),
                                  headers={"x-test-upstream": "reset-before-headers"})
        assert status == 503  # Envoy: upstream connection reset before the response

    async def normal() -> None:
        status, _, data = await post(session, s, chat(5, True))
        assert status == 200 and data.endswith(b"data: [DONE]\n\n")

    kinds = [hang_up_mid_stream, upstream_resets_mid_body, upstream_resets_before_headers,
             normal]
    # Each kind alone (the gauge back to exactly 0 after each), then all of them at once.
    for kind in kinds:
        await kind()
        assert await eventually(lambda: _zero(session, s), timeout=10), kind.__name__
    await asyncio.gather(*(kind() for kind in kinds * 3))
    assert await eventually(lambda: _zero(session, s), timeout=10)
    # Every routed request ended exactly once: 4 + 12 routed streams, each with one
    # outcome (a lean stream cannot tell a client that left from a normal end, so it
    # may say completed where GIE's shape says aborted — but never both, never twice).
    ended = await eventually(lambda: _outcomes_reach(session, s, ended_before + 16),
                             timeout=10)
    assert ended == ended_before + 16
    await asyncio.sleep(0.3)  # not a wait: nothing is counted late, or twice
    assert await running(session, s) == 0 and await outcomes(session, s) == ended


async def _zero(session: aiohttp.ClientSession, s: Stack) -> bool:
    return await running(session, s) == 0


async def _outcomes_reach(session: aiohttp.ClientSession, s: Stack, want: float
                          ) -> float | None:
    got = await outcomes(session, s)
    return got if got >= want else None


# ----------------------------------------------------------------- byte-exact bodies


async def test_lean_bodies_are_byte_exact(shape_stack: Stack, pod: Pod,
                                          session: aiohttp.ClientSession) -> None:
    s = shape_stack
    if s.response_path != "lean":
        pytest.skip("byte-exact bodies in GIE's shape: test_routing.py, test_envoy_config.py")
    # ~3 MB request body (several 62,000-byte pieces, over Envoy's 1 MiB default buffer),
    # with escapes and non-ASCII text.
    text = "".join(f"línea {i} \"quoted\" \\ tab\t ✓ " for i in range(90_000))
    body = chat(1_000_000, False, content=text)
    assert len(body) > 3_000_000
    status, headers, data = await post(session, s, body, headers={"x-test-upstream": "blob"})
    assert status == 200, data[:200]
    seen = pod.seen[-1]
    assert (seen["len"], seen["sha256"]) == (len(body), hashlib.sha256(body).hexdigest())
    # The pod's binary answer, its framing included, reaches the client unchanged.
    assert data == blob(body, 1_000_000)
    assert headers["Content-Length"] == str(len(data))
    # An SSE answer arrives exactly as the pod wrote it.
    status, _, data = await post(session, s, chat(100, True))
    assert status == 200
    assert data == b"".join(sse_event(MODEL, i) for i in range(100)) + sse_tail(MODEL, 100)
    # The pod saw the EPP's route, never a client's.
    status, _, _ = await post(session, s, chat(1, False),
                              headers={"x-gateway-destination-endpoint": "127.0.0.1:1"})
    assert status == 200
    assert pod.seen[-1]["headers"]["x-gateway-destination-endpoint"] == pod.key


def test_shapes_cover_the_defaults() -> None:
    """The shape the project ships is the one these tests call lean."""
    from epp.stack.envoy import DEFAULT_RESPONSE_PATH

    assert DEFAULT_RESPONSE_PATH == "lean"
    assert {p for _, p in SHAPES} == {"lean", "inline"}
