"""Several parsers on one EPP: llm-d-router's ``requestHandler.parsers`` list.

Each parser claims request-path suffixes (llm-d's ``Parser.Claims().Paths``); a request
goes to the first listed parser one of whose suffixes its path ends with (the path
without its query string and one trailing ``/``; suffixes compared without their
leading/trailing ``/``). A parser that claims no paths (the passthrough-parser, and any
parser plugin without a ``parser_claims`` attribute) is the fallback for every
unmatched path; parsers listed after it are never used. A second parser of a type
already listed is skipped (with a warning). A path no parser claims, with no fallback,
is answered 400.

Followed: llm-d-router v0.10.0 pkg/epp/handlers/parsers.go (ParserRegistry),
pkg/epp/framework/common/request/headers.go (GetRequestPath, MatchPathSuffix) and each
parser's Claims().
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from epp.errors import BadRequest
from epp.parsing.parser import Parser, ResponseParser
from epp.parsing.request import ParsedRequest
from epp.parsing.vllm_http import request_path
from epp.scheduling.types import LLMRequest

# llm-d's GetRequestPath default when no path header is present.
DEFAULT_PATH: Final = "/v1/completions"

# The built-in parsers' claims, by type (llm-d-router v0.10.0). A parser plugin may
# declare its own as a ``parser_claims`` attribute (a tuple of suffixes; empty: fallback).
CLAIMS: Final[Mapping[str, tuple[str, ...]]] = {
    "openai-parser": ("chat/completions", "completions", "embeddings", "responses",
                      "conversations", "chat/completions/render", "completions/render",
                      "images/generations"),
    "anthropic-parser": ("messages", "messages/count_tokens"),
    "vllmhttp-parser": ("inference/v1/generate",),
    "vllmgrpc-parser": ("vllm.grpc.engine.VllmEngine/Generate",
                        "vllm.grpc.engine.VllmEngine/Embed"),
    "vertexai-parser": ("PredictionService/ChatCompletions",
                        "PredictionService/StreamRawPredict", "PredictionService/RawPredict"),
    "passthrough-parser": (),
}


def claims_of(parser: Parser) -> tuple[str, ...]:
    """The path suffixes ``parser`` claims (empty: it is a fallback)."""
    own = getattr(parser, "parser_claims", None)
    if own is not None:
        return tuple(own)
    return CLAIMS.get(parser.type_name, ())


def match_path_suffix(path: str, suffix: str) -> bool:
    """llm-d's MatchPathSuffix."""
    path = path.strip()
    path = path.removesuffix("/")
    return path.endswith(suffix.strip().strip("/"))


class ParserRouter:
    """A :class:`Parser` that hands each request to the parser its path resolves to.

    Its ``type_name`` is the types of the parsers in use, comma separated (e.g.
    ``openai-parser,anthropic-parser``): ``epp serve --workers N`` hands it to each
    protocol front, which builds the same router from it (parsers take no parameters)."""

    parser_protocol = "multi"

    def __init__(self, parsers: Sequence[Parser], name: str = "requestHandler.parsers"
                 ) -> None:
        self.name = name
        self.entries: list[tuple[Parser, tuple[str, ...]]] = []
        self.fallback: Parser | None = None
        self.parsers: list[Parser] = []  # the ones in use, in order
        self.warnings: list[str] = []
        seen: set[str] = set()
        for i, p in enumerate(parsers):
            if p.type_name in seen:
                self.warnings.append(
                    f"parser {p.name!r}: a parser of type {p.type_name} is already listed; "
                    "this one is skipped")
                continue
            seen.add(p.type_name)
            self.parsers.append(p)
            paths = claims_of(p)
            if not paths:
                self.fallback = p
                for skipped in parsers[i + 1:]:
                    self.warnings.append(
                        f"parser {skipped.name!r} is skipped: it is listed after the "
                        f"fallback parser {p.name!r}, which takes every unmatched path")
                break
            self.entries.append((p, paths))
        self.type_name = ",".join(p.type_name for p in self.parsers)

    @property
    def protocols(self) -> tuple[str, ...]:
        return tuple(p.parser_protocol for p in self.parsers)

    def resolve(self, headers: Mapping[str, str]) -> Parser | None:
        path = request_path(headers) or DEFAULT_PATH
        for parser, suffixes in self.entries:
            for s in suffixes:
                if match_path_suffix(path, s):
                    return parser
        return self.fallback

    def parse_request(self, headers: Mapping[str, str], body: bytes) -> ParsedRequest:
        parser = self.resolve(headers)
        if parser is None:
            path = request_path(headers) or DEFAULT_PATH
            raise BadRequest(f"no parser registered matching path suffix for: {path} "
                             f"(configured: {', '.join(p.name for p in self.parsers)})")
        return parser.parse_request(headers, body)

    def response_parser(self, request: LLMRequest,
                        headers: Mapping[str, str]) -> ResponseParser | None:
        parser = self.resolve(request.headers)
        return None if parser is None else parser.response_parser(request, headers)
