"""The metrics scraper: one asyncio task per endpoint polling its Prometheus ``/metrics``.

Lifecycle: :meth:`MetricsScraper.start` (from inside the running loop) starts a task for
every endpoint in the datastore and subscribes to additions and removals, so tasks follow
discovery; ``await`` :meth:`MetricsScraper.stop` cancels and awaits every task and closes
the shared ``aiohttp.ClientSession``. No threads.

Per poll: ``GET {scheme}://{address}:{port}{path}`` (port = the endpoint's unless
overridden) under a shared concurrency semaphore and a per-poll timeout; the body is
read through :class:`epp.datalayer.promparse.SampleIndex` (only the lines of the metric
names the endpoint engine's mapping asks for are tokenized; unchanged lines hit a line
cache) and mapped by the endpoint's :class:`~epp.datalayer.engines.EngineMapping`.
A scrape that succeeds but lacks a required signal (waiting, running, KV usage) is a
partial success, as in GIE: the found values are used, the missing ones keep their
previous values, and the gap is logged; a body with none of them is a failed scrape.
Polls of one endpoint are spaced ``interval`` apart start to start, ±10 % (a slow poll
delays the next one; missed ticks are not replayed); each endpoint starts at a random
phase, and re-phases randomly after falling behind, so 200 endpoints never fire in one
burst.

Failures and staleness: an error (connect failure, timeout, non-200, oversized or
malformed body) is logged when it differs in kind from the endpoint's previous error —
not once per poll, and not again when only a garbage body's details change — and a
recovery is logged once. A failing endpoint is polled less often (the interval doubles
per consecutive failure, up to the ceiling below and at most ``MAX_FAILURE_BACKOFF_S``,
1 s) so dead pods do not crowd out live ones. An endpoint keeps its last values; once
its last successful scrape is older than ``staleness_threshold_s`` (checked on every
failed poll and by a sweeper every ``sweep_period_s``, so also while a poll hangs) its
metrics are re-published with ``stale=True``. Stale endpoints are still scheduled.

Unreachable endpoints: a poll that fails at the connection level before any response —
refused, reset, or closed by the peer — marks the endpoint ``Metrics.unreachable`` at
once (a SIGKILLed pod whose address is still listed refuses connections); so do
``UNREACHABLE_AFTER_TIMEOUTS`` (3) polls in a row that get no response headers within the
timeout (a node gone dark, a frozen process; about 3 × ``timeout_s``). The datastore
leaves unreachable endpoints out of the scheduler's candidates (``Datastore.routable``)
unless every endpoint is unreachable (fail open). Any HTTP answer clears the mark — a
successful scrape, but also an error status or a bad body, since the pod's server is
evidently up; TLS errors and slow bodies do not set it. The scraper never drops an
endpoint from the datastore: discovery owns the set. Timing at the defaults: a dead
pod is marked by the first poll after its death (≤ one interval, 50 ms, more under
load shedding) plus the commit delay (10 ms); a restarted one is noticed within the
failure backoff (≤ ``min(ceiling, 1 s)``, 0.5 s by default, ±10 %).

Untrusted bodies: a pod's /metrics is input the EPP cannot trust. The body is read
chunk by chunk and the read aborts as soon as it exceeds ``max_body_bytes`` (also
without a Content-Length), so one poll holds at most about that much; a pod that
accepts and never answers, or trickles bytes, is cut off by the per-poll timeout. The body
is decoded as it arrives; one that is not UTF-8 fails the poll at its first invalid
chunk (strictly, as Prometheus reads the format: replacing the bytes of 4 MiB of binary
would cost ~90 ms of loop time, and an error on the whole body copies it), the lines read are bounded in
number, length and total size (:class:`_BoundedIndex`), as is the shared line cache
(:class:`_LineCache`), so garbage costs bounded time and memory and fails the poll.

Datastore writes and the scheduler's snapshot — the cost model. Every
``Datastore.update_metrics`` replaces an Endpoint and invalidates the cached snapshot the
Director hands the scheduler; 200 endpoints at 50 ms would do that 4,000 times a second
and make every scheduling cycle rebuild it. Two measures bound it:

1. *Write only what matters.* A scrape is written when a value changed or the ``stale``
   flag flips. When nothing changed, the write that refreshes ``Metrics.updated_at`` is
   skipped unless the stored stamp is older than ``freshness_resolution_s`` (default
   ``min(2 × interval, threshold / 4)``, 100 ms at the defaults). So an idle pool costs a
   write per endpoint per resolution, not per poll, and ``updated_at`` under-states
   freshness by at most that resolution (consumers wanting an exact age use
   :meth:`last_success`; ``stale`` is exact to the sweep period).
2. *Coalesce.* Writes are staged and applied together by
   ``Datastore.update_metrics_many`` at most every ``commit_interval_s`` (default 10 ms):
   the scraper invalidates the snapshot at most 100 times a second whatever the pool
   size, at the price of up to 10 ms of extra signal delay.

Never starve the loop. Scraping is background work sharing the loop that answers Envoy.
With ``max_loop_lag_s`` set (default 3 ms), a probe measures how late a 10 ms timer
fires; when the 90th percentile of that lateness over half a second is above the target
the effective interval is stretched (×1.5, up to ``max_interval_s``, default
``threshold / 4``) and it creeps back (×0.9) once the lag is under 3/4 of the target.
The scraper thus uses what the loop can spare — less when requests keep the loop busy
or the machine is contended — and :attr:`effective_interval` and the exported gauges
say what it achieved (docs/benchmarks.md has the numbers).
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import random
import ssl
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from yarl import URL

from epp.datalayer import promparse
from epp.datalayer.engines import EngineMapping, EngineMappings, Extracted
from epp.datastore.store import Datastore, Unsubscribe
from epp.errors import ConfigError
from epp.scheduling.types import NO_METRICS, Endpoint, Metrics

if TYPE_CHECKING:
    from epp.observability.metrics import EppMetrics

log = logging.getLogger(__name__)

_ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"

#: Default cap on a /metrics body (``--model-server-metrics-max-bytes``). vLLM's body is
#: typically 50-500 KB, a few MB with many LoRA adapters; the cap bounds the memory one
#: poll can take (the body is buffered up to it, then decoded) — see docs/configuration.md.
DEFAULT_MAX_BODY_BYTES = 4 << 20
#: Consecutive polls without response headers (timeouts) that mark an endpoint
#: unreachable; a connection error marks it at once.
UNREACHABLE_AFTER_TIMEOUTS = 3
#: The longest gap between polls of a failing endpoint (the failure backoff's bound,
#: unless load shedding has stretched the normal interval beyond it): how late the
#: recovery of a restarted pod can be noticed.
MAX_FAILURE_BACKOFF_S = 1.0
# Limits on the work one body can cause (_BoundedIndex, _LineCache).
_MAX_SAMPLES_PER_NAME = 1024
_MAX_SAMPLE_LINE = 64 << 10
_MAX_SAMPLE_TEXT = 128 << 10
_MAX_CACHED_LINE = 4096
_LINE_CACHE_CHARS = 512 << 10
_MAX_LOGGED_PROBLEM = 300  # characters of an error message that reach the log


@dataclass(frozen=True)
class ScrapeOptions:
    """Scraper settings (the ``--model-server-metrics-*``, ``--refresh-metrics-interval``,
    ``--metrics-*`` flags). All durations in seconds.

    - ``interval_s``: poll period per endpoint (start to start).
    - ``timeout_s``: per-poll timeout (connect, headers and body).
    - ``staleness_threshold_s``: no successful scrape for this long → ``stale=True``.
    - ``scheme`` / ``path`` / ``port``: the URL; ``port`` None = the endpoint's port.
    - ``insecure_skip_verify``: with https, do not verify certificates (GIE's default).
    - ``max_concurrency``: polls in flight at once, all endpoints together.
    - ``commit_interval_s``: datastore writes are applied in batches this often
      (0 = at once, one snapshot invalidation per write).
    - ``freshness_resolution_s``: unchanged values are re-written (to refresh
      ``updated_at``) at most this often; None = ``min(2 × interval, threshold / 4)``.
    - ``max_body_bytes``: a larger /metrics body is an error; the read stops at this many
      bytes (``--model-server-metrics-max-bytes``).
    - ``max_loop_lag_s``: load-shedding target (p90 event-loop lag); None = off.
    - ``max_interval_s``: the longest interval load shedding and failure backoff
      stretch to; None = ``threshold / 4``.
    - ``lag_probe_period_s``: period of the loop-lag probe.
    """

    interval_s: float = 0.05
    timeout_s: float = 1.0
    staleness_threshold_s: float = 2.0
    scheme: str = "http"
    path: str = "/metrics"
    port: int | None = None
    insecure_skip_verify: bool = True
    max_concurrency: int = 64
    commit_interval_s: float = 0.01
    freshness_resolution_s: float | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_loop_lag_s: float | None = 0.003
    max_interval_s: float | None = None
    lag_probe_period_s: float = 0.01

    def validate(self) -> ScrapeOptions:
        """Return self; raise :class:`ConfigError` on a nonsensical value."""
        if not self.interval_s > 0:
            raise ConfigError(f"--refresh-metrics-interval must be > 0, got {self.interval_s}")
        if not self.timeout_s > 0:
            raise ConfigError(f"metrics scrape timeout must be > 0, got {self.timeout_s}")
        if not self.staleness_threshold_s > 0:
            raise ConfigError("--metrics-staleness-threshold must be > 0, got "
                              f"{self.staleness_threshold_s}")
        if self.scheme not in ("http", "https"):
            raise ConfigError(f"--model-server-metrics-scheme must be http or https, got "
                              f"{self.scheme!r}")
        if not self.path.startswith("/"):
            raise ConfigError(f"--model-server-metrics-path must start with '/', got "
                              f"{self.path!r}")
        if self.port is not None and not 0 < self.port < 65536:
            raise ConfigError(f"--model-server-metrics-port must be 1..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--model-server-metrics-max-bytes must be >= 1024, got "
                              f"{self.max_body_bytes}")
        if self.max_concurrency < 1:
            raise ConfigError(f"max scrape concurrency must be >= 1, got {self.max_concurrency}")
        if self.commit_interval_s < 0:
            raise ConfigError(f"commit interval must be >= 0, got {self.commit_interval_s}")
        if self.max_loop_lag_s is not None and not self.max_loop_lag_s > 0:
            raise ConfigError(f"max loop lag must be > 0, got {self.max_loop_lag_s}")
        return self

    @property
    def resolution_s(self) -> float:
        if self.freshness_resolution_s is not None:
            return self.freshness_resolution_s
        return min(2 * self.interval_s, self.staleness_threshold_s / 4)

    @property
    def ceiling_s(self) -> float:
        """The longest effective interval load shedding may stretch to."""
        if self.max_interval_s is not None:
            return max(self.interval_s, self.max_interval_s)
        return max(self.interval_s, self.staleness_threshold_s / 4)

    @property
    def sweep_period_s(self) -> float:
        return max(self.interval_s, min(self.staleness_threshold_s / 8, 0.25))


# How a poll failed (_ScrapeFailure.kind). Only _CONNECTION and _TIMEOUT say anything
# about reachability; every other kind means the pod's server answered.
_CONNECTION = "connection"  # refused, reset, or closed before a response
_TIMEOUT = "timeout"  # no response headers within the poll timeout
_BAD_RESPONSE = "response"  # an answer, but not a usable one (status, size, body)
_MALFORMED = "malformed"  # the body's wanted lines do not parse, or exceed the limits
_INTERNAL = "internal"  # a bug in the scraper
_NO_SIGNAL = "no-signal"  # a parsed body without one load signal (the extraction failed)

# The source and extractor types llm-d's data-layer error counters name for the scrape.
SOURCE_TYPE = "metrics-data-source"
EXTRACTOR_TYPE = "core-metrics-extractor"


_utf8_decoder = codecs.getincrementaldecoder("utf-8")


class _ScrapeFailure(Exception):
    """A poll failed in an expected way; the message is what gets logged.

    ``kind`` classifies it (the constants above); ``key`` identifies the error for
    logging: a problem is logged when its key differs from the previous one, so a body
    whose garbage changes every poll is logged once, not once per poll.
    """

    def __init__(self, message: str, kind: str, key: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.key = key or kind


class _LineCache(dict[str, promparse.Sample]):
    """SampleIndex's shared line cache, bounded in text as well as in entries.

    ``SampleIndex`` clears a cache once it holds ``line_cache_max`` entries; with lines up
    to :data:`_MAX_SAMPLE_LINE` long (and a parsed label set costing ~15 bytes per
    character of dense labels) that alone would let one pod's garbage pin hundreds of MB.
    Here lines longer than :data:`_MAX_CACHED_LINE` are not cached, and the cache is
    cleared when the cached text would exceed ``max_chars``.
    """

    __slots__ = ("chars", "max_chars")

    def __init__(self, max_chars: int) -> None:
        super().__init__()
        self.chars = 0
        self.max_chars = max_chars

    def __setitem__(self, line: str, sample: promparse.Sample) -> None:
        n = len(line)
        if n > _MAX_CACHED_LINE:
            return
        if self.chars + n > self.max_chars:
            self.clear()
        self.chars += n
        super().__setitem__(line, sample)

    def clear(self) -> None:
        super().clear()
        self.chars = 0


class _BoundedIndex(promparse.SampleIndex):
    """A :class:`promparse.SampleIndex` that refuses bodies too costly to read.

    Parsing is synchronous work on the event loop that answers Envoy, ~0.14 s per MiB of
    dense sample lines: a body of a few MB of lines named like a wanted metric (or one
    line of a million labels) would stall every request for a second per poll. So before
    any line is tokenized the lines of the name looked up are counted and measured
    (one ``str.find`` when they are short, one per line otherwise): more than :data:`_MAX_SAMPLES_PER_NAME` of one name,
    a line longer than :data:`_MAX_SAMPLE_LINE`, or more than :data:`_MAX_SAMPLE_TEXT`
    characters of wanted lines in one body raise :class:`promparse.ParseError` (a failed
    scrape). Real model servers stay orders of magnitude below (vLLM: ~1 KB of wanted
    lines, a few lines per name). Finding the lines is still linear in their number
    (~55 ms for 4 MiB of one-sample lines); the failure backoff bounds how often.

    Cost on a real body: ~4 µs per scrape (vLLM's 42 KB fixture: 22 → 26 µs). It hooks
    promparse's internal ``_starts`` (and reads ``_text``): these limits belong in
    :class:`promparse.SampleIndex` itself, where they would cost next to nothing.
    """

    __slots__ = ("_budget",)

    def __init__(self, text: str, line_cache: dict[str, promparse.Sample]) -> None:
        super().__init__(text, line_cache)
        self._budget = _MAX_SAMPLE_TEXT

    def _starts(self, name: str) -> list[int]:
        starts = super()._starts(name)
        if not starts:
            return starts
        text = self._text
        if len(starts) > _MAX_SAMPLES_PER_NAME:
            raise promparse.ParseError(
                f"{len(starts)} samples of {name} (the scraper reads at most "
                f"{_MAX_SAMPLES_PER_NAME})", text.count("\n", 0, starts[0]) + 1)
        # Fast path: the lines found lie between the first start and the end of the
        # last line; when that span is short, so is every line, and it bounds their sum.
        last = starts[-1]
        end = text.find("\n", last, last + _MAX_SAMPLE_LINE + 1)
        if end == -1:
            end = min(len(text), last + _MAX_SAMPLE_LINE + 1)
        used = end - starts[0]
        if used > _MAX_SAMPLE_LINE:
            used = 0
            for s in starts:
                e = text.find("\n", s, s + _MAX_SAMPLE_LINE + 1)
                n = (min(len(text), s + _MAX_SAMPLE_LINE + 1) if e == -1 else e) - s
                if n > _MAX_SAMPLE_LINE:
                    raise promparse.ParseError(
                        f"a sample line of {name} is longer than {_MAX_SAMPLE_LINE} "
                        "characters", text.count("\n", 0, s) + 1)
                used += n
        self._budget -= used
        if self._budget < 0:
            raise promparse.ParseError(
                f"the sample lines read exceed {_MAX_SAMPLE_TEXT} characters (at {name})",
                text.count("\n", 0, starts[0]) + 1)
        return starts


@dataclass(eq=False)
class _EndpointState:
    key: str
    url: URL
    added_at: float
    metrics: Metrics = NO_METRICS  # the last Metrics this scraper staged (mirrors the store)
    values: tuple[object, ...] | None = None
    last_success: float | None = None
    problem: str | None = None
    problem_key: str | None = None
    failures: int = 0
    timeouts: int = 0  # consecutive polls that got no response headers in time
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class _LagGovernor:
    """Stretches the scrape interval while the event loop runs late (see module doc).

    Every ``period`` it sleeps ``period`` and records how late it woke; every ``window``
    seconds it compares the 90th percentile of those delays with ``target`` (a high
    percentile, not the max, so one GC pause or a noisy neighbour does not halve the
    scrape rate; not the mean, which stays low while bursts already hurt the tail): above
    it, the interval grows ×1.5 (at most ``ceiling``); under 3/4 of it, the interval
    shrinks ×0.9 (at least ``base``). Multiplicative both ways: it backs off fast and
    returns slowly, so it settles where the loop's p90 lag sits just under the target.
    """

    def __init__(self, base: float, ceiling: float, target: float, period: float,
                 window: float = 0.5) -> None:
        self.base = base
        self.ceiling = ceiling
        self.target = target
        self.period = period
        self.window = window
        self.interval = base
        self.last_lag = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        window_start = loop.time()
        lags: list[float] = []
        while True:
            t0 = loop.time()
            await asyncio.sleep(self.period)
            now = loop.time()
            lags.append(max(0.0, now - t0 - self.period))
            if now - window_start >= self.window:
                lags.sort()
                self.adjust(lags[int(0.9 * (len(lags) - 1))])
                window_start, lags = now, []

    def adjust(self, lag: float) -> None:
        self.last_lag = lag
        old = self.interval
        if lag > self.target:
            self.interval = min(self.ceiling, self.interval * 1.5)
        elif lag < self.target * 0.75 and self.interval > self.base:
            self.interval = max(self.base, self.interval * 0.9)
        if self.interval != old and (self.interval == self.ceiling or self.interval == self.base):
            log.info("metrics scrape interval now %.0f ms (p90 loop lag %.1f ms, target "
                     "%.1f ms)", self.interval * 1e3, lag * 1e3, self.target * 1e3)


class MetricsScraper:
    """Keeps every endpoint's :class:`Metrics` in ``store`` fresh. See the module doc."""

    def __init__(self, store: Datastore, options: ScrapeOptions | None = None,
                 engines: EngineMappings | None = None, *, seed: int | None = None,
                 metrics: EppMetrics | None = None) -> None:
        """``metrics``: where failed polls and extractions are counted (llm-d's
        ``llm_d_epp_datalayer_{poll,extract}_errors_total``); None: not counted."""
        self._metrics = metrics
        self.options = (options or ScrapeOptions()).validate()
        self._store = store
        self._engines = engines or EngineMappings()
        self._rng = random.Random(seed)
        self._states: dict[str, _EndpointState] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: dict[str, Metrics] = {}
        # Parsed sample lines by text, shared by all endpoints (see SampleIndex).
        self._line_cache = _LineCache(_LINE_CACHE_CHARS)
        self._commit_handle: asyncio.TimerHandle | None = None
        self._session: aiohttp.ClientSession | None = None
        self._sem = asyncio.Semaphore(self.options.max_concurrency)
        self._unsubscribe: list[Unsubscribe] = []
        self._ssl: ssl.SSLContext | bool | None = None
        o = self.options
        self._governor = (_LagGovernor(o.interval_s, o.ceiling_s, o.max_loop_lag_s,
                                       o.lag_probe_period_s)
                          if o.max_loop_lag_s is not None else None)
        self._started = False
        self._stopped = False
        # Counters for the exported metrics and the benchmarks.
        self.scrapes_ok = 0
        self.scrapes_failed = 0
        self.commits = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start polling every endpoint now in the store and follow additions/removals.

        Must be called from inside the running event loop; call once.
        """
        if self._started:
            raise RuntimeError("MetricsScraper.start() called twice")
        self._started = True
        o = self.options
        if o.scheme == "https":
            self._ssl = False if o.insecure_skip_verify else ssl.create_default_context()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, ssl=self._ssl or False,
                                           keepalive_timeout=30.0),
            headers={"Accept": _ACCEPT, "Accept-Encoding": "identity"},
            timeout=aiohttp.ClientTimeout(total=o.timeout_s),
            auto_decompress=True,
            skip_auto_headers=("User-Agent",),
        )
        self._unsubscribe = [self._store.on_added(self._add), self._store.on_removed(self._remove)]
        for ep in self._store.snapshot():
            self._add(ep)
        self._spawn(self._sweep(), "metrics-staleness-sweeper")
        if self._governor is not None:
            self._spawn(self._governor.run(), "metrics-lag-governor")

    async def stop(self) -> None:
        """Cancel and await every task, apply staged writes, close the HTTP session.

        Idempotent; safe if :meth:`start` was never called.
        """
        if self._stopped:
            return
        self._stopped = True
        for unsub in self._unsubscribe:
            unsub()
        self._unsubscribe = []
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._states.clear()
        self._commit()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ introspection

    @property
    def effective_interval(self) -> float:
        """The interval polls use now: the configured one, stretched under loop pressure."""
        return self._governor.interval if self._governor is not None else self.options.interval_s

    @property
    def loop_lag(self) -> float:
        """The p90 timer lateness in the governor's last window (0 without a governor)."""
        return self._governor.last_lag if self._governor is not None else 0.0

    def scraping(self) -> list[str]:
        """Keys of the endpoints that have a polling task."""
        return sorted(self._states)

    def last_success(self, key: str) -> float | None:
        """``time.monotonic()`` of ``key``'s last successful scrape (exact), or None."""
        st = self._states.get(key)
        return None if st is None else st.last_success

    def last_error(self, key: str) -> str | None:
        """The current problem with ``key``'s scrapes (None when the last one was clean)."""
        st = self._states.get(key)
        return None if st is None else st.problem

    def stale_count(self) -> int:
        return sum(1 for st in self._states.values() if st.metrics.stale)

    def unreachable_count(self) -> int:
        """Endpoints now marked unreachable (see the module doc)."""
        return sum(1 for st in self._states.values() if st.metrics.unreachable)

    # ------------------------------------------------------------------ endpoint set

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _url(self, ep: Endpoint) -> URL:
        o = self.options
        host = f"[{ep.address}]" if ":" in ep.address else ep.address
        return URL(f"{o.scheme}://{host}:{o.port or ep.port}{o.path}", encoded=True)

    def _add(self, ep: Endpoint) -> None:
        if self._stopped or ep.key in self._states:
            return
        st = _EndpointState(ep.key, self._url(ep), time.monotonic(), metrics=ep.metrics)
        self._states[ep.key] = st
        st.task = self._spawn(self._run(st), f"metrics-scrape {ep.key}")

    def _remove(self, ep: Endpoint) -> None:
        st = self._states.pop(ep.key, None)
        self._pending.pop(ep.key, None)
        if st is not None and st.task is not None:
            st.task.cancel()

    # ------------------------------------------------------------------ polling

    async def _run(self, st: _EndpointState) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self._rng.random() * self.effective_interval
        while True:
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            ep = self._store.get(st.key)
            if ep is None or self._states.get(st.key) is not st:
                return
            try:
                await self._poll(st, self._engines.for_endpoint(ep))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug here must not end polling of this endpoint
                log.debug("metrics scrape of %s: unexpected error", st.key, exc_info=True)
                self._failed(st, _ScrapeFailure(f"internal error: {type(e).__name__}: {e}",
                                                _INTERNAL, f"internal {type(e).__name__}"))
            # ±10 % jitter per poll, and a random re-phase after falling behind: without
            # them, endpoints delayed by one slow loop iteration would fire together from
            # then on, and the bursts would keep the loop late.
            iv = self.effective_interval
            if st.failures:
                # Back off from a failing endpoint (doubling, up to the ceiling and at most
                # MAX_FAILURE_BACKOFF_S) so dead or hanging pods do not hold concurrency
                # slots meant for healthy ones, while a restarted pod is still noticed
                # within a second.
                cap = min(self.options.ceiling_s, MAX_FAILURE_BACKOFF_S)
                iv = min(iv * 2 ** min(st.failures, 10), max(iv, cap))
            next_at += iv * (0.9 + 0.2 * self._rng.random())
            now = loop.time()
            if next_at < now:
                next_at = now + iv * self._rng.random()

    async def _fetch(self, st: _EndpointState) -> str:
        """GET the body as text, read and decoded incrementally, never beyond
        ``max_body_bytes``.

        Raises :class:`_ScrapeFailure`; its kind says whether a response was received.
        """
        assert self._session is not None
        o = self.options
        cap = o.max_body_bytes
        resp: aiohttp.ClientResponse | None = None
        try:
            # The session's ClientTimeout(total=timeout_s) bounds connect + headers + body,
            # so a pod that accepts and never answers, or trickles bytes, costs one
            # concurrency slot for at most timeout_s.
            async with self._session.get(st.url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise _ScrapeFailure(f"HTTP {resp.status} from {st.url}", _BAD_RESPONSE,
                                         f"HTTP {resp.status}")
                length = resp.content_length
                if length is not None and length > cap:
                    raise _ScrapeFailure(
                        f"body of {length} bytes (Content-Length) exceeds the {cap}-byte cap "
                        "(--model-server-metrics-max-bytes)", _BAD_RESPONSE, "too large")
                # Chunk by chunk (aiohttp's reader pauses the socket above ~128 KiB
                # unread), so memory is bounded by the cap even without a Content-Length:
                # a chunked body that never ends is cut off here, not at the timeout.
                # Decoded as it arrives, strictly, as Prometheus reads the format: binary
                # garbage fails at its first chunk, unread beyond it, and no copy of the
                # whole body is ever made for an error (replacing invalid bytes would also
                # cost ~90 ms of loop time per 4 MiB).
                decoder = _utf8_decoder()
                parts: list[str] = []
                n = 0
                async for chunk in resp.content.iter_any():
                    if n + len(chunk) > cap:
                        resp.close()  # drop the connection rather than drain the rest
                        raise _ScrapeFailure(
                            f"body exceeds the {cap}-byte cap (--model-server-metrics-max-bytes)"
                            "; read aborted", _BAD_RESPONSE, "too large")
                    try:
                        parts.append(decoder.decode(chunk))
                    except UnicodeDecodeError as e:
                        resp.close()
                        raise _ScrapeFailure(f"body from {st.url} is not UTF-8 text (invalid "
                                             f"byte at offset {n + e.start})", _BAD_RESPONSE,
                                             "not UTF-8") from None
                    n += len(chunk)
                try:
                    if rest := decoder.decode(b"", True):
                        parts.append(rest)
                except UnicodeDecodeError:
                    raise _ScrapeFailure(f"body from {st.url} ends inside a UTF-8 sequence",
                                         _BAD_RESPONSE, "not UTF-8") from None
                return parts[0] if len(parts) == 1 else "".join(parts)
        except TimeoutError:
            if resp is None:
                raise _ScrapeFailure(f"timed out after {o.timeout_s:g}s waiting for a response "
                                     f"({st.url})", _TIMEOUT) from None
            raise _ScrapeFailure(f"timed out after {o.timeout_s:g}s reading the body "
                                 f"({st.url})", _BAD_RESPONSE, "slow body") from None
        except aiohttp.ClientSSLError as e:  # a TLS setup problem, not a dead pod
            raise _ScrapeFailure(f"{type(e).__name__}: {e}", _BAD_RESPONSE,
                                 type(e).__name__) from None
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as e:
            # Before a response: refused, reset, or closed by the peer — a dead pod's
            # signature. After one (a body cut short): the pod answered; not reachability.
            raise _ScrapeFailure(f"{type(e).__name__}: {e}",
                                 _CONNECTION if resp is None else _BAD_RESPONSE,
                                 type(e).__name__) from None
        except aiohttp.ClientError as e:
            raise _ScrapeFailure(f"{type(e).__name__}: {e}", _BAD_RESPONSE,
                                 type(e).__name__) from None

    async def _poll(self, st: _EndpointState, mapping: EngineMapping) -> None:
        try:
            async with self._sem:
                text = await self._fetch(st)
            extracted = mapping.extract(_BoundedIndex(text, self._line_cache))
            if (extracted.missing and extracted.waiting is None
                    and extracted.running is None and extracted.kv_usage is None):
                # Not one load signal: not a model server's metrics (an HTML page,
                # garbage, the wrong port or engine). A failure, so that it backs off and
                # goes stale instead of looking idle.
                raise _ScrapeFailure(f"no load signal in the body from {st.url}: missing "
                                     f"{'; '.join(extracted.missing)}", _NO_SIGNAL,
                                     "no load signal")
        except _ScrapeFailure as e:
            self._failed(st, e)
            return
        except promparse.ParseError as e:
            self._failed(st, _ScrapeFailure(f"malformed metrics text from {st.url}: {e}",
                                            _MALFORMED))
            return
        self._succeeded(st, extracted, time.monotonic())

    def _succeeded(self, st: _EndpointState, ex: Extracted, now: float) -> None:
        self.scrapes_ok += 1
        if ex.missing and self._metrics is not None:
            # llm-d's core-metrics-extractor fails on a missing signal (its source counts it).
            self._metrics.record_datalayer_extract_error(SOURCE_TYPE, EXTRACTOR_TYPE)
        st.last_success = now
        st.failures = 0
        st.timeouts = 0
        prev = st.metrics
        values = (
            prev.waiting_queue_size if ex.waiting is None else ex.waiting,
            prev.running_requests if ex.running is None else ex.running,
            prev.kv_cache_usage if ex.kv_usage is None else ex.kv_usage,
            prev.active_loras if ex.active_loras is None else ex.active_loras,
            prev.waiting_loras if ex.waiting_loras is None else ex.waiting_loras,
            prev.max_loras if ex.max_loras is None else ex.max_loras,
            prev.block_size if ex.block_size is None else ex.block_size,
            prev.num_blocks if ex.num_blocks is None else ex.num_blocks,
        )
        incomplete = (f"metrics of {st.key} incomplete: missing {'; '.join(ex.missing)}"
                      if ex.missing else None)
        self._report(st, incomplete, incomplete)
        if prev.unreachable:
            log.info("endpoint %s is reachable again (scrape succeeded): scheduled again",
                     st.key)
        if (values != st.values or prev.stale or prev.unreachable or prev.updated_at is None
                or now - prev.updated_at >= self.options.resolution_s):
            st.values = values
            self._stage(st, Metrics(*values, updated_at=now, stale=False))

    def _failed(self, st: _EndpointState, failure: _ScrapeFailure) -> None:
        self.scrapes_failed += 1
        if self._metrics is not None:
            # llm-d: a poll that yields no payload is a poll error (its collector); one
            # whose payload the extractor cannot read, an extract error (HTTPDataSource).
            if failure.kind == _NO_SIGNAL:
                self._metrics.record_datalayer_extract_error(SOURCE_TYPE, EXTRACTOR_TYPE)
            else:
                self._metrics.record_datalayer_poll_error(SOURCE_TYPE)
        st.failures += 1
        self._report(st, f"metrics scrape of {st.key} failed: {failure}", failure.key)
        if failure.kind == _TIMEOUT:
            st.timeouts += 1
        else:
            st.timeouts = 0
        if failure.kind == _CONNECTION:
            self._set_unreachable(st, True, failure.key)
        elif failure.kind == _TIMEOUT:
            if st.timeouts >= UNREACHABLE_AFTER_TIMEOUTS:
                self._set_unreachable(st, True, f"no response to {st.timeouts} polls in a row")
        elif failure.kind != _INTERNAL:
            # The pod's server answered (an error status, a bad body): it is up.
            self._set_unreachable(st, False, failure.key)
        self._check_stale(st, time.monotonic())

    def report_unreachable(self, key: str) -> None:
        """The gateway could not connect to endpoint ``key`` (Envoy's connect-failure flag
        on a response it sent the EPP): mark it unreachable now, without waiting for a
        poll. The next poll that gets an HTTP answer clears the mark, so a wrong report
        costs at most one interval of exclusion. Unknown keys are ignored."""
        st = self._states.get(key)
        if st is not None:
            self._set_unreachable(st, True, "the gateway could not connect to it")

    def _set_unreachable(self, st: _EndpointState, unreachable: bool, why: str) -> None:
        if st.metrics.unreachable == unreachable:
            return
        if unreachable:
            log.warning("endpoint %s is unreachable (%s): not scheduled until its metrics "
                        "port answers again", st.key, why)
        else:
            log.info("endpoint %s is reachable again (%s): scheduled again", st.key, why)
        self._stage(st, replace(st.metrics, unreachable=unreachable))

    def _report(self, st: _EndpointState, problem: str | None, key: str | None) -> None:
        """Keep ``problem`` as the endpoint's current error; log it only when its ``key``
        differs from the previous one (once per change of error, not once per poll)."""
        st.problem = problem
        if key == st.problem_key:
            return
        st.problem_key = key
        if problem is None:
            log.info("metrics scrape of %s recovered", st.key)
        else:
            if len(problem) > _MAX_LOGGED_PROBLEM:
                problem = problem[:_MAX_LOGGED_PROBLEM] + "…"
            log.warning("%s (logged again only if the error changes)", problem)

    def _check_stale(self, st: _EndpointState, now: float) -> None:
        if st.metrics.stale:
            return
        ref = st.last_success if st.last_success is not None else st.added_at
        age = now - ref
        if age > self.options.staleness_threshold_s:
            log.warning("metrics of %s are stale: no successful scrape for %.1fs; keeping "
                        "its last values, marked stale", st.key, age)
            self._stage(st, replace(st.metrics, stale=True))

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.options.sweep_period_s)
            now = time.monotonic()
            for st in list(self._states.values()):
                self._check_stale(st, now)

    # ------------------------------------------------------------------ datastore writes

    def _with_attributes(self, key: str, m: Metrics) -> Metrics:
        """``m`` with the endpoint's current attributes: the scraper never sets them; other
        data sources (dcgm-data-source, epp/datalayer/polling.py) merge theirs into the
        store, and a scrape's fresh Metrics must not drop them."""
        ep = self._store.get(key)
        if ep is None or ep.metrics.attributes is m.attributes or not ep.metrics.attributes:
            return m
        return replace(m, attributes=ep.metrics.attributes)

    def _stage(self, st: _EndpointState, m: Metrics) -> None:
        st.metrics = m
        if self.options.commit_interval_s <= 0:
            self._store.update_metrics(st.key, self._with_attributes(st.key, m))
            self.commits += 1
            return
        self._pending[st.key] = m
        if self._commit_handle is None:
            self._commit_handle = asyncio.get_running_loop().call_later(
                self.options.commit_interval_s, self._commit)

    def _commit(self) -> None:
        if self._commit_handle is not None:
            self._commit_handle.cancel()
            self._commit_handle = None
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        self._store.update_metrics_many(
            {k: self._with_attributes(k, m) for k, m in pending.items()})
        self.commits += 1


class ScraperCollector(Collector):
    """The scraper's own Prometheus metrics, read when ``/metrics`` is scraped."""

    def __init__(self, scraper: MetricsScraper) -> None:
        self._s = scraper

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        s = self._s
        scrapes = CounterMetricFamily("epp_model_server_scrapes",
                                      "Scrapes of model-server /metrics, by result.",
                                      labels=["result"])
        scrapes.add_metric(["success"], s.scrapes_ok)
        scrapes.add_metric(["failure"], s.scrapes_failed)
        stale = GaugeMetricFamily("epp_model_server_metrics_stale_endpoints",
                                  "Endpoints whose metrics are stale (last successful scrape "
                                  "older than the staleness threshold).")
        stale.add_metric([], s.stale_count())
        interval = GaugeMetricFamily("epp_model_server_scrape_interval_seconds",
                                     "The scrape interval in force (stretched above the "
                                     "configured one while the event loop runs late).")
        interval.add_metric([], s.effective_interval)
        age = GaugeMetricFamily("epp_model_server_metrics_age_seconds",
                                "Seconds since each endpoint's last successful metrics scrape "
                                "(absent until the first one succeeds).",
                                labels=["model_server_pod"])
        pod_stale = GaugeMetricFamily("epp_model_server_metrics_stale",
                                      "1 while an endpoint's metrics are stale, else 0.",
                                      labels=["model_server_pod"])
        pod_unreachable = GaugeMetricFamily(
            "epp_model_server_unreachable",
            "1 while an endpoint is unreachable (its metrics port refused or dropped the "
            "connection, or did not answer several polls in a row): it is not scheduled "
            "unless every endpoint is unreachable; else 0.", labels=["model_server_pod"])
        now = time.monotonic()
        n_unreachable = 0
        for ep in s._store.snapshot():
            a = ep.metrics.age(now)
            if a is not None:
                age.add_metric([ep.name], a)
            pod_stale.add_metric([ep.name], 1.0 if ep.metrics.stale else 0.0)
            pod_unreachable.add_metric([ep.name], 1.0 if ep.metrics.unreachable else 0.0)
            n_unreachable += ep.metrics.unreachable
        unreachable = GaugeMetricFamily("epp_model_server_unreachable_endpoints",
                                        "Endpoints marked unreachable by the metrics scraper "
                                        "(left out of scheduling unless all are).")
        unreachable.add_metric([], n_unreachable)
        return [scrapes, stale, interval, age, pod_stale, unreachable, pod_unreachable]
