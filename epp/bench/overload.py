"""``epp bench --workload overload``: admission under overload, side by side.

Two scenarios ("variants"), each played open loop through every router on the same
fresh pods (docs/benchmarks.md, "Overload: flow control"):

- ``priority``: tenant A, interactive (InferenceObjective priority 10, short prompts),
  alone at 50 % of the pool's capacity (its baseline), then tenant B, batch (priority
  -1: sheddable), joins at 150 %, so the pool is offered 2× its capacity. Reported: A's
  TTFT p50/p90 in both phases and their ratio; B's requests dispatched, queued in the
  EPP, rejected and evicted.
- ``fair``: two equal tenants (priority 0) at 100 % each (2× together). Reported: each
  one's share of the dispatches.

Requests carry GIE's headers: the fairness ID (``x-gateway-inference-fairness-id``, the
tenant) and the objective (``x-gateway-inference-objective``, whose priority the EPP reads
from the objectives file the bench writes and passes with ``--objectives-file``).

Routers: ``epp-flow-control`` (the built-in default scheduling config plus GIE's
``flowControl`` feature gate, a ``concurrency-detector`` that counts the pool saturated
when the EPP has ``max-num-seqs`` requests in flight per pod — exactly the pods' batch —
and bounded priority bands with a TTL), ``epp-legacy`` (the same config without the gate:
GIE's legacy admission, sheddable requests rejected with 429 while saturated), and
``round-robin`` (Envoy alone); ``random`` and ``epp=FILE`` may be added.

**Capacity** is computed from the simulator's configuration, not measured: with the
batch full (``max-num-seqs``), a request of ``u`` prompt and ``n`` output tokens costs a
pod ``u·prefill_ms_per_token + n·(decode_per_seq_ms + decode_base_ms / batch)`` ms (the
model of :func:`epp.bench.traces.capacity`; prompts here share nothing, so the cold
cost is the cost), and the pool has ``1000 × pods`` pod-ms per second. A tenant at load
``L`` sends ``L × 1000 × pods / cost`` requests per second (Poisson).

Accounting: every request sent ends as a 200 (dispatched), a 429 (rejected), a 503
(evicted), another status, or no status at all (lost: connection error, or still
unanswered when the drain ran out). From the EPP, under flow control, the outcome counts
of ``inference_extension_flow_control_request_queue_duration_seconds`` per fairness ID
must add up to the requests sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from epp import keys
from epp.bench.quality import RouterSpec, Stack
from epp.bench.traces import OVERLOAD_WORKLOAD, SimCosts, words
from epp.config.loader import DEFAULT_CONFIG_TEXT
from epp.sim.config import SimConfig
from epp.sim.options import build_parser, config_from_args
from epp.stack.runner import Result, stream_chat

WORKLOAD: Final = OVERLOAD_WORKLOAD
VARIANTS: Final = ("priority", "fair")
ROUTERS: Final = ("epp-flow-control", "epp-legacy", "round-robin", "random")
DEFAULT_ROUTERS: Final = "epp-flow-control,epp-legacy,round-robin"
MODEL: Final = "sim-model"

#: The pods: docs/simulator.md's realistic step costs, a batch of 16 sequences, a chunked-
#: prefill budget of 1,024 tokens per step (a batch job's long prompt is computed over a
#: few steps instead of stalling one for 50 ms), a KV pool that never binds (the batch
#: does), and every duration doubled (half the requests per second for the same model,
#: so the two cores keep up at 2x overload).
SIM_ARGS: Final = ("--prefill-ms-per-token 0.05 --decode-base-ms 10 --decode-per-seq-ms 0.1 "
                   "--max-num-seqs 16 --max-num-batched-tokens 1024 --num-gpu-blocks 8192 "
                   "--time-scale 2")
#: ``--smoke``: a batch of 4, tiny requests, durations × 4 (about 40 requests/s at 2x).
SMOKE_SIM_ARGS: Final = ("--prefill-ms-per-token 0.05 --decode-base-ms 10 "
                         "--decode-per-seq-ms 0.1 --max-num-seqs 4 --num-gpu-blocks 1024 "
                         "--time-scale 4")

# Targets (issue 16).
TARGET_TTFT_P90_RATIO: Final = 1.5
TARGET_SHARE: Final = 0.5
TARGET_SHARE_TOLERANCE: Final = 0.05

#: A request that waited at least this long in the EPP's flow-control queue counts as
#: queued (a bucket bound of GIE's queue-duration histogram; one dispatched at once
#: spends microseconds there).
QUEUED_BUCKET_S: Final = 0.001
QUEUE_DURATION: Final = "inference_extension_flow_control_request_queue_duration_seconds"
DISPATCHED: Final = "Dispatched"
REJECTED_OUTCOMES: Final = ("RejectedCapacity", "RejectedOther")
EVICTED_OUTCOMES: Final = ("EvictedTTL", "EvictedContextCancelled", "EvictedOther")


# ----------------------------------------------------------------- scenario


@dataclass(frozen=True, slots=True)
class Tenant:
    """One client population: its fairness ID, objective and request shape."""

    name: str
    """The fairness ID (``x-gateway-inference-fairness-id``)."""
    objective: str
    """The InferenceObjective it names (``x-gateway-inference-objective``)."""
    priority: int
    """That objective's priority (negative: sheddable)."""
    prompt_tokens: int
    max_tokens: int
    role: str = ""
    """What it stands for, for the report (``interactive``, ``batch`` ...)."""

    def headers(self) -> dict[str, str]:
        return {keys.HEADER_FAIRNESS_ID: self.name, keys.HEADER_OBJECTIVE: self.objective}


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    duration_s: float
    loads: tuple[tuple[str, float], ...]
    """(tenant name, fraction of the pool's capacity it offers) for each tenant sending."""


@dataclass(frozen=True, slots=True)
class Scenario:
    variant: str
    tenants: tuple[Tenant, ...]
    phases: tuple[Phase, ...]

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def tenant(self, name: str) -> Tenant:
        for t in self.tenants:
            if t.name == name:
                return t
        raise KeyError(name)

    def phase_start(self, name: str) -> float:
        t = 0.0
        for p in self.phases:
            if p.name == name:
                return t
            t += p.duration_s
        raise KeyError(name)


TENANT_A: Final = Tenant("tenant-a", "interactive", 10, 256, 16, "interactive")
TENANT_B: Final = Tenant("tenant-b", "batch", -1, 1024, 128, "batch")
TENANT_C: Final = Tenant("tenant-c", "standard", 0, 512, 64, "equal")
TENANT_D: Final = Tenant("tenant-d", "standard", 0, 512, 64, "equal")
SMOKE_TENANTS: Final = {
    "tenant-a": Tenant("tenant-a", "interactive", 10, 32, 4, "interactive"),
    "tenant-b": Tenant("tenant-b", "batch", -1, 128, 16, "batch"),
    "tenant-c": Tenant("tenant-c", "standard", 0, 64, 8, "equal"),
    "tenant-d": Tenant("tenant-d", "standard", 0, 64, 8, "equal"),
}


def scenarios(*, baseline_s: float, overload_s: float, baseline_load: float = 0.5,
              factor: float = 2.0, smoke: bool = False) -> dict[str, Scenario]:
    """The two variants. ``priority``: A alone at ``baseline_load`` for ``baseline_s``,
    then A at the same load plus B at ``factor - baseline_load`` for ``overload_s``.
    ``fair``: C and D at ``factor / 2`` each for ``overload_s``."""
    if not baseline_s > 0 or not overload_s > 0:
        raise ValueError("the baseline and overload phases must last > 0 s")
    if not 0 < baseline_load < factor:
        raise ValueError(f"the baseline load ({baseline_load:g}) must be > 0 and below the "
                         f"overload factor ({factor:g})")
    a, b, c, d = ((SMOKE_TENANTS[t.name] if smoke else t)
                  for t in (TENANT_A, TENANT_B, TENANT_C, TENANT_D))
    return {
        "priority": Scenario("priority", (a, b), (
            Phase("baseline", baseline_s, ((a.name, baseline_load),)),
            Phase("overload", overload_s, ((a.name, baseline_load),
                                           (b.name, factor - baseline_load))))),
        "fair": Scenario("fair", (c, d), (
            Phase("overload", overload_s, ((c.name, factor / 2), (d.name, factor / 2))),)),
    }


def costs_of(cfg: SimConfig) -> SimCosts:
    """The pods' costs in wall-clock milliseconds (model costs × ``time_scale``)."""
    return SimCosts(cfg.prefill_ms_per_token * cfg.time_scale,
                    cfg.decode_base_ms * cfg.time_scale,
                    cfg.decode_per_seq_ms * cfg.time_scale, cfg.max_num_seqs,
                    cfg.num_gpu_blocks, cfg.block_size)


def pod_ms(prompt_tokens: int, max_tokens: int, costs: SimCosts) -> float:
    """Pod time one request costs with the batch at its largest (cold prompt)."""
    per_seq_blocks = max(1, math.ceil((prompt_tokens + max_tokens) / costs.block_size))
    batch = max(1, min(costs.max_num_seqs, costs.num_gpu_blocks // per_seq_blocks))
    return (prompt_tokens * costs.prefill_ms_per_token
            + max_tokens * (costs.decode_per_seq_ms + costs.decode_base_ms / batch))


def tenant_rate(tenant: Tenant, load: float, costs: SimCosts, servers: int) -> float:
    """Requests/s that make ``tenant`` offer ``load`` × the pool's capacity."""
    ms = pod_ms(tenant.prompt_tokens, tenant.max_tokens, costs)
    return load * servers * 1000.0 / ms if ms > 0 else float("inf")


def rates(scenario: Scenario, costs: SimCosts, servers: int) -> dict[str, dict[str, float]]:
    """phase → tenant → requests/s."""
    return {p.name: {name: tenant_rate(scenario.tenant(name), load, costs, servers)
                     for name, load in p.loads} for p in scenario.phases}


@dataclass(frozen=True, slots=True)
class OverloadRequest:
    index: int
    at: float
    """Planned send time, seconds from the start of the variant."""
    tenant: str
    phase: str
    prompt: str
    max_tokens: int

    def body(self, model: str) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": self.prompt}],
                "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": self.max_tokens}


def _poisson(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    out: list[float] = []
    if not rate > 0:
        return out
    t = start + rng.expovariate(rate)
    while t < end:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def make_overload_trace(scenario: Scenario, costs: SimCosts, servers: int, *,
                        seed: int = 1) -> list[OverloadRequest]:
    """The variant's requests in send order: per phase and tenant, Poisson arrivals at
    :func:`tenant_rate`; every prompt is new random words (nothing cached). Deterministic
    for a seed."""
    rng = random.Random(f"epp-bench:{WORKLOAD}:{scenario.variant}:{seed}")
    drafts: list[tuple[float, str, str]] = []
    start = 0.0
    for phase in scenario.phases:
        for name, load in phase.loads:
            rate = tenant_rate(scenario.tenant(name), load, costs, servers)
            drafts += [(t, name, phase.name)
                       for t in _poisson(rng, rate, start, start + phase.duration_s)]
        start += phase.duration_s
    drafts.sort(key=lambda d: d[0])
    out = []
    for i, (at, name, phase_name) in enumerate(drafts):
        t = scenario.tenant(name)
        out.append(OverloadRequest(i, at, name, phase_name, words(rng, t.prompt_tokens),
                                   t.max_tokens))
    return out


def parse_variants(text: str) -> list[str]:
    """``priority,fair`` → the variants, in the order given."""
    variants = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"unknown variant {', '.join(bad) or '(none given)'}; expected "
                         f"{' and/or '.join(VARIANTS)}")
    return variants


# ----------------------------------------------------------------- configs


def objectives_yaml(tenants: Sequence[Tenant]) -> str:
    """The objectives file (GIE's InferenceObjective documents) naming each tenant's
    objective and priority, for ``epp serve --objectives-file``."""
    seen: dict[str, int] = {}
    for t in tenants:
        if seen.setdefault(t.objective, t.priority) != t.priority:
            raise ValueError(f"objective {t.objective!r} is given two priorities")
    docs = [{"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
             "kind": "InferenceObjective", "metadata": {"name": name},
             "spec": {"priority": prio}} for name, prio in seen.items()]
    return str(yaml.safe_dump_all(docs, sort_keys=False))


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """The flow-control section's bounds (``epp-flow-control``)."""

    ttl_s: float
    sheddable_requests: int
    """``maxRequests`` of the sheddable band (B's)."""
    standard_requests: int
    """``maxRequests`` of band 0 (the equal tenants')."""


def queue_limits(costs: SimCosts, servers: int, ttl_s: float) -> QueueLimits:
    """One pool-batch of waiting sheddable requests, two of priority 0."""
    slots = costs.max_num_seqs * servers
    return QueueLimits(ttl_s, slots, 2 * slots)


HOLDBACK_MIN_CEILING = 0.4


def router_config(costs: SimCosts, *, flow_control: bool, limits: QueueLimits,
                  high_priority: int = TENANT_A.priority,
                  sheddable_priority: int = TENANT_B.priority) -> str:
    """The built-in default config plus a saturation detector that counts the pool
    saturated when the EPP has ``max_num_seqs`` requests in flight per pod (the pods'
    batch: any more would wait in a pod's queue); with ``flow_control``, GIE's feature
    gate and a ``flowControl`` section (TTL, round-robin fairness, bounded bands)."""
    doc = yaml.safe_load(DEFAULT_CONFIG_TEXT)
    plugins: list[dict[str, Any]] = doc["plugins"]
    plugins.append({"type": "concurrency-detector",
                    "parameters": {"maxConcurrency": costs.max_num_seqs}})
    doc["saturationDetector"] = {"pluginRef": "concurrency-detector"}
    if flow_control:
        doc = {"apiVersion": doc.pop("apiVersion"), "kind": doc.pop("kind"),
               "featureGates": ["flowControl"], **doc}
        doc["plugins"].append({"type": "round-robin-fairness-policy"})
        # llm-d's priority-holdback-policy: lower bands stop dispatching at lower pool
        # saturation (the lowest at 40 %), so the highest band always finds free batch
        # slots; GIE's static-usage-limit-policy gives every band the same ceiling.
        doc["plugins"].append({"type": "priority-holdback-policy",
                               "parameters": {"minCeiling": HOLDBACK_MIN_CEILING}})
        rr = "round-robin-fairness-policy"
        doc["flowControl"] = {
            "usageLimitPolicyPluginRef": "priority-holdback-policy",
            "defaultRequestTTL": f"{int(limits.ttl_s * 1000)}ms",
            "defaultPriorityBand": {"fairnessPolicyRef": rr},
            "priorityBands": [
                {"priority": high_priority, "fairnessPolicyRef": rr},
                {"priority": 0, "fairnessPolicyRef": rr,
                 "maxRequests": limits.standard_requests},
                {"priority": sheddable_priority, "fairnessPolicyRef": rr,
                 "maxRequests": limits.sheddable_requests},
            ],
        }
    head = ("# Written by `epp bench --workload overload` "
            + ("(router epp-flow-control)" if flow_control else "(router epp-legacy)")
            + ": the built-in default config plus\n# a concurrency-detector at the pods' "
            "batch (max-num-seqs)"
            + (", GIE's flowControl feature gate and section.\n" if flow_control
               else "; no flow control: GIE's legacy admission.\n"))
    return head + str(yaml.safe_dump(doc, sort_keys=False))


@dataclass(frozen=True, slots=True)
class OverloadRouter:
    kind: str
    """``epp``, ``round-robin`` or ``random`` (as :class:`epp.bench.quality.RouterSpec`)."""
    label: str
    config: str | None = None
    flow_control: bool = False


def parse_routers(text: str, config_dir: Path | None = None) -> list[OverloadRouter]:
    """``epp-flow-control,epp-legacy,round-robin[,random][,epp=FILE]``; the first two
    use the configs the bench writes into ``config_dir`` (``flow-control.yaml``,
    ``legacy.yaml``)."""
    out: list[OverloadRouter] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        kind, _, path = item.partition("=")
        if kind == "epp" and path:
            cfg = Path(path).resolve()
            fc = "flowControl" in (yaml.safe_load(cfg.read_text()) or {}).get(
                "featureGates", []) if cfg.exists() else False
            out.append(OverloadRouter("epp", f"epp:{cfg.stem}", str(cfg), fc))
        elif kind in ("epp-flow-control", "epp-legacy") and not path:
            name = "flow-control.yaml" if kind == "epp-flow-control" else "legacy.yaml"
            cfg_path = str((config_dir or Path(".")) / name)
            out.append(OverloadRouter("epp", kind, cfg_path, kind == "epp-flow-control"))
        elif kind in ("round-robin", "random") and not path:
            out.append(OverloadRouter(kind, kind))
        else:
            raise ValueError(f"unknown router {item!r} for --workload {WORKLOAD}; expected "
                             f"{', '.join(ROUTERS)} or epp=CONFIG_FILE")
    labels = [r.label for r in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a router is named twice: {text!r}")
    if not out:
        raise ValueError("no router given")
    return out


# ----------------------------------------------------------------- open-loop run


CUT: Final = "cut"


@dataclass(frozen=True, slots=True)
class OverloadSample:
    index: int
    tenant: str
    phase: str
    sent_at: float
    late_s: float
    """How much later than planned it was sent (the client's own lag)."""
    result: Result


Mark = tuple[float, Callable[[], Awaitable[None]]]


async def play(url: str, trace: Sequence[OverloadRequest], headers: Mapping[str, Mapping[str, str]],
               *, drain_s: float, model: str = MODEL, marks: Sequence[Mark] = (),
               progress: Callable[[int, int, float], None] | None = None
               ) -> list[OverloadSample]:
    """Send every request of ``trace`` at its planned time (open loop: whatever the
    answers), with its tenant's ``headers``; wait up to ``drain_s`` after the last send,
    then cancel what is still unanswered (status 0, error ``cut``). One sample per
    request. ``marks`` are (seconds from the start, coroutine) run on the way, e.g. a
    scrape at a phase boundary."""
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    samples: list[OverloadSample] = []
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(session: aiohttp.ClientSession, r: OverloadRequest) -> None:
        sent = loop.time() - start
        try:
            result, _ = await stream_chat(session, endpoint, r.body(model), headers[r.tenant])
        except asyncio.CancelledError:
            samples.append(OverloadSample(r.index, r.tenant, r.phase, sent,
                                          max(0.0, sent - r.at),
                                          Result(0, "", 0.0, loop.time() - start - sent,
                                                 error=CUT)))
            raise
        samples.append(OverloadSample(r.index, r.tenant, r.phase, sent, max(0.0, sent - r.at),
                                      result))

    async def at(when: float, fn: Callable[[], Awaitable[None]]) -> None:
        delay = start + when - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        await fn()

    async def ticker() -> None:
        while progress is not None:
            await asyncio.sleep(1.0)
            progress(len(samples), sum(1 for s in samples if s.result.status != 200),
                     loop.time() - start)

    end = trace[-1].at if trace else 0.0
    timeout = aiohttp.ClientTimeout(total=end + drain_s + 10)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks: list[asyncio.Task[None]] = []
        side = [asyncio.create_task(at(w, fn)) for w, fn in marks]
        tick = asyncio.create_task(ticker())
        try:
            for r in trace:
                delay = start + r.at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(session, r)))
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=drain_s)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            if side:
                await asyncio.gather(*side)
        finally:
            tick.cancel()
            for t in (*tasks, *side):
                t.cancel()
    samples.sort(key=lambda s: s.index)
    return samples


# ----------------------------------------------------------------- EPP metrics


@dataclass(slots=True)
class OutcomeStat:
    count: float = 0.0
    sum_s: float = 0.0
    waited: float = 0.0
    """Of ``count``, those that spent >= :data:`QUEUED_BUCKET_S` in the queue."""


FlowMetrics = dict[str, dict[str, OutcomeStat]]
"""fairness ID → outcome → its counts (cumulative, as scraped)."""


def parse_flow_metrics(text: str) -> FlowMetrics:
    """GIE's flow-control queue-duration histogram from a /metrics body, summed over the
    other labels (priority, pool, models)."""
    out: FlowMetrics = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != QUEUE_DURATION:
            continue
        below: dict[tuple[str, str], float] = {}
        for s in fam.samples:
            fid, outcome = s.labels.get("fairness_id", ""), s.labels.get("outcome", "")
            stat = out.setdefault(fid, {}).setdefault(outcome, OutcomeStat())
            if s.name.endswith("_count"):
                stat.count += s.value
            elif s.name.endswith("_sum"):
                stat.sum_s += s.value
            elif s.name.endswith("_bucket") and float(s.labels.get("le", "nan")) == QUEUED_BUCKET_S:
                below[(fid, outcome)] = below.get((fid, outcome), 0.0) + s.value
        for (fid, outcome), n in below.items():
            stat = out[fid][outcome]
            stat.waited = stat.count - n
    return out


def metrics_delta(after: FlowMetrics, before: FlowMetrics) -> FlowMetrics:
    out: FlowMetrics = {}
    for fid, outcomes in after.items():
        for outcome, a in outcomes.items():
            b = before.get(fid, {}).get(outcome, OutcomeStat())
            out.setdefault(fid, {})[outcome] = OutcomeStat(a.count - b.count, a.sum_s - b.sum_s,
                                                           a.waited - b.waited)
    return out


async def scrape_flow_metrics(port: int) -> FlowMetrics:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s, \
            s.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    return parse_flow_metrics(text)


POD_QUEUE_TIME: Final = "vllm:request_queue_time_seconds"


async def scrape_pod_queue(ports: Sequence[int]) -> tuple[float, float]:
    """(sum of seconds, count) of the pods' ``vllm:request_queue_time_seconds`` (arrival
    at the engine → first admission to the batch): how long requests waited *at the
    pods*, as opposed to in the EPP."""
    total = count = 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        for p in ports:
            try:
                async with s.get(f"http://127.0.0.1:{p}/metrics") as r:
                    text = await r.text()
            except (TimeoutError, aiohttp.ClientError):
                continue
            for line in text.splitlines():
                if line.startswith(POD_QUEUE_TIME + "_sum"):
                    total += float(line.rsplit(" ", 1)[1])
                elif line.startswith(POD_QUEUE_TIME + "_count"):
                    count += float(line.rsplit(" ", 1)[1])
    return total, count


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the bench reads from the stack at a moment: the EPP's flow-control outcome
    counts (None without flow control) and the pods' queue time."""

    flow: FlowMetrics | None
    pod_queue: tuple[float, float]

    def flow_delta(self, earlier: Snapshot) -> FlowMetrics | None:
        if self.flow is None or earlier.flow is None:
            return None
        return metrics_delta(self.flow, earlier.flow)

    def pod_queue_mean_ms(self, earlier: Snapshot) -> float:
        """Mean time a request admitted in between waited in a pod's queue."""
        n = self.pod_queue[1] - earlier.pod_queue[1]
        return 1000 * (self.pod_queue[0] - earlier.pod_queue[0]) / n if n > 0 else float("nan")


async def snapshot(pod_ports: Sequence[int], epp_port: int | None) -> Snapshot:
    flow = await scrape_flow_metrics(epp_port) if epp_port else None
    return Snapshot(flow, await scrape_pod_queue(pod_ports))


def epp_counts(m: FlowMetrics, tenant: str) -> dict[str, int]:
    """One tenant's flow-control outcomes: dispatched / rejected / evicted / queued
    (waited >= 1 ms, whatever the outcome) / total, and each outcome."""
    outcomes = m.get(tenant, {})

    def n(names: Sequence[str]) -> int:
        return round(sum(outcomes[o].count for o in names if o in outcomes))

    out = {"dispatched": n((DISPATCHED,)), "rejected": n(REJECTED_OUTCOMES),
           "evicted": n(EVICTED_OUTCOMES),
           "queued": round(sum(s.waited for s in outcomes.values())),
           "total": round(sum(s.count for s in outcomes.values()))}
    out.update({f"outcome:{o}": round(s.count) for o, s in sorted(outcomes.items())})
    return out


# ----------------------------------------------------------------- statistics


def quantile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (NaN for no data)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def tenant_summary(samples: Sequence[OverloadSample]) -> dict[str, Any]:
    """Client-side view of one tenant (in one phase): counts by answer, TTFT and e2e."""
    ok = [s.result for s in samples if s.result.status == 200 and not s.result.error]
    statuses = Counter(s.result.status for s in samples)
    broken = sum(1 for s in samples if s.result.status == 200 and s.result.error)
    lost = statuses.get(0, 0)
    other = len(samples) - len(ok) - statuses.get(429, 0) - statuses.get(503, 0) - lost
    ttft = [r.ttft_s for r in ok]
    out: dict[str, Any] = {
        "sent": len(samples), "ok": len(ok), "rejected_429": statuses.get(429, 0),
        "evicted_503": statuses.get(503, 0), "other_status": other, "lost": lost,
        "cut": sum(1 for s in samples if s.result.error == CUT),
        "broken_streams": broken,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "ttft_mean_ms": 1000 * statistics.fmean(ttft) if ttft else float("nan"),
        "send_lag_max_ms": 1000 * max((s.late_s for s in samples), default=0.0),
    }
    for q in (50, 90, 99):
        out[f"ttft_p{q}_ms"] = 1000 * quantile(ttft, q / 100)
    out["e2e_p50_ms"] = 1000 * quantile([r.latency_s for r in ok], 0.5)
    return out


def accounting(samples: Sequence[OverloadSample], epp: FlowMetrics | None,
               tenants: Sequence[str]) -> dict[str, Any]:
    """sent = dispatched + rejected + evicted, from the client (every request got a 200,
    429 or 503) and, under flow control, from the EPP's outcome counts per tenant."""
    c = tenant_summary(samples)
    client = {"sent": c["sent"], "dispatched": c["ok"], "rejected": c["rejected_429"],
              "evicted": c["evicted_503"], "other_status": c["other_status"],
              "lost": c["lost"]}
    client["balanced"] = (client["sent"] == client["dispatched"] + client["rejected"]
                          + client["evicted"])
    out: dict[str, Any] = {"client": client}
    if epp is not None:
        per = {t: epp_counts(epp, t) for t in tenants}
        sent = Counter(s.tenant for s in samples)
        out["epp"] = {
            "per_tenant": per,
            "sent": len(samples),
            "dispatched": sum(p["dispatched"] for p in per.values()),
            "rejected": sum(p["rejected"] for p in per.values()),
            "evicted": sum(p["evicted"] for p in per.values()),
            "balanced": all(per[t]["total"] == sent.get(t, 0) for t in tenants),
        }
    return out


def _dispatch_mean_s(m: FlowMetrics | None, tenant: str) -> float | None:
    d = m.get(tenant, {}).get(DISPATCHED) if m is not None else None
    return d.sum_s / d.count if d and d.count > 0 else None


def summarize_priority(scenario: Scenario, samples: Sequence[OverloadSample],
                       epp: FlowMetrics | None, epp_baseline: FlowMetrics | None,
                       pod_queue_ms: Mapping[str, float | None] | None = None
                       ) -> dict[str, Any]:
    """Tenant A per phase (TTFT and its overload/baseline ratio), tenant B's outcomes,
    the accounting. ``epp`` is the EPP's flow-control counts over the variant,
    ``epp_baseline`` up to the end of the baseline phase (both None without flow
    control); ``pod_queue_ms`` the pods' mean queue time per phase."""
    a, b = (t.name for t in scenario.tenants)
    by = {(t, p.name): [s for s in samples if s.tenant == t and s.phase == p.name]
          for t in (a, b) for p in scenario.phases}
    a_base = tenant_summary(by[(a, "baseline")])
    a_over = tenant_summary(by[(a, "overload")])
    b_all = tenant_summary([s for s in samples if s.tenant == b])
    out: dict[str, Any] = {
        "a": {"tenant": a, "baseline": a_base, "overload": a_over,
              "ttft_p50_ratio": _ratio(a_over["ttft_p50_ms"], a_base["ttft_p50_ms"]),
              "ttft_p90_ratio": _ratio(a_over["ttft_p90_ms"], a_base["ttft_p90_ms"]),
              "overload_ok_fraction": (a_over["ok"] / a_over["sent"] if a_over["sent"]
                                       else float("nan"))},
        "b": {"tenant": b, "sent": b_all["sent"], "dispatched": b_all["ok"],
              "queued": None, "rejected": b_all["rejected_429"],
              "evicted": b_all["evicted_503"], "other_status": b_all["other_status"],
              "lost": b_all["lost"], "ttft_p50_ms": b_all["ttft_p50_ms"],
              "ttft_p90_ms": b_all["ttft_p90_ms"]},
        "accounting": accounting(samples, epp, (a, b)),
    }
    if epp is not None:
        eb = epp_counts(epp, b)
        out["b"]["queued"] = eb["queued"]
        out["b"]["epp"] = eb
        out["a"]["epp"] = epp_counts(epp, a)
    # Time in the EPP's flow-control queue, mean of A's dispatched requests: while the
    # pool is unsaturated (baseline: the queue's own cost per request) and under overload.
    base_s = _dispatch_mean_s(epp_baseline, a)
    over_s = _dispatch_mean_s(metrics_delta(epp, epp_baseline)
                              if epp is not None and epp_baseline is not None else None, a)
    out["a"]["epp_queue_baseline_mean_us"] = None if base_s is None else 1e6 * base_s
    out["a"]["epp_queue_overload_mean_ms"] = None if over_s is None else 1e3 * over_s
    out["pod_queue_mean_ms"] = dict(pod_queue_ms or {})
    return out


#: The fair variant's shares are counted from this fraction of the overload phase on,
#: when both tenants have requests waiting (the pool fills in about a second), to its end.
FAIR_WINDOW_START: Final = 0.2


def fair_window(scenario: Scenario) -> tuple[float, float]:
    """(start, end) in seconds from the variant's start: the overload phase without its
    first :data:`FAIR_WINDOW_START`."""
    start = scenario.phase_start("overload")
    length = next(p.duration_s for p in scenario.phases if p.name == "overload")
    return start + FAIR_WINDOW_START * length, start + length


def summarize_fair(scenario: Scenario, samples: Sequence[OverloadSample],
                   epp: FlowMetrics | None, epp_window: FlowMetrics | None = None
                   ) -> dict[str, Any]:
    """Per tenant counts; ``client_shares``: each tenant's share of the requests sent in
    the overload window that were not refused (200: dispatched on arrival by a router
    without flow control); ``epp_shares``: each tenant's share of the flow controller's
    dispatches during the window (``epp_window``, a scrape delta). ``dispatch_shares``
    is the latter when there is one, else the former."""
    names = [t.name for t in scenario.tenants]
    per = {t: tenant_summary([s for s in samples if s.tenant == t]) for t in names}
    lo, hi = fair_window(scenario)
    in_window = Counter(s.tenant for s in samples if lo <= s.sent_at < hi
                        and s.result.status == 200 and not s.result.error)
    total = sum(in_window.values())
    client = {t: in_window[t] / total if total else float("nan") for t in names}
    out: dict[str, Any] = {
        "tenants": per, "window_s": [lo, hi], "client_shares": client,
        "dispatch_shares": client, "dispatch_source": "client",
        "accounting": accounting(samples, epp, names),
    }
    if epp_window is not None:
        disp = {t: epp_counts(epp_window, t)["dispatched"] for t in names}
        n = sum(disp.values())
        out["epp_window_dispatched"] = disp
        out["epp_shares"] = {t: disp[t] / n if n else float("nan") for t in names}
        out["dispatch_shares"] = out["epp_shares"]
        out["dispatch_source"] = "epp"
    return out


def verdicts(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, for every router (they are flow control's targets; the other
    routers are there for comparison)."""
    out: list[dict[str, Any]] = []
    for label, r in results.items():
        pr = r.get("priority")
        if pr:
            ratio = pr["a"]["ttft_p90_ratio"]
            out.append({"router": label, "target": "tenant A TTFT p90 under 2x overload <= "
                        f"{TARGET_TTFT_P90_RATIO:g}x its baseline p90", "value": ratio,
                        "met": not math.isnan(ratio) and ratio <= TARGET_TTFT_P90_RATIO})
            frac = pr["a"]["overload_ok_fraction"]
            out.append({"router": label, "target": "tenant B never starves tenant A (every "
                        "A request under overload answered 200)", "value": frac,
                        "met": frac == 1.0})
        fr = r.get("fair")
        if fr:
            shares = list(fr["dispatch_shares"].values())
            worst = max((abs(s - TARGET_SHARE) for s in shares), default=float("nan"))
            out.append({"router": label, "target": "equal tenants: each "
                        f"{TARGET_SHARE:.0%} +- {TARGET_SHARE_TOLERANCE:.0%} of dispatches",
                        "value": min(shares, default=float("nan")),
                        "met": not math.isnan(worst) and worst <= TARGET_SHARE_TOLERANCE + 1e-9})
        lost = 0
        balanced = True
        for v in ("priority", "fair"):
            if v in r:
                acc = r[v]["accounting"]
                lost += acc["client"]["sent"] - (acc["client"]["dispatched"]
                                                 + acc["client"]["rejected"]
                                                 + acc["client"]["evicted"])
                balanced = balanced and acc["client"]["balanced"] and acc.get(
                    "epp", {"balanced": True})["balanced"]
        out.append({"router": label, "target": "zero lost: sent = dispatched + rejected + "
                    "evicted (client; and EPP flow-control counts)", "value": lost,
                    "met": balanced})
    return out


# ----------------------------------------------------------------- output


def _ms(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.0f}"


def _x(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def _n(x: int | None) -> str:
    return "-" if x is None else str(x)


def table(report: Mapping[str, Any]) -> str:
    results: Mapping[str, Mapping[str, Any]] = report["results"]
    labels = list(results)
    w = max(14, *(len(lbl) + 2 for lbl in labels))
    lines = [(f"workload {WORKLOAD}: {report['servers']} pods, capacity computed from the "
              f"simulator's configuration ({report['sim_args']})")]
    for v, sc in report["scenarios"].items():
        for ph in sc["phases"]:
            offered = ", ".join(f"{t} {100 * load:.0f}% = {sc['rates'][ph['name']][t]:.1f} "
                                "req/s" for t, load in ph["loads"])
            lines.append(f"  {v} / {ph['name']} ({ph['duration_s']:g}s): {offered}")
    lines.append(f"{'':30}" + "".join(f"{lbl:>{w}}" for lbl in labels))
    rows: list[tuple[str, Callable[[Mapping[str, Any]], str]]] = []
    if any("priority" in r for r in results.values()):
        def p(f: Callable[[Mapping[str, Any]], str]) -> Callable[[Mapping[str, Any]], str]:
            return lambda r: f(r["priority"]) if "priority" in r else "-"
        rows += [
            ("A TTFT p50 ms, baseline", p(lambda x: _ms(x["a"]["baseline"]["ttft_p50_ms"]))),
            ("A TTFT p90 ms, baseline", p(lambda x: _ms(x["a"]["baseline"]["ttft_p90_ms"]))),
            ("A TTFT p50 ms, overload", p(lambda x: _ms(x["a"]["overload"]["ttft_p50_ms"]))),
            ("A TTFT p90 ms, overload", p(lambda x: _ms(x["a"]["overload"]["ttft_p90_ms"]))),
            ("A p50 overload/baseline", p(lambda x: _x(x["a"]["ttft_p50_ratio"]))),
            ("A p90 overload/baseline", p(lambda x: _x(x["a"]["ttft_p90_ratio"]))),
            ("A overload 200s / sent", p(lambda x: f"{x['a']['overload']['ok']}/"
                                                    f"{x['a']['overload']['sent']}")),
            ("A EPP queue us, baseline", p(lambda x: _ms(x["a"].get(
                "epp_queue_baseline_mean_us")))),
            ("A EPP queue ms, overload", p(lambda x: _ms(x["a"].get(
                "epp_queue_overload_mean_ms")))),
            ("pod queue ms, base/overload", p(lambda x: "/".join(
                _ms(x.get("pod_queue_mean_ms", {}).get(k)) for k in ("baseline", "overload")))),
            ("B sent", p(lambda x: str(x["b"]["sent"]))),
            ("B dispatched (200)", p(lambda x: str(x["b"]["dispatched"]))),
            ("B queued in the EPP", p(lambda x: _n(x["b"]["queued"]))),
            ("B rejected (429)", p(lambda x: str(x["b"]["rejected"]))),
            ("B evicted (503)", p(lambda x: str(x["b"]["evicted"]))),
            ("B other / lost", p(lambda x: f"{x['b']['other_status']}/{x['b']['lost']}")),
            ("B TTFT p50 ms", p(lambda x: _ms(x["b"]["ttft_p50_ms"]))),
        ]
    if any("fair" in r for r in results.values()):
        def f(g: Callable[[Mapping[str, Any]], str]) -> Callable[[Mapping[str, Any]], str]:
            return lambda r: g(r["fair"]) if "fair" in r else "-"
        names = sorted({t for r in results.values() if "fair" in r
                        for t in r["fair"]["dispatch_shares"]})

        def share(t: str) -> Callable[[Mapping[str, Any]], str]:
            return lambda x: _pct(x["dispatch_shares"].get(t)) + (
                " (EPP)" if x["dispatch_source"] == "epp" else "")

        def answers(t: str) -> Callable[[Mapping[str, Any]], str]:
            return lambda x: "/".join(str(x["tenants"][t][k])
                                      for k in ("ok", "rejected_429", "evicted_503"))

        for t in names:
            rows.append((f"fair: {t} dispatch share", f(share(t))))
            rows.append((f"fair: {t} 200/429/503", f(answers(t))))
        rows.append(("fair: 200 shares, sent in window", f(lambda x: "/".join(
            _pct(v) for v in x["client_shares"].values()))))

    def acc(v: str) -> Callable[[Mapping[str, Any]], str]:
        def show(r: Mapping[str, Any]) -> str:
            if v not in r:
                return "-"
            c = r[v]["accounting"]["client"]
            return (f"{c['sent']}={c['dispatched']}+{c['rejected']}+{c['evicted']}"
                    + ("" if c["balanced"] else f" !{c['other_status']}+{c['lost']}"))
        return show

    def acc_epp(v: str) -> Callable[[Mapping[str, Any]], str]:
        def show(r: Mapping[str, Any]) -> str:
            e = r.get(v, {}).get("accounting", {}).get("epp")
            if e is None:
                return "-"
            return (f"{e['dispatched']}+{e['rejected']}+{e['evicted']}"
                    + ("" if e["balanced"] else " !"))
        return show

    def cpu(v: str) -> Callable[[Mapping[str, Any]], str]:
        def show(r: Mapping[str, Any]) -> str:
            c = r.get(v, {}).get("cpu_s")
            if not c:
                return "-"
            return "/".join(f"{c[k]:.0f}" if k in c else "-" for k in ("epp", "envoy", "pods"))
        return show

    for v in ("priority", "fair"):
        if any(v in r for r in results.values()):
            rows.append((f"{v}: CPU s epp/envoy/pods", cpu(v)))
            rows.append((f"{v}: sent=200+429+503", acc(v)))
            rows.append((f"{v}: EPP disp+rej+evict", acc_epp(v)))
    for name, fn in rows:
        lines.append(f"{name:30}" + "".join(f"{fn(results[lbl]):>{w}}" for lbl in labels))
    for v in report["verdicts"]:
        val = v["value"]
        shown = f"{val:.3f}" if isinstance(val, float) else str(val)
        lines.append(f"target [{v['router']}] {v['target']}: {shown} -> "
                     f"{'met' if v['met'] else 'NOT met'}")
    return "\n".join(lines)


# ----------------------------------------------------------------- the command


def sim_config(sim_args: Sequence[str]) -> SimConfig:
    return config_from_args(build_parser().parse_args(["--port", "1", *sim_args]))


def _append_samples(path: Path, router: str, variant: str,
                    samples: Sequence[OverloadSample]) -> None:
    """One line per request (a local file: fast enough to write on the loop between
    variants)."""
    with open(path, "a") as fh:
        fh.writelines(json.dumps({"router": router, "variant": variant, "index": s.index,
                                  "tenant": s.tenant, "phase": s.phase,
                                  "sent_at": round(s.sent_at, 4),
                                  "late_ms": round(1000 * s.late_s, 2),
                                  **asdict(s.result)}) + "\n" for s in samples)


def _json_default(o: object) -> object:
    if isinstance(o, OutcomeStat):
        return asdict(o)
    return str(o)


async def run_overload(args: argparse.Namespace,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """Play the variants through every router; write results.json, samples.jsonl,
    table.txt and the configs into ``--out``; return the report."""
    smoke: bool = args.smoke
    sim_args = shlex.split(SMOKE_SIM_ARGS if smoke else SIM_ARGS) + shlex.split(args.sim_args
                                                                                or "")
    costs = costs_of(sim_config(sim_args))
    servers: int = args.servers
    variants = parse_variants(args.variants)
    scen = scenarios(baseline_s=args.baseline_s, overload_s=args.overload_s,
                     baseline_load=args.baseline_load, factor=args.overload_factor,
                     smoke=smoke)
    traces = {v: make_overload_trace(scen[v], costs, servers, seed=args.seed)
              for v in variants}
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="epp-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_dir = out_dir / "configs"
    cfg_dir.mkdir(exist_ok=True)
    limits = queue_limits(costs, servers, args.queue_ttl)
    (cfg_dir / "flow-control.yaml").write_text(router_config(costs, flow_control=True,
                                                             limits=limits))
    (cfg_dir / "legacy.yaml").write_text(router_config(costs, flow_control=False,
                                                       limits=limits))
    objectives = cfg_dir / "objectives.yaml"
    objectives.write_text(objectives_yaml([t for v in variants for t in scen[v].tenants]))
    routers = parse_routers(args.routers, cfg_dir)
    samples_path = out_dir / "samples.jsonl"
    samples_path.unlink(missing_ok=True)
    log(f"epp bench: workload {WORKLOAD}, {servers} pods, routers "
        f"{', '.join(r.label for r in routers)}; output in {out_dir}")
    log(f"  sim args: {' '.join(sim_args)}")
    described: dict[str, Any] = {}
    for v in variants:
        sc = scen[v]
        rt = rates(sc, costs, servers)
        described[v] = {
            "tenants": [asdict(t) for t in sc.tenants],
            "pod_ms": {t.name: pod_ms(t.prompt_tokens, t.max_tokens, costs)
                       for t in sc.tenants},
            "phases": [{"name": p.name, "duration_s": p.duration_s, "loads": list(p.loads)}
                       for p in sc.phases],
            "rates": rt, "requests": len(traces[v]),
        }
        for p in sc.phases:
            log(f"  {v} / {p.name} {p.duration_s:g}s: " + ", ".join(
                f"{t} at {100 * load:.0f}% of capacity = {rt[p.name][t]:.1f} req/s"
                for t, load in p.loads))
    # Long enough for round robin's backlog (2x for overload_s seconds takes about as
    # long again to serve); flow control's is bounded by the TTL.
    drain = args.drain if args.drain is not None else args.overload_s + (5.0 if smoke
                                                                         else 10.0)
    results: dict[str, dict[str, Any]] = {}
    t_start = time.monotonic()
    for spec in routers:
        label = spec.label
        log(f"\n[{label}] starting {servers} fresh pods + router")
        epp_args = ["--objectives-file", str(objectives)] if spec.kind == "epp" else []
        rs = RouterSpec(spec.kind, label, spec.config)
        results[label] = {}
        async with Stack(rs, servers, sim_args, out_dir / "logs" / label.replace(":", "-"),
                         epp_args=epp_args) as stack:
            port = stack.metrics_port if spec.flow_control else None
            for v in variants:
                sc = scen[v]
                trace = traces[v]
                headers = {t.name: t.headers() for t in sc.tenants}
                cpu_before = stack.cpu_seconds()
                before = await snapshot(stack.ports, port)
                snaps: dict[str, Snapshot] = {}

                def snap_as(key: str, port: int | None = port, ports: list[int] = stack.ports,
                            snaps: dict[str, Snapshot] = snaps
                            ) -> Callable[[], Awaitable[None]]:
                    async def take() -> None:
                        snaps[key] = await snapshot(ports, port)
                    return take

                marks: list[Mark] = []
                if v == "priority":
                    marks.append((sc.phase_start("overload"), snap_as("boundary")))
                else:
                    lo, hi = fair_window(sc)
                    marks += [(lo, snap_as("window-start")), (hi, snap_as("window-end"))]

                def progress(n: int, errors: int, t: float, label: str = label,
                             v: str = v) -> None:
                    if args.progress:
                        log(f"  [{label} {v}] {t:5.1f}s  {n:5d} answered  {errors} not 200")

                log(f"  [{label}] {v}: {len(trace)} requests over {sc.duration_s:g}s")
                samples = await play(stack.url, trace, headers, drain_s=drain, marks=marks,
                                     progress=progress)
                after = await snapshot(stack.ports, port)
                epp = after.flow_delta(before)
                if v == "priority":
                    mid = snaps.get("boundary")
                    pod_q = {"baseline": mid.pod_queue_mean_ms(before) if mid else None,
                             "overload": after.pod_queue_mean_ms(mid) if mid else None,
                             "all": after.pod_queue_mean_ms(before)}
                    results[label][v] = summarize_priority(
                        sc, samples, epp, mid.flow_delta(before) if mid else None, pod_q)
                else:
                    w0, w1 = snaps.get("window-start"), snaps.get("window-end")
                    window = w1.flow_delta(w0) if w0 and w1 else None
                    results[label][v] = summarize_fair(sc, samples, epp, window)
                    results[label][v]["pod_queue_mean_ms"] = {
                        "all": after.pod_queue_mean_ms(before)}
                cpu = stack.cpu_seconds()
                results[label][v]["cpu_s"] = {k: cpu[k] - cpu_before.get(k, 0.0)
                                              for k in cpu}
                _append_samples(samples_path, label, v, samples)
                acc = results[label][v]["accounting"]["client"]
                log(f"  [{label}] {v}: sent {acc['sent']} = {acc['dispatched']} 200 + "
                    f"{acc['rejected']} 429 + {acc['evicted']} 503"
                    + (f" (+ {acc['other_status']} other, {acc['lost']} lost)"
                       if not acc["balanced"] else ""))
            if all(r["accounting"]["client"]["dispatched"] == 0
                   for r in results[label].values()):
                log(stack.log_tails())
    report: dict[str, Any] = {
        "workload": WORKLOAD, "seed": args.seed, "servers": servers, "smoke": smoke,
        "sim_args": " ".join(sim_args), "capacity_method": "computed from the simulator's "
        "configuration (pod time per request with the batch full; epp.bench.overload."
        "pod_ms)", "variants": variants, "scenarios": described,
        "queue_limits": asdict(limits), "drain_s": drain,
        "routers": {r.label: asdict(r) for r in routers}, "results": results,
        "verdicts": verdicts(results), "elapsed_s": time.monotonic() - t_start,
        "machine": {"python": sys.version.split()[0]},
    }
    (out_dir / "results.json").write_text(json.dumps(report, indent=2, default=_json_default))
    txt = table(report)
    (out_dir / "table.txt").write_text(txt + "\n")
    log("\n" + txt)
    log(f"\nwrote {out_dir / 'results.json'} ({report['elapsed_s']:.0f}s)")
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options only ``--workload overload`` reads."""
    g = p.add_argument_group("overload workload (--workload overload)")
    g.add_argument("--variants", default=",".join(VARIANTS),
                   help="which scenarios: priority (an interactive and a sheddable batch "
                   "tenant), fair (two equal tenants) (default priority,fair)")
    g.add_argument("--baseline-s", type=float, default=None,
                   help="seconds of the interactive tenant alone (default 8; smoke 2)")
    g.add_argument("--overload-s", type=float, default=None,
                   help="seconds of overload (default 10; smoke 2)")
    g.add_argument("--baseline-load", type=float, default=0.5,
                   help="the interactive tenant's load, a fraction of the pool's capacity "
                   "(default 0.5)")
    g.add_argument("--overload-factor", type=float, default=2.0,
                   help="the pool's total offered load under overload, × its capacity "
                   "(default 2)")
    g.add_argument("--queue-ttl", type=float, default=None,
                   help="epp-flow-control: defaultRequestTTL in seconds (default 5; smoke 1.5)")


def main(args: argparse.Namespace) -> int:
    """``epp bench --workload overload``: defaults, checks, run; exit 0 when every router
    answered, 1 otherwise (targets missed do not fail the run), 2 for bad options."""
    smoke = args.smoke
    if args.servers is None:
        args.servers = 2
    if args.routers is None:
        args.routers = DEFAULT_ROUTERS
    if args.baseline_s is None:
        args.baseline_s = 2.0 if smoke else 8.0
    if args.overload_s is None:
        args.overload_s = 2.0 if smoke else 10.0
    if args.queue_ttl is None:
        args.queue_ttl = 1.5 if smoke else 5.0
    unused = [flag for flag, bad in (("--rate", bool(args.rate)), ("--repeat", args.repeat != 1),
                                     ("--max-requests", args.max_requests is not None),
                                     ("--config", args.config is not None),
                                     ("--duration", args.duration != 60.0)) if bad]
    if unused:
        print(f"epp bench: {', '.join(unused)} do(es) not apply to --workload overload "
              "(see --baseline-s, --overload-s, --overload-factor, --baseline-load; "
              "epp=CONFIG in --routers)", file=sys.stderr)
        return 2
    if (args.servers < 1 or args.baseline_s <= 0 or args.overload_s <= 0
            or args.queue_ttl <= 0 or (args.drain is not None and args.drain < 0)):
        print("epp bench: --servers, --baseline-s, --overload-s and --queue-ttl must be "
              "positive", file=sys.stderr)
        return 2
    try:
        parse_routers(args.routers)
        parse_variants(args.variants)
        report = asyncio.run(run_overload(args, log=lambda s: print(s, flush=True)))
    except (ValueError, OSError) as e:
        print(f"epp bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nstopped; everything the bench started has been stopped")
        return 130
    ok = report["results"] and all(
        any(v["accounting"]["client"]["dispatched"] > 0 for v in r.values())
        for r in report["results"].values())
    return 0 if ok else 1
