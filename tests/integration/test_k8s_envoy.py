"""`epp serve` on Kubernetes, without a cluster: real EPP processes against the fake API
server (tests/k8s_fake), readiness, leader election between two processes, and real Envoy
routing to the `epp sim` pods the fake API server reports."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp import keys
from epp.stack.envoy import EnvoyProcess, render_envoy_config
from epp.stack.procs import LOCAL_SERVE_FLAGS, ManagedProcess, free_port, wait_port
from tests.integration.conftest import ROOT, Upstreams, eventually
from tests.integration.plugins import CONFIG
from tests.k8s_fake import FakeApiServer

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
APP = {"app": "sim"}


@pytest_asyncio.fixture(scope="module")
async def fake() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer(bookmark_interval_s=1.0)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(scope="module")
def kubeconfig(fake: FakeApiServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake.write_kubeconfig(tmp_path_factory.mktemp("kube") / "kubeconfig")


class KubeEpp:
    """One `epp serve` process discovering endpoints through the fake API server."""

    def __init__(self, workdir: Path, kubeconfig: Path, *args: str,
                 config: str | None = CONFIG, kube: bool = True) -> None:
        self.grpc_port, self.health_port, self.metrics_port = (free_port() for _ in range(3))
        argv = [sys.executable, "-m", "epp.cli", "serve", *LOCAL_SERVE_FLAGS, "--drain-quiet-period", "0", "--bind-address", "127.0.0.1",
                "--grpc-port", str(self.grpc_port), "--grpc-health-port", str(self.health_port),
                "--metrics-port", str(self.metrics_port), "--no-metrics-scraping",
                "--log-level", "info", *args]
        if kube:
            argv += ["--kubeconfig", str(kubeconfig)]
        if config is not None:
            argv += ["--config-text", config]
        env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.proc = ManagedProcess(argv, log_path=workdir / f"epp-{self.grpc_port}.log",
                                   env=env, cwd=ROOT)

    @staticmethod
    async def static(factory: Callable[..., Awaitable[KubeEpp]], endpoints: str,
                     *args: str) -> KubeEpp:
        """An EPP with a static endpoint list (no Kubernetes source)."""
        return await factory("--endpoints", endpoints, *args, kube=False)

    async def start(self) -> None:
        await self.proc.start()
        try:
            await wait_port("127.0.0.1", self.health_port, timeout=20)
        except TimeoutError:
            raise RuntimeError(f"epp did not start:\n{self.proc.log_tail()}") from None

    async def health(self, service: str = keys.HEALTH_READINESS) -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.health_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                     timeout=2)
            except grpc.aio.AioRpcError:
                return -1
            return int(r.status)

    async def ready(self) -> bool:
        return await self.health() == SERVING

    def kill(self) -> None:
        """SIGKILL (a crash: no Lease release)."""
        assert self.proc.pid is not None
        os.killpg(self.proc.pid, signal.SIGKILL)

    async def stop(self) -> None:
        await self.proc.stop()


@pytest_asyncio.fixture
async def epps(tmp_path: Path, kubeconfig: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[KubeEpp] = []

    async def make(*args: str, config: str | None = CONFIG, kube: bool = True) -> KubeEpp:
        e = KubeEpp(tmp_path, kubeconfig, *args, config=config, kube=kube)
        made.append(e)
        await e.start()
        return e

    yield make
    for e in made:
        await e.stop()


async def test_readiness_follows_the_pool(fake: FakeApiServer, epps: Any) -> None:
    ns = "ready-test"
    epp = await epps("--pool-name", "pool", "--pool-namespace", ns)
    assert await epp.health(keys.HEALTH_LIVENESS) == SERVING
    await asyncio.sleep(0.5)  # not a wait: time to sync, and it must not turn ready meanwhile
    assert not await epp.ready()                        # no InferencePool yet
    assert await epp.health(keys.HEALTH_EXT_PROC) != SERVING
    fake.put_pod("p", "10.1.0.1", labels=APP, namespace=ns)
    fake.put_pool("pool", APP, [8000], namespace=ns)
    await eventually(epp.ready)
    assert await epp.health(keys.HEALTH_EXT_PROC) == SERVING
    fake.delete("inferencepools", "pool", ns)
    await eventually(lambda: _not(epp.ready))
    assert await epp.health(keys.HEALTH_LIVENESS) == SERVING


async def _not(check: Callable[[], Awaitable[bool]]) -> bool:
    return not await check()


async def test_leader_election_between_two_processes(fake: FakeApiServer, epps: Any) -> None:
    ns = "ha-test"
    fake.put_pool("pool", APP, [8000], namespace=ns)
    fake.put_pod("p", "10.2.0.1", labels=APP, namespace=ns)
    ha = ("--pool-name", "pool", "--pool-namespace", ns, "--ha-enable-leader-election",
          "--ha-lease-duration", "4s", "--ha-renew-deadline", "3s",
          "--ha-retry-period", "200ms")
    a, b = await asyncio.gather(epps(*ha), epps(*ha))

    async def one_ready() -> list[KubeEpp] | None:
        states = [await e.ready() for e in (a, b)]
        return [e for e, r in zip((a, b), states) if r] if sum(states) == 1 else None

    leader = (await eventually(one_ready))[0]
    standby = b if leader is a else a
    await asyncio.sleep(0.6)  # not a wait: stable over several renewals
    assert await leader.ready() and not await standby.ready()
    assert await standby.health(keys.HEALTH_LIVENESS) == SERVING
    lease = fake.get("leases", f"epp-{ns}-pool.{keys.K8S_LEASE_SUFFIX}", ns)
    assert lease is not None and lease["spec"]["leaseDurationSeconds"] == 4

    # Graceful stop: the leader releases the Lease; the standby takes over at once.
    t0 = asyncio.get_running_loop().time()
    await leader.stop()
    await eventually(standby.ready, timeout=5)
    # Sooner than the 4 s lease (includes the old leader's own shutdown).
    assert asyncio.get_running_loop().time() - t0 < 3.0

    # A new replica joins as standby; then the leader crashes: failover after the lease.
    c = await epps(*ha)
    await asyncio.sleep(0.8)  # not a wait: c keeps retrying, and must not take a held Lease
    assert await standby.ready() and not await c.ready()
    t0 = asyncio.get_running_loop().time()
    standby.kill()
    await eventually(c.ready, timeout=12)
    assert asyncio.get_running_loop().time() - t0 > 3.0   # it had to wait for the lapse


async def test_bad_kubernetes_flags_fail_at_startup(kubeconfig: Path) -> None:
    """One end-to-end check of the exit status and message (the rest: unit tests)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", "serve", *LOCAL_SERVE_FLAGS, "--drain-quiet-period", "0", "--bind-address", "127.0.0.1",
        "--grpc-port", str(free_port()), "--grpc-health-port", str(free_port()),
        "--metrics-port", str(free_port()), "--pool-name", "p", "--kubeconfig",
        "/nonexistent/kubeconfig",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1, err.decode()
    assert "epp: error: --kubeconfig /nonexistent/kubeconfig: no such file" in err.decode()


# ------------------------------------------------------------------ through real Envoy
async def _post(session: aiohttp.ClientSession, url: str, pin: int) -> tuple[int, str]:
    body = orjson.dumps({"model": "sim-model", "prompt": uuid.uuid4().hex, "max_tokens": 2})
    async with session.post(url + "/v1/completions", data=body,
                            headers={"content-type": "application/json",
                                     "x-test-pin": str(pin)}) as r:
        await r.read()
        return r.status, r.headers.get("x-sim-server", "")


async def test_traffic_follows_the_pods_the_api_server_reports(
        fake: FakeApiServer, epps: Any, upstreams: Upstreams, session: aiohttp.ClientSession,
        tmp_path: Path) -> None:
    """Four `epp sim` servers on 127.0.0.1; the pool targets all four ports and each fake
    pod (podIP 127.0.0.1) takes traffic on its own port through the active-ports
    annotation — one endpoint per pod, as on a real cluster."""
    ns = "envoy-test"
    ports = upstreams.ports
    pods = [f"sim-{i}" for i in range(len(ports))]

    def put(i: int, ready: bool = True, gang: str | None = None) -> None:
        labels = APP if gang is None else {**APP, keys.LABEL_GROVE_PODGANG: gang}
        fake.put_pod(pods[i], "127.0.0.1", labels=labels, namespace=ns, ready=ready,
                     annotations={keys.ANNOTATION_ACTIVE_PORTS: str(ports[i])})

    fake.put_pool("pool", APP, ports, namespace=ns)
    put(0)
    put(1)
    put(2, ready=False)                                   # pod 3 does not exist yet
    epp = await epps("--pool-name", "pool", "--pool-namespace", ns)
    await eventually(epp.ready)
    envoy = EnvoyProcess()
    listen = free_port()
    cfg = render_envoy_config(listen_port=listen, epp_port=epp.grpc_port,
                              admin_port=free_port(), body_mode="FULL_DUPLEX_STREAMED",
                              max_body_bytes=1 << 20)
    await envoy.start(cfg, tmp_path)
    try:
        await envoy.wait_ready()
        url = f"http://127.0.0.1:{listen}"

        async def served_by(pin: int) -> str:
            status, server = await _post(session, url, pin)
            assert status == 200, status
            return server

        # Pinned to a ready pod's port: that pod serves. Pinned to a NotReady or absent
        # pod's port: the pin matches no endpoint, so a ready pod serves instead.
        assert await served_by(ports[0]) == f"sim-{ports[0]}"
        assert await served_by(ports[1]) == f"sim-{ports[1]}"
        ready_now = {f"sim-{ports[0]}", f"sim-{ports[1]}"}
        for _ in range(5):
            assert await served_by(ports[2]) in ready_now
            assert await served_by(ports[3]) in ready_now

        put(2)                                            # becomes Ready
        put(3)                                            # scheduled and Ready
        await eventually(lambda: _is(served_by(ports[2]), f"sim-{ports[2]}"))
        await eventually(lambda: _is(served_by(ports[3]), f"sim-{ports[3]}"))

        put(0, ready=False)                               # readiness probe fails
        fake.delete("pods", pods[1], ns)                  # scaled down
        await eventually(lambda: _is_not(served_by(ports[0]), f"sim-{ports[0]}"))
        await eventually(lambda: _is_not(served_by(ports[1]), f"sim-{ports[1]}"))
        for _ in range(5):
            assert await served_by(ports[0]) in {f"sim-{ports[2]}", f"sim-{ports[3]}"}

        # Pod 2 turns out to lead a Grove gang whose worker (not in the pool) is not
        # Ready: the gang is incomplete, so pod 2 takes nothing until the worker is up.
        fake.put_podgang("gang", {"leader": ([pods[2]], 1), "worker": (["worker-0"], 1)},
                         namespace=ns)
        fake.put_pod("worker-0", None, labels={keys.LABEL_GROVE_PODGANG: "gang"},
                     namespace=ns, ready=False)
        put(2, gang="gang")
        await eventually(lambda: _is(served_by(ports[2]), f"sim-{ports[3]}"))
        for _ in range(5):
            assert await served_by(ports[2]) == f"sim-{ports[3]}"
        assert await _gauge(session, epp.metrics_port, "epp_gang_excluded_pods") == 1.0
        fake.put_pod("worker-0", "10.9.9.9", labels={keys.LABEL_GROVE_PODGANG: "gang"},
                     namespace=ns)
        await eventually(lambda: _is(served_by(ports[2]), f"sim-{ports[2]}"))
        assert await _gauge(session, epp.metrics_port, "epp_gang_excluded_pods") == 0.0

        fake.delete("inferencepools", "pool", ns)          # pool gone: nothing to route to
        await eventually(lambda: _status_is(_post(session, url, ports[2]), 503))
    finally:
        await envoy.stop()


async def _gauge(session: aiohttp.ClientSession, port: int, name: str) -> float:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


async def _is(result: Awaitable[str], want: str) -> bool:
    return await result == want


async def _is_not(result: Awaitable[str], unwanted: str) -> bool:
    return await result != unwanted


async def _status_is(result: Awaitable[tuple[int, str]], want: int) -> bool:
    return (await result)[0] == want


async def test_standalone_envoy_snippet_routes_over_tls_to_the_epp(
        epps: Any, upstreams: Upstreams, session: aiohttp.ClientSession,
        tmp_path: Path) -> None:
    """deploy/gateways/envoy-standalone.yaml's Envoy config, run by real Envoy: TLS to an
    EPP with --secure-serving (self-signed, unverified — as gateways built for GIE do)."""
    import yaml

    docs = list(yaml.safe_load_all((ROOT / "deploy/gateways/envoy-standalone.yaml")
                                   .read_text()))
    cm = next(d for d in docs if d and d["kind"] == "ConfigMap")
    cfg = yaml.safe_load(cm["data"]["envoy.yaml"])
    port = upstreams.ports[0]
    epp = await KubeEpp.static(epps, f"127.0.0.1:{port}", "--secure-serving")
    listen, admin = free_port(), free_port()
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen}
    epp_cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "epp")
    epp_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"]["socket_address"] = {"address": "127.0.0.1", "port_value": epp.grpc_port}
    envoy = EnvoyProcess()
    await envoy.start(yaml.safe_dump(cfg), tmp_path)
    try:
        await envoy.wait_ready()
        # Envoy's first TLS connection to the EPP can race the EPP's startup on a busy
        # machine: allow a few seconds for the first success, then require steady 200s.
        async def answered() -> tuple[int, str] | None:
            status, server = await _post(session, f"http://127.0.0.1:{listen}", port)
            return (status, server) if status == 200 else None

        assert await eventually(answered, timeout=15, interval=0.2) == (200, f"sim-{port}")
        for _ in range(3):
            assert await _post(session, f"http://127.0.0.1:{listen}", port) == (200, f"sim-{port}")
    finally:
        await envoy.stop()
