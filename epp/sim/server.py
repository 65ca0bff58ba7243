"""``epp sim``: OpenAI-compatible, vLLM-like model servers backed by a latency model.

One :func:`build_app` per simulated pod, each with its own :class:`epp.sim.engine.Engine`
(continuous batching, chunked prefill, prefix cache, LoRA slots; see that module and
docs/simulator.md), its own Prometheus registry and its own seeded random source.

Contracts
- Every response carries ``x-sim-server: <name>`` (``sim-<port>`` from
  :func:`start_servers`).
- A POST whose body is not a JSON object gets 400 with an OpenAI error body
  ``{"error": {"message", "type", "code"}}``; so does one missing its route's required
  field (``prompt``, ``messages``, ``input``), and one whose prompt plus ``max_tokens``
  could never fit in the KV cache.
- Tokens are whitespace words (:mod:`epp.sim.tokens`). ``usage.prompt_tokens`` is the
  prompt's word count (token ids count one each); ``completion_tokens`` is
  ``max_tokens`` (or ``max_completion_tokens``; Responses API: ``max_output_tokens``),
  default :data:`DEFAULT_MAX_TOKENS`, and 1 on a ``prefill``-role server;
  ``prompt_tokens_details.cached_tokens`` is the prompt tokens served from the prefix
  cache. The Responses API uses its own names (``input_tokens``, ``output_tokens``,
  ``input_tokens_details``).
- Generation takes the time the engine model says: a non-streaming response is sent
  when the last token is generated; ``"stream": true`` gives SSE with one event per
  token, written (and flushed) when that token's engine step ends, so a client observes
  TTFT and inter-token latency. Then a usage-only chunk when
  ``stream_options.include_usage`` is true, then ``data: [DONE]``. (Responses API
  streams typed events and no ``[DONE]``.)
- ``error_rate``: each valid generation/embedding request draws from the server's
  random source (seeded by ``seed`` and the server name); a hit gets 500 with an OpenAI
  error body before reaching the engine.
- Every POST is recorded on arrival, before any delay or failure, as ``{"path",
  "body_len", "body_sha256", "headers"}`` (header names lower-cased; repeated headers
  joined with ", ") in a deque of the last :data:`DEBUG_LOG_SIZE`; ``GET
  /debug/requests`` returns it oldest first, ``DELETE /debug/requests`` clears it. Once
  the body parses, the record gains ``fields`` (``model``, ``stream``, the output-token
  limits and ``kv_transfer_params``, those present); a decode pod that asked a prefill
  pod adds ``pd`` (see :func:`_remote_prefill`).
- P/D (``role = decode``): a generation request carrying ``x-prefiller-host-port`` is
  prefilled by that pod first, as llm-d's decode sidecar does (:func:`_remote_prefill`;
  docs/disaggregation.md).
  ``GET /debug/state`` returns the configuration and the engine's state.
- ``/metrics``: vLLM metric names (:mod:`epp.sim.metrics`). ``/health``: 200, or 503
  during slow start. ``/v1/models``: the base model and each LoRA adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import math
import random
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from epp.keys import HEADER_PREFILLER
from epp.sim.config import PREFILL_FAILURE_MODES, ROLES, SimConfig
from epp.sim.engine import Engine, EngineError, PromptTooLong, SimRequest
from epp.sim.metrics import CONTENT_TYPE as _PROMETHEUS
from epp.sim.metrics import build_registry, render
from epp.sim.tokens import (
    BadRequest,
    Token,
    messages_tokens,
    prompt_tokens,
    responses_input_tokens,
)
from epp.sim.topology import (
    LEVELS,
    PeerTopology,
    distance,
    parse_level_costs,
    parse_topology,
)

__all__ = [
    "DEBUG_LOG_SIZE",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MODEL",
    "SIM_SERVER_HEADER",
    "STATE_KEY",
    "BadRequest",
    "SimConfig",
    "SimState",
    "build_app",
    "build_parser",
    "config_from_args",
    "main",
    "run_servers",
    "serving",
    "start_servers",
]

SIM_SERVER_HEADER: Final = "x-sim-server"
DEFAULT_MODEL: Final = "sim-model"
DEFAULT_MAX_TOKENS: Final = 16
DEBUG_LOG_SIZE: Final = 1000
EMBEDDING_DIM: Final = 8

_JSON: Final = "application/json"
_SSE: Final = "text/event-stream"

Json = dict[str, Any]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class SimState:
    """Per-app state (one simulated pod). Owned by its app, never shared."""

    name: str
    model: str
    config: SimConfig
    engine: Engine
    registry: CollectorRegistry
    rng: random.Random
    delay_s: float = 0.0
    requests: deque[Json] = field(default_factory=lambda: deque(maxlen=DEBUG_LOG_SIZE))
    address: str = "127.0.0.1"
    """The address this pod is known by (for finding its own entry in ``peers``)."""
    topology: dict[str, str] | None = None
    """This pod's topology (``--topology``); None: look it up in ``peers``."""
    peers: PeerTopology | None = None
    """Topologies of the pods in the endpoints file (``--peer-topology-file``)."""
    pd: PdStats = field(default_factory=lambda: PdStats())
    http: aiohttp.ClientSession | None = None

    def inject_error(self) -> bool:
        """Draw once from the seeded source: True with probability ``error_rate``."""
        rate = self.config.error_rate
        return rate > 0 and self.rng.random() < rate

    def own_topology(self, port: int) -> dict[str, str] | None:
        if self.topology:
            return self.topology
        if self.peers is None:
            return None
        return self.peers.own(self.address, port)

    def client(self) -> aiohttp.ClientSession:
        """The HTTP client for prefill requests (created on first use, closed with the
        app)."""
        if self.http is None or self.http.closed:
            self.http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.prefill_timeout_s),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self.http


@dataclass
class PdStats:
    """Decode role: what the decode sidecar did (``GET /debug/state`` → ``pd``)."""

    remote_prefills: int = 0
    """Requests prefilled by a prefill pod (its answer was 2xx)."""
    prefill_failures: int = 0
    """Prefill pods that failed or could not be reached."""
    fallbacks: int = 0
    """Of those, requests then prefilled locally (``prefill_failure = fallback``)."""
    by_distance: dict[str, int] = field(default_factory=dict)
    """Remote prefills by the prefill pod's distance (``node`` … ``other``, ``unknown``)."""
    by_prefiller: dict[str, int] = field(default_factory=dict)
    """Remote prefills by prefill pod (``address:port``)."""

    def as_dict(self) -> Json:
        return {
            "remote_prefills": self.remote_prefills,
            "prefill_failures": self.prefill_failures,
            "fallbacks": self.fallbacks,
            "by_distance": dict(self.by_distance),
            "by_prefiller": dict(self.by_prefiller),
        }


STATE_KEY: Final = web.AppKey("sim_state", SimState)
_RECORD: Final = web.RequestKey("epp_sim_debug_record", dict)
"""Request key of the request's ``/debug/requests`` record (handlers add to it)."""
_RECORDED_FIELDS: Final = (
    "model",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "kv_transfer_params",
)
_PREFILL_KV_PARAMS: Final[Json] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""``kv_transfer_params`` of the prefill request, as llm-d's nixlv2 sidecar sends them."""


class _HttpError(Exception):
    """Becomes an OpenAI error response with ``status``."""

    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type


# ---------------------------------------------------------------- helpers


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type=_JSON)


def _error(message: str, status: int = 400, err_type: str = "BadRequestError") -> web.Response:
    return _json_response(
        {"error": {"message": message, "type": err_type, "code": status}}, status=status
    )


def _max_tokens(body: Json, *keys: str) -> int:
    for key in keys:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadRequest(f"'{key}' must be a non-negative integer")
            return value
    return DEFAULT_MAX_TOKENS


def _token_text(i: int) -> str:
    """The fake completion's token ``i`` (each is one word)."""
    return f" tok{i}"


def _include_usage(body: Json) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


def _model(body: Json, state: SimState) -> str:
    """The request's model is echoed (so tests see rewrites); the served one if absent."""
    model = body.get("model")
    return model if isinstance(model, str) and model else state.model


async def _json_body(request: web.Request) -> Json:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    record = request.get(_RECORD)
    if record is not None:
        record["fields"] = {k: body[k] for k in _RECORDED_FIELDS if k in body}
    return body


async def _sse_start(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200, headers={"Content-Type": _SSE, "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    return resp


async def _sse_send(resp: web.StreamResponse, obj: Any, event: str | None = None) -> None:
    """Write one SSE event. Each event is its own write (its own HTTP chunk), and the
    yield lets the transport push it out before the next one is produced."""
    prefix = f"event: {event}\n".encode() if event else b""
    await resp.write(prefix + b"data: " + orjson.dumps(obj) + b"\n\n")
    await asyncio.sleep(0)


async def _sse_done(resp: web.StreamResponse) -> web.StreamResponse:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


# ---------------------------------------------------------------- generation


@dataclass(slots=True)
class _Gen:
    """One accepted generation: the engine request and what the response reports."""

    state: SimState
    req: SimRequest
    prompt_tokens: int
    max_tokens: int
    model: str
    kv_transfer_params: Json | None

    def usage(self) -> Json:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.req.generated,
            "total_tokens": self.prompt_tokens + self.req.generated,
            "prompt_tokens_details": {"cached_tokens": self.req.cached_tokens},
        }

    def text(self) -> str:
        return "".join(_token_text(i) for i in range(self.req.generated))

    def extra(self) -> Json:
        """Top-level response fields besides the OpenAI ones (P/D transfer params)."""
        return (
            {}
            if self.kv_transfer_params is None
            else {"kv_transfer_params": self.kv_transfer_params}
        )

    async def wait(self) -> None:
        """Until the last token; 503 if the engine stops first. Aborts on cancel."""
        try:
            await self.req.result()
        except EngineError as exc:
            raise _HttpError(503, str(exc), "ServiceUnavailableError") from None
        finally:
            self.state.engine.abort(self.req)

    async def stream(self) -> AsyncIterator[int]:
        """Token indices as generated. The caller must :meth:`close` in a finally."""
        async for i in self.req.tokens():
            yield i

    def close(self) -> None:
        """Abort the engine request if it is still pending (client gone, error)."""
        self.state.engine.abort(self.req)


async def _submit(
    request: web.Request,
    body: Json,
    tokens: list[Token],
    max_tokens: int,
    *,
    generate: bool,
    limit_fields: tuple[str, ...] = (),
) -> _Gen:
    """Accept a parsed request: role rules, the KV-fit check (400), failure injection
    (500; only requests that pass the checks draw), the decode sidecar's remote prefill
    (decode role, ``x-prefiller-host-port`` set; see :func:`_remote_prefill`), engine
    submission (503 once the engine is stopped).

    ``generate`` is False for embeddings (prefill only, no role rules);
    ``limit_fields`` are the route's output-token limit fields (set to 1 in the prefill
    request).
    """
    state = request.app[STATE_KEY]
    cfg = state.config
    model = _model(body, state)
    lora = model if model in cfg.loras else None
    if generate and cfg.role == "prefill":
        max_tokens = 1
    try:
        state.engine.validate(len(tokens), max_tokens, lora)
    except PromptTooLong as exc:
        raise BadRequest(str(exc)) from None
    if state.inject_error():  # only requests that would be served draw
        raise _HttpError(500, "simulated internal server error", "InternalServerError")
    params = body.get("kv_transfer_params")
    params = params if isinstance(params, dict) else None
    remote = False
    out_params: Json | None = None
    if generate and cfg.role == "prefill" and params is not None:
        bs = cfg.block_size
        out_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": state.name,
            "remote_block_ids": list(range(math.ceil(max(1, len(tokens)) / bs))),
            "remote_host": request.host.rsplit(":", 1)[0],
            "remote_port": _local_port(request),
            "tp_size": 1,
        }
    transfer: float | None = None
    if generate and cfg.role == "decode":
        prefiller = request.headers.get(HEADER_PREFILLER, "").strip()
        if prefiller:
            got, transfer = await _remote_prefill(request, state, body, limit_fields, prefiller)
            params = got  # the prefill pod's params replace the client's
        remote = params is not None and params.get("do_remote_prefill") is True
    try:
        req = state.engine.submit(
            tokens, max_tokens, lora=lora, remote_prefill=remote, transfer_ms_per_token=transfer
        )
    except PromptTooLong as exc:
        raise BadRequest(str(exc)) from None
    except EngineError as exc:  # stopped: the server is shutting down
        raise _HttpError(503, str(exc), "ServiceUnavailableError") from None
    return _Gen(state, req, len(tokens), max_tokens, model, out_params)


async def _remote_prefill(
    request: web.Request, state: SimState, body: Json, limit_fields: tuple[str, ...], peer: str
) -> tuple[Json | None, float | None]:
    """llm-d's decode sidecar (nixlv2 connector): send the prefill pod ``peer``
    (``address:port``) the request with ``kv_transfer_params`` asking for a remote
    decode, ``stream: false`` and every output-token limit set to 1, wait for its answer,
    and return its ``kv_transfer_params`` with the KV-transfer cost per token for the
    pair's distance.

    When the prefill pod fails or cannot be reached: with ``prefill_failure = fallback``
    returns ``(None, None)`` (the decode pod prefills locally); with ``error`` raises the
    prefill pod's status (502 when unreachable), as llm-d's sidecar does.
    """
    cfg = state.config
    info: Json = {"prefiller": peer}
    record = request.get(_RECORD)
    if record is not None:
        record["pd"] = info
    pbody = dict(body)
    pbody["kv_transfer_params"] = dict(_PREFILL_KV_PARAMS)
    pbody["stream"] = False
    pbody.pop("stream_options", None)
    for f in limit_fields:
        pbody[f] = 1
    status: int | None = None
    params: Json | None = None
    error = ""
    t0 = time.monotonic()
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in host or "@" in host:
        error = f"malformed {HEADER_PREFILLER} {peer!r} (expected address:port)"
    else:
        try:
            async with state.client().post(
                f"http://{peer}{request.path}",
                data=orjson.dumps(pbody),
                headers={"content-type": _JSON, "x-request-id": str(uuid.uuid4())},
            ) as resp:
                status = resp.status
                raw = await resp.read()
            if 200 <= status < 300:
                answer = orjson.loads(raw)
                got = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                params = got if isinstance(got, dict) else {}
            else:
                error = f"prefill pod {peer} answered {status}"
        except orjson.JSONDecodeError:
            error = f"prefill pod {peer} answered with invalid JSON"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            error = f"prefill pod {peer} unreachable: {type(exc).__name__}: {exc}"
    info["status"] = status
    info["prefill_s"] = round(time.monotonic() - t0, 6)
    pd = state.pd
    if params is None:
        pd.prefill_failures += 1
        info["error"] = error
        if cfg.prefill_failure == "error":
            code = status if status is not None and status >= 400 else 502
            raise _HttpError(code, error, "BadGatewayError" if code == 502 else "PrefillError")
        pd.fallbacks += 1
        info["fallback"] = True
        return None, None
    own = state.own_topology(_local_port(request))
    level = distance(own, state.peers.lookup(peer) if state.peers is not None else None)
    cost = cfg.transfer_cost(level)
    pd.remote_prefills += 1
    key = level or "unknown"
    pd.by_distance[key] = pd.by_distance.get(key, 0) + 1
    pd.by_prefiller[peer] = pd.by_prefiller.get(peer, 0) + 1
    info.update(distance=level, transfer_ms_per_token=cost, fallback=False)
    return params, cost


def _local_port(request: web.Request) -> int:
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return int(sockname[1]) if isinstance(sockname, tuple) and len(sockname) >= 2 else 0


async def _stream_events(
    request: web.Request,
    gen: _Gen,
    on_start: Callable[[web.StreamResponse], Awaitable[None]] | None,
    on_token: Callable[[web.StreamResponse, int], Awaitable[None]],
    on_end: Callable[[web.StreamResponse], Awaitable[web.StreamResponse]],
) -> web.StreamResponse:
    """Drive one SSE response: ``on_start`` after the headers, ``on_token`` per token as
    its step ends, ``on_end`` after the last. An engine failure mid-stream sends an
    ``{"error": ...}`` event and ends the stream; a client that goes away aborts the
    engine request."""
    resp = await _sse_start(request)
    try:
        if on_start is not None:
            await on_start(resp)
        try:
            async for i in gen.stream():
                await on_token(resp, i)
        except EngineError as exc:
            err = {"message": str(exc), "type": "ServiceUnavailableError", "code": 503}
            await _sse_send(resp, {"error": err})
            await resp.write_eof()
            return resp
        return await on_end(resp)
    except ConnectionError:
        return resp
    finally:
        gen.close()


# ---------------------------------------------------------------- middleware


@web.middleware
async def _track(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Record every POST on arrival, apply ``delay_s``, and turn BadRequest and
    _HttpError into OpenAI error responses."""
    state = request.app[STATE_KEY]
    if request.method != "POST":
        return await handler(request)
    raw = await request.read()
    record: Json = {
        "path": request.path,
        "body_len": len(raw),
        "body_sha256": hashlib.sha256(raw).hexdigest(),
        "headers": _lower_headers(request),
    }
    state.requests.append(record)
    request[_RECORD] = record
    try:
        if state.delay_s > 0:
            await asyncio.sleep(state.delay_s)
        return await handler(request)
    except BadRequest as exc:
        return _error(str(exc))
    except _HttpError as exc:
        return _error(str(exc), exc.status, exc.err_type)


def _lower_headers(request: web.Request) -> dict[str, str]:
    headers: dict[str, str] = {}
    for key, value in request.headers.items():
        k = key.lower()
        headers[k] = f"{headers[k]}, {value}" if k in headers else value
    return headers


async def _stamp(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[SIM_SERVER_HEADER] = request.app[STATE_KEY].name


# ---------------------------------------------------------------- handlers


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    body = await _json_body(request)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required")
    tokens = prompt_tokens(body["prompt"])
    gen = await _submit(
        request, body, tokens, _max_tokens(body, "max_tokens"), generate=True,
        limit_fields=("max_tokens",),
    )
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def envelope(choices: list[Json]) -> Json:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": gen.model,
            "choices": choices,
        }

    if not body.get("stream"):
        await gen.wait()
        choice = {"index": 0, "text": gen.text(), "logprobs": None, "finish_reason": "length"}
        return _json_response({**envelope([choice]), "usage": gen.usage(), **gen.extra()})

    async def on_token(resp: web.StreamResponse, i: int) -> None:
        last = i == gen.max_tokens - 1
        choice = {
            "index": 0,
            "text": _token_text(i),
            "logprobs": None,
            "finish_reason": "length" if last else None,
        }
        await _sse_send(resp, envelope([choice]))

    async def on_end(resp: web.StreamResponse) -> web.StreamResponse:
        if _include_usage(body):
            await _sse_send(resp, {**envelope([]), "usage": gen.usage(), **gen.extra()})
        return await _sse_done(resp)

    return await _stream_events(request, gen, None, on_token, on_end)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions. Streaming sends the assistant-role chunk together with
    the first token (as vLLM does), so the first event marks TTFT."""
    body = await _json_body(request)
    if "messages" not in body:
        raise BadRequest("'messages' is required")
    tokens = messages_tokens(body["messages"])
    max_tokens = _max_tokens(body, "max_completion_tokens", "max_tokens")
    gen = await _submit(
        request, body, tokens, max_tokens, generate=True,
        limit_fields=("max_tokens", "max_completion_tokens"),
    )
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    if not body.get("stream"):
        await gen.wait()
        return _json_response(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": gen.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": gen.text()},
                        "logprobs": None,
                        "finish_reason": "length",
                    }
                ],
                "usage": gen.usage(),
                **gen.extra(),
            }
        )

    def chunk(choices: list[Json]) -> Json:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": gen.model,
            "choices": choices,
        }

    def delta(d: Json, finish: str | None) -> Json:
        return chunk([{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}])

    role_sent = False

    async def send_role(resp: web.StreamResponse) -> None:
        nonlocal role_sent
        if not role_sent:
            role_sent = True
            await _sse_send(resp, delta({"role": "assistant", "content": ""}, None))

    async def on_token(resp: web.StreamResponse, i: int) -> None:
        await send_role(resp)
        last = i == gen.max_tokens - 1
        await _sse_send(resp, delta({"content": _token_text(i)}, "length" if last else None))

    async def on_end(resp: web.StreamResponse) -> web.StreamResponse:
        await send_role(resp)
        if _include_usage(body):
            await _sse_send(resp, {**chunk([]), "usage": gen.usage(), **gen.extra()})
        return await _sse_done(resp)

    return await _stream_events(request, gen, None, on_token, on_end)


async def embeddings(request: web.Request) -> web.StreamResponse:
    """POST /v1/embeddings: one fixed-size deterministic vector per input, answered
    when the engine has prefilled the inputs (no decode)."""
    body = await _json_body(request)
    if "input" not in body:
        raise BadRequest("'input' is required")
    inp = body["input"]
    tokens = prompt_tokens(inp)
    gen = await _submit(request, body, tokens, 0, generate=False)
    await gen.wait()
    items: list[Any] = (
        inp if isinstance(inp, list) and inp and not isinstance(inp[0], int) else [inp]
    )
    data = []
    for i, item in enumerate(items):
        digest = hashlib.sha256(orjson.dumps(item)).digest()
        data.append(
            {
                "object": "embedding",
                "index": i,
                "embedding": [b / 255.0 for b in digest[:EMBEDDING_DIM]],
            }
        )
    return _json_response(
        {"object": "list", "data": data, "model": gen.model, "usage": gen.usage()}
    )


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses (OpenAI Responses API); streams typed events when asked."""
    body = await _json_body(request)
    if "input" not in body:
        raise BadRequest("'input' is required")
    tokens = responses_input_tokens(body["input"])
    gen = await _submit(
        request, body, tokens, _max_tokens(body, "max_output_tokens"), generate=True,
        limit_fields=("max_output_tokens",),
    )
    rid, msg_id, created = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time())

    def final() -> Json:
        usage = gen.usage()
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": "completed",
            "model": gen.model,
            "output": [
                {
                    "type": "message",
                    "id": msg_id,
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": gen.text(), "annotations": []}],
                }
            ],
            "usage": {
                "input_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"],
                "input_tokens_details": usage["prompt_tokens_details"],
                "output_tokens_details": {"reasoning_tokens": 0},
            },
            **gen.extra(),
        }

    if not body.get("stream"):
        await gen.wait()
        return _json_response(final())

    async def on_start(resp: web.StreamResponse) -> None:
        in_progress = {**final(), "status": "in_progress", "output": [], "usage": None}
        await _sse_send(
            resp, {"type": "response.created", "response": in_progress}, "response.created"
        )

    async def on_token(resp: web.StreamResponse, i: int) -> None:
        await _sse_send(
            resp,
            {
                "type": "response.output_text.delta",
                "item_id": msg_id,
                "output_index": 0,
                "content_index": 0,
                "delta": _token_text(i),
            },
            "response.output_text.delta",
        )

    async def on_end(resp: web.StreamResponse) -> web.StreamResponse:
        await _sse_send(
            resp, {"type": "response.completed", "response": final()}, "response.completed"
        )
        await resp.write_eof()
        return resp

    return await _stream_events(request, gen, on_start, on_token, on_end)


async def models(request: web.Request) -> web.StreamResponse:
    """GET /v1/models: the served model, then each LoRA adapter (``parent`` = base)."""
    state = request.app[STATE_KEY]

    def card(name: str, parent: str | None) -> Json:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "epp-sim",
            "root": name,
            "parent": parent,
        }

    data = [card(state.model, None)] + [card(n, state.model) for n in state.config.loras]
    return _json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.StreamResponse:
    """GET /health: 200 with an empty body, like vLLM; 503 during slow start."""
    if request.app[STATE_KEY].engine.in_slow_start():
        return web.Response(status=503, text="starting")
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.StreamResponse:
    """GET /metrics: Prometheus text with vLLM metric names."""
    body = render(request.app[STATE_KEY].registry)
    return web.Response(body=body, headers={"Content-Type": _PROMETHEUS})


async def debug_requests(request: web.Request) -> web.StreamResponse:
    """GET /debug/requests: the recorded POSTs, oldest first."""
    return _json_response(list(request.app[STATE_KEY].requests))


async def debug_requests_clear(request: web.Request) -> web.StreamResponse:
    """DELETE /debug/requests: forget the recorded POSTs."""
    request.app[STATE_KEY].requests.clear()
    return web.Response(status=204)


async def debug_state(request: web.Request) -> web.StreamResponse:
    """GET /debug/state: name, model, role, parameters and the engine's state."""
    state = request.app[STATE_KEY]
    return _json_response(
        {
            "name": state.name,
            "model": state.model,
            "role": state.config.role,
            "delay_s": state.delay_s,
            "config": state.config.as_dict(),
            "engine": state.engine.snapshot(),
            "topology": state.own_topology(_local_port(request)),
            "pd": state.pd.as_dict(),
        }
    )


# ---------------------------------------------------------------- app and servers


def build_app(
    name: str,
    model: str = DEFAULT_MODEL,
    *,
    delay_s: float = 0.0,
    config: SimConfig | None = None,
    address: str = "127.0.0.1",
    topology: dict[str, str] | None = None,
    peers: PeerTopology | None = None,
) -> web.Application:
    """One simulated pod named ``name`` serving ``model`` with ``config`` (defaults:
    :class:`SimConfig`).

    P/D (decode role): ``topology`` is this pod's own (level → value), ``peers`` the
    topologies of the pods in an endpoints file, where this pod finds its own entry by
    ``address`` and its port when ``topology`` is not given. Together they price KV
    transfers by distance; without them every transfer costs
    ``kv_transfer_ms_per_token``.

    ``delay_s`` (>= 0, wall-clock seconds, not scaled by ``time_scale``) delays every
    POST before it reaches the engine; the request is not running or waiting meanwhile. The app's state is at
    ``app[STATE_KEY]`` (:class:`SimState`); its engine starts with the app and stops on
    shutdown, failing pending requests.
    """
    if delay_s < 0:
        raise ValueError(f"delay_s must be >= 0, got {delay_s}")
    cfg = config if config is not None else SimConfig()
    engine = Engine(cfg)
    app = web.Application(middlewares=[_track], client_max_size=1 << 30)
    app[STATE_KEY] = SimState(
        name=name,
        model=model,
        config=cfg,
        engine=engine,
        registry=build_registry(engine, model),
        rng=random.Random(f"{cfg.seed}:{name}"),
        delay_s=delay_s,
        address=address,
        topology=dict(topology) if topology else None,
        peers=peers,
    )

    async def start_engine(_: web.Application) -> None:
        engine.start()

    async def stop_engine(_: web.Application) -> None:
        await engine.stop()
        http = app[STATE_KEY].http
        if http is not None:
            await http.close()

    app.on_startup.append(start_engine)
    app.on_shutdown.append(stop_engine)
    app.on_cleanup.append(stop_engine)
    app.on_response_prepare.append(_stamp)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/requests", debug_requests)
    app.router.add_delete("/debug/requests", debug_requests_clear)
    app.router.add_get("/debug/state", debug_state)
    return app


async def start_servers(
    host: str,
    ports: Sequence[int],
    model: str = DEFAULT_MODEL,
    *,
    delay_s: float = 0.0,
    config: SimConfig | None = None,
    topology: dict[str, str] | None = None,
    peers: PeerTopology | None = None,
) -> list[web.AppRunner]:
    """Start one app per port (named ``sim-<port>``) on ``host``; return their runners.

    Each app has its own engine with the same ``config``. The caller owns the runners
    and must ``await runner.cleanup()`` each. If one port cannot be bound, the ones
    already started are cleaned up and the OSError propagates.
    """
    runners: list[web.AppRunner] = []
    try:
        for port in ports:
            app = build_app(
                f"sim-{port}", model, delay_s=delay_s, config=config, address=host,
                topology=topology, peers=peers,
            )
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, host, port).start()
    except BaseException:
        for r in runners:
            await r.cleanup()
        raise
    return runners


@contextlib.asynccontextmanager
async def serving(
    host: str,
    ports: Sequence[int],
    model: str = DEFAULT_MODEL,
    *,
    delay_s: float = 0.0,
    config: SimConfig | None = None,
    topology: dict[str, str] | None = None,
    peers: PeerTopology | None = None,
) -> AsyncIterator[list[web.AppRunner]]:
    """``async with serving(...)``: :func:`start_servers`, cleaned up on exit."""
    runners = await start_servers(
        host, ports, model, delay_s=delay_s, config=config, topology=topology, peers=peers
    )
    try:
        yield runners
    finally:
        for r in runners:
            await r.cleanup()


async def run_servers(
    host: str,
    ports: list[int],
    model: str = DEFAULT_MODEL,
    *,
    delay_s: float = 0.0,
    config: SimConfig | None = None,
    topology: dict[str, str] | None = None,
    peers: PeerTopology | None = None,
) -> None:
    """Serve one simulated pod per port in this process until cancelled."""
    cfg = config if config is not None else SimConfig()
    async with serving(
        host, ports, model, delay_s=delay_s, config=cfg, topology=topology, peers=peers
    ):
        print(
            f"sim: serving model {model!r} (role {cfg.role}) on "
            + ", ".join(f"{host}:{p}" for p in ports),
            flush=True,
        )
        await asyncio.Event().wait()


def build_parser() -> argparse.ArgumentParser:
    """The ``epp sim`` argument parser (defaults from :class:`SimConfig`)."""
    d = SimConfig()
    p = argparse.ArgumentParser(
        prog="epp sim",
        description="vLLM-like OpenAI-compatible model-server simulator: one simulated pod "
        "per --port, each with its own engine (continuous batching, chunked prefill, prefix "
        "cache, LoRA slots). Durations are model milliseconds, multiplied by --time-scale. "
        "See docs/simulator.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--port", type=int, action="append", required=True,
        help="port to serve a simulated pod on (repeatable)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--model", default=DEFAULT_MODEL, help="served base model name")
    p.add_argument("--role", choices=ROLES, default=d.role,
                   help="prefill: answer with 1 token (P/D prefill pod); decode: price "
                   "prompts with kv_transfer_params.do_remote_prefill as KV transfer")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random source")
    p.add_argument("--delay-s", type=float, default=0.0,
                   help="extra latency before every POST reaches the engine (seconds)")  # fmt: skip
    g = p.add_argument_group("batching and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most sequences running at once; the rest wait")  # fmt: skip
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget per engine step (decode tokens + prefill chunks)")  # fmt: skip
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks,
                   help="KV cache capacity in blocks (running sequences + prefix cache)")  # fmt: skip
    g = p.add_argument_group("step cost (model milliseconds)")
    g.add_argument("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token,
                   help="cost per uncached prompt token")  # fmt: skip
    g.add_argument("--decode-base-ms", type=float, default=d.decode_base_ms,
                   help="fixed cost of a step that decodes")  # fmt: skip
    g.add_argument("--decode-per-seq-ms", type=float, default=d.decode_per_seq_ms,
                   help="extra cost per decoding sequence in a step")  # fmt: skip
    g.add_argument("--kv-transfer-ms-per-token", type=float, default=d.kv_transfer_ms_per_token,
                   help="decode role: cost per prompt token pulled from a prefill pod whose "
                   "distance is unknown")  # fmt: skip
    g = p.add_argument_group("P/D disaggregation (decode role; see docs/disaggregation.md)")
    g.add_argument("--kv-transfer-cost", action="append", default=[],
                   metavar="LEVEL=MS[,LEVEL=MS...]",
                   help="KV-transfer cost per token by the prefill pod's distance: node, "
                   "rack, block, zone or other (repeatable; default "
                   + ",".join(f"{k}={v:g}" for k, v in d.kv_transfer_ms_per_token_by_level)
                   + ")")  # fmt: skip
    g.add_argument("--topology", default="", metavar="LEVEL=VALUE[,...]",
                   help="this pod's topology, e.g. node=n1,rack=r1,block=b1,zone=z1 (default: "
                   "its entry in --peer-topology-file)")  # fmt: skip
    g.add_argument("--peer-topology-file", default=None, metavar="FILE",
                   help="the endpoints file `epp serve --endpoints-file` reads (labels, "
                   "nodeName, nodes: labels); gives each prefill pod's topology, and this "
                   "pod's own when --topology is not given; re-read when it changes")  # fmt: skip
    g.add_argument("--topology-label", action="append", default=[], metavar="LEVEL=KEY",
                   help="label key of a level in --peer-topology-file (defaults: "
                   "node=kubernetes.io/hostname (else nodeName), "
                   "rack=topology.kubernetes.io/rack, block=topology.kubernetes.io/block, "
                   "zone=topology.kubernetes.io/zone)")  # fmt: skip
    g.add_argument("--prefill-failure", choices=PREFILL_FAILURE_MODES, default=d.prefill_failure,
                   help="when the prefill pod fails: prefill locally (fallback), or return "
                   "its status as llm-d's sidecar does (error)")  # fmt: skip
    g.add_argument("--prefill-timeout-s", type=float, default=d.prefill_timeout_s,
                   help="give up on the prefill pod after this long (wall-clock seconds)")  # fmt: skip
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora", action="append", default=[], metavar="NAME[,NAME...]",
                   help="LoRA adapter served besides the base model (repeatable)")  # fmt: skip
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="adapter slots (distinct adapters running at once)")  # fmt: skip
    g.add_argument("--lora-load-ms", type=float, default=d.lora_load_ms,
                   help="added to a step per adapter loaded in it")  # fmt: skip
    g = p.add_argument_group("failure injection and time")
    g.add_argument("--error-rate", type=float, default=d.error_rate,
                   help="probability that a valid request gets a 500")  # fmt: skip
    g.add_argument("--slow-start-s", type=float, default=d.slow_start_s,
                   help="after start, /health is 503 and steps are slower for this long "
                   "(seconds, scaled by --time-scale)")  # fmt: skip
    g.add_argument("--slow-start-factor", type=float, default=d.slow_start_factor,
                   help="step-time multiplier during slow start")  # fmt: skip
    g.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="multiplies every modeled duration (0: no waiting at all)")  # fmt: skip
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The :class:`SimConfig` of parsed ``epp sim`` arguments; ValueError if invalid."""
    loras = tuple(n.strip() for arg in args.lora for n in arg.split(",") if n.strip())
    by_level = dict(SimConfig().kv_transfer_ms_per_token_by_level)
    for arg in getattr(args, "kv_transfer_cost", []):
        by_level.update(parse_level_costs(arg))
    return SimConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        prefill_ms_per_token=args.prefill_ms_per_token,
        decode_base_ms=args.decode_base_ms,
        decode_per_seq_ms=args.decode_per_seq_ms,
        kv_transfer_ms_per_token=args.kv_transfer_ms_per_token,
        kv_transfer_ms_per_token_by_level=tuple(by_level.items()),
        prefill_failure=args.prefill_failure,
        prefill_timeout_s=args.prefill_timeout_s,
        loras=loras,
        max_loras=args.max_loras,
        lora_load_ms=args.lora_load_ms,
        role=args.role,
        error_rate=args.error_rate,
        slow_start_s=args.slow_start_s,
        slow_start_factor=args.slow_start_factor,
        time_scale=args.time_scale,
        seed=args.seed,
    )


def topology_from_args(
    args: argparse.Namespace,
) -> tuple[dict[str, str] | None, PeerTopology | None]:
    """``--topology`` and ``--peer-topology-file`` / ``--topology-label``; ValueError if
    invalid (the file must exist and parse at startup)."""
    topology = parse_topology(args.topology) if args.topology else None
    keys: dict[str, str] = {}
    for item in args.topology_label:
        level, sep, key = item.partition("=")
        if not sep or level.strip() not in LEVELS or not key.strip():
            raise ValueError(f"--topology-label {item!r}: expected LEVEL=KEY with LEVEL one of "
                             f"{', '.join(LEVELS)}")
        keys[level.strip()] = key.strip()
    if args.peer_topology_file is None:
        if keys:
            raise ValueError("--topology-label needs --peer-topology-file")
        return topology, None
    return topology, PeerTopology(Path(args.peer_topology_file), keys)


def main(argv: Sequence[str] | None = None) -> int:
    """``epp sim --port 8001 --port 8002 [--model M] [--host H] [model options]``
    (also ``python -m epp.sim.server``).

    Runs until SIGINT or SIGTERM, then shuts the servers down cleanly; returns 0.
    Invalid options exit with status 2 and a message, like any argparse error.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.delay_s < 0:
        parser.error("--delay-s must be >= 0")
    try:
        config = config_from_args(args)
        topology, peers = topology_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))

    async def _run() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await run_servers(
                args.host, args.port, args.model, delay_s=args.delay_s, config=config,
                topology=topology, peers=peers,
            )

    asyncio.run(_run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
