"""Gateway throughput: Envoy alone vs Envoy + EPP (1, 2, … workers), one run, side by side.

Three loads (``--load``, default all): ``short`` (2 KB completion bodies, a JSON answer),
``long-prompt`` (200 KB bodies, a JSON answer) and ``sse`` (2 KB bodies, the answer
streamed as 100 SSE events ``--sse-gap-ms`` apart, then usage and ``[DONE]``). For the
JSON loads the upstream is a second Envoy answering every request itself
(direct_response), so it costs next to nothing; for ``sse`` it is ``bench/sse_upstream.py``
(aiohttp on uvloop, one write per event). "Envoy alone" is the same gateway bootstrap without the
ext_proc filter (wrk names the upstream in the routing header). The load generator is
wrk (Debian package `wrk`) with a Lua script POSTing an OpenAI completion body. For each
case: req/s, p50/p99 latency (wrk), the EPP's CPU per request (from /proc of the EPP and
its worker processes) and the ratio to Envoy alone.

    .venv/bin/python -m bench.throughput --duration 10 --workers 1 --workers 2
    .venv/bin/python -m bench.throughput --smoke        # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import orjson

from epp.stack.envoy import (
    DEFAULT_RESPONSE_PATH,
    RESPONSE_PATHS,
    EnvoyProcess,
    render_envoy_config,
    without_ext_proc,
)
from epp.stack.procs import LOCAL_SERVE_FLAGS, ManagedProcess, free_port, wait_port

UPSTREAM_YAML = """\
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: %(admin)d}}
static_resources:
  listeners:
  - name: upstream
    address: {socket_address: {address: 127.0.0.1, port_value: %(port)d}}
    per_connection_buffer_limit_bytes: 16777216
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: upstream
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                direct_response:
                  status: 200
                  body: {inline_string: '{"id":"x","object":"text_completion","model":"m","choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":500,"completion_tokens":1,"total_tokens":501}}'}
                response_headers_to_add:
                - header: {key: content-type, value: application/json}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
"""

MAX_BODY = 4 << 20  # Envoy's buffer limit and the EPP's body limit: the 200 KB load fits

LUA = """\
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
%(extra)s
wrk.body = io.open("%(body)s", "rb"):read("*a")
"""


@dataclass(frozen=True)
class Load:
    """One workload: request body size and the upstream's answer."""

    name: str
    body_bytes: int
    sse_events: int = 0  # 0: a JSON completion from Envoy's direct_response


LOADS = {
    "short": Load("short", 2048),
    "long-prompt": Load("long-prompt", 200_000),
    "sse": Load("sse", 2048, sse_events=100),
}


@dataclass
class Row:
    load: str
    case: str
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    epp_cpu_us: float | None
    core_cpu_us: float | None = None  # of it, the main (scheduling core) process, --workers > 1


def cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            out += _tree(int(child))
    except OSError:
        pass
    return out


def _ms(v: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)", v)
    if not m:
        return float("nan")
    x = float(m.group(1))
    return {"us": x / 1000, "ms": x, "s": x * 1000}[m.group(2)]


async def run_wrk(url: str, script: Path, conc: int, duration: float) -> tuple[float, float, float, int, int]:
    proc = await asyncio.create_subprocess_exec(
        "wrk", "-t", "2", "-c", str(conc), "-d", f"{max(1, round(duration))}s", "--latency", "-s", str(script),
        url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out = (await proc.communicate())[0].decode()
    if "Requests/sec" not in out:
        raise RuntimeError(f"wrk failed:\n{out}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.MULTILINE).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.MULTILINE).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    errs = 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        errs += int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        errs += sum(int(x) for x in m.groups())
    return rps, p50, p99, errs, total


async def main_async(args: argparse.Namespace) -> list[Row]:
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install wrk")
    work = Path(tempfile.mkdtemp(prefix="epp-tput-"))
    rows: list[Row] = []
    for name in args.load:
        rows += await _load_rows(args, LOADS[name], work / name)
    return rows


async def _load_rows(args: argparse.Namespace, load: Load, work: Path) -> list[Row]:
    """Envoy alone, then Envoy + EPP per worker count, per concurrency, for one load."""
    work.mkdir(parents=True)
    up_port = free_port()
    body = work / "body.json"
    body.write_bytes(orjson.dumps({"model": "m", "max_tokens": 1, "stream": load.sse_events > 0,
                                   "prompt": "x" * max(1, load.body_bytes - 60)}))
    direct_lua, epp_lua = work / "direct.lua", work / "epp.lua"
    direct_lua.write_text(LUA % {"body": body, "extra":
                                 f'wrk.headers["x-gateway-destination-endpoint"] = "127.0.0.1:{up_port}"'})
    epp_lua.write_text(LUA % {"body": body, "extra": ""})
    envoys: list[EnvoyProcess] = []
    sse: ManagedProcess | None = None
    rows: list[Row] = []
    try:
        if load.sse_events:
            sse = ManagedProcess([sys.executable, "-m", "bench.sse_upstream", "--port",
                                  str(up_port), "--events", str(load.sse_events),
                                  "--gap-ms", str(args.sse_gap_ms)],
                                 log_path=work / "sse-upstream.log")
            await sse.start()
            await wait_port("127.0.0.1", up_port, 30)
        else:
            upstream = EnvoyProcess()
            envoys.append(upstream)
            await upstream.start(UPSTREAM_YAML % {"port": up_port, "admin": free_port()},
                                 work / "upstream", concurrency=1)
            await upstream.wait_ready()
        direct = EnvoyProcess()
        envoys.append(direct)
        gw_direct = free_port()
        await direct.start(without_ext_proc(render_envoy_config(
            listen_port=gw_direct, epp_port=1, admin_port=free_port(),
            max_body_bytes=MAX_BODY)), work / "direct", concurrency=args.envoy_workers)
        await direct.wait_ready()
        url_direct = f"http://127.0.0.1:{gw_direct}/v1/completions"
        for conc in args.concurrency:
            await run_wrk(url_direct, direct_lua, conc, args.warmup)
            rps, p50, p99, errs, _ = await run_wrk(url_direct, direct_lua, conc, args.duration)
            rows.append(Row(load.name, "Envoy alone", conc, rps, p50, p99, errs, None))
            for path in args.response_path:
                for workers in args.workers:
                    rows.append(await _epp_case(args, load, work, up_port, epp_lua, conc,
                                                workers, path))
    finally:
        for e in envoys:
            await e.stop()
        if sse is not None:
            await sse.stop()
    return rows


async def _epp_case(args: argparse.Namespace, load: Load, work: Path, up_port: int, lua: Path,
                    conc: int, workers: int, path: str) -> Row:
    grpc_port = free_port()
    argv = [sys.executable, "-m", "epp.cli", "serve", *LOCAL_SERVE_FLAGS, "--drain-quiet-period", "0", "--bind-address", "127.0.0.1",
            "--grpc-port", str(grpc_port), "--grpc-health-port", str(free_port()),
            "--metrics-port", str(free_port()), "--log-level", "warning",
            "--endpoints", f"127.0.0.1:{up_port}", "--no-metrics-scraping",
            "--max-request-body-bytes", str(MAX_BODY)]
    if workers != 1:
        argv += ["--workers", str(workers)]
    epp = ManagedProcess(argv, log_path=work / f"epp-{workers}-{conc}.log")
    gw = EnvoyProcess()
    try:
        await epp.start()
        await wait_port("127.0.0.1", grpc_port, 30)
        port = free_port()
        await gw.start(render_envoy_config(listen_port=port, epp_port=grpc_port,
                                           admin_port=free_port(), body_mode=args.body_mode,
                                           max_body_bytes=MAX_BODY, response_path=path),
                       work / f"gw-{workers}-{conc}-{path}", concurrency=args.envoy_workers)
        await gw.wait_ready()
        url = f"http://127.0.0.1:{port}/v1/completions"
        await run_wrk(url, lua, conc, args.warmup)
        assert epp.pid is not None
        pids = _tree(epp.pid)
        c0 = cpu_seconds(pids)
        k0 = cpu_seconds([epp.pid])
        spy = None
        if args.pyspy:
            spy = await asyncio.create_subprocess_exec(
                "py-spy", "record", "-p", str(epp.pid), "-d", str(max(1, int(args.duration) - 1)),
                "-r", "250", "--format", "raw", "-o", f"{args.pyspy}-{workers}-{conc}.raw",
                "--nonblocking", stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL)
        rps, p50, p99, errs, total = await run_wrk(url, lua, conc, args.duration)
        cpu = cpu_seconds(pids) - c0
        core = cpu_seconds([epp.pid]) - k0
        if spy is not None:
            await spy.wait()
        label = f"Envoy + EPP ({workers} worker{'s' if workers != 1 else ''}, {path})"
        return Row(load.name, label, conc, rps, p50, p99, errs,
                   1e6 * cpu / total if total else None,
                   1e6 * core / total if total and workers > 1 else None)
    finally:
        await gw.stop()
        await epp.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, action="append")
    ap.add_argument("--workers", type=int, action="append")
    ap.add_argument("--load", action="append", choices=list(LOADS),
                    help="workloads (repeatable; default all): short = 2 KB body, JSON "
                    "answer; long-prompt = 200 KB body; sse = 2 KB body, answer streamed "
                    "as 100 SSE events")
    ap.add_argument("--response-path", action="append", choices=list(RESPONSE_PATHS),
                    help="the gateway shape (repeatable; default lean): lean = one ext_proc "
                    "filter, response headers only, never a response body chunk (the "
                    "shipped default); inline = GIE's shape, every response chunk through "
                    "the EPP and back; observer = routing filter + observability-mode filter")
    ap.add_argument("--sse-gap-ms", type=float, default=1.0,
                    help="gap between the sse load's events (default 1 ms)")
    ap.add_argument("--envoy-workers", type=int, default=2)
    ap.add_argument("--body-mode", default="FULL_DUPLEX_STREAMED",
                    choices=["FULL_DUPLEX_STREAMED", "BUFFERED"])
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny run for CI")
    ap.add_argument("--pyspy", metavar="PREFIX",
                    help="record a py-spy raw profile of the EPP per case to PREFIX-W-C.raw")
    args = ap.parse_args()
    args.concurrency = args.concurrency or [16, 64]
    args.workers = args.workers or [1]
    args.load = args.load or list(LOADS)
    args.response_path = args.response_path or [DEFAULT_RESPONSE_PATH]
    if args.smoke:
        args.duration, args.warmup, args.concurrency = 1.0, 0.5, [8]
    rows = asyncio.run(main_async(args))
    print(f"# Envoy {args.envoy_workers} workers, {args.body_mode}, {args.duration:g}s per case "
          f"after {args.warmup:g}s warm-up; sse events {args.sse_gap_ms:g} ms apart")
    print("| load | case | conc | req/s | p50 ms | p99 ms | errors | EPP CPU µs/req "
          "(core) | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    alone = {(r.load, r.concurrency): r.rps for r in rows if r.case == "Envoy alone"}
    for r in rows:
        cpu = "-" if r.epp_cpu_us is None else f"{r.epp_cpu_us:.0f}"
        if r.core_cpu_us is not None:
            cpu += f" ({r.core_cpu_us:.0f})"
        print(f"| {r.load} | {r.case} | {r.concurrency} | {r.rps:.0f} | {r.p50_ms:.2f} | "
              f"{r.p99_ms:.2f} | {r.errors} | {cpu} | "
              f"{r.rps / alone[(r.load, r.concurrency)]:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1))


if __name__ == "__main__":
    main()
