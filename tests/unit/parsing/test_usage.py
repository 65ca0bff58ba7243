"""Tests for epp.parsing.usage: usage from JSON and SSE response bodies."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from epp.parsing.usage import Usage, UsageParser, usage_from_json_object

CHAT_JSON = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi!"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15,
              "prompt_tokens_details": {"cached_tokens": 8}},
}

RESPONSES_JSON = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "output": [{"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "usage is fun"}]}],
    "usage": {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32},
              "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 0},
              "total_tokens": 49},
}


def json_usage(body: bytes, chunk: int = 0, **kw: Any) -> Usage | None:
    p = UsageParser(sse=False, **kw)
    if chunk:
        for i in range(0, len(body), chunk):
            p.feed(body[i : i + chunk])
    else:
        p.feed(body)
    return p.finish()


def sse_usage(body: bytes, cuts: list[int] | None = None, **kw: Any) -> Usage | None:
    p = UsageParser(sse=True, **kw)
    prev = 0
    for c in cuts or []:
        p.feed(body[prev:c])
        prev = c
    p.feed(body[prev:])
    return p.finish()


def sse(*events: Any, sep: bytes = b"\n\n", done: bool = True) -> bytes:
    out = b""
    for e in events:
        payload = e if isinstance(e, bytes) else orjson.dumps(e)
        out += b"data: " + payload + sep
    if done:
        out += b"data: [DONE]" + sep
    return out


def chat_chunk(text: str, usage: Any = None, with_usage_key: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {"content": text}}]}
    if with_usage_key or usage is not None:
        d["usage"] = usage
    return d


FINAL_USAGE = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120,
               "prompt_tokens_details": {"cached_tokens": 64}}


def chat_stream(sep: bytes = b"\n\n") -> bytes:
    return sse(
        chat_chunk("Hel", with_usage_key=True),
        chat_chunk("lo", with_usage_key=True),
        {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": FINAL_USAGE},
        sep=sep,
    )


# --- JSON ---------------------------------------------------------------------------


def test_json_chat() -> None:
    assert json_usage(orjson.dumps(CHAT_JSON)) == Usage(12, 3, 8)


def test_json_chat_chunked() -> None:
    assert json_usage(orjson.dumps(CHAT_JSON), chunk=7) == Usage(12, 3, 8)


def test_json_responses_api() -> None:
    assert json_usage(orjson.dumps(RESPONSES_JSON), chunk=5) == Usage(40, 9, 32)


def test_json_without_cached_details() -> None:
    body = orjson.dumps({"usage": {"prompt_tokens": 7, "completion_tokens": 1}})
    assert json_usage(body) == Usage(7, 1, None)


def test_json_embeddings_usage() -> None:
    body = orjson.dumps({"object": "list", "data": [{"embedding": [0.1, 0.2]}],
                         "usage": {"prompt_tokens": 5, "total_tokens": 5}})
    assert json_usage(body) == Usage(5, None, None)


def test_json_without_usage() -> None:
    assert json_usage(orjson.dumps({"choices": []})) is None
    assert json_usage(orjson.dumps({"choices": [], "usage": None})) is None
    assert json_usage(b"") is None
    assert UsageParser(sse=False).finish() is None


@pytest.mark.parametrize(
    "body",
    [
        b'{"usage": {"prompt_tokens": 1',
        b"not json at all \"usage\"",
        b'["usage", 1]',
        b'{"usage": "lots"}',
        b'{"usage": {"prompt_tokens": "12", "completion_tokens": true}}',
        b'{"usage": {"prompt_tokens": -1}}',
        b"\xff\xfe\"usage\"",
    ],
)
def test_json_malformed(body: bytes) -> None:
    assert json_usage(body) is None


def test_json_bad_field_types_are_none() -> None:
    body = orjson.dumps({"usage": {"prompt_tokens": 10, "completion_tokens": "x",
                                   "prompt_tokens_details": {"cached_tokens": 1.5}}})
    assert json_usage(body) == Usage(10, None, None)


def test_json_over_limit() -> None:
    body = orjson.dumps(CHAT_JSON)
    assert json_usage(body, chunk=10, max_buffer_bytes=len(body) - 1) is None
    assert json_usage(body, chunk=10, max_buffer_bytes=len(body)) == Usage(12, 3, 8)


def test_finish_is_idempotent_and_feed_after_finish_ignored() -> None:
    p = UsageParser(sse=False)
    p.feed(orjson.dumps(CHAT_JSON))
    assert p.finish() == Usage(12, 3, 8)
    p.feed(b"garbage")
    assert p.finish() == Usage(12, 3, 8)


# --- SSE ----------------------------------------------------------------------------


def test_sse_chat_usage_last_event() -> None:
    assert sse_usage(chat_stream()) == Usage(100, 20, 64)


def test_sse_split_at_every_byte_offset() -> None:
    body = chat_stream()
    for cut in range(len(body) + 1):
        assert sse_usage(body, [cut]) == Usage(100, 20, 64), cut


def test_sse_split_at_every_two_offsets_around_usage() -> None:
    body = chat_stream()
    start = body.index(b'"usage":{') - 10
    for a in range(start, len(body)):
        for b in range(a, min(a + 40, len(body) + 1)):
            assert sse_usage(body, [a, b]) == Usage(100, 20, 64), (a, b)


def test_sse_byte_by_byte() -> None:
    body = chat_stream(sep=b"\r\n\r\n")
    assert sse_usage(body, list(range(1, len(body)))) == Usage(100, 20, 64)


def test_sse_crlf_separators() -> None:
    body = chat_stream(sep=b"\r\n\r\n")
    assert b"\r\n\r\n" in body and b"\n\n" not in body.replace(b"\r\n\r\n", b"")
    assert sse_usage(body) == Usage(100, 20, 64)
    for cut in range(len(body) + 1):
        assert sse_usage(body, [cut]) == Usage(100, 20, 64), cut


def test_sse_cr_only_separators() -> None:
    assert sse_usage(chat_stream(sep=b"\r\r")) == Usage(100, 20, 64)


def test_sse_without_usage() -> None:
    body = sse(chat_chunk("a"), chat_chunk("b"))
    assert sse_usage(body) is None
    body2 = sse(chat_chunk("a", with_usage_key=True), chat_chunk("b", with_usage_key=True))
    assert sse_usage(body2) is None
    assert sse_usage(b"") is None


def test_sse_usage_word_in_text_is_not_usage() -> None:
    body = sse(chat_chunk('the "usage": {"prompt_tokens": 999} field'))
    assert sse_usage(body) is None


def test_sse_last_usage_wins() -> None:
    # vLLM continuous_usage_stats: usage on every chunk.
    body = sse(
        chat_chunk("a", usage={"prompt_tokens": 10, "completion_tokens": 1}),
        chat_chunk("b", usage={"prompt_tokens": 10, "completion_tokens": 2}),
        chat_chunk("c", usage={"prompt_tokens": 10, "completion_tokens": 3}),
    )
    assert sse_usage(body) == Usage(10, 3, None)


def test_sse_malformed_usage_event_ignored() -> None:
    good = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    body = sse(good, b'{"usage": {"prompt_tokens": 5,,,}')
    assert sse_usage(body) == Usage(4, 2, None)
    assert sse_usage(sse(b'{"usage": {"prompt_tokens": oops}}')) is None
    assert sse_usage(b"data: {\"usage\": {\xff\xff}}\n\n") is None
    assert sse_usage(b"\x00\x01garbage\n\n\n\n\r\r\r") is None


def test_sse_responses_api_completed_event() -> None:
    created = {"type": "response.created",
               "response": {"id": "resp_1", "status": "in_progress", "usage": None}}
    delta = {"type": "response.output_text.delta", "delta": "hi"}
    completed = {"type": "response.completed",
                 "response": {"id": "resp_1", "status": "completed",
                              "usage": {"input_tokens": 30, "output_tokens": 5,
                                        "input_tokens_details": {"cached_tokens": 16}}}}
    body = b""
    for name, ev in (("response.created", created), ("response.output_text.delta", delta),
                     ("response.completed", completed)):
        body += b"event: " + name.encode() + b"\ndata: " + orjson.dumps(ev) + b"\n\n"
    assert sse_usage(body) == Usage(30, 5, 16)
    for cut in range(0, len(body) + 1, 7):
        assert sse_usage(body, [cut]) == Usage(30, 5, 16), cut


def test_sse_unterminated_last_event_read_at_finish() -> None:
    body = sse(chat_chunk("a"), done=False) + b"data: " + orjson.dumps(
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    assert sse_usage(body) == Usage(3, 4, None)
    assert sse_usage(body + b"\r") == Usage(3, 4, None)


def test_sse_multiline_data_and_comments() -> None:
    body = (b": keep-alive\n\n"
            b"id: 7\ndata: {\"choices\": [],\ndata: \"usage\": {\"prompt_tokens\": 8,\n"
            b"data:\"completion_tokens\": 9}}\n\n"
            b"data: [DONE]\n\n")
    assert sse_usage(body) == Usage(8, 9, None)


def test_sse_over_limit_event_dropped_then_resumes() -> None:
    huge = sse(chat_chunk("x" * 5000), done=False)
    final = sse({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}})
    body = huge + final
    # Fed in small chunks: the 5 KB event exceeds a 1 KB limit and is dropped.
    cuts = list(range(100, len(body), 100))
    assert sse_usage(body, cuts, max_buffer_bytes=1024) == Usage(1, 2, None)
    # And a usage event that itself exceeds the limit is not read.
    big_usage = sse({"pad": "y" * 5000, "usage": {"prompt_tokens": 1}})
    assert sse_usage(big_usage, list(range(100, len(big_usage), 100)),
                     max_buffer_bytes=1024) is None


def test_sse_never_buffered_unbounded() -> None:
    p = UsageParser(sse=True, max_buffer_bytes=1000)
    for _ in range(1000):
        p.feed(b"data: " + b"z" * 100)  # one never-ending event
    assert len(p._buf) <= 1000  # internal bound
    p.feed(b"\n\ndata: " + orjson.dumps({"usage": {"prompt_tokens": 2}}) + b"\n\n")
    assert p.finish() == Usage(2, None, None)


def test_many_chunks_stream() -> None:
    events = [chat_chunk(f"tok{i} ", with_usage_key=True) for i in range(5000)]
    events.append({"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 5000}})
    body = sse(*events)
    p = UsageParser(sse=True)
    # Chunks not aligned with events.
    for i in range(0, len(body), 333):
        p.feed(body[i : i + 333])
    assert p.finish() == Usage(50, 5000, None)


# --- usage_from_json_object ---------------------------------------------------------


def test_usage_from_json_object() -> None:
    assert usage_from_json_object(CHAT_JSON) == Usage(12, 3, 8)
    assert usage_from_json_object(RESPONSES_JSON) == Usage(40, 9, 32)
    assert usage_from_json_object({"response": {"usage": {"input_tokens": 1}}}) == Usage(
        1, None, None)
    assert usage_from_json_object([]) is None
    assert usage_from_json_object({"usage": {}}) is None
    assert usage_from_json_object({"usage": {"total_tokens": 3}}) is None


def test_sse_multiline_data_crlf_split_at_every_offset() -> None:
    # A CR at the end of one chunk and LF at the start of the next is one line end, not
    # two: otherwise this event would break in half after its first data line.
    body = (b"data: {\"choices\": [],\r\n"
            b"data: \"usage\": {\"prompt_tokens\": 8, \"completion_tokens\": 9}}\r\n\r\n"
            b"data: [DONE]\r\n\r\n")
    for cut in range(len(body) + 1):
        assert sse_usage(body, [cut]) == Usage(8, 9, None), cut


def test_sse_separator_straddling_chunks_completes_event() -> None:
    p = UsageParser(sse=True)
    p.feed(b"data: {\"choices\": []}\n")
    p.feed(b"\n")
    assert len(p._buf) == 0  # the event was complete and has been consumed
    p.feed(b"data: {\"usage\": {\"prompt_tokens\": 1}}\r\n\r")
    p.feed(b"\n")
    assert len(p._buf) == 0
    assert p.finish() == Usage(1, None, None)


# --- lenient reading, as GIE's parser reads a chunk (line by line) ---


def _sse(*chunks: bytes) -> Usage | None:
    p = UsageParser(sse=True)
    for c in chunks:
        p.feed(c)
    return p.finish()


def test_sse_usage_without_blank_line_separators_gie_shape() -> None:
    # GIE v1.5.0's hermetic case "streaming SSE token counting": unterminated events that
    # meet at a chunk boundary, the usage line and [DONE] in one event.
    got = _sse(b"data: {}",
               b'data: {"usage":{"prompt_tokens":7,"total_tokens":17,'
               b'"completion_tokens":10}}\ndata: [DONE]', b"")
    assert got == Usage(prompt_tokens=7, completion_tokens=10, cached_tokens=None)


def test_sse_usage_line_followed_by_done_in_one_event() -> None:
    # vLLM's two entries in one event (GIE's comment in openai.go), no blank line between.
    got = _sse(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n'
               b"data: [DONE]\n\n")
    assert got == Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=None)


def test_sse_lenient_reading_ignores_broken_values_and_keeps_last() -> None:
    got = _sse(b'data: {"usage":{"prompt_tokens":1}}\ndata: {"usage": {broken\n'
               b'data: {"usage":{"prompt_tokens":2,"completion_tokens":5}}\n\n')
    assert got == Usage(prompt_tokens=2, completion_tokens=5, cached_tokens=None)
    # A "data:" inside a JSON string is not a field boundary for the longer reading.
    got = _sse(b'data: {"text":"data: x","usage":{"prompt_tokens":9}}data: [DONE]\n\n')
    assert got == Usage(prompt_tokens=9, completion_tokens=None, cached_tokens=None)


def test_sse_no_usage_object_stays_none() -> None:
    assert _sse(b"data: {}data: {\"usage\": null}\ndata: [DONE]") is None
