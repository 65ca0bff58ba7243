"""Graceful shutdown: count ext_proc streams, keep serving through a drain window, stop.

The shutdown sequence (``epp serve``, and each ``--workers`` front), modelled on the
llm-d router's ``--drain-timeout``:

1. The first SIGTERM or SIGINT starts the drain: readiness and the ext_proc health
   service go NOT_SERVING at once (liveness stays SERVING), so Kubernetes takes the pod
   out of the Service and the gateway stops picking it.
2. The ext_proc port keeps accepting new streams — the gateway needs time to notice —
   and running ones continue. Discovery and metrics scraping keep running, so what is
   still routed here is routed well.
3. The drain ends at ``timeout`` after the signal, or earlier once no ext_proc stream
   has been in flight for ``quiet`` seconds (counted from the signal at the earliest):
   traffic has moved away and nothing is left to finish. The llm-d router always serves
   the whole window; ``quiet >= timeout`` gives that behaviour, and is the default (a
   gateway may take seconds to notice; under sparse traffic an early exit would make it
   send requests to a process that is gone). Local tools and tests pass a short
   ``--drain-quiet-period``: no gateway there needs the time.
4. The gRPC server stops; streams still running when ``timeout`` expires are cancelled
   (their HTTP requests are cut). ``timeout = 0`` cancels them at once.

A second SIGTERM or SIGINT stops at once, whatever phase the drain is in.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_DRAIN_QUIET_S = DEFAULT_DRAIN_TIMEOUT_S  # the whole window, as llm-d's router


class StreamTracker:
    """Counts ext_proc streams in flight; ``idle`` is set while none is."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.started = 0  # streams started since the process began
        self.idle = asyncio.Event()
        self.idle.set()
        self.idle_since = 0.0  # loop time at which in_flight last dropped to 0

    def stream_started(self) -> None:
        self.in_flight += 1
        self.started += 1
        self.idle.clear()

    def stream_ended(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle_since = asyncio.get_running_loop().time()
            self.idle.set()


class TrackedExtProc:
    """An ExternalProcessor servicer that counts the streams of the one it wraps.

    Every stream is counted from the moment the handler starts until it returns, raises
    or is cancelled. The wrapped servicer uses grpc.aio's read()/write() API (its
    ``Process`` is a coroutine), so its own clean-up has run when the stream counts as
    ended. The generated registration only calls ``Process``: no need to subclass the
    generated (untyped) base class.
    """

    def __init__(self, inner: pb_grpc.ExternalProcessorServicer, tracker: StreamTracker) -> None:
        self._inner = inner
        self._tracker = tracker

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> None:
        tracker = self._tracker
        tracker.stream_started()
        try:
            inner: Any = self._inner
            await inner.Process(request_iterator, context)
        finally:
            tracker.stream_ended()


@dataclass
class DrainReport:
    seconds: float
    in_flight_at_start: int
    started_during: int  # new streams accepted during the drain
    cut: int  # streams cancelled when the drain ended
    reason: str  # "idle", "timeout" or "stopped"


def install_shutdown_signals(drain: asyncio.Event, stop_now: asyncio.Event,
                             what: str = "epp") -> None:
    """SIGTERM/SIGINT: the first sets ``drain``, any later one sets ``stop_now``.

    Counted per process: ``drain`` set by other means (a worker told by its core) does not
    turn the first signal into a second one."""
    loop = asyncio.get_running_loop()
    received = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal received
        received += 1
        if received == 1:
            log.info("%s: %s received: draining (send it again to stop at once)", what,
                     sig.name)
            drain.set()
        elif not stop_now.is_set():
            log.warning("%s: second %s: stopping at once", what, sig.name)
            stop_now.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


async def _wait_any(*events: asyncio.Event, timeout: float | None) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def stop_server(server: grpc.aio.Server, grace: float | None,
                      stop_now: asyncio.Event | None = None) -> None:
    """``server.stop(grace)``, shortened to an immediate stop if ``stop_now`` is set."""
    stopping = asyncio.ensure_future(server.stop(grace))
    if stop_now is not None and grace:
        waiter = asyncio.ensure_future(stop_now.wait())
        await asyncio.wait({stopping, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not stopping.done():
            await server.stop(None)  # the most restrictive call wins
    await stopping


async def drain_server(server: grpc.aio.Server, tracker: StreamTracker, timeout: float,
                       quiet: float, stop_now: asyncio.Event, what: str = "epp") -> DrainReport:
    """Keep ``server`` serving until the drain ends (module docstring), then stop it.

    Returns when the server has stopped; the caller has already reported NOT_SERVING.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + max(0.0, timeout)
    at_start, started0 = tracker.in_flight, tracker.started
    log.info("%s: drain started: %d ext_proc streams in flight; new streams are served for "
             "up to %.1fs (less once none has been in flight for %.1fs)", what, at_start,
             timeout, quiet)
    reason = "timeout"
    while True:
        now = loop.time()
        if stop_now.is_set():
            reason = "stopped"
            break
        if now >= deadline:
            break
        if tracker.in_flight == 0:
            quiet_until = max(start, tracker.idle_since) + quiet
            if now >= quiet_until:
                reason = "idle"
                break
            # A stream that starts and ends meanwhile moves idle_since: re-checked then.
            await _wait_any(stop_now, timeout=min(deadline, quiet_until) - now)
        else:
            await _wait_any(tracker.idle, stop_now, timeout=deadline - now)
    remaining = deadline - loop.time()
    pending = tracker.in_flight
    # The idle case still passes the remaining time as grace: a stream that started
    # between the last check and the stop gets to finish within the window.
    grace = remaining if reason == "idle" and remaining > 0 else None
    await stop_server(server, grace, stop_now)
    # Cancelled: all that were pending, unless they could still finish within the grace.
    cut = pending if grace is None or loop.time() >= deadline or stop_now.is_set() else 0
    report = DrainReport(loop.time() - start, at_start, tracker.started - started0, cut, reason)
    log_level = logging.WARNING if report.cut else logging.INFO
    log.log(log_level, "%s: drain finished after %.1fs (%s): %d streams were in flight at the "
            "start, %d started during the drain, %d cut", what, report.seconds,
            {"idle": "no stream in flight", "timeout": "drain timeout",
             "stopped": "stopped at once"}[reason],
            report.in_flight_at_start, report.started_during, report.cut)
    return report
