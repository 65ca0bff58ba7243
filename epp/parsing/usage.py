"""Read token usage out of model-server responses (design.md §2, "Responses").

A :class:`UsageParser` is fed the response body chunk by chunk, as it passes through, and
reports the usage at the end. It never raises on malformed input: anything it cannot read
is ignored and ``finish()`` returns None.

Recognised shapes (``usage`` object at the top level of the JSON body or SSE event):

- Chat / completions / embeddings: ``prompt_tokens``, ``completion_tokens``,
  ``prompt_tokens_details.cached_tokens``.
- Responses API: ``input_tokens``, ``output_tokens``, ``input_tokens_details.cached_tokens``;
  its streaming ``response.completed`` event carries them under ``response.usage``.

A field that is missing or not a non-negative integer is None in the :class:`Usage`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

import orjson

# A "usage" key whose value is an object. Inside JSON strings quotes are escaped, so this
# only matches real keys; it skips the many chunks that carry ``"usage": null``.
_USAGE_OBJECT: Final = re.compile(rb'"usage"\s*:\s*\{')
_USAGE_KEY: Final = b'"usage"'
_DONE: Final = b"[DONE]"


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts a model server reported for one response; None = not reported."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None


def _count(v: Any) -> int | None:
    return v if type(v) is int and v >= 0 else None


def _usage_of(usage: Any) -> Usage | None:
    """A :class:`Usage` from a decoded ``usage`` object, or None if it holds no counts."""
    if not isinstance(usage, dict):
        return None
    prompt = _count(usage.get("prompt_tokens"))
    if prompt is None:
        prompt = _count(usage.get("input_tokens"))
    completion = _count(usage.get("completion_tokens"))
    if completion is None:
        completion = _count(usage.get("output_tokens"))
    cached: int | None = None
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key)
        if isinstance(details, dict):
            cached = _count(details.get("cached_tokens"))
            if cached is not None:
                break
    if prompt is None and completion is None and cached is None:
        return None
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


def usage_from_json_object(obj: Any) -> Usage | None:
    """Usage from a decoded response body or SSE event payload.

    Looks at ``obj["usage"]``, then (Responses API streaming) ``obj["response"]["usage"]``.
    """
    if not isinstance(obj, dict):
        return None
    found = _usage_of(obj.get("usage"))
    if found is None:
        response = obj.get("response")
        if isinstance(response, dict):
            found = _usage_of(response.get("usage"))
    return found


class UsageParser:
    """Incremental usage reader for one response body.

    ``sse=False`` (``application/json``): chunks are buffered, up to ``max_buffer_bytes``
    in total (beyond that the parser gives up and ``finish()`` returns None), and decoded
    once at ``finish()``.

    ``sse=True`` (``text/event-stream``): events (separated by a blank line; ``\\n``,
    ``\\r\\n`` and ``\\r`` line ends are accepted) are processed as they complete, so only
    the incomplete last event is buffered. An event is JSON-decoded only when its bytes
    contain a ``"usage"`` key with an object value; ``[DONE]`` is ignored; the last usage
    seen wins. An incomplete event larger than ``max_buffer_bytes`` is dropped, and
    parsing resumes at the next event. An unterminated final event is still read at
    ``finish()``.

    Per-chunk cost is a few C-level scans of the chunk (no re-scanning of earlier bytes);
    a chunk of whole events without a usage object (every token chunk but the last) costs
    one scan and keeps nothing.
    Not thread-safe; ``feed`` after ``finish`` is ignored; ``finish`` is idempotent.
    """

    __slots__ = (
        "_buf",
        "_chunks",
        "_finished",
        "_gave_up",
        "_last",
        "_max",
        "_pending_cr",
        "_size",
        "_skipping",
        "_sse",
    )

    def __init__(self, sse: bool, max_buffer_bytes: int = 8 << 20) -> None:
        self._sse = sse
        self._max = max_buffer_bytes
        # JSON mode: the body so far.
        self._chunks: list[bytes] = []
        self._size = 0
        # SSE mode: the incomplete last event, with line ends normalised to "\n".
        self._buf = bytearray()
        self._pending_cr = False  # the previous chunk ended in "\r" (maybe half a "\r\n")
        self._skipping = False  # dropping an over-limit event until its end
        self._gave_up = False
        self._last: Usage | None = None
        self._finished = False

    def feed(self, chunk: bytes) -> None:
        """Consume the next body chunk. Never raises on malformed content."""
        if self._finished or self._gave_up or not chunk:
            return
        if not self._sse:
            self._size += len(chunk)
            if self._size > self._max:
                self._gave_up = True
                self._chunks.clear()
                return
            self._chunks.append(bytes(chunk))
            return
        self._feed_sse(chunk)

    def finish(self) -> Usage | None:
        """End of body: the usage found (SSE: the last one seen), or None."""
        if self._finished:
            return self._last
        self._finished = True
        if self._gave_up:
            self._chunks.clear()
            return None
        if not self._sse:
            body = b"".join(self._chunks)
            self._chunks.clear()
            if _USAGE_KEY in body:
                try:
                    self._last = usage_from_json_object(orjson.loads(body))
                except ValueError:  # orjson.JSONDecodeError
                    self._last = None
            return self._last
        if self._pending_cr:
            self._pending_cr = False
            self._buf += b"\n"
        if not self._skipping and self._buf:
            self._scan(bytes(self._buf))
        self._buf.clear()
        return self._last

    # --- SSE ---

    def _feed_sse(self, chunk: bytes) -> None:
        if (not self._buf and not self._pending_cr and not self._skipping
                and chunk.endswith(b"\n\n") and b"\r" not in chunk):
            # The common case: the chunk is whole events and nothing is pending. Only a
            # chunk holding a usage object is looked at further (one C-level scan).
            if _USAGE_OBJECT.search(chunk) is not None:
                self._scan(bytes(chunk))
            return
        data = bytes(chunk)
        if self._pending_cr:
            data = b"\r" + data
            self._pending_cr = False
        if data.endswith(b"\r"):
            # Might be the first half of "\r\n": decide when the next byte arrives.
            data = data[:-1]
            self._pending_cr = True
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if not data:
            return
        buf = self._buf
        if self._skipping:
            # buf holds at most the last byte of the dropped event.
            buf += data
            end = buf.find(b"\n\n")
            if end == -1:
                del buf[:-1]
                return
            self._skipping = False
            del buf[: end + 2]
            rest = bytes(buf)
            buf.clear()
            if rest:
                self._feed_normalised(rest)
            return
        self._feed_normalised(data)

    def _feed_normalised(self, data: bytes) -> None:
        buf = self._buf
        start = len(buf) - 1 if buf else 0  # a separator may straddle the boundary
        buf += data
        end = buf.rfind(b"\n\n", start)
        if end == -1:
            if len(buf) > self._max:
                # One event larger than the limit: drop it, resume at the next event.
                self._skipping = True
                del buf[:-1]
            return
        if _USAGE_OBJECT.search(buf, 0, end) is not None:
            self._scan(bytes(buf[:end]))
        del buf[: end + 2]
        if len(buf) > self._max:
            self._skipping = True
            del buf[:-1]

    def _scan(self, events: bytes) -> None:
        """Read usage from complete, "\\n"-normalised events (separated by blank lines)."""
        if _USAGE_KEY not in events:
            return
        for event in events.split(b"\n\n"):
            if _USAGE_OBJECT.search(event) is None:
                continue
            payload = _event_data(event)
            found = None
            if payload is not None and payload.strip() != _DONE:
                try:
                    found = usage_from_json_object(orjson.loads(payload))
                except ValueError:  # orjson.JSONDecodeError: try the lenient reading
                    found = None
            if found is None:
                found = _usage_from_data_lines(event)
            if found is not None:
                self._last = found


_DATA_FIELD: Final = re.compile(rb"data: ?")


def _usage_from_data_lines(event: bytes) -> Usage | None:
    """Lenient reading of an event that is not one JSON payload, as GIE's parser reads a
    chunk: each ``data:`` field on its own, line by line. This also reads events whose
    blank-line separator a server left out (``data: {}data: {"usage": …}`` when two
    unterminated events meet at a chunk boundary). Only events holding a usage object get
    here. The last usage found wins."""
    found: Usage | None = None
    for line in event.split(b"\n"):
        fields = [(m.start(), m.end()) for m in _DATA_FIELD.finditer(line)]
        for i, (_, start) in enumerate(fields):
            # The value runs to the end of the line, or (events run together) to a later
            # "data:" field ("data:" may also occur inside a JSON string); longest first.
            ends = [len(line), *(f[0] for f in reversed(fields[i + 1:]))]
            for end in ends:
                value = line[start:end].strip()
                if not value.startswith(b"{") or _USAGE_OBJECT.search(value) is None:
                    continue
                try:
                    usage = usage_from_json_object(orjson.loads(value))
                except ValueError:  # orjson.JSONDecodeError
                    continue
                if usage is not None:
                    found = usage
                    break
    return found


def _event_data(event: bytes) -> bytes | None:
    """The SSE ``data`` of one event (its data lines joined with "\\n"), or None."""
    parts: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            if value.startswith(b" "):
                value = value[1:]
            parts.append(value)
        elif line == b"data":
            parts.append(b"")
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else b"\n".join(parts)
