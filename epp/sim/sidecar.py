"""P/D disaggregation in the simulator: both sides of llm-d's KV-transfer handshake.

- Prefill role: a generation request carrying ``kv_transfer_params`` is answered (with
  one token) together with the ``kv_transfer_params`` a decode pod needs to pull the KV
  (:func:`prefill_answer_params`).
- Decode role: a generation request carrying ``x-prefiller-host-port`` is prefilled by
  that pod first, as llm-d's decode sidecar does (:func:`remote_prefill`;
  docs/disaggregation.md); the pulled KV is priced by the pair's distance
  (:mod:`epp.sim.topology`) and counted in :class:`~epp.sim.state.PdStats`.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Final

import aiohttp
import orjson
from aiohttp import web

from epp.keys import HEADER_PREFILLER
from epp.sim.state import (
    JSON_CONTENT_TYPE,
    RECORD_KEY,
    HttpError,
    Json,
    SimState,
    local_port,
)
from epp.sim.topology import distance

__all__ = ["PREFILL_KV_PARAMS", "prefill_answer_params", "remote_prefill"]

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
