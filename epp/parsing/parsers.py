"""The built-in parser plugins (:class:`epp.parsing.parser.Parser`).

- ``openai-parser`` (the default): OpenAI-compatible JSON bodies
  (:func:`epp.parsing.request.parse_request_body`); usage from JSON or SSE responses.
- ``passthrough-parser``: reads nothing; any body is routed and forwarded as is.
- ``vllmgrpc-parser``: gRPC-framed vLLM ``Generate``/``Embed`` requests
  (:mod:`epp.parsing.vllm_grpc`); usage from the gRPC responses.
- ``vllmhttp-parser`` (llm-d-router's): vLLM's ``/inference/v1/generate``
  (:mod:`epp.parsing.vllm_http`); every other path goes to the openai-parser.
- ``anthropic-parser`` (llm-d-router's): Anthropic Messages API ``…/messages`` and
  ``…/messages/count_tokens`` (:mod:`epp.parsing.anthropic`).
- ``vertexai-parser`` (llm-d-router's): Vertex AI gRPC ``PredictionService`` methods
  wrapping OpenAI JSON (:mod:`epp.parsing.vertexai`).

None takes parameters. GIE sources: pkg/epp/framework/plugins/requesthandling/parsers/
{openai,passthrough,vllmgrpc} (v1.5.0); llm-d-router's (v0.10.0)
pkg/epp/framework/plugins/requesthandling/parsers/{vllmhttp,anthropic,vertexai}.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Self

from epp import keys
from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters
from epp.parsing.anthropic import AnthropicUsageParser, is_count_tokens, parse_messages_request
from epp.parsing.parser import ResponseParser
from epp.parsing.request import ParsedRequest, parse_request_body
from epp.parsing.usage import UsageParser
from epp.parsing.vertexai import VertexUsageParser, method_of, parse_vertex_request
from epp.parsing.vllm_grpc import GrpcUsageParser, parse_grpc_request
from epp.parsing.vllm_http import is_generate_path, parse_generate_request
from epp.scheduling.types import ApiType, LLMRequest


class _ParserPlugin:
    type_name = ""
    parser_protocol = ""
    Parameters = NoParameters

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.type_name

    @classmethod
    def from_params(cls, name: str, params: NoParameters, handle: PluginHandle) -> Self:
        return cls(name)


class OpenAIParser(_ParserPlugin):
    """OpenAI-compatible requests: the API from the path, ``model`` required, the prompt
    rendered for prefix affinity; usage from JSON bodies or SSE events."""

    type_name = "openai-parser"
    parser_protocol = "openai"

    def parse_request(self, headers: Mapping[str, str], body: bytes) -> ParsedRequest:
        return parse_request_body(headers.get(keys.HEADER_PATH, "/"), body)

    def response_parser(self, request: LLMRequest,
                        headers: Mapping[str, str]) -> ResponseParser | None:
        ctype = headers.get(keys.HEADER_CONTENT_TYPE, "")
        return UsageParser(sse=ctype.startswith(keys.CONTENT_TYPE_SSE))


class PassthroughParser(_ParserPlugin):
    """Any body, not read: no model (the ``x-gateway-model-name-rewrite`` header may give
    one), no prompt (scorers that need it, e.g. prefix-cache-scorer, score every endpoint
    alike), no usage. The body goes upstream byte for byte."""

    type_name = "passthrough-parser"
    parser_protocol = "passthrough"

    def parse_request(self, headers: Mapping[str, str], body: bytes) -> ParsedRequest:
        return ParsedRequest(api=ApiType.OTHER, model="", prompt="", stream=False,
                             max_tokens=None, cache_salt=None, user=None, data=None)

    def response_parser(self, request: LLMRequest,
                        headers: Mapping[str, str]) -> ResponseParser | None:
        return None


class VllmGrpcParser(_ParserPlugin):
    """vLLM's gRPC engine API: ``/vllm.grpc.engine.VllmEngine/Generate`` and ``…/Embed``
    requests, routed on their prompt and forwarded byte for byte; usage from the
    ``GenerateResponse``/``EmbedResponse`` messages."""

    type_name = "vllmgrpc-parser"
    parser_protocol = "vllmgrpc"

    def parse_request(self, headers: Mapping[str, str], body: bytes) -> ParsedRequest:
        return parse_grpc_request(headers, body)

    def response_parser(self, request: LLMRequest,
                        headers: Mapping[str, str]) -> ResponseParser | None:
        return GrpcUsageParser(request.headers.get(keys.HEADER_PATH, ""))


class VllmHttpParser(OpenAIParser):
    """vLLM's ``/inference/v1/generate`` (pre-tokenized ``token_ids``, optional multimodal
    ``features``) and, on every other path, the openai-parser; responses as the
    openai-parser reads them."""

    type_name = "vllmhttp-parser"
    parser_protocol = "vllmhttp"

    def parse_request(self, headers: Mapping[str, str], body: bytes) -> ParsedRequest:
        if is_generate_path(headers):
            return parse_generate_request(body)
        return super().parse_request(headers, body)


class AnthropicParser(_ParserPlugin):
    """Anthropic's Messages API: ``…/messages`` bodies (``messages`` required; ``system``,
    ``tools``, ``model``, ``stream``, ``max_tokens``, ``cache_salt`` read), usage from JSON
    or SSE (``message_start``/``message_delta``) responses; ``…/messages/count_tokens``
    passes through unread; any other path is answered 400."""

    type_name = "anthropic-parser"
    parser_protocol = "anthropic"

    def parse_request(self, headers: Mapping[str, str], body: bytes) -> ParsedRequest:
        return parse_messages_request(headers, body)

    def response_parser(self, request: LLMRequest,
                        headers: Mapping[str, str]) -> ResponseParser | None:
        if is_count_tokens(request.headers):
            return None
        ctype = headers.get(keys.HEADER_CONTENT_TYPE, "").lower()
        return AnthropicUsageParser(sse=keys.CONTENT_TYPE_SSE in ctype)


class VertexAIParser(_ParserPlugin):
    """Vertex AI's gRPC ``PredictionService/ChatCompletions``, ``…/StreamRawPredict`` and
    ``…/RawPredict``: the OpenAI JSON in the request's ``HttpBody`` is read as the
    openai-parser reads it and the request forwarded byte for byte; usage from the
    ``HttpBody`` responses. Other methods pass through unread."""

    type_name = "vertexai-parser"
    parser_protocol = "vertexai"

    def parse_request(self, headers: Mapping[str, str], body: bytes) -> ParsedRequest:
        return parse_vertex_request(headers, body)

    def response_parser(self, request: LLMRequest,
                        headers: Mapping[str, str]) -> ResponseParser | None:
        return None if method_of(request.headers) is None else VertexUsageParser()


BUILTIN_PARSERS: tuple[type[_ParserPlugin], ...] = (
    OpenAIParser, PassthroughParser, VllmGrpcParser, VllmHttpParser, AnthropicParser,
    VertexAIParser)
DEFAULT_PARSER = OpenAIParser.type_name
