"""`epp serve` startup errors and health, `epp check-config`, as a user runs them."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.stack.procs import ManagedProcess, free_port, wait_port

ROOT = Path(__file__).resolve().parents[2]


def run_epp(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epp.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, check=False)


def serve_args(**ports: int) -> list[str]:
    return ["serve", "--drain-quiet-period", "0", "--bind-address", "127.0.0.1",
            "--grpc-port", str(ports.get("grpc", free_port())),
            "--grpc-health-port", str(ports.get("health", free_port())),
            "--metrics-port", str(ports.get("metrics", free_port()))]


@pytest.mark.parametrize("which", ["grpc", "health", "metrics"])
def test_port_in_use_is_a_clear_startup_error(which: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_epp(*serve_args(**{which: port}), "--endpoints", "127.0.0.1:8000")
    assert r.returncode == 1
    assert "epp: error: cannot listen" in r.stderr and str(port) in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--endpoints-file", "/nonexistent/endpoints.yaml"], "cannot read endpoints file"),
    (["--endpoints", "not-an-address"], "expected ip:port"),
    (["--endpoints", "127.0.0.1:8000", "--config-text", "plugins: [{type: nope}]"],
     "unknown plugin type 'nope'"),
    (["--endpoints", "127.0.0.1:8000", "--config-file", "/nonexistent.yaml"],
     "cannot read config file"),
])
def test_bad_inputs_fail_at_startup(args: list[str], needle: str) -> None:
    r = run_epp(*serve_args(), *args)
    assert r.returncode == 1, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_bad_endpoints_file_names_the_entry(tmp_path: Path) -> None:
    f = tmp_path / "eps.yaml"
    f.write_text("endpoints:\n- {address: 10.0.0.1, port: 8000}\n- {address: 10.0.0.2}\n")
    r = run_epp(*serve_args(), "--endpoints-file", str(f))
    assert r.returncode == 1
    assert f"{f}: endpoints[1]" in r.stderr and "'port'" in r.stderr


def test_missing_endpoint_source_is_a_usage_error() -> None:
    r = run_epp("serve")
    assert r.returncode == 2 and "--endpoints" in r.stderr


def test_check_config_accepts_examples_and_rejects_bad(tmp_path: Path) -> None:
    for example in sorted((ROOT / "config").glob("*.yaml")):
        r = run_epp("check-config", str(example))
        assert r.returncode == 0, (example, r.stderr)
        assert "OK" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("plugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 0}\n")
    r = run_epp("check-config", str(bad))
    assert r.returncode == 1
    assert f"{bad}: plugins[0].parameters.maxNumOfEndpoints: must be >= 1" in r.stderr


async def test_health_services_report_serving(tmp_path: Path) -> None:
    health_port, grpc_port = free_port(), free_port()
    proc = ManagedProcess([sys.executable, "-m", "epp.cli",
                           *serve_args(grpc=grpc_port, health=health_port),
                           "--endpoints", "127.0.0.1:8000"], log_path=tmp_path / "epp.log",
                          cwd=ROOT)
    await proc.start()
    try:
        await wait_port("127.0.0.1", health_port, timeout=20)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for svc in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING, svc
    finally:
        await proc.stop()
    assert proc.returncode == 0  # SIGTERM → graceful stop, exit 0
