"""The metrics scraper (epp.datalayer.scraper) against in-process HTTP servers.

Synchronisation is by polling the datastore or the scraper's counters with a deadline
(:func:`tests.polling.eventually`), never by sleeping a fixed time and hoping.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from epp import keys
from epp.config.loader import load_and_build
from epp.datalayer.scraper import (
    UNREACHABLE_AFTER_TIMEOUTS,
    MetricsScraper,
    ScrapeOptions,
    ScraperCollector,
    _LagGovernor,
)
from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.observability.metrics import EppMetrics
from epp.requestcontrol.director import Director, SchedulingCore
from epp.scheduling.types import Endpoint, Metrics
from tests.polling import eventually

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "metrics"
LOGGER = "epp.datalayer.scraper"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


@dataclass
class FakePod:
    """One fake model server: serves ``body`` at ``path`` with ``status``; can hang."""

    port: int
    body: str
    status: int = 200
    path: str = "/metrics"
    hang: bool = False
    requests: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def key(self) -> str:
        return f"127.0.0.1:{self.port}"

    def endpoint(self, **labels: str) -> Endpoint:
        return Endpoint(f"pod-{self.port}", "127.0.0.1", self.port, labels=labels)


class Pods:
    def __init__(self) -> None:
        self.pods: list[FakePod] = []
        self.runners: list[web.AppRunner] = []

    async def add(self, body: str, path: str = "/metrics", port: int = 0) -> FakePod:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        pod = FakePod(sock.getsockname()[1], body, path=path)

        async def handler(_: web.Request) -> web.Response:
            pod.requests += 1
            if pod.hang:
                await pod.release.wait()
            return web.Response(text=pod.body, status=pod.status, content_type="text/plain")

        app = web.Application()
        app.router.add_get(path, handler)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self.pods.append(pod)
        self.runners.append(runner)
        return pod

    async def close(self) -> None:
        for p in self.pods:
            p.hang = False
            p.release.set()
        for r in self.runners:
            await r.cleanup()


@pytest.fixture
async def pods() -> AsyncIterator[Pods]:
    p = Pods()
    try:
        yield p
    finally:
        await p.close()


class CountingStore(Datastore):
    def __init__(self) -> None:
        super().__init__()
        self.batches = 0
        self.writes = 0

    def update_metrics_many(self, updates: Any) -> int:
        self.batches += 1
        self.writes += len(updates)
        return super().update_metrics_many(updates)


def opts(**kw: Any) -> ScrapeOptions:
    base: dict[str, Any] = {"interval_s": 0.01, "timeout_s": 0.5, "staleness_threshold_s": 0.3,
                            "commit_interval_s": 0.005, "max_loop_lag_s": None}
    base.update(kw)
    return ScrapeOptions(**base)


def metrics(store: Datastore, pod: FakePod) -> Metrics:
    ep = store.get(pod.key)
    assert ep is not None
    return ep.metrics


@pytest.fixture
async def scrapers() -> AsyncIterator[list[MetricsScraper]]:
    made: list[MetricsScraper] = []
    yield made
    for s in made:
        await s.stop()


def start(scrapers: list[MetricsScraper], store: Datastore, o: ScrapeOptions) -> MetricsScraper:
    s = MetricsScraper(store, o, seed=7)
    s.start()
    scrapers.append(s)
    return s


# ---------------------------------------------------------------- values


async def test_values_arrive_and_follow_changes(pods: Pods, scrapers: list[MetricsScraper]) -> None:
    pod = await pods.add(fixture("vllm.txt"))
    store = Datastore()
    store.set_endpoints([pod.endpoint()])
    start(scrapers, store, opts())
    await eventually(lambda: metrics(store, pod).updated_at is not None, what="first scrape")
    m = metrics(store, pod)
    assert (m.waiting_queue_size, m.running_requests, m.kv_cache_usage) == (3, 7, 0.4375)
    assert m.active_loras == {"sql-lora", "chat-lora"} and m.waiting_loras == {"tweet-lora"}
    assert (m.max_loras, m.block_size, m.num_blocks) == (4, 16, 27264)
    assert not m.stale
    pod.body = pod.body.replace('Llama-3.1-8B-Instruct"} 7.0', 'Llama-3.1-8B-Instruct"} 9.0', 1)
    await eventually(lambda: metrics(store, pod).running_requests == 9, what="new value")


async def test_engine_chosen_by_label(pods: Pods, scrapers: list[MetricsScraper]) -> None:
    sg = await pods.add(fixture("sglang.txt"))
    tr = await pods.add(fixture("triton_trtllm.txt"))
    store = Datastore()
    store.set_endpoints([sg.endpoint(**{keys.LABEL_ENGINE: "sglang"}),
                         tr.endpoint(**{keys.LABEL_ENGINE_GIE: "triton-tensorrt-llm"})])
    start(scrapers, store, opts())
    await eventually(lambda: metrics(store, sg).updated_at is not None
                     and metrics(store, tr).updated_at is not None)
    a, b = metrics(store, sg), metrics(store, tr)
    assert (a.waiting_queue_size, a.running_requests, a.kv_cache_usage) == (5, 9, 0.27)
    assert (a.block_size, a.num_blocks) == (1, 189756)
    assert (b.waiting_queue_size, b.running_requests, b.kv_cache_usage) == (3, 11, 0.25)


async def test_port_and_path_overrides(pods: Pods, scrapers: list[MetricsScraper]) -> None:
    pod = await pods.add(fixture("vllm_old.txt"), path="/custom/metrics")
    store = Datastore()
    # The endpoint's own port serves nothing; metrics come from the override port.
    store.set_endpoints([Endpoint("p", "127.0.0.1", 1)])
    start(scrapers, store, opts(port=pod.port, path="/custom/metrics"))
    await eventually(lambda: (e := store.get("127.0.0.1:1")) is not None
                     and e.metrics.kv_cache_usage == 0.8125, what="old vLLM KV name")


async def test_partial_scrape_keeps_missing_values_and_logs_once(
        pods: Pods, scrapers: list[MetricsScraper], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    pod = await pods.add(fixture("vllm.txt"))
    store = Datastore()
    store.set_endpoints([pod.endpoint()])
    s = start(scrapers, store, opts())
    await eventually(lambda: metrics(store, pod).updated_at is not None)
    pod.body = fixture("missing.txt")  # running 5, waiting 1, no KV metric
    await eventually(lambda: metrics(store, pod).running_requests == 5)
    n = s.scrapes_ok
    await eventually(lambda: s.scrapes_ok >= n + 10, what="more scrapes")
    m = metrics(store, pod)
    assert m.kv_cache_usage == 0.4375  # kept from the last scrape that had it
    assert not m.stale  # a partial scrape is a successful scrape
    incomplete = [r for r in caplog.records if "incomplete" in r.getMessage()]
    assert len(incomplete) == 1
    assert keys.VLLM_KV_USAGE in incomplete[0].getMessage()
    assert s.last_error(pod.key) is not None


# ---------------------------------------------------------------- failures and staleness


async def test_errors_logged_once_per_change_then_recovery(
        pods: Pods, scrapers: list[MetricsScraper], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    pod = await pods.add(fixture("vllm.txt"))
    store = Datastore()
    store.set_endpoints([pod.endpoint()])
    s = start(scrapers, store, opts(staleness_threshold_s=10.0, max_interval_s=0.02))
    await eventually(lambda: metrics(store, pod).updated_at is not None)
    pod.status = 500
    await eventually(lambda: s.scrapes_failed >= 5, what="5 failed polls")
    pod.status = 404
    n = s.scrapes_failed
    await eventually(lambda: s.scrapes_failed >= n + 5, what="5 more failed polls")
    pod.status = 200
    await eventually(lambda: s.last_error(pod.key) is None, what="recovery")
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("HTTP 500" in m for m in msgs) == 1
    assert sum("HTTP 404" in m for m in msgs) == 1
    assert sum("recovered" in m for m in msgs) == 1
    assert metrics(store, pod).running_requests == 7  # values never dropped


async def test_malformed_body_is_an_error_and_keeps_values(
        pods: Pods, scrapers: list[MetricsScraper], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    pod = await pods.add(fixture("vllm.txt"))
    store = Datastore()
    store.set_endpoints([pod.endpoint()])
    s = start(scrapers, store, opts())
    await eventually(lambda: metrics(store, pod).updated_at is not None)
    pod.body = fixture("malformed.txt")
    await eventually(lambda: metrics(store, pod).stale, what="stale after threshold")
    m = metrics(store, pod)
    assert (m.waiting_queue_size, m.running_requests) == (3, 7)
    err = s.last_error(pod.key)
    assert err is not None and "malformed metrics text" in err and "line 3" in err
    assert sum("malformed" in r.getMessage() for r in caplog.records) == 1


async def test_hanging_server_goes_stale_while_the_poll_hangs(
        pods: Pods, scrapers: list[MetricsScraper], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    pod = await pods.add(fixture("vllm.txt"))
    store = Datastore()
    store.set_endpoints([pod.endpoint()])
    # The poll timeout is far longer than the staleness threshold: the sweeper must mark
    # the endpoint stale while its poll is still hanging.
    s = start(scrapers, store, opts(timeout_s=30.0, staleness_threshold_s=0.2))
    await eventually(lambda: metrics(store, pod).updated_at is not None)
    last_ok = s.last_success(pod.key)
    pod.hang = True
    await eventually(lambda: metrics(store, pod).stale, what="stale")
    m = metrics(store, pod)
    assert (m.waiting_queue_size, m.running_requests, m.kv_cache_usage) == (3, 7, 0.4375)
    assert m.updated_at is not None and last_ok is not None
    assert m.is_stale(time.monotonic())
    assert s.scrapes_failed == 0  # nothing failed yet: the poll is still in flight
    assert store.get(pod.key) is not None  # never dropped
    pod.hang = False
    pod.release.set()
    await eventually(lambda: not metrics(store, pod).stale, what="fresh again")
    assert sum("stale" in r.getMessage() for r in caplog.records) == 1


async def test_timeout_marks_failure(pods: Pods, scrapers: list[MetricsScraper],
                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    pod = await pods.add(fixture("vllm.txt"))
    pod.hang = True
    store = Datastore()
    store.set_endpoints([pod.endpoint()])
    s = start(scrapers, store, opts(timeout_s=0.05, staleness_threshold_s=0.2,
                                    max_interval_s=0.02))
    await eventually(lambda: s.scrapes_failed >= 3, what="3 timeouts")
    assert "timed out after 0.05s" in (s.last_error(pod.key) or "")
    assert sum("timed out" in r.getMessage() for r in caplog.records) == 1
    await eventually(lambda: metrics(store, pod).stale)
    assert metrics(store, pod).updated_at is None  # never scraped: stale, no values


async def test_unreachable_endpoint_is_stale_not_dropped(scrapers: list[MetricsScraper]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: connection refused
    store = Datastore()
    store.set_endpoints([Endpoint("dead", "127.0.0.1", port)])
    s = start(scrapers, store, opts(staleness_threshold_s=0.1))
    key = f"127.0.0.1:{port}"
    await eventually(lambda: (e := store.get(key)) is not None and e.metrics.stale)
    assert s.stale_count() == 1
    assert "failed" in (s.last_error(key) or "")


# ---------------------------------------------------------------- following the datastore


def scrape_tasks(key: str | None = None) -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks()
            if t.get_name().startswith("metrics-") and not t.done()
            and (key is None or t.get_name() == f"metrics-scrape {key}")]


async def test_tasks_follow_additions_and_removals(pods: Pods,
                                                   scrapers: list[MetricsScraper]) -> None:
    a = await pods.add(fixture("vllm.txt"))
    b = await pods.add(fixture("vllm.txt"))
    store = Datastore()
    store.set_endpoints([a.endpoint()])
    s = start(scrapers, store, opts())
    assert s.scraping() == [a.key]
    store.set_endpoints([a.endpoint(), b.endpoint()])
    assert s.scraping() == sorted([a.key, b.key])
    await eventually(lambda: metrics(store, b).updated_at is not None, what="b scraped")
    assert len(scrape_tasks(b.key)) == 1

    store.set_endpoints([a.endpoint()])
    assert s.scraping() == [a.key]
    await eventually(lambda: not scrape_tasks(b.key), what="b's task to end")
    seen = b.requests
    n = a.requests
    await eventually(lambda: a.requests >= n + 5, what="a still polled")
    assert b.requests <= seen + 1  # at most one poll already in flight at removal

    # Re-added: a fresh task and fresh metrics.
    store.set_endpoints([a.endpoint(), b.endpoint()])
    assert len(scrape_tasks(b.key)) == 1
    await eventually(lambda: b.requests > seen + 1)


async def test_stop_cancels_every_task_and_is_idempotent(pods: Pods) -> None:
    a = await pods.add(fixture("vllm.txt"))
    store = Datastore()
    store.set_endpoints([a.endpoint()])
    s = MetricsScraper(store, opts(max_loop_lag_s=0.002))
    s.start()
    await eventually(lambda: metrics(store, a).updated_at is not None)
    assert len(scrape_tasks()) == 3  # the endpoint, the staleness sweeper, the governor
    await s.stop()
    assert scrape_tasks() == []
    await s.stop()
    # Unsubscribed: later endpoint changes start nothing.
    b = await pods.add(fixture("vllm.txt"))
    store.set_endpoints([a.endpoint(), b.endpoint()])
    assert scrape_tasks() == [] and s.scraping() == []


async def test_start_twice_is_an_error(scrapers: list[MetricsScraper]) -> None:
    s = start(scrapers, Datastore(), opts())
    with pytest.raises(RuntimeError):
        s.start()


# ---------------------------------------------------------------- datastore write policy


async def test_unchanged_values_are_not_rewritten_every_poll(
        pods: Pods, scrapers: list[MetricsScraper]) -> None:
    pod = await pods.add(fixture("vllm.txt"))
    store = CountingStore()
    store.set_endpoints([pod.endpoint()])
    s = start(scrapers, store, opts(freshness_resolution_s=10.0))
    await eventually(lambda: metrics(store, pod).updated_at is not None)
    first = metrics(store, pod).updated_at
    await eventually(lambda: s.scrapes_ok >= 20, what="20 scrapes")
    assert store.writes == 1  # the first scrape only: nothing changed since
    assert metrics(store, pod).updated_at == first
    assert (s.last_success(pod.key) or 0) > (first or 0)  # the exact time is still known


async def test_updated_at_refreshes_at_the_resolution(
        pods: Pods, scrapers: list[MetricsScraper]) -> None:
    pod = await pods.add(fixture("vllm.txt"))
    store = CountingStore()
    store.set_endpoints([pod.endpoint()])
    s = start(scrapers, store, opts(freshness_resolution_s=0.05))
    await eventually(lambda: metrics(store, pod).updated_at is not None)
    first = metrics(store, pod).updated_at or 0.0
    await eventually(lambda: (metrics(store, pod).updated_at or 0.0) >= first + 0.05,
                     what="a refresh")
    assert store.writes < s.scrapes_ok


async def test_writes_are_coalesced(pods: Pods, scrapers: list[MetricsScraper]) -> None:
    body = fixture("vllm.txt")
    many = [await pods.add(body) for _ in range(10)]
    store = CountingStore()
    store.set_endpoints([p.endpoint() for p in many])
    s = start(scrapers, store, opts(commit_interval_s=0.05))
    await eventually(lambda: all(metrics(store, p).updated_at is not None for p in many))
    assert store.writes == 10
    assert store.batches < 10  # several endpoints' first values applied per commit
    assert s.commits == store.batches


async def test_default_resolution_and_ceiling() -> None:
    o = ScrapeOptions()
    assert o.resolution_s == pytest.approx(0.1)
    assert o.ceiling_s == pytest.approx(0.5)
    assert ScrapeOptions(interval_s=1.0).resolution_s == pytest.approx(0.5)


@pytest.mark.parametrize("kw,fragment", [
    ({"interval_s": 0}, "--refresh-metrics-interval"),
    ({"staleness_threshold_s": -1}, "--metrics-staleness-threshold"),
    ({"scheme": "ftp"}, "--model-server-metrics-scheme"),
    ({"path": "metrics"}, "--model-server-metrics-path"),
    ({"port": 70000}, "--model-server-metrics-port"),
    ({"max_concurrency": 0}, "concurrency"),
    ({"timeout_s": 0}, "timeout"),
])
def test_options_are_validated(kw: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        ScrapeOptions(**kw).validate()


# ---------------------------------------------------------------- load shedding


def test_governor_backs_off_fast_and_returns_slowly() -> None:
    g = _LagGovernor(base=0.05, ceiling=0.5, target=0.002, period=0.01)
    g.adjust(0.010)
    assert g.interval == pytest.approx(0.075)
    for _ in range(10):
        g.adjust(0.010)
    assert g.interval == 0.5  # capped
    g.adjust(0.0018)  # between 3/4 of the target and the target: hold
    assert g.interval == 0.5
    g.adjust(0.0001)
    assert g.interval == pytest.approx(0.45)
    for _ in range(100):
        g.adjust(0.0)
    assert g.interval == 0.05  # never below the configured interval


async def test_collector_exports_scrape_counts(pods: Pods,
                                               scrapers: list[MetricsScraper]) -> None:
    pod = await pods.add(fixture("vllm.txt"))
    store = Datastore()
    store.set_endpoints([pod.endpoint()])
    s = start(scrapers, store, opts())
    await eventually(lambda: s.scrapes_ok >= 2)
    fams = {f.name: f for f in ScraperCollector(s).collect()}
    ok = [x for x in fams["epp_model_server_scrapes"].samples
          if x.labels == {"result": "success"}]
    assert ok[0].value >= 2
    assert fams["epp_model_server_metrics_stale_endpoints"].samples[0].value == 0
    assert fams["epp_model_server_scrape_interval_seconds"].samples[0].value == 0.01


# ---------------------------------------------------------------- untrusted bodies (issue 19)


class Misbehaving:
    """Servers whose /metrics misbehave, torn down with the test.

    ``flood``: 200, chunked, no Content-Length, 64 KiB chunks forever (``flood_closed``
    counts the floods the client cut off). ``trickle``: 200, then one byte every 20 ms.
    ``body``: 200 with the given bytes. Raw TCP: ``hang`` accepts and reads but never
    answers; ``close`` closes before answering; ``reset`` resets the connection.
    """

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.servers: list[asyncio.Server] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.done = asyncio.Event()
        self.flood_started = 0
        self.flood_closed = 0
        self.bodies: dict[int, Callable[[], bytes]] = {}

    async def http(self, kind: str, body: Callable[[], bytes] | None = None) -> int:
        async def handler(request: web.Request) -> web.StreamResponse:
            if kind == "body":
                assert body is not None
                return web.Response(body=body(), content_type="text/plain")
            resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            chunk = b"# " + b"x" * (64 << 10) + b"\n" if kind == "flood" else b"#"
            if kind == "flood":
                self.flood_started += 1
            try:
                while not self.done.is_set():
                    await resp.write(chunk)
                    if kind == "trickle":
                        await asyncio.sleep(0.02)  # pacing: a trickle is the point, not a wait
            except (ConnectionError, RuntimeError):
                if kind == "flood":
                    self.flood_closed += 1
            return resp

        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        await web.SockSite(runner, sock).start()
        self.runners.append(runner)
        port: int = sock.getsockname()[1]
        return port

    async def tcp(self, kind: str) -> int:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.writers.append(writer)
            if kind == "close":
                writer.close()
            elif kind == "reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            else:  # hang: read the request, never answer
                await self.done.wait()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.servers.append(server)
        port: int = server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        self.done.set()
        for w in self.writers:
            w.close()
        for srv in self.servers:
            srv.close()
            await srv.wait_closed()
        for r in self.runners:
            await r.cleanup()


@pytest.fixture
async def bad() -> AsyncIterator[Misbehaving]:
    m = Misbehaving()
    try:
        yield m
    finally:
        await m.close()


def ep_at(port: int) -> Endpoint:
    return Endpoint(f"pod-{port}", "127.0.0.1", port)


def warnings(caplog: pytest.LogCaptureFixture, fragment: str) -> int:
    return sum(fragment in r.getMessage() for r in caplog.records
               if r.levelno >= logging.WARNING)


async def test_flooding_chunked_body_is_cut_at_the_cap(
        bad: Misbehaving, scrapers: list[MetricsScraper],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    port = await bad.http("flood")
    store = Datastore()
    store.set_endpoints([ep_at(port)])
    # The poll timeout is far away: the read must stop at the cap, not at the timeout.
    s = start(scrapers, store, opts(timeout_s=60.0, max_body_bytes=256 << 10,
                                    staleness_threshold_s=60.0))
    key = f"127.0.0.1:{port}"
    t0 = time.monotonic()
    await eventually(lambda: s.scrapes_failed >= 3, timeout=10.0, what="3 aborted polls")
    assert time.monotonic() - t0 < 10.0
    err = s.last_error(key) or ""
    assert "exceeds the 262144-byte cap" in err and "--model-server-metrics-max-bytes" in err
    # The connection is dropped (not drained): the server sees its flood cut off.
    await eventually(lambda: bad.flood_closed >= 2, what="floods cut off by the client")
    assert warnings(caplog, "cap") == 1  # logged once, not once per poll
    assert s.unreachable_count() == 0  # it answered: failed, not unreachable
    m = store.get(key)
    assert m is not None and not m.metrics.unreachable and m.metrics.updated_at is None


async def test_content_length_over_the_cap_is_refused_unread(
        bad: Misbehaving, scrapers: list[MetricsScraper]) -> None:
    port = await bad.http("body", lambda: b"# " + b"x" * (300 << 10) + b"\n")
    store = Datastore()
    store.set_endpoints([ep_at(port)])
    s = start(scrapers, store, opts(max_body_bytes=256 << 10))
    await eventually(lambda: s.scrapes_failed >= 1)
    assert "(Content-Length) exceeds the 262144-byte cap" in (s.last_error(f"127.0.0.1:{port}")
                                                              or "")


async def test_trickling_body_is_bounded_by_the_timeout(
        bad: Misbehaving, scrapers: list[MetricsScraper]) -> None:
    port = await bad.http("trickle")
    store = Datastore()
    store.set_endpoints([ep_at(port)])
    s = start(scrapers, store, opts(timeout_s=0.2, max_interval_s=0.02))
    await eventually(lambda: s.scrapes_failed >= 4, what="4 timed-out polls")
    assert "reading the body" in (s.last_error(f"127.0.0.1:{port}") or "")
    assert s.unreachable_count() == 0  # headers came: the pod is up, only slow


async def test_hanging_endpoint_is_unreachable_after_consecutive_timeouts_then_recovers(
        pods: Pods, scrapers: list[MetricsScraper], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    pod = await pods.add(fixture("vllm.txt"))
    store = Datastore()
    store.set_endpoints([pod.endpoint()])
    s = start(scrapers, store, opts(timeout_s=0.1, max_interval_s=0.02,
                                    staleness_threshold_s=10.0))
    await eventually(lambda: metrics(store, pod).updated_at is not None)
    n = s.scrapes_failed
    pod.hang = True
    await eventually(lambda: metrics(store, pod).unreachable, what="unreachable")
    assert s.scrapes_failed - n >= UNREACHABLE_AFTER_TIMEOUTS  # not after a single timeout
    assert [e.key for e in store.routable()] == [pod.key]  # the only one: fail open
    pod.hang = False
    pod.release.set()
    await eventually(lambda: not metrics(store, pod).unreachable, what="reachable again")
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("is unreachable (no response to 3 polls in a row)" in m for m in msgs) == 1
    assert sum("reachable again" in m for m in msgs) == 1


async def test_raw_hang_holds_no_more_than_the_timeout(
        bad: Misbehaving, scrapers: list[MetricsScraper]) -> None:
    port = await bad.tcp("hang")
    store = Datastore()
    store.set_endpoints([ep_at(port)])
    s = start(scrapers, store, opts(timeout_s=0.1, max_interval_s=0.02))
    await eventually(lambda: s.unreachable_count() == 1, what="unreachable after timeouts")
    assert "waiting for a response" in (s.last_error(f"127.0.0.1:{port}") or "")


def _random_garbage() -> bytes:
    return os.urandom(64 << 10)


@pytest.mark.parametrize("name,body", [
    ("binary", lambda: bytes(range(256)) * 256),
    ("random binary, different every poll", _random_garbage),
    ("invalid UTF-8 in a metrics body",
     lambda: fixture("vllm.txt").encode().replace(b"engine=", b"\xff\xfeengine=")),
    ("one huge line, no newline", lambda: b"x" * (200 << 10)),
    ("a wanted line with a million labels",
     lambda: ("vllm:num_requests_waiting{" + ",".join(f'l{i}="v"' for i in range(40000))
              + "} 1\n").encode()),
    ("a wanted name on 5,000 lines",
     lambda: b"vllm:num_requests_waiting 1\n" * 5000),
    ("200 KB of wanted lines, each under the line limit",
     lambda: b"".join(b'vllm:num_requests_waiting{l="%d",pad="%s"} 1\n' % (i, b"p" * 2000)
                      for i in range(100))),
    ("HTML", lambda: b"<html><body>metrics moved</body></html>\n"),
])
async def test_garbage_fails_the_poll_once_logged_and_hurts_nothing(
        name: str, body: Callable[[], bytes], bad: Misbehaving, pods: Pods,
        scrapers: list[MetricsScraper], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    port = await bad.http("body", body)
    good = await pods.add(fixture("vllm.txt"))
    store = Datastore()
    store.set_endpoints([ep_at(port), good.endpoint()])
    s = start(scrapers, store, opts(max_body_bytes=1 << 20, max_interval_s=0.02,
                                    staleness_threshold_s=10.0))
    key = f"127.0.0.1:{port}"
    await eventually(lambda: s.scrapes_failed >= 5, what="5 failed polls")
    n = s.scrapes_ok
    await eventually(lambda: s.scrapes_ok >= n + 5, what="the good pod still scraped")
    assert "failed" in (s.last_error(key) or "")
    assert warnings(caplog, key) == 1, [r.getMessage() for r in caplog.records]
    assert all(len(r.getMessage()) < 600 for r in caplog.records)  # no garbage dumped
    assert s.unreachable_count() == 0
    assert metrics(store, good).running_requests == 7
    assert len(s._line_cache) < 100 and s._line_cache.chars < (1 << 20)


async def test_unusually_large_but_valid_body_is_read(pods: Pods,
                                                     scrapers: list[MetricsScraper]) -> None:
    # 3 MiB of unrelated families (many LoRA adapters, big histograms) under the 4 MiB cap.
    pad = "".join(f'vllm:some_histogram_bucket{{le="{i}",lora="adapter-{i}"}} {i}\n'
                  for i in range(60000))
    pod = await pods.add(fixture("vllm.txt") + pad)
    assert len(pod.body) > 3 << 20
    store = Datastore()
    store.set_endpoints([pod.endpoint()])
    start(scrapers, store, opts(timeout_s=5.0, max_body_bytes=ScrapeOptions().max_body_bytes))
    await eventually(lambda: metrics(store, pod).running_requests == 7, what="values")


# ---------------------------------------------------------------- unreachable endpoints


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens: connection refused


@pytest.mark.parametrize("kind", ["refused", "close", "reset"])
async def test_connection_errors_mark_unreachable_at_once(
        kind: str, bad: Misbehaving, pods: Pods, scrapers: list[MetricsScraper],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    port = closed_port() if kind == "refused" else await bad.tcp(kind)
    good = await pods.add(fixture("vllm.txt"))
    store = Datastore()
    store.set_endpoints([ep_at(port), good.endpoint()])
    # A long staleness threshold: exclusion must not wait for staleness.
    s = start(scrapers, store, opts(staleness_threshold_s=30.0))
    key = f"127.0.0.1:{port}"
    await eventually(lambda: store.unreachable_count() == 1, what="unreachable")
    assert s.scrapes_failed >= 1
    e = store.get(key)
    assert e is not None and e.metrics.unreachable and not e.metrics.stale
    assert [x.key for x in store.routable()] == [good.key]
    assert [x.key for x in store.snapshot()] == [key, good.key]  # listed, never dropped
    fams = {f.name: f for f in ScraperCollector(s).collect()}
    assert fams["epp_model_server_unreachable_endpoints"].samples[0].value == 1
    per_pod = {x.labels["model_server_pod"]: x.value
               for x in fams["epp_model_server_unreachable"].samples}
    assert per_pod == {f"pod-{port}": 1.0, f"pod-{good.port}": 0.0}
    n = s.scrapes_failed
    await eventually(lambda: s.scrapes_failed >= n + 3, what="more failed polls")
    assert sum("is unreachable" in r.getMessage() for r in caplog.records) == 1


async def test_scheduler_never_gets_an_unreachable_endpoint(
        scrapers: list[MetricsScraper], pods: Pods) -> None:
    good = [await pods.add(fixture("vllm.txt")) for _ in range(2)]
    dead = closed_port()
    store = Datastore()
    store.set_endpoints([ep_at(dead), *(p.endpoint() for p in good)])
    start(scrapers, store, opts())
    await eventually(lambda: store.unreachable_count() == 1)
    built = load_and_build()
    director = Director(SchedulingCore(store, built.scheduler, EppMetrics(store),
                                       built.pre_request, built.response_complete))
    picked = set()
    for i in range(60):
        r = await director.route({":method": "POST", ":path": "/v1/completions",
                                  "x-request-id": f"r{i}"},
                                 orjson.dumps({"model": "m", "prompt": f"p {i}"}), True, None)
        picked.add(r.destination)
    assert picked == {p.key for p in good}


async def test_restarted_pod_is_reachable_again_within_a_second(
        pods: Pods, scrapers: list[MetricsScraper], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    port = closed_port()
    store = Datastore()
    store.set_endpoints([ep_at(port)])
    # Default backoff bounds (ceiling = threshold / 4 = 0.5 s) at a 50 ms interval.
    s = start(scrapers, store, opts(interval_s=0.05, staleness_threshold_s=2.0))
    key = f"127.0.0.1:{port}"
    await eventually(lambda: store.unreachable_count() == 1)
    # Let the failure backoff reach its bound before the pod comes back.
    await eventually(lambda: s.scrapes_failed >= 6, what="backoff at its bound")
    pod = await pods.add(fixture("vllm.txt"), port=port)
    t0 = time.monotonic()
    await eventually(lambda: (e := store.get(key)) is not None and not e.metrics.unreachable,
                     timeout=3.0, what="reachable again")
    assert time.monotonic() - t0 < 1.2
    assert [e.key for e in store.routable()] == [pod.key]
    assert metrics(store, pod).running_requests == 7
    assert sum("reachable again" in r.getMessage() for r in caplog.records) == 1


async def test_error_status_clears_unreachable(pods: Pods,
                                               scrapers: list[MetricsScraper]) -> None:
    port = closed_port()
    store = Datastore()
    store.set_endpoints([ep_at(port)])
    s = start(scrapers, store, opts(max_interval_s=0.02))
    await eventually(lambda: store.unreachable_count() == 1)
    pod = await pods.add(fixture("vllm.txt"), port=port)
    pod.status = 503  # up, but its metrics are not ready: reachable, still failing
    await eventually(lambda: store.unreachable_count() == 0, what="reachable")
    assert "HTTP 503" in (s.last_error(pod.key) or "")


def test_routable_fails_open_when_every_endpoint_is_unreachable(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="epp.datastore.store")
    store = Datastore()
    eps = [Endpoint(f"p{i}", "10.0.0.1", 8000 + i) for i in range(3)]
    store.set_endpoints(eps)
    down = Metrics(unreachable=True)
    assert store.routable() is store.snapshot()  # nothing unreachable: the snapshot itself
    store.update_metrics(eps[0].key, down)
    live = store.routable()
    assert [e.key for e in live] == [eps[1].key, eps[2].key]
    assert store.routable() is live  # cached with the snapshot: no work per request
    store.update_metrics_many({eps[1].key: down, eps[2].key: down})
    assert [e.key for e in store.routable()] == [e.key for e in eps]  # fail open
    assert store.unreachable_count() == 3
    for _ in range(3):
        store.update_metrics(eps[0].key, down)  # new snapshots, still all down
        assert len(store.routable()) == 3
    store.update_metrics(eps[2].key, Metrics())
    assert [e.key for e in store.routable()] == [eps[2].key]
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("fail open" in m and "every endpoint (3)" in m for m in msgs) == 1
    assert sum("fail open ended" in m for m in msgs) == 1
    # Discovery keeps the mark for endpoints it keeps; a re-added endpoint starts clean.
    store.set_endpoints(eps[1:])
    store.set_endpoints(eps)
    assert not store.get(eps[0].key).metrics.unreachable  # type: ignore[union-attr]
    assert store.get(eps[1].key).metrics.unreachable  # type: ignore[union-attr]


def test_max_body_bytes_is_validated() -> None:
    with pytest.raises(ConfigError, match="--model-server-metrics-max-bytes"):
        ScrapeOptions(max_body_bytes=10).validate()


def test_cli_flag_sets_the_cap() -> None:
    from epp.cli import build_parser

    base = ["serve", "--endpoints", "10.0.0.1:8000"]
    assert build_parser().parse_args(base).model_server_metrics_max_bytes \
        == ScrapeOptions().max_body_bytes == 4 << 20
    a = build_parser().parse_args([*base, "--model-server-metrics-max-bytes", "1048576"])
    assert a.model_server_metrics_max_bytes == 1 << 20


async def test_utf8_split_across_chunks_and_truncated_utf8(
        bad: Misbehaving, scrapers: list[MetricsScraper]) -> None:
    # A multi-byte character split over chunk boundaries is fine; one cut off is not.
    other = "".join(f'other_metric{{m="modèle-ünïcødé-{i}"}} 1\n' for i in range(12000))
    ok = (other + 'vllm:num_requests_waiting{m="modèle"} 4\n'
          'vllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.5\n').encode()
    assert len(ok) > 300_000  # several chunks
    good = await bad.http("body", lambda: ok)
    cut = await bad.http("body", lambda: ok[:50] + "é".encode()[:1])
    store = Datastore()
    store.set_endpoints([ep_at(good), ep_at(cut)])
    s = start(scrapers, store, opts(max_body_bytes=1 << 20))
    await eventually(lambda: (e := store.get(f"127.0.0.1:{good}")) is not None
                     and e.metrics.waiting_queue_size == 4, what="multi-chunk UTF-8 body")
    await eventually(lambda: "UTF-8" in (s.last_error(f"127.0.0.1:{cut}") or ""))


async def test_gateway_report_marks_unreachable_until_the_next_answer(
        pods: Pods, scrapers: list[MetricsScraper]) -> None:
    """Envoy's connect-failure report excludes an endpoint at once; a scrape that gets an
    answer puts it back (a wrong report costs at most one interval)."""
    a = await pods.add(fixture("vllm.txt"))
    b = await pods.add(fixture("vllm.txt"))
    store = Datastore()
    store.set_endpoints([ep_at(a.port), ep_at(b.port)])
    s = start(scrapers, store, opts(interval_s=0.05))
    key = f"127.0.0.1:{a.port}"
    await eventually(lambda: s.scrapes_ok >= 2)
    s.report_unreachable(key)
    s.report_unreachable("10.9.9.9:1")  # not an endpoint: ignored
    s._commit()
    assert [e.key for e in store.routable()] == [f"127.0.0.1:{b.port}"]
    await eventually(lambda: len(store.routable()) == 2, what="cleared by the next scrape")
