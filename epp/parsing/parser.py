"""The Parser extension point: how the EPP reads request and response bodies.

GIE v1.5.0's ``requesthandling.Parser`` (pkg/epp/framework/interface/requesthandling/
plugins.go): the config's ``parser: {pluginRef: NAME}`` names one parser plugin for the
whole EPP; without it the ``openai-parser`` is used. llm-d-router's ``requestHandler:
{parsers: [...]}`` may name several, chosen per request by path
(:class:`epp.parsing.dispatch.ParserRouter`). The Director hands it every request
body and, through the :class:`ResponseParser` it makes per response, every response
body chunk. Built-in parsers: :mod:`epp.parsing.parsers`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from epp.framework.interfaces import Plugin
from epp.parsing.request import ParsedRequest
from epp.parsing.usage import Usage
from epp.scheduling.types import LLMRequest


class ResponseParser(Protocol):
    """Reads token usage from one response body, fed chunk by chunk as it passes.

    Never raises on malformed input (a response is never failed for its usage);
    ``finish`` is called once, at the end of the body."""

    def feed(self, chunk: bytes) -> None: ...

    def finish(self) -> Usage | None: ...


@runtime_checkable
class Parser(Plugin, Protocol):
    """A request/response parser plugin (the config's ``parser: {pluginRef: …}``).

    ``parser_protocol`` names the payload format it reads (``openai``, ``vllmgrpc``, …).
    """

    parser_protocol: str

    def parse_request(self, headers: Mapping[str, str], body: bytes) -> ParsedRequest:
        """Parse a complete request body; ``headers`` are the lower-cased request headers
        (``:path`` included).

        Raises :class:`epp.errors.BadRequest` (answered 400, as GIE answers every parser
        error) naming the problem. ``ParsedRequest.data`` is the JSON object the Director
        may rewrite (the model), or None when the body must pass through unchanged;
        ``model`` may be ``""`` when the body names none.
        """
        ...

    def response_parser(self, request: LLMRequest,
                        headers: Mapping[str, str]) -> ResponseParser | None:
        """A reader for the response to ``request`` (``headers``: its response headers),
        or None when this parser reads nothing from responses."""
        ...
