"""Event-loop lag while scraping many model servers' /metrics (docs/benchmarks.md).

A separate process (this module with ``serve``) serves N fake vLLM ``/metrics`` endpoints
on 127.0.0.1 with aiohttp; the body is tests/fixtures/metrics/vllm.txt with the running,
waiting and KV lines changing on every request. This process runs the real
:class:`~epp.datalayer.scraper.MetricsScraper` against them on one event loop, next to a
10 ms ticker whose lateness is the loop's lag (what a gRPC stream from Envoy would wait).

Phases, each on a fresh scraper, with a warm-up that is not measured:

- ``idle``: the ticker alone (the floor);
- ``raw``: scraping with load shedding off (``max_loop_lag_s=None``): what the
  configured interval costs;
- ``governed``: the default scraper (stretches its interval while the loop runs late).

Reported per phase: ticker lateness p50/p99/max, scrapes/s, the mean interval per
endpoint achieved, the scraper's effective interval, CPU% of this process (all threads),
and datastore commits/s.

    .venv/bin/python -m bench.loop_lag --endpoints 200 --interval 0.05 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from epp.datalayer.scraper import MetricsScraper, ScrapeOptions
from epp.datastore.store import Datastore
from epp.scheduling.types import Endpoint
from epp.stack.procs import ManagedProcess

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "metrics" / "vllm.txt"
_DYNAMIC = ("vllm:num_requests_running{", "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{")


# ---------------------------------------------------------------- the fake servers


def _body_parts(text: str) -> list[str]:
    """Split the fixture around the three lines whose values change per request."""
    parts: list[str] = []
    rest = text
    for prefix in _DYNAMIC:
        i = rest.index("\n" + prefix) + 1
        j = rest.index("} ", i) + 2
        k = rest.index("\n", j)
        parts.append(rest[:j])
        rest = rest[k:]
    parts.append(rest)
    return parts


async def _serve(count: int, body_file: Path) -> None:
    """Serve ``count`` endpoints on kernel-chosen ports; print ``PORTS p1,p2,…`` when up."""
    parts = [p.encode() for p in _body_parts(body_file.read_text())]
    counter = itertools.count()

    async def metrics(_: web.Request) -> web.Response:
        i = next(counter)
        running, waiting, kv = i % 37, i % 5, (i % 100) / 100
        body = b"".join((parts[0], b"%d.0" % running, parts[1], b"%d.0" % waiting, parts[2],
                         b"%r" % kv, parts[3]))
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ports = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        ports.append(sock.getsockname()[1])
        await web.SockSite(runner, sock).start()
    print("PORTS " + ",".join(map(str, ports)), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


async def _wait_ports(proc: ManagedProcess, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proc.log_tail(5).splitlines():
            if line.startswith("PORTS "):
                return [int(p) for p in line[6:].split(",")]
        if not proc.running:
            break
        await asyncio.sleep(0.1)
    raise RuntimeError("fake metrics server did not start:\n" + proc.log_tail())


# ---------------------------------------------------------------- measurement


@dataclass
class PhaseResult:
    name: str
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    scrapes_per_s: float
    interval_ms: float
    effective_interval_ms: float
    cpu_pct: float
    commits_per_s: float

    def row(self) -> str:
        return (f"| {self.name} | {self.lag_p50_ms:.2f} | {self.lag_p99_ms:.2f} | "
                f"{self.lag_max_ms:.1f} | {self.scrapes_per_s:.0f} | {self.interval_ms:.0f} | "
                f"{self.effective_interval_ms:.0f} | {self.cpu_pct:.0f} | "
                f"{self.commits_per_s:.0f} |")


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


async def _ticker(lags: list[float], stop: asyncio.Event, period: float = 0.01) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t0 = loop.time()
        await asyncio.sleep(period)
        lags.append(loop.time() - t0 - period)


async def _phase(name: str, store: Datastore, options: ScrapeOptions | None,
                 warmup: float, duration: float) -> PhaseResult:
    scraper = MetricsScraper(store, options, seed=1) if options is not None else None
    if scraper is not None:
        scraper.start()
    await asyncio.sleep(warmup)
    lags: list[float] = []
    stop = asyncio.Event()
    ok0 = scraper.scrapes_ok if scraper else 0
    c0 = scraper.commits if scraper else 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    ticker = asyncio.create_task(_ticker(lags, stop))
    await asyncio.sleep(duration)
    stop.set()
    await ticker
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    ok = (scraper.scrapes_ok - ok0) if scraper else 0
    commits = (scraper.commits - c0) if scraper else 0
    eff = scraper.effective_interval if scraper else 0.0
    if scraper is not None:
        await scraper.stop()
    n = len(store)
    rate = ok / wall
    return PhaseResult(name, _q(lags, 0.5) * 1e3, _q(lags, 0.99) * 1e3, max(lags) * 1e3,
                       rate, (n / rate * 1e3) if rate else 0.0, eff * 1e3,
                       100 * cpu / wall, commits / wall)


async def _run(args: argparse.Namespace) -> int:
    counts = [len(range(i, args.endpoints, args.server_procs))
              for i in range(args.server_procs)]
    procs = []
    ports: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i, count in enumerate(counts):
                proc = ManagedProcess([sys.executable, "-m", "bench.loop_lag", "serve",
                                       "--body", str(args.body), "--count", str(count)],
                                      log_path=Path(tmp) / f"server{i}.log", cwd=ROOT)
                await proc.start()
                procs.append(proc)
            for proc in procs:
                ports += await _wait_ports(proc)
            store = Datastore()
            store.set_endpoints(Endpoint(f"pod-{p}", "127.0.0.1", p) for p in ports)
            base = ScrapeOptions(interval_s=args.interval, timeout_s=1.0,
                                 max_concurrency=args.concurrency,
                                 max_loop_lag_s=args.max_loop_lag)
            results = [await _phase("idle (no scraping)", store, None, 0.5, args.duration)]
            results.append(await _phase("raw (no load shedding)", store,
                                        dataclasses.replace(base, max_loop_lag_s=None),
                                        args.warmup, args.duration))
            results.append(await _phase("governed (default)", store, base, args.warmup,
                                        args.duration))
        finally:
            for proc in procs:
                await proc.stop()
    size = args.body.stat().st_size
    print(f"{args.endpoints} endpoints × {args.interval * 1e3:g} ms interval (target "
          f"{args.endpoints / args.interval:.0f} scrapes/s), body {size / 1024:.1f} KiB, "
          f"{args.duration:g} s per phase, {os.cpu_count()} CPUs, "
          f"{args.server_procs} server process(es), concurrency {args.concurrency}, "
          f"governed max_loop_lag {args.max_loop_lag * 1e3:g} ms")
    print("| phase | lag p50 ms | lag p99 ms | lag max ms | scrapes/s | interval/endpoint ms "
          "| effective interval ms | CPU % | commits/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(r.row())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loop_lag", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd")
    serve = sub.add_parser("serve", help="(internal) serve fake /metrics endpoints")
    serve.add_argument("--count", type=int, required=True)
    serve.add_argument("--body", type=Path, default=FIXTURE)
    parser.add_argument("--endpoints", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--body", type=Path, default=FIXTURE)
    parser.add_argument("--server-procs", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=ScrapeOptions.max_concurrency,
                        help="scraper max_concurrency (default: the scraper's default)")
    parser.add_argument("--max-loop-lag", type=float, default=ScrapeOptions.max_loop_lag_s,
                        help="governed phase: max_loop_lag_s (default: the scraper's default)")
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        try:
            asyncio.run(_serve(args.count, args.body))
        except KeyboardInterrupt:
            pass
        return 0
    return asyncio.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
