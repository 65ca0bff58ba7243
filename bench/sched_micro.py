"""Scheduling micro-benchmark: one scheduling cycle of the default config, timed.

``Scheduler.schedule`` of ``load_and_build()`` (the built-in default: queue-scorer 2,
kv-cache-utilization-scorer 2, prefix-cache-scorer 3, max-score-picker) over N endpoints,
for prompts of T tokens (4 characters per token). Each cycle gets a fresh request, so
hashing the prompt is part of the cycle, as in the EPP. After each cycle the Director's
``pre_request`` runs (not timed: the index fills as in production) and the request's
``response_complete`` releases its in-flight count. Prompts share one of 32 prefixes
(90 % of the prompt) so the index has real matches; endpoint metrics (queue, running, KV
usage) vary between 16 pre-built snapshots. Nothing touches the network.

    .venv/bin/python -m bench.sched_micro                       # the full grid
    .venv/bin/python -m bench.sched_micro --endpoints 100 --tokens 8192 --cycles 5000
    .venv/bin/python -m bench.sched_micro --smoke              # seconds, for CI

Prints p50 / p99 / max per (endpoints, tokens) and checks the target: p99 <= 1 ms at
100 endpoints with 8k-token prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from epp.config.loader import load_and_build
from epp.scheduling.types import ApiType, Endpoint, LLMRequest, Metrics

TARGET_P99_MS = 1.0
TARGET_AT = (100, 8192)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _text(rng: random.Random, tokens: int) -> str:
    """``tokens`` three-letter words: 4 characters per token."""
    c = rng.choice
    return " ".join(c(_LETTERS) + c(_LETTERS) + c(_LETTERS) for _ in range(tokens))


def _snapshots(n: int, rng: random.Random, count: int = 16) -> list[tuple[Endpoint, ...]]:
    out = []
    for _ in range(count):
        out.append(tuple(
            Endpoint(f"pod-{i}", "127.0.0.1", 20000 + i, metrics=Metrics(
                waiting_queue_size=rng.randrange(0, 8), running_requests=rng.randrange(0, 32),
                kv_cache_usage=rng.random(), block_size=16, num_blocks=65536,
                updated_at=time.monotonic()))
            for i in range(n)))
    return out


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(endpoints: int, tokens: int, cycles: int, warmup: int, seed: int = 1
            ) -> dict[str, Any]:
    rng = random.Random(seed)
    built = load_and_build()
    scheduler = built.scheduler
    snaps = _snapshots(endpoints, rng)
    prefix_len = int(tokens * 0.9)
    prefixes = [_text(rng, prefix_len) for _ in range(32)]
    suffixes = [_text(rng, tokens - prefix_len) for _ in range(64)]
    times: list[float] = []
    pre: list[float] = []
    for i in range(warmup + cycles):
        req = LLMRequest(request_id=f"r{i}", target_model="m", incoming_model="m",
                         api=ApiType.CHAT_COMPLETIONS,
                         prompt=prefixes[rng.randrange(32)] + " " + suffixes[i % 64] + f" {i}",
                         headers={})
        cands = snaps[i % len(snaps)]
        t0 = time.perf_counter()
        result = scheduler.schedule(req, cands)
        t1 = time.perf_counter()
        for p in built.pre_request:
            p.pre_request(req, result)
        t2 = time.perf_counter()
        key = result.primary.endpoints[0].key
        for p in built.response_complete:
            p.response_complete(req, key, False)
        if i >= warmup:
            times.append(t1 - t0)
            pre.append(t2 - t1)
    ms = [1000 * t for t in times]
    return {"endpoints": endpoints, "tokens": tokens, "cycles": cycles,
            "p50_ms": quantile(ms, 0.5), "p99_ms": quantile(ms, 0.99), "max_ms": max(ms),
            "pre_request_p50_ms": 1000 * quantile(pre, 0.5)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoints", type=int, action="append",
                    help="endpoint counts (repeatable; default 10, 100, 1000)")
    ap.add_argument("--tokens", type=int, action="append",
                    help="prompt tokens (repeatable; default 1024, 8192, 65536)")
    ap.add_argument("--cycles", type=int, default=0,
                    help="measured cycles per cell (default: 3000, 1000 at 1,000 endpoints)")
    ap.add_argument("--warmup", type=int, default=200, help="unmeasured cycles first")
    ap.add_argument("--smoke", action="store_true", help="a few cycles per cell (CI)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    eps = args.endpoints or [10, 100, 1000]
    toks = args.tokens or [1024, 8192, 65536]
    rows = []
    print(f"{'endpoints':>9} {'tokens':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'pre_request p50':>16}")
    for n in eps:
        for t in toks:
            cycles = args.cycles or (3000 if n < 1000 else 1000)
            warmup = args.warmup
            if args.smoke:
                cycles, warmup = 50, 10
            r = measure(n, t, cycles, warmup)
            rows.append(r)
            print(f"{n:9d} {t:7d} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['max_ms']:8.3f} "
                  f"{r['pre_request_p50_ms']:13.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    for r in rows:
        if (r["endpoints"], r["tokens"]) == TARGET_AT:
            met = r["p99_ms"] <= TARGET_P99_MS
            print(f"target: p99 <= {TARGET_P99_MS} ms at {TARGET_AT[0]} endpoints, "
                  f"{TARGET_AT[1]}-token prompts: {r['p99_ms']:.3f} ms -> "
                  f"{'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
