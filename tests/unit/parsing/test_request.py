"""Tests for epp.parsing.request: API types, shapes, errors and the prompt view."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from epp.errors import BadRequest
from epp.parsing.request import (
    ParsedRequest,
    api_type_for_path,
    parse_request_body,
    rewrite_model,
)
from epp.scheduling.types import ApiType

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"


def parse(path: str, obj: Any) -> ParsedRequest:
    return parse_request_body(path, orjson.dumps(obj))


def chat(*messages: dict[str, Any], **extra: Any) -> ParsedRequest:
    return parse(CHAT, {"model": "m", "messages": list(messages), **extra})


def bad(path: str, body: bytes | Any) -> BadRequest:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(BadRequest) as info:
        parse_request_body(path, raw)
    assert info.value.status == 400
    assert info.value.error_type == "invalid_request_error"
    return info.value


# --- api_type_for_path --------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/completions", ApiType.COMPLETIONS),
        ("/v1/chat/completions", ApiType.CHAT_COMPLETIONS),
        ("/v1/embeddings", ApiType.EMBEDDINGS),
        ("/v1/responses", ApiType.RESPONSES),
        ("/v1/chat/completions?api-version=2024-02-01", ApiType.CHAT_COMPLETIONS),
        ("/v1/completions?", ApiType.COMPLETIONS),
        ("/v1/embeddings/", ApiType.EMBEDDINGS),
        ("/v1/responses?x=/v1/chat/completions", ApiType.RESPONSES),
        ("/v1/models", ApiType.OTHER),
        ("/v1/chat/completions/extra", ApiType.OTHER),
        ("/v2/completions", ApiType.OTHER),
        ("/", ApiType.OTHER),
        ("", ApiType.OTHER),
        ("?/v1/completions", ApiType.OTHER),
    ],
)
def test_api_type_for_path(path: str, api: ApiType) -> None:
    assert api_type_for_path(path) is api


def test_query_string_does_not_change_parse() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    a = parse("/v1/chat/completions?foo=bar&x=1", body)
    b = parse(CHAT, body)
    assert a.api is ApiType.CHAT_COMPLETIONS
    assert a.prompt == b.prompt == "<|user|>\nhi\n"


# --- common fields and errors -------------------------------------------------------


def test_not_json() -> None:
    err = bad(CHAT, b"{not json")
    assert "not valid JSON" in err.message


def test_empty_body_is_not_json() -> None:
    assert "not valid JSON" in bad(COMPLETIONS, b"").message


def test_invalid_utf8_is_not_json() -> None:
    assert "not valid JSON" in bad(COMPLETIONS, b'{"model": "\xff", "prompt": "x"}').message


@pytest.mark.parametrize("body", [b"[]", b"1", b'"model"', b"null", b"true"])
def test_not_an_object(body: bytes) -> None:
    err = bad(CHAT, body)
    assert "JSON object" in err.message


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, EMBEDDINGS, RESPONSES, "/v1/other"])
def test_missing_model(path: str) -> None:
    err = bad(path, {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "input": "x"})
    assert "'model'" in err.message
    assert "required" in err.message


@pytest.mark.parametrize("model", [1, None, ["m"], {"name": "m"}, True])
def test_model_not_a_string(model: Any) -> None:
    err = bad(COMPLETIONS, {"model": model, "prompt": "x"})
    assert "'model'" in err.message


def test_model_empty() -> None:
    err = bad(CHAT, {"model": "", "messages": [{"role": "user", "content": "x"}]})
    assert "'model'" in err.message and "empty" in err.message


@pytest.mark.parametrize("value", ["true", 1, 0, [], {}])
def test_stream_must_be_bool(value: Any) -> None:
    err = bad(COMPLETIONS, {"model": "m", "prompt": "x", "stream": value})
    assert "'stream'" in err.message and "boolean" in err.message


def test_stream_options_must_be_object() -> None:
    err = bad(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                     "stream": True, "stream_options": "include_usage"})
    assert "'stream_options'" in err.message


@pytest.mark.parametrize("value", [-1, 1.5, "10", True, [1]])
def test_max_tokens_must_be_count(value: Any) -> None:
    err = bad(COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": value})
    assert "'max_tokens'" in err.message


def test_max_completion_tokens_must_be_count() -> None:
    err = bad(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                     "max_completion_tokens": -5})
    assert "'max_completion_tokens'" in err.message and ">= 0" in err.message


def test_max_output_tokens_must_be_count() -> None:
    err = bad(RESPONSES, {"model": "m", "input": "x", "max_output_tokens": "many"})
    assert "'max_output_tokens'" in err.message


@pytest.mark.parametrize("field", ["cache_salt", "user"])
@pytest.mark.parametrize("value", [1, True, ["a"], {"a": 1}])
def test_string_fields(field: str, value: Any) -> None:
    err = bad(COMPLETIONS, {"model": "m", "prompt": "x", field: value})
    assert f"'{field}'" in err.message and "string" in err.message


def test_common_fields_read() -> None:
    p = parse(COMPLETIONS, {"model": "llama", "prompt": "hello", "stream": True,
                            "max_tokens": 64, "cache_salt": "salt", "user": "u1",
                            "temperature": 0.5})
    assert p.api is ApiType.COMPLETIONS
    assert p.model == "llama"
    assert p.stream is True
    assert p.max_tokens == 64
    assert p.cache_salt == "salt"
    assert p.user == "u1"
    assert p.data["temperature"] == 0.5


def test_defaults_and_nulls_are_absent() -> None:
    p = parse(COMPLETIONS, {"model": "m", "prompt": "x", "stream": None, "max_tokens": None,
                            "cache_salt": None, "user": None, "stream_options": None})
    assert (p.stream, p.max_tokens, p.cache_salt, p.user) == (False, None, None, None)
    q = parse(COMPLETIONS, {"model": "m", "prompt": "x"})
    assert (q.stream, q.max_tokens, q.cache_salt, q.user) == (False, None, None, None)


def test_max_tokens_zero_allowed() -> None:
    assert parse(COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 0}).max_tokens == 0


# --- completions --------------------------------------------------------------------


def test_completions_string() -> None:
    p = parse(COMPLETIONS, {"model": "m", "prompt": "Once upon a time"})
    assert p.prompt == "Once upon a time"


def test_completions_empty_string_allowed() -> None:
    assert parse(COMPLETIONS, {"model": "m", "prompt": ""}).prompt == ""


def test_completions_list_of_strings() -> None:
    p = parse(COMPLETIONS, {"model": "m", "prompt": ["a b", "c", "d"]})
    assert p.prompt == "a b\nc\nd"


def test_completions_token_ids() -> None:
    p = parse(COMPLETIONS, {"model": "m", "prompt": [1, 22, 333, 0]})
    assert p.prompt == "1 22 333 0"


def test_completions_token_id_lists() -> None:
    p = parse(COMPLETIONS, {"model": "m", "prompt": [[1, 2], [3], []]})
    assert p.prompt == "1 2\n3\n"


def test_completions_token_ids_differ_from_string_digits() -> None:
    a = parse(COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]}).prompt
    b = parse(COMPLETIONS, {"model": "m", "prompt": [1, 2, 4]}).prompt
    assert a != b


def test_completions_missing_prompt() -> None:
    err = bad(COMPLETIONS, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert "'prompt'" in err.message and "required" in err.message


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        (5, "'prompt'"),
        ({"text": "x"}, "'prompt'"),
        (True, "'prompt'"),
        ([], "'prompt'"),
        (["a", 1], "'prompt[1]'"),
        ([1, "a"], "'prompt[1]'"),
        ([1, True], "'prompt[1]'"),
        ([1, 2.5], "'prompt[1]'"),
        ([[1, 2], [3, "x"]], "'prompt[1]'"),
        ([[1, 2], 3], "'prompt[1]'"),
        ([None], "'prompt"),
        ([{"a": 1}], "'prompt"),
        ([True, 1], "'prompt"),
    ],
)
def test_completions_bad_prompt(prompt: Any, field: str) -> None:
    err = bad(COMPLETIONS, {"model": "m", "prompt": prompt})
    assert field in err.message


# --- embeddings ---------------------------------------------------------------------


def test_embeddings_shapes() -> None:
    assert parse(EMBEDDINGS, {"model": "e", "input": "text"}).prompt == "text"
    assert parse(EMBEDDINGS, {"model": "e", "input": ["a", "b"]}).prompt == "a\nb"
    assert parse(EMBEDDINGS, {"model": "e", "input": [5, 6]}).prompt == "5 6"
    assert parse(EMBEDDINGS, {"model": "e", "input": [[5], [6, 7]]}).prompt == "5\n6 7"
    p = parse(EMBEDDINGS, {"model": "e", "input": "x", "user": "u"})
    assert p.api is ApiType.EMBEDDINGS and p.max_tokens is None and p.user == "u"


def test_embeddings_chat_style_messages() -> None:
    p = parse(EMBEDDINGS, {"model": "e", "messages": [{"role": "user", "content": "q"}]})
    assert p.prompt == "<|user|>\nq\n"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "e"}, "'input'"),
        ({"model": "e", "input": None}, "'input'"),
        ({"model": "e", "input": 3}, "'input'"),
        ({"model": "e", "input": []}, "'input'"),
        ({"model": "e", "input": ["a", ["b"]]}, "'input[1]'"),
        ({"model": "e", "input": [[1], ["b"]]}, "'input[1]'"),
    ],
)
def test_embeddings_errors(body: dict[str, Any], field: str) -> None:
    assert field in bad(EMBEDDINGS, body).message


# --- chat ---------------------------------------------------------------------------


def test_chat_single_message() -> None:
    p = chat({"role": "user", "content": "Hello"})
    assert p.api is ApiType.CHAT_COMPLETIONS
    assert p.prompt == "<|user|>\nHello\n"


def test_chat_every_message_in_order() -> None:
    p = chat(
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    )
    assert p.prompt == (
        "<|system|>\nYou are helpful.\n"
        "<|user|>\nWhat is 2+2?\n"
        "<|assistant|>\n4\n"
        "<|user|>\nAnd 3+3?\n"
    )


def test_chat_second_message_matters() -> None:
    sys = {"role": "system", "content": "shared system prompt " * 20}
    a = chat(sys, {"role": "user", "content": "question A"})
    b = chat(sys, {"role": "user", "content": "question B"})
    assert a.prompt != b.prompt
    assert "question A" in a.prompt and "question B" in b.prompt
    # Both share the system prompt as a common prefix (what prefix affinity relies on).
    assert a.prompt.startswith("<|system|>\n" + sys["content"] + "\n")
    assert b.prompt.startswith("<|system|>\n" + sys["content"] + "\n")


def test_chat_role_matters() -> None:
    a = chat({"role": "user", "content": "x"})
    b = chat({"role": "system", "content": "x"})
    assert a.prompt != b.prompt


def test_chat_fields() -> None:
    p = chat({"role": "user", "content": "x"}, stream=True, max_tokens=10,
             max_completion_tokens=20, cache_salt="s", user="u")
    assert (p.stream, p.max_tokens, p.cache_salt, p.user) == (True, 20, "s", "u")
    q = chat({"role": "user", "content": "x"}, max_tokens=10)
    assert q.max_tokens == 10
    r = chat({"role": "user", "content": "x"}, max_tokens=10, max_completion_tokens=None)
    assert r.max_tokens == 10


def test_chat_text_parts_concatenated() -> None:
    p = chat({"role": "user", "content": [{"type": "text", "text": "Hello, "},
                                          {"type": "text", "text": "world"}]})
    assert p.prompt == "<|user|>\nHello, world\n"


def test_chat_image_parts() -> None:
    def img(url: str) -> ParsedRequest:
        return chat({"role": "user", "content": [
            {"type": "text", "text": "Describe"},
            {"type": "image_url", "image_url": {"url": url, "detail": "high"}},
        ]})

    a = img("https://example.com/cat.png")
    b = img("https://example.com/dog.png")
    data_url = "data:image/png;base64," + "A" * 1000
    c = img(data_url)
    assert a.prompt == "<|user|>\nDescribe<|image_url|>https://example.com/cat.png\n"
    assert a.prompt != b.prompt
    assert data_url in c.prompt
    # Same image, same prompt (deterministic).
    assert img("https://example.com/cat.png").prompt == a.prompt


def test_chat_image_url_as_plain_string() -> None:
    p = chat({"role": "user", "content": [{"type": "image_url", "image_url": "http://x/i.png"}]})
    assert p.prompt == "<|user|>\n<|image_url|>http://x/i.png\n"


def test_chat_audio_and_file_parts_rendered_deterministically() -> None:
    def audio(data: str) -> ParsedRequest:
        return chat({"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"format": "wav", "data": data}}]})

    a, b = audio("AAAA"), audio("BBBB")
    assert a.prompt != b.prompt
    assert "AAAA" in a.prompt and "<|input_audio|>" in a.prompt
    # Key order in the request does not change the rendering.
    c = chat({"role": "user", "content": [
        {"input_audio": {"data": "AAAA", "format": "wav"}, "type": "input_audio"}]})
    assert c.prompt == a.prompt
    f = chat({"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]})
    g = chat({"role": "user", "content": [{"type": "file", "file": {"file_id": "file-2"}}]})
    assert f.prompt != g.prompt and "file-1" in f.prompt


def test_chat_name_tool_calls_and_null_content() -> None:
    tool_calls = [{"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    p = chat(
        {"role": "user", "name": "alice", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    )
    expected_calls = orjson.dumps(tool_calls, option=orjson.OPT_SORT_KEYS).decode()
    assert p.prompt == (
        "<|user|>\n<|name|>alice\nweather?\n"
        "<|assistant|>\n\n<|tool_calls|>" + expected_calls + "\n"
        "<|tool|>\nsunny\n<|tool_call_id|>call_1\n"
    )
    other = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    q = chat(
        {"role": "user", "name": "alice", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": other},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    )
    assert q.prompt != p.prompt
    assert chat({"role": "user", "name": "bob", "content": "x"}).prompt != chat(
        {"role": "user", "name": "alice", "content": "x"}).prompt


def test_chat_assistant_without_content_allowed() -> None:
    p = chat({"role": "user", "content": "x"}, {"role": "assistant"})
    assert p.prompt == "<|user|>\nx\n<|assistant|>\n\n"


def test_chat_tools_rendered_first() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    p = chat({"role": "user", "content": "x"}, tools=tools)
    assert p.prompt.startswith("<|tools|>\n")
    assert p.prompt.endswith("<|user|>\nx\n")
    q = chat({"role": "user", "content": "x"},
             tools=[{"type": "function", "function": {"name": "g", "parameters": {}}}])
    assert p.prompt != q.prompt


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "m"}, "'messages'"),
        ({"model": "m", "messages": None}, "'messages'"),
        ({"model": "m", "messages": []}, "'messages'"),
        ({"model": "m", "messages": "hi"}, "'messages'"),
        ({"model": "m", "messages": {"role": "user"}}, "'messages'"),
        ({"model": "m", "messages": ["hi"]}, "'messages[0]'"),
        ({"model": "m", "messages": [{"content": "x"}]}, "'messages[0].role'"),
        ({"model": "m", "messages": [{"role": 1, "content": "x"}]}, "'messages[0].role'"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "user"}]},
         "'messages[1].content'"),
        ({"model": "m", "messages": [{"role": "user", "content": None}]},
         "'messages[0].content'"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]},
         "'messages[0].content'"),
        ({"model": "m", "messages": [{"role": "user", "content": {"type": "text"}}]},
         "'messages[0].content'"),
        ({"model": "m", "messages": [{"role": "user", "content": ["x"]}]},
         "'messages[0].content[0]'"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"text": "x"}]}]},
         "'messages[0].content[0].type'"),
        ({"model": "m", "messages": [{"role": "user",
                                      "content": [{"type": "text", "text": 3}]}]},
         "'messages[0].content[0].text'"),
        ({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "ok"}, {"type": "text"}]}]},
         "'messages[0].content[1].text'"),
        ({"model": "m", "messages": [{"role": "user", "name": 7, "content": "x"}]},
         "'messages[0].name'"),
        ({"model": "m", "messages": [{"role": "assistant", "content": None,
                                      "tool_calls": "call"}]},
         "'messages[0].tool_calls'"),
    ],
)
def test_chat_errors(body: dict[str, Any], field: str) -> None:
    assert field in bad(CHAT, body).message


# --- responses ----------------------------------------------------------------------


def test_responses_string_input() -> None:
    p = parse(RESPONSES, {"model": "m", "input": "Tell me a joke", "stream": True,
                          "max_output_tokens": 100, "max_tokens": 5, "user": "u"})
    assert p.api is ApiType.RESPONSES
    assert p.prompt == "<|user|>\nTell me a joke\n"
    assert p.stream is True and p.max_tokens == 100 and p.user == "u"


def test_responses_instructions_first() -> None:
    p = parse(RESPONSES, {"model": "m", "instructions": "Be terse.", "input": "hi"})
    assert p.prompt == "<|system|>\nBe terse.\n<|user|>\nhi\n"


def test_responses_items() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "look: "},
                                     {"type": "input_image", "image_url": "https://x/a.png"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "a cat"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "user", "content": "thanks"},
    ]
    p = parse(RESPONSES, {"model": "m", "instructions": "sys", "input": items})
    fc = orjson.dumps(items[2], option=orjson.OPT_SORT_KEYS).decode()
    fco = orjson.dumps(items[3], option=orjson.OPT_SORT_KEYS).decode()
    assert p.prompt == (
        "<|system|>\nsys\n"
        "<|user|>\nlook: <|input_image|>https://x/a.png\n"
        "<|assistant|>\na cat\n"
        "<|function_call|>\n" + fc + "\n"
        "<|function_call_output|>\n" + fco + "\n"
        "<|user|>\nthanks\n"
    )


def test_responses_items_match_chat_rendering() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    r = parse(RESPONSES, {"model": "m", "input": msgs})
    c = chat(*msgs)
    assert r.prompt == c.prompt


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "m"}, "'input'"),
        ({"model": "m", "input": 5}, "'input'"),
        ({"model": "m", "input": {"role": "user"}}, "'input'"),
        ({"model": "m", "input": ["hi"]}, "'input[0]'"),
        ({"model": "m", "input": [{"content": "x"}]}, "'input[0]'"),
        ({"model": "m", "input": [{"role": "user", "content": 3}]}, "'input[0].content'"),
        ({"model": "m", "input": [{"role": "user",
                                   "content": [{"type": "input_text"}]}]},
         "'input[0].content[0].text'"),
        ({"model": "m", "input": "x", "instructions": 5}, "'instructions'"),
        ({"model": "m", "input": "x", "stream": "yes"}, "'stream'"),
    ],
)
def test_responses_errors(body: dict[str, Any], field: str) -> None:
    assert field in bad(RESPONSES, body).message


# --- other paths --------------------------------------------------------------------


def test_other_path_needs_only_model() -> None:
    p = parse("/v1/rerank", {"model": "r", "query": "q", "documents": ["a"], "stream": "x",
                             "max_tokens": -1})
    assert p.api is ApiType.OTHER
    assert p.model == "r"
    assert p.prompt == ""
    assert p.stream is False and p.max_tokens is None
    q = parse("/v1/audio/x", {"model": "r", "stream": True, "max_tokens": 7, "user": "u"})
    assert (q.stream, q.max_tokens, q.user) == (True, 7, "u")


def test_other_path_errors() -> None:
    assert "JSON object" in bad("/v1/other", b"[1]").message
    assert "'model'" in bad("/v1/other", {"x": 1}).message


# --- large bodies -------------------------------------------------------------------


def test_one_megabyte_completion_prompt() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 23_302  # ~1 MB
    assert len(text) > 1_000_000
    p = parse(COMPLETIONS, {"model": "m", "prompt": text})
    assert p.prompt == text


def test_one_megabyte_chat_many_messages() -> None:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " + "x" * 100}
            for i in range(10_000)]
    p = chat(*msgs)
    assert len(p.prompt) > 1_000_000
    assert p.prompt.startswith("<|user|>\nmessage 0 ")
    assert p.prompt.count("<|user|>\n") == 5_000
    assert p.prompt.count("<|assistant|>\n") == 5_000
    assert "message 9999 " in p.prompt


def test_large_token_id_prompt() -> None:
    ids = list(range(200_000))
    p = parse(COMPLETIONS, {"model": "m", "prompt": ids})
    assert p.prompt.split(" ") == [str(i) for i in ids]


# --- rewrite_model ------------------------------------------------------------------


def test_rewrite_model() -> None:
    p = chat({"role": "user", "content": "héllo"}, temperature=0.2)
    out = rewrite_model(p.data, "llama-3-8b-lora")
    assert isinstance(out, bytes)
    back = orjson.loads(out)
    assert back["model"] == "llama-3-8b-lora"
    assert back["messages"] == [{"role": "user", "content": "héllo"}]
    assert back["temperature"] == 0.2
    assert p.data["model"] == "llama-3-8b-lora"
    again = parse_request_body(CHAT, out)
    assert again.model == "llama-3-8b-lora" and again.prompt == p.prompt


def test_dumps_any_depth_matches_orjson_and_goes_deeper() -> None:
    import random

    from epp.parsing.request import dumps_any_depth

    rng = random.Random(7)

    def value(depth: int = 0) -> object:
        r = rng.random()
        if depth > 4 or r < 0.3:
            return rng.choice([1, -2.5, "x\u00e9\"\n", None, True, False, 10**15])
        if r < 0.65:
            return {f"k{rng.randint(0, 9)}": value(depth + 1) for _ in range(rng.randint(0, 4))}
        return [value(depth + 1) for _ in range(rng.randint(0, 4))]

    for _ in range(500):
        v = value()
        assert dumps_any_depth(v) == orjson.dumps(v)
        assert dumps_any_depth(v, sort_keys=True) == orjson.dumps(v, option=orjson.OPT_SORT_KEYS)
    deep = orjson.loads(b"[" * 1000 + b"{}" + b"]" * 1000)
    assert dumps_any_depth(deep) == b"[" * 1000 + b"{}" + b"]" * 1000


@pytest.mark.parametrize("where", ["image", "tools", "tool_calls", "responses"])
def test_deep_nesting_in_rendered_json_parses(where: str) -> None:
    nest = "[" * 900 + "]" * 900
    if where == "image":
        body = ('{"model":"m","messages":[{"role":"user","content":[{"type":"image_url",'
                '"image_url":{"detail":' + nest + '}}]}]}')
        path = "/v1/chat/completions"
    elif where == "tools":
        body = ('{"model":"m","tools":[' + nest + '],"messages":[{"role":"user",'
                '"content":"hi"}]}')
        path = "/v1/chat/completions"
    elif where == "tool_calls":
        body = ('{"model":"m","messages":[{"role":"assistant","tool_calls":[' + nest + ']}]}')
        path = "/v1/chat/completions"
    else:
        body = '{"model":"m","input":[{"type":"function_call","arguments":' + nest + '}]}'
        path = "/v1/responses"
    parsed = parse_request_body(path, body.encode())
    assert nest in parsed.prompt
