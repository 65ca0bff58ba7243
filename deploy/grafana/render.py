"""Render epp-dashboard.json as a picture from real data, without Grafana.

Grafana is not installable from this project's package sources (no Debian package; the PyPI
and npm packages named ``grafana`` are placeholders or client libraries), so this script
does what Grafana would do with the dashboard and draws the result:

1. starts a local P/D stack on 127.0.0.1 (``epp.stack.pd.PdStack``: `epp sim` prefill and
   decode pods in two racks, ``epp serve`` with config/pd.yaml, real Envoy);
2. starts Prometheus (Debian package ``prometheus``) scraping the EPP's /metrics every
   second and evaluating epp-alerts.yaml;
3. drives bounded traffic through Envoy for ``--duration`` seconds: multi-turn chats that
   share prefixes, long documents (disaggregated) and short follow-ups (decode-only), a few
   bad requests, concurrency ramping up and down; for a stretch in the middle one decode
   "pod" that does not exist is in the pool (its scrapes fail, its metrics go stale and
   requests sent to it fail);
4. runs every panel's PromQL (``$__rate_interval`` -> ``--rate-interval``, ``$pool`` and
   ``$model`` -> All) as a range query against that Prometheus and draws the panels where
   the dashboard's gridPos puts them, in Grafana's dark theme (matplotlib).

    .venv/bin/python deploy/grafana/render.py --out docs/img/dashboard.png
    .venv/bin/python deploy/grafana/render.py --duration 60 --out /tmp/dash.png  # quicker

Needs ``prometheus`` on PATH and matplotlib (``pip install matplotlib``). Every process
started is stopped at the end; nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from epp import keys
from epp.stack.pd import PD_SIM_ARGS, PdPod, PdStack, grove_layout, repo_config
from epp.stack.procs import ManagedProcess, free_port, wait_port

DASHBOARD = HERE / "epp-dashboard.json"
ALERTS = HERE / "epp-alerts.yaml"

# Grafana's dark theme and classic palette.
BG, PANEL, BORDER, TEXT, MUTED, GRID = ("#111217", "#181b1f", "#2c3235", "#ccccdc",
                                        "#8e8e99", "#2a2d33")
PALETTE = ["#73BF69", "#F2CC0C", "#8AB8FF", "#FF780A", "#F2495C", "#5794F2", "#B877D9",
           "#705DA0", "#37872D", "#FADE2A", "#447EBC", "#C15C17"]
COLORS = {"green": "#73BF69", "yellow": "#FADE2A", "red": "#F2495C", "orange": "#FF9830"}


# ----------------------------------------------------------------------------- traffic

SYSTEM = ["You are a travel agent. Answer briefly. " * 20,
          "You review Python code for bugs, then style. " * 20,
          "You are a cloud support engineer; ask for the region first. " * 20]


@dataclass
class Traffic:
    sent: int = 0
    status: dict[int, int] = field(default_factory=dict)


async def drive(url: str, duration: float, stack: PdStack, dead: PdPod, rng: random.Random,
                traffic: Traffic, during_outage: Callable[[], Awaitable[None]] | None = None
                ) -> None:
    """Bounded load: concurrency follows a ramp; one phase adds a dead pod to the pool."""
    t0 = time.monotonic()
    stop_at = t0 + duration
    chats: list[list[dict[str, str]]] = []

    def concurrency(t: float) -> int:  # 2 -> 30 (at 60 %) -> 12
        return max(1, round(2 + 28 * math.sin(0.8 * math.pi * min(1.0, t / duration)) ** 2))

    def next_request() -> tuple[str, bytes]:
        r = rng.random()
        if r < 0.02:
            return "/v1/chat/completions", b'{"model": "sim-model", "messages": '  # cut short
        if r < 0.03:
            return "/v1/embeddings-typo", orjson.dumps({"model": "sim-model", "input": "x"})
        if r < 0.18:  # a long document: far more uncached tokens than nonCachedTokens
            doc = " ".join(f"doc{rng.randrange(10**6)}" for _ in range(700))
            msgs = [{"role": "user", "content": "Summarise: " + doc}]
        else:  # a chat turn: a system prompt shared by many, history shared within a chat
            if not chats or rng.random() < 0.3 or len(chats[-1]) > 8:
                chats.append([{"role": "system", "content": rng.choice(SYSTEM)}])
            chat = rng.choice(chats[-20:])
            chat.append({"role": "user", "content": f"question {rng.randrange(1000)} " * 5})
            chat.append({"role": "assistant", "content": "answer " * 20})
            msgs = chat[:-1]
        body = {"model": "sim-model", "messages": msgs, "max_tokens": rng.choice((16, 32, 64)),
                "stream": rng.random() < 0.5, "stream_options": {"include_usage": True}}
        return "/v1/chat/completions", orjson.dumps(body)

    async def worker(i: int, session: aiohttp.ClientSession) -> None:
        while (now := time.monotonic()) < stop_at:
            if i >= concurrency(now - t0):
                await asyncio.sleep(0.2)
                continue
            path, body = next_request()
            traffic.sent += 1
            try:
                async with session.post(url + path, data=body,
                                        headers={"content-type": "application/json"}) as r:
                    await r.read()
                    traffic.status[r.status] = traffic.status.get(r.status, 0) + 1
            except (TimeoutError, aiohttp.ClientError):
                traffic.status[0] = traffic.status.get(0, 0) + 1

    async def dead_pod_phase() -> None:
        await asyncio.sleep(duration * 0.45)
        stack.layout.pods.append(dead)
        stack.set_pool()
        await asyncio.sleep(duration * 0.12)
        if during_outage is not None:
            await during_outage()
        stack.layout.pods.remove(dead)
        stack.set_pool()

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(dead_pod_phase(), *(worker(i, session) for i in range(32)))


# ----------------------------------------------------------------------------- prometheus

async def start_prometheus(binary: str, workdir: Path, epp_metrics_port: int,
                           port: int) -> ManagedProcess:
    shutil.copy(ALERTS, workdir / "epp-alerts.yaml")
    (workdir / "prometheus.yml").write_text(f"""\
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [epp-alerts.yaml]
scrape_configs:
- job_name: epp
  static_configs: [{{targets: ["127.0.0.1:{epp_metrics_port}"]}}]
""")
    proc = ManagedProcess([binary, f"--config.file={workdir / 'prometheus.yml'}",
                           f"--storage.tsdb.path={workdir / 'data'}",
                           f"--web.listen-address=127.0.0.1:{port}"],
                          log_path=workdir / "prometheus.log", cwd=workdir)
    await proc.start()
    await wait_port("127.0.0.1", port, timeout=30)
    return proc


async def query_range(session: aiohttp.ClientSession, prom: str, expr: str, start: float,
                      end: float, step: float) -> list[dict[str, Any]]:
    async with session.get(f"{prom}/api/v1/query_range",
                           params={"query": expr, "start": str(start), "end": str(end),
                                   "step": str(step)}) as r:
        data = await r.json()
    if data.get("status") != "success":
        raise RuntimeError(f"query failed: {expr}: {data}")
    result: list[dict[str, Any]] = data["data"]["result"]
    return result


def resolve(expr: str, rate_interval: str) -> str:
    expr = re.sub(r"\$(?:\{__rate_interval\}|__rate_interval)", rate_interval, expr)
    return re.sub(r"\$(?:\{(?:pool|model)\}|(?:pool|model)\b)", ".*", expr)


async def screenshot(url: str, out: Path) -> None:
    """Debian chromium, headless, of a page of the local Prometheus."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium not found: no alerts screenshot", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory() as profile:
        proc = await asyncio.create_subprocess_exec(
            chromium, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", f"--user-data-dir={profile}", f"--screenshot={out}",
            "--window-size=1200,760", url,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    print(f"wrote {out}", file=sys.stderr)


# ----------------------------------------------------------------------------- drawing

def fmt(v: float, unit: str, decimals: int | None = None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "No data"
    if unit == "percentunit":
        return f"{v * 100:.{1 if decimals is None else decimals}f}%"
    if unit == "s":
        if v == 0:
            return "0 s"
        if abs(v) < 1e-3:
            return f"{v * 1e6:.0f} µs"
        if abs(v) < 1:
            return f"{v * 1e3:.{1 if v < 0.01 else 0}f} ms"
        return f"{v:.2f} s"
    suffix = {"reqps": " req/s", "ops": " ops/s"}.get(unit, "")
    if decimals is not None:
        return f"{v:.{decimals}f}{suffix}"
    if abs(v) >= 100 or v == int(v):
        return f"{v:.0f}{suffix}"
    return f"{v:.3g}{suffix}"


def legend_name(fmt_s: str, metric: dict[str, str], expr: str) -> str:
    if fmt_s and fmt_s != "__auto":
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt_s)
    return ", ".join(f'{k}="{v}"' for k, v in metric.items()) or expr[:40]


def threshold_color(v: float, steps: list[dict[str, Any]]) -> str:
    color = steps[0]["color"] if steps else "green"
    for s in steps:
        if s["value"] is not None and v >= s["value"]:
            color = s["color"]
    return COLORS.get(color, color)


def draw(dashboard: dict[str, Any], data: dict[int, list[tuple[str, list[tuple[float, float]]]]],
         start: float, end: float, out: Path, subtitle: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from datetime import datetime

    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    W, unit_h, header, margin = 1600, 30, 96, 10
    H = header + rows * unit_h + margin
    col_w = (W - 2 * margin) / 24
    dpi = 100
    fig = plt.figure(figsize=(W / dpi, H / dpi), dpi=dpi, facecolor=BG)
    plt.rcParams.update({"font.family": "DejaVu Sans", "font.size": 8})

    def box(x: float, y: float, w: float, h: float) -> tuple[float, float, float, float]:
        """Pixel box (top-left origin) -> figure fraction (left, bottom, width, height)."""
        return x / W, 1 - (y + h) / H, w / W, h / H

    fig.text(margin / W, 1 - 24 / H, dashboard["title"], color=TEXT, fontsize=15,
             fontweight="bold", va="center")
    t_end = datetime.fromtimestamp(end)
    fig.text(1 - margin / W, 1 - 24 / H, f"{datetime.fromtimestamp(start):%H:%M:%S} to "
             f"{t_end:%H:%M:%S}   refresh 30s", color=MUTED, fontsize=9, ha="right",
             va="center")
    x: float = margin
    for label, value in (("Data source", "prometheus"), ("Pool", "All"), ("Model", "All")):
        w = 24 + 6.5 * len(label) + 7.5 * len(value)
        fig.patches.append(FancyBboxPatch((x / W, 1 - 62 / H), w / W, 22 / H,
                                          boxstyle="round,pad=0,rounding_size=0.002",
                                          transform=fig.transFigure, facecolor=PANEL,
                                          edgecolor=BORDER, zorder=-1))
        fig.text((x + 6) / W, 1 - 51 / H, label, color=MUTED, fontsize=9, va="center")
        fig.text((x + 14 + 6.5 * len(label)) / W, 1 - 51 / H, value, color=TEXT, fontsize=9,
                 va="center", fontweight="bold")
        x += w + 8
    fig.text(1 - margin / W, 1 - 51 / H, subtitle, color=MUTED, fontsize=8, ha="right",
             va="center", style="italic")

    for p in panels:
        g = p["gridPos"]
        px, py = margin + g["x"] * col_w, header + g["y"] * unit_h
        pw, ph = g["w"] * col_w - 6, g["h"] * unit_h - 6
        if p["type"] == "row":
            fig.text(px / W, 1 - (py + unit_h / 2) / H, "⌄ " + p["title"], color=TEXT,
                     fontsize=11, fontweight="bold", va="center")
            continue
        fig.patches.append(FancyBboxPatch(box(px, py, pw, ph)[:2], pw / W, ph / H,
                                          boxstyle="round,pad=0,rounding_size=0.002",
                                          transform=fig.transFigure, facecolor=PANEL,
                                          edgecolor=BORDER, linewidth=0.8, zorder=-1))
        fig.text((px + 8) / W, 1 - (py + 14) / H, p["title"], color=TEXT, fontsize=9,
                 fontweight="bold", va="center")
        series = data.get(p["id"], [])
        defaults = p["fieldConfig"]["defaults"]
        unit = defaults.get("unit", "short")
        if p["type"] == "stat":
            _draw_stat(fig, box, p, series, px, py, pw, ph, unit, defaults)
        else:
            _draw_timeseries(fig, box, p, series, px, py, pw, ph, unit, defaults, start, end,
                             mdates)
    fig.savefig(out, dpi=dpi, facecolor=BG)
    plt.close(fig)


def _draw_stat(fig: Any, box: Any, p: dict[str, Any], series: list[Any], px: float, py: float,
               pw: float, ph: float, unit: str, defaults: dict[str, Any]) -> None:
    """Grafana's stat panel: the last value, coloured by threshold, over a sparkline."""
    fw, fh = fig.get_figwidth() * fig.dpi, fig.get_figheight() * fig.dpi
    steps = defaults.get("thresholds", {}).get("steps", [])
    named = p["targets"][0].get("legendFormat", "__auto") != "__auto"
    n = max(1, len(series))
    for k, (name, points) in enumerate(series or [("", [])]):
        vals = [v for _, v in points if not math.isnan(v)]
        last = vals[-1] if vals else float("nan")
        color = threshold_color(last, steps) if vals else MUTED
        cx = px + pw * (k + 0.5) / n
        if len(vals) > 1:
            ax = fig.add_axes(box(px + pw * k / n + 4, py + ph * 0.55, pw / n - 8, ph * 0.42))
            xs = [t for t, _ in points]
            ys = [0.0 if math.isnan(v) else v for _, v in points]
            ax.fill_between(xs, ys, color=color, alpha=0.18, linewidth=0)
            ax.plot(xs, ys, color=color, lw=1, alpha=0.6)
            ax.set_axis_off()
            ax.set_xlim(xs[0], xs[-1])
            ax.set_ylim(min(0.0, min(vals)), max(vals) * 1.05 or 1)
        fig.text(cx / fw, 1 - (py + ph * 0.52) / fh, fmt(last, unit, defaults.get("decimals")),
                 color=color, fontsize=22 if n == 1 else 16, fontweight="bold", ha="center",
                 va="center")
        if name and named:
            fig.text(cx / fw, 1 - (py + ph * 0.8) / fh, name, color=MUTED, fontsize=8,
                     ha="center", va="center")


def _draw_timeseries(fig: Any, box: Any, p: dict[str, Any], series: list[Any], px: float,
                     py: float, pw: float, ph: float, unit: str, defaults: dict[str, Any],
                     start: float, end: float, mdates: Any) -> None:
    from datetime import datetime

    from matplotlib import ticker

    cols = 3 if pw > 700 or all(len(name) < 22 for name, _ in series) else 2
    legend_rows = max(1, math.ceil(len(series[:12]) / cols)) if series else 0
    top, bottom = 26, 22 + 14 * legend_rows
    ax = fig.add_axes(box(px + 52, py + top, pw - 62, ph - top - bottom))
    ax.set_facecolor(PANEL)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.grid(True, color=GRID, linewidth=0.6)
    ax.tick_params(colors=MUTED, labelsize=7, length=0)
    stacked = defaults.get("custom", {}).get("stacking", {}).get("mode") == "normal"
    base: dict[float, float] = {}
    ymax = 0.0
    for k, (name, points) in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        ts = [datetime.fromtimestamp(t) for t, _ in points]
        vs = [v for _, v in points]
        if stacked:
            lows = [base.get(t, 0.0) for t, _ in points]
            vs = [lo + (0 if math.isnan(v) else v) for lo, v in zip(lows, vs)]
            for (t, _), v in zip(points, vs):
                base[t] = v
            ax.fill_between(ts, lows, vs, color=color, alpha=0.25, linewidth=0)
        else:
            ax.fill_between(ts, [0 if math.isnan(v) else v for v in vs], color=color,
                            alpha=0.08, linewidth=0)
        ax.plot(ts, vs, color=color, lw=1.2)
        finite = [v for v in vs if not math.isnan(v)]
        ymax = max([ymax, *finite])
    ax.set_xlim(datetime.fromtimestamp(start), datetime.fromtimestamp(end))
    lo = defaults.get("min", None)
    hi = defaults.get("max", None)
    top_v = hi if hi is not None else (ymax * 1.1 if ymax > 0 else 1)
    ax.set_ylim(lo if lo is not None else 0, top_v)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    span = end - start
    step = next((c for c in (10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200)
                 if span / c <= 6), 3 * 3600)
    ax.set_xticks([datetime.fromtimestamp(t)
                   for t in range(int(math.ceil(start / step) * step), int(end) + 1, step)])
    ax.yaxis.set_major_locator(ticker.MaxNLocator(4))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(
        lambda v, _: fmt(v, unit).replace(" req/s", "").replace(" ops/s", "")))
    if not series:
        ax.text(0.5, 0.5, "No data", color=MUTED, ha="center", va="center",
                transform=ax.transAxes, fontsize=10)
    # Legend: coloured dashes with names, two or three to a line.
    fw, fh = fig.get_figwidth() * fig.dpi, fig.get_figheight() * fig.dpi
    for k, (name, _) in enumerate(series[:12]):
        col, line = k % cols, k // cols
        lx = px + 10 + col * (pw - 20) / cols
        ly = py + ph - bottom + 20 + 14 * line
        fig.text(lx / fw, 1 - ly / fh, "▬", color=PALETTE[k % len(PALETTE)], fontsize=8,
                 va="center")
        room = int(((pw - 20) / cols - 20) / 4.6)
        label = name if len(name) <= room else name[:room - 1] + "…"
        fig.text((lx + 14) / fw, 1 - ly / fh, label, color=MUTED, fontsize=7, va="center")


# ----------------------------------------------------------------------------- main

async def main_async(args: argparse.Namespace) -> int:
    dashboard = json.loads(DASHBOARD.read_text())
    if args.replot:  # draw again from a --data file, no stack
        saved = json.loads(Path(args.replot).read_text())
        draw(dashboard, {int(k): v for k, v in saved["data"].items()}, saved["start"], saved["end"], Path(args.out), saved.get("subtitle", ""))
        print(f"wrote {args.out}", file=sys.stderr)
        return 0
    prometheus = shutil.which(args.prometheus) or args.prometheus
    if not Path(prometheus).exists():
        print("prometheus not found: apt-get install prometheus", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="epp-dash-"))
    sim_args = {"prefill": PD_SIM_ARGS["prefill"],
                "decode": (*PD_SIM_ARGS["decode"], "--max-num-seqs", "6",
                           "--num-gpu-blocks", "600")}
    layout = grove_layout(racks=("rack-1", "rack-2"), prefill_per_rack=1, decode_per_rack=2,
                          sim_args=sim_args)
    dead_port = free_port()
    labels = dict(layout.by_role("decode")[-1].labels)
    labels[keys.LABEL_GROVE_POD_INDEX] = "9"
    dead = PdPod("decode", "rack-2", dead_port, "llm-1-decode-gone",
                 layout.by_role("decode")[-1].node, labels)
    traffic = Traffic()
    prom_port = free_port()
    async with PdStack(work / "stack", layout, config_file=repo_config("pd.yaml"),
                       epp_args=["--metrics-staleness-threshold", "2s"]) as stack:
        prom = await start_prometheus(prometheus, work, stack.metrics_port, prom_port)
        try:
            await asyncio.sleep(5)
            start = time.time()
            print(f"driving traffic for {args.duration:.0f}s (Prometheus on :{prom_port}, "
                  f"work dir {work})", file=sys.stderr)
            prom_url = f"http://127.0.0.1:{prom_port}"

            async def shoot_alerts() -> None:
                if args.alerts_screenshot:
                    await screenshot(f"{prom_url}/classic/alerts", Path(args.alerts_screenshot))

            await drive(stack.url, args.duration, stack, dead, random.Random(args.seed),
                        traffic, shoot_alerts)
            end = time.time()
            await asyncio.sleep(2.5)  # Prometheus' last scrapes of the loaded state
            print(f"sent {traffic.sent} requests: {traffic.status}", file=sys.stderr)
            data: dict[int, list[tuple[str, list[tuple[float, float]]]]] = {}
            url = prom_url
            async with aiohttp.ClientSession() as session:
                for p in _all_panels(dashboard["panels"]):
                    for t in p.get("targets", []):
                        result = await query_range(session, url,
                                                   resolve(t["expr"], args.rate_interval),
                                                   start - 20, end, args.step)
                        for r in result:
                            pts = [(float(ts), float(v)) for ts, v in r["values"]]
                            name = legend_name(t.get("legendFormat", ""), r["metric"],
                                               t["expr"])
                            data.setdefault(p["id"], []).append((name, pts))
                async with session.get(f"{url}/api/v1/rules") as resp:
                    rules = (await resp.json())["data"]["groups"]
            states = {rule["name"]: rule["state"] for g in rules for rule in g["rules"]}
            print("alert states:", states, file=sys.stderr)
        finally:
            await prom.stop()
    subtitle = (f"Rendered by deploy/grafana/render.py from a Prometheus scraping a local P/D "
                f"stack ({traffic.sent} requests through Envoy)")
    if args.data:
        Path(args.data).write_text(json.dumps({"data": data, "start": start - 20, "end": end,
                                               "alerts": states, "subtitle": subtitle,
                                               "traffic": traffic.status}))
    draw(dashboard, data, start - 20, end, Path(args.out), subtitle)
    print(f"wrote {args.out}", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _all_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(_all_panels(p.get("panels", [])))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "dashboard.png"))
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of traffic")
    ap.add_argument("--step", type=float, default=2.0, help="range-query step (s)")
    ap.add_argument("--rate-interval", default="10s", help="what $__rate_interval becomes")
    ap.add_argument("--prometheus", default="prometheus", help="the prometheus binary")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--data", help="also write the queried series as JSON to this file")
    ap.add_argument("--replot", metavar="DATA", help="only draw, from a --data file")
    ap.add_argument("--alerts-screenshot", metavar="PNG",
                    help="also screenshot Prometheus' alerts page (chromium) during the outage")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
