"""`epp serve` with Kubernetes flags: validation at startup and health, in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp import keys
from epp.cli import main as cli_main
from epp.discovery.reflector import ReflectorOptions
from epp.errors import ConfigError
from epp.server.app import EppServer, ServeOptions
from epp.server.options import (
    HaOptions,
    KubernetesSourceOptions,
    ListenOptions,
    ScrapingOptions,
    StaticSourceOptions,
    TlsOptions,
)
from epp.stack.procs import free_port
from tests.k8s_fake import FakeApiServer
from tests.polling import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
APP = {"app": "vllm"}
NO_SCRAPING = ScrapingOptions(enabled=False)


def _listen(**ports: int) -> ListenOptions:
    """Free ports on 127.0.0.1 (``ports`` overrides some)."""
    return ListenOptions(**{"grpc_port": free_port(), "grpc_health_port": free_port(),
                            "metrics_port": free_port(), **ports}, bind_address="127.0.0.1")


@pytest.mark.parametrize("args, message", [
    (["--endpoint-selector", "app=x"], "--endpoint-target-ports"),
    (["--endpoint-target-ports", "8000", "--pool-name", "p"], "needs --endpoint-selector"),
    (["--endpoints", "127.0.0.1:8000", "--ha-enable-leader-election"],
     "needs a Kubernetes endpoint source"),
    (["--pool-name", "p", "--endpoints", "127.0.0.1:8000"], "exactly one endpoint source"),
    (["--endpoint-selector", "app", "--endpoint-target-ports", "8000"], "key=value"),
    (["--endpoint-selector", "app=x", "--endpoint-target-ports", "80000"], "1..65535"),
    (["--endpoint-selector", "app=x", "--endpoint-target-ports", "8000",
      "--ha-enable-leader-election"], "needs --pool-name NAME to name the Lease"),
    (["--pool-name", "p", "--ha-enable-leader-election", "--ha-lease-duration", "5s",
      "--ha-renew-deadline", "10s"], "lease duration must exceed"),
    (["--endpoints", "127.0.0.1:8000", "--pool-namespace", "x"], "need --pool-name"),
    (["--pool-name", "p", "--kubeconfig", "/nonexistent"], "no such file"),
])
def test_bad_kubernetes_flags(args: list[str], message: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    ports = ["--grpc-port", str(free_port()), "--grpc-health-port", str(free_port()),
             "--metrics-port", str(free_port()), "--bind-address", "127.0.0.1"]
    assert cli_main(["serve", *ports, *args]) == 1
    assert message in capsys.readouterr().err


def test_serve_help_lists_the_kubernetes_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--pool-name", "--pool-namespace", "--pool-group", "--endpoint-selector",
                 "--endpoint-target-ports", "--kubeconfig", "--ha-enable-leader-election",
                 "--ha-lease-duration", "--ha-renew-deadline", "--ha-retry-period",
                 "--no-node-labels"):
        assert flag in out


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer(bookmark_interval_s=0)
    await server.start()
    yield server
    await server.stop()


async def _health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2)
        return int(r.status)


async def test_server_ready_only_after_sync_and_while_leader(fake: FakeApiServer,
                                                             tmp_path: Path) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put_pod("a", "10.0.0.1", labels=APP)
    fake.fail_next("/api/v1/namespaces/default/pods", 500, times=3)  # a slow first sync
    health = free_port()
    server = EppServer(ServeOptions(
        listen=_listen(grpc_health_port=health),
        kubernetes=KubernetesSourceOptions(
            pool_name="pool", pool_namespace="default",
            kubeconfig=str(fake.write_kubeconfig(tmp_path / "kc")),
            reflector=ReflectorOptions(backoff_initial_s=0.2)),
        scraping=NO_SCRAPING,
        ha=HaOptions(enable_leader_election=True, lease_duration_s=1.0, renew_deadline_s=0.6,
                     retry_period_s=0.1)))
    await server.start()
    try:
        assert await _health(health, keys.HEALTH_LIVENESS) == SERVING
        assert await _health(health, keys.HEALTH_READINESS) != SERVING  # not synced yet

        async def ready() -> bool:
            return await _health(health, keys.HEALTH_READINESS) == SERVING

        async def not_ready() -> bool:
            return not await ready()

        await eventually(ready)
        assert await _health(health, keys.HEALTH_EXT_PROC) == SERVING
        assert server.elector is not None and server.elector.is_leader
        assert [e.name for e in server.store.snapshot()] == ["a-rank-0"]
        # Another replica takes the Lease (e.g. ours could not renew): readiness drops.
        lease = fake.get("leases", server.elector.options.name)
        assert lease is not None
        lease["spec"]["holderIdentity"] = "other"
        fake.put("leases", lease)
        await eventually(not_ready)
        assert await _health(health, keys.HEALTH_READINESS) != SERVING
        assert await _health(health, keys.HEALTH_LIVENESS) == SERVING
    finally:
        await server.stop(0)


async def test_standalone_needs_no_crd(fake: FakeApiServer, tmp_path: Path) -> None:
    fake.put_pod("a", "10.0.0.1", labels=APP)
    server = EppServer(ServeOptions(
        listen=_listen(),
        kubernetes=KubernetesSourceOptions(
            endpoint_selector="app=vllm", endpoint_target_ports="8000",
            kubeconfig=str(fake.write_kubeconfig(tmp_path / "kc"))),
        scraping=NO_SCRAPING))
    await server.start()
    try:
        assert server.k8s_source is not None
        assert await server.k8s_source.wait_ready(5)
        assert [e.key for e in server.store.snapshot()] == ["10.0.0.1:8000"]
        assert fake.requests[("GET", "inferencepools", "list")] == 0
    finally:
        await server.stop(0)


async def test_start_validates_before_connecting() -> None:
    with pytest.raises(ConfigError, match="exactly one endpoint source"):
        await EppServer(ServeOptions(static=StaticSourceOptions(endpoints="127.0.0.1:1"),
                                     kubernetes=KubernetesSourceOptions(pool_name="p"))).start()


async def _tls_health(port: int, root: bytes) -> int:
    creds = grpc.ssl_channel_credentials(root_certificates=root)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=[
            ("grpc.ssl_target_name_override", "localhost")]) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=keys.HEALTH_LIVENESS), timeout=2)
        return int(r.status)


@pytest.mark.parametrize("own_cert", [False, True], ids=["self-signed", "cert-path"])
async def test_secure_serving(tmp_path: Path, own_cert: bool) -> None:
    import ssl

    from epp.server.tls import self_signed_key_pair

    cert_dir = None
    if own_cert:
        key, cert = self_signed_key_pair()
        (tmp_path / "tls.key").write_bytes(key)
        (tmp_path / "tls.crt").write_bytes(cert)
        cert_dir = str(tmp_path)
    grpc_port, health = free_port(), free_port()
    server = EppServer(ServeOptions(
        listen=_listen(grpc_port=grpc_port, grpc_health_port=health),
        static=StaticSourceOptions(endpoints="127.0.0.1:1"), scraping=NO_SCRAPING,
        tls=TlsOptions(secure_serving=True, cert_path=cert_dir)))
    await server.start()
    try:
        served = ssl.get_server_certificate(("127.0.0.1", grpc_port)).encode()
        if own_cert:
            assert served.strip() == (tmp_path / "tls.crt").read_bytes().strip()
        assert await _tls_health(grpc_port, served) == SERVING     # ext_proc port: TLS
        assert await _health(health, keys.HEALTH_LIVENESS) == SERVING  # probes: plaintext
        with pytest.raises(grpc.aio.AioRpcError):
            await _health(grpc_port, keys.HEALTH_LIVENESS)       # no plaintext on ext_proc
    finally:
        await server.stop(0)


async def test_cert_path_without_files_fails(tmp_path: Path) -> None:
    server = EppServer(ServeOptions(
        listen=_listen(), static=StaticSourceOptions(endpoints="127.0.0.1:1"),
        scraping=NO_SCRAPING, tls=TlsOptions(secure_serving=True, cert_path=str(tmp_path))))
    with pytest.raises(ConfigError, match="tls.key"):
        await server.start()
