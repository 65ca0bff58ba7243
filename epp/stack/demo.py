"""``epp demo`` and ``epp demo --pd``: the local stack — real Envoy + simulated model
servers + the EPP — with a chat workload through it and a summary.

``epp demo``: two identical sets of simulated pods (cold caches each) are started: one
behind Envoy with the EPP (ext_proc), one behind Envoy doing plain round robin. The same
workload (shared system prompts, multi-turn chat, streamed; :mod:`epp.stack.workload`,
played by :mod:`epp.stack.runner`) runs through the EPP gateway, then through the
round-robin gateway, and a side-by-side summary is printed. Every process listens on
127.0.0.1 on a free port and is stopped on exit, on Ctrl-C and on error.

``epp demo --pd`` (:func:`pd_demo`): the P/D stack of :mod:`epp.stack.pd` (prefill and
decode pods in two racks, Grove labels), the same workload, and the P/D pairing summary.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
import tempfile
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import yaml

from epp.stack.envoy import (
    DEFAULT_RESPONSE_PATH,
    EnvoyProcess,
    render_envoy_config,
    without_ext_proc,
)
from epp.stack.pd import PD_SIM_ARGS, PairStats, PdLayout, PdStack, grove_layout, repo_config
from epp.stack.procs import LOCAL_SERVE_FLAGS, ManagedProcess, free_port, wait_port
from epp.stack.runner import Report, run
from epp.stack.workload import Workload, WorkloadSpec

MODEL = "sim-model"


def _progress(report: Report) -> None:
    ok = len(report.ok)
    err = len(report.results) - ok
    print(f"  [{report.label}] {report.elapsed_s:5.1f}s  {len(report.results):5d} requests  "
          f"{ok / report.elapsed_s if report.elapsed_s else 0:6.1f} ok/s  {err} errors",
          flush=True)


def _fmt_ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{1000 * x:.0f} ms"


def summary(reports: list[Report], pods: dict[str, list[str]]) -> str:
    """The end-of-demo summary: request share per pod, TTFT, cache hits, errors."""
    lines = []
    for rep in reports:
        ok = len(rep.ok)
        lines.append(f"\n{rep.label}: {len(rep.results)} requests in {rep.elapsed_s:.1f}s, "
                     f"{ok} OK, {len(rep.results) - ok} errors")
        share = rep.share()
        for i, name in enumerate(pods[rep.label]):
            c = share.get(name, 0)
            pct = 100 * c / ok if ok else 0.0
            lines.append(f"  pod {i} ({name:<10}) {c:5d}  {pct:5.1f}%  {'#' * round(pct / 2.5)}")
        for err, c in rep.errors().items():
            lines.append(f"  error {err}: {c}")
    lines.append("")
    head = f"{'':26}" + "".join(f"{r.label:>18}" for r in reports)
    lines.append(head)
    rows: list[tuple[str, Callable[[Report], str]]] = [
        ("requests OK", lambda r: f"{len(r.ok)}"),
        ("throughput", lambda r: f"{r.throughput:.1f} req/s"),
        ("TTFT p50", lambda r: _fmt_ms(r.quantile("ttft_s", 0.5))),
        ("TTFT p90", lambda r: _fmt_ms(r.quantile("ttft_s", 0.9))),
        ("latency p50", lambda r: _fmt_ms(r.quantile("latency_s", 0.5))),
        ("prefix-cache hit rate", lambda r: f"{100 * r.cache_hit_rate:.1f}%"),
        ("errors", lambda r: f"{len(r.results) - len(r.ok)}"),
    ]
    for name, fn in rows:
        lines.append(f"{name:26}" + "".join(f"{fn(r):>18}" for r in reports))
    return "\n".join(lines)


async def _start_sims(ports: list[int], extra: list[str], log: Path) -> ManagedProcess:
    argv = [sys.executable, "-m", "epp.cli", "sim", "--model", MODEL, *extra]
    for p in ports:
        argv += ["--port", str(p)]
    proc = ManagedProcess(argv, log_path=log)
    await proc.start()
    return proc


async def _demo(args: argparse.Namespace) -> int:
    if getattr(args, "pd", False):
        return await pd_demo(args)
    workdir = Path(tempfile.mkdtemp(prefix="epp-demo-"))
    sim_extra = shlex.split(args.sim_args or "")
    epp_ports = [free_port() for _ in range(args.servers)]
    rr_ports = [free_port() for _ in range(args.servers)]
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    gw_epp, gw_rr = free_port(), free_port()
    endpoints = workdir / "endpoints.yaml"
    endpoints.write_text(yaml.safe_dump({"endpoints": [
        {"address": "127.0.0.1", "port": p, "name": f"sim-{p}"} for p in epp_ports]}))
    epp_argv = [sys.executable, "-m", "epp.cli", "serve", *LOCAL_SERVE_FLAGS, "--drain-quiet-period", "0", "--bind-address", "127.0.0.1",
                "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
                "--metrics-port", str(metrics_port), "--endpoints-file", str(endpoints),
                "--log-level", "warning"]
    if args.config_file:
        epp_argv += ["--config-file", str(Path(args.config_file).resolve())]
    print(f"epp demo: logs in {workdir}")
    async with AsyncExitStack() as stack:
        sims = await _start_sims(epp_ports, sim_extra, workdir / "sim-epp.log")
        stack.push_async_callback(sims.stop)
        epp = ManagedProcess(epp_argv, log_path=workdir / "epp.log")
        await epp.start()
        stack.push_async_callback(epp.stop)
        envoy_epp, envoy_rr = EnvoyProcess(), EnvoyProcess()
        stack.push_async_callback(envoy_epp.stop)
        stack.push_async_callback(envoy_rr.stop)
        rr_sims = None
        if args.compare:
            rr_sims = await _start_sims(rr_ports, sim_extra, workdir / "sim-rr.log")
            stack.push_async_callback(rr_sims.stop)
        try:
            for p in epp_ports + (rr_ports if args.compare else []):
                await wait_port("127.0.0.1", p, timeout=20)
            await wait_port("127.0.0.1", grpc_port, timeout=20)
        except TimeoutError as e:
            print(f"a process did not start ({e}):\n--- epp ---\n{epp.log_tail()}\n--- sim ---\n"
                  f"{sims.log_tail()}", file=sys.stderr)
            return 1
        await envoy_epp.start(render_envoy_config(listen_port=gw_epp, epp_port=grpc_port,
                                                  admin_port=free_port(),
                                                  body_mode=args.body_mode,
                                                  response_path=args.response_path),
                               workdir / "envoy-epp")
        if args.compare:
            await envoy_rr.start(without_ext_proc(render_envoy_config(
                listen_port=gw_rr, epp_port=grpc_port, admin_port=free_port(),
                pool_endpoints=[f"127.0.0.1:{p}" for p in rr_ports])), workdir / "envoy-rr")
            await envoy_rr.wait_ready()
        await envoy_epp.wait_ready()
        url = f"http://127.0.0.1:{gw_epp}"
        print(f"gateway  {url}  (Envoy → EPP ext_proc {args.body_mode}, response "
              f"{args.response_path} → {args.servers} pods)")
        print(f"epp      metrics http://127.0.0.1:{metrics_port}/metrics")
        if args.compare:
            print(f"baseline http://127.0.0.1:{gw_rr}  (Envoy round robin over {args.servers} "
                  "other pods)")
        spec = WorkloadSpec(seed=args.seed)
        print(f"\nworkload: {spec.system_prompts} shared system prompts (~{spec.system_prompt_words}"
              f" words), {spec.turns_per_conversation}-turn conversations, {args.concurrency} "
              f"concurrent users, up to {args.duration:g}s or {args.requests} requests per gateway")
        reports = []
        pods = {}
        for label, gw_url, ports in (("EPP", url, epp_ports),
                                     ("round-robin", f"http://127.0.0.1:{gw_rr}", rr_ports)):
            if label == "round-robin" and not args.compare:
                continue
            print(f"\n{label}:", flush=True)
            rep = await run(gw_url, Workload(spec, MODEL), label=label,
                            concurrency=args.concurrency, max_requests=args.requests,
                            duration_s=args.duration, progress=_progress)
            reports.append(rep)
            pods[label] = [f"sim-{p}" for p in ports]
        print(summary(reports, pods), flush=True)
        if args.keep_running:
            print(f"\nThe stack keeps running. Try:\n  curl {url}/v1/chat/completions "
                  "-H 'content-type: application/json' -d '{\"model\":\"" + MODEL + "\","
                  "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'\nCtrl-C to stop.",
                  flush=True)
            await asyncio.Event().wait()
        ok = all(r.ok and len(r.ok) == len(r.results) for r in reports)
        return 0 if ok else 1
    return 1


# ---------------------------------------------------------------- `epp demo --pd`


def pd_summary(layout: PdLayout, stats: PairStats, decisions: Mapping[str, float]) -> str:
    """The P/D part of the demo's summary: decisions, pairing distance, prefill shares."""
    dist = ", ".join(f"{d} {stats.by_distance[d]}"
                     for d in ("node", "rack", "block", "zone", "other", "unknown")
                     if stats.by_distance[d])
    share = stats.same_rack_share
    lines = [
        "",
        "P/D pairing (per request: the decode pod first, then a prefill pod for it)",
        (f"  EPP decisions            disaggregated {decisions.get('disaggregated', 0):.0f}, "
         f"decode-only {decisions.get('decode-only', 0):.0f}"),
        f"  remote prefills          {stats.remote_prefills}  ({dist or 'none'})",
        f"  same-rack pairs          {'-' if math.isnan(share) else f'{100 * share:.1f}%'}",
        (f"  prefill failures         {stats.prefill_failures} (fallbacks to a local prefill: "
         f"{stats.fallbacks})"),
    ]
    total = sum(stats.by_prefiller.values())
    for p in layout.by_role("prefill"):
        c = stats.by_prefiller.get(p.key, 0)
        pct = 100 * c / total if total else 0.0
        lines.append(f"  prefill {p.name:<16} {p.rack:<7} {c:5d}  {pct:5.1f}%  "
                     f"{'#' * round(pct / 2.5)}")
    return "\n".join(lines)


async def pd_demo(args: argparse.Namespace) -> int:
    """``epp demo --pd``: two racks of 2 prefill + 2 decode simulated pods with Grove
    labels and node topology, the EPP with config/pd-grove.yaml, Envoy; a chat workload,
    then the summary with the share of same-rack pairs."""
    workdir = Path(tempfile.mkdtemp(prefix="epp-demo-pd-"))
    extra = tuple(shlex.split(args.sim_args or ""))
    layout = grove_layout(sim_args={r: (*a, *extra) for r, a in PD_SIM_ARGS.items()})
    config = Path(args.config_file).resolve() if args.config_file else repo_config(
        "pd-grove.yaml")
    if not config.is_file():
        print(f"epp demo --pd: config file {config} not found (give --config-file)",
              file=sys.stderr)
        return 1
    print(f"epp demo --pd: logs in {workdir}")
    stack = PdStack(workdir, layout, config_file=config, body_mode=args.body_mode,
                    response_path=getattr(args, "response_path", DEFAULT_RESPONSE_PATH))
    try:
        await stack.start()
    except RuntimeError as e:
        print(str(e), file=sys.stderr)
        return 1
    try:
        print(f"gateway  {stack.url}  (Envoy → EPP ext_proc {args.body_mode}, response "
              f"{stack.response_path} → decode pod → its prefill pod)")
        print(f"epp      metrics {stack.metrics_url}  config {config}")
        print(f"pods     endpoints file {stack.epp_file} (Grove labels, node topology)")
        for p in layout.pods:
            print(f"  {p.role:<8} {p.name:<16} {p.key:<16} {p.rack}  node {p.node}")
        spec = WorkloadSpec(seed=args.seed)
        print(f"\nworkload: {spec.system_prompts} shared system prompts "
              f"(~{spec.system_prompt_words} words), {spec.turns_per_conversation}-turn "
              f"conversations, {args.concurrency} concurrent users, up to "
              f"{args.duration:g}s or {args.requests} requests")
        label = "EPP P/D"
        print(f"\n{label}:", flush=True)
        rep = await run(stack.url, Workload(spec, MODEL), label=label,
                        concurrency=args.concurrency, max_requests=args.requests,
                        duration_s=args.duration, progress=_progress)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            stats = await stack.pair_stats(session)
            decisions = await stack.decisions(session)
        decode_names = [f"sim-{p.port}" for p in layout.by_role("decode")]
        print(summary([rep], {label: decode_names}), flush=True)
        print(pd_summary(layout, stats, decisions), flush=True)
        if args.keep_running:
            print(f"\nThe stack keeps running. Try:\n  curl {stack.url}/v1/chat/completions "
                  "-H 'content-type: application/json' -d '{\"model\":\"" + MODEL + "\","
                  "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'\nCtrl-C to stop.",
                  flush=True)
            await asyncio.Event().wait()
        return 0 if rep.ok and len(rep.ok) == len(rep.results) else 1
    finally:
        await stack.stop()


def run_demo(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_demo(args))
    except KeyboardInterrupt:
        print("\nstopped; everything the demo started has been stopped")
        return 130
