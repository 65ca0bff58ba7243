"""The KV-block index: which pods hold which prompt blocks, from the engines' KV events.

Modelled on llm-d-router v0.10.0 ``pkg/kvcache/kvblock/in_memory.go`` (``Add``,
``Evict`` by engine key, ``Clear``, ``Lookup``, ``GetRequestKey``,
``engineToRequestMapping``), ``pkg/kvevents/pool.go`` (``processEventBatch``: how each
event becomes index operations) and ``pkg/kvcache/kvblock_scorer.go``
(``LongestPrefixScorer``). Own Python.

Two kinds of key, as in llm-d:

* **request keys**: the EPP's own chained block hashes
  (:func:`epp.kvcache.hashing.request_keys`) of the event's ``token_ids``,
  computed with the EPP's ``blockSize``/``hashSeed`` and the model (or LoRA) name. The
  request path hashes the request's tokens the same way, so the engine's hash algorithm,
  ``PYTHONHASHSEED`` and block size need not be known here;
* **engine keys**: the engine's 64-bit block hashes from the event, kept only to map a
  later ``BlockRemoved`` (and a child's ``parent_block_hash``) back to request keys.

Layout: per pod, per medium, an insertion-ordered set of request keys (llm-d keeps the
transpose, key → pods). Events touch one pod, so a store or removal of a few hundred
blocks is a handful of C-level bulk operations instead of a Python loop over per-key
pod sets; a lookup walks each candidate's sets along the request's keys, which is cheap
because the chain breaks at the first block a pod lacks.

Memory is bounded per pod: each pod keeps at most ``max_blocks_per_pod`` request keys
per medium; adding beyond that drops that pod's oldest keys on that medium first.
``max_keys`` (llm-d's ``size``) bounds the (pod, medium, key) entries over all pods — at
least as strict as llm-d's bound on distinct keys. llm-d's ``podCacheSize`` (pods
remembered per key) has no counterpart: the per-pod bound already bounds memory, and a
key held by more pods than that stays known on all of them.

Not thread-safe: used from the event loop only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import filterfalse, islice, repeat, takewhile
from typing import Any

from epp.kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    engine_keys,
)
from epp.kvcache.hashing import request_keys as chain_keys

__all__ = ["DEFAULT_MEDIUM_WEIGHTS", "BlockIndex", "IndexStats", "event_extra", "normalize_medium"]

DEFAULT_MEDIUM = "gpu"
#: llm-d's ``DefaultKVCacheBackendConfig``: scoring weight per medium.
DEFAULT_MEDIUM_WEIGHTS: Mapping[str, float] = {"gpu": 1.0, "cpu": 0.8}

# Rough CPython cost of one entry (a dict slot and index, the int key) and of one
# engine-key mapping, for the memory estimate only.
_BYTES_PER_ENTRY = 200
_BYTES_PER_ENGINE_KEY = 160
_consume: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend
_SCALAR = {int, type(None)}


def _flatten(mapped: Iterable[int | tuple[int, ...] | None]) -> list[int]:
    """The request keys of engine-key mappings (a tuple where the engine's blocks are
    larger than the EPP's; None: not mapped)."""
    return [r for rk in mapped if rk is not None
            for r in ((rk,) if isinstance(rk, int) else rk)]


def _drop_oldest(d: dict[int, Any], n: int) -> None:
    """Drop the ``n`` oldest entries of an insertion-ordered dict, in one pass."""
    if n > 0:
        _consume(map(d.pop, list(islice(d, n))))


def normalize_medium(medium: str | None) -> str:
    """llm-d's ``normalizeDeviceTier``: lower case, ``gpu`` when the event names none."""
    return medium.lower() if medium else DEFAULT_MEDIUM


@dataclass(frozen=True, slots=True)
class IndexStats:
    keys: int
    entries: int
    engine_keys: int
    pods: int
    approx_bytes: int
    admissions: int
    evictions: int


def event_extra(ev: BlockStored, n_blocks: int) -> list[object] | None:
    """Per-block extra hash inputs from a ``BlockStored``'s ``extra_keys`` (llm-d's
    ``ParseRawExtraKeys`` + ``realignExtraFeatures``): each string (multimodal
    identifier, cache salt) or ``(identifier, offset)`` tuple becomes ``{"Hash": s}``.
    The LoRA name is left out: it is already the model name the keys are chained from
    (llm-d would fold it in here too, and then never match a LoRA request)."""
    if not ev.extra_keys or n_blocks <= 0:
        return None
    per_block: list[object] = []
    for keys in ev.extra_keys:
        hashes: list[dict[str, str]] = []
        for k in keys or ():
            if isinstance(k, str):
                if k != ev.lora_name:
                    hashes.append({"Hash": k})
            elif isinstance(k, tuple) and k and isinstance(k[0], str):
                hashes.append({"Hash": k[0]})
        per_block.append(hashes or None)
    if not any(per_block):
        return None
    ne = len(per_block)
    if ne == n_blocks:
        return per_block
    out: list[object] = [None] * n_blocks
    if ne < n_blocks:
        for i in range(n_blocks):
            out[i] = per_block[i * ne // n_blocks]
    else:
        for i, hs in enumerate(per_block):
            if isinstance(hs, list):
                j = i * n_blocks // ne
                cur = out[j]
                out[j] = (cur if isinstance(cur, list) else []) + hs
    return out


class _Pod:
    """What one pod holds: per medium, its request keys (oldest first); engine key →
    request key (an int, or a tuple when the engine's block size differs). Plain dicts:
    insertion-ordered, and their bulk updates run at C speed (OrderedDict's do not)."""

    __slots__ = ("engine", "mapped", "pending", "tiers")

    def __init__(self) -> None:
        self.tiers: dict[str, dict[int, None]] = {}
        self.engine: dict[int, int | tuple[int, ...]] = {}
        self.mapped: set[str] = set()  # media the engine's events named
        # request keys sent to the pod that its events have not reported stored yet
        self.pending: dict[int, None] = {}

    def size(self) -> int:
        return sum(map(len, self.tiers.values()))


class BlockIndex:
    def __init__(
        self,
        *,
        block_size: int = 16,
        hash_seed: str = "",
        max_blocks_per_pod: int = 262_144,
        max_keys: int = 100_000_000,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be greater than 0, got {block_size}")
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.max_blocks_per_pod = max_blocks_per_pod
        self.max_keys = max_keys
        self._pods: dict[str, _Pod] = {}
        self._entries = 0  # (pod, medium, key) entries over all pods
        self.admissions = 0
        self.evictions = 0

    # ------------------------------------------------------------------ request side

    def request_keys(self, tokens: Sequence[int], model: str,
                     cache_salt: str | None = None) -> list[int]:
        """The request keys of a prompt's full blocks (llm-d's ``TokensToKVBlockKeys``;
        the cache salt folds into block 0 as llm-d's ``foldCacheSalt`` does)."""
        extra: list[object] | None = None
        n = len(tokens) // self.block_size
        if cache_salt and n:
            extra = [None] * n
            extra[0] = [{"Hash": cache_salt}]
        return chain_keys(tokens, self.block_size, model_name=model,
                          hash_seed=self.hash_seed, extra=extra)

    def longest_prefix(self, keys: Sequence[int], pods: Iterable[str],
                       weights: Mapping[str, float] = DEFAULT_MEDIUM_WEIGHTS,
                       ) -> tuple[dict[str, float], dict[str, int], dict[str, dict[str, int]]]:
        """llm-d's ``LongestPrefixScorer``: per pod, the weighted count of consecutive
        blocks from the first one (each block counts the best weight among the media
        holding it); plus the unweighted count and, per medium, the consecutive blocks
        from the first held on that medium (llm-d's ``matchedBlockCountByTier``)."""
        scores: dict[str, float] = {}
        counts: dict[str, int] = {}
        by_tier: dict[str, dict[str, int]] = {}
        if not keys:
            return scores, counts, by_tier
        first = keys[0]
        index = self._pods
        for pod in pods:
            p = index.get(pod)
            if p is None:
                continue
            runs = {m: len(list(takewhile(t.__contains__, keys)))
                    for m, t in p.tiers.items() if first in t}
            if not runs:
                continue
            if len(runs) == 1:
                (m, n), = runs.items()
                scores[pod] = n * weights.get(m, 1.0)
                counts[pod] = n
                by_tier[pod] = runs
                continue
            scores[pod], counts[pod] = self._mixed_run(keys, p.tiers, runs, weights)
            by_tier[pod] = runs
        return scores, counts, by_tier

    @staticmethod
    def _mixed_run(keys: Sequence[int], tiers: Mapping[str, dict[int, None]],
                   runs: Mapping[str, int], weights: Mapping[str, float]
                   ) -> tuple[float, int]:
        """(weighted, plain) count of the consecutive blocks held on any medium."""
        ranked = sorted(tiers, key=lambda m: -weights.get(m, 1.0))
        best = ranked[0]
        i = runs.get(best, 0)  # the best medium's own run: all at its weight
        score = i * weights.get(best, 1.0)
        n = len(keys)
        while i < n:
            k = keys[i]
            w = next((weights.get(m, 1.0) for m in ranked if k in tiers[m]), None)
            if w is None:
                break
            score += w
            i += 1
        return score, i

    # ------------------------------------------------------------------ event side

    def request_key_for(self, pod: str, engine: int) -> int | None:
        """The last request key an engine key of ``pod`` maps to (``GetRequestKey``)."""
        p = self._pods.get(pod)
        rk = p.engine.get(engine) if p is not None else None
        if rk is None or isinstance(rk, int):
            return rk
        return rk[-1] if rk else None

    def apply(self, pod: str, model: str, batch: KVEventBatch) -> None:
        """Apply one decoded batch from ``pod`` (llm-d's ``processEventBatch``). vLLM
        sends one ``BlockRemoved`` per evicted block: a run of them on one medium is
        applied as one removal."""
        removed: list[int | bytes] = []
        medium: str | None = None
        for ev in batch.events:
            if isinstance(ev, BlockRemoved):
                if removed and ev.medium != medium:
                    self.remove(pod, engine_keys(removed), normalize_medium(medium))
                    removed = []
                medium = ev.medium
                removed.extend(ev.block_hashes)
                continue
            if removed:
                self.remove(pod, engine_keys(removed), normalize_medium(medium))
                removed = []
            if isinstance(ev, BlockStored):
                self.apply_stored(pod, model, ev)
            elif isinstance(ev, AllBlocksCleared):
                self.clear_pod(pod)
        if removed:
            self.remove(pod, engine_keys(removed), normalize_medium(medium))

    def apply_stored(self, pod: str, model: str, ev: BlockStored) -> None:
        medium = normalize_medium(ev.medium)
        name = ev.lora_name or model
        parent_rk: int | None = None
        if ev.parent_block_hash is not None:
            parent_ek = ev.parent_engine_key
            parent_rk = None if parent_ek is None else self.request_key_for(pod, parent_ek)
            if parent_rk is None:
                return  # llm-d skips a store whose parent it does not know
        engine = ev.engine_keys
        if not ev.token_ids:
            # a medium update (e.g. offload to CPU) without tokens: reuse the known keys
            p = self._pods.get(pod)
            if p is not None:
                flat = _flatten([p.engine.get(ek) for ek in engine])
                if flat:
                    p.mapped.add(medium)
                    self._add(p, flat, medium)
            return
        rks = chain_keys(ev.token_ids, self.block_size, model_name=name,
                         hash_seed=self.hash_seed, parent=parent_rk,
                         extra=event_extra(ev, len(ev.token_ids) // self.block_size))
        if not rks:
            return
        p = self._pod(pod)
        p.mapped.add(medium)
        self._map_engine(p, engine, rks)
        self._add(p, rks, medium)

    def add(self, pod: str, request_keys: Sequence[int], medium: str = DEFAULT_MEDIUM,
            engine_keys: Sequence[int] | None = None) -> None:
        """Record that ``pod`` holds ``request_keys`` on ``medium``."""
        p = self._pod(pod)
        if engine_keys:
            p.mapped.add(medium)
            self._map_engine(p, engine_keys, request_keys)
        self._add(p, request_keys, medium)

    def _pod(self, pod: str) -> _Pod:
        p = self._pods.get(pod)
        if p is None:
            p = self._pods[pod] = _Pod()
        return p

    def _map_engine(self, p: _Pod, engine: Sequence[int], rks: Sequence[int]) -> None:
        """llm-d's ``engineToRequestMapping``: proportional when the engine's block size
        differs from the EPP's."""
        if not engine or not rks:
            return
        m = p.engine
        if len(engine) == len(rks):  # the engine's block size is the EPP's: one to one
            m.update(zip(engine, rks))
        else:
            n = max(len(engine), len(rks))
            mapping: dict[int, list[int]] = {}
            for i in range(n):
                mapping.setdefault(engine[i * len(engine) // n], []).append(
                    rks[i * len(rks) // n])
            m.update((ek, tuple(lst)) for ek, lst in mapping.items())
        _drop_oldest(m, len(m) - self.max_blocks_per_pod)

    def _add(self, p: _Pod, rks: Sequence[int], medium: str) -> None:
        tier = p.tiers.get(medium)
        if tier is None:
            tier = p.tiers[medium] = {}
        before = len(tier)
        if not tier.keys().isdisjoint(rks):  # blocks it held already: now the newest
            _consume(map(tier.pop, rks, repeat(None)))
        tier.update(dict.fromkeys(rks))
        if p.pending and medium in p.mapped:  # the engine computed them: no longer pending
            _consume(map(p.pending.pop, rks, repeat(None)))
        added = len(tier) - before
        self.admissions += added
        self._entries += added
        over = len(tier) - self.max_blocks_per_pod
        if self._entries > self.max_keys:
            over = max(over, min(len(tier), self._entries - self.max_keys))
        if over > 0:
            _drop_oldest(tier, over)
            self._entries -= over
            self.evictions += over

    def remove(self, pod: str, engine_keys: Iterable[int], medium: str = DEFAULT_MEDIUM) -> None:
        """``BlockRemoved``: ``pod`` no longer holds these engine blocks on ``medium``."""
        p = self._pods.get(pod)
        if p is None:
            return
        tier = p.tiers.get(medium)
        if not tier:
            return
        emap = p.engine
        eks = engine_keys if isinstance(engine_keys, (list, tuple)) else list(engine_keys)
        # other media the engine reported blocks on (not the EPP's speculative entries)
        others = [t for m, t in p.tiers.items() if t and t is not tier and m in p.mapped]
        rks: list[int | tuple[int, ...] | None]
        if not others:  # held on this medium only: forget the mappings with the blocks
            rks = list(map(emap.pop, eks, repeat(None)))
        else:
            rks = list(map(emap.get, eks))
        # request keys (None: not mapped, popped as nothing)
        flat: list[Any] = rks if set(map(type, rks)) <= _SCALAR else _flatten(rks)
        before = len(tier)
        _consume(map(tier.pop, flat, repeat(None)))
        if others:  # a mapping stays while another medium still holds its blocks
            for ek, rk in zip(eks, rks, strict=True):
                if rk is None:
                    continue
                held = (rk,) if isinstance(rk, int) else rk
                if not any(r in t for t in others for r in held):
                    emap.pop(ek, None)
        gone = before - len(tier)
        self._entries -= gone
        self.evictions += gone

    def remove_keys(self, pod: str, request_keys: Iterable[int], medium: str) -> None:
        """Drop ``pod``'s entries for these request keys on ``medium``."""
        p = self._pods.get(pod)
        tier = p.tiers.get(medium) if p is not None else None
        if not tier:
            return
        before = len(tier)
        _consume(map(tier.pop, request_keys, repeat(None)))
        gone = before - len(tier)
        self._entries -= gone
        self.evictions += gone

    def add_pending(self, pod: str, request_keys: Sequence[int]) -> int:
        """Record that ``pod`` was sent a prompt with these block keys: those it holds on
        no medium its events named are *pending* (to be computed) until a ``BlockStored``
        reports them or :meth:`remove_pending` drops them. Returns how many were new."""
        p = self._pod(pod)
        new: Iterable[int] = request_keys
        for m, t in p.tiers.items():
            if t and m in p.mapped:
                new = filterfalse(t.__contains__, new)
        pending = p.pending
        before = len(pending)
        pending.update(dict.fromkeys(new))
        _drop_oldest(pending, len(pending) - self.max_blocks_per_pod)
        return len(pending) - before

    def remove_pending(self, pod: str, request_keys: Iterable[int]) -> None:
        p = self._pods.get(pod)
        if p is not None and p.pending:
            _consume(map(p.pending.pop, request_keys, repeat(None)))

    def pending_blocks(self, pod: str) -> int:
        """Blocks sent to ``pod`` that its events have not reported stored yet: the prefill
        work queued or in progress there, as far as this index knows."""
        p = self._pods.get(pod)
        return len(p.pending) if p is not None else 0

    def clear_pod(self, pod: str) -> None:
        """Forget everything ``pod`` holds (``AllBlocksCleared``, a sequence gap or restart,
        the pod leaving)."""
        p = self._pods.pop(pod, None)
        if p is not None:
            n = p.size()
            self._entries -= n
            self.evictions += n

    # ------------------------------------------------------------------ introspection

    def pods(self) -> list[str]:
        return [name for name, p in self._pods.items() if any(p.tiers.values())]

    def blocks_of(self, pod: str) -> int:
        p = self._pods.get(pod)
        return p.size() if p is not None else 0

    def size(self) -> int:
        """Entries (request key, pod, medium) held."""
        return self._entries

    def stats(self) -> IndexStats:
        keys: set[int] = set()
        for p in self._pods.values():
            for t in p.tiers.values():
                keys.update(t)
        engine = sum(len(p.engine) for p in self._pods.values())
        return IndexStats(
            keys=len(keys), entries=self._entries, engine_keys=engine,
            pods=len(self.pods()),
            approx_bytes=self._entries * _BYTES_PER_ENTRY + engine * _BYTES_PER_ENGINE_KEY,
            admissions=self.admissions, evictions=self.evictions)

    @staticmethod
    def estimate_bytes(max_blocks_per_pod: int, pods: int) -> int:
        """Upper bound of the memory ``pods`` pods may take at ``max_blocks_per_pod`` (one
        medium each)."""
        return pods * max_blocks_per_pod * (_BYTES_PER_ENTRY + _BYTES_PER_ENGINE_KEY)
