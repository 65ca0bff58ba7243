"""dcgm-data-source / dcgm-extractor (llm-d-router v0.10.0,
pkg/epp/framework/plugins/datalayer/{source,extractor}/dcgm): GPU utilization from a
(fake, local aiohttp) DCGM exporter as the ``GPUUtilization/dcgm-extractor`` attribute,
and llm-d's deploy/config/sim-epp-gpu-config.yaml routing by it."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from yarl import URL

from epp.config.loader import load_and_build
from epp.datalayer import promparse
from epp.datalayer.polling import PollingRunner, effective_interval
from epp.datalayer.scraper import MetricsScraper, ScrapeOptions, _EndpointState
from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.scheduling.plugins.dcgm import GPU_UTILIZATION_KEY, DCGMDataSource, DCGMExtractor
from epp.scheduling.types import Endpoint, Metrics
from tests.polling import eventually
from tests.unit.scheduling.test_llmd_plugins import GPU_CONFIG, make, send, server

KEY = GPU_UTILIZATION_KEY


def ep(i: int, name: str | None = None, attrs: dict[str, float] | None = None) -> Endpoint:
    return Endpoint(name=name or f"pod-{i}", address=f"127.0.0.{i}", port=8000,
                    metrics=Metrics(attributes=attrs or {}))


def attr(store: Datastore, key: str) -> float | None:
    e = store.get(key)
    return None if e is None else e.metrics.attributes.get(KEY)


def dcgm_text(samples: list[tuple[dict[str, str], float]]) -> str:
    lines = ["# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).",
             "# TYPE DCGM_FI_DEV_GPU_UTIL gauge"]
    for labels, v in samples:
        lbl = ",".join(f'{k}="{val}"' for k, val in labels.items())
        lines.append(f"DCGM_FI_DEV_GPU_UTIL{{{lbl}}} {v}")
    return "\n".join(lines) + "\n"


def build(type_name: str, params: dict[str, Any] | None = None) -> Any:
    return make(type_name, params)


# ------------------------------------------------------------------------- the plugins


def test_source_defaults_and_url() -> None:
    src = build("dcgm-data-source")
    assert isinstance(src, DCGMDataSource)
    assert (src.scheme, src.path, src.port, src.insecure_skip_verify, src.interval_s) == (
        "http", "/metrics", 9400, True, None)
    assert src.url(ep(1)) == "http://127.0.0.1:9400/metrics"
    src = build("dcgm-data-source", {"scheme": "https", "path": "m", "port": 9500,
                                      "interval": "1s"})
    assert src.url(ep(2)) == "https://127.0.0.2:9500/m" and src.interval_s == 1.0


@pytest.mark.parametrize(("params", "fragment"), [
    ({"scheme": "ftp"}, "scheme: unsupported scheme 'ftp'"),
    ({"port": 0}, "port: expected a port number 1-65535, got 0"),
    ({"interval": "soon"}, "interval: expected a duration"),
    ({"useNodeAddress": "yes"}, "useNodeAddress: expected true or false"),
])
def test_source_rejects(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        build("dcgm-data-source", params)


def test_interval_rounds_to_the_base_tick() -> None:
    assert effective_interval(None, 0.05) == 0.05
    assert effective_interval(1.0, 0.05) == pytest.approx(1.0)
    assert effective_interval(0.12, 0.05) == pytest.approx(0.1)
    assert effective_interval(0.01, 0.05) == 0.05


def test_extractor_max_of_the_pods_gpus_normalized() -> None:
    ext = DCGMExtractor()
    payload = promparse.parse(dcgm_text([
        ({"gpu": "0", "pod": "pod-1"}, 40), ({"gpu": "1", "pod": "pod-1"}, 80),
        ({"gpu": "0", "pod": "pod-2"}, 95), ({"gpu": "2"}, 10)]))
    assert ext.extract_poll(payload, ep(1)) == {KEY: 0.8}
    assert ext.extract_poll(payload, ep(2)) == {KEY: 0.95}
    assert ext.extract_poll(payload, ep(3)) == {KEY: 0.1}  # unlabelled samples are kept
    with pytest.raises(ValueError, match="no samples for pod 'x'"):
        ext.extract_poll(promparse.parse(dcgm_text([({"pod": "y"}, 5)])), ep(1, "x"))
    with pytest.raises(ValueError, match="not found in DCGM response"):
        ext.extract_poll(promparse.parse("other 1\n"), ep(1))


def test_dcgm_extractor_needs_a_dcgm_source() -> None:
    text = """
plugins:
- {type: metrics-data-source}
- {type: dcgm-extractor}
- {type: max-score-picker}
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: dcgm-extractor}]
"""
    with pytest.raises(ConfigError, match="attach it to a dcgm-data-source"):
        load_and_build(None, text)
    text = text.replace("dcgm-extractor", "core-metrics-extractor").replace(
        "type: metrics-data-source", "type: dcgm-data-source").replace(
        "pluginRef: metrics-data-source", "pluginRef: dcgm-data-source")
    with pytest.raises(ConfigError, match=r"needs extract_poll\(payload, endpoint\)"):
        load_and_build(None, text)


# ------------------------------------------------------------------ the fake exporter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeExporter:
    """One DCGM exporter for every 127.0.0.x address: answers with the utilization set
    for the address the request came in on (the pod IP)."""

    def __init__(self) -> None:
        self.util: dict[str, float] = {}
        self.status = 200
        self.hits = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        assert request.path == "/metrics"
        local = request.transport.get_extra_info("sockname")[0] if request.transport else ""
        pod = f"pod-{local.rsplit('.', 1)[-1]}"
        util = self.util.get(local)
        body = dcgm_text([({"gpu": "0", "pod": pod}, util)] if util is not None else [])
        return web.Response(text=body, status=self.status)


@pytest.fixture
async def exporter() -> AsyncIterator[tuple[FakeExporter, int]]:
    fake = FakeExporter()
    app = web.Application()
    app.router.add_get("/metrics", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "0.0.0.0", port)
    await site.start()
    try:
        yield fake, port
    finally:
        await runner.cleanup()


async def test_runner_merges_attributes_and_keeps_them_on_failure(
        exporter: tuple[FakeExporter, int]) -> None:
    fake, port = exporter
    store = Datastore()
    store.set_endpoints([ep(1, attrs={"Other/x": 7.0}), ep(2)])
    fake.util = {"127.0.0.1": 30.0, "127.0.0.2": 70.0}
    runner = PollingRunner(store, [(DCGMDataSource("d", port=port), [DCGMExtractor()])],
                           0.02)
    runner.start()
    try:
        await eventually(lambda: attr(store, "127.0.0.2:8000") == 0.7)
        a1 = store.get("127.0.0.1:8000")
        assert a1 is not None and dict(a1.metrics.attributes) == {"Other/x": 7.0, KEY: 0.3}
        fake.status = 500
        hits = fake.hits
        await eventually(lambda: runner.polls_failed >= 2 and fake.hits > hits + 2)
        a1 = store.get("127.0.0.1:8000")
        assert a1 is not None and a1.metrics.attributes[KEY] == 0.3  # last value kept
    finally:
        await runner.stop()


async def test_scraper_writes_keep_other_sources_attributes() -> None:
    store = Datastore()
    store.set_endpoints([ep(1)])
    store.update_metrics("127.0.0.1:8000", Metrics(attributes={KEY: 0.5}))
    scraper = MetricsScraper(store, ScrapeOptions(commit_interval_s=0))
    scraper._stage(scraper_state(scraper), Metrics(waiting_queue_size=3))
    got = store.get("127.0.0.1:8000")
    assert got is not None and got.metrics.waiting_queue_size == 3
    assert dict(got.metrics.attributes) == {KEY: 0.5}


def scraper_state(scraper: MetricsScraper) -> Any:
    return _EndpointState("127.0.0.1:8000", URL("http://127.0.0.1:8000/metrics"), 0.0)


# ----------------------------------------------------- llm-d's sim-epp-gpu-config.yaml


async def test_gpu_config_loads_and_filters_the_busy_gpu(
        exporter: tuple[FakeExporter, int]) -> None:
    """deploy/config/sim-epp-gpu-config.yaml as shipped (only the exporter's port moved to
    the fake's): the pod above 90 % GPU utilization is filtered out, the least utilized
    one wins."""
    fake, port = exporter
    built = load_and_build(str(GPU_CONFIG), strict=True)
    assert isinstance(built.plugins["dcgm-source"], DCGMDataSource)
    text = GPU_CONFIG.read_text()
    assert "port: 9400" in text
    parts = server(text.replace("port: 9400", f"port: {port}"), eps=[ep(1), ep(2), ep(3)])
    fake.util = {"127.0.0.1": 95.0, "127.0.0.2": 50.0, "127.0.0.3": 20.0}
    # llm-d adds the metrics source beside the listed one (injectDefaults unset)
    assert parts.pollers is not None and parts.scraper is not None
    parts.pollers.start()
    try:
        def polled() -> bool:
            return all(KEY in e.metrics.attributes for e in parts.store.snapshot())
        await eventually(polled)
        for i in range(3):
            routing, _ = await send(parts, f"r{i}")
            assert routing.destination == "127.0.0.3:8000"
        fake.util["127.0.0.3"] = 99.0  # now pod-2 is the only one under the threshold
        await eventually(lambda: attr(parts.store, "127.0.0.3:8000") == 0.99)
        routing, _ = await send(parts, "r-after")
        assert routing.destination == "127.0.0.2:8000"
    finally:
        await parts.pollers.stop()
