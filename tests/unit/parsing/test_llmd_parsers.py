"""llm-d-router's anthropic-parser and vertexai-parser (epp/parsing/anthropic.py,
vertexai.py) and the requestHandler parser router (epp/parsing/dispatch.py).

Request and response shapes are those of llm-d-router v0.10.0's anthropic_test.go and
vertexai_test.go (pkg/epp/framework/plugins/requesthandling/parsers/…)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from epp.errors import BadRequest
from epp.framework.handle import PluginHandle
from epp.parsing.dispatch import ParserRouter
from epp.parsing.parser import Parser
from epp.parsing.parsers import (
    AnthropicParser,
    OpenAIParser,
    PassthroughParser,
    VertexAIParser,
    VllmHttpParser,
)
from epp.parsing.usage import Usage
from epp.parsing.vertexai import MESSAGES
from epp.parsing.vllm_grpc import frame
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.types import ApiType, LLMRequest

MSG = {":path": "/v1/messages"}


def body(obj: Any) -> bytes:
    return orjson.dumps(obj)


def req(headers: dict[str, str]) -> LLMRequest:
    return LLMRequest(request_id="r", target_model="m", incoming_model="m",
                      api=ApiType.OTHER, prompt="", headers=headers)


def read_usage(parser: Parser, path: dict[str, str], ctype: str,
               chunks: list[bytes]) -> Usage | None:
    rp = parser.response_parser(req(path), {"content-type": ctype})
    assert rp is not None
    for c in chunks:
        rp.feed(c)
    return rp.finish()


# --- anthropic-parser: requests ------------------------------------------------------


def test_registered_without_parameters() -> None:
    reg = default_registry()
    for t in ("anthropic-parser", "vertexai-parser"):
        p = reg.create(t, "p", PluginHandle())
        assert isinstance(p, Parser) and p.type_name == t and p.name == "p"


def test_simple_text_messages() -> None:
    p = AnthropicParser().parse_request(MSG, body({
        "model": "claude-3", "max_tokens": 1024,
        "messages": [{"role": "user", "content": "Hello"},
                     {"role": "assistant", "content": "Hi there"},
                     {"role": "user", "content": "How are you?"}]}))
    assert p.model == "claude-3" and p.max_tokens == 1024 and p.stream is False
    assert p.prompt == "<|user|>\nHello\n<|assistant|>\nHi there\n<|user|>\nHow are you?\n"
    assert p.data is not None and p.data["model"] == "claude-3"  # rewritable


def test_structured_blocks_system_tools_image_stream_salt() -> None:
    data = {"model": "claude-3", "stream": True, "cache_salt": "s1",
            "system": [{"type": "text", "text": "You are helpful."}],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "AAAA"}}]}]}
    p = AnthropicParser().parse_request(MSG, body(data))
    assert p.stream is True and p.cache_salt == "s1"
    assert p.prompt.startswith("<|tools|>\n")
    assert "<|system|>\nYou are helpful.\n<|user|>\nWhat is this?<|image|>" in p.prompt
    data["messages"][0]["content"][1]["source"]["data"] = "BBBB"
    other = AnthropicParser().parse_request(MSG, body(data))
    assert other.prompt != p.prompt  # a different image, a different prompt


def test_system_as_string_and_x_original_path() -> None:
    p = AnthropicParser().parse_request({"x-original-path": "/v1/messages?beta=true"}, body(
        {"model": "m", "system": "Be brief.",
         "messages": [{"role": "user", "content": "Hi"}]}))
    assert p.prompt == "<|system|>\nBe brief.\n<|user|>\nHi\n"


def test_model_optional() -> None:
    p = AnthropicParser().parse_request(MSG, body({"messages": [{"role": "user",
                                                                 "content": "x"}]}))
    assert p.model == ""


@pytest.mark.parametrize(("headers", "raw", "fragment"), [
    (MSG, {"model": "m", "messages": []}, "must have at least one message"),
    (MSG, {"model": "m"}, "must have at least one message"),
    (MSG, None, "not valid JSON"),
    (MSG, [1], "must be a JSON object"),
    (MSG, {"messages": "hi"}, "'messages' must be an array"),
    (MSG, {"messages": [{"content": "x"}]}, "'messages[0].role' is required"),
    (MSG, {"messages": [{"role": "user"}]}, "'messages[0].content' is required"),
    (MSG, {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "'messages[0].content[0].type' must be a string"),
    (MSG, {"messages": [{"role": "user", "content": "x"}], "system": 3},
     "'system' must be a string or an array"),
    ({":path": "/v1/chat/completions"}, {"messages": [{"role": "user", "content": "x"}]},
     "unsupported API endpoint: /v1/chat/completions"),
    ({}, {"messages": [{"role": "user", "content": "x"}]},
     "unsupported API endpoint: /v1/completions"),
])
def test_request_errors(headers: dict[str, str], raw: Any, fragment: str) -> None:
    data = b"" if raw is None else body(raw)
    with pytest.raises(BadRequest, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        AnthropicParser().parse_request(headers, data)


def test_count_tokens_passes_through() -> None:
    path = {":path": "/v1/messages/count_tokens"}
    p = AnthropicParser().parse_request(path, body(
        {"model": "test-model", "system": "You are a helpful assistant.",
         "messages": [{"role": "user", "content": "Hello"}]}))
    assert p.data is None and p.prompt == "" and p.model == "test-model"
    assert AnthropicParser().parse_request(path, b"").data is None  # empty body forwarded
    assert AnthropicParser().response_parser(req(path), {}) is None


# --- anthropic-parser: responses -----------------------------------------------------


def test_json_usage() -> None:
    resp = body({"id": "msg_1", "type": "message",
                 "usage": {"input_tokens": 25, "output_tokens": 15,
                           "cache_read_input_tokens": 10}})
    assert read_usage(AnthropicParser(), MSG, "application/json", [resp[:7], resp[7:]]) \
        == Usage(prompt_tokens=25, completion_tokens=15, cached_tokens=10)
    assert read_usage(AnthropicParser(), MSG, "application/json",
                      [b'{"id": "msg_123", "type": "message"}']) is None
    assert read_usage(AnthropicParser(), MSG, "application/json", [b"{malformed"]) is None


SSE = (b'event: message_start\n'
       b'data: {"type":"message_start","message":{"usage":{"input_tokens":25,'
       b'"cache_read_input_tokens":5}}}\n\n'
       b'event: content_block_delta\n'
       b'data: {"type":"content_block_delta","delta":{"type":"text_delta","text":"Hi"}}\n\n'
       b'event: message_delta\n'
       b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
       b'"usage":{"output_tokens":15}}\n\n'
       b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


@pytest.mark.parametrize("split", [1, 17, 80, 200, len(SSE)])
def test_sse_usage_any_chunking(split: int) -> None:
    chunks = [SSE[i:i + split] for i in range(0, len(SSE), split)]
    assert read_usage(AnthropicParser(), MSG, "text/event-stream; charset=utf-8", chunks) \
        == Usage(prompt_tokens=25, completion_tokens=15, cached_tokens=5)


def test_sse_without_usage() -> None:
    only_stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert read_usage(AnthropicParser(), MSG, "text/event-stream", [only_stop]) is None
    delta_only = (b'data: {"type":"message_delta","usage":{"output_tokens":7}}\n\n')
    assert read_usage(AnthropicParser(), MSG, "text/event-stream", [delta_only]) \
        == Usage(prompt_tokens=0, completion_tokens=7, cached_tokens=None)


# --- vertexai-parser -----------------------------------------------------------------

CHAT = {":path": "/google.cloud.aiplatform.v1beta1.PredictionService/ChatCompletions",
        "content-type": "application/grpc"}
STREAM_RAW = {":path": "/google.cloud.aiplatform.v1beta1.PredictionService/StreamRawPredict"}
RAW = {":path": "/google.cloud.aiplatform.v1beta1.PredictionService/RawPredict"}


def vertex_request(name: str, data: bytes) -> bytes:
    msg = MESSAGES[name](endpoint="projects/p/locations/l/endpoints/e")
    msg.http_body.data = data
    return frame(msg.SerializeToString())


def http_body_frame(data: bytes) -> bytes:
    return frame(MESSAGES["HttpBody"](content_type="application/json",
                                      data=data).SerializeToString())


def test_vertex_chat_completions() -> None:
    raw = vertex_request("ChatCompletionsRequest",
                         b'{"messages":[{"role":"user","content":"Hello"}],"stream":true}')
    p = VertexAIParser().parse_request(CHAT, raw)
    assert p.api is ApiType.CHAT_COMPLETIONS and p.stream is True
    assert p.prompt == "<|user|>\nHello\n" and p.model == ""
    assert p.data is None  # the protobuf is forwarded byte for byte
    with_model = VertexAIParser().parse_request(CHAT, vertex_request(
        "ChatCompletionsRequest", b'{"model":"gemma","messages":[{"role":"user","content":"x"}]}'))
    assert with_model.model == "gemma"


@pytest.mark.parametrize(("headers", "name", "text"), [
    (STREAM_RAW, "StreamRawPredictRequest", "Hello from stream raw predict"),
    (RAW, "RawPredictRequest", "Hello from raw predict"),
])
def test_vertex_raw_predict(headers: dict[str, str], name: str, text: str) -> None:
    p = VertexAIParser().parse_request(headers, vertex_request(
        name, body({"input": text})))
    assert p.api is ApiType.RESPONSES and text in p.prompt and p.data is None


def test_vertex_unsupported_path_passes_through() -> None:
    p = VertexAIParser().parse_request({":path": "/unsupported/path"}, b"")
    assert p.data is None and p.prompt == "" and p.model == ""
    assert VertexAIParser().response_parser(req({":path": "/unsupported/path"}), {}) is None


@pytest.mark.parametrize(("headers", "raw", "fragment"), [
    (CHAT, b"\x00\x00\x00\x00", "invalid or unsupported gRPC payload"),
    (CHAT, b"\x00\x00\x00\x00\x01\xff", "unmarshaling ChatCompletionsRequest"),
    (STREAM_RAW, b"\x00\x00\x00\x00\x01\xff", "unmarshaling StreamRawPredictRequest"),
    (RAW, b"\x00\x00\x00\x00\x01\xff", "unmarshaling RawPredictRequest"),
    (CHAT, frame(b""), "ChatCompletionsRequest has no HttpBody"),
    (CHAT, b"\x01" + frame(b"")[1:], "compressed"),
    (CHAT, None, "parsing ChatCompletionsRequest: request body is not valid JSON"),
    (CHAT, b"{}", "parsing ChatCompletionsRequest: 'messages' is required"),
])
def test_vertex_request_errors(headers: dict[str, str], raw: bytes | None,
                               fragment: str) -> None:
    if raw is None:
        raw = vertex_request("ChatCompletionsRequest", b"{oops")
    elif raw == b"{}":
        raw = vertex_request("ChatCompletionsRequest", b"{}")
    with pytest.raises(BadRequest, match=fragment):
        VertexAIParser().parse_request(headers, raw)


def test_vertex_response_usage() -> None:
    resp = http_body_frame(b'{"usage":{"prompt_tokens":10,"completion_tokens":20,'
                           b'"total_tokens":30}}')
    assert read_usage(VertexAIParser(), CHAT, "application/grpc", [resp[:3], resp[3:]]) \
        == Usage(prompt_tokens=10, completion_tokens=20, cached_tokens=None)
    # streamed: several HttpBody frames, the last usage wins; SSE data is read too
    frames = (http_body_frame(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
              + http_body_frame(b'data: {"usage":{"prompt_tokens":4,"completion_tokens":2}}'
                                b'\n\ndata: [DONE]\n\n'))
    assert read_usage(VertexAIParser(), STREAM_RAW, "application/grpc", [frames]) \
        == Usage(prompt_tokens=4, completion_tokens=2, cached_tokens=None)
    # not a frame / not an HttpBody: nothing, never an error
    assert read_usage(VertexAIParser(), CHAT, "application/grpc", [b"\x00\x00\x00"]) is None
    assert read_usage(VertexAIParser(), CHAT, "application/grpc",
                      [b"\x00\x00\x00\x00\x01\xff"]) is None


# --- several parsers: requestHandler.parsers ----------------------------------------


def test_router_first_match_by_suffix() -> None:
    router = ParserRouter([OpenAIParser(), AnthropicParser(), VllmHttpParser()])
    assert router.type_name == "openai-parser,anthropic-parser,vllmhttp-parser"
    chat = router.parse_request({":path": "/v1/chat/completions"}, body(
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    assert chat.api is ApiType.CHAT_COMPLETIONS
    msgs = router.parse_request(MSG, body({"messages": [{"role": "user", "content": "x"}]}))
    assert msgs.prompt == "<|user|>\nx\n"
    gen = router.parse_request({":path": "/inference/v1/generate/"}, body({"token_ids": [1]}))
    assert gen.prompt == "1"
    assert isinstance(router.response_parser(req(MSG), {"content-type": "text/event-stream"}),
                      type(AnthropicParser().response_parser(req(MSG), {})))
    with pytest.raises(BadRequest, match="no parser registered matching path suffix for: "
                                         "/v1/models"):
        router.parse_request({":path": "/v1/models"}, b"{}")
    assert router.response_parser(req({":path": "/v1/models"}), {}) is None


def test_router_fallback_and_duplicates() -> None:
    router = ParserRouter([AnthropicParser(), AnthropicParser("again"), PassthroughParser(),
                           OpenAIParser()])
    assert [p.type_name for p in router.parsers] == ["anthropic-parser", "passthrough-parser"]
    assert any("'again'" in w and "already listed" in w for w in router.warnings)
    assert any("'openai-parser' is skipped" in w for w in router.warnings)
    other = router.parse_request({":path": "/v1/chat/completions"}, b"not json")
    assert other.data is None  # the passthrough fallback
