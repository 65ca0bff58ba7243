"""Polling data sources other than the metrics scraper (llm-d-router v0.10.0's
``HTTPDataSource``, pkg/epp/framework/plugins/datalayer/source/http): ``dcgm-data-source``
and ``models-data-source``.

One asyncio task per configured source. Each tick it GETs ``src.url(endpoint)`` for every
endpoint in the datastore (concurrently), parses the body — Prometheus text, or with the
source's own ``parse(text)`` (``models-data-source``: the ``/v1/models`` JSON) — and
hands it to the source's extractors. A source may set ``accept`` (the Accept header;
``text/plain`` otherwise) and ``ssl_context()`` (its TLS settings: CA bundle, client
certificate; otherwise ``insecure_skip_verify`` alone decides). The
scalar attributes extractors return are MERGED into the endpoint's ``Metrics.attributes`` (the
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
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import aiohttp

from epp.datalayer import promparse
from epp.datastore.store import Datastore
from epp.framework.interfaces import DataExtractor, DataSource
from epp.framework.params import ParameterError
from epp.scheduling.types import Endpoint

if TYPE_CHECKING:
    from epp.observability.metrics import EppMetrics

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
    ``ValueError`` when the payload has nothing for the endpoint. ``payload`` is what its
    source parses: :data:`Payload` for Prometheus text sources."""

    def extract_poll(self, payload: Any, endpoint: Endpoint) -> Mapping[str, float]: ...


def effective_interval(interval_s: float | None, base_s: float) -> float:
    """llm-d's rounding: to the nearest multiple of the base tick, at least one tick."""
    if interval_s is None or interval_s <= 0:
        return base_s
    return max(1, round(interval_s / base_s)) * base_s


class PollingRunner:
    """Runs every polling source of the data layer against ``store``."""

    def __init__(self, store: Datastore,
                 sources: Sequence[tuple[PollingSource, Sequence[PollingExtractor]]],
                 base_interval_s: float, *, metrics: EppMetrics | None = None) -> None:
        """``metrics``: where failed polls and extractions are counted (llm-d's
        ``llm_d_epp_datalayer_{poll,extract}_errors_total``); None: not counted."""
        self._store = store
        self._metrics = metrics
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
        make_ctx = getattr(src, "ssl_context", None)
        ssl_ctx: ssl.SSLContext | bool = (
            make_ctx() if callable(make_ctx)
            else False if src.insecure_skip_verify else ssl.create_default_context())
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
        parse = getattr(src, "parse", None) or promparse.parse
        try:
            payload = parse(await self._fetch(url, ssl_ctx, getattr(src, "accept", None)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of one poll is logged, not fatal
            self.polls_failed += 1
            if self._metrics is not None:  # llm-d's Collector: RecordDataLayerPollError
                self._metrics.record_datalayer_poll_error(src.type_name)
            self._report(src.name, ep.key, f"{src.type_name} {src.name!r}: poll of {url} "
                         f"failed: {type(e).__name__}: {e}")
            return
        self.polls_ok += 1
        attrs: dict[str, float] = {}
        for ext in extractors:
            try:
                attrs.update(ext.extract_poll(payload, ep))
            except Exception as e:  # noqa: BLE001 - one extractor's error must not stop others
                if self._metrics is not None:  # HTTPDataSource.runExtractor
                    self._metrics.record_datalayer_extract_error(src.type_name, ext.type_name)
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

    async def _fetch(self, url: str, ssl_ctx: ssl.SSLContext | bool,
                     accept: str | None = None) -> str:
        assert self._session is not None
        headers = {"Accept": accept} if accept else None
        async with self._session.get(url, ssl=ssl_ctx, allow_redirects=False,
                                     headers=headers) as resp:
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


def client_tls_context(insecure_skip_verify: bool, ca_cert_path: str = "",
                client_cert_path: str = "", client_key_path: str = "") -> ssl.SSLContext:
    """llm-d's tlsClientConfig: skip verification, or verify against ``ca_cert_path``
    (else the system pool); a client certificate when either path is set. Raises
    ParameterError naming the key whose file is bad."""
    ctx = ssl.create_default_context()
    if insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif ca_cert_path:
        try:
            ctx = ssl.create_default_context(cafile=ca_cert_path)
        except (OSError, ssl.SSLError) as e:
            raise ParameterError("caCertPath", f"reading CA cert {ca_cert_path}: {e}") from None
    if client_cert_path or client_key_path:
        if not (client_cert_path and client_key_path):
            raise ParameterError("clientCertPath" if not client_cert_path else "clientKeyPath",
                                 "loading client cert: set clientCertPath and "
                                 "clientKeyPath together")
        try:
            ctx.load_cert_chain(client_cert_path, client_key_path)
        except (OSError, ssl.SSLError) as e:
            raise ParameterError("clientCertPath", f"loading client cert "
                                 f"{client_cert_path} / key {client_key_path}: {e}") from None
    return ctx
