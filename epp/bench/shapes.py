"""Workload shapes for ``epp bench --sweep``: a broad family, drawn per seed.

A :class:`Shape` is everything about one sweep point that is not the router: how many
pods and how fast each is, how many prefix groups (distinct system prompts / documents)
and how long their prefixes and questions are, how the requests are spread over the
groups (equal or Zipf-skewed group sizes), whether a group's requests arrive interleaved
at random or in bursts, what share of the traffic is multi-turn chat (each turn resends
the history; think time between turns), the pool's KV cache as a multiple of the
workload's working set, and the load as a fraction of the pool's capacity.

:func:`draw_shape` draws one from its seed (deterministic). Training sweeps
(``--sweep N --seed S``) use shape seeds ``S * 100 + i``; the held-out set is
:data:`HELD_OUT_SEEDS`, which no training seed can reach (:func:`training_seeds` refuses
seeds that would). The first shape of every training sweep is :func:`pinned_shape`, the
issue's capacity-bound shared-prefix example, so it is always measured.

:func:`plan` turns a shape into what a run needs: the trace (:class:`TraceRequest`, the
same type ``epp bench`` plays), each pod's ``epp sim`` arguments, the KV pool size that
gives the drawn cache ratio, and the arrival rate that gives the drawn load — with the
capacity computed from the simulator's cost model as ``epp bench`` does
(:func:`epp.bench.traces.capacity`, once per pod as the pods' costs differ). Two cores
cannot drive every rate a fast pool sustains, so the modeled durations are scaled
(``--time-scale``) to keep the offered rate within ``[min_rate, max_rate]``: the load
*fraction* is what the shape draws, and it is what stays true.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from epp.bench.traces import SimCosts, TraceRequest, answer_text, capacity, words
from epp.sim.kvcache import block_hashes
from epp.sim.tokens import messages_tokens

ARRIVALS: Final = ("random", "bursty")
#: The family's ranges (what :func:`draw_shape` draws from; the unit tests check them).
POD_RANGE: Final = (2, 16)
#: What a sweep caps the pods at unless told otherwise (``--max-pods``): on 2 cores every
#: pod is scraped by the EPP every 50 ms and Envoy, the EPP, the load generator and the
#: simulators share the cores; past 8 pods the EPP's scraping alone costs a large part of
#: a core and measurements turn into CPU contention.
DEFAULT_MAX_PODS: Final = 8
GROUP_RANGE: Final = (1, 64)
PREFIX_RANGE: Final = (200, 4000)
QUESTION_RANGE: Final = (16, 800)
MAX_TOKENS_CHOICES: Final = (8, 16, 32, 64)
SKEW_CHOICES: Final = (0.0, 0.0, 0.6, 1.2)
BURST_RANGE: Final = (3, 10)
TURN_RANGE: Final = (2, 6)
THINK_RANGE: Final = (0.1, 1.5)
CACHE_RATIO_RANGE: Final = (0.2, 5.0)
LOAD_RANGE: Final = (0.3, 0.9)
#: Cost multipliers a heterogeneous pod draws from (2 = twice as slow as the base costs).
POD_COST_CHOICES: Final = (0.5, 1.0, 2.0)
HETERO_P: Final = 0.4
BURSTY_P: Final = 0.35
CHAT_P: Final = 0.5

#: The held-out shapes: never used for tuning, reported separately (``--held-out``).
HELD_OUT_SEEDS: Final = tuple(range(900_001, 900_009))
#: Shapes per training sweep at most (seed ``S`` draws ``S*100 .. S*100+N-1``).
MAX_SWEEP: Final = 100
PINNED_NAME: Final = "capacity-bound-shared-prefix"


@dataclass(frozen=True, slots=True)
class Shape:
    """One point of the family (lengths in tokens, times in seconds)."""

    name: str
    seed: int
    held_out: bool
    pods: int
    pod_cost: tuple[float, ...]
    """Cost multiplier per pod (applied to prefill and decode costs; 1 = base)."""
    groups: int
    prefix_tokens: int
    question_tokens: int
    max_tokens: int
    group_skew: float
    """Zipf exponent of the group sizes (0: equal-sized groups)."""
    arrival: str
    """``random``: each request's group drawn independently (interleaved at random);
    ``bursty``: ``burst`` requests of one group arrive back to back."""
    burst: int
    chat_share: float
    """Share of the requests that are turns of multi-turn conversations."""
    turns: int
    think_s: float
    cache_ratio: float
    """The pool's KV cache (all pods) / the working set (blocks used by ≥ 2 requests)."""
    load: float
    """Offered rate / the pool's cold-cache capacity."""

    def describe(self) -> str:
        slow = sum(1 for c in self.pod_cost if c > 1)
        fast = sum(1 for c in self.pod_cost if c < 1)
        pods = f"{self.pods} pods" + (f" ({fast} fast, {slow} slow)" if slow or fast else "")
        chat = (f", chat {self.chat_share:.0%} ({self.turns} turns, think "
                f"{self.think_s:.1f}s)" if self.chat_share > 0 else "")
        skew = f" zipf {self.group_skew:g}" if self.group_skew else ""
        arrival = f"bursts of {self.burst}" if self.arrival == "bursty" else "random order"
        return (f"{pods}; {self.groups} group(s){skew} of {self.prefix_tokens}+"
                f"{self.question_tokens} tok, {self.max_tokens} out, {arrival}{chat}; "
                f"drawn: cache {self.cache_ratio:.2g}x working set, load {self.load:.0%}")


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw_shape(seed: int, *, held_out: bool = False, max_pods: int = DEFAULT_MAX_PODS,
               smoke: bool = False, name: str | None = None) -> Shape:
    """The shape of ``seed`` (deterministic). ``smoke``: tiny lengths and 2–3 pods."""
    if not POD_RANGE[0] <= max_pods <= POD_RANGE[1]:
        raise ValueError(f"max pods must be in {POD_RANGE[0]}..{POD_RANGE[1]}, got {max_pods}")
    rng = random.Random(f"epp-sweep-shape:{seed}")
    pods = rng.randint(POD_RANGE[0], min(3, max_pods) if smoke else max_pods)
    cost = [1.0] * pods
    if rng.random() < HETERO_P:
        cost = [rng.choice(POD_COST_CHOICES) for _ in range(pods)]
        if len(set(cost)) == 1:  # heterogeneous means at least two speeds
            cost[0] = 2.0 if cost[0] != 2.0 else 0.5
    groups = round(_log_uniform(rng, *GROUP_RANGE))
    prefix = round(_log_uniform(rng, *PREFIX_RANGE), -1)
    question = round(_log_uniform(rng, *QUESTION_RANGE))
    max_tokens = rng.choice(MAX_TOKENS_CHOICES)
    skew = rng.choice(SKEW_CHOICES)
    bursty = rng.random() < BURSTY_P
    burst = rng.randint(*BURST_RANGE)
    chat = rng.uniform(0.2, 1.0) if rng.random() < CHAT_P else 0.0
    turns = rng.randint(*TURN_RANGE)
    think = round(rng.uniform(*THINK_RANGE), 2)
    ratio = _log_uniform(rng, *CACHE_RATIO_RANGE)
    load = rng.uniform(*LOAD_RANGE)
    if smoke:  # the same draw, scaled down ~10x
        groups = min(groups, 6)
        prefix = max(100, round(prefix / 10, -1))
        question = max(8, question // 10)
        max_tokens = 4
        think = min(think, 0.3)
    return Shape(name or (f"held-out-{seed}" if held_out else f"shape-{seed}"), seed, held_out,
                 pods, tuple(cost), groups, int(prefix), question, max_tokens, skew,
                 "bursty" if bursty else "random", burst, round(chat, 2), turns, think,
                 round(ratio, 3), round(load, 3))


def pinned_shape(*, smoke: bool = False) -> Shape:
    """The issue's example: more distinct system prompts than the pool's KV cache holds
    (half of the working set fits), question groups interleaved at random, moderate
    load, 4 equal pods."""
    if smoke:
        return Shape(PINNED_NAME, 0, False, 2, (1.0, 1.0), 6, 200, 20, 4, 0.0, "random", 1,
                     0.0, 1, 0.0, 0.5, 0.6)
    return Shape(PINNED_NAME, 0, False, 4, (1.0,) * 4, 48, 2000, 200, 32, 0.0, "random", 1,
                 0.0, 1, 0.0, 0.5, 0.6)


def training_seeds(n: int, seed: int) -> list[int]:
    """Shape seeds of a training sweep of ``n`` drawn shapes; ValueError when they would
    reach the held-out seeds."""
    if not 0 <= n <= MAX_SWEEP:
        raise ValueError(f"--sweep takes 1..{MAX_SWEEP} shapes, got {n}")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0 for a sweep, got {seed}")
    top = min(HELD_OUT_SEEDS) // MAX_SWEEP
    if seed >= top:
        raise ValueError(f"--seed {seed} would draw near the held-out seeds "
                         f"({HELD_OUT_SEEDS[0]}..); use a seed below {top}")
    return [seed * MAX_SWEEP + i for i in range(n)]


def check_shape_seeds(seeds: Sequence[int]) -> list[int]:
    """``--shape-seeds``: training shape seeds a sweep ``--seed`` could draw; ValueError for
    one that could not (negative, or at or above the held-out range's neighbourhood)."""
    top = min(HELD_OUT_SEEDS) // MAX_SWEEP * MAX_SWEEP
    for s in seeds:
        if not 0 <= s < top:
            raise ValueError(f"--shape-seeds: {s} is not a training shape seed (0..{top - 1}; "
                             "the held-out shapes run with --held-out)")
    return list(seeds)


def sweep_shapes(n: int, seed: int, *, held_out: bool, max_pods: int = DEFAULT_MAX_PODS,
                 smoke: bool = False, shape_seeds: Sequence[int] = ()) -> list[Shape]:
    """``n`` training shapes (the pinned one first) — or, given ``shape_seeds``, the
    training shapes of exactly those seeds — and, with ``held_out``, the held-out set after
    them."""
    out: list[Shape] = []
    if shape_seeds:
        out += [draw_shape(s, max_pods=max_pods, smoke=smoke)
                for s in check_shape_seeds(shape_seeds)]
    elif n > 0:
        out.append(pinned_shape(smoke=smoke))
        out += [draw_shape(s, max_pods=max_pods, smoke=smoke)
                for s in training_seeds(n - 1, seed)]
    if held_out:
        out += [draw_shape(s, held_out=True, max_pods=max_pods, smoke=smoke)
                for s in HELD_OUT_SEEDS]
    return out


# ----------------------------------------------------------------- traces


@dataclass(slots=True)
class _Draft:
    at: float
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    kind: str
    key: str
    prev: int | None = None


def _arrivals(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    out: list[float] = []
    t = rng.expovariate(rate) if rate > 0 else duration_s
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


#: Mean gap between the requests of one burst (seconds).
BURST_GAP_S: Final = 0.02


def make_shape_trace(shape: Shape, rate: float, duration_s: float) -> list[TraceRequest]:
    """The shape's requests at ``rate`` requests/s over ``duration_s`` (deterministic)."""
    if not rate > 0 or not duration_s > 0:
        raise ValueError("rate and duration must be > 0")
    rng = random.Random(f"epp-sweep-trace:{shape.seed}:{shape.name}")
    prefixes = [f"s{shape.seed}g{g}: " + words(rng, max(1, shape.prefix_tokens - 1))
                for g in range(shape.groups)]
    weights = [1.0 / (i + 1) ** shape.group_skew for i in range(shape.groups)]
    order = list(range(shape.groups))
    rng.shuffle(order)  # popularity rank is not group index

    def group() -> int:
        return order[rng.choices(range(shape.groups), weights)[0]]

    drafts: list[_Draft] = []
    single_rate = rate * (1.0 - shape.chat_share)
    if single_rate > 0:
        times: list[tuple[float, int]] = []
        if shape.arrival == "bursty":
            for start in _arrivals(rng, single_rate / shape.burst, duration_s):
                g, t = group(), start
                for _ in range(shape.burst):
                    if t >= duration_s:
                        break
                    times.append((t, g))
                    t += rng.expovariate(1.0 / BURST_GAP_S)
        else:
            times = [(t, group()) for t in _arrivals(rng, single_rate, duration_s)]
        for t, g in times:
            drafts.append(_Draft(t, ({"role": "system", "content": prefixes[g]},
                                     {"role": "user",
                                      "content": words(rng, shape.question_tokens)}),
                                 shape.max_tokens, "single", f"group-{g}"))
    chat_rate = rate * shape.chat_share / max(1, shape.turns)
    for c, start in enumerate(_arrivals(rng, chat_rate, duration_s) if chat_rate > 0 else []):
        history: list[dict[str, str]] = [{"role": "system", "content": prefixes[group()]}]
        t, prev = start, None
        for _turn in range(shape.turns):
            if t >= duration_s:
                break
            history.append({"role": "user", "content": words(rng, shape.question_tokens)})
            drafts.append(_Draft(t, tuple(history), shape.max_tokens, "chat", f"conv-{c}",
                                 prev))
            prev = len(drafts) - 1
            history.append({"role": "assistant", "content": answer_text(shape.max_tokens)})
            t += rng.expovariate(1.0 / shape.think_s) if shape.think_s > 0 else 0.0
    by_time = sorted(range(len(drafts)), key=lambda i: (drafts[i].at, i))
    position = {old: new for new, old in enumerate(by_time)}
    out: list[TraceRequest] = []
    for new, old in enumerate(by_time):
        d = drafts[old]
        out.append(TraceRequest(new, d.at, d.messages, d.max_tokens, d.kind, d.key,
                                None if d.prev is None else position[d.prev]))
    return out


def working_set_blocks(trace: Sequence[TraceRequest], block_size: int) -> int:
    """Distinct KV blocks that at least two requests' prompts share (what a cache must
    hold for every possible hit)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for r in trace:
        for h in block_hashes(messages_tokens(list(r.messages)), block_size):
            if h in seen:
                shared.add(h)
            else:
                seen.add(h)
    return len(shared)


def max_request_blocks(trace: Sequence[TraceRequest], block_size: int) -> int:
    return max((math.ceil((r.prompt_words + r.max_tokens) / block_size) for r in trace),
               default=1)


# ----------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True)
class Plan:
    """What a run of one shape needs (:func:`plan`)."""

    shape: Shape
    trace: list[TraceRequest] = field(repr=False)
    duration_s: float
    rate: float
    """Arrival rate drawn at (requests/s)."""
    offered_rps: float
    """Requests in the trace / duration."""
    capacity_rps: float
    """The pods' cold-cache capacity for this trace at these costs."""
    time_scale: float
    num_gpu_blocks: int
    """KV pool per pod."""
    working_set_blocks: int
    common_args: list[str]
    """``epp sim`` arguments of every pod."""
    pod_args: list[list[str]]
    """Extra arguments per pod (its cost flags when its cost differs from the base)."""

    @property
    def load(self) -> float:
        return self.offered_rps / self.capacity_rps if self.capacity_rps else float("nan")

    @property
    def cache_ratio(self) -> float:
        ws = self.working_set_blocks
        return self.num_gpu_blocks * self.shape.pods / ws if ws else float("inf")


def pod_costs(base: SimCosts, factor: float, time_scale: float, num_gpu_blocks: int) -> SimCosts:
    """``base`` (wall-clock ms at time scale 1) for a pod ``factor`` times as slow."""
    return SimCosts(base.prefill_ms_per_token * factor * time_scale,
                    base.decode_base_ms * factor * time_scale,
                    base.decode_per_seq_ms * factor * time_scale, base.max_num_seqs,
                    num_gpu_blocks, base.block_size)


def pool_capacity(trace: list[TraceRequest], base: SimCosts, pod_cost: Sequence[float],
                  time_scale: float, num_gpu_blocks: int) -> float:
    """Requests/s the pods sustain with cold caches: :func:`epp.bench.traces.capacity`
    per pod (each at its own costs), summed."""
    return sum(capacity(trace, pod_costs(base, f, time_scale, num_gpu_blocks), 1)
               for f in pod_cost)


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def plan(shape: Shape, base: SimCosts, *, duration_s: float, min_rate: float = 8.0,
         max_rate: float = 30.0, base_args: Sequence[str] = ()) -> Plan:
    """The trace, pool size, rate and pod arguments that realise ``shape``.

    ``base`` holds the base costs (wall-clock ms at ``--time-scale 1``) and
    ``base_args`` the ``epp sim`` arguments that give them. The KV pool is sized from the
    working set of the trace (at least room for its largest request and two blocks),
    the rate from the cold-cache capacity at that pool size; the two depend on each other
    through the trace's length, so the pool is settled in two rounds and the last trace
    drawn at the rate that gives the drawn load with it. The realised load and cache
    ratio (:attr:`Plan.load`, :attr:`Plan.cache_ratio`) differ from the drawn ones by the
    Poisson draw and, for the cache, by that floor: report those.
    """
    if min_rate <= 0 or max_rate < min_rate:
        raise ValueError("need 0 < min_rate <= max_rate")
    block = base.block_size

    def rate_for(blocks: int, trace: list[TraceRequest]) -> tuple[float, float]:
        natural = shape.load * pool_capacity(trace, base, shape.pod_cost, 1.0, blocks)
        rate = min(max_rate, max(min_rate, natural))
        return rate, natural / rate

    blocks = 1 << 20
    trace = make_shape_trace(shape, min_rate, duration_s)
    for _ in range(2):
        rate, scale = rate_for(blocks, trace)
        trace = make_shape_trace(shape, rate, duration_s)
        if not trace:
            break
        ws = working_set_blocks(trace, block)
        floor = max_request_blocks(trace, block) + 2
        blocks = max(floor, math.ceil(shape.cache_ratio * ws / shape.pods))
    # The pool is settled; the final rate is the one that gives the drawn load with it.
    rate, scale = rate_for(blocks, trace)
    trace = make_shape_trace(shape, rate, duration_s)
    if not trace:
        raise ValueError(f"shape {shape.name}: no request in {duration_s:g}s at {rate:g}/s")
    blocks = max(blocks, max_request_blocks(trace, block) + 2)  # every request fits
    cap = pool_capacity(trace, base, shape.pod_cost, scale, blocks)
    common = [*base_args, "--num-gpu-blocks", str(blocks), "--time-scale", _fmt(scale)]
    pod_args = [[] if f == 1.0 else
                ["--prefill-ms-per-token", _fmt(base.prefill_ms_per_token * f),
                 "--decode-base-ms", _fmt(base.decode_base_ms * f),
                 "--decode-per-seq-ms", _fmt(base.decode_per_seq_ms * f)]
                for f in shape.pod_cost]
    return Plan(shape, trace, duration_s, rate, len(trace) / duration_s, cap, scale, blocks,
                working_set_blocks(trace, block), common, pod_args)
