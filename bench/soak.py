"""Soak benchmark: real Envoy → `epp serve` → 3 `epp sim` pods, mixed traffic, for a long time.

What runs (everything on 127.0.0.1, free ports, stopped at the end):

- 3 simulated pods in one `epp sim` process (``--sim-blocks`` KV blocks each, so the EPP's
  approximate prefix index, auto-tuned to the pods' cache size, fills up within the
  first minutes and must then stay bounded);
- `epp serve` with a static endpoints file and the built-in default config
  (``--workers`` front processes);
- Envoy from the project's template in GIE's shape by default: FULL_DUPLEX_STREAMED both
  ways, every response chunk through the EPP (``--body-mode BUFFERED`` for an
  AIBrix-style gateway, ``--response-path`` for the other shapes).

Open-loop traffic: Poisson arrivals at ``--rate`` req/s for ``--duration`` seconds, at most
``--max-inflight`` requests in flight (an arrival beyond that is dropped and counted, so
the load never piles up without bound). The mix (:data:`KINDS`): chat completions streamed
and not, completions streamed and not, many distinct prompts that share one of
``--prefixes`` system prompts / documents, some ~100 KB bodies, clients that abort a
stream after a few chunks, GET /v1/models (headers only), and a share of bad requests
(invalid JSON, not an object, missing model, wrong types, not UTF-8, empty) that must be
answered 4xx.

Every ``--sample`` seconds one sample: the RSS of the `epp serve` process tree (VmRSS from
/proc, summed over its processes when ``--workers`` > 1), of Envoy and of the simulator;
the EPP's CPU time; from the EPP's /metrics ``inference_extension_prefix_indexer_size``,
``inference_objective_running_requests`` (summed over models) and the ext_proc stream
outcomes; and for the window since the previous sample the responses by status, the
unexpected ones, and the client-side latency p50/p99 (complete, non-aborted valid
requests) and TTFT p50/p99 (streamed ones).

After the load: wait for in-flight requests (``--drain-timeout``), then poll the running
gauge until it is 0 (at most 20 s), take a last sample, write every sample and the
summary as JSON (``--json``, default ``soak.json`` in the run's temporary directory) and
print the summary: EPP RSS at minute 5 (``--baseline-at``; at most a quarter of the
duration for short runs) against the end of the load (target: within 10 %), the RSS
slope after the baseline, the prefix index's maximum, the unexpected errors (5xx,
connection errors and timeouts, a valid request not answered 200, a bad one not answered
4xx) and the running gauge after the drain.

``--tracemalloc`` (opt-in, slows the EPP): the EPP runs with Python's tracemalloc (a
``sitecustomize`` module written into the run's directory, on the EPP's PYTHONPATH only;
no EPP code changes) and the run ends with the allocation sites that grew most between
the baseline and the end of the load, and between the baseline and after the drain.

Exit status: 0 when there were no unexpected errors and the running gauge returned to 0;
1 otherwise (2 when the stack could not start). The RSS target is reported, not enforced.

    .venv/bin/python -m bench.soak                              # 25 minutes at 40 req/s
    .venv/bin/python -m bench.soak --duration 120 --json /tmp/soak.json
    .venv/bin/python -m bench.soak --quick                      # ~15 s of load, for CI
    .venv/bin/python -m bench.soak --duration 600 --tracemalloc # where does the heap grow?
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench.throughput import cpu_seconds as cpu_s
from epp.stack.envoy import BODY_MODES, RESPONSE_PATHS, EnvoyProcess, render_envoy_config
from epp.stack.procs import LOCAL_SERVE_FLAGS, ManagedProcess, free_port, wait_port

MODEL = "sim-model"
PODS = 3
MAX_BODY = 4 << 20

# (kind, weight %, expectation). Expectations: "ok" = 200 read to the end; "4xx" = a
# client error; "abort" = 200, then the client goes away after a few chunks.
KINDS: tuple[tuple[str, float, str], ...] = (
    ("chat-stream", 30, "ok"),
    ("chat", 18, "ok"),
    ("chat-multiturn-stream", 10, "ok"),
    ("completion", 12, "ok"),
    ("completion-stream", 6, "ok"),
    ("long-chat", 2, "ok"),          # ~100 KB body
    ("long-completion", 1.5, "ok"),  # ~100 KB body
    ("abort-stream", 6, "abort"),
    ("models", 1.5, "ok"),           # GET /v1/models, no body
    ("bad-json", 2, "4xx"),
    ("bad-not-object", 1.5, "4xx"),
    ("bad-missing-model", 2.5, "4xx"),
    ("bad-model-type", 1.5, "4xx"),
    ("bad-messages-type", 1.5, "4xx"),
    ("bad-prompt-type", 1.5, "4xx"),
    ("bad-not-utf8", 1, "4xx"),
    ("bad-empty", 1, "4xx"),
)
EXPECT = {k: e for k, _, e in KINDS}

_WORDS = ["the", "of", "and", "to", "in", "is", "for", "on", "that", "with", "as", "by",
          "at", "from", "this", "be", "are", "was", "it", "an", "or", "model", "token",
          "cache", "prefix", "prompt", "answer", "server", "request", "stream", "batch",
          "block", "gpu", "kernel", "router", "gateway", "envoy", "latency", "memory",
          "queue", "decode", "prefill", "layer", "weight", "vector", "matrix", "tensor",
          "shard", "replica", "region", "cluster", "node", "pod", "rack", "zone", "alpha",
          "beta", "gamma", "delta", "epsilon", "lambda", "sigma", "omega", "north", "south",
          "east", "west", "river", "mountain", "forest", "ocean", "desert", "island",
          "valley", "city", "harbor", "bridge", "tower", "castle", "garden"]


# ---------------------------------------------------------------------------------------
# Traffic


class Traffic:
    """Deterministic (``seed``) request bodies: distinct prompts over shared prefixes."""

    def __init__(self, seed: int, prefixes: int, long_kb: int) -> None:
        self.rng = random.Random(seed)
        self.seq = 0
        self.long_chars = long_kb * 1000
        self.system = [self._text(self.rng.randint(1000, 4000)) for _ in range(prefixes)]
        # Long documents: shared heads (so they are cached and matched) of ~20 KB; the
        # rest of each long body is fresh text.
        self.docs = [self._text(20_000) for _ in range(max(2, prefixes // 8))]
        weights = [w for _, w, _ in KINDS]
        total = sum(weights)
        acc, self._cum = 0.0, []
        for w in weights:
            acc += w / total
            self._cum.append(acc)

    def _text(self, chars: int) -> str:
        out: list[str] = []
        n = 0
        words = self.rng.choices(_WORDS, k=chars // 5 + 8)
        for w in words:
            out.append(w)
            n += len(w) + 1
            if n >= chars:
                break
        return " ".join(out)

    def _unique(self, chars: int) -> str:
        self.seq += 1
        return f"[{self.seq}] {self._text(chars)}"

    def kind(self) -> str:
        i = bisect.bisect_left(self._cum, self.rng.random())
        return KINDS[min(i, len(KINDS) - 1)][0]

    def build(self, kind: str) -> tuple[str, str, bytes | None]:
        """(method, path, body) of one request of ``kind``."""
        rng = self.rng
        sys_prompt = rng.choice(self.system)
        max_tokens = rng.randint(4, 40)
        chat, comp = "/v1/chat/completions", "/v1/completions"
        if kind in ("chat", "chat-stream"):
            user = self._unique(rng.randint(100, 2000))
            content: Any = user if rng.random() < 0.8 else [{"type": "text", "text": user}]
            body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "messages": [
                {"role": "system", "content": sys_prompt}, {"role": "user", "content": content}]}
            if kind == "chat-stream":
                body["stream"] = True
                if rng.random() < 0.5:
                    body["stream_options"] = {"include_usage": True}
            return "POST", chat, orjson.dumps(body)
        if kind == "chat-multiturn-stream":
            msgs: list[dict[str, Any]] = [{"role": "system", "content": sys_prompt}]
            for _ in range(rng.randint(1, 4)):
                msgs.append({"role": "user", "content": self._unique(rng.randint(50, 600))})
                msgs.append({"role": "assistant", "content": self._text(rng.randint(50, 400))})
            msgs.append({"role": "user", "content": self._unique(rng.randint(50, 600))})
            return "POST", chat, orjson.dumps({
                "model": MODEL, "max_tokens": max_tokens, "stream": True, "messages": msgs,
                "stream_options": {"include_usage": True}})
        if kind in ("completion", "completion-stream"):
            prompt = sys_prompt + " " + self._unique(rng.randint(100, 2000))
            return "POST", comp, orjson.dumps({"model": MODEL, "max_tokens": max_tokens,
                                               "prompt": prompt,
                                               "stream": kind == "completion-stream"})
        if kind in ("long-chat", "long-completion"):
            doc = rng.choice(self.docs)
            text = doc + " " + self._unique(max(1000, self.long_chars - len(doc)))
            if kind == "long-chat":
                return "POST", chat, orjson.dumps({
                    "model": MODEL, "max_tokens": max_tokens, "stream": rng.random() < 0.5,
                    "messages": [{"role": "user", "content": text}]})
            return "POST", comp, orjson.dumps({"model": MODEL, "max_tokens": max_tokens,
                                               "prompt": text})
        if kind == "abort-stream":
            # Long enough (200+ tokens, >= 1 s at the simulator's 5 ms steps) to be cut.
            return "POST", chat, orjson.dumps({
                "model": MODEL, "max_tokens": rng.randint(200, 400), "stream": True,
                "messages": [{"role": "system", "content": sys_prompt},
                             {"role": "user", "content": self._unique(rng.randint(100, 800))}]})
        if kind == "models":
            return "GET", "/v1/models", None
        user_msg = [{"role": "user", "content": self._unique(200)}]
        if kind == "bad-json":
            good = orjson.dumps({"model": MODEL, "messages": user_msg})
            return "POST", chat, good[: rng.randint(1, len(good) - 1)]
        if kind == "bad-not-object":
            return "POST", chat, orjson.dumps(rng.choice([[1, 2, 3], "text", 42, None]))
        if kind == "bad-missing-model":
            return "POST", rng.choice([chat, comp]), orjson.dumps(
                {"messages": user_msg, "prompt": self._unique(200), "max_tokens": max_tokens})
        if kind == "bad-model-type":
            return "POST", chat, orjson.dumps({"model": rng.choice([123, None, ["m"], {"a": 1}]),
                                               "messages": user_msg})
        if kind == "bad-messages-type":
            return "POST", chat, orjson.dumps({"model": MODEL, "messages": rng.choice(
                ["hello", 7, {"role": "user"}, [1, 2]])})
        if kind == "bad-prompt-type":
            return "POST", comp, orjson.dumps({"model": MODEL, "prompt": rng.choice(
                [{"a": 1}, 3.5, [{"x": 1}], True])})
        if kind == "bad-not-utf8":
            return "POST", chat, (b'{"model": "sim-model", "messages": [{"role": "user", '
                                  b'"content": "\xff\xfe\xfa"}]}')
        if kind == "bad-empty":
            return "POST", rng.choice([chat, comp]), b""
        raise ValueError(f"unknown kind {kind}")


# ---------------------------------------------------------------------------------------
# Client side


@dataclass
class Window:
    """What the client saw since the previous sample."""

    status: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[str] = field(default_factory=Counter)
    latency: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)


@dataclass
class ClientStats:
    started: int = 0
    dropped: int = 0
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    status: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # first example per problem
    window: Window = field(default_factory=Window)

    def record(self, kind: str, status: str, problem: str | None, latency: float | None,
               ttft: float | None, detail: str = "") -> None:
        self.by_kind.setdefault(kind, Counter())[status] += 1
        self.status[status] += 1
        self.window.status[status] += 1
        if problem is not None:
            key = f"{kind}: {problem}"
            self.unexpected[key] += 1
            self.window.unexpected[key] += 1
            self.examples.setdefault(key, detail[:300])
        if latency is not None:
            self.window.latency.append(latency)
        if ttft is not None:
            self.window.ttft.append(ttft)

    def take_window(self) -> Window:
        w, self.window = self.window, Window()
        return w


async def one_request(session: aiohttp.ClientSession, base: str, traffic: Traffic,
                      stats: ClientStats, kind: str) -> None:
    method, path, body = traffic.build(kind)
    expect = EXPECT[kind]
    headers = {"content-type": "application/json"} if body is not None else {}
    t0 = time.monotonic()
    try:
        async with session.request(method, base + path, data=body, headers=headers) as r:
            st = r.status
            if expect == "abort" and st == 200:
                chunks = 0
                want = traffic.rng.randint(1, 5)
                ended = True
                async for _ in r.content.iter_any():
                    chunks += 1
                    if chunks >= want:
                        ended = False
                        break
                if not ended:
                    r.close()  # drop the connection mid-stream
                stats.record(kind, "aborted" if not ended else "200", None, None, None)
                return
            ttft = None
            if st == 200 and body is not None and b'"stream":true' in body:
                first = True
                async for chunk in r.content.iter_any():
                    if first and chunk.strip():
                        ttft = time.monotonic() - t0
                        first = False
                payload = b""
            else:
                payload = await r.read()
            lat = time.monotonic() - t0
    except (TimeoutError, aiohttp.ClientError) as e:
        name = "timeout" if isinstance(e, TimeoutError) else "connection error"
        stats.record(kind, name, name, None, None, f"{type(e).__name__}: {e}")
        return
    label = str(st)
    if st >= 500:
        problem: str | None = f"HTTP {st}"
    elif expect == "4xx":
        problem = None if 400 <= st < 500 else f"HTTP {st} (expected 4xx)"
    else:
        problem = None if st == 200 else f"HTTP {st} (expected 200)"
    ok_latency = lat if (expect == "ok" and st == 200) else None
    stats.record(kind, label, problem, ok_latency, ttft,
                 payload.decode("utf-8", "replace") if problem else "")


async def drive(base: str, traffic: Traffic, stats: ClientStats, rate: float, duration: float,
                max_inflight: int, drain_timeout: float,
                session: aiohttp.ClientSession) -> int:
    """Poisson arrivals for ``duration`` s; then wait for the rest. Returns requests that
    had to be cancelled at the drain timeout (counted as unexpected)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + duration
    next_t = start
    tasks: set[asyncio.Task[None]] = set()
    while True:
        next_t += traffic.rng.expovariate(rate)
        if next_t >= deadline:
            break
        delay = next_t - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= max_inflight:
            stats.dropped += 1
            continue
        kind = traffic.kind()
        stats.started += 1
        t = asyncio.create_task(one_request(session, base, traffic, stats, kind))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    if tasks:
        _, pending = await asyncio.wait(list(tasks), timeout=drain_timeout)
        for t in pending:
            t.cancel()
        for _ in pending:
            stats.record("?", "cancelled at drain", "still running at the drain timeout",
                         None, None)
        return len(pending)
    return 0


# ---------------------------------------------------------------------------------------
# Process and EPP observations


def proc_tree(pid: int) -> list[int]:
    out = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for c in children:
        out += proc_tree(int(c))
    return out


def rss_kb(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    break
        except OSError:
            continue
    return total


def metric_sums(text: str, names: tuple[str, ...]) -> dict[str, Any]:
    """Sum of each named metric's samples; ``epp_extproc_streams_total`` by outcome."""
    out: dict[str, Any] = {n: None for n in names}
    streams: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
        if name in out:
            out[name] = (out[name] or 0.0) + value
        elif name == "epp_extproc_streams_total":
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0] if 'outcome="' in line \
                else "?"
            streams[outcome] = streams.get(outcome, 0.0) + value
    out["extproc_streams"] = {k: int(v) for k, v in sorted(streams.items())}
    return out


INDEX = "inference_extension_prefix_indexer_size"
RUNNING = "inference_objective_running_requests"


async def epp_metrics(session: aiohttp.ClientSession, port: int) -> dict[str, Any]:
    try:
        async with session.get(f"http://127.0.0.1:{port}/metrics",
                               timeout=aiohttp.ClientTimeout(total=10)) as r:
            text = await r.text()
    except (TimeoutError, aiohttp.ClientError) as e:
        return {INDEX: None, RUNNING: None, "extproc_streams": {},
                "metrics_error": type(e).__name__}
    return metric_sums(text, (INDEX, RUNNING))


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


@dataclass
class Procs:
    epp: ManagedProcess
    envoy: EnvoyProcess
    sims: ManagedProcess


async def take_sample(t: float, procs: Procs, stats: ClientStats, session: aiohttp.ClientSession,
                      metrics_port: int, phase: str) -> dict[str, Any]:
    assert procs.epp.pid is not None and procs.sims.pid is not None
    epp_pids = proc_tree(procs.epp.pid)
    envoy_proc = procs.envoy.process
    envoy_pids = [envoy_proc.pid] if envoy_proc is not None and envoy_proc.pid else []
    m = await epp_metrics(session, metrics_port)
    w = stats.take_window()
    return {
        "t_s": round(t, 1),
        "phase": phase,
        "epp_rss_kb": rss_kb(epp_pids),
        "epp_processes": len(epp_pids),
        "envoy_rss_kb": rss_kb(envoy_pids),
        "sim_rss_kb": rss_kb(proc_tree(procs.sims.pid)),
        "epp_cpu_s": round(cpu_s(epp_pids), 2),
        "prefix_index_size": m.get(INDEX),
        "running_requests": m.get(RUNNING),
        "extproc_streams": m.get("extproc_streams"),
        **({"metrics_error": m["metrics_error"]} if "metrics_error" in m else {}),
        "requests_started": stats.started,
        "dropped": stats.dropped,
        "window_status": dict(sorted(w.status.items())),
        "window_unexpected": sum(w.unexpected.values()),
        "latency_p50_ms": _ms(quantile(w.latency, 0.5)),
        "latency_p99_ms": _ms(quantile(w.latency, 0.99)),
        "ttft_p50_ms": _ms(quantile(w.ttft, 0.5)),
        "ttft_p99_ms": _ms(quantile(w.ttft, 0.99)),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _fmt_sample(s: dict[str, Any]) -> str:
    n = sum(s["window_status"].values())
    p50, p99 = s["latency_p50_ms"], s["latency_p99_ms"]
    lat = f"{p50:.0f}/{p99:.0f} ms" if p50 is not None and p99 is not None else "-"
    return (f"  t={s['t_s']:7.1f}s  epp {s['epp_rss_kb'] / 1024:6.1f} MiB  envoy "
            f"{s['envoy_rss_kb'] / 1024:6.1f} MiB  index {s['prefix_index_size']}  running "
            f"{s['running_requests']}  window {n} resp, {s['window_unexpected']} unexpected, "
            f"p50/p99 {lat}  load {s['loadavg_1m']}")


# ---------------------------------------------------------------------------------------
# Opt-in heap tracing of the EPP (--tracemalloc): a sitecustomize module, written into the
# run's directory and put on the EPP's PYTHONPATH only, starts tracemalloc before `epp
# serve` imports anything and writes a snapshot whenever a request file appears.

_TRACEMALLOC_HOOK = """\
import os, threading, time, tracemalloc

_dir = os.environ.get("EPP_SOAK_TRACEMALLOC_DIR")
if _dir:
    tracemalloc.start(int(os.environ.get("EPP_SOAK_TRACEMALLOC_FRAMES", "8")))

    def _serve_requests():
        pid = os.getpid()
        done = set()
        while True:
            time.sleep(0.5)
            for name in sorted(os.listdir(_dir)):
                label = name[:-4]
                if not name.endswith(".req") or label in done:
                    continue
                done.add(label)
                snap = tracemalloc.take_snapshot()
                tmp = os.path.join(_dir, f"{label}-{pid}.snap.tmp")
                snap.dump(tmp)
                os.replace(tmp, tmp[:-4])
                open(os.path.join(_dir, f"{label}-{pid}.done"), "w").close()

    threading.Thread(target=_serve_requests, daemon=True, name="soak-tracemalloc").start()
"""


def tracemalloc_env(work: Path) -> tuple[Path, dict[str, str]]:
    hook = work / "tracemalloc-hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_TRACEMALLOC_HOOK)
    snaps = work / "tracemalloc"
    snaps.mkdir()
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    return snaps, {"PYTHONPATH": path, "EPP_SOAK_TRACEMALLOC_DIR": str(snaps)}


async def request_snapshot(snaps: Path, label: str, pid: int, timeout: float = 120.0) -> bool:
    """Ask the EPP's processes for a heap snapshot ``label``; wait for process ``pid``'s."""
    (snaps / f"{label}.req").touch()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (snaps / f"{label}-{pid}.done").exists():
            return True
        await asyncio.sleep(0.25)
    return False


def snapshot_diff(snaps: Path, pid: int, before: str, after: str, top: int = 25) -> list[str]:
    """The allocation sites that grew most between two snapshots (by traceback)."""
    import tracemalloc

    a = tracemalloc.Snapshot.load(str(snaps / f"{before}-{pid}.snap"))
    b = tracemalloc.Snapshot.load(str(snaps / f"{after}-{pid}.snap"))
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__),
              tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
              tracemalloc.Filter(False, "*/sitecustomize.py")]
    a, b = a.filter_traces(ignore), b.filter_traces(ignore)
    total_a = sum(s.size for s in a.statistics("filename"))
    total_b = sum(s.size for s in b.statistics("filename"))
    lines = [(f"traced Python heap: {total_a / 2**20:.1f} MiB ({before}) -> "
              f"{total_b / 2**20:.1f} MiB ({after}), {((total_b - total_a) / 2**20):+.2f} MiB")]
    for st in b.compare_to(a, "traceback")[:top]:
        if st.size_diff <= 0:
            continue
        lines.append(f"{st.size_diff / 1024:+9.1f} KiB {st.count_diff:+7d} blocks "
                     f"(now {st.size / 1024:.1f} KiB in {st.count})")
        for fr in list(st.traceback)[-4:]:
            lines.append(f"      {fr.filename}:{fr.lineno}")
    return lines


# ---------------------------------------------------------------------------------------
# Summary


def summarize(samples: list[dict[str, Any]], stats: ClientStats, args: argparse.Namespace,
              drained_running: float | None, drain_cancelled: int,
              gauge_wait_s: float) -> dict[str, Any]:
    load = [s for s in samples if s["phase"] == "load"]
    baseline_at = min(args.baseline_at, args.duration / 4)
    base = min(load, key=lambda s: abs(s["t_s"] - baseline_at)) if load else None
    end = load[-1] if load else None
    final = samples[-1] if samples else None
    ratio = (end["epp_rss_kb"] / base["epp_rss_kb"]) if base and end and base["epp_rss_kb"] \
        else None
    env_ratio = (end["envoy_rss_kb"] / base["envoy_rss_kb"]) if base and end and \
        base["envoy_rss_kb"] else None
    # Least-squares slope of EPP RSS over the samples after the baseline (MiB per hour).
    after = [s for s in load if base is not None and s["t_s"] >= base["t_s"]]
    slope = None
    if len(after) >= 3:
        xs = [s["t_s"] for s in after]
        ys = [s["epp_rss_kb"] / 1024 for s in after]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        den = sum((x - mx) ** 2 for x in xs)
        if den:
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den * 3600
    index_sizes = [s["prefix_index_size"] for s in samples if s["prefix_index_size"] is not None]
    lat_p99 = [s["latency_p99_ms"] for s in load if s["latency_p99_ms"] is not None]
    unexpected = sum(stats.unexpected.values())
    total = sum(stats.status.values())
    return {
        "started": stats.started,
        "responses": total,
        "dropped_at_inflight_cap": stats.dropped,
        "achieved_rate": round(stats.started / args.duration, 2) if args.duration else None,
        "status": dict(sorted(stats.status.items())),
        "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(stats.by_kind.items())},
        "unexpected_errors": unexpected,
        "unexpected_by_kind": dict(sorted(stats.unexpected.items())),
        "unexpected_examples": stats.examples,
        "cancelled_at_drain": drain_cancelled,
        "baseline_t_s": base["t_s"] if base else None,
        "epp_rss_baseline_kb": base["epp_rss_kb"] if base else None,
        "epp_rss_end_kb": end["epp_rss_kb"] if end else None,
        "epp_rss_end_t_s": end["t_s"] if end else None,
        "epp_rss_after_drain_kb": final["epp_rss_kb"] if final else None,
        "epp_rss_ratio": round(ratio, 4) if ratio else None,
        "epp_rss_max_kb": max((s["epp_rss_kb"] for s in samples), default=None),
        "epp_rss_slope_mib_per_hour": round(slope, 2) if slope is not None else None,
        "rss_target_met": ratio is not None and ratio <= 1.10,
        "envoy_rss_baseline_kb": base["envoy_rss_kb"] if base else None,
        "envoy_rss_end_kb": end["envoy_rss_kb"] if end else None,
        "envoy_rss_ratio": round(env_ratio, 4) if env_ratio else None,
        "prefix_index_max": max(index_sizes) if index_sizes else None,
        "prefix_index_end": index_sizes[-1] if index_sizes else None,
        "running_after_drain": drained_running,
        "running_gauge_wait_s": round(gauge_wait_s, 1),
        "latency_p99_ms_worst_window": max(lat_p99) if lat_p99 else None,
        "epp_cpu_s": final["epp_cpu_s"] if final else None,
        "ok": unexpected == 0 and drained_running == 0,
    }


def print_summary(summary: dict[str, Any], args: argparse.Namespace, json_path: Path) -> None:
    def mb(kb: int | None) -> str:
        return "-" if kb is None else f"{kb / 1024:.1f} MiB"

    s = summary
    print(f"\nsoak: {args.duration:g}s at {args.rate:g} req/s ({args.body_mode}, "
          f"{args.response_path} response path, "
          f"{args.workers} worker(s)): {s['started']} requests started "
          f"({s['achieved_rate']} req/s), {s['dropped_at_inflight_cap']} dropped at the "
          f"in-flight cap")
    print(f"  responses by status: {s['status']}")
    ratio = s["epp_rss_ratio"]
    print(f"  EPP RSS at t={s['baseline_t_s']}s: {mb(s['epp_rss_baseline_kb'])}; at the end "
          f"(t={s['epp_rss_end_t_s']}s): {mb(s['epp_rss_end_kb'])}; ratio "
          f"{'-' if ratio is None else f'{ratio:.3f}'} (target <= 1.10: "
          f"{'met' if s['rss_target_met'] else 'NOT met'}); max {mb(s['epp_rss_max_kb'])}; "
          f"after drain {mb(s['epp_rss_after_drain_kb'])}; slope after the baseline "
          f"{s['epp_rss_slope_mib_per_hour']} MiB/h")
    print(f"  Envoy RSS: {mb(s['envoy_rss_baseline_kb'])} -> {mb(s['envoy_rss_end_kb'])} "
          f"(ratio {s['envoy_rss_ratio']})")
    print(f"  prefix index: max {s['prefix_index_max']}, at the end {s['prefix_index_end']}")
    print(f"  unexpected errors: {s['unexpected_errors']}")
    for k, v in s["unexpected_by_kind"].items():
        print(f"    {k}: {v}  e.g. {s['unexpected_examples'].get(k, '')!r}")
    print(f"  running gauge after the drain: {s['running_after_drain']} "
          f"(waited {s['running_gauge_wait_s']}s)")
    print(f"  worst window client p99: {s['latency_p99_ms_worst_window']} ms")
    print(f"  samples and summary: {json_path}")
    print("soak: OK" if s["ok"] else "soak: FAILED")


# ---------------------------------------------------------------------------------------
# Orchestration


async def main_async(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="epp-soak-"))
    json_path = Path(args.json) if args.json else work / "soak.json"
    print(f"soak: logs in {work}", flush=True)
    pod_ports = [free_port() for _ in range(PODS)]
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    endpoints = work / "endpoints.yaml"
    endpoints.write_text(yaml.safe_dump({"endpoints": [
        {"address": "127.0.0.1", "port": p, "name": f"sim-{p}"} for p in pod_ports]}))
    sim_argv = [sys.executable, "-m", "epp.cli", "sim", "--model", MODEL,
                "--num-gpu-blocks", str(args.sim_blocks)]
    for p in pod_ports:
        sim_argv += ["--port", str(p)]
    epp_argv = [sys.executable, "-m", "epp.cli", "serve", *LOCAL_SERVE_FLAGS,
                "--drain-quiet-period", "0", "--bind-address", "127.0.0.1", "--grpc-port", str(grpc_port),
                "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port),
                "--endpoints-file", str(endpoints),
                "--max-request-body-bytes", str(MAX_BODY), "--log-level", "warning"]
    if args.workers != 1:
        epp_argv += ["--workers", str(args.workers)]
    if args.config_file:
        epp_argv += ["--config-file", str(Path(args.config_file).resolve())]
    snaps: Path | None = None
    epp_env: dict[str, str] | None = None
    if args.tracemalloc:
        snaps, epp_env = tracemalloc_env(work)
    sims = ManagedProcess(sim_argv, log_path=work / "sim.log")
    epp = ManagedProcess(epp_argv, log_path=work / "epp.log", env=epp_env)
    envoy = EnvoyProcess()
    gw_port = free_port()
    procs = Procs(epp, envoy, sims)
    samples: list[dict[str, Any]] = []
    stats = ClientStats()
    baseline_at = min(args.baseline_at, args.duration / 4)
    heap: dict[str, Any] = {}

    async def snapshot(label: str) -> None:
        if snaps is None or epp.pid is None:
            return
        t = time.monotonic()
        ok = await request_snapshot(snaps, label, epp.pid)
        heap.setdefault("snapshots", []).append(
            {"label": label, "ok": ok, "seconds": round(time.monotonic() - t, 2)})
        print(f"  heap snapshot {label!r}: {'taken' if ok else 'TIMED OUT'} in "
              f"{time.monotonic() - t:.1f}s", flush=True)

    try:
        await sims.start()
        await epp.start()
        try:
            for p in [*pod_ports, grpc_port, metrics_port]:
                await wait_port("127.0.0.1", p, 30)
        except TimeoutError as e:
            print(f"soak: a process did not start ({e})\n--- epp ---\n{epp.log_tail()}\n"
                  f"--- sim ---\n{sims.log_tail()}", file=sys.stderr)
            return 2
        await envoy.start(render_envoy_config(listen_port=gw_port, epp_port=grpc_port,
                                              admin_port=free_port(), body_mode=args.body_mode,
                                              max_body_bytes=MAX_BODY,
                                              response_path=args.response_path),
                          work / "envoy", concurrency=args.envoy_workers)
        await envoy.wait_ready()
        base = f"http://127.0.0.1:{gw_port}"
        traffic = Traffic(args.seed, args.prefixes, args.long_kb)
        timeout = aiohttp.ClientTimeout(total=args.request_timeout, sock_connect=10)
        print(f"soak: gateway {base} (Envoy {args.body_mode}, response path "
              f"{args.response_path} -> EPP, {PODS} pods), "
              f"{args.rate:g} req/s for {args.duration:g}s, sample every {args.sample:g}s",
              flush=True)
        async with aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session, \
                aiohttp.ClientSession() as probe:
            # Wait (bounded) until the EPP routes: its endpoints file is read at start.
            t_ready = time.monotonic() + 30
            while True:
                try:
                    async with session.post(base + "/v1/completions", data=orjson.dumps(
                            {"model": MODEL, "prompt": "warm up", "max_tokens": 1})) as r:
                        await r.read()
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > t_ready:
                    print(f"soak: the gateway does not route\n{epp.log_tail()}", file=sys.stderr)
                    return 2
                await asyncio.sleep(0.2)
            t0 = time.monotonic()
            driver = asyncio.create_task(drive(base, traffic, stats, args.rate, args.duration,
                                               args.max_inflight, args.drain_timeout, session))
            k = 1
            while not driver.done():
                wake = t0 + k * args.sample
                if wake > t0 + args.duration + 0.5:
                    break
                await asyncio.wait([driver], timeout=max(0.0, wake - time.monotonic()))
                if driver.done():
                    break
                s = await take_sample(time.monotonic() - t0, procs, stats, probe,
                                      metrics_port, "load")
                samples.append(s)
                print(_fmt_sample(s), flush=True)
                if "base" not in heap and s["t_s"] >= baseline_at - args.sample / 2:
                    heap["base"] = s["t_s"]
                    await snapshot("base")
                if t0 + (k + 1) * args.sample > t0 + args.duration + 0.5:
                    heap["end"] = s["t_s"]
                    await snapshot("end")
                k += 1
                for p in (epp, sims):
                    if not p.running:
                        raise RuntimeError(f"{p.argv[2:4]} exited with {p.returncode}:\n"
                                           f"{p.log_tail()}")
            cancelled = await driver
            # The running gauge: Envoy ends the ext_proc streams as the requests end;
            # give it a moment, bounded.
            g0 = time.monotonic()
            running: float | None = None
            while True:
                m = await epp_metrics(probe, metrics_port)
                running = m.get(RUNNING)
                if running == 0 or time.monotonic() - g0 > 20:
                    break
                await asyncio.sleep(0.25)
            gauge_wait = time.monotonic() - g0
            s = await take_sample(time.monotonic() - t0, procs, stats, probe, metrics_port,
                                  "drained")
            samples.append(s)
            print(_fmt_sample(s), flush=True)
            await snapshot("drained")
    finally:
        await envoy.stop()
        await epp.stop()
        await sims.stop()
    summary = summarize(samples, stats, args, running, cancelled, gauge_wait)
    if snaps is not None and epp.pid is not None:
        try:
            heap["end_vs_base"] = snapshot_diff(snaps, epp.pid, "base", "end")
            heap["drained_vs_base"] = snapshot_diff(snaps, epp.pid, "base", "drained")
        except (OSError, EOFError, ValueError) as e:
            heap["error"] = f"{type(e).__name__}: {e}"
        report = snaps.parent / "tracemalloc-diff.txt"
        report.write_text("\n".join(
            [f"# end (t={heap.get('end')}s) vs base (t={heap.get('base')}s)",
             *heap.get("end_vs_base", []),
             "", "# drained vs base", *heap.get("drained_vs_base", []),
             *([heap["error"]] if "error" in heap else [])]) + "\n")
        print(f"\nheap growth, end vs base (tracemalloc; all of it in {report}):")
        print("\n".join(heap.get("end_vs_base", [heap.get("error", "")])[:40]))
    doc = {
        "benchmark": "soak",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "config": {k: v for k, v in vars(args).items()},
        "source": source_info(),
        "kinds": [{"kind": k, "weight": w, "expect": e} for k, w, e in KINDS],
        "summary": summary,
        "samples": samples,
        "workdir": str(work),
        **({"tracemalloc": heap} if snaps is not None else {}),
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=1))
    print_summary(summary, args, json_path)
    return 0 if summary["ok"] else 1


def source_info() -> dict[str, Any]:
    """Where the EPP code under test comes from (the subprocesses import the same
    ``epp``): its directory, and the git commit and changed files when it is a work tree."""
    import subprocess

    import epp

    root = Path(epp.__file__).resolve().parents[1]
    info: dict[str, Any] = {"epp_root": str(root)}
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=False)
        if head.returncode == 0:
            info["git_head"] = head.stdout.strip()
            st = subprocess.run(["git", "-C", str(root), "status", "--porcelain"],
                                capture_output=True, text=True, timeout=10, check=False)
            info["git_changed"] = st.stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=1500.0,
                    help="seconds of load (default 1500 = 25 minutes)")
    ap.add_argument("--rate", type=float, default=40.0, help="mean arrivals per second "
                    "(Poisson; default 40)")
    ap.add_argument("--sample", type=float, default=10.0, help="seconds between samples "
                    "(default 10)")
    ap.add_argument("--max-inflight", type=int, default=128,
                    help="arrivals beyond this many requests in flight are dropped "
                    "(counted; default 128)")
    ap.add_argument("--body-mode", default="FULL_DUPLEX_STREAMED", choices=list(BODY_MODES),
                    help="the ext_proc request body mode (default FULL_DUPLEX_STREAMED)")
    ap.add_argument("--response-path", default="inline", choices=list(RESPONSE_PATHS),
                    help="the gateway's response path (default inline: GIE's shape, every "
                    "response chunk through the EPP; see epp.stack.envoy)")
    ap.add_argument("--workers", type=int, default=1, help="`epp serve --workers` (default 1)")
    ap.add_argument("--envoy-workers", type=int, default=2)
    ap.add_argument("--config-file", help="EndpointPickerConfig for the EPP (default built-in)")
    ap.add_argument("--sim-blocks", type=int, default=16384,
                    help="KV blocks per simulated pod; the prefix index auto-tunes to this "
                    "many entries per pod (default 16384)")
    ap.add_argument("--prefixes", type=int, default=48,
                    help="shared system prompts (1-4 KB each; default 48)")
    ap.add_argument("--long-kb", type=int, default=100, help="size of the long bodies in KB "
                    "(default 100)")
    ap.add_argument("--baseline-at", type=float, default=300.0,
                    help="the RSS baseline sample's time in seconds (default 300 = minute "
                    "5; at most a quarter of --duration)")
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--drain-timeout", type=float, default=60.0,
                    help="after the load, wait at most this long for in-flight requests")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write samples and summary here (default: soak.json in "
                    "the run's temporary directory)")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="trace the EPP's Python heap (tracemalloc, 8 frames; slows it "
                    "down): snapshots at the baseline, the end of the load and after the "
                    "drain, and the allocation sites that grew most, printed and written "
                    "to tracemalloc-diff.txt in the run's directory")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 15 s at 25 req/s, a sample every 3 s")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.rate, args.sample = 15.0, 25.0, 3.0
    if args.duration <= 0 or args.rate <= 0 or args.sample <= 0:
        ap.error("--duration, --rate and --sample must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(main_async(args))
    except KeyboardInterrupt:
        print("soak: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
