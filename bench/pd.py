"""P/D benchmark: aggregated vs prefill/decode disaggregation on long prompts, and P/D with
topology-aware vs topology-blind pairing. Everything through real Envoy and `epp serve`.

Scenarios (each on a fresh stack, so caches start cold; two racks of one block):

- ``aggregated``: 8 `both` pods (4 per rack), GIE's default scheduling (queue 2, KV
  cache 2, prefix 3; :data:`AGGREGATED_CONFIG`);
- ``pd-aware``: 2 prefill + 2 decode pods per rack, config/pd-grove.yaml without its
  active-request-scorer (always disaggregate; topology-affinity-scorer pairs each decode
  pod with a close prefill pod);
- ``pd-blind``: the same pods and config without topology-affinity-scorer;
- ``pd-aware-active``: config/pd-grove.yaml as shipped: pd-aware plus active-request-scorer
  (weight 2) in the prefill profile (balances prefill pods whose prefills run batched, so
  never queue).

Pods use epp.stack.pd.PD_SIM_ARGS (0.05 ms per prompt token, 5 ms decode steps, KV
transfer 0.002 ms/token within a rack, 0.01 across racks; --block-cost changes the latter). The workload is closed-loop
streamed one-turn chat with long prompts (a --prompt-words system prompt of its own per
request, so no prefix reuse; or one of --prompts shared ones) and --max-tokens output
tokens. Reports, per
scenario: throughput, TTFT p50/p90, inter-token latency p50 (per request: time after the
first token / (tokens − 1)), latency p50, errors, and for P/D the share of same-rack pairs
(from the decode pods' counters).

    .venv/bin/python -m bench.pd --duration 20 --concurrency 8 --concurrency 16
    .venv/bin/python -m bench.pd --smoke          # a few seconds per scenario
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from epp.stack.pd import MODEL, PD_SIM_ARGS, PairStats, PdStack, grove_layout, repo_config
from epp.stack.runner import Report, run
from epp.stack.workload import Conversation, Workload, WorkloadSpec

SCENARIOS = ("aggregated", "pd-aware", "pd-blind", "pd-aware-active")
_WORDS = ("cluster", "replica", "token", "cache", "request", "queue", "budget", "region",
          "policy", "tenant", "model", "adapter", "prompt", "batch", "gateway", "endpoint")


class LongPrompts(Workload):
    """One-turn conversations, each with its own long system prompt (``unique``), or one
    of ``spec.system_prompts`` shared ones."""

    def __init__(self, spec: WorkloadSpec, model: str, unique: bool) -> None:
        if unique:  # no shared prompts to generate
            spec = dataclasses.replace(spec, system_prompts=1)
        super().__init__(spec, model)
        self.unique = unique
        self._n = 0

    def new_conversation(self) -> Conversation:
        if not self.unique:
            return super().new_conversation()
        self._n += 1
        rng = self._rng
        text = f"Document {self._n}: " + " ".join(
            rng.choice(_WORDS) for _ in range(self.spec.system_prompt_words))
        return Conversation(0, [{"role": "system", "content": text}])


def blind_config() -> str:
    """config/pd-grove.yaml without topology-affinity-scorer (and without the
    active-request-scorer it now carries, as the topology-blind baseline was measured)."""
    doc = yaml.safe_load(repo_config("pd-grove.yaml").read_text())
    drop = {"topology-affinity-scorer", "active-request-scorer"}
    names = {p.get("name", p["type"]) for p in doc["plugins"] if p["type"] in drop}
    doc["plugins"] = [p for p in doc["plugins"] if p["type"] not in drop]
    for prof in doc["schedulingProfiles"]:
        prof["plugins"] = [r for r in prof["plugins"] if r["pluginRef"] not in names]
    return str(yaml.safe_dump(doc, sort_keys=False))


def aware_config() -> str:
    """config/pd-grove.yaml without active-request-scorer (topology pairing + load only)."""
    doc = yaml.safe_load(repo_config("pd-grove.yaml").read_text())
    names = {p.get("name", p["type"]) for p in doc["plugins"]
             if p["type"] == "active-request-scorer"}
    doc["plugins"] = [p for p in doc["plugins"] if p["type"] != "active-request-scorer"]
    for prof in doc["schedulingProfiles"]:
        prof["plugins"] = [r for r in prof["plugins"] if r["pluginRef"] not in names]
    return str(yaml.safe_dump(doc, sort_keys=False))


def active_config() -> str:
    """config/pd-grove.yaml with active-request-scorer (weight 2) in the prefill profile:
    the EPP's own in-flight count reacts at once, where the scraped queue of a prefill pod
    stays 0 while its prefills all run (batched) rather than wait."""
    doc = yaml.safe_load(repo_config("pd-grove.yaml").read_text())
    if not any(p["type"] == "active-request-scorer" for p in doc["plugins"]):
        doc["plugins"].append({"type": "active-request-scorer"})
    for prof in doc["schedulingProfiles"]:
        if prof["name"] == "prefill" and not any(
                r["pluginRef"] == "active-request-scorer" for r in prof["plugins"]):
            prof["plugins"].insert(-1, {"pluginRef": "active-request-scorer", "weight": 2})
    return str(yaml.safe_dump(doc, sort_keys=False))


AGGREGATED_CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: max-score-picker}
"""
"""GIE's default scheduling (queue 2, KV cache 2, prefix 3), spelled out so the
aggregated baseline does not move with the EPP's built-in default."""


def sim_args(block_cost: float | None) -> dict[str, tuple[str, ...]]:
    args = dict(PD_SIM_ARGS)
    if block_cost is not None:  # later --kv-transfer-cost items override earlier ones
        args["decode"] = (*args["decode"], "--kv-transfer-cost", f"block={block_cost:g}")
    return args


def stack_for(name: str, workdir: Path, block_cost: float | None) -> PdStack:
    if name == "aggregated":
        layout = grove_layout(prefill_per_rack=0, decode_per_rack=0, both_per_rack=4,
                              sim_args=sim_args(block_cost))
        return PdStack(workdir, layout, config_text=AGGREGATED_CONFIG)
    layout = grove_layout(sim_args=sim_args(block_cost))
    if name == "pd-aware":
        return PdStack(workdir, layout, config_text=aware_config())
    if name == "pd-aware-active":
        return PdStack(workdir, layout, config_text=active_config())
    return PdStack(workdir, layout, config_text=blind_config())


def q(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def row(name: str, concurrency: int, rep: Report, pairs: PairStats, max_tokens: int) -> dict[str, Any]:
    ok = rep.ok
    itl = [(r.latency_s - r.ttft_s) / (max_tokens - 1) for r in ok] if max_tokens > 1 else []
    return {
        "scenario": name, "concurrency": concurrency, "requests_ok": len(ok),
        "errors": len(rep.results) - len(ok), "elapsed_s": rep.elapsed_s,
        "throughput_rps": rep.throughput,
        "ttft_p50_ms": 1000 * rep.quantile("ttft_s", 0.5),
        "ttft_p90_ms": 1000 * rep.quantile("ttft_s", 0.9),
        "itl_p50_ms": 1000 * q(itl, 0.5),
        "latency_p50_ms": 1000 * rep.quantile("latency_s", 0.5),
        "remote_prefills": pairs.remote_prefills,
        "same_rack_share": pairs.same_rack_share,
        "by_distance": dict(pairs.by_distance),
    }


async def one(name: str, args: argparse.Namespace, concurrency: int, root: Path) -> dict[str, Any]:
    stack = stack_for(name, root / f"{name}-c{concurrency}", args.block_cost)
    await stack.start()
    try:
        await asyncio.sleep(0.5)  # a few scrapes
        spec = WorkloadSpec(system_prompts=args.prompts, system_prompt_words=args.prompt_words,
                            turns_per_conversation=1, question_words=40,
                            max_tokens=args.max_tokens, seed=args.seed)
        workload = LongPrompts(spec, MODEL, unique=args.prompts == 0)
        rep = await run(stack.url, workload, label=name, concurrency=concurrency,
                        max_requests=args.requests, duration_s=args.duration)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            pairs = await stack.pair_stats(s)
        return row(name, concurrency, rep, pairs, args.max_tokens)
    finally:
        await stack.stop()


def fmt(rows: list[dict[str, Any]]) -> str:
    out = [("| scenario | conc. | OK | req/s | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | "
            "latency p50 ms | same-rack pairs | errors |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = r["same_rack_share"]
        share_s = "–" if math.isnan(share) else f"{100 * share:.1f}%"
        out.append(f"| {r['scenario']} | {r['concurrency']} | {r['requests_ok']} | "
                   f"{r['throughput_rps']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} "
                   f"| {r['itl_p50_ms']:.1f} | {r['latency_p50_ms']:.0f} | {share_s} | "
                   f"{r['errors']} |")
    return "\n".join(out)


async def main_async(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="epp-bench-pd-"))
    print(f"bench.pd: logs in {root}", flush=True)
    rows = []
    for concurrency in args.concurrency or [16]:
        for name in args.scenario or SCENARIOS:
            print(f"  {name} at concurrency {concurrency} ...", flush=True)
            rows.append(await one(name, args, concurrency, root))
            print("    " + fmt([rows[-1]]).splitlines()[-1], flush=True)
    print()
    print(fmt(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["errors"] == 0 and r["requests_ok"] > 0 for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", action="append", choices=SCENARIOS,
                   help="run only these (repeatable; default all)")
    p.add_argument("--concurrency", action="append", type=int,
                   help="closed-loop users (repeatable; default 16)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per scenario")
    p.add_argument("--requests", type=int, default=100000, help="at most this many per scenario")
    p.add_argument("--prompt-words", type=int, default=3000, help="system prompt length (words "
                   "= tokens in the simulator)")
    p.add_argument("--prompts", type=int, default=0, help="distinct shared system prompts "
                   "(default 0: every request has its own, no prefix reuse)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--block-cost", type=float, default=None, metavar="MS",
                   help="KV-transfer cost per token between racks (same block); default "
                   "0.01 (PD_SIM_ARGS)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="also write the rows as JSON here")
    p.add_argument("--smoke", action="store_true", help="3 s per scenario, concurrency 4")
    args = p.parse_args(argv)
    if args.smoke:
        args.duration, args.concurrency = 3.0, [4]
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
