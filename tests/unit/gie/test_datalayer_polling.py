"""GIE v1.5.0 test/integration/epp/runtime_polling_test.go: the data layer's polling
source against a model server's /metrics, in process.

Go builds a ``Runtime`` with an HTTP source and mock extractors, adds an endpoint
(``NewEndpoint``) and releases it (``ReleaseEndpoint``). Here the same roles: the
config's ``metrics-data-source`` and ``core-metrics-extractor`` (through
:func:`~epp.datalayer.config.scraper_settings`) drive the EPP's scraper; an endpoint
joins and leaves the datastore. Go's mock extractor counts its calls; here a scrape that
reaches the extractor writes the endpoint's metrics (``Metrics.updated_at`` moves), and
the fake pod counts its requests.

Not translated: TestRuntimePollingMultipleExtractors — one metrics source feeds one
``core-metrics-extractor`` here (the loader rejects two, tests/unit/gie/test_config_loader.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
from aiohttp import web

from epp.config.loader import BuiltConfig, build, parse_config
from epp.datalayer.config import scraper_settings
from epp.datalayer.engines import MappingOverrides
from epp.datalayer.scraper import MetricsScraper, ScrapeOptions
from epp.datastore.store import Datastore
from epp.scheduling.types import Endpoint
from tests.polling import eventually

# Go's createTestMetricsServer gauges.
METRICS = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting 5
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 2
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc 0.75
"""

CONFIG = """
plugins:
- type: queue-scorer
- {type: metrics-data-source, name: test-source, parameters: {path: /metrics}}
- {type: core-metrics-extractor, name: test-extractor}
dataLayer:
  sources:
  - pluginRef: test-source
    extractors: [{pluginRef: test-extractor}]
"""


@dataclass
class Pod:
    port: int
    status: int = 200
    requests: int = 0


@pytest_asyncio.fixture
async def pod() -> AsyncIterator[Pod]:
    state = Pod(0)

    async def metrics(request: web.Request) -> web.Response:
        state.requests += 1
        if state.status != 200:
            return web.Response(status=state.status)
        return web.Response(text=METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None and server.sockets
    state.port = server.sockets[0].getsockname()[1]
    yield state
    await runner.cleanup()


def built(text: str = CONFIG) -> BuiltConfig:
    return build(parse_config(text, "cfg.yaml"))


@pytest_asyncio.fixture
async def runtime() -> AsyncIterator[tuple[Datastore, list[MetricsScraper]]]:
    store = Datastore()
    scrapers: list[MetricsScraper] = []
    yield store, scrapers
    for s in scrapers:
        await s.stop()


def start(store: Datastore, scrapers: list[MetricsScraper], text: str = CONFIG,
          ) -> MetricsScraper | None:
    """Go's NewRuntime(50ms) + Configure: the scraper the config's data layer asks for."""
    settings = scraper_settings(built(text).data_layer, True, ScrapeOptions(interval_s=0.05),
                                MappingOverrides())
    if settings is None:
        return None
    scraper = MetricsScraper(store, *settings)
    scrapers.append(scraper)
    scraper.start()
    return scraper


def endpoint(pod: Pod) -> Endpoint:
    return Endpoint(name="test-pod", namespace="test-ns", address="127.0.0.1", port=pod.port)


@pytest.mark.parametrize("ticks", [1, 3])
async def test_polling_dispatch(ticks: int, pod: Pod,
                                runtime: tuple[Datastore, list[MetricsScraper]]) -> None:
    """TestRuntimePollingDispatch: "single poll cycle updates endpoint", "multiple ticks
    trigger multiple polls", "endpoint receives metrics on poll"."""
    store, scrapers = runtime
    scraper = start(store, scrapers)
    assert scraper is not None
    store.set_endpoints([endpoint(pod)])  # Go: r.NewEndpoint(ctx, endpointMeta, nil)
    await eventually(lambda: scraper.scrapes_ok >= ticks and pod.requests >= ticks)
    await eventually(lambda: store.snapshot()[0].metrics.updated_at is not None)
    m = store.snapshot()[0].metrics
    assert (m.waiting_queue_size, m.running_requests, m.kv_cache_usage) == (5, 2, 0.75)


async def test_polling_endpoint_lifecycle(pod: Pod,
                                          runtime: tuple[Datastore, list[MetricsScraper]]
                                          ) -> None:
    """TestRuntimePollingEndpointLifecycle: no poll after the endpoint is released."""
    store, scrapers = runtime
    scraper = start(store, scrapers)
    assert scraper is not None
    store.set_endpoints([endpoint(pod)])
    await eventually(lambda: scraper.scrapes_ok >= 1)
    store.set_endpoints([])  # Go: r.ReleaseEndpoint(ep)
    settled = pod.requests
    # The point is time passing without polls: three intervals (Go sleeps two).
    await asyncio.sleep(0.15)
    assert pod.requests - settled <= 1  # at most a poll already in flight


async def test_polling_without_extractors(pod: Pod,
                                          runtime: tuple[Datastore, list[MetricsScraper]]
                                          ) -> None:
    """TestRuntimePollingWithoutExtractors: accepted; with no extractor nothing reads the
    polled data, so this EPP does not poll at all."""
    store, scrapers = runtime
    text = """
        plugins:
        - type: queue-scorer
        - {type: metrics-data-source, name: test-source}
        dataLayer: {sources: [{pluginRef: test-source}]}
    """
    assert start(store, scrapers, text) is None
    store.set_endpoints([endpoint(pod)])
    assert store.snapshot()[0].metrics.updated_at is None  # never scraped


async def test_polling_http_error(pod: Pod,
                                  runtime: tuple[Datastore, list[MetricsScraper]]) -> None:
    """TestRuntimePollingHTTPError: a 500 reaches no extractor; polling goes on."""
    store, scrapers = runtime
    pod.status = 500
    scraper = start(store, scrapers)
    assert scraper is not None
    store.set_endpoints([endpoint(pod)])
    await eventually(lambda: pod.requests >= 3, timeout=10)
    assert scraper.scrapes_ok == 0 and scraper.scrapes_failed >= 1
    assert store.snapshot()[0].metrics.waiting_queue_size == 0
    pod.status = 200  # and the next poll that succeeds is extracted
    await eventually(lambda: store.snapshot()[0].metrics.waiting_queue_size == 5, timeout=10)
