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
import contextlib
import math
import shlex
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
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
from epp.stack.procs import (
    LOCAL_SERVE_FLAGS,
    ManagedProcess,
    cancel_on_signals,
    free_port,
    wait_port,
)
from epp.stack.runner import Report, Result, run
from epp.stack.workload import Workload, WorkloadSpec

MODEL = "sim-model"
#: Where the summary is explained (printed at its end).
READING_DOC = 'docs/local-stack.md, "Reading the demo\'s summary"'
#: The simulator's KV block size unless ``--sim-args`` sets ``--block-size``.
SIM_BLOCK_SIZE = 16
#: Two measurements closer than this (relative) are reported as even.
EVEN_WITHIN = 0.03


def _progress(report: Report) -> None:
    ok = len(report.ok)
    err = len(report.results) - ok
    print(f"  [{report.label}] {report.elapsed_s:5.1f}s  {len(report.results):5d} requests  "
          f"{ok / report.elapsed_s if report.elapsed_s else 0:6.1f} ok/s  {err} errors",
          flush=True)


def _fmt_ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{1000 * x:.0f} ms"


def computed_tokens(r: Result) -> int:
    """Prompt tokens the pod had to compute (prefill) for ``r``: not served from its
    prefix cache."""
    return max(0, r.prompt_tokens - r.cached_tokens)


@dataclass(frozen=True, slots=True)
class Placement:
    """How well a gateway placed requests on the pods that had their prefix cached."""

    prompt_per_request: float
    """Mean prompt tokens per successful request."""
    computed_per_request: float
    """Mean prompt tokens the pods computed (not cached) per successful request."""
    prefix_found: float
    """Share of successful requests that found their reusable prefix cached on the pod
    they went to: they computed at most ``fresh_tokens`` (what their turn added) plus two
    KV blocks (the partial block at each end)."""
    busiest_share: float
    """Share of the successful requests taken by the busiest pod."""


def placement(rep: Report, fresh_tokens: int, block_size: int) -> Placement:
    """:class:`Placement` of ``rep``'s successful requests (NaN fields when there are none)."""
    ok = rep.ok
    if not ok:
        nan = float("nan")
        return Placement(nan, nan, nan, nan)
    bound = fresh_tokens + 2 * block_size
    share = rep.share()
    return Placement(
        prompt_per_request=statistics.fmean(r.prompt_tokens for r in ok),
        computed_per_request=statistics.fmean(computed_tokens(r) for r in ok),
        prefix_found=sum(computed_tokens(r) <= bound for r in ok) / len(ok),
        busiest_share=max(share.values()) / len(ok),
    )


def _compare(a: float, b: float, *, lower_is_better: bool) -> int:
    """+1 if ``a`` is better than ``b``, -1 if worse, 0 if within :data:`EVEN_WITHIN`
    (or not measured)."""
    if math.isnan(a) or math.isnan(b) or max(abs(a), abs(b)) == 0:
        return 0
    if abs(a - b) / max(abs(a), abs(b)) < EVEN_WITHIN:
        return 0
    better = a < b if lower_is_better else a > b
    return 1 if better else -1


def _vs(a: str, b: str) -> str:
    """``"12 vs 31 ms"`` from ``"12 ms"`` and ``"31 ms"`` (the unit once when shared)."""
    unit_a, unit_b = a.rpartition(" ")[2], b.rpartition(" ")[2]
    if " " in a and unit_a == unit_b:
        return f"{a.rpartition(' ')[0]} vs {b}"
    return f"{a} vs {b}"


def mean_ttft(rep: Report) -> float:
    """Mean TTFT of ``rep``'s successful requests, measured at the client."""
    return statistics.fmean(r.ttft_s for r in rep.ok) if rep.ok else float("nan")


def verdict(epp: Report, rr: Report, *, fresh_tokens: int, block_size: int,
            servers: int, in_pods: Mapping[str, float] | None = None) -> str:
    """The summary's last line: who won on TTFT p50/p90, hit rate and throughput, and
    why — all from the two runs' measurements (``in_pods``: as for :func:`summary`)."""
    rows: list[tuple[str, float, float, bool, Callable[[float], str]]] = [
        ("TTFT p50", epp.quantile("ttft_s", 0.5), rr.quantile("ttft_s", 0.5), True, _fmt_ms),
        ("TTFT p90", epp.quantile("ttft_s", 0.9), rr.quantile("ttft_s", 0.9), True, _fmt_ms),
        ("hit rate", 100 * epp.cache_hit_rate, 100 * rr.cache_hit_rate, False,
         lambda x: f"{x:.0f}%"),
        ("throughput", epp.throughput, rr.throughput, False, lambda x: f"{x:.1f} req/s"),
    ]
    groups: dict[int, list[str]] = {1: [], -1: [], 0: []}
    for name, a, b, lower, fmt in rows:
        won = _compare(a, b, lower_is_better=lower)
        if won == 0:
            groups[0].append(f"{name} (EPP {fmt(a)}, round robin {fmt(b)})")
            continue
        first, second = (a, b) if won > 0 else (b, a)
        groups[won].append(f"{name} ({_vs(fmt(first), fmt(second))})")
    parts = []
    if groups[1]:
        parts.append("the EPP won on " + ", ".join(groups[1]))
    if groups[-1]:
        parts.append("round robin won on " + ", ".join(groups[-1]))
    if groups[0]:
        parts.append("even on " + ", ".join(groups[0]))
    pe = placement(epp, fresh_tokens, block_size)
    pr = placement(rr, fresh_tokens, block_size)
    if math.isnan(pe.computed_per_request) or math.isnan(pr.computed_per_request):
        return "Verdict: " + "; ".join(parts) + "."
    saved = 1 - pe.computed_per_request / pr.computed_per_request \
        if pr.computed_per_request else 0.0
    more_or_fewer = "fewer" if saved >= 0 else "more"
    why = (f"the EPP sent {100 * pe.prefix_found:.0f}% of requests to a pod holding their "
           f"prefix (round robin {100 * pr.prefix_found:.0f}%): its pods computed "
           f"{100 * abs(saved):.0f}% {more_or_fewer} prompt tokens per request "
           f"({pe.computed_per_request:.0f} vs {pr.computed_per_request:.0f} of "
           f"{pe.prompt_per_request:.0f})")
    even = 1 / servers
    if pe.busiest_share > 1.3 * even:
        why += (f", and its busiest pod took {100 * pe.busiest_share:.0f}% of requests "
                f"(even: {100 * even:.0f}%)")
    if in_pods is not None:
        pod_e, pod_r = in_pods.get(epp.label, math.nan), in_pods.get(rr.label, math.nan)
        out_e, out_r = mean_ttft(epp) - pod_e, mean_ttft(rr) - pod_r
        if not any(math.isnan(x) for x in (pod_e, pod_r, out_e, out_r)):
            why += (f"; of the mean TTFT, the pods took {_fmt_ms(pod_e)} with the EPP and "
                    f"{_fmt_ms(pod_r)} with round robin, the way to and from them (gateway, "
                    f"HTTP, client) {_fmt_ms(out_e)} and {_fmt_ms(out_r)}")
    return "Verdict: " + "; ".join(parts) + ". Why: " + why + "."


def summary(reports: list[Report], pods: dict[str, list[str]], *,
            fresh_tokens: int | None = None, block_size: int = SIM_BLOCK_SIZE,
            in_pods: Mapping[str, float] | None = None) -> str:
    """The end-of-demo summary: request share per pod, TTFT, cache hits, prompt tokens
    computed, errors; with ``fresh_tokens`` (the workload's
    :attr:`~epp.stack.workload.WorkloadSpec.fresh_tokens_per_turn`) and an EPP and a
    round-robin report, it ends with the :func:`verdict` and where to read about it.
    ``in_pods`` (label → mean TTFT inside the pods, :func:`pod_ttft`) adds the rows that
    split the mean TTFT into time in the pods and time on the way."""
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

    def per_request(r: Report, fn: Callable[[Result], int]) -> str:
        return f"{statistics.fmean(fn(x) for x in r.ok):.0f}" if r.ok else "-"

    rows: list[tuple[str, Callable[[Report], str]]] = [
        ("requests OK", lambda r: f"{len(r.ok)}"),
        ("throughput", lambda r: f"{r.throughput:.1f} req/s"),
        ("TTFT p50", lambda r: _fmt_ms(r.quantile("ttft_s", 0.5))),
        ("TTFT p90", lambda r: _fmt_ms(r.quantile("ttft_s", 0.9))),
        ("latency p50", lambda r: _fmt_ms(r.quantile("latency_s", 0.5))),
        *([("TTFT mean", lambda r: _fmt_ms(mean_ttft(r))),
           ("  in the pods", lambda r: _fmt_ms(in_pods.get(r.label, math.nan))),
           ("  outside (gateway, HTTP)", lambda r: _fmt_ms(
               mean_ttft(r) - in_pods.get(r.label, math.nan)))]
          if in_pods is not None else []),
        ("prefix-cache hit rate", lambda r: f"{100 * r.cache_hit_rate:.1f}%"),
        ("prompt tokens / request", lambda r: per_request(r, lambda x: x.prompt_tokens)),
        ("computed / request", lambda r: per_request(r, computed_tokens)),
        ("errors", lambda r: f"{len(r.results) - len(r.ok)}"),
    ]
    for name, fn in rows:
        lines.append(f"{name:26}" + "".join(f"{fn(r):>18}" for r in reports))
    by_label = {r.label: r for r in reports}
    if fresh_tokens is not None and "EPP" in by_label and "round-robin" in by_label:
        lines.append("")
        lines.append(verdict(by_label["EPP"], by_label["round-robin"],
                             fresh_tokens=fresh_tokens, block_size=block_size,
                             servers=max(1, len(pods.get("EPP", ()))), in_pods=in_pods))
    if fresh_tokens is not None:
        lines.append(f"How to read these numbers: {READING_DOC}.")
    return "\n".join(lines)


async def pod_ttft(ports: Sequence[int]) -> float:
    """Mean time to first token inside the pods, from arrival at the engine (their
    ``vllm:time_to_first_token_seconds`` histograms, summed over ``ports``); NaN if none
    answers. The client's TTFT minus this is the request's path outside the pods: the
    gateway (Envoy, and the EPP's ext_proc round trip), HTTP and the client itself."""
    total = count = 0.0
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for port in ports:
            try:
                async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
                    text = await r.text()
            except (TimeoutError, aiohttp.ClientError):
                continue
            for line in text.splitlines():
                name, _, value = line.partition(" ")
                if name.startswith("vllm:time_to_first_token_seconds_sum"):
                    total += float(value.split()[0])
                elif name.startswith("vllm:time_to_first_token_seconds_count"):
                    count += float(value.split()[0])
    return total / count if count else float("nan")


def sim_block_size(sim_args: Sequence[str]) -> int:
    """The KV block size the simulators run with: ``--block-size`` in ``sim_args`` (the
    last one wins, as in ``epp sim``), else :data:`SIM_BLOCK_SIZE`."""
    size = SIM_BLOCK_SIZE
    for i, a in enumerate(sim_args):
        value = a.partition("=")[2] if a.startswith("--block-size=") else (
            sim_args[i + 1] if a == "--block-size" and i + 1 < len(sim_args) else None)
        if value is not None:
            with contextlib.suppress(ValueError):
                size = int(value)
    return size


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
              f" tokens), {spec.turns_per_conversation}-turn conversations ({spec.question_tokens}"
              f"-token questions, {spec.max_tokens}-token answers; the last turn's prompt "
              f"~{spec.last_turn_words} tokens), {args.concurrency} concurrent users, up to "
              f"{args.duration:g}s or {args.requests} requests per gateway")
        reports = []
        pods = {}
        in_pods: dict[str, float] = {}
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
            in_pods[label] = await pod_ttft(ports)
        print(summary(reports, pods, fresh_tokens=spec.fresh_tokens_per_turn,
                      block_size=sim_block_size(sim_extra), in_pods=in_pods), flush=True)
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


STOPPED = "stopped; everything the demo started has been stopped"


def _say(text: str) -> None:
    """Print, ignoring a closed terminal (after SIGHUP the terminal may be gone)."""
    with contextlib.suppress(OSError, ValueError):
        print(text, flush=True)


async def _demo_until_signal(args: argparse.Namespace) -> int:
    """:func:`_demo`, stopped by SIGTERM or SIGHUP exactly as by Ctrl-C: the first signal
    cancels it, which stops every process it started (its exit stack and ``finally``
    blocks) before it returns ``128 + signal number``."""
    with cancel_on_signals((signal.SIGTERM, signal.SIGHUP)) as received:
        try:
            return await _demo(args)
        except asyncio.CancelledError:
            if not received:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            sig = received[0]
            _say(f"\n{sig.name}: {STOPPED}")
            return 128 + int(sig)


def run_demo(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_demo_until_signal(args))
    except KeyboardInterrupt:
        _say(f"\n{STOPPED}")
        return 130
