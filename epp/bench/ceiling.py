"""The ceiling: the best prefix-cache hit rate a router can get on a trace.

An offline replay of a request sequence against the simulator's own cache model
(:class:`epp.sim.kvcache.BlockPool`, same block hashes, same "last token is always
recomputed" rule, same LRU eviction), one pool per pod, under several placements:

- ``static-affinity``: each affinity key (prefix group, conversation, or the request
  itself) is pinned to one pod, keys dealt round robin in first-seen order — perfect
  stickiness with a perfectly even spread of keys;
- ``greedy-prefix``: each request goes to the pod whose cache (known exactly, as no real
  router knows it) holds the longest prefix of it; ties to the pod with the fewest
  requests so far;
- ``round-robin`` and ``no-eviction`` (one pod with an unbounded cache) for reference.

The bound is the best of ``static-affinity`` and ``greedy-prefix``. Requests are replayed
one at a time, each finishing before the next starts: no two requests are in flight, so
none misses because an identical prefix was still being computed, and running
sequences never hold KV blocks that the prefix cache would otherwise keep. Both effects
only lower a live run's hit rate, so the replay is an upper bound in practice (not a
proof: LRU is not optimal, and a live router could in principle stumble on a better
placement than both).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from epp.bench.traces import TraceRequest
from epp.sim.kvcache import BlockPool, block_hashes
from epp.sim.tokens import messages_tokens

POLICIES: Final = ("static-affinity", "greedy-prefix", "round-robin", "no-eviction")
BOUND_POLICIES: Final = ("static-affinity", "greedy-prefix")


@dataclass(frozen=True, slots=True)
class _Prompt:
    length: int
    hashes: list[int]
    key: str


def _prompts(trace: Iterable[TraceRequest], block_size: int) -> list[_Prompt]:
    out = []
    for r in trace:
        tokens = messages_tokens(list(r.messages))
        out.append(_Prompt(max(1, len(tokens)), block_hashes(tokens, block_size), r.key))
    return out


def _serve(pool: BlockPool, p: _Prompt, block_size: int) -> int:
    """Run one request through ``pool`` as the simulator admits and finishes it; return
    its cached tokens."""
    hits = pool.lookup(p.hashes, (p.length - 1) // block_size)
    need = math.ceil(p.length / block_size) - len(hits)
    if not pool.can_allocate(need, hits):
        return 0  # larger than the whole pool: the simulator rejects it (400)
    pool.acquire(hits)
    pool.allocate(need)
    blocks = list(hits)
    private = need
    for h in p.hashes[len(hits):]:
        b = pool.register(h)
        if b is not None:
            blocks.append(b)
            private -= 1
    pool.release(blocks, private)
    return len(hits) * block_size


def _match(pool: BlockPool, p: _Prompt, block_size: int) -> int:
    return len(pool.lookup(p.hashes, (p.length - 1) // block_size))


@dataclass(frozen=True, slots=True)
class Replay:
    policy: str
    hit_rate: float
    prompt_tokens: int
    cached_tokens: int
    share: tuple[int, ...]


def replay(trace: Sequence[TraceRequest], policy: str, *, servers: int, num_gpu_blocks: int,
           block_size: int = 16, _prompts_cache: list[_Prompt] | None = None) -> Replay:
    """Replay ``trace`` in order under ``policy`` (one of :data:`POLICIES`)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    prompts = _prompts_cache if _prompts_cache is not None else _prompts(trace, block_size)
    if policy == "no-eviction":
        pools = [BlockPool(1 << 62)]
    else:
        pools = [BlockPool(num_gpu_blocks) for _ in range(servers)]
    share = [0] * len(pools)
    pinned: dict[str, int] = {}
    cached = total = 0
    for i, p in enumerate(prompts):
        if policy == "no-eviction":
            pod = 0
        elif policy == "round-robin":
            pod = i % servers
        elif policy == "static-affinity":
            pod = pinned.setdefault(p.key, len(pinned) % servers)
        else:  # greedy-prefix
            best = max(range(servers), key=lambda s: (_match(pools[s], p, block_size), -share[s]))
            pod = best
        share[pod] += 1
        cached += _serve(pools[pod], p, block_size)
        total += p.length
    return Replay(policy, cached / total if total else 0.0, total, cached, tuple(share))


def ceiling(trace: Sequence[TraceRequest], *, servers: int, num_gpu_blocks: int,
            block_size: int = 16) -> dict[str, Replay]:
    """Every policy's replay; ``result['bound']`` is the best of :data:`BOUND_POLICIES`."""
    prompts = _prompts(trace, block_size)
    out = {pol: replay(trace, pol, servers=servers, num_gpu_blocks=num_gpu_blocks,
                       block_size=block_size, _prompts_cache=prompts) for pol in POLICIES}
    out["bound"] = max((out[p] for p in BOUND_POLICIES), key=lambda r: r.hit_rate)
    return out
