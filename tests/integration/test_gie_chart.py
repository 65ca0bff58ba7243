"""Swapping the image in GIE's Helm chart: GIE v1.5.0's `inferencepool` chart is rendered
with Helm's own engine (helm-python-sdk), and `epp serve` runs with exactly the args of
the chart's EPP container. The chart's probes must pass the way the kubelet runs them
(gRPC health, the chart's service name on the chart's port), and an ext_proc client must
connect over TLS with the self-signed certificate, as gateways built for GIE do.

Without a cluster, a test has to change a few things; each is a substitution a pod makes
too, or an addition the chart leaves to Go's defaults (see :func:`epp_argv`):

1. ``--config-file /config/default-plugins.yaml``: the chart mounts its ConfigMap at
   /config; here the rendered ConfigMap's file is written to a temporary directory, and
   the flag points there.
2. ``--grpc-port``, ``--grpc-health-port``, ``--metrics-port``, ``--bind-address
   127.0.0.1``: the chart relies on GIE's defaults (9002, 9003, 9090 on every interface);
   a test takes free loopback ports. The probes' port (9003) is the health port here.
3. ``--kubeconfig``: in the pod the EPP uses its service account; here the fake API
   server (tests/k8s_fake), which holds the chart's rendered InferencePool and a pod.
4. ``--drain-quiet-period 0``: the test stops the EPP with SIGTERM and has no gateway
   that needs the 30 s drain window.
5. ``--secure-serving=true``, only while epp/server/options.py's DEFAULT_SECURE_SERVING
   is False: GIE's default, which the chart relies on, given explicitly until this EPP's
   default is flipped to it.

The environment gets what the chart's ``env`` fieldRefs give (NAMESPACE, POD_NAME).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
import yaml
from aiohttp import web
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp import keys
from epp.server.options import DEFAULT_SECURE_SERVING
from epp.stack.procs import ManagedProcess, free_port, wait_port
from tests.k8s_fake import FakeApiServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHARTS = ROOT / "tests/fixtures/gie-v1.5.0/config/charts"
RELEASE, NAMESPACE = "vllm-pool", "llm"
SERVING = health_pb2.HealthCheckResponse.SERVING
MODEL_SERVER = {"app": "vllm-llama3"}

# Renders in a subprocess: keeps helm-python-sdk's Go runtime out of the test process (as
# tests/unit/test_k8s_deploy.py does through deploy/helm/render.py).
_RENDER = """
import json, sys
import helm_python as helm
chart, values, name, namespace = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
with helm.Chart.load(chart) as c:
    out = c.render(values, name=name, namespace=namespace, is_install=True)
print(json.dumps(out))
"""


def render(workdir: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    """GIE's inferencepool chart, with its epplib dependency in charts/ (what `helm
    dependency build` puts there), rendered like `helm template RELEASE -n NAMESPACE`."""
    chart = workdir / "inferencepool"
    shutil.copytree(CHARTS / "inferencepool", chart)
    shutil.copytree(CHARTS / "epplib", chart / "charts" / "epplib")
    r = subprocess.run([sys.executable, "-c", _RENDER, str(chart), json.dumps(values),
                        RELEASE, NAMESPACE], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    docs = []
    for path, text in sorted(json.loads(r.stdout).items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def epp_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    dep = _one(docs, "Deployment")
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "epp"]
    return c


class ChartEpp:
    """One `epp serve` with the chart's container args and the test's substitutions."""

    def __init__(self, workdir: Path, container: dict[str, Any], config_file: Path,
                 kubeconfig: Path, n: int) -> None:
        self.args = [str(a) for a in container["args"]]
        self.health_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.probe_ports = {int(container[p]["grpc"]["port"]): self.health_port
                            for p in ("livenessProbe", "readinessProbe")}
        argv = list(self.args)
        i = argv.index("--config-file")  # 1. the ConfigMap's mount
        argv[i + 1] = str(config_file)
        argv += ["--grpc-port", str(self.grpc_port),  # 2. free loopback ports
                 "--grpc-health-port", str(self.health_port),
                 "--metrics-port", str(self.metrics_port), "--bind-address", "127.0.0.1",
                 "--kubeconfig", str(kubeconfig),  # 3. the fake API server
                 "--drain-quiet-period", "0"]  # 4. no gateway to drain for
        if not DEFAULT_SECURE_SERVING:
            argv.append("--secure-serving=true")  # 5. GIE's default, until it is ours
        env = {"NAMESPACE": NAMESPACE, "POD_NAME": f"{RELEASE}-epp-5d8f9b7c6-x{n}k2q",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = ManagedProcess([sys.executable, "-m", "epp.cli", "serve", *argv],
                                   log_path=workdir / f"epp-{n}.log", env=env, cwd=ROOT)

    async def start(self) -> None:
        await self.proc.start()
        try:
            await wait_port("127.0.0.1", self.health_port, timeout=30)
        except TimeoutError:
            raise RuntimeError(f"epp did not start:\n{self.proc.log_tail()}") from None

    async def probe(self, probe: dict[str, Any]) -> bool:
        """The kubelet's gRPC probe: Check(service) on the probe's port; success is
        SERVING, anything else (another status, an error) a failure."""
        port = self.probe_ports[int(probe["grpc"]["port"])]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                r = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")),
                    timeout=2)
            except grpc.aio.AioRpcError:
                return False
            return r.status == SERVING

    async def health(self, service: str) -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.health_port}") as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2)
            return int(r.status)


async def eventually(check: Any, timeout: float = 20.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = await check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.1)


async def route_over_tls(port: int) -> str:
    """An ext_proc exchange over TLS, trusting the certificate the EPP serves (a gateway
    built for GIE skips verification altogether); returns the destination picked."""
    served = (await asyncio.to_thread(ssl.get_server_certificate, ("127.0.0.1", port))).encode()
    creds = grpc.ssl_channel_credentials(root_certificates=served)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=[
            ("grpc.ssl_target_name_override", "localhost")]) as ch:
        process = ch.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                                   request_serializer=pb.ProcessingRequest.SerializeToString,
                                   response_deserializer=pb.ProcessingResponse.FromString)
        call = process()
        headers = {":method": "POST", ":path": "/v1/completions",
                   "content-type": "application/json"}
        await call.write(pb.ProcessingRequest(request_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode())
                                       for k, v in headers.items()]))))
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(
            body=json.dumps({"model": "llama3", "prompt": "hello"}).encode(),
            end_of_stream=True)))
        await call.done_writing()
        destinations = []
        async for msg in call:
            for field in ("request_headers", "request_body"):
                if msg.HasField(field):
                    mutation = getattr(msg, field).response.header_mutation
                    destinations += [h.header.raw_value.decode() or h.header.value
                                     for h in mutation.set_headers
                                     if h.header.key == keys.HEADER_DESTINATION]
            assert not msg.HasField("immediate_response"), msg
        assert len(destinations) == 1, destinations
        return destinations[0]


@pytest_asyncio.fixture
async def model_server() -> AsyncIterator[int]:
    """What the chart's metrics-data-source scrapes: a vLLM-like /metrics."""
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_waiting 0\nvllm:num_requests_running 1\n"
                            "vllm:kv_cache_usage_perc 0.25\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port
    await runner.cleanup()


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer(bookmark_interval_s=1.0)
    await server.start()
    yield server
    await server.stop()


async def _start(tmp_path: Path, fake: FakeApiServer, model_server: int,
                 replicas: int) -> tuple[list[ChartEpp], dict[str, Any]]:
    docs = render(tmp_path, {
        "inferencePool": {"modelServers": {"matchLabels": MODEL_SERVER},
                          "targetPorts": [{"number": model_server}]},
        "inferenceExtension": {"replicas": replicas}})
    pool = _one(docs, "InferencePool")
    fake.put("inferencepools", pool)
    fake.put_pod("vllm-llama3-0", "127.0.0.1", labels=MODEL_SERVER, namespace=NAMESPACE)
    config_map = next(d for d in docs if d["kind"] == "ConfigMap"
                      and "default-plugins.yaml" in d.get("data", {}))
    config_file = tmp_path / "config" / "default-plugins.yaml"
    config_file.parent.mkdir()
    config_file.write_text(config_map["data"]["default-plugins.yaml"])
    container = epp_container(docs)
    kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig")
    epps = [ChartEpp(tmp_path, container, config_file, kubeconfig, n) for n in range(replicas)]
    return epps, container


async def test_one_replica_chart_args_and_probes(tmp_path: Path, fake: FakeApiServer,
                                                 model_server: int) -> None:
    epps, container = await _start(tmp_path, fake, model_server, replicas=1)
    # The args GIE v1.5.0's chart gives its EPP (one replica, vllm, tracing and auth at
    # the chart's defaults): what this test runs.
    assert epps[0].args == [
        "--pool-name", RELEASE, "--pool-namespace", NAMESPACE,
        "--pool-group", "inference.networking.k8s.io", "--zap-encoder", "json",
        "--config-file", "/config/default-plugins.yaml", "--v", "1", "--tracing=false"]
    liveness, readiness = container["livenessProbe"], container["readinessProbe"]
    assert liveness["grpc"] == readiness["grpc"] == {
        "port": 9003, "service": keys.HEALTH_INFERENCE_EXTENSION}
    epp = epps[0]
    await epp.start()
    try:
        assert await eventually(lambda: epp.probe(readiness)), epp.proc.log_tail()
        assert await epp.probe(liveness)
        assert await route_over_tls(epp.grpc_port) == f"127.0.0.1:{model_server}"
        # --zap-encoder json: JSON lines.
        lines = [ln for ln in epp.proc.log_path.read_text().splitlines() if ln.strip()]
        assert lines and all(json.loads(ln)["level"] for ln in lines)
        # The pool going away makes the probe fail (GIE: the datastore is not synced).
        fake.delete("inferencepools", RELEASE, NAMESPACE)
        assert await eventually(lambda: _not(epp.probe(readiness)))
    finally:
        await epp.proc.stop()
    assert epp.proc.returncode == 0, epp.proc.log_tail()


async def _not(result: Any) -> bool:
    return not await result


async def test_two_replicas_chart_leader_election(tmp_path: Path, fake: FakeApiServer,
                                                  model_server: int) -> None:
    """replicas > 1: the chart adds --ha-enable-leader-election and probes `liveness` and
    `readiness`; only the leader is ready, the standby stays live (GIE's semantics)."""
    epps, container = await _start(tmp_path, fake, model_server, replicas=2)
    assert "--ha-enable-leader-election" in epps[0].args
    liveness, readiness = container["livenessProbe"], container["readinessProbe"]
    assert liveness["grpc"]["service"] == keys.HEALTH_LIVENESS
    assert readiness["grpc"]["service"] == keys.HEALTH_READINESS
    try:
        for e in epps:
            await e.start()

        async def one_leader() -> list[bool] | None:
            ready = [await e.probe(readiness) for e in epps]
            return ready if sum(ready) == 1 else None

        ready = await eventually(one_leader)
        leader, standby = (epps[0], epps[1]) if ready[0] else (epps[1], epps[0])
        assert await leader.probe(liveness) and await standby.probe(liveness)
        assert await standby.health(keys.HEALTH_EXT_PROC) != SERVING
        # With leader election GIE knows only its own names.
        assert await leader.health(keys.HEALTH_INFERENCE_EXTENSION) == \
            health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        assert await route_over_tls(leader.grpc_port) == f"127.0.0.1:{model_server}"
        # The leader goes (SIGTERM: it releases the Lease); the standby takes over.
        await leader.proc.stop()
        assert await eventually(lambda: standby.probe(readiness))
    finally:
        for e in epps:
            await e.proc.stop()
