"""The gRPC listeners: server construction, binding (a port in use is a clear
:class:`StartupError`), and the ext_proc port served in this process.

The metrics port is in epp/server/metrics_http.py; ``--workers N`` serves ext_proc from
front processes instead (epp/server/workers.py, :class:`~epp.server.workers.FrontProcesses`).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import grpc

from epp.server.drain import StreamTracker, drain_server


class StartupError(Exception):
    """The server cannot start (port in use, bad endpoints, bad config)."""


def host_port(address: str, port: int) -> str:
    """``address:port`` as gRPC parses it (IPv6 addresses in brackets)."""
    if ":" in address and not address.startswith("["):
        return f"[{address}]:{port}"
    return f"{address}:{port}"


def grpc_server(max_message: int, max_send: int | None = None) -> grpc.aio.Server:
    """A grpc.aio server; ``max_message`` bounds messages both ways (-1: no bound), or
    received ones only when ``max_send`` is given."""
    return grpc.aio.server(options=[
        # Without this a second process could bind the same port silently.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", max_message if max_send is None else max_send),
        # Accept Envoy's HTTP/2 keepalive PINGs (the shipped Envoy config sends them so
        # a hung EPP fails requests instead of hanging full-duplex streams forever).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
    ])


def bind(server: grpc.aio.Server, address: str, port: int, what: str,
         credentials: grpc.ServerCredentials | None = None) -> None:
    """Add the listening port; :class:`StartupError` when it cannot be bound."""
    addr = host_port(address, port)
    try:
        if credentials is not None:
            bound = server.add_secure_port(addr, credentials)
        else:
            bound = server.add_insecure_port(addr)
    except RuntimeError as e:
        raise StartupError(f"cannot listen for {what} on {addr}: {e} (port in use? pick "
                           "another with the matching --*-port flag)") from e
    if bound == 0:
        raise StartupError(f"cannot listen for {what} on {addr} (port in use?)")


class ExtProcPort(Protocol):
    """Whatever serves the ext_proc port, as the drain sees it."""

    async def drain(self, timeout: float, quiet: float, stop_now: asyncio.Event) -> None:
        """Keep serving through the drain window (epp/server/drain.py), then stop."""
        ...


class InProcessExtProc:
    """The ext_proc port served by a gRPC server in this process (``--workers 1``)."""

    def __init__(self, server: grpc.aio.Server, tracker: StreamTracker) -> None:
        self._server = server
        self._tracker = tracker
        self._stopped = False

    async def drain(self, timeout: float, quiet: float, stop_now: asyncio.Event) -> None:
        if self._stopped:
            return
        await drain_server(self._server, self._tracker, timeout, quiet, stop_now)
        self._stopped = True

    async def stop(self, grace: float) -> None:
        """Stop accepting streams; running ones get ``grace`` seconds. Nothing to do
        after :meth:`drain`."""
        if not self._stopped:
            self._stopped = True
            await self._server.stop(grace)
