"""The metrics port: Prometheus ``/metrics`` and ``/debug/decisions`` over HTTP (aiohttp)."""

from __future__ import annotations

import ssl

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from epp.observability.explain import DecisionLog
from epp.server.listeners import StartupError, host_port
from epp.server.metrics_auth import BearerToken, MetricsAuth


def metrics_app(registry: CollectorRegistry, decisions: DecisionLog | None,
                token: str | None = None, *, auth: MetricsAuth | None = None,
                ) -> web.Application:
    """``/metrics`` and ``/debug/decisions``, both behind ``auth`` (epp/server/
    metrics_auth.py) when given, else behind ``token`` as a bearer token when given."""
    if auth is None and token:
        auth = BearerToken(token)

    async def metrics(request: web.Request) -> web.Response:
        if auth is not None and (denied := await auth.check(request)) is not None:
            return denied
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def debug_decisions(request: web.Request) -> web.Response:
        if auth is not None and (denied := await auth.check(request)) is not None:
            return denied
        if decisions is None:
            return web.json_response({"error": "decision history is off; start epp serve "
                                      "with --explain-history N"}, status=404)
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            return web.json_response({"error": "limit must be an integer"}, status=400)
        return web.Response(body=orjson.dumps(decisions.last(limit)),
                            content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/decisions", debug_decisions)
    return app


async def serve_metrics(app: web.Application, address: str, port: int,
                        ssl_context: ssl.SSLContext | None = None) -> web.AppRunner:
    """Listen on ``address:port`` (over TLS with ``ssl_context``: llm-d's
    ``--metrics-cert-dir``); the caller cleans the returned runner up.
    :class:`StartupError` when the port cannot be bound."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, address, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise StartupError(f"cannot listen for metrics on {host_port(address, port)}: "
                           f"{e.strerror or e} (port in use? pick another with "
                           "--metrics-port)") from e
    return runner
