"""Parse and validate OpenAI-compatible request bodies (design.md §3).

The body is decoded exactly once (``orjson.loads``); everything else works on the decoded
object. A malformed body raises :class:`epp.errors.BadRequest` (HTTP 400) whose message
names the offending field, e.g. ``'messages[2].role' must be a string``.

The ``prompt`` of a :class:`ParsedRequest` is the text the model sees, as far as the EPP can
tell without the model's tokenizer or chat template. It only feeds prefix-cache affinity
(hashing), so it has to be deterministic and has to differ wherever the model's input
differs; it does not have to match the server's rendering byte for byte:

- completions / embeddings: a string as is; a list of strings joined with ``"\\n"``; token
  ids as ``" ".join(str(id))``; a list of token-id lists rendered like that, joined with
  ``"\\n"``.
- chat: ``tools`` (when present) first as ``"<|tools|>\\n" + json + "\\n"``, then **every**
  message in order as ``"<|" + role + "|>\\n" + content_text + "\\n"``. A ``name`` goes
  right after the role line as ``"<|name|>" + name + "\\n"``; ``tool_calls`` /
  ``function_call`` / ``tool_call_id`` go after the content as ``"<|tool_calls|>" + json +
  "\\n"`` (and likewise). ``content_text`` of a list of parts concatenates text parts'
  ``text``; any other part renders as ``"<|" + type + "|>" + payload`` where payload is
  the part's URL (``image_url.url`` and the like) or else the whole part as JSON with
  sorted keys, so different images give different prompts.
- responses: ``instructions`` first as a system message, then ``input`` (a string is one
  user message; list items with a ``role`` render like chat messages, other items such as
  ``function_call`` as ``"<|" + type + "|>\\n" + json + "\\n"``).
- other paths: ``""``.

JSON rendered into prompts always uses ``orjson.OPT_SORT_KEYS``. Building is linear in
the body size (parts are collected in a list and joined once).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import orjson

from epp.errors import BadRequest
from epp.scheduling.types import ApiType

# OpenAI API paths. Kept here rather than in epp.keys: they select a parser, they are not
# keys the EPP reads from or writes to another system's data.
PATH_COMPLETIONS: Final = "/v1/completions"
PATH_CHAT_COMPLETIONS: Final = "/v1/chat/completions"
PATH_EMBEDDINGS: Final = "/v1/embeddings"
PATH_RESPONSES: Final = "/v1/responses"

_API_BY_PATH: Final[Mapping[str, ApiType]] = MappingProxyType(
    {
        PATH_COMPLETIONS: ApiType.COMPLETIONS,
        PATH_CHAT_COMPLETIONS: ApiType.CHAT_COMPLETIONS,
        PATH_EMBEDDINGS: ApiType.EMBEDDINGS,
        PATH_RESPONSES: ApiType.RESPONSES,
    }
)

# Content-part types whose ``text`` is plain prompt text (chat uses "text"; the Responses
# API uses "input_text" for user input and "output_text" for earlier assistant output).
_TEXT_PART_TYPES: Final = frozenset({"text", "input_text", "output_text"})

_PROMPT_SHAPES: Final = (
    "a string, a list of strings, a list of token ids or a list of lists of token ids"
)


@dataclass(slots=True)
class ParsedRequest:
    """A validated request body.

    ``prompt`` is the prompt text for prefix-cache hashing (see the module docstring);
    ``max_tokens`` is the output-token limit the client asked for (chat:
    ``max_completion_tokens`` preferred over ``max_tokens``; responses:
    ``max_output_tokens``); ``data`` is the decoded JSON object itself, kept so a model
    rewrite can re-serialise it without decoding again — None when the body is not a JSON
    object the EPP may rewrite (the vllmgrpc- and passthrough-parser's requests, which are
    forwarded byte for byte).
    """

    api: ApiType
    model: str
    prompt: str
    stream: bool
    max_tokens: int | None
    cache_salt: str | None
    user: str | None
    data: dict[str, Any] | None


def api_type_for_path(path: str) -> ApiType:
    """The API a request path addresses.

    The query string (``?…``) and fragment are ignored, as is one trailing ``/``. Unknown
    paths give :attr:`ApiType.OTHER`. Never raises.
    """
    cut = len(path)
    for sep in ("?", "#"):
        i = path.find(sep)
        if i != -1 and i < cut:
            cut = i
    p = path[:cut]
    if len(p) > 1 and p.endswith("/"):
        p = p[:-1]
    return _API_BY_PATH.get(p, ApiType.OTHER)


def parse_request_body(path: str, body: bytes | bytearray | memoryview) -> ParsedRequest:
    """Decode ``body`` once, validate it for the API ``path`` selects, and build the prompt.

    Raises :class:`BadRequest` (status 400) when the body is not JSON, is not a JSON
    object, lacks a non-empty string ``model``, or has the wrong shape for its API (see
    the module docstring for the accepted shapes). Optional fields that are JSON ``null``
    count as absent. For :attr:`ApiType.OTHER` only ``model`` is required; ``stream``,
    ``max_tokens``, ``cache_salt`` and ``user`` are read when they have the right type and
    ignored otherwise, and the prompt is ``""``.
    """
    api = api_type_for_path(path)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest(
            f"request body must be a JSON object, got {_json_type(data)}"
        )
    model = data.get("model")
    if model is None:
        raise BadRequest("'model' is required")
    if not isinstance(model, str):
        raise BadRequest(f"'model' must be a string, got {_json_type(model)}")
    if not model:
        raise BadRequest("'model' must not be empty")

    if api is ApiType.OTHER:
        return _parse_other(model, data)

    stream = _opt_bool(data, "stream")
    if stream is None:
        stream = False
    so = data.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest(f"'stream_options' must be an object, got {_json_type(so)}")
    cache_salt = _opt_str(data, "cache_salt")
    user = _opt_str(data, "user")

    max_tokens: int | None
    if api is ApiType.COMPLETIONS:
        prompt = _render_prompt_input(data, "prompt")
        max_tokens = _opt_count(data, "max_tokens")
    elif api is ApiType.CHAT_COMPLETIONS:
        prompt = _render_chat(data)
        mct = _opt_count(data, "max_completion_tokens")
        mt = _opt_count(data, "max_tokens")
        max_tokens = mct if mct is not None else mt
    elif api is ApiType.EMBEDDINGS:
        if data.get("input") is None and data.get("messages") is not None:
            # vLLM's chat-style embeddings request: messages instead of input.
            prompt = _render_chat(data)
        else:
            prompt = _render_prompt_input(data, "input")
        max_tokens = None
    else:  # ApiType.RESPONSES
        prompt = _render_responses(data)
        max_tokens = _opt_count(data, "max_output_tokens")

    return ParsedRequest(
        api=api,
        model=model,
        prompt=prompt,
        stream=stream,
        max_tokens=max_tokens,
        cache_salt=cache_salt,
        user=user,
        data=data,
    )


def rewrite_model(data: dict[str, Any], new_model: str) -> bytes:
    """Set ``data["model"] = new_model`` (mutating ``data``) and return the JSON bytes.

    ``data`` is a :attr:`ParsedRequest.data`; the result is the new request body (the
    caller sets ``content-length`` from its length).
    """
    data["model"] = new_model
    try:
        return orjson.dumps(data)
    except orjson.JSONEncodeError:
        # Nested deeper than orjson serialises (254 levels; it parses up to 1,024).
        return dumps_any_depth(data)


_END: Final = object()


def dumps_any_depth(value: Any, sort_keys: bool = False) -> bytes:
    """Serialise a decoded JSON value of any nesting depth, without recursion.

    The fallback for values orjson refuses to serialise for depth alone (it parses up
    to 1,024 levels but serialises only 254; the standard library stops near Python's
    recursion limit). Scalars go through orjson, so the output matches
    ``orjson.dumps(value)`` (with ``sort_keys``, ``OPT_SORT_KEYS``) byte for byte.
    """
    out: list[bytes] = []
    # Each open container: [iterator over its items, closing byte, is_object, first].
    stack: list[list[Any]] = []

    def open_value(v: Any) -> None:
        if isinstance(v, dict):
            out.append(b"{")
            items = sorted(v.items()) if sort_keys else v.items()
            stack.append([iter(items), b"}", True, True])
        elif isinstance(v, list):
            out.append(b"[")
            stack.append([iter(v), b"]", False, True])
        else:
            out.append(orjson.dumps(v))

    open_value(value)
    while stack:
        frame = stack[-1]
        item: Any = next(frame[0], _END)
        if item is _END:
            out.append(frame[1])
            stack.pop()
            continue
        if frame[3]:
            frame[3] = False
        else:
            out.append(b",")
        if frame[2]:
            key, item = item
            out.append(orjson.dumps(key))
            out.append(b":")
        open_value(item)
    return b"".join(out)


# --- field helpers ------------------------------------------------------------------


def _json_type(v: Any) -> str:
    """The JSON type name of a decoded value, for error messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__  # pragma: no cover - orjson yields only the types above


def _opt_bool(data: dict[str, Any], key: str) -> bool | None:
    v = data.get(key)
    if v is None or isinstance(v, bool):
        return v
    raise BadRequest(f"'{key}' must be a boolean, got {_json_type(v)}")


def _opt_str(data: dict[str, Any], key: str) -> str | None:
    v = data.get(key)
    if v is None or isinstance(v, str):
        return v
    raise BadRequest(f"'{key}' must be a string, got {_json_type(v)}")


def _opt_count(data: dict[str, Any], key: str) -> int | None:
    """An optional integer >= 0 (booleans are not integers here)."""
    v = data.get(key)
    if v is None:
        return None
    if type(v) is not int:
        raise BadRequest(f"'{key}' must be an integer, got {_json_type(v)}")
    if v < 0:
        raise BadRequest(f"'{key}' must be >= 0, got {v}")
    return v


def _dumps_sorted(v: Any) -> str:
    try:
        return orjson.dumps(v, option=orjson.OPT_SORT_KEYS).decode()
    except orjson.JSONEncodeError:  # deeper than orjson serialises
        return dumps_any_depth(v, sort_keys=True).decode()


# --- completions / embeddings -------------------------------------------------------


def _is_token_ids(v: list[Any]) -> bool:
    return all(type(t) is int for t in v)


def _render_prompt_input(data: dict[str, Any], key: str) -> str:
    """Validate and render a completions ``prompt`` / embeddings ``input``."""
    v = data.get(key)
    if v is None:
        raise BadRequest(f"'{key}' is required")
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise BadRequest(f"'{key}' must be {_PROMPT_SHAPES}, got {_json_type(v)}")
    if not v:
        raise BadRequest(f"'{key}' must not be an empty list")
    first = v[0]
    if isinstance(first, str):
        for i, s in enumerate(v):
            if not isinstance(s, str):
                raise BadRequest(
                    f"'{key}[{i}]' must be a string like '{key}[0]', got {_json_type(s)}"
                )
        return "\n".join(v)
    if type(first) is int:
        if not _is_token_ids(v):
            i = next(i for i, t in enumerate(v) if type(t) is not int)
            raise BadRequest(
                f"'{key}[{i}]' must be an integer token id, got {_json_type(v[i])}"
            )
        return " ".join(map(str, v))
    if isinstance(first, list):
        rows: list[str] = []
        for i, ids in enumerate(v):
            if not isinstance(ids, list) or not _is_token_ids(ids):
                raise BadRequest(f"'{key}[{i}]' must be a list of integer token ids")
            rows.append(" ".join(map(str, ids)))
        return "\n".join(rows)
    raise BadRequest(f"'{key}' must be {_PROMPT_SHAPES}; '{key}[0]' is {_json_type(first)}")


# --- chat ---------------------------------------------------------------------------


def _url_of(v: Any) -> str | None:
    """``v`` if it is a string, ``v["url"]`` if that is a string, else None."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        url = v.get("url")
        if isinstance(url, str):
            return url
    return None


def _render_parts(parts: list[Any], where: str, out: list[str]) -> None:
    """Validate a list of content parts at ``where`` and append its rendering to ``out``."""
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise BadRequest(
                f"'{where}[{j}]' must be a content part object, got {_json_type(part)}"
            )
        ptype = part.get("type")
        if not isinstance(ptype, str):
            raise BadRequest(f"'{where}[{j}].type' must be a string")
        if ptype in _TEXT_PART_TYPES:
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"'{where}[{j}].text' must be a string")
            out.append(text)
            continue
        # Non-text part (image_url, input_audio, video_url, file, input_image, …): render
        # its URL when it has one (cheap, and it identifies the media), else the whole part.
        url = _url_of(part.get(ptype))
        if url is None:
            url = _url_of(part.get("image_url"))
        out.append("<|")
        out.append(ptype)
        out.append("|>")
        out.append(url if url is not None else _dumps_sorted(part))


def _render_message(msg: Any, where: str, out: list[str]) -> None:
    """Validate one chat-style message at ``where`` and append its rendering to ``out``."""
    if not isinstance(msg, dict):
        raise BadRequest(f"'{where}' must be an object, got {_json_type(msg)}")
    role = msg.get("role")
    if not isinstance(role, str):
        raise BadRequest(
            f"'{where}.role' must be a string, got {_json_type(role)}"
            if role is not None
            else f"'{where}.role' is required"
        )
    name = msg.get("name")
    if name is not None and not isinstance(name, str):
        raise BadRequest(f"'{where}.name' must be a string, got {_json_type(name)}")
    tool_calls = msg.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise BadRequest(f"'{where}.tool_calls' must be an array, got {_json_type(tool_calls)}")
    function_call = msg.get("function_call")
    tool_call_id = msg.get("tool_call_id")
    if tool_call_id is not None and not isinstance(tool_call_id, str):
        raise BadRequest(f"'{where}.tool_call_id' must be a string")

    out.append("<|")
    out.append(role)
    out.append("|>\n")
    if name is not None:
        out.append("<|name|>")
        out.append(name)
        out.append("\n")
    content = msg.get("content")
    if isinstance(content, str):
        out.append(content)
    elif isinstance(content, list):
        _render_parts(content, f"{where}.content", out)
    elif content is None:
        # OpenAI: content may be null/absent on assistant messages (tool_calls,
        # function_call, refusal); every other role needs it.
        if tool_calls is None and function_call is None and role != "assistant":
            raise BadRequest(
                f"'{where}.content' is required (null only with tool_calls or on "
                "assistant messages)"
            )
    else:
        raise BadRequest(
            f"'{where}.content' must be a string, a list of content parts or null, "
            f"got {_json_type(content)}"
        )
    out.append("\n")
    if tool_calls is not None:
        out.append("<|tool_calls|>")
        out.append(_dumps_sorted(tool_calls))
        out.append("\n")
    if function_call is not None:
        out.append("<|function_call|>")
        out.append(_dumps_sorted(function_call))
        out.append("\n")
    if tool_call_id is not None:
        out.append("<|tool_call_id|>")
        out.append(tool_call_id)
        out.append("\n")


def _render_tools(data: dict[str, Any], out: list[str]) -> None:
    # Chat templates put tool definitions near the start of the prompt, so requests that
    # differ only in tools do not share a KV prefix; render them first.
    tools = data.get("tools")
    if isinstance(tools, list) and tools:
        out.append("<|tools|>\n")
        out.append(_dumps_sorted(tools))
        out.append("\n")


def _render_chat(data: dict[str, Any]) -> str:
    messages = data.get("messages")
    if messages is None:
        raise BadRequest("'messages' is required")
    if not isinstance(messages, list):
        raise BadRequest(f"'messages' must be an array, got {_json_type(messages)}")
    if not messages:
        raise BadRequest("'messages' must not be empty")
    out: list[str] = []
    _render_tools(data, out)
    for i, msg in enumerate(messages):
        _render_message(msg, f"messages[{i}]", out)
    return "".join(out)


# Chat content-part types that carry media, and their modality: llm-d-router v0.10.0's
# estimate tokenizer (dataproducer/tokenizer/estimate.go ``appendChatMessage``) reports
# each such part as one multimodal feature, which ``always-disagg-multimodal-decider``
# counts. Anthropic ``image`` blocks (with a ``source``) count too (``messagesBytes``).
MULTIMODAL_PART_TYPES: Final[Mapping[str, str]] = MappingProxyType({
    "image_url": "image",
    "video_url": "video",
    "input_audio": "audio",
    "audio_url": "audio",
})


def multimodal_items(data: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The modality (``image``, ``video``, ``audio``) of every media part in a chat
    body's ``messages``, in prompt order; ``()`` for text-only or non-chat bodies.

    Reads the decoded body (``ParsedRequest.data``) without validating it again: parts
    that are not objects with a string ``type`` are skipped."""
    if data is None:
        return ()
    messages = data.get("messages")
    if not isinstance(messages, list):
        return ()
    found: list[str] = []
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            ptype = part.get("type")
            if not isinstance(ptype, str):
                continue
            modality = MULTIMODAL_PART_TYPES.get(ptype)
            if modality is None and ptype == "image" and isinstance(part.get("source"), dict):
                modality = "image"  # Anthropic Messages image block
            if modality is not None:
                found.append(modality)
    return tuple(found)


# --- responses ----------------------------------------------------------------------


def _render_responses(data: dict[str, Any]) -> str:
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest(f"'instructions' must be a string, got {_json_type(instructions)}")
    inp = data.get("input")
    if inp is None:
        raise BadRequest("'input' is required")
    if not isinstance(inp, (str, list)):
        raise BadRequest(
            f"'input' must be a string or a list of items, got {_json_type(inp)}"
        )
    out: list[str] = []
    _render_tools(data, out)
    if instructions is not None:
        out.append("<|system|>\n")
        out.append(instructions)
        out.append("\n")
    if isinstance(inp, str):
        out.append("<|user|>\n")
        out.append(inp)
        out.append("\n")
        return "".join(out)
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"'{where}' must be an object, got {_json_type(item)}")
        if "role" in item:
            _render_message(item, where, out)
            continue
        itype = item.get("type")
        if not isinstance(itype, str):
            raise BadRequest(f"'{where}' must have a string 'role' or 'type'")
        out.append("<|")
        out.append(itype)
        out.append("|>\n")
        out.append(_dumps_sorted(item))
        out.append("\n")
    return "".join(out)


# --- other APIs ---------------------------------------------------------------------


def _parse_other(model: str, data: dict[str, Any]) -> ParsedRequest:
    """Lenient parse for paths the EPP does not know: only ``model`` is validated."""
    stream = data.get("stream")
    max_tokens = data.get("max_tokens")
    cache_salt = data.get("cache_salt")
    user = data.get("user")
    return ParsedRequest(
        api=ApiType.OTHER,
        model=model,
        prompt="",
        stream=stream if isinstance(stream, bool) else False,
        max_tokens=max_tokens if type(max_tokens) is int and max_tokens >= 0 else None,
        cache_salt=cache_salt if isinstance(cache_salt, str) else None,
        user=user if isinstance(user, str) else None,
        data=data,
    )
