"""vLLM's ``/inference/v1/generate`` HTTP API (llm-d-router's vllmhttp-parser).

The request is JSON with pre-tokenized input: ``token_ids`` (required, non-empty),
optional ``model``, ``sampling_params`` (``max_tokens`` there is the output cap),
``stream``, ``cache_salt`` and multimodal ``features`` (``mm_hashes``: modality → content
hashes; ``mm_placeholders``: modality → ``{offset, length}`` ranges in ``token_ids``).
Responses share the OpenAI usage shape. Followed: llm-d-router
pkg/epp/framework/plugins/requesthandling/parsers/vllmhttp/vllmhttp.go and
GenerateRequest.UnmarshalJSON in pkg/epp/framework/interface/requesthandling/types.go
(v0.10.0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import orjson

from epp.errors import BadRequest
from epp.parsing.request import ParsedRequest
from epp.scheduling.types import ApiType

GENERATE_PATH: Final = "/inference/v1/generate"
# Where the request path is read from, in order (llm-d-router's GetRequestPath): the
# pseudo-header, then the headers a proxy in front may have put the original path in.
PATH_HEADERS: Final = (":path", "x-original-path", "x-forwarded-path")
_MAX_TOKEN_ID: Final = (1 << 32) - 1


def request_path(headers: Mapping[str, str]) -> str:
    """The request path without its query string ('' when no header has one)."""
    for key in PATH_HEADERS:
        path = headers.get(key)
        if path:
            return path.partition("?")[0]
    return ""


def is_generate_path(headers: Mapping[str, str]) -> bool:
    """The request addresses ``…/inference/v1/generate`` (one trailing ``/`` allowed)."""
    path = request_path(headers)
    if len(path) > 1 and path.endswith("/"):
        path = path[:-1]
    return path.endswith(GENERATE_PATH)


def _whole(v: Any) -> int | None:
    """``v`` as an int when it is a JSON number holding a whole value >= 0 (``128`` or
    ``128.0``, as Go decodes numbers to float64), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        return None
    return int(v) if v >= 0 else None


def _invalid(msg: str) -> BadRequest:
    return BadRequest(f"invalid generate request: {msg}")


def _token_ids(data: dict[str, Any]) -> list[int]:
    v = data.get("token_ids")
    if v is None:
        v = []
    if not isinstance(v, list):
        raise _invalid(f"'token_ids' must be an array of token ids, got {type(v).__name__}")
    ids: list[int] = []
    for i, t in enumerate(v):
        n = _whole(t)
        if n is None or n > _MAX_TOKEN_ID:
            raise _invalid(f"token_ids[{i}]: invalid value {t!r} (token ids are integers "
                           f"in 0..{_MAX_TOKEN_ID})")
        ids.append(n)
    if not ids:
        raise _invalid("must have non-empty token_ids field")
    return ids


def _markers(features: Any) -> list[tuple[int, str]]:
    """Validate ``features``; return (token offset, marker) per multimodal item."""
    if features is None:
        return []
    if not isinstance(features, dict):
        raise _invalid("'features' must be an object")
    hashes = features.get("mm_hashes") or {}
    ranges = features.get("mm_placeholders") or {}
    if not isinstance(hashes, dict):
        raise _invalid("'features.mm_hashes' must be an object of modality → hashes")
    if not isinstance(ranges, dict):
        raise _invalid("'features.mm_placeholders' must be an object of modality → ranges")
    for modality, hs in hashes.items():
        if not isinstance(hs, list) or not all(isinstance(h, str) for h in hs):
            raise _invalid(f"'features.mm_hashes.{modality}' must be an array of strings")
    out: list[tuple[int, str]] = []
    for modality, rs in ranges.items():
        if not isinstance(rs, list):
            raise _invalid(f"'features.mm_placeholders.{modality}' must be an array")
        hs = hashes.get(modality) or []
        for i, r in enumerate(rs):
            where = f"features.mm_placeholders.{modality}[{i}]"
            if not isinstance(r, dict):
                raise _invalid(f"'{where}' must be an object with offset and length")
            for key in ("offset", "length"):
                n = r.get(key, 0)
                if isinstance(n, bool) or not isinstance(n, int):
                    raise _invalid(f"'{where}.{key}' must be an integer")
            h = hs[i] if i < len(hs) else ""
            out.append((r.get("offset", 0), f"<|{modality}:{h}|>"))
    return out


def _render(ids: list[int], markers: list[tuple[int, str]]) -> str:
    """The prompt for prefix affinity: the token ids space separated (as the openai-parser
    renders a token-id prompt), each multimodal item's content hash inserted before its
    first placeholder token, so requests that differ only in an image do not share what
    follows it."""
    words = [str(t) for t in ids]
    if not markers:
        return " ".join(words)
    for offset, marker in sorted(markers, key=lambda m: m[0], reverse=True):
        words.insert(min(max(offset, 0), len(words)), marker)
    return " ".join(words)


def _max_tokens(data: dict[str, Any]) -> int | None:
    """``sampling_params.max_tokens`` when it is a whole number >= 0 (else no cap)."""
    sp = data.get("sampling_params")
    if not isinstance(sp, dict):
        return None
    return _whole(sp.get("max_tokens"))


def parse_generate_request(body: bytes) -> ParsedRequest:
    """Parse a ``/inference/v1/generate`` body (decoded once).

    Raises :class:`BadRequest` (400) when the body is not a JSON object, ``token_ids``
    is missing, empty or holds anything but integers in 0..2³²-1, ``cache_salt`` is not
    a string, or ``features`` is malformed. ``model`` is optional here (a non-string is
    ignored, as llm-d does); without it the ``x-gateway-model-name-rewrite`` header must
    name the model (the Director answers 400 otherwise).
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    ids = _token_ids(data)
    salt = data.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _invalid("'cache_salt' must be a string")
    prompt = _render(ids, _markers(data.get("features")))
    model = data.get("model")
    return ParsedRequest(
        api=ApiType.COMPLETIONS,
        model=model if isinstance(model, str) else "",
        prompt=prompt,
        stream=data.get("stream") is True,
        max_tokens=_max_tokens(data),
        cache_salt=salt or None,
        user=None,
        data=data,
    )
