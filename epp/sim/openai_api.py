"""The OpenAI API of a simulated pod: request parsing, generation, JSON and SSE answers.

Routes (registered by :func:`epp.sim.app.build_app`): ``POST /v1/completions``,
``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/responses``, ``/v1/messages``
(Anthropic's Messages API, as llm-d's inference simulator serves it: read as a chat
request), ``/tokenize`` and ``GET /v1/models``.

Contracts
- A POST whose body is not a JSON object gets 400 with an OpenAI error body
  ``{"error": {"message", "type", "code"}}``; so does one missing its route's required
  field (``prompt``, ``messages``, ``input``), and one whose prompt plus ``max_tokens``
  could never fit in the KV cache.
- Tokens come from the pod's tokenizer (:mod:`epp.sim.tokens`: whitespace words by
  default, a ``--tokenizer`` with its chat template otherwise). ``usage.prompt_tokens``
  is the prompt's token count (token ids count one each); ``completion_tokens`` is
  ``max_tokens`` (or ``max_completion_tokens``; Responses API: ``max_output_tokens``),
  default :data:`~epp.sim.state.DEFAULT_MAX_TOKENS`, and 1 on a ``prefill``-role server;
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
- Once the body parses, the request's ``/debug/requests`` record gains ``fields``
  (``model``, ``stream``, the output-token limits, ``kv_transfer_params``,
  ``ec_transfer_params`` and ``cache_hit_threshold``, those present).
- P/D: a prefill-role pod answers with ``kv_transfer_params``; a decode-role pod first
  has the pod named by ``x-prefiller-host-port`` prefill (:mod:`epp.sim.sidecar`).
- E/P/D: an encode-role pod answers every generation with one token, and a chat request
  with ``ec_transfer_params`` for its multimodal items; a decode-role pod first has the
  pods named by ``x-encoder-hosts-ports`` encode a chat request's items, then prefills
  (remotely or locally) without encoding them again.
- Encode cost: a chat request's multimodal items (:func:`epp.sim.sidecar.mm_items`) cost
  ``encode_ms_per_image`` each in the step that admits it, on an encode pod and on a pod
  that prefills the request itself without ``ec_transfer_params`` (no encode pod did the
  work); the record gains ``encoded`` (``items``, ``encode_ms``).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson
from aiohttp import web

from epp.keys import HEADER_ENCODERS, HEADER_PREFILLER
from epp.sim.engine import EngineError, PromptTooLong, SimRequest
from epp.sim.sidecar import (
    encode_answer_params,
    mm_items,
    prefill_answer_params,
    remote_encode,
    remote_prefill,
)
from epp.sim.state import (
    DEFAULT_MAX_TOKENS,
    RECORD_KEY,
    STATE_KEY,
    HttpError,
    Json,
    SimState,
    json_response,
)
from epp.sim.tokens import BadRequest, Encoded, SimTokenizer

__all__ = [
    "EMBEDDING_DIM",
    "chat_completions",
    "completions",
    "embeddings",
    "messages",
    "models",
    "responses",
    "tokenize",
]

EMBEDDING_DIM: Final = 8

_SSE: Final = "text/event-stream"
_RECORDED_FIELDS: Final = (
    "model",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "kv_transfer_params",
    "ec_transfer_params",
    "cache_hit_threshold",
)


# ---------------------------------------------------------------- parsing and SSE


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
    record = request.get(RECORD_KEY)
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


def _tokenizer(request: web.Request) -> SimTokenizer:
    return request.app[STATE_KEY].tokenizer


def _flag(body: Json, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be a boolean")
    return value


def _chat(tokenizer: SimTokenizer, body: Json) -> Encoded:
    """Tokens of a chat request's ``messages`` with vLLM's chat options
    (``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``,
    ``chat_template``, ``chat_template_kwargs``)."""
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise BadRequest("'chat_template' must be a string")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object")
    return tokenizer.chat(
        body["messages"],
        add_generation_prompt=_flag(body, "add_generation_prompt", True),
        continue_final_message=_flag(body, "continue_final_message", False),
        add_special_tokens=_flag(body, "add_special_tokens", False),
        chat_template=template,
        chat_template_kwargs=kwargs,
    )


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
    ec_transfer_params: Json | None = None

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
        """Top-level response fields besides the OpenAI ones (P/D and E/P/D transfer
        params)."""
        out: Json = {}
        if self.kv_transfer_params is not None:
            out["kv_transfer_params"] = self.kv_transfer_params
        if self.ec_transfer_params is not None:
            out["ec_transfer_params"] = self.ec_transfer_params
        return out

    async def wait(self) -> None:
        """Until the last token; 503 if the engine stops first. Aborts on cancel."""
        try:
            await self.req.result()
        except EngineError as exc:
            raise HttpError(503, str(exc), "ServiceUnavailableError") from None
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
    tokens: list[int],
    max_tokens: int,
    *,
    generate: bool,
    limit_fields: tuple[str, ...] = (),
) -> _Gen:
    """Accept a parsed request: role rules, the KV-fit check (400), failure injection
    (500; only requests that pass the checks draw), the decode sidecar's remote encode
    (decode role, ``x-encoder-hosts-ports`` set; :func:`epp.sim.sidecar.remote_encode`)
    and remote prefill (decode role, ``x-prefiller-host-port`` set; see
    :func:`epp.sim.sidecar.remote_prefill`), the encode cost of the multimodal items this
    pod encodes itself, engine submission (503 once the engine is stopped).

    ``generate`` is False for embeddings (prefill only, no role rules);
    ``limit_fields`` are the route's output-token limit fields (set to 1 in the prefill
    request).
    """
    state = request.app[STATE_KEY]
    cfg = state.config
    model = _model(body, state)
    lora = model if model in cfg.loras else None
    if generate and cfg.role in ("prefill", "encode"):
        max_tokens = 1
    try:
        state.engine.validate(len(tokens), max_tokens, lora)
    except PromptTooLong as exc:
        raise BadRequest(str(exc)) from None
    if state.inject_error():  # only requests that would be served draw
        raise HttpError(500, "simulated internal server error", "InternalServerError")
    params = body.get("kv_transfer_params")
    params = params if isinstance(params, dict) else None
    remote = False
    out_params: Json | None = None
    if generate and cfg.role == "prefill" and params is not None:
        out_params = prefill_answer_params(request, state, len(tokens))
    transfer: float | None = None
    encoded_remotely = isinstance(body.get("ec_transfer_params"), dict) and bool(
        body["ec_transfer_params"])
    if generate and cfg.role == "decode":
        encoders = request.headers.get(HEADER_ENCODERS, "").strip()
        if encoders:
            body, by_pods = await remote_encode(request, state, body, encoders)
            encoded_remotely = encoded_remotely or by_pods
        prefiller = request.headers.get(HEADER_PREFILLER, "").strip()
        if prefiller:
            got, transfer = await remote_prefill(request, state, body, limit_fields, prefiller)
            params = got  # the prefill pod's params replace the client's
        remote = params is not None and params.get("do_remote_prefill") is True
    items = mm_items(body) if generate else []
    ec_params: Json | None = None
    encode_items = 0
    if cfg.role == "encode" and generate:
        encode_items = len(items)
        if body.get("messages") is not None:
            ec_params = encode_answer_params(request, items)
    elif not remote and not encoded_remotely:
        encode_items = len(items)
    encode_ms = encode_items * cfg.encode_ms_per_image
    try:
        req = state.engine.submit(
            tokens, max_tokens, lora=lora, remote_prefill=remote, transfer_ms_per_token=transfer,
            encode_ms=encode_ms,
        )
    except PromptTooLong as exc:
        raise BadRequest(str(exc)) from None
    except EngineError as exc:  # stopped: the server is shutting down
        raise HttpError(503, str(exc), "ServiceUnavailableError") from None
    if encode_items:
        state.encode.charge(encode_items, encode_ms)
        record = request.get(RECORD_KEY)
        if record is not None:
            record["encoded"] = {"items": encode_items, "encode_ms": encode_ms}
    return _Gen(state, req, len(tokens), max_tokens, model, out_params, ec_params)


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



# ---------------------------------------------------------------- routes


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    body = await _json_body(request)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required")
    tokens = _tokenizer(request).prompt(
        body["prompt"], add_special_tokens=_flag(body, "add_special_tokens", True))[0]
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
        return json_response({**envelope([choice]), "usage": gen.usage(), **gen.extra()})

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
    tokens = _chat(_tokenizer(request), body)[0]
    max_tokens = _max_tokens(body, "max_completion_tokens", "max_tokens")
    gen = await _submit(
        request, body, tokens, max_tokens, generate=True,
        limit_fields=("max_tokens", "max_completion_tokens"),
    )
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    if not body.get("stream"):
        await gen.wait()
        return json_response(
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


def _anthropic_chat(body: Json) -> Json:
    """The chat body an Anthropic Messages body stands for (llm-d's inference simulator
    converts it the same way): ``system`` (a string or text blocks) first as a system
    message, then ``messages``; content blocks keep their ``text`` (``image``,
    ``tool_use`` … blocks add no tokens). 400 when ``messages`` is missing or empty,
    ``max_tokens`` is missing, or an ``image`` block has no ``source``."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty array")
    if body.get("max_tokens") is None:
        raise BadRequest("'max_tokens' is required")
    chat: list[Any] = []
    system = body.get("system")
    if system is not None:
        if not isinstance(system, (str, list)):
            raise BadRequest("'system' must be a string or an array of text blocks")
        chat.append({"role": "system", "content": system})
    for msg in msgs:
        if not isinstance(msg, dict):
            raise BadRequest("each message must be an object with 'role' and 'content'")
        content = msg.get("content")
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") == "image" \
                        and block.get("source") is None:
                    raise BadRequest("image content block is missing required 'source' field")
        chat.append(msg)
    return {**body, "messages": chat}


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages (Anthropic Messages API): ``{"id": "msg_…", "type": "message",
    "role": "assistant", "content": [{"type": "text", …}], "stop_reason": "max_tokens",
    "usage": {"input_tokens", "output_tokens", "cache_creation_input_tokens",
    "cache_read_input_tokens"}}``; streaming sends Anthropic's events (``message_start``,
    ``content_block_start`` and ``ping`` with the first token, ``content_block_delta`` per
    token, ``content_block_stop``, ``message_delta`` with the output tokens,
    ``message_stop``), no ``[DONE]``."""
    body = await _json_body(request)
    chat = _anthropic_chat(body)
    tokens = _chat(_tokenizer(request), chat)[0]
    gen = await _submit(
        request, body, tokens, _max_tokens(body, "max_tokens"), generate=True,
        limit_fields=("max_tokens",),
    )
    mid = f"msg_{uuid.uuid4().hex}"

    def message(content: list[Json], stop: str | None, output_tokens: int) -> Json:
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": gen.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {
                "input_tokens": gen.prompt_tokens,
                "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": gen.req.cached_tokens,
            },
        }

    if not body.get("stream"):
        await gen.wait()
        text = [{"type": "text", "text": gen.text()}]
        return json_response({**message(text, "max_tokens", gen.req.generated), **gen.extra()})

    started = False

    async def on_start(resp: web.StreamResponse) -> None:
        await _sse_send(resp, {"type": "message_start", "message": message([], None, 0)},
                        "message_start")

    async def start_block(resp: web.StreamResponse) -> None:
        nonlocal started
        if not started:
            started = True
            await _sse_send(resp, {"type": "content_block_start", "index": 0,
                                   "content_block": {"type": "text", "text": ""}},
                            "content_block_start")
            await _sse_send(resp, {"type": "ping"}, "ping")

    async def on_token(resp: web.StreamResponse, i: int) -> None:
        await start_block(resp)
        await _sse_send(resp, {"type": "content_block_delta", "index": 0,
                               "delta": {"type": "text_delta", "text": _token_text(i)}},
                        "content_block_delta")

    async def on_end(resp: web.StreamResponse) -> web.StreamResponse:
        await start_block(resp)
        await _sse_send(resp, {"type": "content_block_stop", "index": 0}, "content_block_stop")
        await _sse_send(resp, {"type": "message_delta",
                               "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                               "usage": {"output_tokens": gen.req.generated}},
                        "message_delta")
        await _sse_send(resp, {"type": "message_stop"}, "message_stop")
        await resp.write_eof()
        return resp

    return await _stream_events(request, gen, on_start, on_token, on_end)


async def embeddings(request: web.Request) -> web.StreamResponse:
    """POST /v1/embeddings: one fixed-size deterministic vector per input, answered
    when the engine has prefilled the inputs (no decode)."""
    body = await _json_body(request)
    if "input" not in body:
        raise BadRequest("'input' is required")
    inp = body["input"]
    tokens = _tokenizer(request).prompt(inp)[0]
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
    return json_response(
        {"object": "list", "data": data, "model": gen.model, "usage": gen.usage()}
    )


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses (OpenAI Responses API); streams typed events when asked."""
    body = await _json_body(request)
    if "input" not in body:
        raise BadRequest("'input' is required")
    tokens = _tokenizer(request).responses_input(body["input"])[0]
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
        return json_response(final())

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


async def tokenize(request: web.Request) -> web.StreamResponse:
    """POST /tokenize (vLLM's ``TokenizeCompletionRequest`` / ``TokenizeChatRequest``):
    ``{"model", "prompt", "add_special_tokens"=true}`` or ``{"model", "messages",
    "add_generation_prompt"=true, "continue_final_message"=false,
    "add_special_tokens"=false, "chat_template", "chat_template_kwargs"}``, each with
    ``return_token_strs``; answers vLLM's ``TokenizeResponse`` ``{"count",
    "max_model_len", "tokens", "token_strs"}`` (``token_strs`` null unless asked for).
    Nothing reaches the engine."""
    body = await _json_body(request)
    state = request.app[STATE_KEY]
    if "messages" in body:
        ids, strs = _chat(state.tokenizer, body)
    elif "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise BadRequest("'prompt' must be a string")
        ids, strs = state.tokenizer.prompt(
            body["prompt"], add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        raise BadRequest("'prompt' or 'messages' is required")
    cfg = state.config
    return json_response({
        "count": len(ids),
        "max_model_len": cfg.num_gpu_blocks * cfg.block_size,
        "tokens": ids,
        "token_strs": strs if _flag(body, "return_token_strs", False) else None,
    })


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
    return json_response({"object": "list", "data": data})
