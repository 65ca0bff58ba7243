"""Several protocol-front processes around one scheduling core (``epp serve --workers N``).

Python's gRPC costs far more per ext_proc message than picking an endpoint does, so the
ext_proc work is spread over front processes while one core keeps the single consistent
scheduling state (prefix index, in-flight counts, metrics):

- the **core** is the ``epp serve`` process: datastore, discovery, metrics scraping,
  scheduler and plugins, Prometheus metrics and gRPC health, as in single-process mode.
  It serves a Unix socket for its fronts instead of the ext_proc port.
- each **front** (``python -m epp.server.workers``) serves ext_proc on the shared port
  (SO_REUSEPORT: the kernel spreads Envoy's connections over the fronts, so Envoy should
  open several — e.g. ``max_concurrent_streams`` on its EPP cluster's HTTP/2 options, as
  the shipped template sets; a server-side stream limit would make Envoy fail requests
  with REFUSED_STREAM instead), parses bodies, and asks the
  core for each decision over the socket; responses (usage parsing, model rewrite-back)
  are handled in the front, which reports completion to the core.

Wire format on the socket: frames of a 4-byte big-endian length and an orjson array.
Front → core: ``["R", id, request, subset]`` (decide), ``["C", ticket, status, aborted,
usage, response]`` (complete; ``response``: the front's ResponseStats, or null),
``["J", model, target, status]`` (rejected before scheduling), ``["O", outcome]`` (stream
outcome), ``["U", address]`` (Envoy could not connect to that endpoint), ``["X", id]``
(the client of request ``id`` went away before its answer: the core cancels the decision,
so a request waiting in flow control leaves its queue at once). Core → front:
``["D", id, destination, set_headers, response_headers, ticket]`` or ``["E", id, status,
message, error_type]``, and the shutdown controls ``["T", timeout, quiet]`` (drain:
epp/server/drain.py) and ``["S", grace]`` (stop now, running streams get ``grace``
seconds; null: cancelled), and ``["M", objectives]`` (the core's InferenceObjectives and
model rewrites, ObjectiveStore.export(): on connecting and after every change; the
front's Director applies them). Frames queue in the socket buffers, so a busy core reads and
answers them in batches. When a front's connection drops, the core completes that front's
open requests as aborted (and cancels those still waiting in flow control); when the core
goes away, fronts stop at once.

Flow control (the ``flowControl`` feature gate) lives in the core, like every other piece
of scheduling state: one flow controller orders the requests of every front. Under it
the core decides each "R" in its own task, so a request waiting for capacity holds up
neither the other requests of its front nor that front's completions.

Shutdown: a SIGTERM/SIGINT to the core (or to the whole process group) makes every front
drain like a single process does — NOT_SERVING on the ext_proc port's health service,
new streams still served, exit once idle or at the drain timeout — while the core keeps
deciding for them; the core exits when all fronts have. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import logging
import os
import socket
import struct
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from epp.datastore.objectives import ObjectiveStore
from epp.errors import EppError
from epp.handlers.extproc import DEFAULT_MAX_HEADERS, ExtProcServicer
from epp.observability.observer import ResponseStats
from epp.parsing.parser import Parser
from epp.parsing.usage import Usage
from epp.requestcontrol.director import Decision, Director, SchedulingCore
from epp.scheduling.types import ApiType, LLMRequest
from epp.server.drain import (
    DEFAULT_DRAIN_QUIET_S,
    DEFAULT_DRAIN_TIMEOUT_S,
    StreamTracker,
    TrackedExtProc,
    drain_server,
    install_shutdown_signals,
    stop_server,
)
from epp.server.health import HealthReporter
from epp.server.listeners import StartupError

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
_INTERNAL_ERROR = "internal error in the endpoint picker"


def _frame(msg: Sequence[Any]) -> bytes:
    body = orjson.dumps(msg)
    return _LEN.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    n = _LEN.unpack(await reader.readexactly(4))[0]
    return orjson.loads(await reader.readexactly(n))


def _request_to_wire(r: LLMRequest) -> list[Any]:
    return [r.request_id, r.target_model, r.incoming_model, r.api.value, r.prompt,
            dict(r.headers), r.stream, r.max_tokens, r.cache_salt, r.user, r.objective,
            r.fairness_id, r.session_token, r.request_size_bytes, r.priority, r.model_rewrite]


def _request_from_wire(w: list[Any]) -> LLMRequest:
    return LLMRequest(request_id=w[0], target_model=w[1], incoming_model=w[2],
                      api=ApiType(w[3]), prompt=w[4], headers=w[5], stream=w[6],
                      max_tokens=w[7], cache_salt=w[8], user=w[9], objective=w[10],
                      fairness_id=w[11], session_token=w[12], request_size_bytes=w[13],
                      priority=w[14], model_rewrite=w[15])


# ----------------------------------------------------------------------------- core side


class CoreServer:
    """Serves the scheduling core to front processes over a Unix socket."""

    def __init__(self, core: SchedulingCore, on_outcome: Callable[[str], None]) -> None:
        self.core = core
        self.on_outcome = on_outcome
        self._dir = tempfile.mkdtemp(prefix="epp-core-")
        self.path = os.path.join(self._dir, "core.sock")
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.connected = asyncio.Event()
        self.fronts = 0
        # The fronts' Directors apply InferenceObjectives and model rewrites: each gets the
        # core's store on connecting and again whenever it changes ("M" frames).
        self._objectives = core.objectives
        if self._objectives is not None:
            store = self._objectives
            store.on_change(lambda: self.broadcast(["M", store.export()]))

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        self._writers.add(writer)
        self.fronts += 1
        if self._objectives is not None:
            writer.write(_frame(["M", self._objectives.export()]))
        self.connected.set()
        tickets: dict[int, Any] = {}
        next_ticket = itertools.count(1)
        core = self.core
        # Under flow control a decision may wait in a queue: each runs in its own task, so
        # this connection keeps reading (completions, cancellations) meanwhile; "X" frames
        # cancel them (the front's client went away: the request leaves its queue).
        deciding: dict[int, asyncio.Task[None]] = {}

        async def decide_queued(rid: int, request: LLMRequest,
                                subset: list[str] | None) -> None:
            try:
                d = await core.decide_request(request, subset)
            except EppError as e:
                if not writer.is_closing():
                    writer.write(_frame(["E", rid, e.status, e.message, e.error_type]))
                return
            except Exception:
                log.exception("deciding a request for an ext_proc worker failed")
                if not writer.is_closing():
                    writer.write(_frame(["E", rid, 500, _INTERNAL_ERROR, "internal_error"]))
                return
            if writer.is_closing():  # the front went away meanwhile
                core.complete(d.ticket, 0, True, None)
                return
            ticket = next(next_ticket)
            tickets[ticket] = d.ticket
            writer.write(_frame(["D", rid, d.destination, d.set_headers,
                                 d.response_headers, ticket]))

        try:
            while True:
                msg = await _read_frame(reader)
                kind = msg[0]
                if kind == "R":
                    if core.flow_control is not None:
                        rid = msg[1]
                        t = asyncio.ensure_future(
                            decide_queued(rid, _request_from_wire(msg[2]), msg[3]))
                        deciding[rid] = t
                        t.add_done_callback(functools.partial(_forget, deciding, rid))
                        continue
                    try:
                        d = await core.decide_request(_request_from_wire(msg[2]), msg[3])
                    except EppError as e:
                        writer.write(_frame(["E", msg[1], e.status, e.message, e.error_type]))
                    else:
                        ticket = next(next_ticket)
                        tickets[ticket] = d.ticket
                        writer.write(_frame(["D", msg[1], d.destination, d.set_headers,
                                             d.response_headers, ticket]))
                    if writer.transport.get_write_buffer_size() > (1 << 20):
                        await writer.drain()
                elif kind == "X":
                    queued = deciding.get(msg[1])
                    if queued is not None:
                        queued.cancel()
                elif kind == "C":
                    t = tickets.pop(msg[1], None)
                    if t is not None:
                        u = msg[4]
                        core.complete(t, msg[2], msg[3], None if u is None else Usage(*u),
                                      None if msg[5] is None else ResponseStats(*msg[5]))
                elif kind == "J":
                    core.reject(msg[1], msg[2], msg[3])
                elif kind == "O":
                    self.on_outcome(msg[1])
                elif kind == "U":
                    core.upstream_failed(msg[1])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.fronts -= 1
            for queued in list(deciding.values()):  # their clients went with the front
                queued.cancel()
            for t in tickets.values():  # the front went away: its requests are aborted
                core.complete(t, 0, True, None)
            writer.close()
            self._writers.discard(writer)
            self._conns.discard(task)

    def broadcast(self, msg: Sequence[Any]) -> None:
        """Send a control frame (``T`` or ``S``) to every connected front."""
        frame = _frame(msg)
        for w in self._writers:
            if not w.is_closing():
                w.write(frame)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            try:
                await t
            except asyncio.CancelledError:
                pass
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass


def _forget(tasks: dict[int, asyncio.Task[None]], rid: int, _done: object) -> None:
    tasks.pop(rid, None)


def check_port_free(address: str, port: int) -> None:
    """Raise OSError if ``address:port`` cannot be bound (fronts bind it with SO_REUSEPORT,
    which would otherwise not notice a foreign listener that also uses it)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, port))


async def wait_port(host: str, port: int, timeout: float) -> None:
    """Until a TCP connection to ``host:port`` succeeds (tried every 20 ms); TimeoutError
    when none has within ``timeout`` seconds. The probe connection is closed at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last_error: OSError | None = None
    while True:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                               timeout=max(0.05, deadline - loop.time()))
        except (TimeoutError, OSError) as e:
            last_error = e if isinstance(e, OSError) else None
        else:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        if loop.time() >= deadline:
            raise TimeoutError(f"{host}:{port} did not accept connections within {timeout}s"
                               + (f" (last error: {last_error})" if last_error else ""))
        await asyncio.sleep(0.02)


class FrontPool:
    """Spawns and supervises the front processes."""

    def __init__(self, n: int, argv: list[str]) -> None:
        self.n = n
        self.argv = argv
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self) -> None:
        for _ in range(self.n):
            self.procs.append(await asyncio.create_subprocess_exec(*self.argv))

    def exited(self) -> list[int]:
        return [p.returncode for p in self.procs if p.returncode is not None]

    def running(self) -> int:
        return sum(p.returncode is None for p in self.procs)

    async def wait_exited(self, timeout: float, stop_now: asyncio.Event | None = None) -> None:
        """Until every front has exited, ``timeout`` passes, or ``stop_now`` is set."""
        waiters = [asyncio.ensure_future(p.wait()) for p in self.procs if p.returncode is None]
        if not waiters:
            return
        everyone = asyncio.ensure_future(asyncio.wait(waiters))
        pending: set[asyncio.Future[Any]] = {everyone}
        stop: asyncio.Future[Any] | None = None
        if stop_now is not None:
            stop = asyncio.ensure_future(stop_now.wait())
            pending.add(stop)
        try:
            await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in (everyone, stop, *waiters):
                if f is not None:
                    f.cancel()

    async def stop(self, grace: float) -> None:
        """Wait up to ``grace`` + 2 s for the fronts to exit (the caller has told them to
        stop over the core socket; a front that is not connected exits when the socket
        goes), then SIGKILL what is left."""
        await self.wait_exited(grace + 2)
        for p in self.procs:
            if p.returncode is None:
                p.kill()
                await p.wait()


class FrontProcesses:
    """``--workers N`` on the core's side, once started: the core socket's server and the
    front processes. Serves the ext_proc port as the drain sees it
    (:class:`~epp.server.listeners.ExtProcPort`)."""

    def __init__(self, server: CoreServer, pool: FrontPool) -> None:
        self.server = server
        self.pool = pool

    async def wait_ready(self, address: str, port: int, timeout: float = 30.0) -> None:
        """Until every front has connected and the ext_proc port answers.

        :class:`StartupError` when a front exits first or they do not all connect within
        ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        n = self.pool.n
        while self.server.fronts < n:
            if self.pool.exited():
                raise StartupError(f"an ext_proc worker process exited with status "
                                   f"{self.pool.exited()[0]} at startup (see its log above)")
            if loop.time() > deadline:
                raise StartupError(f"only {self.server.fronts} of {n} ext_proc workers "
                                   f"connected within {timeout:g}s")
            await asyncio.sleep(0.05)
        # A front connects before its gRPC server starts; wait until the port answers.
        await wait_port("127.0.0.1" if address in ("0.0.0.0", "::") else address, port,
                        timeout=timeout)

    async def drain(self, timeout: float, quiet: float, stop_now: asyncio.Event) -> None:
        """Each front drains its own streams (as one process does) and exits; returns once
        all have exited (or at ``timeout`` plus a margin; ``stop_now`` cuts it short)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        running = self.pool.running()
        log.info("drain started: %d ext_proc workers keep serving for up to %.1fs (less once "
                 "none has a stream in flight for %.1fs); each logs its own counts", running,
                 timeout, quiet)
        # Workers that got the signal themselves (a process-group signal) already drain;
        # the message is for those that did not (a signal to this process alone).
        self.server.broadcast(["T", timeout, quiet])
        # Each worker ends its drain by its deadline; the margin covers its stop and exit.
        await self.pool.wait_exited(timeout + 2.0, stop_now)
        if stop_now.is_set():
            self.server.broadcast(["S", None])
            await self.pool.wait_exited(2.0)
        left = self.pool.running()
        log.log(logging.WARNING if left else logging.INFO,
                "drain finished after %.1fs: %d of %d ext_proc workers exited%s",
                loop.time() - start, running - left, running,
                f", {left} still running are stopped now" if left else "")

    async def stop(self, grace: float) -> None:
        """Tell the fronts to stop (running streams get ``grace`` seconds); SIGKILL those
        still running after ``grace`` + 2 s."""
        self.server.broadcast(["S", grace])
        await self.pool.stop(grace)


# ---------------------------------------------------------------------------- front side


class RemoteCore:
    """A CoreClient that reaches the core over its Unix socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_control: Callable[[list[Any]], None] | None = None) -> None:
        self._reader = reader
        self._writer = writer
        self._on_control = on_control
        self._pending: dict[int, asyncio.Future[Decision]] = {}
        self._next = 0
        self.closed = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await _read_frame(self._reader)
                if msg[0] in ("T", "S", "M"):  # controls and objectives, not answers
                    if self._on_control is not None:
                        self._on_control(msg)
                    continue
                fut = self._pending.pop(msg[1], None)
                if fut is None or fut.done():
                    if msg[0] == "D":
                        # The stream went away while the core decided: the decision is
                        # counted there, so hand it back as aborted (nothing leaks).
                        self.complete(msg[5], 0, True, None)
                    continue
                if msg[0] == "D":
                    fut.set_result(Decision(msg[2], msg[3], msg[4], msg[5]))
                else:
                    fut.set_exception(EppError(msg[3], status=msg[2], error_type=msg[4]))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(EppError("the scheduling core is gone", status=503,
                                               error_type="service_unavailable"))
            self._pending.clear()
            self.closed.set()

    async def decide(self, request: LLMRequest, subset: Sequence[str] | None) -> Decision:
        if self.closed.is_set():
            raise EppError("the scheduling core is gone", status=503,
                           error_type="service_unavailable")
        self._next += 1
        rid = self._next
        fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self._writer.write(_frame(["R", rid, _request_to_wire(request),
                                   None if subset is None else list(subset)]))
        try:
            return await fut
        except asyncio.CancelledError:
            # The client went away (its ext_proc stream was cancelled) before the answer:
            # the core cancels the decision, so a request waiting in flow control leaves
            # its queue at once. An answer already on its way is handed back as aborted.
            if self._pending.pop(rid, None) is not None:
                self._send(["X", rid])
            raise

    def complete(self, ticket: Any, status: int, aborted: bool, usage: Usage | None,
                 response: ResponseStats | None = None) -> None:
        u = None if usage is None else [usage.prompt_tokens, usage.completion_tokens,
                                        usage.cached_tokens]
        r = None if response is None else [response.size, response.ttft, response.tpot]
        self._send(["C", ticket, status, aborted, u, r])

    def reject(self, incoming: str, target: str, status: int) -> None:
        self._send(["J", incoming, target, status])

    def outcome(self, outcome: str) -> None:
        self._send(["O", outcome])

    def upstream_failed(self, address: str) -> None:
        self._send(["U", address])

    def _send(self, msg: list[Any]) -> None:
        if not self.closed.is_set():
            self._writer.write(_frame(msg))


async def run_front(args: argparse.Namespace) -> int:
    what = f"ext_proc worker {os.getpid()}"
    drain = asyncio.Event()  # first SIGTERM/SIGINT, or the core's "T"
    stop_now = asyncio.Event()  # second signal, core gone, or "S" while draining
    stop_req = asyncio.Event()  # the core's "S" before any drain: stop with its grace
    install_shutdown_signals(drain, stop_now, what)
    drain_params = [float(args.drain_timeout), float(args.drain_quiet_period)]
    stop_grace: list[float | None] = [None]

    def on_control(msg: list[Any]) -> None:
        if msg[0] == "T":
            if not drain.is_set():
                drain_params[:] = [float(msg[1]), float(msg[2])]
                drain.set()
        elif drain.is_set():  # "S" while draining: stop at once
            stop_now.set()
        else:
            stop_grace[0] = None if msg[1] is None else float(msg[1])
            stop_req.set()

    objectives = ObjectiveStore()  # the core's, as its "M" frames send it

    def on_message(msg: list[Any]) -> None:
        if msg[0] == "M":
            objectives.load(msg[1])
        else:
            on_control(msg)

    reader, writer = await asyncio.open_unix_connection(args.core_socket)
    core = RemoteCore(reader, writer, on_message)
    director = Director(core, _front_parser(args.parser), objectives)
    # No message limit, as in one process (epp/server/app.py, _start_ext_proc): a BUFFERED
    # body over --max-request-body-bytes must reach the handler to get its 413.
    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 1),
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
    ])
    tracker = StreamTracker()
    pb_grpc.add_ExternalProcessorServicer_to_server(
        TrackedExtProc(ExtProcServicer(director, args.max_request_body_bytes,
                                       on_stream_end=core.outcome, observer_supported=False,
                                       max_headers=args.max_request_headers),
                       tracker),
        server)
    # The core reports readiness on the health port; a front is ready until it drains.
    hs = HealthReporter()
    health_pb2_grpc.add_HealthServicer_to_server(hs.servicer, server)
    address = args.bind_address
    addr = f"[{address}]:{args.grpc_port}" if ":" in address else f"{address}:{args.grpc_port}"
    if args.secure_serving:
        from epp.server.tls import server_credentials

        server.add_secure_port(addr, server_credentials(args.cert_path, args.enable_cert_reload))
    else:
        server.add_insecure_port(addr)
    await server.start()
    events = (core.closed, stop_now, drain, stop_req)
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    if core.closed.is_set() or stop_now.is_set():
        await server.stop(None)
    elif stop_req.is_set():
        await stop_server(server, stop_grace[0], stop_now)
    else:
        await hs.start_draining()

        async def core_gone() -> None:
            await core.closed.wait()
            stop_now.set()

        watch = asyncio.ensure_future(core_gone())
        try:
            await drain_server(server, tracker, drain_params[0], drain_params[1], stop_now,
                               what)
        finally:
            watch.cancel()
    writer.close()
    return 0


def front_argv(*, core_socket: str, grpc_port: int, bind_address: str, max_body: int,
               secure_serving: bool, cert_path: str | None, log_level: str,
               cert_reload: bool = False, log_format: str = "text",
               drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
               drain_quiet: float = DEFAULT_DRAIN_QUIET_S,
               max_headers: int = DEFAULT_MAX_HEADERS,
               parser_type: str | None = None) -> list[str]:
    """The command line of one front process. ``parser_type``: the config's parser
    plugin type (``parser:`` section), built in each front; None: openai-parser."""
    argv = [sys.executable, "-m", "epp.server.workers", "--core-socket", core_socket,
            "--grpc-port", str(grpc_port), "--bind-address", bind_address,
            "--max-request-body-bytes", str(max_body), "--max-request-headers",
            str(max_headers), "--drain-timeout", str(drain_timeout),
            "--drain-quiet-period", str(drain_quiet), "--log-level", log_level,
            "--log-format", log_format]
    if secure_serving:
        argv.append("--secure-serving")
    if cert_path:
        argv += ["--cert-path", cert_path]
    if cert_reload:
        argv.append("--enable-cert-reload")
    if parser_type:
        argv += ["--parser", parser_type]
    return argv


def _front_parser(parser_type: str | None) -> Parser | None:
    """The parser plugin a front parses with: the config's ``parser:`` type, built with
    its defaults (parser plugins take no parameters); None: the Director's default."""
    if not parser_type:
        return None
    from epp.framework.handle import PluginHandle
    from epp.scheduling.plugins.catalog import default_registry

    parsers: list[Parser] = []
    for t in parser_type.split(","):  # several: requestHandler.parsers (ParserRouter)
        built = default_registry().builder(t, "--parser")(
            t, None, "parser.parameters", PluginHandle())
        if not isinstance(built, Parser):
            raise SystemExit(f"--parser {t!r} is not a parser plugin")
        parsers.append(built)
    if len(parsers) == 1:
        return parsers[0]
    from epp.parsing.dispatch import ParserRouter

    return ParserRouter(parsers)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m epp.server.workers",
                                description="An epp protocol front (started by epp serve "
                                "--workers N; not meant to be run by hand).")
    p.add_argument("--core-socket", required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--bind-address", default="0.0.0.0")
    p.add_argument("--max-request-body-bytes", type=int, required=True)
    p.add_argument("--max-request-headers", type=int, default=DEFAULT_MAX_HEADERS)
    p.add_argument("--secure-serving", action="store_true")
    p.add_argument("--cert-path")
    p.add_argument("--enable-cert-reload", action="store_true")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="seconds (epp serve --drain-timeout)")
    p.add_argument("--drain-quiet-period", type=float, default=DEFAULT_DRAIN_QUIET_S,
                   help="seconds (epp serve --drain-quiet-period)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="text")
    p.add_argument("--parser", default=None,
                   help="the config's parser plugin type (default: openai-parser)")
    args = p.parse_args(argv)
    from epp.observability.logging import setup_logging

    setup_logging(args.log_level, args.log_format)
    from epp.server.loop import run as run_loop

    return run_loop(run_front(args))


if __name__ == "__main__":
    sys.exit(main())
