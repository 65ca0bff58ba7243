"""llm-d-router's multicluster EPP through real Envoy: no Kubernetes, no --endpoints.

The config's ``dataLayer.discovery`` names ``multicluster-file-discovery`` over an
endpoints file listing two "clusters" (each an `epp sim` pod standing for a peer
cluster's gateway). Each cluster's ``metricsAddress``/``metricsPort`` labels point at a
stand-in of that cluster's EPP metrics (``llm_d_epp_average_queue_size`` and
``llm_d_epp_average_kv_cache_utilization``, served here by an in-process HTTP server),
which ``multicluster-metrics-data-source`` scrapes and ``multicluster-metrics-extractor``
turns into the attributes ``multicluster-queue-scorer`` reads: requests go to the cluster
whose scraped average queue is lower, follow it when it changes, and follow the file
when a cluster is removed from it (``watchFile: true``).
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web

from epp.stack.envoy import EnvoyProcess, render_envoy_config
from epp.stack.procs import LOCAL_SERVE_FLAGS, ManagedProcess, free_port, wait_port
from tests.integration.conftest import ROOT, _env, eventually, start_sims

pytestmark = pytest.mark.integration

CONFIG = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- name: discovery
  type: multicluster-file-discovery
  parameters:
    path: {path}
    watchFile: true
- name: metrics-source
  type: multicluster-metrics-data-source
  parameters:
    scheme: http          # the stand-ins serve plaintext; https (verified) is the default
- name: metrics-extractor
  type: multicluster-metrics-extractor
- name: queue
  type: multicluster-queue-scorer
- name: kv-cache
  type: multicluster-kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: queue, weight: 2}}
  - {{pluginRef: kv-cache, weight: 1}}
  - {{pluginRef: max-score-picker}}
dataLayer:
  discovery:
    pluginRef: discovery
  sources:
  - pluginRef: metrics-source
    extractors:
    - pluginRef: metrics-extractor
"""


class PeerMetrics:
    """Each cluster's EPP /metrics: the pool aggregates set per metrics port."""

    def __init__(self) -> None:
        self.queue: dict[int, float] = {}
        self.kv: dict[int, float] = {}

    async def handle(self, request: web.Request) -> web.Response:
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        port = int(sock[1]) if sock else 0
        return web.Response(text=(
            "# TYPE llm_d_epp_average_queue_size gauge\n"
            f"llm_d_epp_average_queue_size {self.queue.get(port, 0.0)}\n"
            "# TYPE llm_d_epp_average_kv_cache_utilization gauge\n"
            f"llm_d_epp_average_kv_cache_utilization {self.kv.get(port, 0.0)}\n"))


@pytest.fixture
async def peers() -> AsyncIterator[tuple[PeerMetrics, list[int]]]:
    peer = PeerMetrics()
    app = web.Application()
    app.router.add_get("/metrics", peer.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    ports = [free_port(), free_port()]
    for p in ports:
        await web.TCPSite(runner, "127.0.0.1", p).start()
    try:
        yield peer, ports
    finally:
        await runner.cleanup()


def clusters_file(path: Path, sims: list[int], metrics: list[int]) -> None:
    doc = {"endpoints": [
        {"name": f"cluster-{'ab'[i]}", "address": "127.0.0.1", "port": str(port),
         "labels": {"metricsAddress": "127.0.0.1", "metricsPort": str(metrics[i])}}
        for i, port in enumerate(sims)]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    tmp.replace(path)  # atomic, as a ConfigMap swap


async def served_by(session: aiohttp.ClientSession, url: str, sims: list[int]) -> int:
    """Send one completion through Envoy; the sim port whose log has its request id."""
    rid = str(uuid.uuid4())
    body = orjson.dumps({"model": "sim-model", "prompt": "hello", "max_tokens": 2})
    async with session.post(url + "/v1/completions", data=body,
                            headers={"content-type": "application/json",
                                     "x-request-id": rid}) as r:
        assert r.status == 200, await r.text()
        await r.read()
    seen = []
    for p in sims:
        async with session.get(f"http://127.0.0.1:{p}/debug/requests") as r:
            if any(rec["headers"].get("x-request-id") == rid for rec in await r.json()):
                seen.append(p)
    assert len(seen) == 1, seen
    return seen[0]


async def test_multicluster_routes_to_the_cluster_with_the_lower_queue(
        tmp_path: Path, peers: tuple[PeerMetrics, list[int]]) -> None:
    peer, metrics_ports = peers
    sims = [free_port(), free_port()]
    sim_proc = await start_sims(sims, tmp_path / "sim.log")
    endpoints = tmp_path / "clusters.yaml"
    clusters_file(endpoints, sims, metrics_ports)
    a, b = sims
    ma, mb = metrics_ports
    peer.queue = {ma: 8.0, mb: 1.0}  # cluster b's pool is less loaded
    peer.kv = {ma: 0.5, mb: 0.5}
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    epp = ManagedProcess(
        [sys.executable, "-m", "epp.cli", "serve", *LOCAL_SERVE_FLAGS,
         "--bind-address", "127.0.0.1", "--grpc-port", str(grpc_port),
         "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port),
         "--pool-name", "clusters", "--pool-namespace", "mc",
         "--allow-experimental-plugins",  # llm-d registers the multicluster types as Alpha
         "--config-text", CONFIG.format(path=json.dumps(str(endpoints))),
         "--drain-quiet-period", "0", "--log-level", "info"],
        log_path=tmp_path / "epp.log", env=_env(), cwd=ROOT)
    envoy = EnvoyProcess()
    try:
        await epp.start()
        try:
            await wait_port("127.0.0.1", grpc_port, timeout=20)
        except TimeoutError:
            raise AssertionError(f"epp did not start:\n{epp.log_tail()}") from None
        port = free_port()
        await envoy.start(render_envoy_config(listen_port=port, epp_port=grpc_port,
                                              admin_port=free_port()), tmp_path)
        await envoy.wait_ready()
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            # Once both clusters' aggregates are scraped, every request goes to b.
            async def to(target: int) -> bool:
                return all([await served_by(s, url, sims) == target for _ in range(3)])

            await eventually(lambda: to(b), timeout=20,
                             what=lambda: f"requests to cluster b:\n{epp.log_tail()}")
            assert [await served_by(s, url, sims) for _ in range(5)] == [b] * 5

            # The peers' queues change: routing follows the next scrape.
            peer.queue = {ma: 0.0, mb: 12.0}
            await eventually(lambda: to(a), timeout=20)

            # Cluster a leaves the file (watchFile): everything goes to b, queue or not.
            clusters_file(endpoints, [b], [mb])
            await eventually(lambda: to(b), timeout=20)

            # The pool is labelled as --pool-name says (llm-d's file-discovery mode).
            async with s.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                text = await r.text()
            assert 'inference_pool_ready_pods{name="clusters"} 1.0' in text
        log = (tmp_path / "epp.log").read_text()
        assert "EPP starting (file discovery mode)" in log
    finally:
        await envoy.stop()
        await epp.stop()
        await sim_proc.stop()
