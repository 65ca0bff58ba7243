"""One simulated pod as an aiohttp app: :func:`build_app`.

Each app has its own :class:`epp.sim.engine.Engine` (continuous batching, chunked
prefill, prefix cache, LoRA slots; see that module and docs/simulator.md), its own
Prometheus registry and its own seeded random source, all in its
:class:`~epp.sim.state.SimState` (``app[STATE_KEY]``). The OpenAI routes are in
:mod:`epp.sim.openai_api`; this module adds what is around them.

Contracts
- Every response carries ``x-sim-server: <name>`` (``sim-<port>`` from
  :func:`epp.sim.server.start_servers`).
- Every POST is recorded on arrival, before any delay or failure, as ``{"path",
  "body_len", "body_sha256", "headers"}`` (header names lower-cased; repeated headers
  joined with ", ") in a deque of the last :data:`~epp.sim.state.DEBUG_LOG_SIZE`;
  ``GET /debug/requests`` returns it oldest first, ``DELETE /debug/requests`` clears it.
  The OpenAI routes add ``fields`` to the record, a decode pod that asked a prefill pod
  adds ``pd`` (:func:`epp.sim.sidecar.remote_prefill`), one that asked encode pods
  ``encode`` (:func:`epp.sim.sidecar.remote_encode`); a pod that encoded multimodal items
  adds ``encoded`` (items and model milliseconds).
- ``delay_s`` delays every POST after it is recorded; a request error (bad body, injected
  failure, engine stopped) becomes an OpenAI error response.
- ``GET /debug/state`` returns the configuration and the engine's state.
- ``POST /v1/messages``: Anthropic's Messages API (:func:`epp.sim.openai_api.messages`).
- ``/metrics``: vLLM metric names (:mod:`epp.sim.metrics`). ``/health``: 200, or 503
  during slow start. ``/v1/models``: the base model and each LoRA adapter.
  ``/tokenize``: vLLM's (:func:`epp.sim.openai_api.tokenize`).
- ``POST /reset_prefix_cache``: vLLM's; forgets the evictable cached blocks and
  publishes the KV event for it.
- With an :class:`~epp.sim.kvevents.EventPublisher`, its sockets open when the app
  starts (a taken port fails the startup) and close on cleanup.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Awaitable, Callable

from aiohttp import web

from epp.sim.config import DEFAULT_MODEL, SimConfig
from epp.sim.engine import Engine
from epp.sim.kvevents import EventPublisher
from epp.sim.metrics import CONTENT_TYPE as _PROMETHEUS
from epp.sim.metrics import build_registry, render
from epp.sim.openai_api import (
    chat_completions,
    completions,
    embeddings,
    messages,
    models,
    responses,
    tokenize,
)
from epp.sim.state import (
    RECORD_KEY,
    SIM_SERVER_HEADER,
    STATE_KEY,
    HttpError,
    Json,
    SimState,
    error_response,
    json_response,
    local_port,
)
from epp.sim.tokens import BadRequest, SimTokenizer, WordTokenizer
from epp.sim.topology import PeerTopology

__all__ = ["build_app"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# ---------------------------------------------------------------- middleware


@web.middleware
async def _track(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Record every POST on arrival, apply ``delay_s``, and turn BadRequest and
    HttpError into OpenAI error responses."""
    state = request.app[STATE_KEY]
    if request.method != "POST":
        return await handler(request)
    raw = await request.read()
    record: Json = {
        "path": request.path,
        "body_len": len(raw),
        "body_sha256": hashlib.sha256(raw).hexdigest(),
        "headers": _lower_headers(request),
    }
    state.requests.append(record)
    request[RECORD_KEY] = record
    try:
        if state.delay_s > 0:
            await asyncio.sleep(state.delay_s)
        return await handler(request)
    except BadRequest as exc:
        return error_response(str(exc))
    except HttpError as exc:
        return error_response(str(exc), exc.status, exc.err_type)


def _lower_headers(request: web.Request) -> dict[str, str]:
    headers: dict[str, str] = {}
    for key, value in request.headers.items():
        k = key.lower()
        headers[k] = f"{headers[k]}, {value}" if k in headers else value
    return headers


async def _stamp(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[SIM_SERVER_HEADER] = request.app[STATE_KEY].name



# ---------------------------------------------------------------- operational routes


async def health(request: web.Request) -> web.StreamResponse:
    """GET /health: 200 with an empty body, like vLLM; 503 during slow start."""
    if request.app[STATE_KEY].engine.in_slow_start():
        return web.Response(status=503, text="starting")
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.StreamResponse:
    """GET /metrics: Prometheus text with vLLM metric names."""
    body = render(request.app[STATE_KEY].registry)
    return web.Response(body=body, headers={"Content-Type": _PROMETHEUS})


async def debug_requests(request: web.Request) -> web.StreamResponse:
    """GET /debug/requests: the recorded POSTs, oldest first."""
    return json_response(list(request.app[STATE_KEY].requests))


async def debug_requests_clear(request: web.Request) -> web.StreamResponse:
    """DELETE /debug/requests: forget the recorded POSTs."""
    request.app[STATE_KEY].requests.clear()
    return web.Response(status=204)


async def reset_prefix_cache(request: web.Request) -> web.StreamResponse:
    """POST /reset_prefix_cache: forget the evictable cached blocks (vLLM's route)."""
    request.app[STATE_KEY].engine.reset_prefix_cache()
    return web.Response(status=200)


async def debug_state(request: web.Request) -> web.StreamResponse:
    """GET /debug/state: name, model, role, parameters and the engine's state."""
    state = request.app[STATE_KEY]
    return json_response(
        {
            "name": state.name,
            "model": state.model,
            "role": state.config.role,
            "delay_s": state.delay_s,
            "config": state.config.as_dict(),
            "engine": state.engine.snapshot(),
            "topology": state.own_topology(local_port(request)),
            "pd": state.pd.as_dict(),
            "encode": state.encode.as_dict(),
        }
    )



# ---------------------------------------------------------------- the app


def build_app(
    name: str,
    model: str = DEFAULT_MODEL,
    *,
    delay_s: float = 0.0,
    config: SimConfig | None = None,
    address: str = "127.0.0.1",
    topology: dict[str, str] | None = None,
    peers: PeerTopology | None = None,
    tokenizer: SimTokenizer | None = None,
    events: EventPublisher | None = None,
) -> web.Application:
    """One simulated pod named ``name`` serving ``model`` with ``config`` (defaults:
    :class:`SimConfig`).

    P/D (decode role): ``topology`` is this pod's own (level → value), ``peers`` the
    topologies of the pods in an endpoints file, where this pod finds its own entry by
    ``address`` and its port when ``topology`` is not given. Together they price KV
    transfers by distance; without them every transfer costs
    ``kv_transfer_ms_per_token``.

    ``delay_s`` (>= 0, wall-clock seconds, not scaled by ``time_scale``) delays every
    POST before it reaches the engine; the request is not running or waiting meanwhile. The app's state is at
    ``app[STATE_KEY]`` (:class:`SimState`); its engine starts with the app and stops on
    shutdown, failing pending requests.

    ``tokenizer`` turns prompts into token ids (default: whitespace words); ``events``
    publishes the pod's KV events (started with the app, closed on cleanup).
    """
    if delay_s < 0:
        raise ValueError(f"delay_s must be >= 0, got {delay_s}")
    cfg = config if config is not None else SimConfig()
    engine = Engine(cfg, events)
    app = web.Application(middlewares=[_track], client_max_size=1 << 30)
    app[STATE_KEY] = SimState(
        name=name,
        model=model,
        config=cfg,
        engine=engine,
        registry=build_registry(engine, model),
        rng=random.Random(f"{cfg.seed}:{name}"),
        delay_s=delay_s,
        address=address,
        topology=dict(topology) if topology else None,
        peers=peers,
        tokenizer=tokenizer if tokenizer is not None else WordTokenizer(),
    )

    async def start_engine(_: web.Application) -> None:
        if events is not None:
            events.start()
        engine.start()

    async def stop_engine(_: web.Application) -> None:
        await engine.stop()
        if events is not None:
            await events.close()
        http = app[STATE_KEY].http
        if http is not None:
            await http.close()

    app.on_startup.append(start_engine)
    app.on_shutdown.append(stop_engine)
    app.on_cleanup.append(stop_engine)
    app.on_response_prepare.append(_stamp)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/requests", debug_requests)
    app.router.add_delete("/debug/requests", debug_requests_clear)
    app.router.add_get("/debug/state", debug_state)
    return app
