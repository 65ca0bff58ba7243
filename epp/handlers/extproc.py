"""The ext_proc stream state machine (design.md §2, envoy-notes.md).

One :class:`ExtProcStream` per HTTP request. It is transport-free — ``handle(message)``
returns the responses to send — so it is unit-tested in memory; :class:`ExtProcServicer`
binds it to a grpc.aio stream.

FULL_DUPLEX_STREAMED (request body mode from ``protocol_config``): the answer to the
request-headers message is withheld until the body is complete and routed; then the
headers answer (routing mutation, ``clear_route_cache``, ``envoy.lb`` metadata), the body
as StreamedBodyResponse chunks of at most 62,000 bytes (end_of_stream on the last), then a
trailers answer if trailers came. Any other request body mode is handled as BUFFERED:
headers are answered at once and the routing goes in the body answer. Header-only
requests (end_of_stream on the headers) are routed from the headers alone.

Responses (GIE's pkg/epp/handlers/response.go, server.go): the response-headers answer
always sets ``x-went-into-resp-headers: true`` (plus any headers plugins set); body chunks
are echoed (full duplex) or continued. When the response ends — the end-of-stream body
chunk, or the trailers of a gRPC response — the ``response_metadata`` hook is asked once,
and its dynamic metadata (e.g. ``request-attribute-reporter``'s ``envoy.lb`` cost) rides
on the answer to that last message; no other answer carries any.

A rejection is one ImmediateResponse with a JSON error body, after which the stream ends.
A routed request that flow control evicts in flight (llm-d's ``enableEviction``; the
servicer's ``evictions``) is ended the same way, with llm-d's 429 plain-text answer.
An exception inside the handler becomes a 500 before routing, and is logged and passed
over after it: a stream never crashes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

import grpc
import orjson
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.message import DecodeError
from google.protobuf.struct_pb2 import Struct

from epp import keys
from epp.errors import BadRequest, BodyTooLarge, EppError
from epp.flowcontrol.eviction import EVICTED_BODY, EVICTED_STATUS, HEADER_REQUEST_DROPPED_REASON
from epp.handlers.protocol import DynamicMetadata, RequestDirector, ResponseMetadata, Routing

log = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 62_000
DEFAULT_MAX_HEADERS = 100  # Envoy's default max_headers_count
_FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
_NONE = ProcessingMode.NONE
_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def _set_header(key: str, value: str) -> HeaderValueOption:
    # raw_value, not value: Envoy sets an empty header from `value` (envoy-notes pitfall 1).
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()),
                             append_action=_OVERWRITE)


def _headers_dict(headers: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _subset_hint(msg: pb.ProcessingRequest) -> list[str] | None:
    if not msg.HasField("metadata_context"):
        return None
    st = msg.metadata_context.filter_metadata.get(keys.METADATA_SUBSET_NAMESPACE)
    if st is None or keys.METADATA_SUBSET_KEY not in st.fields:
        return None
    v = st.fields[keys.METADATA_SUBSET_KEY]
    kind = v.WhichOneof("kind")
    if kind == "list_value":
        return [x.string_value for x in v.list_value.values if x.string_value]
    if kind == "string_value":
        return [s.strip() for s in v.string_value.split(",") if s.strip()]
    return []


def routing_mutation(routing: Routing, content_length: int | None = None,
                     token: str | None = None) -> pb.HeaderMutation:
    """Set the destination (overwriting any client value) and remove unset routing headers.

    ``token``: the response observer's token (split response path), set as a header."""
    sets = [_set_header(keys.HEADER_DESTINATION, routing.destination)]
    for k, v in routing.set_headers.items():
        sets.append(_set_header(k, v))
    if content_length is not None:
        sets.append(_set_header(keys.HEADER_CONTENT_LENGTH, str(content_length)))
    if token is not None:
        sets.append(_set_header(keys.HEADER_OBSERVE_TOKEN, token))
    removes = [h for h in keys.ROUTING_HEADERS
               if h != keys.HEADER_DESTINATION and h not in routing.set_headers
               and (token is None or h != keys.HEADER_OBSERVE_TOKEN)]
    return pb.HeaderMutation(set_headers=sets, remove_headers=removes)


def routing_metadata(destination: str, scores: Mapping[str, float] | None = None) -> Struct:
    """The request-path metadata: ``envoy.lb`` with the destination and, with llm-d's
    ``--emit-endpoint-scores`` (``scores`` not empty), ``x-gateway-destination-endpoint-
    scores``: each scored endpoint's ``ip:port`` -> its weighted score (a number)."""
    lb: dict[str, Any] = {keys.METADATA_DESTINATION_KEY: destination}
    if scores:
        lb[keys.METADATA_DESTINATION_SCORES_KEY] = dict(scores)
    md = Struct()
    md.update({keys.METADATA_NAMESPACE_LB: lb})
    return md


def immediate_response(status: int, message: str, error_type: str) -> pb.ProcessingResponse:
    body = orjson.dumps({"error": {"message": message, "type": error_type, "code": status}})
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=[
            _set_header(keys.HEADER_CONTENT_TYPE, keys.CONTENT_TYPE_JSON)]),
        body=body,
        details=error_type,
    ))


def evicted_response(reason: str) -> pb.ProcessingResponse:
    """llm-d's answer to a request flow control evicted in flight (handlers/server.go):
    429, plain-text body, the reason in ``x-llm-d-request-dropped-reason``."""
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=HttpStatus(code=EVICTED_STATUS),
        headers=pb.HeaderMutation(set_headers=[_set_header(HEADER_REQUEST_DROPPED_REASON,
                                                           reason)]) if reason else None,
        body=EVICTED_BODY))


def _streamed_chunks(body: bytes, phase: str) -> list[pb.ProcessingResponse]:
    """The body as StreamedBodyResponse pieces of at most MAX_CHUNK_BYTES."""
    n = len(body)
    out = []
    start = 0
    while True:
        end = min(start + MAX_CHUNK_BYTES, n)
        last = end >= n
        br = pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=body[start:end], end_of_stream=last))))
        out.append(pb.ProcessingResponse(**{phase: br}))
        if last:
            return out
        start = end


def echo_response(body: bytes, end_of_stream: bool,
                  metadata: Struct | None = None) -> pb.ProcessingResponse:
    """A full-duplex response body answer carrying ``body`` (and ``metadata``, if any)."""
    resp = pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=body, end_of_stream=end_of_stream)))))
    if metadata is not None:
        resp.dynamic_metadata.CopyFrom(metadata)
    return resp


def _with_metadata(resp: pb.ProcessingResponse, metadata: Struct | None) -> pb.ProcessingResponse:
    """``resp`` with ``metadata`` attached (a copy: ``resp`` may be a shared constant)."""
    if metadata is None:
        return resp
    out = pb.ProcessingResponse()
    out.CopyFrom(resp)
    out.dynamic_metadata.CopyFrom(metadata)
    return out


# GIE's EPP sets this on every response whose headers it processes (pkg/epp/handlers/
# response.go, generateResponseHeaders: "for debugging purpose only"); gateways and clients
# built against GIE may look for it.
HEADER_WENT_INTO_RESP_HEADERS = "x-went-into-resp-headers"
_WENT_INTO_RESP_HEADERS = _set_header(HEADER_WENT_INTO_RESP_HEADERS, "true")

_EMPTY_REQ_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_RESP_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse(
    response=pb.CommonResponse(header_mutation=pb.HeaderMutation(
        set_headers=[_WENT_INTO_RESP_HEADERS]))))
_EMPTY_REQ_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_EMPTY_RESP_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
_CONTINUE_RESP_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())


class ExtProcStream:
    """State of one ext_proc stream (one HTTP request). Not thread-safe; one task drives it."""

    __slots__ = (
        "_aborted",
        "_chunks",
        "_director",
        "_done_reported",
        "_duplex",
        "_header_count",
        "_headers",
        "_headers_seen",
        "_lean",
        "_max_body",
        "_max_headers",
        "_metadata",
        "_resp_duplex",
        "_resp_len",
        "_resp_seen",
        "_resp_started",
        "_response_metadata",
        "_routed",
        "_routing",
        "_size",
        "_subset",
        "_trailers_pending",
        "closed",
        "token",
    )

    def __init__(self, director: RequestDirector, max_body_bytes: int,
                 token: str | None = None, max_headers: int = DEFAULT_MAX_HEADERS,
                 response_metadata: ResponseMetadata | None = None) -> None:
        """``token``: the response comes on a separate observer stream that will carry
        this token (split response path); it is set on the routed request.
        ``max_headers``: the gateway's request header limit (0 = do not check).
        ``response_metadata``: asked once when the response ends; what it returns goes to
        Envoy as dynamic metadata on the answer to the last response message."""
        self._director = director
        self._response_metadata = response_metadata
        self._metadata: Struct | None = None  # computed at the end, not yet sent
        self._max_body = max_body_bytes
        self._max_headers = max_headers
        self._header_count = 0
        self.token = token
        self._duplex = False
        self._resp_duplex = False
        # Lean gateway shape: the response body is never sent to us (response_body_mode
        # NONE); the end of the stream, after the response headers, is the completion.
        self._lean = False
        self._resp_started = False  # the routed request's response headers passed
        self._headers: dict[str, str] = {}
        self._subset: list[str] | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._routed = False
        self._routing: Routing | None = None
        self.closed = False
        self._done_reported = False
        self._trailers_pending = False
        self._resp_len: int | None = None  # response content-length, when declared
        self._resp_seen = 0
        self._aborted = False  # the final say on whether the routed request was aborted
        self._headers_seen = False

    async def handle(self, msg: pb.ProcessingRequest) -> Sequence[pb.ProcessingResponse]:
        """Process one message from Envoy and return the responses to send, in order."""
        kind = msg.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._on_request_headers(msg)
            if kind == "request_body":
                return await self._on_request_body(msg.request_body)
            if kind == "request_trailers":
                return await self._on_request_trailers()
            if kind == "response_headers":
                if msg.attributes:
                    self._check_upstream(msg)
                return self._on_response_headers(msg.response_headers)
            if kind == "response_body":
                return self._on_response_body(msg.response_body)
            if kind == "response_trailers":
                # gRPC: the trailers end the response (GIE's finishResponse); the body went
                # back already, so the metadata rides on this answer.
                self._report_done(aborted=False)
                return [_with_metadata(_EMPTY_RESP_TRAILERS, self.take_metadata())]
        except EppError as e:
            return self._reject(e.status, e.message, e.error_type)
        except Exception:
            log.exception("ext_proc handler error (%s)", kind)
            if not self._routed:
                self._director.on_rejected(self._headers, 500)
                return self._reject(500, "internal error in the endpoint picker", "internal_error")
            return self._passthrough(msg, kind)
        return []

    # --- request path ---

    async def _on_request_headers(self, msg: pb.ProcessingRequest) -> Sequence[pb.ProcessingResponse]:
        if self._headers_seen:
            # One stream is one HTTP request: Envoy never sends this. Answer it (and end a
            # request routed already, so nothing stays counted as running).
            raise BadRequest("ext_proc protocol error: a second request_headers message "
                             "on one stream")
        self._headers_seen = True
        if msg.HasField("protocol_config"):
            pc = msg.protocol_config
            self._duplex = pc.request_body_mode == _FULL_DUPLEX
            self._resp_duplex = pc.response_body_mode == _FULL_DUPLEX
            # (Not on the split path: there the observer stream brings the response.)
            self._lean = pc.response_body_mode == _NONE and self.token is None
        self._headers = _headers_dict(msg.request_headers.headers)
        self._header_count = len(msg.request_headers.headers.headers)
        self._subset = _subset_hint(msg)
        if self._max_headers:
            # Envoy checks the count after every mutation, even a removal: a request over
            # the limit here fails whatever we answer.
            self._check_header_count(0)
        if msg.request_headers.end_of_stream:
            routing = await self._route(b"", has_body=False)
            return [self._headers_response(routing)]
        if self._duplex:
            return []  # withheld until the body is complete and routed
        # BUFFERED: answer now (dropping client routing headers); route in the body answer.
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=pb.HeaderMutation(
                remove_headers=list(keys.ROUTING_HEADERS)))))]

    async def _on_request_body(self, body: pb.HttpBody) -> Sequence[pb.ProcessingResponse]:
        if self._routed:
            # Only reachable in modes we do not route from (e.g. STREAMED): let it through.
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        data = body.body
        self._size += len(data)
        if self._size > self._max_body:
            self._director.on_rejected(self._headers, 413)
            raise BodyTooLarge(f"request body exceeds the limit of {self._max_body} bytes")
        if data:
            self._chunks.append(data)
        if not self._duplex:
            # BUFFERED: this message is the whole body (end_of_stream is false when
            # trailers follow; do not wait for it).
            return await self._route_buffered()
        if body.end_of_stream:
            return await self._route_duplex()
        return []

    async def _on_request_trailers(self) -> Sequence[pb.ProcessingResponse]:
        if self._duplex and not self._routed:
            return [*await self._route_duplex(), _EMPTY_REQ_TRAILERS]
        return [_EMPTY_REQ_TRAILERS]

    def _body(self) -> bytes:
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        return body

    @property
    def routed(self) -> bool:
        """A routing decision was made (the request was not rejected before it)."""
        return self._routed

    async def _route(self, body: bytes, has_body: bool) -> Routing:
        routing = await self._director.route(self._headers, body, has_body, self._subset)
        self._routing = routing
        self._routed = True
        if self._max_headers:
            self._check_header_room(routing)
        return routing

    def _check_header_room(self, routing: Routing) -> None:
        """Envoy fails a request with a bare 500 when a header mutation leaves more headers
        than its listener's ``max_headers_count``: answer 431 instead, naming the cause.

        Envoy counts the headers it sent us, less ``content-length`` in full duplex (it
        strips it there; measured with Envoy 1.40: in FULL_DUPLEX_STREAMED 100 sent with a
        content-length + 1 added passes, in BUFFERED 100 + 1 fails)."""
        have = self._headers
        added = sum(1 for k in (keys.HEADER_DESTINATION, *routing.set_headers) if k not in have)
        if self.token is not None and keys.HEADER_OBSERVE_TOKEN not in have:
            added += 1
        if routing.body is not None and keys.HEADER_CONTENT_LENGTH not in have:
            added += 1
        removed = sum(1 for k in keys.ROUTING_HEADERS
                      if k in have and k != keys.HEADER_DESTINATION
                      and k not in routing.set_headers)
        self._check_header_count(added - removed)

    def _check_header_count(self, delta: int) -> None:
        count = self._header_count
        if self._duplex and keys.HEADER_CONTENT_LENGTH in self._headers:
            count -= 1
        if count + delta > self._max_headers:
            if not self._routed:
                self._director.on_rejected(self._headers, 431)
            raise EppError(
                f"the request has {count} headers; with the {max(delta, 0)} routing "
                "header(s) the endpoint picker adds it would exceed the gateway's limit of "
                f"{self._max_headers} (Envoy's max_headers_count; epp serve "
                "--max-request-headers)", status=431,
                error_type="request_header_fields_too_large")

    def _headers_response(self, routing: Routing,
                          content_length: int | None = None) -> pb.ProcessingResponse:
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=routing_mutation(routing, content_length, self.token),
                clear_route_cache=True)),
            dynamic_metadata=routing_metadata(routing.destination, routing.scores),
        )

    async def _route_duplex(self) -> Sequence[pb.ProcessingResponse]:
        body = self._body()
        routing = await self._route(body, has_body=True)
        out_body = body if routing.body is None else routing.body
        return [self._headers_response(routing), *_streamed_chunks(out_body, "request_body")]

    async def _route_buffered(self) -> Sequence[pb.ProcessingResponse]:
        body = self._body()
        routing = await self._route(body, has_body=True)
        common = pb.CommonResponse(clear_route_cache=True)
        if routing.body is not None:
            common.header_mutation.CopyFrom(routing_mutation(routing, len(routing.body),
                                                             self.token))
            common.body_mutation.body = routing.body
        else:
            common.header_mutation.CopyFrom(routing_mutation(routing, token=self.token))
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                      dynamic_metadata=routing_metadata(routing.destination, routing.scores))]

    # --- response path ---

    def _check_upstream(self, msg: pb.ProcessingRequest) -> None:
        """Envoy's attributes say the upstream could not be connected to (flag UF): tell
        the Director which endpoint, so it stops being picked before a scrape notices."""
        if self._routing is None:
            return
        attrs = msg.attributes.get(keys.ATTRIBUTES_NAMESPACE)
        if attrs is None:
            return
        flags = attrs.fields.get(keys.ATTRIBUTE_RESPONSE_FLAGS)
        if flags is None or not int(flags.number_value) & keys.RESPONSE_FLAG_UPSTREAM_CONNECTION_FAILURE:
            return
        upstream = attrs.fields.get(keys.ATTRIBUTE_UPSTREAM_ADDRESS)
        address = upstream.string_value if upstream is not None else ""
        self._director.on_upstream_failure(self._routing.context,
                                           address or self._routing.destination.split(",")[0])

    def _on_response_headers(self, h: pb.HttpHeaders) -> Sequence[pb.ProcessingResponse]:
        if self._routing is None:
            return [_RESP_HEADERS]
        headers = _headers_dict(h.headers)
        try:
            status = int(headers.get(keys.HEADER_STATUS, "0"))
        except ValueError:
            status = 0
        cl = headers.get(keys.HEADER_CONTENT_LENGTH)
        if cl is not None and cl.isdigit():
            self._resp_len = int(cl)
        self._resp_started = True
        extra = self._director.on_response_headers(self._routing.context, status, headers)
        if h.end_of_stream:
            self._report_done(aborted=False)
        if not extra:
            return [_with_metadata(_RESP_HEADERS, self.take_metadata())]
        sets = [_WENT_INTO_RESP_HEADERS]
        sets += [_set_header(k, v) for k, v in extra.items()]
        return [_with_metadata(pb.ProcessingResponse(response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=pb.HeaderMutation(
                set_headers=sets)))), self.take_metadata())]

    @property
    def lean(self) -> bool:
        """The gateway sends this stream no response body (lean shape)."""
        return self._lean

    @property
    def echoing(self) -> bool:
        """The response body is streaming in full duplex: chunks are echoed and may be
        coalesced (:meth:`echo_chunk`)."""
        return self._resp_duplex and self._resp_started and not self.closed

    def echo_chunk(self, b: pb.HttpBody) -> bytes:
        """Account one full-duplex response body chunk and return the bytes to pass on.

        Never raises: a failing Director callback passes the chunk on unchanged."""
        chunk: bytes = b.body
        self._resp_seen += len(chunk)
        if self._routing is not None:
            try:
                replaced = self._director.on_response_body(self._routing.context, chunk,
                                                           b.end_of_stream)
                if replaced is not None:
                    chunk = replaced
            except Exception:
                log.exception("ext_proc response body callback failed; passing it on")
        if b.end_of_stream:
            self._report_done(aborted=False)
        return chunk

    def _on_response_body(self, b: pb.HttpBody) -> Sequence[pb.ProcessingResponse]:
        chunk = b.body
        self._resp_seen += len(chunk)
        replaced = None
        if self._routing is not None:
            replaced = self._director.on_response_body(self._routing.context, chunk, b.end_of_stream)
        return self._response_body_reply(b, replaced)

    def _response_body_reply(self, b: pb.HttpBody,
                             replaced: bytes | None) -> Sequence[pb.ProcessingResponse]:
        """Pass a response body chunk on (echoed in full duplex), ``replaced`` if given;
        the last one carries the response's dynamic metadata, if any."""
        md = None
        if b.end_of_stream:
            self._report_done(aborted=False)
            md = self.take_metadata()
        if self._resp_duplex:
            return [echo_response(b.body if replaced is None else replaced, b.end_of_stream,
                                  md)]
        if replaced is None:
            return [_with_metadata(_CONTINUE_RESP_BODY, md)]
        return [_with_metadata(pb.ProcessingResponse(response_body=pb.BodyResponse(
            response=pb.CommonResponse(body_mutation=pb.BodyMutation(body=replaced)))), md)]

    def _passthrough(self, msg: pb.ProcessingRequest, kind: str | None) -> Sequence[pb.ProcessingResponse]:
        """After routing, a failing callback must not break the response: pass it on."""
        if kind == "response_body":
            return self._response_body_reply(msg.response_body, None)
        if kind == "response_headers":
            if msg.response_headers.end_of_stream:
                self._report_done(aborted=False)
            return [_with_metadata(_RESP_HEADERS, self.take_metadata())]
        if kind == "response_trailers":
            return [_with_metadata(_EMPTY_RESP_TRAILERS, self.take_metadata())]
        if kind == "request_trailers":
            return [_EMPTY_REQ_TRAILERS]
        return [_EMPTY_REQ_HEADERS]

    # --- endings ---

    def _reject(self, status: int, message: str, error_type: str) -> Sequence[pb.ProcessingResponse]:
        self.closed = True
        self._chunks = []
        if self._routed:
            self._report_done(aborted=True)
        return [immediate_response(status, message, error_type)]

    def _report_done(self, aborted: bool) -> None:
        if self._done_reported or self._routing is None:
            return
        self._done_reported = True
        self._aborted = aborted
        try:
            verdict = self._director.on_done(self._routing.context, aborted)
            if verdict is not None:
                self._aborted = verdict
        except Exception:
            log.exception("director on_done failed")
        # (On the split response path nothing can be sent back: not computed.)
        if self._response_metadata is not None and not self._aborted and self.token is None:
            try:
                self._metadata = _struct(self._response_metadata(self._routing.context))
            except Exception:
                log.exception("computing the response's dynamic metadata failed; none sent")

    @property
    def request_id(self) -> str:
        """The routed request's ``x-request-id`` (the client's, or the one the EPP set)."""
        rid = self._headers.get(keys.HEADER_REQUEST_ID)
        if not rid and self._routing is not None:
            rid = self._routing.set_headers.get(keys.HEADER_REQUEST_ID)
        return rid or ""

    def evict(self, reason: str) -> Sequence[pb.ProcessingResponse] | None:
        """Flow control evicted the routed request (llm-d's ``RequestEvicted`` state): the
        answer that ends it, or None when its response already completed (ignored)."""
        if self.closed or (self._done_reported and not self._aborted):
            return None
        log.info("request evicted by flow control", extra={"request_id": self.request_id})
        self.closed = True
        self._chunks = []
        self._report_done(aborted=True)
        return [evicted_response(reason)]

    def take_metadata(self) -> Struct | None:
        """The response's dynamic metadata, once (None: none, or sent already)."""
        md = self._metadata
        self._metadata = None
        return md

    def finish(self, clean: bool = False) -> str:
        """The gRPC stream ended; a routed request without a complete response was aborted.

        ``clean``: Envoy closed the stream normally (not a reset). Envoy sometimes closes
        it after the last response bytes without the final end-of-stream body message; a
        response whose declared content-length has fully passed through then counts as
        completed. (A client that goes away mid-response also ends the stream cleanly, so
        without a content-length a clean end cannot be told from an abort.)

        Returns the stream's outcome: ``rejected`` (an ImmediateResponse was sent),
        ``completed`` (the response ended) or ``aborted`` (the stream ended first).

        Lean gateway shape (response body not sent to the EPP): Envoy ends the stream when
        the HTTP request ends, so a routed request whose response headers passed is
        completed here — a client that leaves mid-response cannot be told apart (Envoy
        ends the stream the same way, measured with Envoy 1.40); one whose response never
        started is aborted.
        """
        if self._lean and self._resp_started and not self.closed:
            self._report_done(aborted=False)
        if (clean and not self.closed and not self._done_reported and self._resp_len is not None
                and self._resp_seen >= self._resp_len):
            self._report_done(aborted=False)
        self._report_done(aborted=True)
        if self.closed:
            return "rejected"
        return "aborted" if self._aborted or not self._done_reported else "completed"


def _struct(metadata: DynamicMetadata | None) -> Struct | None:
    if not metadata:
        return None
    md = Struct()
    md.update({ns: dict(fields) for ns, fields in metadata.items()})
    return md


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """Binds :class:`ExtProcStream` to grpc.aio bidirectional streams.

    Split response path: a stream whose gRPC metadata has ``x-epp-response-path:
    observer`` routes only; its request is tagged with a one-time token header, and the
    response arrives on another stream, from an ext_proc filter in observability mode
    (no replies: the response never waits for the EPP). That stream's first message (the
    request headers, token included) attaches it to the routed request; its response
    messages then drive the same state (usage, completion). If no observer stream
    attaches within ``observer_grace_s`` after the routing stream ended, the request
    counts as aborted (so in-flight counts never leak).

    ``observer_supported=False`` (the fronts of ``--workers N``, where the two streams
    of one request may reach different processes): split streams are served as if the
    routing stream were the whole request, with one warning.
    """

    def __init__(self, director: RequestDirector, max_body_bytes: int,
                 on_stream_end: Callable[[str], None] | None = None,
                 observer_grace_s: float = 5.0, observer_supported: bool = True,
                 max_headers: int = DEFAULT_MAX_HEADERS,
                 body_consumers: Sequence[str] = (),
                 response_metadata: ResponseMetadata | None = None,
                 evictions: EvictionLookup | None = None) -> None:
        """``evictions``: the in-flight eviction tracker (flowControl.enableEviction); a
        routed request it may evict is answered 429 when evicted. ``body_consumers``: names of configured plugins that need response bodies
        (``response_needs`` contains ``"body"``); the first lean-shape stream warns that
        the gateway cannot feed them. ``response_metadata``: see :class:`ExtProcStream`
        (not on the split response path: the observer stream cannot answer)."""
        self._director = director
        self._response_metadata = response_metadata
        self._evictions = evictions
        self._max_headers = max_headers
        self._body_consumers = tuple(body_consumers)
        self._lean_noted = False
        self._observer_supported = observer_supported
        self._max_body = max_body_bytes
        self._on_stream_end = on_stream_end
        self._observer_grace_s = observer_grace_s
        # token -> routed stream whose observer has not attached yet
        self._awaiting: dict[str, ExtProcStream] = {}
        self._warned_no_observer = False
        self._warned_dropped_headers = False
        self._warned_unsupported = False
        self._bad_messages = 0

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> None:
        # grpc.aio's read()/write() API, not the request iterator and a response generator:
        # _echo reads ahead while writing, which needs read() (the two APIs cannot be mixed
        # on one call); for a bare server envoy-notes.md measured it ~15 % cheaper, here the
        # difference was within noise (bench/extproc_messages.py).
        token = os.urandom(12).hex() if _split_requested(context) else None
        if token is not None and not self._observer_supported:
            token = None
            if not self._warned_unsupported:
                self._warned_unsupported = True
                log.warning("a gateway asks for the split response path (x-epp-response-path: "
                            "observer), which needs --workers 1: with several ext_proc "
                            "processes the response cannot be matched to its request, so "
                            "each request ends (as aborted) with its routing stream and "
                            "response usage is not counted")
        stream: ExtProcStream | None = ExtProcStream(self._director, self._max_body, token,
                                                     self._max_headers,
                                                     self._response_metadata)
        clean = False
        read, write, eof = context.read, context.write, grpc.aio.EOF
        evictions = self._evictions
        evicted: asyncio.Future[str] | None = None  # set once routed and evictable
        reading: asyncio.Future[Any] | None = None
        try:
            while True:
                if evicted is None and reading is None:
                    msg = await read()
                else:
                    if reading is None:
                        reading = asyncio.ensure_future(read())
                    if evicted is not None:
                        await asyncio.wait((reading, evicted),
                                           return_when=asyncio.FIRST_COMPLETED)
                    if evicted is not None and evicted.done():
                        assert stream is not None
                        ending = stream.evict(evicted.result())
                        evicted = None
                        if ending is None:
                            continue  # the response completed first
                        for resp in ending:
                            await write(resp)
                        return
                    msg = await reading
                    reading = None
                if msg is eof:
                    break
                if msg.observability_mode:
                    stream = None
                    await self._observe(msg, context)
                    return
                assert stream is not None
                out = await stream.handle(msg)
                if not self._lean_noted and stream.lean:
                    self._note_lean()
                if token is not None and stream.routed and not stream.closed:
                    self._awaiting[token] = stream  # before Envoy sees the routing answer
                    token = None
                for resp in out:
                    await write(resp)
                if stream.closed:
                    return
                if evictions is not None and evicted is None and stream.routed:
                    evicted = _eviction_future(evictions, stream.request_id)
                    if evicted is None:
                        evictions = None  # not evictable: nothing to listen for
                if stream.echoing:
                    clean = await _echo(stream, read, write, evicted)
                    return
            clean = True
        except DecodeError as e:
            await self._not_ext_proc(context, e)
        finally:
            if reading is not None:
                reading.cancel()
            if stream is not None:
                self._end(stream, clean)

    def _note_lean(self) -> None:
        """Say once what the lean gateway shape (no response bodies) turns off."""
        self._lean_noted = True
        log.info("the gateway sends no response bodies to the EPP (lean shape): per-request "
                 "token usage metrics and the model-name rewrite-back in responses are off "
                 "(docs/architecture.md, \"Gateway shapes\")")
        if self._body_consumers:
            log.warning("configured plugin(s) %s need response bodies, which this gateway "
                        "does not send (response_body_mode NONE): they will not see any; "
                        "configure GIE's shape (response_body_mode FULL_DUPLEX_STREAMED) "
                        "for them", ", ".join(self._body_consumers))

    async def _not_ext_proc(self, context: Any, error: DecodeError) -> None:
        """A message that is not a ProcessingRequest (not Envoy, or a broken peer): end the
        stream with INVALID_ARGUMENT and say so in one log line, never a traceback."""
        self._bad_messages += 1
        first = self._bad_messages == 1
        log.log(logging.WARNING if first else logging.DEBUG,
                "an ext_proc stream from %s sent a message that is not a ProcessingRequest "
                "(%s); ended with INVALID_ARGUMENT%s", context.peer(), error,
                " (further ones are logged at debug level)" if first else "")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            "message is not an envoy.service.ext_proc.v3.ProcessingRequest")

    def _end(self, stream: ExtProcStream, clean: bool) -> None:
        if stream.token is not None and stream.routed and not stream.closed:
            # Split path: the observer stream (attached or still to come) owns the end.
            if stream.token in self._awaiting:
                asyncio.get_running_loop().call_later(
                    self._observer_grace_s, self._observer_missing, stream.token)
            return
        self._outcome(stream.finish(clean))

    def _outcome(self, outcome: str) -> None:
        if self._on_stream_end is not None:
            self._on_stream_end(outcome)

    def _observer_missing(self, token: str) -> None:
        stream = self._awaiting.pop(token, None)
        if stream is None:
            return
        if not self._warned_no_observer:
            self._warned_no_observer = True
            log.warning("no response observer stream arrived within %.1fs of a routed "
                        "request (x-epp-response-path: observer): is the observability-mode "
                        "ext_proc filter configured after the routing one? Counting such "
                        "requests as aborted", self._observer_grace_s)
        self._outcome(stream.finish(False))

    async def _observe(self, first: pb.ProcessingRequest, context: Any) -> None:
        """An observability-mode stream: attach to the routed request by its token, feed
        it the response, end it. Nothing is sent back (Envoy expects nothing)."""
        target = None
        if first.WhichOneof("request") == "request_headers":
            for h in first.request_headers.headers.headers:
                if h.key == keys.HEADER_OBSERVE_TOKEN:
                    target = self._awaiting.pop(h.raw_value.decode("ascii", "replace") if
                                                h.raw_value else h.value, None)
                    break
        if target is None:
            # Not routed by this EPP (rejected, or routed by another replica): drain.
            while await context.read() is not grpc.aio.EOF:
                pass
            return
        clean = False
        try:
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    break
                kind = msg.WhichOneof("request")
                if kind not in _RESPONSE_KINDS:
                    continue
                out = await target.handle(msg)
                # (Beyond x-went-into-resp-headers, which every answer sets.)
                if kind == "response_headers" and not self._warned_dropped_headers and out \
                        and len(out[0].response_headers.response.header_mutation
                                .set_headers) > 1:
                    self._warned_dropped_headers = True
                    log.warning("response headers set by plugins (e.g. a session token, "
                                "x-epp-explain) cannot reach clients on the split response "
                                "path (the observer cannot change the response)")
            clean = True
        finally:
            self._outcome(target.finish(clean))


_RESPONSE_KINDS = frozenset({"response_headers", "response_body", "response_trailers"})


class EvictionLookup(Protocol):
    """The in-flight eviction tracker as the streams see it (llm-d's
    ``EvictChannelLookup``; epp/flowcontrol/eviction.py ``RequestEvictor``)."""

    def signal(self, request_id: str) -> Any:
        """The request's eviction signal (``subscribe(callback(reason))``), or None when
        it cannot be evicted."""
        ...


_EVICTED = object()  # the echo loop's marker: the request was evicted


def _eviction_future(evictions: EvictionLookup, request_id: str) -> asyncio.Future[str] | None:
    signal = evictions.signal(request_id) if request_id else None
    if signal is None:
        return None
    fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def fired(reason: str) -> None:
        if not fut.done():
            fut.set_result(reason)

    signal.subscribe(fired)
    return fut


async def _echo(stream: ExtProcStream, read: Callable[[], Any],
                write: Callable[[pb.ProcessingResponse], Any],
                evicted: asyncio.Future[str] | None = None) -> bool:
    """Serve the rest of a stream whose response body streams in full duplex (GIE's
    shape), coalescing chunks that are already queued into one answer.

    A reader task reads ahead while an answer is being written; each answer carries every
    chunk that arrived meanwhile. The first chunk is never held back (it is answered as
    soon as it is read), and a backlog — the EPP or the machine busy, tokens arriving
    faster than answers go out — costs one write instead of one per chunk: writes are
    most of grpc.aio's cost per message (bench/extproc_messages.py, docs/benchmarks.md).
    Envoy accepts a full-duplex body back in any chunking. Anything other than a body
    chunk (trailers) takes the ordinary path, in order. Returns True when the stream ended
    cleanly (EOF); raises what the reader raised (e.g. a DecodeError).
    """
    loop = asyncio.get_running_loop()
    queue: deque[Any] = deque()
    waiter: list[asyncio.Future[None] | None] = [None]
    eof = grpc.aio.EOF

    def wake() -> None:
        w = waiter[0]
        if w is not None and not w.done():
            w.set_result(None)

    async def reader() -> None:
        try:
            while True:
                m = await read()
                queue.append(m)
                wake()
                if m is eof:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- handed to the writer, which raises it
            queue.append(e)
            wake()

    task = loop.create_task(reader())
    if evicted is not None:
        def on_evicted(_: asyncio.Future[str]) -> None:
            queue.append(_EVICTED)
            wake()

        evicted.add_done_callback(on_evicted)
    try:
        while True:
            if not queue:
                w = waiter[0] = loop.create_future()
                await w
                waiter[0] = None
            # The body chunks at the head of the queue go back as one answer ...
            parts: list[bytes] = []
            last = False
            while queue and not last:
                m = queue[0]
                if m is eof or m is _EVICTED or isinstance(m, BaseException) \
                        or m.WhichOneof("request") != "response_body":
                    break
                queue.popleft()
                b = m.response_body
                parts.append(stream.echo_chunk(b))
                last = b.end_of_stream
            if parts:
                await write(echo_response(parts[0] if len(parts) == 1 else b"".join(parts),
                                          last, stream.take_metadata() if last else None))
            if not queue:
                continue
            # ... then anything else (trailers, the end, an error), in order.
            m = queue.popleft()
            if m is eof:
                return True
            if m is _EVICTED:
                assert evicted is not None
                ending = stream.evict(evicted.result())
                if ending is None:
                    continue  # the response completed first
                for resp in ending:
                    await write(resp)
                return False
            if isinstance(m, BaseException):
                raise m
            for resp in await stream.handle(m):
                await write(resp)
            if stream.closed:
                return False
    finally:
        task.cancel()


def _split_requested(context: Any) -> bool:
    for key, value in context.invocation_metadata() or ():
        if key == keys.GRPC_MD_RESPONSE_PATH:
            return bool(value == keys.RESPONSE_PATH_OBSERVER)
    return False
