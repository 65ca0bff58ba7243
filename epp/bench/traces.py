"""Open-loop workload traces for ``epp bench``: who asks what, and when.

A trace is a list of :class:`TraceRequest` in planned send order, generated up front and
deterministic for a seed, so every router sees exactly the same request sequence and the
offline ceiling (:mod:`epp.bench.ceiling`) replays that same sequence.

Arrivals are open loop: requests (or, for multi-turn chat, conversations) arrive as a
Poisson process at the given rate, whatever the gateway's latency. The one exception is a
chat's next turn, which also waits for the previous turn's answer (``after``): a user
cannot ask the follow-up before the answer came. The simulator's answer to
``max_tokens = n`` is always `` tok0 tok1 … tok{n-1}``, so the history each turn resends
is known in advance and the trace is fixed.

Text is made of random three-letter words: a word is one simulator token and, with its
space, four characters — the EPP's own characters-per-token assumption — so the EPP's
character blocks and the simulator's token blocks cover the same text.

Workloads (lengths in tokens):

- ``shared-prefix``: ``groups`` distinct long prefixes (a RAG corpus chunk, an agent's
  instructions …), each request one prefix (popularity Zipf(``zipf``); 0 = uniform) plus
  a unique question. Sized so the distinct prefixes exceed the pods' combined KV cache.
- ``multi-turn``: conversations of ``turns`` turns; each turn resends the history (one of
  a few system prompts, earlier questions and answers) plus a new question; think time
  between turns is exponential.
- ``hot-spot``: one system prompt shared by all traffic plus a unique question — the trap
  for a router that follows prefix affinity blindly.
- ``mix``: the three interleaved, each at a share of the rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

WORKLOADS: Final = ("shared-prefix", "multi-turn", "hot-spot", "mix")
#: ``epp bench --workload overload``: not a trace of this module but two tenants over
#: capacity (:mod:`epp.bench.overload`); named here, at the bottom, for the CLI.
OVERLOAD_WORKLOAD: Final = "overload"

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def answer_text(max_tokens: int) -> str:
    """What the simulator answers to ``max_tokens`` (one word per token)."""
    return "".join(f" tok{i}" for i in range(max_tokens))


def words(rng: random.Random, n: int) -> str:
    """``n`` random three-letter words (one token and four characters each)."""
    choice = rng.choice
    return " ".join(choice(_LETTERS) + choice(_LETTERS) + choice(_LETTERS) for _ in range(n))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One planned request."""

    index: int
    at: float
    """Planned send time, seconds from the start of the run."""
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    kind: str
    """The workload it belongs to (``shared-prefix``, ``multi-turn``, ``hot-spot``)."""
    key: str
    """Affinity key: the prefix group, the conversation, or the request itself."""
    after: int | None = None
    """Index of the request whose answer must arrive first (the previous turn)."""

    def body(self, model: str) -> dict[str, Any]:
        return {"model": model, "messages": list(self.messages), "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": self.max_tokens}

    @property
    def prompt_words(self) -> int:
        return sum(len(m["content"].split()) for m in self.messages)


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    groups: int = 100
    prefix_tokens: int = 3000
    question_tokens: int = 200
    max_tokens: int = 32
    zipf: float = 0.0


@dataclass(frozen=True, slots=True)
class MultiTurnSpec:
    system_prompts: int = 4
    system_tokens: int = 1000
    turns: int = 6
    question_tokens: int = 300
    max_tokens: int = 32
    think_s: float = 2.0


@dataclass(frozen=True, slots=True)
class HotSpotSpec:
    system_tokens: int = 2500
    question_tokens: int = 300
    max_tokens: int = 32


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """Every knob of the four workloads; :func:`default_shape` gives the benchmark's."""

    shared_prefix: SharedPrefixSpec = field(default_factory=SharedPrefixSpec)
    multi_turn: MultiTurnSpec = field(default_factory=MultiTurnSpec)
    hot_spot: HotSpotSpec = field(default_factory=HotSpotSpec)
    mix: tuple[tuple[str, float], ...] = (("shared-prefix", 0.4), ("multi-turn", 0.4),
                                          ("hot-spot", 0.2))


def default_shape(smoke: bool = False) -> WorkloadShape:
    """The benchmark's workload shapes; ``smoke`` scales every length down ~10×."""
    if not smoke:
        return WorkloadShape()
    return WorkloadShape(
        shared_prefix=SharedPrefixSpec(groups=8, prefix_tokens=200, question_tokens=20,
                                       max_tokens=4),
        multi_turn=MultiTurnSpec(system_prompts=2, system_tokens=100, turns=3,
                                 question_tokens=30, max_tokens=4, think_s=0.2),
        hot_spot=HotSpotSpec(system_tokens=200, question_tokens=30, max_tokens=4),
    )


def _poisson(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    out: list[float] = []
    t = rng.expovariate(rate) if rate > 0 else duration_s
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass(slots=True)
class _Draft:
    at: float
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    kind: str
    key: str
    prev: int | None = None  # position of the previous turn in the draft list


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def _shared_prefix(rng: random.Random, spec: SharedPrefixSpec, rate: float,
                   duration_s: float, tag: str) -> list[_Draft]:
    prefixes = [f"{tag}doc {g}: " + words(rng, spec.prefix_tokens - 2) for g in range(spec.groups)]
    weights = _zipf_weights(spec.groups, spec.zipf)
    order = list(range(spec.groups))
    rng.shuffle(order)  # popularity rank is not group index
    out = []
    for t in _poisson(rng, rate, duration_s):
        g = order[rng.choices(range(spec.groups), weights)[0]]
        out.append(_Draft(t, ({"role": "system", "content": prefixes[g]},
                              {"role": "user", "content": words(rng, spec.question_tokens)}),
                          spec.max_tokens, "shared-prefix", f"{tag}group-{g}"))
    return out


def _multi_turn(rng: random.Random, spec: MultiTurnSpec, rate: float, duration_s: float,
                tag: str) -> list[_Draft]:
    systems = [f"{tag}system {i}: " + words(rng, spec.system_tokens - 2)
               for i in range(spec.system_prompts)]
    out: list[_Draft] = []
    for c, start in enumerate(_poisson(rng, rate / spec.turns, duration_s)):
        history: list[dict[str, str]] = [
            {"role": "system", "content": systems[rng.randrange(len(systems))]}]
        t, prev = start, None
        for _turn in range(spec.turns):
            if t >= duration_s:
                break
            history.append({"role": "user", "content": words(rng, spec.question_tokens)})
            out.append(_Draft(t, tuple(history), spec.max_tokens, "multi-turn",
                              f"{tag}conv-{c}", prev))
            prev = len(out) - 1
            history.append({"role": "assistant", "content": answer_text(spec.max_tokens)})
            t += rng.expovariate(1.0 / spec.think_s) if spec.think_s > 0 else 0.0
    return out


def _hot_spot(rng: random.Random, spec: HotSpotSpec, rate: float, duration_s: float,
              tag: str) -> list[_Draft]:
    system = f"{tag}system: " + words(rng, spec.system_tokens - 1)
    return [_Draft(t, ({"role": "system", "content": system},
                       {"role": "user", "content": words(rng, spec.question_tokens)}),
                   spec.max_tokens, "hot-spot", f"{tag}req-{i}")
            for i, t in enumerate(_poisson(rng, rate, duration_s))]


_MAKERS: Final[dict[str, Callable[..., list[_Draft]]]] = {
    "shared-prefix": lambda rng, shape, r, d, tag: _shared_prefix(rng, shape.shared_prefix, r,
                                                                  d, tag),
    "multi-turn": lambda rng, shape, r, d, tag: _multi_turn(rng, shape.multi_turn, r, d, tag),
    "hot-spot": lambda rng, shape, r, d, tag: _hot_spot(rng, shape.hot_spot, r, d, tag),
}


def make_trace(workload: str, rate: float, duration_s: float, *, seed: int = 1,
               shape: WorkloadShape | None = None,
               max_requests: int | None = None) -> list[TraceRequest]:
    """The request sequence of ``workload`` at ``rate`` requests/s for ``duration_s``.

    Sorted by planned send time; ``max_requests`` keeps the first that many (a request
    whose previous turn was cut is cut too).
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")
    if not rate > 0 or not duration_s > 0:
        raise ValueError("rate and duration must be > 0")
    shape = shape or default_shape()
    rng = random.Random(f"epp-bench:{workload}:{seed}")
    if workload == "mix":
        drafts: list[_Draft] = []
        for kind, share in shape.mix:
            part = _MAKERS[kind](rng, shape, rate * share, duration_s, f"{kind[0]}")
            base = len(drafts)
            drafts += [replace(d, prev=None if d.prev is None else d.prev + base) for d in part]
    else:
        drafts = _MAKERS[workload](rng, shape, rate, duration_s, "")
    order = sorted(range(len(drafts)), key=lambda i: (drafts[i].at, i))
    position = {old: new for new, old in enumerate(order)}
    out: list[TraceRequest] = []
    for new, old in enumerate(order):
        d = drafts[old]
        after = None if d.prev is None else position[d.prev]
        out.append(TraceRequest(new, d.at, d.messages, d.max_tokens, d.kind, d.key, after))
    if max_requests is not None and len(out) > max_requests:
        out = out[:max_requests]
    return out


@dataclass(frozen=True, slots=True)
class SimCosts:
    """The simulator parameters the capacity estimate needs (see docs/simulator.md)."""

    prefill_ms_per_token: float
    decode_base_ms: float
    decode_per_seq_ms: float
    max_num_seqs: int
    num_gpu_blocks: int
    block_size: int


def capacity(trace: list[TraceRequest], costs: SimCosts, servers: int) -> float:
    """Requests/s the pods sustain for this request mix with *cold* caches.

    From the simulator's latency model: a pod's time goes to prefill (every prompt token,
    as if nothing were cached: ``prefill_ms_per_token`` each) and to decode steps (each
    costs ``decode_base_ms`` for the batch plus ``decode_per_seq_ms`` per sequence in it;
    a request needs ``max_tokens`` of them). With the batch at its largest — bounded by
    ``max_num_seqs`` and by how many requests' KV blocks fit in the pool — one request
    costs ``u·c + n·(decode_per_seq_ms + decode_base_ms / batch)`` ms of pod time, so a
    pod completes at most ``1000 / that`` requests per second. Queueing makes latency
    grow well before that rate; 65 % of it is a busy but stable load.
    """
    if not trace:
        return 0.0
    u = sum(r.prompt_words for r in trace) / len(trace)
    n = sum(r.max_tokens for r in trace) / len(trace)
    per_seq_blocks = max(1, math.ceil((u + n) / costs.block_size))
    batch = max(1, min(costs.max_num_seqs, costs.num_gpu_blocks // per_seq_blocks))
    ms = u * costs.prefill_ms_per_token + n * (costs.decode_per_seq_ms
                                               + costs.decode_base_ms / batch)
    return servers * 1000.0 / ms if ms > 0 else float("inf")
