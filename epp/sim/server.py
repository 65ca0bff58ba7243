"""A minimal OpenAI-compatible model server (vLLM-like) for tests, the demo and benchmarks.

One :func:`build_app` per simulated pod. It answers the OpenAI routes the EPP parses
(design.md section 3) with deterministic fake output, exports vLLM-named Prometheus
metrics (design.md section 6) and records what it received so tests can check, on the
upstream side, which pod Envoy routed to and that the body arrived intact.

Contracts
- Every response carries ``x-sim-server: <name>``.
- A POST whose body is not a JSON object gets 400 with an OpenAI error body
  ``{"error": {"message", "type", "code"}}``; so does one missing its route's required
  field (``prompt``, ``messages``, ``input``).
- ``usage.prompt_tokens`` is the whitespace word count of the prompt text (token ids
  count one each); ``completion_tokens`` is ``max_tokens`` (or
  ``max_completion_tokens``; Responses API: ``max_output_tokens``), default
  :data:`DEFAULT_MAX_TOKENS`; ``prompt_tokens_details.cached_tokens`` is 0. The Responses
  API uses its own names (``input_tokens``, ``output_tokens``, ``input_tokens_details``).
- ``"stream": true`` gives SSE: one event per completion token, each written (and so
  flushed) separately, then a usage-only chunk when ``stream_options.include_usage`` is
  true, then ``data: [DONE]``. (Responses API streams typed events and no ``[DONE]``.)
- Every POST is recorded, before any artificial delay, as ``{"path", "body_len",
  "body_sha256", "headers"}`` (header names lower-cased; repeated headers joined with
  ", ") in a deque of the last :data:`DEBUG_LOG_SIZE`; ``GET /debug/requests`` returns
  it oldest first, ``DELETE /debug/requests`` clears it.
- ``vllm:num_requests_running`` is the number of POST requests in flight right now;
  ``vllm:num_requests_waiting`` is 0 (no queue); ``vllm:kv_cache_usage_perc`` is
  ``min(1, running / MAX_NUM_SEQS)``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from aiohttp import web

__all__ = [
    "DEBUG_LOG_SIZE",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MODEL",
    "SIM_SERVER_HEADER",
    "SimState",
    "build_app",
    "main",
    "run_servers",
    "start_servers",
]

SIM_SERVER_HEADER: Final = "x-sim-server"
DEFAULT_MODEL: Final = "sim-model"
DEFAULT_MAX_TOKENS: Final = 16
DEBUG_LOG_SIZE: Final = 1000
MAX_NUM_SEQS: Final = 256
EMBEDDING_DIM: Final = 8

_JSON: Final = "application/json"
_SSE: Final = "text/event-stream"
_PROMETHEUS: Final = "text/plain; version=0.0.4; charset=utf-8"

Json = dict[str, Any]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class SimState:
    """Per-app mutable state (one simulated pod). Owned by its app, never shared."""

    name: str
    model: str
    delay_s: float = 0.0
    running: int = 0
    requests: deque[Json] = field(default_factory=lambda: deque(maxlen=DEBUG_LOG_SIZE))


STATE_KEY: Final = web.AppKey("sim_state", SimState)


class BadRequest(Exception):
    """A client error that becomes a 400 OpenAI error response."""


# ---------------------------------------------------------------- helpers


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type=_JSON)


def _error(message: str, status: int = 400, err_type: str = "BadRequestError") -> web.Response:
    return _json_response(
        {"error": {"message": message, "type": err_type, "code": status}}, status=status
    )


def _words(text: str) -> int:
    return len(text.split())


def _count_prompt(prompt: Any) -> int:
    """Word count of a completions ``prompt`` / embeddings ``input``: a string, a list of
    strings, a list of token ids, or a list of token-id lists (each id counts one)."""
    if isinstance(prompt, str):
        return _words(prompt)
    if isinstance(prompt, int):
        return 1
    if isinstance(prompt, list):
        return sum(_count_prompt(p) for p in prompt)
    raise BadRequest("prompt/input must be a string, a list of strings or token ids")


def _content_text(content: Any) -> str:
    """Text of a chat/Responses message ``content``: a string or a list of parts; parts
    without text (images, audio) contribute nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, str):
                texts.append(part)
        return " ".join(texts)
    raise BadRequest("message content must be a string or a list of content parts")


def _count_messages(messages: Any) -> int:
    if not isinstance(messages, list):
        raise BadRequest("'messages' must be a list")
    total = 0
    for msg in messages:
        if not isinstance(msg, dict):
            raise BadRequest("each message must be an object")
        total += _words(_content_text(msg.get("content")))
    return total


def _count_responses_input(inp: Any) -> int:
    if isinstance(inp, str):
        return _words(inp)
    if isinstance(inp, list):
        total = 0
        for item in inp:
            if isinstance(item, dict):
                total += _words(_content_text(item.get("content", item.get("text"))))
            elif isinstance(item, str):
                total += _words(item)
        return total
    raise BadRequest("'input' must be a string or a list of input items")


def _max_tokens(body: Json, *keys: str) -> int:
    for key in keys:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadRequest(f"'{key}' must be a non-negative integer")
            return value
    return DEFAULT_MAX_TOKENS


def _tokens(n: int) -> list[str]:
    """The fake completion: ``n`` tokens; each streamed token is one word."""
    return [f" tok{i}" for i in range(n)]


def _usage(prompt_tokens: int, completion_tokens: int) -> Json:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


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
    return body


async def _sse_start(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200, headers={"Content-Type": _SSE, "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    return resp


async def _sse_send(resp: web.StreamResponse, obj: Any, event: str | None = None) -> None:
    """Write one SSE event. Each event is its own write (its own HTTP chunk), and the
    drain lets the transport push it out before the next one is produced."""
    prefix = f"event: {event}\n".encode() if event else b""
    await resp.write(prefix + b"data: " + orjson.dumps(obj) + b"\n\n")
    await asyncio.sleep(0)


async def _sse_done(resp: web.StreamResponse) -> web.StreamResponse:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


# ---------------------------------------------------------------- middleware


@web.middleware
async def _track(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Record every POST and count it as running while it is handled (streams included);
    turn BadRequest into a 400."""
    state = request.app[STATE_KEY]
    if request.method != "POST":
        return await handler(request)
    raw = await request.read()
    state.requests.append(
        {
            "path": request.path,
            "body_len": len(raw),
            "body_sha256": hashlib.sha256(raw).hexdigest(),
            "headers": _lower_headers(request),
        }
    )
    state.running += 1
    try:
        if state.delay_s > 0:
            await asyncio.sleep(state.delay_s)
        return await handler(request)
    except BadRequest as exc:
        return _error(str(exc))
    finally:
        state.running -= 1


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
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required")
    prompt_tokens = _count_prompt(body["prompt"])
    tokens = _tokens(_max_tokens(body, "max_tokens"))
    model = _model(body, state)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    usage = _usage(prompt_tokens, len(tokens))
    if not body.get("stream"):
        return _json_response(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": "".join(tokens),
                        "logprobs": None,
                        "finish_reason": "length",
                    }
                ],
                "usage": usage,
            }
        )
    resp = await _sse_start(request)
    for i, tok in enumerate(tokens):
        last = i == len(tokens) - 1
        await _sse_send(
            resp,
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": tok,
                        "logprobs": None,
                        "finish_reason": "length" if last else None,
                    }
                ],
            },
        )
    if _include_usage(body):
        await _sse_send(
            resp,
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            },
        )
    return await _sse_done(resp)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    if "messages" not in body:
        raise BadRequest("'messages' is required")
    prompt_tokens = _count_messages(body["messages"])
    tokens = _tokens(_max_tokens(body, "max_completion_tokens", "max_tokens"))
    model = _model(body, state)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    usage = _usage(prompt_tokens, len(tokens))
    if not body.get("stream"):
        return _json_response(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(tokens)},
                        "logprobs": None,
                        "finish_reason": "length",
                    }
                ],
                "usage": usage,
            }
        )

    def chunk(delta: Json, finish: str | None) -> Json:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    resp = await _sse_start(request)
    await _sse_send(resp, chunk({"role": "assistant", "content": ""}, None))
    for i, tok in enumerate(tokens):
        await _sse_send(resp, chunk({"content": tok}, "length" if i == len(tokens) - 1 else None))
    if _include_usage(body):
        await _sse_send(
            resp,
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            },
        )
    return await _sse_done(resp)


async def embeddings(request: web.Request) -> web.StreamResponse:
    """POST /v1/embeddings: one fixed-size deterministic vector per input."""
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    if "input" not in body:
        raise BadRequest("'input' is required")
    inp = body["input"]
    prompt_tokens = _count_prompt(inp)
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
        {
            "object": "list",
            "data": data,
            "model": _model(body, state),
            "usage": _usage(prompt_tokens, 0),
        }
    )


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses (OpenAI Responses API); streams typed events when asked."""
    state = request.app[STATE_KEY]
    body = await _json_body(request)
    if "input" not in body:
        raise BadRequest("'input' is required")
    input_tokens = _count_responses_input(body["input"])
    tokens = _tokens(_max_tokens(body, "max_output_tokens"))
    model = _model(body, state)
    rid, msg_id, created = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time())
    text = "".join(tokens)
    usage = {
        "input_tokens": input_tokens,
        "output_tokens": len(tokens),
        "total_tokens": input_tokens + len(tokens),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    message = {
        "type": "message",
        "id": msg_id,
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    final = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "completed",
        "model": model,
        "output": [message],
        "usage": usage,
    }
    if not body.get("stream"):
        return _json_response(final)
    resp = await _sse_start(request)
    in_progress = {**final, "status": "in_progress", "output": [], "usage": None}
    await _sse_send(resp, {"type": "response.created", "response": in_progress}, "response.created")
    for tok in tokens:
        await _sse_send(
            resp,
            {
                "type": "response.output_text.delta",
                "item_id": msg_id,
                "output_index": 0,
                "content_index": 0,
                "delta": tok,
            },
            "response.output_text.delta",
        )
    await _sse_send(resp, {"type": "response.completed", "response": final}, "response.completed")
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.StreamResponse:
    """GET /v1/models: the served model."""
    state = request.app[STATE_KEY]
    return _json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": state.model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "epp-sim",
                    "root": state.model,
                    "parent": None,
                }
            ],
        }
    )


async def health(request: web.Request) -> web.StreamResponse:
    """GET /health: 200 with an empty body, like vLLM."""
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.StreamResponse:
    """GET /metrics: Prometheus text with vLLM metric names."""
    state = request.app[STATE_KEY]
    label = '{model_name="' + state.model.replace("\\", "\\\\").replace('"', '\\"') + '"}'
    kv = min(1.0, state.running / MAX_NUM_SEQS)
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{label} {float(state.running)}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{label} 0.0\n"
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{label} {kv}\n"
    )
    return web.Response(body=text.encode(), headers={"Content-Type": _PROMETHEUS})


async def debug_requests(request: web.Request) -> web.StreamResponse:
    """GET /debug/requests: the recorded POSTs, oldest first."""
    return _json_response(list(request.app[STATE_KEY].requests))


async def debug_requests_clear(request: web.Request) -> web.StreamResponse:
    """DELETE /debug/requests: forget the recorded POSTs."""
    request.app[STATE_KEY].requests.clear()
    return web.Response(status=204)


# ---------------------------------------------------------------- app and servers


def build_app(name: str, model: str = DEFAULT_MODEL, *, delay_s: float = 0.0) -> web.Application:
    """One simulated pod named ``name`` serving ``model``.

    ``delay_s`` (>= 0) delays every POST before it is answered (the request counts as
    running meanwhile). The app's state is at ``app[STATE_KEY]`` (:class:`SimState`).
    """
    if delay_s < 0:
        raise ValueError(f"delay_s must be >= 0, got {delay_s}")
    app = web.Application(middlewares=[_track], client_max_size=1 << 30)
    app[STATE_KEY] = SimState(name=name, model=model, delay_s=delay_s)
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
    return app


async def start_servers(
    host: str, ports: Sequence[int], model: str = DEFAULT_MODEL, *, delay_s: float = 0.0
) -> list[web.AppRunner]:
    """Start one app per port (named ``sim-<port>``) on ``host``; return their runners.

    The caller owns the runners and must ``await runner.cleanup()`` each. If one port
    cannot be bound, the ones already started are cleaned up and the OSError propagates.
    """
    runners: list[web.AppRunner] = []
    try:
        for port in ports:
            runner = web.AppRunner(
                build_app(f"sim-{port}", model, delay_s=delay_s), access_log=None
            )
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
    host: str, ports: Sequence[int], model: str = DEFAULT_MODEL, *, delay_s: float = 0.0
) -> AsyncIterator[list[web.AppRunner]]:
    """``async with serving(...)``: :func:`start_servers`, cleaned up on exit."""
    runners = await start_servers(host, ports, model, delay_s=delay_s)
    try:
        yield runners
    finally:
        for r in runners:
            await r.cleanup()


async def run_servers(
    host: str, ports: list[int], model: str = DEFAULT_MODEL, *, delay_s: float = 0.0
) -> None:
    """Serve one simulated pod per port in this process until cancelled."""
    async with serving(host, ports, model, delay_s=delay_s):
        print(
            f"sim: serving model {model!r} on " + ", ".join(f"{host}:{p}" for p in ports),
            flush=True,
        )
        await asyncio.Event().wait()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m epp.sim.server --port 8001 --port 8002 [--model M] [--host H] [--delay-s S]``.

    Runs until SIGINT or SIGTERM, then shuts the servers down cleanly; returns 0.
    """
    parser = argparse.ArgumentParser(
        prog="python -m epp.sim.server", description="OpenAI-compatible model-server simulator"
    )
    parser.add_argument(
        "--port",
        type=int,
        action="append",
        required=True,
        help="port to serve a simulated pod on (repeatable)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--delay-s",
        type=float,
        default=0.0,
        help="artificial latency added to every POST (seconds)",
    )
    args = parser.parse_args(argv)
    if args.delay_s < 0:
        parser.error("--delay-s must be >= 0")

    async def _run() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await run_servers(args.host, args.port, args.model, delay_s=args.delay_s)

    asyncio.run(_run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
