"""Anthropic's Messages API (llm-d-router's ``anthropic-parser``).

Requests: ``…/messages`` bodies are JSON objects with ``messages`` (a non-empty array of
``{role, content}``; ``content`` a string or an array of content blocks), an optional
``system`` (a string or an array of text blocks), ``tools``, ``model``, ``stream``,
``max_tokens`` (the output cap) and ``cache_salt``. ``…/messages/count_tokens`` bodies
are not read for routing: they pass through unchanged and their responses are not
parsed. Any other path is an error.

Responses: usage from a JSON body's ``usage`` (``input_tokens``, ``output_tokens``,
``cache_read_input_tokens``) or, for ``text/event-stream`` responses, from the
``message_start`` event's ``message.usage`` (input and cached tokens) and the
``message_delta`` events' ``usage.output_tokens``.

Followed: llm-d-router v0.10.0
pkg/epp/framework/plugins/requesthandling/parsers/anthropic/anthropic.go (and its
README, anthropic_test.go) and ``MessagesRequest`` in
pkg/epp/framework/interface/requesthandling/types.go.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import orjson

from epp.errors import BadRequest
from epp.parsing.request import (
    ParsedRequest,
    _dumps_sorted,
    _json_type,
    _render_message,
    _render_parts,
)
from epp.parsing.usage import Usage
from epp.parsing.vllm_http import request_path
from epp.scheduling.types import ApiType

MESSAGES_API: Final = "messages"
COUNT_TOKENS_API: Final = "messages/count_tokens"
# llm-d's GetRequestPath: with no path header the request counts as a completions one.
DEFAULT_PATH: Final = "/v1/completions"


def _path(headers: Mapping[str, str]) -> str:
    return request_path(headers) or DEFAULT_PATH


def is_count_tokens(headers: Mapping[str, str]) -> bool:
    return _path(headers).endswith("/" + COUNT_TOKENS_API)


def _invalid(msg: str) -> BadRequest:
    return BadRequest(f"invalid messages request: {msg}")


def _render_system(system: Any, out: list[str]) -> None:
    if system is None:
        return
    if isinstance(system, str):
        if not system:
            return
        out.append("<|system|>\n")
        out.append(system)
    elif isinstance(system, list):
        out.append("<|system|>\n")
        _render_parts(system, "system", out)
    else:
        raise _invalid(f"'system' must be a string or an array of content blocks, "
                       f"got {_json_type(system)}")
    out.append("\n")


def _whole(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not v.is_integer():
        return None
    return int(v) if v >= 0 else None


def parse_messages_request(headers: Mapping[str, str], body: bytes) -> ParsedRequest:
    """Parse an Anthropic Messages API request (see the module docstring).

    Raises :class:`BadRequest` (400) for a path that is neither ``…/messages`` nor
    ``…/messages/count_tokens``, a body that is not a JSON object, missing or empty
    ``messages``, or a message / content block of the wrong shape. ``model`` is optional
    (as in llm-d); without it the ``x-gateway-model-name-rewrite`` header must name one.
    """
    path = _path(headers)
    if path.endswith("/" + COUNT_TOKENS_API):
        # Forwarded unchanged, nothing parsed for routing (llm-d: RawPayload,
        # SkipResponseProcessing). The model is read when the body names one, so the
        # request can be routed to a pool serving it.
        model = ""
        try:
            data = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("model"), str):
            model = data["model"]
        return ParsedRequest(api=ApiType.OTHER, model=model, prompt="", stream=False,
                             max_tokens=None, cache_salt=None, user=None, data=None)
    if not path.endswith("/" + MESSAGES_API):
        raise BadRequest(f"unsupported API endpoint: {path} (the anthropic-parser reads "
                         f"…/{MESSAGES_API} and …/{COUNT_TOKENS_API})")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {_json_type(data)}")
    messages = data.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise _invalid(f"'messages' must be an array, got {_json_type(messages)}")
    if not messages:
        raise _invalid("must have at least one message")
    salt = data.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _invalid(f"'cache_salt' must be a string, got {_json_type(salt)}")
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _invalid(f"'tools' must be an array, got {_json_type(tools)}")

    out: list[str] = []
    if tools:
        out.append("<|tools|>\n")
        out.append(_dumps_sorted(tools))
        out.append("\n")
    _render_system(data.get("system"), out)
    for i, msg in enumerate(messages):
        if isinstance(msg, dict) and msg.get("content") is None:
            raise _invalid(f"'messages[{i}].content' is required (a string or an array "
                           "of content blocks)")
        _render_message(msg, f"messages[{i}]", out)
    name = data.get("model")
    return ParsedRequest(
        api=ApiType.OTHER,
        model=name if isinstance(name, str) else "",
        prompt="".join(out),
        stream=data.get("stream") is True,
        max_tokens=_whole(data.get("max_tokens")),
        cache_salt=salt or None,
        user=None,
        data=data,
    )


# --- responses ----------------------------------------------------------------------


def _count(v: Any) -> int | None:
    return _whole(v)


def usage_from_message(body: bytes) -> Usage | None:
    """Usage of a non-streamed Messages response (None: no ``usage`` object, or not
    JSON)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    return Usage(prompt_tokens=_count(usage.get("input_tokens")) or 0,
                 completion_tokens=_count(usage.get("output_tokens")) or 0,
                 cached_tokens=_count(usage.get("cache_read_input_tokens")))


class AnthropicUsageParser:
    """Usage of one Messages response, fed chunk by chunk. ``sse``: the response is a
    ``text/event-stream`` (``message_start`` gives input and cached tokens,
    ``message_delta`` the output tokens). Bodies past ``max_buffer_bytes`` are given up
    (None); never raises."""

    __slots__ = ("_buf", "_cached", "_finished", "_gave_up", "_input", "_max", "_output",
                 "_seen", "_size", "_sse")

    def __init__(self, sse: bool, max_buffer_bytes: int = 8 << 20) -> None:
        self._sse = sse
        self._max = max_buffer_bytes
        self._buf = bytearray()
        self._size = 0
        self._gave_up = False
        self._finished = False
        self._seen = False
        self._input = 0
        self._output = 0
        self._cached: int | None = None

    def feed(self, chunk: bytes) -> None:
        if self._finished or self._gave_up or not chunk:
            return
        self._buf += chunk
        if not self._sse:
            if len(self._buf) > self._max:
                self._gave_up = True
                self._buf.clear()
            return
        end = self._buf.rfind(b"\n")
        if end == -1:
            if len(self._buf) > self._max:
                self._buf.clear()  # one over-long line: drop it
            return
        lines = bytes(self._buf[:end])
        del self._buf[:end + 1]
        self._scan(lines)

    def _scan(self, lines: bytes) -> None:
        for line in lines.split(b"\n"):
            line = line.rstrip(b"\r")
            if not line.startswith(b"data: ") or b"usage" not in line:
                continue
            try:
                event = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                continue
            if not isinstance(event, dict):
                continue
            etype = event.get("type")
            if etype == "message_start":
                message = event.get("message")
                usage = message.get("usage") if isinstance(message, dict) else None
                if isinstance(usage, dict):
                    self._seen = True
                    n = _count(usage.get("input_tokens"))
                    if n is not None:
                        self._input = n
                    c = _count(usage.get("cache_read_input_tokens"))
                    if c is not None:
                        self._cached = c
            elif etype == "message_delta":
                usage = event.get("usage")
                if isinstance(usage, dict):
                    self._seen = True
                    n = _count(usage.get("output_tokens"))
                    if n is not None:
                        self._output = n

    def finish(self) -> Usage | None:
        if not self._finished:
            self._finished = True
            if not self._gave_up and self._buf:
                if self._sse:
                    self._scan(bytes(self._buf))
                else:
                    found = usage_from_message(bytes(self._buf))
                    if found is not None:
                        self._seen = True
                        self._input = found.prompt_tokens or 0
                        self._output = found.completion_tokens or 0
                        self._cached = found.cached_tokens
            self._buf.clear()
        if self._gave_up or not self._seen:
            return None
        return Usage(prompt_tokens=self._input, completion_tokens=self._output,
                     cached_tokens=self._cached)
