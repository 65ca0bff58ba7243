"""P/D and E/P/D disaggregation in the simulator: every side of llm-d's handshakes.

- Prefill role: a generation request carrying ``kv_transfer_params`` is answered (with
  one token) together with the ``kv_transfer_params`` a decode pod needs to pull the KV
  (:func:`prefill_answer_params`).
- Decode role: a generation request carrying ``x-prefiller-host-port`` is prefilled by
  that pod first, as llm-d's decode sidecar does (:func:`remote_prefill`;
  docs/disaggregation.md); the pulled KV is priced by the pair's distance
  (:mod:`epp.sim.topology`) and counted in :class:`~epp.sim.state.PdStats`.
- Encode role (vLLM ``--mm-encoder-only``): a chat request's multimodal items are
  encoded (priced by the engine) and answered with one token and ``ec_transfer_params``
  keyed by each item's hash (:func:`encode_answer_params`), as llm-d's inference
  simulator answers.
- Decode role, E/P/D: a chat request carrying ``x-encoder-hosts-ports`` first has those
  encode pods encode its multimodal items, one request per item spread round-robin over
  them, in parallel (:func:`remote_encode`), as llm-d's sidecar does
  (pkg/sidecar/proxy/connector_ec_common.go, connector_ec_nixl.go); their
  ``ec_transfer_params`` go on to the prefill pod (or the local prefill), which then
  encodes nothing itself. Counted in :class:`~epp.sim.state.EncodeStats`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import time
import uuid
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web

from epp.keys import HEADER_ENCODERS, HEADER_PREFILLER
from epp.sim.state import (
    JSON_CONTENT_TYPE,
    RECORD_KEY,
    HttpError,
    Json,
    SimState,
    local_port,
)
from epp.sim.topology import distance

__all__ = [
    "EC_SIZE_BYTES",
    "MM_TYPES",
    "PREFILL_KV_PARAMS",
    "encode_answer_params",
    "encoder_request",
    "mm_hash",
    "mm_items",
    "prefill_answer_params",
    "remote_encode",
    "remote_prefill",
]

MM_TYPES: Final = ("image_url", "audio_url", "video_url", "input_audio")
"""Chat content-part types that need the encoder (llm-d's sidecar ``mmTypes``)."""
EC_SIZE_BYTES: Final = 2359296
"""``size_bytes`` of one item's encoder output in ``ec_transfer_params`` (the value
llm-d's inference simulator reports)."""
_NIXL_PLACEHOLDER: Final = base64.b64encode(b"NIXL_METADATA_PLACEHOLDER").decode()

PREFILL_KV_PARAMS: Final[Json] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""``kv_transfer_params`` of the prefill request, as llm-d's nixlv2 sidecar sends them."""


def prefill_answer_params(request: web.Request, state: SimState, prompt_len: int) -> Json:
    """Prefill role: the ``kv_transfer_params`` of the answer to a request of
    ``prompt_len`` tokens (where a decode pod would pull its KV blocks from)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": state.name,
        "remote_block_ids": list(range(math.ceil(max(1, prompt_len) / state.config.block_size))),
        "remote_host": request.host.rsplit(":", 1)[0],
        "remote_port": local_port(request),
        "tp_size": 1,
    }


async def remote_prefill(
    request: web.Request, state: SimState, body: Json, limit_fields: tuple[str, ...], peer: str
) -> tuple[Json | None, float | None]:
    """llm-d's decode sidecar (nixlv2 connector): send the prefill pod ``peer``
    (``address:port``) the request with ``kv_transfer_params`` asking for a remote
    decode, ``stream: false`` and every output-token limit set to 1, wait for its answer,
    and return its ``kv_transfer_params`` with the KV-transfer cost per token for the
    pair's distance.

    When the prefill pod fails or cannot be reached: with ``prefill_failure = fallback``
    returns ``(None, None)`` (the decode pod prefills locally); with ``error`` raises the
    prefill pod's status (502 when unreachable), as llm-d's sidecar does.
    """
    cfg = state.config
    info: Json = {"prefiller": peer}
    record = request.get(RECORD_KEY)
    if record is not None:
        record["pd"] = info
    pbody = dict(body)
    pbody["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    pbody["stream"] = False
    pbody.pop("stream_options", None)
    for f in limit_fields:
        pbody[f] = 1
    status: int | None = None
    params: Json | None = None
    error = ""
    t0 = time.monotonic()
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in host or "@" in host:
        error = f"malformed {HEADER_PREFILLER} {peer!r} (expected address:port)"
    else:
        try:
            async with state.client().post(
                f"http://{peer}{request.path}",
                data=orjson.dumps(pbody),
                headers={"content-type": JSON_CONTENT_TYPE, "x-request-id": str(uuid.uuid4())},
            ) as resp:
                status = resp.status
                raw = await resp.read()
            if 200 <= status < 300:
                answer = orjson.loads(raw)
                got = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                params = got if isinstance(got, dict) else {}
            else:
                error = f"prefill pod {peer} answered {status}"
        except orjson.JSONDecodeError:
            error = f"prefill pod {peer} answered with invalid JSON"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            error = f"prefill pod {peer} unreachable: {type(exc).__name__}: {exc}"
    info["status"] = status
    info["prefill_s"] = round(time.monotonic() - t0, 6)
    pd = state.pd
    if params is None:
        pd.prefill_failures += 1
        info["error"] = error
        if cfg.prefill_failure == "error":
            code = status if status is not None and status >= 400 else 502
            raise HttpError(code, error, "BadGatewayError" if code == 502 else "PrefillError")
        pd.fallbacks += 1
        info["fallback"] = True
        return None, None
    own = state.own_topology(local_port(request))
    level = distance(own, state.peers.lookup(peer) if state.peers is not None else None)
    cost = cfg.transfer_cost(level)
    pd.remote_prefills += 1
    key = level or "unknown"
    pd.by_distance[key] = pd.by_distance.get(key, 0) + 1
    pd.by_prefiller[peer] = pd.by_prefiller.get(peer, 0) + 1
    info.update(distance=level, transfer_ms_per_token=cost, fallback=False)
    return params, cost


# ---------------------------------------------------------------- E/P/D


def _item_url(item: Json) -> str:
    kind = item.get("type")
    if kind in ("image_url", "audio_url", "video_url"):
        inner = item.get(kind)
        if isinstance(inner, dict) and isinstance(inner.get("url"), str):
            return str(inner["url"])
    return ""


def mm_items(body: Json) -> list[Json]:
    """The multimodal items of a chat body as llm-d's sidecar finds them: every
    ``messages[].content[]`` part whose ``type`` is one of :data:`MM_TYPES`, in order,
    an URL-based item (``image_url``, ``audio_url``, ``video_url``) whose URL came before
    left out; inline ones (``input_audio``) all kept. Anything else (a string content,
    malformed parts, a body without ``messages``) has none."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    seen: set[str] = set()
    out: list[Json] = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for item in content:
            if not isinstance(item, dict) or item.get("type") not in MM_TYPES:
                continue
            url = _item_url(item)
            if url:
                if url in seen:
                    continue
                seen.add(url)
            out.append(item)
    return out


def mm_hash(item: Json) -> str:
    """A stable identifier of one item (its URL's, else its JSON's, SHA-256): the key of
    its entry in ``ec_transfer_params``, as vLLM keys them by ``mm_hash``."""
    url = _item_url(item)
    raw = url.encode() if url else orjson.dumps(item, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(raw).hexdigest()


def encoder_request(body: Json, item: Json) -> Json:
    """llm-d's ``buildEncoderRequest``: the chat request with ``messages`` replaced by one
    user message holding only ``item``, ``max_tokens`` 1 (``max_completion_tokens`` 1 when
    present), ``stream`` false and no ``stream_options``."""
    out = dict(body)
    out["messages"] = [{"role": "user", "content": [item]}]
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    return out


def encode_answer_params(request: web.Request, items: list[Json]) -> Json:
    """Encode role: the answer's ``ec_transfer_params``, one entry per item keyed by
    :func:`mm_hash` naming this pod as the peer to read the encoder output from."""
    host, port = request.host.rsplit(":", 1)[0], local_port(request)
    return {
        mm_hash(item): {
            "peer_host": host,
            "peer_port": port,
            "size_bytes": EC_SIZE_BYTES,
            "nixl_agent_metadata_b64": _NIXL_PLACEHOLDER,
        }
        for item in items
    }


async def _encode_one(
    state: SimState, path: str, body: Json, item: Json, peer: str, request_id: str
) -> tuple[int | None, Json | None, str]:
    """Send one item to the encode pod ``peer``: (status, its ``ec_transfer_params``
    (``{}`` when it gave none), the error or "")."""
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in host or "@" in host:
        return None, None, f"malformed {HEADER_ENCODERS} entry {peer!r} (expected address:port)"
    try:
        async with state.client().post(
            f"http://{peer}{path}",
            data=orjson.dumps(encoder_request(body, item)),
            headers={"content-type": JSON_CONTENT_TYPE, "x-request-id": request_id},
        ) as resp:
            status = resp.status
            raw = await resp.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return None, None, f"encode pod {peer} unreachable: {type(exc).__name__}: {exc}"
    if not 200 <= status < 300:
        return status, None, f"encode pod {peer} answered {status}"
    try:
        answer: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return status, None, f"encode pod {peer} answered with invalid JSON"
    got = answer.get("ec_transfer_params") if isinstance(answer, dict) else None
    return status, (got if isinstance(got, dict) else {}), ""


async def remote_encode(
    request: web.Request, state: SimState, body: Json, header: str
) -> tuple[Json, bool]:
    """llm-d's decode sidecar, encode stage: send each of the chat body's multimodal
    items (:func:`mm_items`) to the encode pods listed in ``header`` (comma-separated
    ``address:port``; item ``i`` to entry ``i mod n``), all at once, each as
    :func:`encoder_request` to the request's path; merge the answers'
    ``ec_transfer_params``. Returns the body to prefill (with the merged
    ``ec_transfer_params`` and ``cache_hit_threshold`` 0, as llm-d's ``runPDPipeline``)
    and whether encode pods encoded the items (False when there were none).

    When an encode pod fails or cannot be reached: with ``encode_failure = error``
    raises 502, as llm-d's sidecar does; with ``fallback`` returns the body unchanged and
    False (this pod encodes the items itself).
    """
    items = mm_items(body)
    encoders = [h.strip() for h in header.split(",") if h.strip()]
    info: Json = {"encoders": encoders, "items": len(items)}
    record = request.get(RECORD_KEY)
    if record is not None:
        record["encode"] = info
    if not items or not encoders:  # llm-d: no multimodal items, skip the encoder
        return body, False
    rid = str(uuid.uuid4())
    t0 = time.monotonic()
    peers = [encoders[i % len(encoders)] for i in range(len(items))]
    results = await asyncio.gather(*(
        _encode_one(state, request.path, body, item, peer, f"{rid}-enc-{i}")
        for i, (item, peer) in enumerate(zip(items, peers, strict=True))))
    info["status"] = [status for status, _, _ in results]
    info["encode_s"] = round(time.monotonic() - t0, 6)
    stats = state.encode
    errors = [err for _, _, err in results if err]
    if errors:
        stats.failures += 1
        info["error"] = errors[0]
        if state.config.encode_failure == "error":
            raise HttpError(502, errors[0], "BadGatewayError")
        stats.fallbacks += 1
        info["fallback"] = True
        return body, False
    merged: Json = {}
    for peer, (_, params, _) in zip(peers, results, strict=True):
        merged.update(params or {})
        stats.by_encoder[peer] = stats.by_encoder.get(peer, 0) + 1
    stats.remote_requests += 1
    stats.remote_items += len(items)
    info["fallback"] = False
    out = dict(body)
    if merged:
        out["ec_transfer_params"] = merged
    out["cache_hit_threshold"] = 0
    return out, True
