"""vLLM's gRPC engine API: message types, gRPC framing, request and usage parsing.

The messages are those of ``vllm_engine.proto`` (package ``vllm.grpc.engine``) as GIE
v1.5.0 ships it (pkg/epp/framework/plugins/requesthandling/parsers/vllmgrpc/api/proto/
vllm_engine.proto): the request and response messages of the ``Generate`` and ``Embed``
methods and the types they use, field for field (names, numbers, types, ``optional``,
``oneof``, the ``logit_bias`` map). They are built at import time from a
``FileDescriptorProto`` written out below, in a private descriptor pool, so there is no
generated module to keep in step with the protobuf runtime; the management messages
(health check, abort, model and server info) are left out, the EPP never sees them.

A gRPC request or response body is a sequence of frames: a 1-byte compression flag (1 =
compressed), a 4-byte big-endian message length, the serialised message. A unary request
is one frame.

Parsing never changes the body: the EPP forwards the bytes it received.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from epp.errors import BadRequest
from epp.parsing.request import ParsedRequest
from epp.parsing.usage import Usage
from epp.scheduling.types import ApiType

PACKAGE: Final = "vllm.grpc.engine"
# The gRPC method paths (``:path``) the vllmgrpc-parser routes.
GENERATE_PATH: Final = "/vllm.grpc.engine.VllmEngine/Generate"
EMBED_PATH: Final = "/vllm.grpc.engine.VllmEngine/Embed"
FRAME_HEADER_BYTES: Final = 5

_F = descriptor_pb2.FieldDescriptorProto
# (name, number, type, repeated, message type name or "", oneof name or "", proto3 optional)
_Field = tuple[str, int, int, bool, str, str, bool]


def _field(name: str, number: int, ftype: int, *, repeated: bool = False, message: str = "",
           oneof: str = "", optional: bool = False) -> _Field:
    return (name, number, ftype, repeated, message, oneof, optional)


_FLOAT, _DOUBLE, _UINT32, _INT32 = _F.TYPE_FLOAT, _F.TYPE_DOUBLE, _F.TYPE_UINT32, _F.TYPE_INT32
_STRING, _BOOL, _MESSAGE = _F.TYPE_STRING, _F.TYPE_BOOL, _F.TYPE_MESSAGE

# message name -> fields, in the order of vllm_engine.proto.
_MESSAGES: Final[dict[str, list[_Field]]] = {
    "SamplingParams": [
        _field("temperature", 1, _FLOAT, optional=True),
        _field("top_p", 2, _FLOAT),
        _field("top_k", 3, _UINT32),
        _field("min_p", 4, _FLOAT),
        _field("frequency_penalty", 5, _FLOAT),
        _field("presence_penalty", 6, _FLOAT),
        _field("repetition_penalty", 7, _FLOAT),
        _field("max_tokens", 8, _UINT32, optional=True),
        _field("min_tokens", 9, _UINT32),
        _field("stop", 10, _STRING, repeated=True),
        _field("stop_token_ids", 11, _UINT32, repeated=True),
        _field("skip_special_tokens", 12, _BOOL),
        _field("spaces_between_special_tokens", 13, _BOOL),
        _field("ignore_eos", 14, _BOOL),
        _field("n", 15, _UINT32),
        _field("logprobs", 22, _INT32, optional=True),
        _field("prompt_logprobs", 23, _INT32, optional=True),
        _field("seed", 24, _INT32, optional=True),
        _field("include_stop_str_in_output", 25, _BOOL),
        _field("logit_bias", 26, _MESSAGE, repeated=True,
               message="SamplingParams.LogitBiasEntry"),
        _field("truncate_prompt_tokens", 27, _INT32, optional=True),
        _field("json_schema", 16, _STRING, oneof="constraint"),
        _field("regex", 17, _STRING, oneof="constraint"),
        _field("grammar", 18, _STRING, oneof="constraint"),
        _field("structural_tag", 19, _STRING, oneof="constraint"),
        _field("json_object", 20, _BOOL, oneof="constraint"),
        _field("choice", 21, _MESSAGE, message="ChoiceConstraint", oneof="constraint"),
    ],
    "ChoiceConstraint": [_field("choices", 1, _STRING, repeated=True)],
    "TokenizedInput": [
        _field("original_text", 1, _STRING),
        _field("input_ids", 2, _UINT32, repeated=True),
    ],
    "GenerateRequest": [
        _field("request_id", 1, _STRING),
        _field("tokenized", 2, _MESSAGE, message="TokenizedInput", oneof="input"),
        _field("text", 3, _STRING, oneof="input"),
        _field("sampling_params", 4, _MESSAGE, message="SamplingParams"),
        _field("stream", 5, _BOOL),
    ],
    "GenerateResponse": [
        _field("chunk", 1, _MESSAGE, message="GenerateStreamChunk", oneof="response"),
        _field("complete", 2, _MESSAGE, message="GenerateComplete", oneof="response"),
    ],
    "GenerateStreamChunk": [
        _field("token_ids", 1, _UINT32, repeated=True),
        _field("prompt_tokens", 2, _UINT32),
        _field("completion_tokens", 3, _UINT32),
        _field("cached_tokens", 4, _UINT32),
    ],
    "GenerateComplete": [
        _field("output_ids", 1, _UINT32, repeated=True),
        _field("finish_reason", 2, _STRING),
        _field("prompt_tokens", 3, _UINT32),
        _field("completion_tokens", 4, _UINT32),
        _field("cached_tokens", 5, _UINT32),
    ],
    "EmbedRequest": [
        _field("request_id", 1, _STRING),
        _field("tokenized", 2, _MESSAGE, message="TokenizedInput"),
    ],
    "EmbedResponse": [
        _field("embedding", 1, _FLOAT, repeated=True),
        _field("prompt_tokens", 2, _UINT32),
        _field("embedding_dim", 3, _UINT32),
    ],
}


def _add_fields(msg: descriptor_pb2.DescriptorProto, fields: list[_Field]) -> None:
    # protoc's layout: real oneofs first (in order of appearance), then one synthetic
    # oneof per proto3 ``optional`` field.
    oneofs: list[str] = []
    for f in fields:
        if f[5] and f[5] not in oneofs:
            oneofs.append(f[5])
    synthetic = ["_" + f[0] for f in fields if f[6]]
    for name in oneofs + synthetic:
        msg.oneof_decl.add(name=name)
    for name, number, ftype, repeated, message, oneof, optional in fields:
        fd = msg.field.add(name=name, number=number, type=ftype, json_name=_json_name(name),
                           label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
        if message:
            fd.type_name = f".{PACKAGE}.{message}"
        if oneof:
            fd.oneof_index = oneofs.index(oneof)
        if optional:
            fd.proto3_optional = True
            fd.oneof_index = len(oneofs) + synthetic.index("_" + name)


def _json_name(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.capitalize() for p in rest)


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(name="vllm_engine.proto", package=PACKAGE,
                                             syntax="proto3")
    for name, fields in _MESSAGES.items():
        msg = fdp.message_type.add(name=name)
        _add_fields(msg, fields)
        if name == "SamplingParams":
            entry = msg.nested_type.add(name="LogitBiasEntry")
            entry.options.map_entry = True
            _add_fields(entry, [_field("key", 1, _INT32), _field("value", 2, _FLOAT)])
    return fdp


_POOL: Final = descriptor_pool.DescriptorPool()
_POOL.Add(_file_descriptor())


def message_class(name: str) -> type[Message]:
    """The class of the message ``name`` (e.g. ``GenerateRequest``)."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


GenerateRequest: Final = message_class("GenerateRequest")
GenerateResponse: Final = message_class("GenerateResponse")
EmbedRequest: Final = message_class("EmbedRequest")
EmbedResponse: Final = message_class("EmbedResponse")
TokenizedInput: Final = message_class("TokenizedInput")
SamplingParams: Final = message_class("SamplingParams")


# --- framing ------------------------------------------------------------------------


def frame(message: bytes, compressed: bool = False) -> bytes:
    """One gRPC frame around a serialised message."""
    return bytes([1 if compressed else 0]) + len(message).to_bytes(4, "big") + message


def unframe(data: bytes) -> tuple[bytes, bool]:
    """The first message of a gRPC body and whether it is compressed.

    Raises ValueError when ``data`` is shorter than a frame header or than the length
    the header declares. Bytes after the first frame are ignored (as GIE does).
    """
    if len(data) < FRAME_HEADER_BYTES:
        raise ValueError(f"invalid gRPC frame: expected at least {FRAME_HEADER_BYTES} bytes "
                         f"for the header, got {len(data)}")
    length = int.from_bytes(data[1:5], "big")
    if len(data) < FRAME_HEADER_BYTES + length:
        raise ValueError(f"incomplete gRPC payload: the header declares {length} bytes, "
                         f"{len(data) - FRAME_HEADER_BYTES} follow")
    return data[FRAME_HEADER_BYTES:FRAME_HEADER_BYTES + length], data[0] == 1


def _decode(body: bytes, cls: type[Message]) -> Any:
    """The first framed message of ``body`` as ``cls`` (ValueError naming the problem)."""
    try:
        payload, compressed = unframe(body)
    except ValueError as e:
        raise ValueError(f"not able to parse payload ({e})") from None
    if compressed:
        raise ValueError("compressed vllmgrpc payload is not supported")
    msg = cls()
    try:
        msg.ParseFromString(payload)
    except DecodeError as e:
        raise ValueError(f"not a valid {cls.DESCRIPTOR.name} message: {e}") from None
    return msg


# --- requests -----------------------------------------------------------------------


def _tokenized_prompt(tokenized: Any) -> str:
    """A TokenizedInput's prompt: its ``original_text`` (what GIE uses); when that is
    empty, its token ids rendered as the openai-parser renders token-id prompts (space
    separated), so prefix affinity still works for clients that send ids only."""
    text: str = tokenized.original_text
    if text:
        return text
    return " ".join(map(str, tokenized.input_ids))


def parse_grpc_request(headers: Mapping[str, str], body: bytes) -> ParsedRequest:
    """Parse a vLLM gRPC ``Generate`` or ``Embed`` request (GIE's vllmgrpc-parser).

    The method comes from ``:path``; any other path, a body that is not one framed
    message of the method's request type, a compressed frame, a ``GenerateRequest``
    without ``text`` or ``tokenized`` input, or an ``EmbedRequest`` without
    ``tokenized`` raises :class:`BadRequest` (400). The result has no model (the proto
    carries none: the ``x-gateway-model-name-rewrite`` header may name one), the prompt
    (``text`` or ``tokenized.original_text``), ``stream`` and
    ``sampling_params.max_tokens``, and no JSON data (the body is never rewritten).
    """
    path = headers.get(":path", "")
    if path == GENERATE_PATH:
        try:
            req = _decode(body, GenerateRequest)
        except ValueError as e:
            raise BadRequest(f"parsing gRPC payload for Generate: {e}") from None
        kind = req.WhichOneof("input")
        if kind == "text":
            prompt: str = req.text
        elif kind == "tokenized":
            prompt = _tokenized_prompt(req.tokenized)
        else:
            raise BadRequest("parsing gRPC payload for Generate: not supported request "
                             "inputType (the GenerateRequest has neither text nor tokenized "
                             "input)")
        sp = req.sampling_params
        max_tokens = sp.max_tokens if req.HasField("sampling_params") and \
            sp.HasField("max_tokens") else None
        return ParsedRequest(api=ApiType.COMPLETIONS, model="", prompt=prompt,
                             stream=bool(req.stream), max_tokens=max_tokens, cache_salt=None,
                             user=None, data=None)
    if path == EMBED_PATH:
        try:
            req = _decode(body, EmbedRequest)
        except ValueError as e:
            raise BadRequest(f"parsing gRPC payload for Embed: {e}") from None
        if not req.HasField("tokenized"):
            raise BadRequest("parsing gRPC payload for Embed: missing tokenized input in "
                             "EmbedRequest")
        return ParsedRequest(api=ApiType.EMBEDDINGS, model="",
                             prompt=_tokenized_prompt(req.tokenized), stream=False,
                             max_tokens=None, cache_salt=None, user=None, data=None)
    raise BadRequest(f"unsupported gRPC path: {path} (the vllmgrpc-parser routes "
                     f"{GENERATE_PATH} and {EMBED_PATH})")


# --- responses ----------------------------------------------------------------------


def _usage(prompt: int, completion: int, cached: int) -> Usage | None:
    """GIE: a chunk or completion reports usage only when it has prompt or completion
    tokens (streaming chunks carry none until the last)."""
    if prompt > 0 or completion > 0:
        return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
    return None


def generate_usage(payload: bytes) -> Usage | None:
    """Usage from one serialised ``GenerateResponse`` (ValueError if it is not one)."""
    resp: Any = GenerateResponse()
    try:
        resp.ParseFromString(payload)
    except DecodeError as e:
        raise ValueError(f"not a GenerateResponse: {e}") from None
    kind = resp.WhichOneof("response")
    if kind is None:
        raise ValueError("unrecognized response type in GenerateResponse")
    part = resp.chunk if kind == "chunk" else resp.complete
    return _usage(part.prompt_tokens, part.completion_tokens, part.cached_tokens)


def embed_usage(payload: bytes) -> Usage | None:
    """Usage from one serialised ``EmbedResponse`` (ValueError if it is not one)."""
    resp: Any = EmbedResponse()
    try:
        resp.ParseFromString(payload)
    except DecodeError as e:
        raise ValueError(f"not an EmbedResponse: {e}") from None
    if resp.prompt_tokens > 0:
        return Usage(prompt_tokens=resp.prompt_tokens, completion_tokens=0, cached_tokens=None)
    return None


def any_usage(payload: bytes) -> Usage | None:
    """GIE's order when the method is unknown: a ``GenerateResponse`` with a response set,
    else an ``EmbedResponse`` with an embedding or prompt tokens."""
    try:
        return generate_usage(payload)
    except ValueError:
        pass
    resp: Any = EmbedResponse()
    try:
        resp.ParseFromString(payload)
    except DecodeError:
        raise ValueError("not a GenerateResponse or EmbedResponse") from None
    if len(resp.embedding) > 0 or resp.prompt_tokens > 0:
        return embed_usage(payload)
    raise ValueError("not a GenerateResponse or EmbedResponse")


class GrpcUsageParser:
    """Reads token usage from a vLLM gRPC response body fed chunk by chunk.

    Frames may span chunks and a chunk may hold several; every complete frame is decoded
    as the method's response type (``GenerateResponse`` for Generate, ``EmbedResponse``
    for Embed, either for an unknown method) and the last usage seen wins (a streamed
    Generate reports it in its last message). Compressed frames, frames that do not
    decode and frames longer than ``max_frame_bytes`` are skipped; it never raises.
    """

    __slots__ = ("_buf", "_decode", "_finished", "_last", "_max", "_skip")

    def __init__(self, request_path: str, max_frame_bytes: int = 8 << 20) -> None:
        self._decode = (generate_usage if request_path == GENERATE_PATH
                        else embed_usage if request_path == EMBED_PATH else any_usage)
        self._max = max_frame_bytes
        self._buf = bytearray()
        self._skip = 0  # bytes of an over-long frame still to drop
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
            if length > self._max:
                dropped = len(buf) - FRAME_HEADER_BYTES
                if dropped >= length:
                    del buf[:FRAME_HEADER_BYTES + length]
                    continue
                self._skip = length - dropped
                buf.clear()
                return
            end = FRAME_HEADER_BYTES + length
            if len(buf) < end:
                return
            compressed = buf[0] == 1
            payload = bytes(buf[FRAME_HEADER_BYTES:end])
            del buf[:end]
            if compressed:
                continue
            try:
                found = self._decode(payload)
            except ValueError:
                continue
            if found is not None:
                self._last = found

    def finish(self) -> Usage | None:
        self._finished = True
        self._buf.clear()
        return self._last
