"""Polling data sources other than the metrics scraper (llm-d-router v0.10.0's
``HTTPDataSource``, pkg/epp/framework/plugins/datalayer/source/http): ``dcgm-data-source``.

One asyncio task per configured source. Each tick it GETs
``<scheme>://<endpoint address>:<port><path>`` for every endpoint in the datastore
(concurrently), parses the Prometheus text and hands it to the source's extractors; the
scalar attributes they return are MERGED into the endpoint's ``Metrics.attributes`` (the
scraper writes a fresh :class:`~epp.scheduling.types.Metrics` on each scrape and carries
the attributes over, see epp/datalayer/scraper.py). A failed poll or extractor keeps the
attribute's last value (llm-d logs and leaves it) and is logged once per change of error.

The period is the source's ``interval`` rounded to the nearest multiple of the base tick
(``--refresh-metrics-interval``), at least one tick; no interval: every base tick.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol, runtime_checkable

import aiohttp

from epp.datalayer import promparse
from epp.datastore.store import Datastore
from epp.framework.interfaces import DataExtractor, DataSource
from epp.scheduling.types import Endpoint

log = logging.getLogger(__name__)

#: Longest body read from a polled exporter (a DCGM exporter's page is a few 10 KiB).
MAX_BODY_BYTES = 16 * 1024 * 1024
TIMEOUT_S = 5.0

Payload = Mapping[str, Sequence[promparse.Sample]]


@runtime_checkable
class PollingSource(DataSource, Protocol):
    """A source the EPP polls per endpoint over HTTP (llm-d's ``HTTPDataSource``)."""

    scheme: str
    path: str
    port: int
    insecure_skip_verify: bool
    interval_s: float | None  # None: every base tick

    def url(self, endpoint: Endpoint) -> str: ...


@runtime_checkable
class PollingExtractor(DataExtractor, Protocol):
    """Reads a polling source's parsed payload for one endpoint (llm-d's
    ``PollingExtractor``) and returns the scalar attributes to set on it. Raises
    ``ValueError`` when the payload has nothing for the endpoint."""

    def extract_poll(self, payload: Payload, endpoint: Endpoint) -> Mapping[str, float]: ...


def effective_interval(interval_s: float | None, base_s: float) -> float:
    """llm-d's rounding: to the nearest multiple of the base tick, at least one tick."""
    if interval_s is None or interval_s <= 0:
        return base_s
    return max(1, round(interval_s / base_s)) * base_s


class PollingRunner:
    """Runs every polling source of the data layer against ``store``."""

    def __init__(self, store: Datastore,
                 sources: Sequence[tuple[PollingSource, Sequence[PollingExtractor]]],
                 base_interval_s: float) -> None:
        self._store = store
        self._sources = list(sources)
        self._base = base_interval_s
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._problems: dict[tuple[str, str], str] = {}
        self.polls_ok = 0
        self.polls_failed = 0

    def start(self) -> None:
        """Start one task per source; call from inside the running loop, once."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_S),
            headers={"Accept": "text/plain"})
        loop = asyncio.get_running_loop()
        for src, extractors in self._sources:
            self._tasks.append(loop.create_task(self._run(src, extractors),
                                                name=f"data-source {src.name}"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self, src: PollingSource, extractors: Sequence[PollingExtractor]) -> None:
        period = effective_interval(src.interval_s, self._base)
        ssl_ctx: ssl.SSLContext | bool = (False if src.insecure_skip_verify
                                          else ssl.create_default_context())
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            eps = self._store.snapshot()
            await asyncio.gather(*(self.poll(src, extractors, ep, ssl_ctx) for ep in eps))
            await asyncio.sleep(max(0.0, started + period - loop.time()))

    async def poll(self, src: PollingSource, extractors: Sequence[PollingExtractor],
                   ep: Endpoint, ssl_ctx: ssl.SSLContext | bool = False) -> None:
        """One poll of ``ep`` by ``src``; never raises (but on cancellation)."""
        url = src.url(ep)
        try:
            payload = promparse.parse(await self._fetch(url, ssl_ctx))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of one poll is logged, not fatal
            self.polls_failed += 1
            self._report(src.name, ep.key, f"{src.type_name} {src.name!r}: poll of {url} "
                         f"failed: {type(e).__name__}: {e}")
            return
        self.polls_ok += 1
        attrs: dict[str, float] = {}
        for ext in extractors:
            try:
                attrs.update(ext.extract_poll(payload, ep))
            except Exception as e:  # noqa: BLE001 - one extractor's error must not stop others
                self._report(ext.name, ep.key, f"{ext.type_name} {ext.name!r} on {ep.key}: {e}")
            else:
                self._report(ext.name, ep.key, None)
        self._report(src.name, ep.key, None)
        if attrs:
            self.merge(ep.key, attrs)

    def merge(self, key: str, attrs: Mapping[str, float]) -> None:
        """Merge ``attrs`` into ``key``'s current attributes (other sources' are kept)."""
        current = self._store.get(key)
        if current is None:
            return
        old = current.metrics.attributes
        if all(old.get(k) == v for k, v in attrs.items()):
            return
        self._store.update_metrics(key, replace(current.metrics,
                                                attributes={**old, **attrs}))

    async def _fetch(self, url: str, ssl_ctx: ssl.SSLContext | bool) -> str:
        assert self._session is not None
        async with self._session.get(url, ssl=ssl_ctx, allow_redirects=False) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
            body = await resp.content.read(MAX_BODY_BYTES + 1)
            if len(body) > MAX_BODY_BYTES:
                raise ValueError(f"body exceeds {MAX_BODY_BYTES} bytes")
            return body.decode("utf-8")

    def _report(self, who: str, key: str, problem: str | None) -> None:
        """Log a problem once per change (not once per poll), and its recovery."""
        prev = self._problems.get((who, key))
        if problem == prev:
            return
        if problem is None:
            self._problems.pop((who, key), None)
            log.info("data layer: %s on %s recovered", who, key)
        else:
            self._problems[(who, key)] = problem
            log.warning("data layer: %s (logged again only if the error changes)", problem)
