"""Parser plugins (issue 14): openai-, passthrough-, vllmgrpc- and vllmhttp-parser.

Cases translated from GIE v1.5.0 pkg/epp/framework/plugins/requesthandling/parsers/
{openai,passthrough,vllmgrpc}/*_test.go and llm-d-router's parsers/vllmhttp/vllmhttp_test.go
(the commit that added it, 3dc42b9b5, and v0.10.0), plus the Director's use of them
(GIE pkg/epp/requestcontrol/director.go: every parser error is a 400; non-JSON payloads
are forwarded unchanged and get their model only from x-gateway-model-name-rewrite).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from epp.config.loader import load_and_build
from epp.datastore.store import Datastore
from epp.errors import BadRequest
from epp.observability.metrics import EppMetrics
from epp.parsing import vllm_grpc as g
from epp.parsing.parser import Parser
from epp.parsing.parsers import (
    BUILTIN_PARSERS,
    OpenAIParser,
    PassthroughParser,
    VllmGrpcParser,
    VllmHttpParser,
)
from epp.parsing.request import parse_request_body
from epp.parsing.usage import Usage
from epp.requestcontrol.director import Director, SchedulingCore, build_request
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.types import ApiType, Endpoint, LLMRequest

PROTO = (Path(__file__).resolve().parents[2] / "fixtures" / "gie-v1.5.0" / "pkg" / "epp"
         / "framework" / "plugins" / "requesthandling" / "parsers" / "vllmgrpc" / "api"
         / "proto" / "vllm_engine.proto")
GEN = {":path": g.GENERATE_PATH}
EMB = {":path": g.EMBED_PATH}


def grpc_body(msg: Any) -> bytes:
    return g.frame(msg.SerializeToString())


def req(headers: dict[str, str]) -> LLMRequest:
    return LLMRequest(request_id="r", target_model="", incoming_model="", api=ApiType.OTHER,
                      prompt="", headers=headers)


# --- plugin lifecycle ---------------------------------------------------------------


@pytest.mark.parametrize("cls,type_name", [
    (OpenAIParser, "openai-parser"), (PassthroughParser, "passthrough-parser"),
    (VllmGrpcParser, "vllmgrpc-parser"), (VllmHttpParser, "vllmhttp-parser")])
def test_registered_and_named(cls: type[Any], type_name: str) -> None:
    """TestVllmGRPCParser_PluginLifecycle: default name = type; the factory names it."""
    assert cls.type_name == type_name
    assert cls().name == type_name
    reg = default_registry()
    from epp.framework.handle import PluginHandle
    built = reg.builder(type_name, "plugins[0].type")("custom", None, "p", PluginHandle())
    assert isinstance(built, cls) and built.name == "custom"
    assert isinstance(built, Parser)


def test_parsers_are_no_scheduling_plugins() -> None:
    from epp.framework.interfaces import Filter, Picker, ProfileHandler, Scorer
    for cls in BUILTIN_PARSERS:
        p = cls()
        assert not isinstance(p, (Filter, Scorer, Picker, ProfileHandler))


# --- openai-parser: today's parsing, unchanged ---------------------------------------


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "m", "prompt": "hello"}),
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "cache_salt": "s"}),
    ("/v1/chat/completions", {"model": "m", "stream": True,
                              "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "m", "input": "hi", "cache_salt": "x"}),
    ("/v1/embeddings", {"model": "m", "input": ["a", "b"]}),
])
def test_openai_parser_is_parse_request_body(path: str, body: dict[str, Any]) -> None:
    raw = orjson.dumps(body)
    assert OpenAIParser().parse_request({":path": path}, raw) == parse_request_body(path, raw)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "m", "prompt": []}),          # empty string array prompt
    ("/v1/chat/completions", {"model": "m", "messages": []}),   # empty messages array
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": 1, "content": "x"}]}),
    ("/v1/responses", {"model": "m"}),                          # responses missing input
    ("/v1/embeddings", {"model": "m"}),                         # embeddings missing input
    ("/v1/embeddings", {"model": "m", "input": None}),          # null input
    ("/v1/completions", {"prompt": "no model"}),   # GIE: 400 "model not found" (Director)
])
def test_openai_parser_rejects_with_400(path: str, body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest) as e:
        OpenAIParser().parse_request({":path": path}, orjson.dumps(body))
    assert e.value.status == 400


def test_openai_parser_nil_body_is_400() -> None:
    with pytest.raises(BadRequest, match="not valid JSON"):
        OpenAIParser().parse_request({":path": "/v1/completions"}, b"")


def test_openai_response_parser_json_and_sse() -> None:
    p = OpenAIParser()
    rp = p.response_parser(req({}), {"content-type": "application/json"})
    assert rp is not None
    rp.feed(b'{"object":"chat.completion","usage":{"prompt_tokens":3,"completion_tokens":4,'
            b'"prompt_tokens_details":{"cached_tokens":2}}}')
    assert rp.finish() == Usage(3, 4, 2)
    sse = p.response_parser(req({}), {"content-type": "text/event-stream"})
    assert sse is not None
    sse.feed(b'data: {"usage":{"prompt_tokens":7,"total_tokens":17,"completion_tokens":10}}'
             b"\n\ndata: [DONE]\n\n")
    assert sse.finish() == Usage(7, 10, None)


# --- passthrough-parser ---------------------------------------------------------------


@pytest.mark.parametrize("body", [b"", b"hello world", b"\x00\xff not json {"])
def test_passthrough_parses_nothing(body: bytes) -> None:
    parsed = PassthroughParser().parse_request({":path": "/anything"}, body)
    assert (parsed.model, parsed.prompt, parsed.data, parsed.stream) == ("", "", None, False)
    assert parsed.api is ApiType.OTHER


def test_passthrough_reads_no_response() -> None:
    assert PassthroughParser().response_parser(req({}), {"content-type": "text/plain"}) is None


# --- vllmgrpc-parser: requests (TestVllmGRPCParser_ParseRequest) ------------------------


def test_grpc_valid_text_request() -> None:
    parsed = VllmGrpcParser().parse_request(GEN, grpc_body(g.GenerateRequest(text="Hello world")))
    assert (parsed.api, parsed.model, parsed.prompt, parsed.stream, parsed.data) == (
        ApiType.COMPLETIONS, "", "Hello world", False, None)


def test_grpc_valid_tokenized_request() -> None:
    msg = g.GenerateRequest(tokenized=g.TokenizedInput(original_text="Tokenized hello",
                                                        input_ids=[1, 2]))
    assert VllmGrpcParser().parse_request(GEN, grpc_body(msg)).prompt == "Tokenized hello"


def test_grpc_tokenized_without_text_uses_token_ids() -> None:
    """Not in GIE (its prompt is then empty): the ids keep prefix affinity working."""
    msg = g.GenerateRequest(tokenized=g.TokenizedInput(input_ids=[11, 22, 33]))
    assert VllmGrpcParser().parse_request(GEN, grpc_body(msg)).prompt == "11 22 33"


def test_grpc_stream_and_max_tokens() -> None:
    msg = g.GenerateRequest(text="Hello world", stream=True,
                            sampling_params=g.SamplingParams(max_tokens=64, temperature=0.5))
    parsed = VllmGrpcParser().parse_request(GEN, grpc_body(msg))
    assert parsed.stream is True and parsed.max_tokens == 64
    no_cap = g.GenerateRequest(text="x", sampling_params=g.SamplingParams(top_k=3))
    assert VllmGrpcParser().parse_request(GEN, grpc_body(no_cap)).max_tokens is None


def test_grpc_valid_embed_request() -> None:
    msg = g.EmbedRequest(tokenized=g.TokenizedInput(original_text="Embed this"))
    parsed = VllmGrpcParser().parse_request(EMB, grpc_body(msg))
    assert (parsed.api, parsed.prompt, parsed.stream) == (ApiType.EMBEDDINGS, "Embed this", False)


@pytest.mark.parametrize("headers,body,message", [
    (GEN, b"\x00\x00\x00", "parsing gRPC payload for Generate: not able to parse payload"),
    (GEN, b"\x01\x00\x00\x00\x00", "compressed vllmgrpc payload is not supported"),
    # grpc_test.go "invalid gRPC payload"
    (GEN, b"plain text not grpc payload style",
     "parsing gRPC payload for Generate: not able to parse payload"),
    (GEN, g.frame(b"\xff\xff\xff"), "not a valid GenerateRequest message"),
    (GEN, grpc_body(g.GenerateRequest()), "not supported request inputType"),
    ({}, grpc_body(g.GenerateRequest()), "unsupported gRPC path: "),
    # grpc_test.go "unsupported gRPC method"
    ({":path": "unsupportedMethod"}, grpc_body(g.GenerateRequest(text="x")),
     "unsupported gRPC path: unsupportedMethod"),
    (EMB, grpc_body(g.EmbedRequest(request_id="r")), "missing tokenized input in EmbedRequest"),
    (EMB, b"\x00\x00", "parsing gRPC payload for Embed: not able to parse payload"),
])
def test_grpc_bad_requests_are_400(headers: dict[str, str], body: bytes, message: str) -> None:
    with pytest.raises(BadRequest) as e:
        VllmGrpcParser().parse_request(headers, body)
    assert e.value.status == 400
    assert message in e.value.message


def test_grpc_bytes_after_the_first_frame_are_ignored() -> None:
    body = grpc_body(g.GenerateRequest(text="first")) + grpc_body(g.GenerateRequest(text="2nd"))
    assert VllmGrpcParser().parse_request(GEN, body).prompt == "first"


# --- vllmgrpc-parser: responses (TestVllmGRPCParser_ParseResponse) ----------------------


def usage_of(path: str, *chunks: bytes) -> Usage | None:
    rp = VllmGrpcParser().response_parser(req({":path": path}), {"content-type": "application/grpc"})
    assert rp is not None
    for c in chunks:
        rp.feed(c)
    return rp.finish()


def chunk(**kw: Any) -> Any:
    return g.GenerateResponse(chunk=g.message_class("GenerateStreamChunk")(**kw))


def complete(**kw: Any) -> Any:
    return g.GenerateResponse(complete=g.message_class("GenerateComplete")(**kw))


@pytest.mark.parametrize("path", [g.GENERATE_PATH, "/unknown"])
def test_grpc_usage_from_chunk_and_complete(path: str) -> None:
    assert usage_of(path, grpc_body(chunk(token_ids=[1, 2, 3], prompt_tokens=10,
                                          completion_tokens=5, cached_tokens=2))) == \
        Usage(10, 5, 2)
    assert usage_of(path, grpc_body(complete(finish_reason="stop", prompt_tokens=20,
                                             completion_tokens=15, cached_tokens=5))) == \
        Usage(20, 15, 5)
    # "Valid Generate Response with Context": cached 0 is still reported (GIE records it).
    assert usage_of(path, grpc_body(complete(prompt_tokens=20, completion_tokens=15))) == \
        Usage(20, 15, 0)


def test_grpc_chunk_without_tokens_reports_nothing() -> None:
    assert usage_of(g.GENERATE_PATH, grpc_body(chunk(token_ids=[4]))) is None
    # "Nil Response" (GIE: an error, logged; the response passes): no usage.
    assert usage_of(g.GENERATE_PATH, grpc_body(g.GenerateResponse())) is None


@pytest.mark.parametrize("path", [g.EMBED_PATH, "/unknown"])
def test_grpc_embed_usage(path: str) -> None:
    body = grpc_body(g.EmbedResponse(prompt_tokens=10, embedding=[1.0, 2.0], embedding_dim=2))
    assert usage_of(path, body) == Usage(10, 0, None)


def test_grpc_stream_split_frames_last_usage_wins() -> None:
    """grpc_test.go "response buffering: multi-chunk" and "response streaming with token
    usage": frames split across chunks, several frames, the last usage counts."""
    a = grpc_body(chunk(token_ids=[1, 2, 3]))
    b = grpc_body(chunk(token_ids=[4], prompt_tokens=7, completion_tokens=1))
    c = grpc_body(complete(prompt_tokens=7, completion_tokens=10))
    whole = a + b + c
    assert usage_of(g.GENERATE_PATH, whole) == Usage(7, 10, 0)
    pieces = [whole[i:i + 3] for i in range(0, len(whole), 3)]
    assert usage_of(g.GENERATE_PATH, *pieces) == Usage(7, 10, 0)
    assert usage_of(g.GENERATE_PATH, c[: len(c) // 2], c[len(c) // 2:]) == Usage(7, 10, 0)


def test_grpc_response_garbage_is_ignored() -> None:
    """grpc_test.go "response buffering: invalid gRPC": never raises, no usage."""
    assert usage_of(g.GENERATE_PATH, b"no healthy upstream") is None
    compressed = g.frame(complete(prompt_tokens=7, completion_tokens=1).SerializeToString(),
                         compressed=True)
    assert usage_of(g.GENERATE_PATH, compressed) is None


def test_grpc_oversized_frame_is_skipped() -> None:
    rp = g.GrpcUsageParser(g.GENERATE_PATH, max_frame_bytes=16)
    big = g.frame(b"\x0a" + b"x" * 40)
    good = grpc_body(complete(prompt_tokens=3, completion_tokens=4))
    data = big + good
    for i in range(0, len(data), 7):
        rp.feed(data[i:i + 7])
    assert rp.finish() == Usage(3, 4, 0)


# --- the vLLM engine messages match GIE's vllm_engine.proto ---------------------------

_SCALARS = {"float": "TYPE_FLOAT", "double": "TYPE_DOUBLE", "uint32": "TYPE_UINT32",
            "int32": "TYPE_INT32", "string": "TYPE_STRING", "bool": "TYPE_BOOL"}
_FIELD = re.compile(r"^\s*(optional |repeated )?(map<\w+, ?\w+>|[\w.]+) (\w+) = (\d+);")


def _proto_messages() -> dict[str, dict[str, tuple[int, str, str]]]:
    """message → field → (number, label, type) from the .proto text (its simple grammar)."""
    out: dict[str, dict[str, tuple[int, str, str]]] = {}
    current: dict[str, tuple[int, str, str]] | None = None
    for line in PROTO.read_text().splitlines():
        m = re.match(r"^message (\w+) \{", line)
        if m:
            current = out.setdefault(m.group(1), {})
            continue
        if line.startswith("}"):
            current = None
            continue
        f = _FIELD.match(line)
        if f and current is not None:
            label, ftype, name, num = f.groups()
            current[name] = (int(num), (label or "").strip(), ftype)
    return out


def test_messages_match_the_proto() -> None:
    from google.protobuf.descriptor import FieldDescriptor
    proto = _proto_messages()
    for name in ("SamplingParams", "ChoiceConstraint", "TokenizedInput", "GenerateRequest",
                 "GenerateResponse", "GenerateStreamChunk", "GenerateComplete",
                 "EmbedRequest", "EmbedResponse"):
        desc = g.message_class(name).DESCRIPTOR
        want = proto[name]
        assert set(desc.fields_by_name) == set(want), name
        for fname, (num, label, ftype) in want.items():
            fd = desc.fields_by_name[fname]
            assert fd.number == num, (name, fname)
            if ftype.startswith("map<"):
                assert fd.message_type.GetOptions().map_entry, (name, fname)
                continue
            assert fd.is_repeated == (label == "repeated"), (name, fname)
            if label == "optional":
                assert fd.has_presence and fd.containing_oneof is not None, (name, fname)
            if ftype in _SCALARS:
                assert fd.type == getattr(FieldDescriptor, _SCALARS[ftype]), (name, fname)
            else:
                assert fd.message_type.name == ftype, (name, fname)


# --- vllmhttp-parser (llm-d-router) ---------------------------------------------------

GENERATE = {":path": "/inference/v1/generate"}


def gen(body: dict[str, Any], headers: dict[str, str] = GENERATE) -> Any:
    return VllmHttpParser().parse_request(headers, orjson.dumps(body))


def test_generate_with_token_ids() -> None:
    parsed = gen({"token_ids": [1, 2, 3]})
    assert (parsed.api, parsed.model, parsed.prompt, parsed.stream, parsed.cache_salt) == (
        ApiType.COMPLETIONS, "", "1 2 3", False, None)
    assert parsed.data == {"token_ids": [1, 2, 3]}


def test_generate_with_cache_salt_model_sampling_params_and_stream() -> None:
    parsed = gen({"token_ids": [10, 20, 30], "cache_salt": "abc123", "model": "m",
                  "sampling_params": {"temperature": 0.8, "max_tokens": 128}, "stream": True})
    assert (parsed.cache_salt, parsed.model, parsed.max_tokens, parsed.stream) == (
        "abc123", "m", 128, True)


@pytest.mark.parametrize("body,message", [
    ({"sampling_params": {"temperature": 0.8}}, "must have non-empty token_ids field"),
    ({"token_ids": []}, "must have non-empty token_ids field"),
    ({"token_ids": [1, 2, -1]}, "token_ids[2]: invalid value"),
    ({"token_ids": [1, 2.5]}, "token_ids[1]: invalid value"),
    ({"token_ids": [1 << 32]}, "token_ids[0]: invalid value"),
    ({"token_ids": "1 2"}, "'token_ids' must be an array"),
    ({"token_ids": [1], "cache_salt": 5}, "'cache_salt' must be a string"),
    ({"token_ids": [1], "features": {"mm_hashes": {"image": [1]}}}, "mm_hashes.image"),
])
def test_generate_errors(body: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest) as e:
        gen(body)
    assert e.value.status == 400 and message in e.value.message


def test_generate_via_x_original_path_and_query() -> None:
    assert gen({"token_ids": [5, 6, 7]}, {"x-original-path": "/inference/v1/generate"}).prompt \
        == "5 6 7"
    assert gen({"token_ids": [5]}, {":path": "/inference/v1/generate?x=1"}).prompt == "5"


def test_generate_with_multimodal_features() -> None:
    body = {"token_ids": [151644, 872, 198, 3838, 374, 279, 6722],
            "features": {"mm_hashes": {"image": ["abc123hash", "def456hash"]},
                         "mm_placeholders": {"image": [{"offset": 1, "length": 3},
                                                       {"offset": 4, "length": 3}]}}}
    parsed = gen(body)
    assert parsed.prompt == ("151644 <|image:abc123hash|> 872 198 3838 <|image:def456hash|> "
                             "374 279 6722")
    other = dict(body, features={"mm_hashes": {"image": ["zzz", "def456hash"]},
                                 "mm_placeholders": body["features"]["mm_placeholders"]})
    assert gen(other).prompt != parsed.prompt


def test_vllmhttp_delegates_other_paths_to_openai() -> None:
    raw = orjson.dumps({"model": "m", "prompt": "hello world"})
    assert VllmHttpParser().parse_request({":path": "/v1/completions"}, raw) == \
        parse_request_body("/v1/completions", raw)
    rp = VllmHttpParser().response_parser(req({}), {"content-type": "application/json"})
    assert rp is not None
    rp.feed(b'{"usage":{"prompt_tokens":1,"completion_tokens":2}}')
    assert rp.finish() == Usage(1, 2, None)


# --- the Director with each parser ------------------------------------------------------


def director(parser: Parser) -> Director:
    store = Datastore()
    store.set_endpoints(Endpoint(f"p{i}", f"10.0.0.{i}", 8000) for i in range(1, 4))
    built = load_and_build()
    return Director(SchedulingCore(store, built.scheduler, EppMetrics(store), built.pre_request,
                                   built.response_complete), parser)


async def test_director_passthrough_forwards_any_body_unchanged() -> None:
    d = director(PassthroughParser())
    body = b"\x00\x01 arbitrary bytes, not JSON"
    r = await d.route({":path": "/whatever", "x-request-id": "a"}, body, True, None)
    assert r.body is None  # the original bytes go upstream
    assert r.context.request.incoming_model == "" and r.context.request.prompt == ""
    # The rewrite header names the target model; the body is still not touched.
    r = await d.route({":path": "/x", "x-gateway-model-name-rewrite": "m2"}, body, True, None)
    assert r.body is None and r.context.request.target_model == "m2"
    assert r.context.model_back is None
    assert d.on_response_headers(r.context, 200, {"content-type": "application/json"}) is None
    d.on_response_body(r.context, b'{"usage":{"prompt_tokens":1}}', True)
    assert r.context.usage is None
    d.on_done(r.context, False)


async def test_director_grpc_routes_and_reads_usage() -> None:
    d = director(VllmGrpcParser())
    body = grpc_body(g.GenerateRequest(text="hello", stream=True))
    r = await d.route({":path": g.GENERATE_PATH, "content-type": "application/grpc"}, body,
                      True, None)
    assert r.body is None and r.destination.startswith("10.0.0.")
    assert r.context.request.prompt == "hello" and r.context.request.stream is True
    d.on_response_headers(r.context, 200, {"content-type": "application/grpc"})
    resp = grpc_body(complete(prompt_tokens=7, completion_tokens=10))
    assert d.on_response_body(r.context, resp[:4], False) is None
    assert d.on_response_body(r.context, resp[4:], False) is None
    assert r.context.usage.finish() == Usage(7, 10, 0)
    d.on_done(r.context, False)
    with pytest.raises(BadRequest, match="not able to parse payload"):
        await d.route({":path": g.GENERATE_PATH}, b"plain text not grpc payload style",
                      True, None)


async def test_director_generate_needs_a_model_from_body_or_header() -> None:
    d = director(VllmHttpParser())
    body = orjson.dumps({"token_ids": [1, 2, 3]})
    with pytest.raises(BadRequest, match="model not found in request body"):
        await d.route(GENERATE, body, True, None)
    r = await d.route({**GENERATE, "x-gateway-model-name-rewrite": "m"}, body, True, None)
    assert r.body is not None and orjson.loads(r.body) == {"token_ids": [1, 2, 3], "model": "m"}
    assert r.context.model_back is None  # nothing to rewrite back to
    with_model = orjson.dumps({"token_ids": [1], "model": "m"})
    r = await d.route(GENERATE, with_model, True, None)
    assert r.body is None and r.context.request.incoming_model == "m"


def test_build_request_defaults_to_openai() -> None:
    raw = orjson.dumps({"model": "m", "prompt": "p"})
    request, parsed = build_request({":path": "/v1/completions"}, raw, True)
    assert parsed is not None and request.prompt == "p" and request.target_model == "m"


# --- the config's parser section (GIE's ParserConfig) ----------------------------------

CONFIG = """\
plugins:
- type: queue-scorer
- {{type: {parser}, name: p}}
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: queue-scorer}}]
parser: {{pluginRef: p}}
"""


@pytest.mark.parametrize("cls", BUILTIN_PARSERS)
def test_config_selects_the_parser(cls: type[Any]) -> None:
    built = load_and_build(text=CONFIG.format(parser=cls.type_name))
    assert isinstance(built.parser_plugin, cls) and built.parser_plugin.name == "p"
    store = Datastore()
    d = Director(SchedulingCore(store, built.scheduler, EppMetrics(store)), built.parser_plugin)
    assert d.parser is built.parser_plugin


def test_without_parser_section_the_openai_parser_reads() -> None:
    built = load_and_build()
    store = Datastore()
    d = Director(SchedulingCore(store, built.scheduler, EppMetrics(store)), built.parser_plugin)
    assert isinstance(d.parser, OpenAIParser)
    assert isinstance(Director(SchedulingCore(store, built.scheduler, EppMetrics(store))).parser,
                      OpenAIParser)


class MarkerOnly:
    """Claims to be a parser but cannot parse."""

    type_name = "tests.unit.gie.test_parsers:MarkerOnly"
    parser_protocol = "openai"

    def __init__(self, name: str) -> None:
        self.name = name


def test_director_refuses_a_plugin_that_cannot_parse() -> None:
    from epp.errors import ConfigError
    built = load_and_build()
    store = Datastore()
    with pytest.raises(ConfigError, match="'x' .* cannot be the parser: it needs parse_request"):
        Director(SchedulingCore(store, built.scheduler, EppMetrics(store)), MarkerOnly("x"))
