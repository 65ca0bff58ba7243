"""``epp bench --sweep N --seed S [--held-out]``: routers on many workload shapes.

Where ``epp bench`` plays four hand-made workloads, the sweep draws N shapes from a broad
family (:mod:`epp.bench.shapes`: prefix groups, prefix and question lengths, group
sizes, random or bursty arrivals, multi-turn chat with think time, 2–16 pods of equal or
different speeds, KV pool 0.2–5× the working set, load 30–90 % of capacity), plays each
through every router with fresh simulated pods (the stacks of :mod:`epp.bench.quality`),
replays each shape's trace offline for its ceiling (:mod:`epp.bench.ceiling`), and
reports per shape and in aggregate — hit rate against the ceiling, client-side TTFT
p50/p90 through the router, throughput, per-pod shares — and the issue's target checks
for every router that ran (so a candidate default given as ``epp=FILE`` is checked the
same way). ``--held-out`` adds the fixed held-out shapes (never to be tuned on),
reported as their own set. Output: ``results.json``, ``table.txt`` and ``sweep.png``
(when matplotlib is there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

from epp.bench.ceiling import ceiling
from epp.bench.quality import (
    BASE_SIM_ARGS,
    ROUTERS,
    RouterSpec,
    Stack,
    ensure_sglang,
    have_matplotlib,
    parse_routers,
    play,
    sim_config,
    summarize,
)
from epp.bench.shapes import (
    DEFAULT_MAX_PODS,
    HELD_OUT_SEEDS,
    POD_RANGE,
    Plan,
    Shape,
    plan,
    sweep_shapes,
)
from epp.bench.tokenizer import trace_words
from epp.bench.traces import SimCosts

ROUND_ROBIN: Final = "round-robin"
#: GIE's default scheduling profile, shipped with the project (``epp:gie-default``).
GIE_DEFAULT_CONFIG: Final = Path(__file__).resolve().parents[2] / "config" / "gie-default.yaml"
SMOKE_ROUTERS: Final = "epp,round-robin"

# The targets.
TARGET_HIT_VS_CEILING: Final = 0.95
TARGET_SHAPE_SHARE: Final = 0.90
RR_TOLERANCE: Final = 0.10

TRAINING: Final = "training"
HELD_OUT: Final = "held-out"


def default_routers() -> str:
    """The built-in default, GIE's default, round robin, random, sglang-router."""
    gie = f"epp={GIE_DEFAULT_CONFIG}" if GIE_DEFAULT_CONFIG.exists() else ""
    return ",".join(r for r in (ROUTERS[0], gie, *ROUTERS[1:]) if r)


# ----------------------------------------------------------------- checks (pure)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _ratio(a: float, b: float) -> float:
    return a / b if _finite(a) and _finite(b) and b > 0 else float("nan")


def shape_check(results: Mapping[str, Mapping[str, Any]], bound: float, router: str
                ) -> dict[str, Any] | None:
    """The issue's per-shape checks for ``router`` against the others on one shape
    (None when it did not run there).

    - ``hit_ok``: hit rate ≥ 95 % of the ceiling (true when the ceiling is 0: nothing to
      win);
    - ``ttft_ok``: TTFT p90 ≤ the best other router's;
    - ``worse_than_rr``: TTFT p90 more than 10 % above round robin's, or throughput more
      than 10 % below it.

    A router that answered nothing fails every check.
    """
    m = results.get(router)
    if m is None:
        return None
    alive = m.get("ok", 0) > 0
    hit_ratio = _ratio(m["hit_rate"], bound) if bound > 0 else float("nan")
    hit_ok = alive and (bound <= 0 or hit_ratio >= TARGET_HIT_VS_CEILING)
    others = [(lbl, r["ttft_p90_ms"]) for lbl, r in results.items()
              if lbl != router and r.get("ok", 0) > 0 and _finite(r["ttft_p90_ms"])]
    best_lbl, best = min(others, key=lambda x: x[1]) if others else ("", float("nan"))
    p90_vs_best = _ratio(m["ttft_p90_ms"], best)
    ttft_ok = alive and (not others or (_finite(p90_vs_best) and p90_vs_best <= 1.0))
    rr = results.get(ROUND_ROBIN) if router != ROUND_ROBIN else None
    p90_vs_rr = tput_vs_rr = float("nan")
    worse = not alive
    if rr is not None and rr.get("ok", 0) > 0:
        p90_vs_rr = _ratio(m["ttft_p90_ms"], rr["ttft_p90_ms"])
        tput_vs_rr = _ratio(m["throughput_rps"], rr["throughput_rps"])
        worse = worse or (p90_vs_rr > 1.0 + RR_TOLERANCE) or (tput_vs_rr < 1.0 - RR_TOLERANCE)
    return {"hit_vs_ceiling": hit_ratio, "hit_ok": hit_ok, "best_other": best_lbl,
            "ttft_p90_vs_best_other": p90_vs_best, "ttft_ok": ttft_ok,
            "ttft_p90_vs_rr": p90_vs_rr, "throughput_vs_rr": tput_vs_rr,
            "worse_than_rr": worse}


def check_summary(per_shape: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The targets over a set of shapes, from :func:`shape_check`'s results by shape."""
    n = len(per_shape)
    hit = [s for s, c in per_shape.items() if c["hit_ok"]]
    ttft = [s for s, c in per_shape.items() if c["ttft_ok"]]
    both = [s for s, c in per_shape.items() if c["hit_ok"] and c["ttft_ok"]]
    worse = [s for s, c in per_shape.items() if c["worse_than_rr"]]
    rr = {s: c for s, c in per_shape.items() if _finite(c["ttft_p90_vs_rr"])}
    worst = max(rr, key=lambda s: rr[s]["ttft_p90_vs_rr"], default=None)
    tput = {s: c for s, c in per_shape.items() if _finite(c["throughput_vs_rr"])}
    lowest = min(tput, key=lambda s: tput[s]["throughput_vs_rr"], default=None)
    return {
        "shapes": n,
        "hit_ok": len(hit), "ttft_ok": len(ttft), "both_ok": len(both),
        "share_hit_ok": len(hit) / n if n else float("nan"),
        "share_ttft_ok": len(ttft) / n if n else float("nan"),
        "share_both_ok": len(both) / n if n else float("nan"),
        "worse_than_rr": worse,
        "worst_ttft_p90_vs_rr": rr[worst]["ttft_p90_vs_rr"] if worst else float("nan"),
        "worst_ttft_p90_vs_rr_shape": worst,
        "lowest_throughput_vs_rr": (tput[lowest]["throughput_vs_rr"] if lowest
                                    else float("nan")),
        "target_shapes_met": n > 0 and len(both) / n >= TARGET_SHAPE_SHARE,
        "target_rr_met": n > 0 and not worse,
    }


def aggregate(entries: Sequence[Mapping[str, Any]], router: str) -> dict[str, Any]:
    """Medians over shapes of ``router``'s ratios: hit rate / ceiling, TTFT p50 and p90 /
    the best router's on that shape (1 = best), throughput / offered rate; the mean
    busiest-pod share (÷ the even share: 1 = even) and summed errors."""
    hit: list[float] = []
    p50: list[float] = []
    p90: list[float] = []
    tput: list[float] = []
    busiest: list[float] = []
    errors = n = 0
    for e in entries:
        res = e["results"]
        m = res.get(router)
        if m is None:
            continue
        n += 1
        errors += m["errors"]
        bound = e["ceiling"]["bound"]["hit_rate"]
        if bound > 0:
            hit.append(m["hit_rate"] / bound)
        for q, out in (("ttft_p50_ms", p50), ("ttft_p90_ms", p90)):
            best = min((r[q] for r in res.values() if r.get("ok", 0) > 0 and _finite(r[q])),
                       default=float("nan"))
            if _finite(m[q]) and best > 0:
                out.append(m[q] / best)
        offered = e["plan"]["offered_rps"]
        if offered:
            tput.append(m["throughput_rps"] / offered)
        if m.get("share_max") is not None:
            busiest.append(m["share_max"] * e["shape"]["pods"])

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    return {"shapes": n, "hit_vs_ceiling": med(hit), "ttft_p50_vs_best": med(p50),
            "ttft_p90_vs_best": med(p90), "throughput_vs_offered": med(tput),
            "busiest_vs_even": statistics.fmean(busiest) if busiest else float("nan"),
            "errors": errors}


def evaluate(entries: Sequence[Mapping[str, Any]], routers: Sequence[str]
             ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(aggregate, checks) per set (training / held-out) and router."""
    agg: dict[str, dict[str, Any]] = {}
    checks: dict[str, dict[str, Any]] = {}
    for name in (TRAINING, HELD_OUT):
        part = [e for e in entries if e["set"] == name]
        if not part:
            continue
        agg[name] = {r: aggregate(part, r) for r in routers}
        checks[name] = {}
        for r in routers:
            per = {e["shape"]["name"]: c for e in part
                   if (c := e["checks"].get(r)) is not None}
            checks[name][r] = check_summary(per) | {"per_shape": per}
    return agg, checks


# ----------------------------------------------------------------- output


def _ms(x: float) -> str:
    return f"{x:.0f}" if _finite(x) else "-"


def _x(x: float) -> str:
    return f"{x:.2f}" if _finite(x) else "-"


def _shares(m: Mapping[str, Any], pod_cost: Sequence[float]) -> str:
    out = []
    for i, f in enumerate(pod_cost):
        v = m["share"].get(f"pod{i}", 0.0)
        out.append(f"{100 * v:.0f}" + ("" if f == 1.0 else f"({f:g}x)"))
    return "/".join(out)


def shape_table(e: Mapping[str, Any]) -> list[str]:
    sh, pl, c = e["shape"], e["plan"], e["ceiling"]
    bound = c["bound"]["hit_rate"]
    lines = [f"[{e['set']}] {sh['name']}: {e['description']}",
             (f"  {pl['requests']} requests over {pl['duration_s']:g}s = "
             f"{pl['offered_rps']:.1f} req/s, {pl['load']:.0%} of the {pl['capacity_rps']:.1f} "
             f"req/s cold-cache capacity (time scale {pl['time_scale']:.3g}); KV "
             f"{pl['num_gpu_blocks']} blocks/pod = {pl['cache_ratio']:.2f}x the working set "
             f"({pl['working_set_blocks']} blocks)"),
             "  ceiling: " + ", ".join(f"{k} {100 * v['hit_rate']:.1f}%" for k, v in c.items()
                                       if k != "bound") + f" -> bound {100 * bound:.1f}%",
             (f"  {'router':22}{'hit':>7}{'/ceil':>7}{'p50':>6}{'p90':>6}{'/best':>7}"
             f"{'req/s':>7}{'err':>5}  pod shares % (cost)")]
    for lbl, m in e["results"].items():
        ck = e["checks"].get(lbl) or {}
        lines.append(f"  {lbl:22}{100 * m['hit_rate']:6.1f}%{_x(ck.get('hit_vs_ceiling', float('nan'))):>7}"
                     f"{_ms(m['ttft_p50_ms']):>6}{_ms(m['ttft_p90_ms']):>6}"
                     f"{_x(ck.get('ttft_p90_vs_best_other', float('nan'))):>7}"
                     f"{m['throughput_rps']:7.1f}{m['errors']:5d}  "
                     f"{_shares(m, sh['pod_cost'])}")
    return lines


def table(report: Mapping[str, Any]) -> str:
    lines = [(f"epp bench sweep: {len(report['shapes'])} shapes ({report['command']}); "
             f"routers {', '.join(report['routers'])}"), ""]
    for e in report["shapes"]:
        lines += shape_table(e) + [""]
    for name, per_router in report["aggregate"].items():
        n = max((a["shapes"] for a in per_router.values()), default=0)
        lines.append(f"aggregate [{name}], medians over {n} shapes (ratios: 1.00 = the best "
                     "router on the shape for TTFT, the ceiling for hits)")
        lines.append(f"  {'router':22}{'hit/ceil':>9}{'p50/best':>9}{'p90/best':>9}"
                     f"{'tput/offered':>13}{'busiest/even':>13}{'errors':>7}"
                     f"{'hit ok':>8}{'p90 ok':>8}{'both':>7}{'worst p90/RR':>13}")
        for r, a in per_router.items():
            ck = report["checks"][name][r]
            n_r = ck["shapes"]
            lines.append(f"  {r:22}{_x(a['hit_vs_ceiling']):>9}{_x(a['ttft_p50_vs_best']):>9}"
                         f"{_x(a['ttft_p90_vs_best']):>9}{_x(a['throughput_vs_offered']):>13}"
                         f"{_x(a['busiest_vs_even']):>13}{a['errors']:7d}"
                         f"{ck['hit_ok']:>5}/{n_r:<2}{ck['ttft_ok']:>5}/{n_r:<2}"
                         f"{ck['both_ok']:>4}/{n_r:<2}{_x(ck['worst_ttft_p90_vs_rr']):>13}")
        lines.append("")
    for name, per_router in report["checks"].items():
        for r, ck in per_router.items():
            n = ck["shapes"]
            lines.append(
                f"target [{name}] [{r}] hit >= {TARGET_HIT_VS_CEILING:.0%} of ceiling and TTFT "
                f"p90 <= best other router on >= {TARGET_SHAPE_SHARE:.0%} of shapes: "
                f"{ck['both_ok']}/{n} ({_pct(ck['share_both_ok'])}; hit {ck['hit_ok']}/{n}, "
                f"TTFT {ck['ttft_ok']}/{n}) -> {'met' if ck['target_shapes_met'] else 'NOT met'}")
            if r != ROUND_ROBIN:
                worse = ck["worse_than_rr"]
                lines.append(
                    f"target [{name}] [{r}] on no shape > {RR_TOLERANCE:.0%} worse than round "
                    f"robin (TTFT p90, throughput): worst p90 {_x(ck['worst_ttft_p90_vs_rr'])}x"
                    f" RR, lowest throughput {_x(ck['lowest_throughput_vs_rr'])}x RR"
                    + (f"; worse on {', '.join(worse)}" if worse else "")
                    + f" -> {'met' if ck['target_rr_met'] else 'NOT met'}")
    if report.get("skipped"):
        lines += [f"skipped {k}: {v}" for k, v in report["skipped"].items()]
    return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{x:.0%}" if _finite(x) else "-"


def plot(report: Mapping[str, Any], path: Path) -> None:
    """A PNG: per shape, each router's hit rate / ceiling and TTFT p90 / the best's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = report["shapes"]
    routers: list[str] = list(report["routers"])
    names = [("* " if e["set"] == HELD_OUT else "") + e["shape"]["name"] for e in entries]
    x = list(range(len(entries)))
    width = 0.8 / max(1, len(routers))
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(entries) + 3), 8), sharex=True)
    for j, r in enumerate(routers):
        off = [i + (j - (len(routers) - 1) / 2) * width for i in x]
        hit = [e["checks"].get(r, {}).get("hit_vs_ceiling", float("nan")) for e in entries]
        p90 = []
        for e in entries:
            res = e["results"]
            best = min((m["ttft_p90_ms"] for m in res.values()
                        if m.get("ok", 0) > 0 and _finite(m["ttft_p90_ms"])), default=float("nan"))
            v = res.get(r, {}).get("ttft_p90_ms", float("nan"))
            p90.append(v / best if _finite(v) and _finite(best) and best > 0 else float("nan"))
        axes[0].bar(off, hit, width, label=r)
        axes[1].bar(off, p90, width, label=r)
    axes[0].axhline(TARGET_HIT_VS_CEILING, color="grey", linestyle=":", label="95% of ceiling")
    axes[0].set_ylabel("hit rate / ceiling")
    axes[0].legend(fontsize="small", ncol=3)
    axes[1].axhline(1.0, color="black", linestyle="--")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("TTFT p90 / best router's (log)")
    axes[1].set_xticks(x, names, rotation=30, ha="right", fontsize="small")
    fig.suptitle(f"epp bench sweep ({report['command']}); * = held-out")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------- the run


def base_costs(sim_args: Sequence[str]) -> SimCosts:
    """The pods' costs at ``--time-scale 1`` (the sweep sets the time scale per shape)."""
    cfg = sim_config(list(sim_args))
    return SimCosts(cfg.prefill_ms_per_token, cfg.decode_base_ms, cfg.decode_per_seq_ms,
                    cfg.max_num_seqs, cfg.num_gpu_blocks, cfg.block_size)


def _plan_json(pl: Plan) -> dict[str, Any]:
    return {"requests": len(pl.trace), "duration_s": pl.duration_s, "rate": pl.rate,
            "offered_rps": pl.offered_rps, "capacity_rps": pl.capacity_rps, "load": pl.load,
            "time_scale": pl.time_scale, "num_gpu_blocks": pl.num_gpu_blocks,
            "working_set_blocks": pl.working_set_blocks, "cache_ratio": pl.cache_ratio,
            "sim_args": pl.common_args, "pod_args": pl.pod_args,
            "kinds": sorted({r.kind for r in pl.trace})}


_KEEP: Final = ("requests", "ok", "errors", "error_kinds", "not_sent_or_cut", "elapsed_s",
                "throughput_rps", "hit_rate", "prompt_tokens", "cached_tokens", "ttft_mean_ms",
                "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p90_ms",
                "share", "share_max", "share_sorted", "by_kind")


async def run_shape(pl: Plan, routers: Sequence[RouterSpec], *, index: int, drain_s: float,
                    workdir: Path, progress: bool, skipped: dict[str, str],
                    log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Every router on one shape, each with fresh pods; metrics by router label."""
    out: dict[str, dict[str, Any]] = {}
    k = index % max(1, len(routers))
    for spec in [*routers[k:], *routers[:k]]:
        if spec.kind in skipped:
            continue
        t0 = time.monotonic()
        try:
            async with Stack(spec, pl.shape.pods, pl.common_args,
                             workdir / f"{pl.shape.name}-{spec.label.replace(':', '-')}",
                             pod_args=pl.pod_args, share_processes=True,
                             words=trace_words(r.messages for r in pl.trace)) as stack:

                def tick(n: int, errors: int, t: float, label: str = spec.label) -> None:
                    if progress:
                        log(f"    [{label}] {t:4.1f}s {n:4d} done {errors} errors")

                samples, elapsed, cut = await play(stack.url, pl.trace,
                                                   duration_s=pl.duration_s, drain_s=drain_s,
                                                   progress=tick)
                m = summarize(samples, elapsed, cut, stack.pods)
                if m["ok"] == 0:
                    log(stack.log_tails())
        except (OSError, RuntimeError, TimeoutError) as e:
            if spec.kind != "sglang":
                raise
            skipped["sglang"] = f"sglang-router did not start: {e}"
            log(f"  skipping sglang: {skipped['sglang']}")
            continue
        out[spec.label] = {k2: m[k2] for k2 in _KEEP if k2 in m}
        log(f"  [{spec.label}] {m['ok']} ok, {m['errors']} errors, TTFT p50/p90 "
            f"{_ms(m['ttft_p50_ms'])}/{_ms(m['ttft_p90_ms'])} ms, hit "
            f"{100 * m['hit_rate']:.1f}% ({time.monotonic() - t0:.0f}s)")
    return out


def shape_entry(shape: Shape, pl: Plan, c: Mapping[str, Any],
                results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One shape's record in the report, its checks included."""
    bound = c["bound"]["hit_rate"]
    return {"set": HELD_OUT if shape.held_out else TRAINING, "shape": asdict(shape),
            "description": shape.describe(), "plan": _plan_json(pl), "ceiling": dict(c),
            "results": results,
            "checks": {r: ck for r in results
                       if (ck := shape_check(results, bound, r)) is not None}}


async def run_sweep(args: argparse.Namespace, log: Callable[[str], None] = print
                    ) -> dict[str, Any]:
    smoke = args.smoke
    extra = shlex.split(args.sim_args or "")
    base_args = [*shlex.split(BASE_SIM_ARGS), *extra]
    base = base_costs(base_args)
    shapes = sweep_shapes(args.sweep, args.seed, held_out=args.held_out,
                          max_pods=args.max_pods, smoke=smoke, shape_seeds=args.shape_seeds)
    routers = parse_routers(args.routers, args.config)
    skipped: dict[str, str] = {}
    if any(r.kind == "sglang" for r in routers):
        why = ensure_sglang(install=not smoke and not args.no_install, log=log)
        if why:
            log(f"skipping sglang: {why}")
            skipped["sglang"] = why
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="epp-sweep-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    picked = ",".join(str(x) for x in args.shape_seeds)
    command = ("epp bench " + (f"--shape-seeds {picked}" if picked
                                else f"--sweep {args.sweep} --seed {args.seed}")
               + (" --held-out" if args.held_out else "") + (" --smoke" if smoke else ""))
    log(f"{command}: {len(shapes)} shapes x {len(routers)} routers, output in {out_dir}")
    # SIGTERM and SIGHUP stop the sweep as Ctrl-C does: every stack is closed on the way.
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, task.cancel)
    entries: list[dict[str, Any]] = []
    t_start = time.monotonic()
    for i, shape in enumerate(shapes):
        pl = plan(shape, base, duration_s=args.shape_duration, min_rate=args.min_rate,
                  max_rate=args.max_rate, base_args=base_args)
        c = ceiling(pl.trace, servers=shape.pods, num_gpu_blocks=pl.num_gpu_blocks,
                    block_size=base.block_size)
        cj = {k: {"policy": v.policy, "hit_rate": v.hit_rate, "share": list(v.share)}
              for k, v in c.items()}
        log(f"\n[{i + 1}/{len(shapes)}] {shape.name}: {shape.describe()}")
        log(f"  {len(pl.trace)} requests, {pl.offered_rps:.1f} req/s ({pl.load:.0%} of "
            f"capacity, time scale {pl.time_scale:.3g}), KV {pl.num_gpu_blocks} blocks/pod "
            f"({pl.cache_ratio:.2f}x working set); ceiling {100 * c['bound'].hit_rate:.1f}%")
        results = await run_shape(pl, routers, index=i, drain_s=args.drain,
                                  workdir=out_dir / "logs", progress=args.progress,
                                  skipped=skipped, log=log)
        entries.append(shape_entry(shape, pl, cj, results))
    labels = [r.label for r in routers if r.kind not in skipped]
    agg, checks = evaluate(entries, labels)
    report: dict[str, Any] = {
        "command": command, "seed": args.seed, "sweep": args.sweep,
        "shape_seeds": list(args.shape_seeds), "held_out": args.held_out,
        "held_out_seeds": list(HELD_OUT_SEEDS), "smoke": smoke, "max_pods": args.max_pods,
        "shape_duration_s": args.shape_duration, "min_rate": args.min_rate,
        "max_rate": args.max_rate, "base_sim_args": base_args,
        "routers": labels, "router_specs": {r.label: asdict(r) for r in routers},
        "shapes": entries, "aggregate": agg, "checks": checks, "skipped": skipped,
        "wall_s": time.monotonic() - t_start,
        "machine": {"python": sys.version.split()[0], "cpus": _cpus()},
    }
    (out_dir / "results.json").write_text(json.dumps(report, indent=2, default=str))
    txt = table(report)
    (out_dir / "table.txt").write_text(txt + "\n")
    log("\n" + txt)
    if entries and have_matplotlib(install=False, log=log):
        plot(report, out_dir / "sweep.png")
        log(f"\nwrote {out_dir / 'results.json'}, table.txt and sweep.png")
    else:
        log(f"\nwrote {out_dir / 'results.json'} and table.txt (no plot: matplotlib is "
            "not installed)")
    return report


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


# ----------------------------------------------------------------- command line


def _seed_list(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("expected at least one seed")
    return seeds


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep (docs/benchmarks.md, \"Sweep\")")
    g.add_argument("--sweep", type=int, default=0, metavar="N",
                   help="draw N workload shapes from --seed (the first is the issue's "
                   "capacity-bound shared-prefix shape) and run every router on each; "
                   "uses --seed, --routers, --config, --sim-args, --drain, --out, --smoke")
    g.add_argument("--shape-seeds", type=_seed_list, default=(), metavar="S1,S2,...",
                   help="instead of --sweep N: the training shapes of exactly these seeds "
                   "(e.g. the bursty ones of an earlier sweep, to tune on them again); "
                   "held-out seeds are refused")
    g.add_argument("--held-out", action="store_true",
                   help=f"also run the {len(HELD_OUT_SEEDS)} held-out shapes (seeds "
                   f"{HELD_OUT_SEEDS[0]}..{HELD_OUT_SEEDS[-1]}; never tune on them), "
                   "reported as their own set; alone, only those")
    g.add_argument("--max-pods", type=int, default=None,
                   help=f"largest pod count a shape may draw ({POD_RANGE[0]}..{POD_RANGE[1]}; "
                   f"default {DEFAULT_MAX_PODS}, smoke 3)")
    g.add_argument("--shape-duration", type=float, default=None,
                   help="seconds of arrivals per shape and router (default 8; smoke 3)")
    g.add_argument("--min-rate", type=float, default=None,
                   help="lowest offered rate, req/s: slower pools run faster (time scale "
                   "< 1) to get enough requests (default 8; smoke 10)")
    g.add_argument("--max-rate", type=float, default=None,
                   help="highest offered rate, req/s, that 2 cores drive through Envoy and "
                   "the EPP without becoming the bottleneck: faster pools run slower "
                   "(time scale > 1) (default 30; smoke 15)")


def main(args: argparse.Namespace) -> int:
    """``epp bench --sweep N`` / ``--held-out``."""
    def bad(msg: str) -> int:
        print(f"epp bench: {msg}", file=sys.stderr)
        return 2

    if args.workload == "overload":
        return bad("--sweep does not combine with --workload overload")
    for flag, given in (("--servers", args.servers is not None), ("--rate", bool(args.rate)),
                        ("--max-requests", args.max_requests is not None),
                        ("--repeat", args.repeat != 1)):
        if given:
            return bad(f"{flag} does not apply to a sweep (each shape draws its pods and "
                       "load; run the sweep again for another round)")
    smoke = args.smoke
    if args.max_pods is None:
        args.max_pods = 3 if smoke else DEFAULT_MAX_PODS
    if args.shape_duration is None:
        args.shape_duration = 3.0 if smoke else 8.0
    if args.min_rate is None:
        args.min_rate = 10.0 if smoke else 8.0
    if args.max_rate is None:
        args.max_rate = 15.0 if smoke else 30.0
    if args.drain is None:
        args.drain = 5.0 if smoke else 15.0
    if args.routers is None:
        args.routers = SMOKE_ROUTERS if smoke else default_routers()
    if not POD_RANGE[0] <= args.max_pods <= POD_RANGE[1]:
        return bad(f"--max-pods must be in {POD_RANGE[0]}..{POD_RANGE[1]}, got {args.max_pods}")
    if args.shape_duration <= 0 or args.min_rate <= 0 or args.max_rate < args.min_rate:
        return bad("--shape-duration and --min-rate must be > 0 and --max-rate >= --min-rate")
    if args.sweep < 0:
        return bad(f"--sweep must be >= 0, got {args.sweep}")
    if args.shape_seeds and args.sweep:
        return bad("--shape-seeds replaces --sweep N (give one of them)")
    try:
        parse_routers(args.routers, args.config)
        sweep_shapes(args.sweep, args.seed, held_out=args.held_out, max_pods=args.max_pods,
                     smoke=smoke, shape_seeds=args.shape_seeds)
        report = asyncio.run(run_sweep(args, log=lambda s: print(s, flush=True)))
    except ValueError as e:
        return bad(f"error: {e}")
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\nstopped; everything the sweep started has been stopped")
        return 130
    ran = all(m["ok"] > 0 for e in report["shapes"] for m in e["results"].values())
    return 0 if ran and report["shapes"] else 1
