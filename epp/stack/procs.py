"""Process and port helpers for the local stack, the demo and the integration tests.

Everything here binds or connects to loopback only. Nothing keeps module-level state:
each :class:`ManagedProcess` owns exactly one child and its log file.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import signal
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Self

__all__ = ["LOCAL_SERVE_FLAGS", "ManagedProcess", "cancel_on_signals", "free_port",
           "kv_events_port_offset", "sim_kv_events_args", "wait_port"]

# What every `epp serve` of the local stack and the benchmarks runs with, whatever the
# defaults (epp/server/options.py: GIE's are TLS on ext_proc, tracing on, and Kubernetes
# auth on /metrics): plaintext to a loopback Envoy, whose template speaks plaintext and
# whose measurements should not include TLS; no tracing, whose per-request spans and
# exporter would be measured too; an open /metrics, scraped by the tools themselves.
LOCAL_SERVE_FLAGS = ("--secure-serving=false", "--tracing=false",
                     "--metrics-endpoint-auth=false")


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


#: Ports :func:`free_port` returned lately (oldest first), not to be returned again.
_handed_out_order: collections.deque[int] = collections.deque(maxlen=2048)
_handed_out: set[int] = set()


def _remember(port: int) -> None:
    if len(_handed_out_order) == _handed_out_order.maxlen:
        _handed_out.discard(_handed_out_order[0])
    _handed_out_order.append(port)
    _handed_out.add(port)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago.

    Ports are drawn at random from *below* the kernel's ephemeral range (10000 up to its
    start), so the outgoing connections every process keeps opening (scrapers, clients)
    cannot take a port between this call and the caller's bind — with ``bind(0)`` they
    could, and did. A port this process handed out recently is never handed out again
    (a stack asks for several ports before anything binds them: two equal draws gave
    Envoy a port the EPP bound first). Another process may still bind the port first;
    callers that need certainty must retry on ``EADDRINUSE``.
    """
    lo, _ = _ephemeral_range()
    top = max(lo - 1, 11000)
    for _ in range(200):
        port = random.randint(10000, top)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _remember(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        fallback: int = sock.getsockname()[1]
        return fallback


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def kv_events_port_offset(ports: Sequence[int]) -> int:
    """An offset ``N`` such that every ``port + N`` was free a moment ago, is none of
    ``ports`` and lies below the kernel's ephemeral range: the pods of a single-host pool
    (``epp sim --kv-events-port-offset N``) publish their KV events there, and the EPP
    dials them there (``precise-prefix-cache-producer``'s
    ``podDiscoveryConfig.endpointPortOffset``). Drawn at random, as :func:`free_port`."""
    lo, _ = _ephemeral_range()
    top = max(lo - 1, 11000)
    taken = set(ports)
    for _ in range(200):
        n = random.choice((-1, 1)) * random.randint(100, 9000)
        want = [p + n for p in ports]
        if all(1024 <= q <= top and q not in taken for q in want) and all(
                _port_free(q) for q in want):
            return n
    raise RuntimeError(f"no free KV-event ports for the pods on {sorted(ports)}")


def sim_kv_events_args(ports: Sequence[int]) -> tuple[list[str], int]:
    """``epp sim`` arguments that make the pods on ``ports`` publish vLLM KV events, each
    on its own HTTP port + the returned offset (:func:`kv_events_port_offset`). The PUB
    sockets bind ``*`` — vLLM binds only a wildcard endpoint; a concrete address would be
    dialled — so nothing but the EPP on this host connects to them."""
    offset = kv_events_port_offset(ports)
    cfg = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
           '"endpoint": "tcp://*:5557"}')
    return ["--kv-events-config", cfg, f"--kv-events-port-offset={offset}"], offset


async def wait_port(host: str, port: int, timeout: float = 10.0) -> None:
    """Wait until a TCP connection to ``host:port`` succeeds.

    Retries every 20 ms. Raises :class:`TimeoutError` when no connection succeeded
    within ``timeout`` seconds. The probe connection is closed at once.
    """
    deadline = time.monotonic() + timeout
    last_error: OSError | None = None
    while True:
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), timeout=max(0.05, deadline - time.monotonic())
            )
        except (TimeoutError, OSError) as exc:
            last_error = exc if isinstance(exc, OSError) else None
        else:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"{host}:{port} did not accept connections within {timeout}s"
                + (f" (last error: {last_error})" if last_error else "")
            )
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def cancel_on_signals(
    signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGHUP),
) -> Iterator[list[signal.Signals]]:
    """Within the block, the first of ``signals`` cancels the current task — what
    ``asyncio.run`` does on SIGINT — so that its ``finally`` blocks and exit stacks stop
    the children it started; without this, SIGTERM or SIGHUP would end the Python process
    at once and leave its children (each in its own session, see
    :class:`ManagedProcess`) running. Further signals are recorded but do not interrupt
    that cleanup. Yields the list of signals received (empty unless one came).

    Needs a running event loop; on platforms without ``loop.add_signal_handler`` the
    signals keep their default action.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("cancel_on_signals needs a running task")
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        if len(received) == 1:
            task.cancel()

    installed: list[signal.Signals] = []
    for sig in signals:
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError, ValueError):
            continue
        installed.append(sig)
    try:
        yield received
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


class ManagedProcess:
    """One child process with its stdout and stderr going to a log file.

    Lifecycle: :meth:`start` once, then :meth:`stop` (idempotent). The child runs in its
    own session (process group) so that :meth:`stop` also reaches grandchildren it forks;
    signals go to that group. Also an async context manager: ``async with`` calls
    :meth:`stop` on exit.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        """Describe the process; nothing starts until :meth:`start`.

        ``env``, when given, is merged over ``os.environ`` (it does not replace it).
        ``log_path`` is truncated at start; its parent directory is created.
        """
        if not argv:
            raise ValueError("argv must name a program")
        self.argv: tuple[str, ...] = tuple(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The child's pid, or None before :meth:`start`."""
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """The exit status once the child has exited (negative: killed by that signal),
        None while it runs or before :meth:`start`."""
        return self._proc.returncode if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True between a successful :meth:`start` and the child's exit."""
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        """Launch the child. Raises RuntimeError if already started, OSError if the
        program cannot be executed."""
        if self._proc is not None:
            raise RuntimeError(f"process already started: {self.argv[0]}")
        self._log = self._open_log()
        env = {**os.environ, **self.env} if self.env is not None else None
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=self._log,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                cwd=self.cwd,
                start_new_session=True,
            )
        except BaseException:
            self._log.close()
            self._log = None
            raise

    def _open_log(self) -> IO[bytes]:
        """Create the parent directory and truncate the log (a local file: fast enough to
        do on the loop). The handle is closed by :meth:`stop`."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.log_path, "wb")

    async def wait(self) -> int:
        """Wait for the child to exit and return its exit status."""
        if self._proc is None:
            raise RuntimeError("process not started")
        return await self._proc.wait()

    def _signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the child's process group; ignore a child already gone."""
        assert self._proc is not None
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            # The group may be gone and its id reused; fall back to the child alone.
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(sig)

    async def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the child, SIGKILL it after ``grace`` seconds, and reap it.

        Returns the exit status (None if never started). Idempotent; also closes the log
        file. Safe to call after the child has exited by itself. Any process left in the
        child's process group gets a SIGKILL too.
        """
        if self._proc is None:
            return None
        try:
            if self._proc.returncode is None:
                self._signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(self._proc.wait(), timeout=grace)
                except TimeoutError:
                    self._signal(signal.SIGKILL)
                    await self._proc.wait()
            # Stragglers forked by the child (same session) do not outlive it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
        return self._proc.returncode

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the log file (empty string if there is none yet)."""
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return ""
        lines = data.decode("utf-8", errors="replace").splitlines()
        return "\n".join(lines[-n:])

    async def __aenter__(self) -> Self:
        if self._proc is None:
            await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def __repr__(self) -> str:
        return f"ManagedProcess({self.argv[0]!r}, pid={self.pid}, returncode={self.returncode})"
