"""Vertex AI's gRPC prediction API (llm-d-router's ``vertexai-parser``).

Vertex AI wraps OpenAI-compatible JSON in protobuf: ``PredictionService/ChatCompletions``
(``ChatCompletionsRequest``), ``…/StreamRawPredict`` (``StreamRawPredictRequest``) and
``…/RawPredict`` (``RawPredictRequest``) each carry a ``google.api.HttpBody`` whose
``data`` is the JSON. The request is one gRPC frame; its JSON is read as the
openai-parser reads ``/v1/chat/completions`` (ChatCompletions) or ``/v1/responses``
(the raw-predict methods) bodies, and the request is forwarded byte for byte. Other
methods are not read (passed through, responses not parsed). Responses: each gRPC frame
is an ``HttpBody`` whose ``data`` holds OpenAI-shaped JSON (or SSE events) with a
``usage`` object.

The messages are defined here (in a private descriptor pool) with only the fields the
parser reads: ``endpoint`` = 1 and ``http_body`` = 2 of the three requests, ``content_type``
= 1 and ``data`` = 2 of ``HttpBody`` (other fields are kept as unknown fields).

Followed: llm-d-router v0.10.0
pkg/epp/framework/plugins/requesthandling/parsers/vertexai/vertexai.go (README,
vertexai_test.go); google/cloud/aiplatform/v1beta1/prediction_service.proto and
google/api/httpbody.proto for the field numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import orjson
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from epp.errors import BadRequest
from epp.parsing.request import (
    PATH_CHAT_COMPLETIONS,
    PATH_RESPONSES,
    ParsedRequest,
    parse_request_body,
)
from epp.parsing.usage import Usage, UsageParser
from epp.parsing.vllm_grpc import FRAME_HEADER_BYTES, unframe
from epp.parsing.vllm_http import request_path
from epp.scheduling.types import ApiType

CHAT_COMPLETIONS_METHOD: Final = "PredictionService/ChatCompletions"
STREAM_RAW_PREDICT_METHOD: Final = "PredictionService/StreamRawPredict"
RAW_PREDICT_METHOD: Final = "PredictionService/RawPredict"
# method suffix -> (request message, the OpenAI path its JSON is read as)
_METHODS: Final = (
    (CHAT_COMPLETIONS_METHOD, "ChatCompletionsRequest", PATH_CHAT_COMPLETIONS),
    (STREAM_RAW_PREDICT_METHOD, "StreamRawPredictRequest", PATH_RESPONSES),
    (RAW_PREDICT_METHOD, "RawPredictRequest", PATH_RESPONSES),
)
# Stands in for a missing ``model`` while the JSON is validated (Vertex names the model
# in the endpoint, not the body); never reaches the ParsedRequest.
_NO_MODEL: Final = "\x00vertexai-no-model"

_F = descriptor_pb2.FieldDescriptorProto


def _build() -> dict[str, type[Message]]:
    fd = descriptor_pb2.FileDescriptorProto(name="epp_vertexai.proto", package="epp.vertexai",
                                            syntax="proto3")
    body = fd.message_type.add(name="HttpBody")
    body.field.add(name="content_type", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    body.field.add(name="data", number=2, type=_F.TYPE_BYTES, label=_F.LABEL_OPTIONAL)
    for _, name, _ in _METHODS:
        msg = fd.message_type.add(name=name)
        msg.field.add(name="endpoint", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
        msg.field.add(name="http_body", number=2, type=_F.TYPE_MESSAGE,
                      label=_F.LABEL_OPTIONAL, type_name=".epp.vertexai.HttpBody")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return {m.name: message_factory.GetMessageClass(
        pool.FindMessageTypeByName(f"epp.vertexai.{m.name}")) for m in fd.message_type}


MESSAGES: Final = _build()


def method_of(headers: Mapping[str, str]) -> tuple[str, str] | None:
    """(request message name, OpenAI path) of the Vertex method the request calls, or
    None for any other path."""
    path = request_path(headers)
    for suffix, name, target in _METHODS:
        if path.endswith(suffix):
            return name, target
    return None


def _decode(payload: bytes, name: str) -> Any:
    msg = MESSAGES[name]()
    try:
        msg.ParseFromString(payload)
    except DecodeError as e:
        raise ValueError(f"unmarshaling {name}: {e}") from None
    return msg


def parse_vertex_request(headers: Mapping[str, str], body: bytes) -> ParsedRequest:
    """Parse a Vertex AI request (see the module docstring). Raises :class:`BadRequest`
    (400) naming the problem: ``invalid or unsupported gRPC payload`` (no complete frame,
    or a compressed one), ``unmarshaling <Message>`` (not that protobuf message),
    ``<Message> has no HttpBody``, ``parsing <Message>: …`` (the JSON inside is not a
    valid OpenAI body). ``model`` is optional."""
    method = method_of(headers)
    if method is None:
        return ParsedRequest(api=ApiType.OTHER, model="", prompt="", stream=False,
                             max_tokens=None, cache_salt=None, user=None, data=None)
    name, target = method
    try:
        payload, compressed = unframe(body)
    except ValueError as e:
        raise BadRequest(f"invalid or unsupported gRPC payload: {e}") from None
    if compressed:
        raise BadRequest("invalid or unsupported gRPC payload: compressed messages are "
                         "not supported")
    try:
        msg = _decode(payload, name)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    if not msg.HasField("http_body"):
        raise BadRequest(f"{name} has no HttpBody")
    data: bytes = msg.http_body.data
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"parsing {name}: request body is not valid JSON: {e}") from None
    placeholder = isinstance(obj, dict) and "model" not in obj
    if placeholder:
        obj["model"] = _NO_MODEL
        data = orjson.dumps(obj)
    try:
        parsed = parse_request_body(target, data)
    except BadRequest as e:
        raise BadRequest(f"parsing {name}: {e}") from None
    if placeholder:
        parsed.model = ""
    parsed.data = None  # the protobuf is forwarded as received
    return parsed


class VertexUsageParser:
    """Usage of a Vertex AI response, fed chunk by chunk: every complete gRPC frame is an
    ``HttpBody`` whose ``data`` is read as the openai-parser reads a response (JSON, or
    SSE events when it starts with ``data:``/``event:``); the last usage seen wins.
    Compressed, undecodable and over-long (``max_frame_bytes``) frames are skipped; never
    raises."""

    __slots__ = ("_buf", "_finished", "_last", "_max", "_skip")

    def __init__(self, max_frame_bytes: int = 8 << 20) -> None:
        self._max = max_frame_bytes
        self._buf = bytearray()
        self._skip = 0
        self._last: Usage | None = None
        self._finished = False

    def feed(self, chunk: bytes) -> None:
        if self._finished or not chunk:
            return
        if self._skip:
            if len(chunk) <= self._skip:
                self._skip -= len(chunk)
                return
            chunk = chunk[self._skip:]
            self._skip = 0
        buf = self._buf
        buf += chunk
        while len(buf) >= FRAME_HEADER_BYTES:
            length = int.from_bytes(buf[1:5], "big")
            end = FRAME_HEADER_BYTES + length
            if length > self._max:
                if len(buf) >= end:
                    del buf[:end]
                    continue
                self._skip = end - len(buf)
                buf.clear()
                return
            if len(buf) < end:
                return
            compressed = buf[0] == 1
            payload = bytes(buf[FRAME_HEADER_BYTES:end])
            del buf[:end]
            if not compressed:
                found = usage_of_frame(payload)
                if found is not None:
                    self._last = found

    def finish(self) -> Usage | None:
        self._finished = True
        self._buf.clear()
        return self._last


def usage_of_frame(payload: bytes) -> Usage | None:
    """The usage in one response frame's ``HttpBody.data`` (None: none, or not an
    HttpBody)."""
    try:
        msg = _decode(payload, "HttpBody")
    except ValueError:
        return None
    data: bytes = msg.data
    stripped = data.lstrip()
    parser = UsageParser(sse=stripped.startswith((b"data:", b"event:")))
    parser.feed(data)
    return parser.finish()
