"""`epp envoy-config` prints a configuration real Envoy runs as is (issue 14).

Every body mode × gateway shape passes Envoy's own validation (`envoy --mode validate`),
and the default one, started as printed, routes a request through a running EPP to the
simulated pod it picks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest

from epp.stack.envoy import BODY_MODES, RESPONSE_PATHS, EnvoyProcess, envoy_binary
from epp.stack.procs import free_port
from tests.integration.conftest import Epp, start_sims

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def envoy_config(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epp.cli", "envoy-config", *args],
                          capture_output=True, text=True, timeout=30, cwd=ROOT, check=False)


@pytest.mark.parametrize("tls", ["true", "false"])
@pytest.mark.parametrize("shape", RESPONSE_PATHS)
@pytest.mark.parametrize("body_mode", BODY_MODES)
def test_every_shape_validates_in_envoy(tmp_path: Path, body_mode: str, shape: str,
                                        tls: str) -> None:
    out = tmp_path / "envoy.yaml"
    r = envoy_config("--epp", "10.1.2.3:9002", "--listen", "127.0.0.1:18081",
                     "--body-mode", body_mode, "--response-path", shape, "--epp-tls", tls,
                     "-o", str(out))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "${" not in text  # no placeholder left for the user to fill in
    assert "10.1.2.3" in text and "9002" in text
    assert ("UpstreamTlsContext" in text) == (tls == "true")
    v = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(out)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert v.returncode == 0, v.stdout + v.stderr


def test_fallback_endpoints_validate_and_bad_addresses_are_named(tmp_path: Path) -> None:
    out = tmp_path / "envoy.yaml"
    r = envoy_config("--pool-endpoints", "10.0.0.1:8000,10.0.0.2:8000", "-o", str(out))
    assert r.returncode == 0, r.stderr
    v = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(out)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert v.returncode == 0, v.stdout + v.stderr
    for args, message in [(["--epp", "nowhere"], "--epp: expected HOST:PORT"),
                          (["--listen", "0.0.0.0:99999"], "--listen: expected HOST:PORT"),
                          (["--pool-endpoints", ","], "--pool-endpoints: give at least one")]:
        r = envoy_config(*args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plaintext"])
async def test_the_printed_config_routes_through_the_epp(tmp_path: Path, tls: bool) -> None:
    """TLS: epp serve's default (--secure-serving, self-signed) and envoy-config's."""
    pods = [free_port(), free_port()]
    sims = await start_sims(pods, tmp_path / "sim.log")
    epp = Epp(tmp_path, tmp_path / "endpoints.yaml",
              extra_args=["--secure-serving=true"] if tls else [])
    epp.write_endpoints(pods)
    envoy = EnvoyProcess()
    try:
        await epp.start()
        listen, admin = free_port(), free_port()
        r = envoy_config("--epp", f"127.0.0.1:{epp.grpc_port}", "--listen",
                         f"127.0.0.1:{listen}", "--admin-port", str(admin),
                         *([] if tls else ["--epp-tls", "false"]))
        assert r.returncode == 0, r.stderr
        await envoy.start(r.stdout, tmp_path)
        await envoy.wait_ready()
        body = orjson.dumps({"model": "sim-model", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hello"}]})
        async with aiohttp.ClientSession() as s, s.post(
                f"http://127.0.0.1:{listen}/v1/chat/completions", data=body,
                headers={"content-type": "application/json"}) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        assert answer["choices"][0]["message"]["content"]
        # The EPP placed it: its own counter saw the request.
        async with aiohttp.ClientSession() as s, s.get(
                f"http://127.0.0.1:{epp.metrics_port}/metrics") as m:
            text = await m.text()
        assert 'inference_objective_request_total{model_name="sim-model"' in text
    finally:
        await envoy.stop()
        await epp.stop()
        await sims.stop()
