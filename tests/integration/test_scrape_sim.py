"""The metrics scraper against real `epp sim` processes, and through a real `epp serve`.

A sim with two sequence slots and slow decode steps is given five long requests: two
run, three wait, and their KV blocks are held. The scraper (in this process, and inside
`epp serve`) must see exactly that. Synchronisation is by polling with deadlines.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from epp.datalayer.scraper import MetricsScraper, ScrapeOptions
from epp.datastore.store import Datastore
from epp.scheduling.types import Endpoint, Metrics
from epp.stack.procs import LOCAL_SERVE_FLAGS, ManagedProcess, free_port, wait_port
from tests.polling import eventually

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


class Sims:
    """One `epp sim` process serving a busy pod and an idle pod."""

    def __init__(self, proc: ManagedProcess, busy: int, idle: int) -> None:
        self.proc, self.busy, self.idle = proc, busy, idle
        self.tasks: list[asyncio.Task[None]] = []

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint("busy", "127.0.0.1", self.busy), Endpoint("idle", "127.0.0.1", self.idle)]

    async def load_busy(self, session: aiohttp.ClientSession, n: int = 5) -> None:
        """Start ``n`` long completions on the busy pod (they run in the background)."""
        async def one(i: int) -> None:
            body = {"model": "sim-model", "prompt": f"request {i} " + "word " * 64,
                    "max_tokens": 400}
            try:
                async with session.post(f"http://127.0.0.1:{self.busy}/v1/completions",
                                        json=body) as r:
                    await r.read()
            except aiohttp.ClientError:
                pass  # the sim is stopped at teardown while these still run

        self.tasks = [asyncio.create_task(one(i)) for i in range(n)]


@pytest.fixture
async def sims(tmp_path: Path) -> AsyncIterator[Sims]:
    busy, idle = free_port(), free_port()
    proc = ManagedProcess([sys.executable, "-m", "epp.cli", "sim", "--port", str(busy),
                           "--port", str(idle), "--max-num-seqs", "2",
                           "--decode-base-ms", "50", "--num-gpu-blocks", "1000"],
                          log_path=tmp_path / "sim.log", cwd=ROOT)
    await proc.start()
    sims = Sims(proc, busy, idle)
    try:
        await wait_port("127.0.0.1", busy, timeout=20)
        await wait_port("127.0.0.1", idle, timeout=20)
        yield sims
    finally:
        for t in sims.tasks:
            t.cancel()
        await proc.stop()


def m(store: Datastore, port: int) -> Metrics:
    ep = store.get(f"127.0.0.1:{port}")
    assert ep is not None
    return ep.metrics


async def test_scraper_sees_running_waiting_and_kv_of_real_sims(sims: Sims) -> None:
    store = Datastore()
    store.set_endpoints(sims.endpoints())
    scraper = MetricsScraper(store, ScrapeOptions(interval_s=0.05))
    scraper.start()
    try:
        await eventually(lambda: m(store, sims.busy).updated_at is not None
                         and m(store, sims.idle).updated_at is not None,
                         timeout=15, what="first scrapes")
        idle0 = m(store, sims.idle)
        assert (idle0.running_requests, idle0.waiting_queue_size, idle0.kv_cache_usage) == \
            (0, 0, 0.0)
        assert idle0.block_size == 16 and idle0.num_blocks == 1000
        async with aiohttp.ClientSession() as session:
            await sims.load_busy(session)
            await eventually(lambda: m(store, sims.busy).running_requests == 2
                             and m(store, sims.busy).waiting_queue_size == 3,
                             timeout=15, what="2 running / 3 waiting on the busy pod")
            busy = m(store, sims.busy)
            assert 0.0 < busy.kv_cache_usage <= 1.0
            assert not busy.stale
            idle = m(store, sims.idle)
            assert (idle.running_requests, idle.waiting_queue_size) == (0, 0)
            assert scraper.last_error(f"127.0.0.1:{sims.busy}") is None
    finally:
        await scraper.stop()


async def test_killed_sim_goes_stale_keeping_its_last_values(sims: Sims) -> None:
    store = Datastore()
    store.set_endpoints(sims.endpoints())
    scraper = MetricsScraper(store, ScrapeOptions(interval_s=0.05, staleness_threshold_s=0.5,
                                                  timeout_s=0.25))
    scraper.start()
    try:
        async with aiohttp.ClientSession() as session:
            await sims.load_busy(session)
            await eventually(lambda: m(store, sims.busy).running_requests == 2,
                             timeout=15, what="busy pod loaded")
            await sims.proc.stop()
            await eventually(lambda: m(store, sims.busy).stale and m(store, sims.idle).stale,
                             timeout=15, what="both stale")
            assert m(store, sims.busy).running_requests == 2  # kept, marked stale
            assert len(store) == 2  # nothing dropped
            assert "failed" in (scraper.last_error(f"127.0.0.1:{sims.busy}") or "")
    finally:
        await scraper.stop()


async def test_epp_serve_scrapes_and_exports(sims: Sims, tmp_path: Path) -> None:
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    epp = ManagedProcess([sys.executable, "-m", "epp.cli", "serve", *LOCAL_SERVE_FLAGS, "--drain-quiet-period", "0",
                          "--endpoints", f"127.0.0.1:{sims.busy},127.0.0.1:{sims.idle}",
                          "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
                          "--metrics-port", str(metrics_port), "--bind-address", "127.0.0.1",
                          "--refresh-metrics-interval", "50ms",
                          "--metrics-staleness-threshold", "2s"],
                         log_path=tmp_path / "epp.log", cwd=ROOT)
    await epp.start()
    try:
        await wait_port("127.0.0.1", metrics_port, timeout=20)
        async with aiohttp.ClientSession() as session:
            text = ""

            async def scrape() -> str:
                async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                    return await r.text()

            def queue_of(port: int) -> float | None:
                # Endpoints given by --endpoints are named by their address.
                mm = re.search(r'inference_pool_per_pod_queue_size\{[^}]*model_server_pod="'
                               + re.escape(f"127.0.0.1:{port}") + r'"[^}]*\} (\S+)', text)
                return float(mm.group(1)) if mm else None

            await sims.load_busy(session)
            text = ""

            async def scraped_the_queue() -> bool:
                nonlocal text
                text = await scrape()
                ok = re.search(r'epp_model_server_scrapes_total\{result="success"\} (\S+)', text)
                return bool(ok and float(ok.group(1)) > 0 and queue_of(sims.busy) == 3.0)

            await eventually(scraped_the_queue, timeout=15, interval=0.05,
                             what=lambda: "the busy pod's queue in\n" + text + epp.log_tail())
            assert queue_of(sims.idle) == 0.0
            assert "epp_model_server_metrics_stale_endpoints 0.0" in text
    finally:
        await epp.stop()


QUEUE_ONLY = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer}
  - {pluginRef: max-score-picker}
"""


async def test_envoy_routes_away_from_the_queued_pod(sims: Sims, tmp_path: Path) -> None:
    """Real Envoy → `epp serve` (queue-scorer) → two sims, one with a waiting queue: once
    the scrape shows the queue, every request goes to the other pod."""
    from tests.integration.conftest import Upstreams, start_stack, stop_stack

    stack = await start_stack("FULL_DUPLEX_STREAMED", Upstreams([sims.busy, sims.idle], sims.proc),
                              tmp_path, endpoint_ports=[sims.busy, sims.idle], config=QUEUE_ONLY)
    try:
        async with aiohttp.ClientSession() as session:
            await sims.load_busy(session)

            async def saw_the_queue() -> bool:
                return await stack.epp.metric(session, "inference_pool_average_queue_size") >= 1.5

            await eventually(saw_the_queue, timeout=15, interval=0.05,
                             what="the EPP to see the busy pod's queue")
            before = {p: len(await stack.upstreams.requests(session, p))
                      for p in (sims.busy, sims.idle)}
            for i in range(20):
                body = {"model": "sim-model", "prompt": f"hello {i}", "max_tokens": 1}
                async with session.post(f"{stack.url}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
            after = {p: len(await stack.upstreams.requests(session, p))
                     for p in (sims.busy, sims.idle)}
            assert after[sims.idle] - before[sims.idle] == 20
            assert after[sims.busy] == before[sims.busy]
    finally:
        await stop_stack(stack)
