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

Memory is bounded per pod: each pod keeps at most ``max_blocks_per_pod`` (request key,
medium) entries; adding beyond that drops that pod's oldest entries first. ``max_keys``
bounds the distinct request keys (oldest dropped) and ``pods_per_key`` the pods
remembered per key (llm-d's ``podCacheSize``; the oldest pod entry is dropped).

Not thread-safe: used from the event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from epp.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from epp.kvcache.hashing import request_keys as chain_keys

__all__ = ["DEFAULT_MEDIUM_WEIGHTS", "BlockIndex", "IndexStats", "event_extra", "normalize_medium"]

DEFAULT_MEDIUM = "gpu"
#: llm-d's ``DefaultKVCacheBackendConfig``: scoring weight per medium.
DEFAULT_MEDIUM_WEIGHTS: Mapping[str, float] = {"gpu": 1.0, "cpu": 0.8}

# Rough CPython cost of one entry across the structures below (dict slots, the int key,
# the pod's OrderedDict node, the tier set), for the memory estimate only.
_BYTES_PER_ENTRY = 320
_BYTES_PER_ENGINE_KEY = 160


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


class BlockIndex:
    def __init__(
        self,
        *,
        block_size: int = 16,
        hash_seed: str = "",
        max_blocks_per_pod: int = 262_144,
        max_keys: int = 100_000_000,
        pods_per_key: int = 10,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be greater than 0, got {block_size}")
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.max_blocks_per_pod = max_blocks_per_pod
        self.max_keys = max_keys
        self.pods_per_key = pods_per_key
        # request key -> pod -> media (insertion-ordered: oldest pod first)
        self._keys: dict[int, dict[str, set[str]]] = {}
        # pod -> (request key, medium) in insertion order, for the per-pod bound
        self._pod_entries: dict[str, OrderedDict[tuple[int, str], None]] = {}
        # pod -> engine key -> request keys
        self._engine: dict[str, OrderedDict[int, tuple[int, ...]]] = {}
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

    def lookup(self, keys: Sequence[int], pods: Iterable[str] | None = None
               ) -> list[dict[str, set[str]]]:
        """For each key in order, the candidate pods holding it and on which media; stops
        at the first key nobody holds (the prefix chain breaks there)."""
        wanted = None if pods is None else set(pods)
        out: list[dict[str, set[str]]] = []
        for k in keys:
            holders = self._keys.get(k)
            if not holders:
                break
            if wanted is None:
                out.append({p: set(m) for p, m in holders.items()})
            else:
                out.append({p: set(m) for p, m in holders.items() if p in wanted})
        return out

    def longest_prefix(self, keys: Sequence[int], pods: Iterable[str],
                       weights: Mapping[str, float] = DEFAULT_MEDIUM_WEIGHTS,
                       ) -> tuple[dict[str, float], dict[str, int], dict[str, dict[str, int]]]:
        """llm-d's ``LongestPrefixScorer``: per pod, the weighted count of consecutive
        blocks from the first one it holds (each block counts the best weight among the
        media holding it); plus the unweighted count and the count per medium (the
        media present on every block so far, llm-d's ``matchedBlockCountByTier``)."""
        scores: dict[str, float] = {}
        counts: dict[str, int] = {}
        by_tier: dict[str, dict[str, int]] = {}
        alive: dict[str, set[str]] | None = None
        wanted = set(pods)
        index = self._keys
        for k in keys:  # (lookup, without copying the media sets: nothing here mutates them)
            holders = index.get(k)
            if not holders:
                break
            current = {p: m for p, m in holders.items()
                       if p in wanted and (alive is None or p in alive)}
            if not current:
                break
            nxt: dict[str, set[str]] = {}
            for p, media in current.items():
                w = max(weights.get(m, 1.0) for m in media)
                scores[p] = scores.get(p, 0.0) + w
                counts[p] = counts.get(p, 0) + 1
                tiers = media if alive is None else (alive[p] & media)
                for t in tiers:
                    by_tier.setdefault(p, {})[t] = by_tier.get(p, {}).get(t, 0) + 1
                nxt[p] = tiers if tiers else set()
            alive = nxt
        return scores, counts, by_tier

    # ------------------------------------------------------------------ event side

    def request_key_for(self, pod: str, engine: int) -> int | None:
        """The last request key an engine key of ``pod`` maps to (``GetRequestKey``)."""
        emap = self._engine.get(pod)
        rks = emap.get(engine) if emap is not None else None
        return rks[-1] if rks else None

    def apply(self, pod: str, model: str, batch: KVEventBatch) -> None:
        """Apply one decoded batch from ``pod`` (llm-d's ``processEventBatch``)."""
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.apply_stored(pod, model, ev)
            elif isinstance(ev, BlockRemoved):
                self.remove(pod, ev.engine_keys, normalize_medium(ev.medium))
            elif isinstance(ev, AllBlocksCleared):
                self.clear_pod(pod)

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
            emap = self._engine.get(pod)
            known = [rk for ek in engine for rk in (emap.get(ek, ()) if emap else ())]
            if known:
                self._add(pod, dict.fromkeys(known), medium)
            return
        rks = chain_keys(ev.token_ids, self.block_size, model_name=name,
                         hash_seed=self.hash_seed, parent=parent_rk,
                         extra=event_extra(ev, len(ev.token_ids) // self.block_size))
        if not rks:
            return
        self._map_engine(pod, engine, rks)
        self._add(pod, dict.fromkeys(rks), medium)

    def add(self, pod: str, request_keys: Sequence[int], medium: str = DEFAULT_MEDIUM,
            engine_keys: Sequence[int] | None = None) -> None:
        """Record that ``pod`` holds ``request_keys`` on ``medium``."""
        if engine_keys:
            self._map_engine(pod, engine_keys, request_keys)
        self._add(pod, dict.fromkeys(request_keys), medium)

    def _map_engine(self, pod: str, engine: Sequence[int], rks: Sequence[int]) -> None:
        """llm-d's ``engineToRequestMapping``: proportional when the engine's block size
        differs from the EPP's."""
        if not engine or not rks:
            return
        m = self._engine.setdefault(pod, OrderedDict())
        if len(engine) == len(rks):  # the engine's block size is the EPP's: one to one
            move = m.move_to_end
            for ek, rk in zip(engine, rks, strict=True):
                m[ek] = (rk,)
                move(ek)
            while len(m) > self.max_blocks_per_pod:
                m.popitem(last=False)
            return
        n = max(len(engine), len(rks))
        mapping: dict[int, list[int]] = {}
        for i in range(n):
            ek = engine[i * len(engine) // n]
            rk = rks[i * len(rks) // n]
            mapping.setdefault(ek, []).append(rk)
        for ek, lst in mapping.items():
            m[ek] = tuple(lst)
            m.move_to_end(ek)
        while len(m) > self.max_blocks_per_pod:
            m.popitem(last=False)

    def _add(self, pod: str, rks: Iterable[int], medium: str) -> None:
        entries = self._pod_entries.get(pod)
        if entries is None:
            entries = self._pod_entries[pod] = OrderedDict()
        keys = self._keys
        admitted = 0
        for rk in rks:
            holders = keys.get(rk)
            if holders is None:  # the common case: a block no pod held
                keys[rk] = {pod: {medium}}
                entries[(rk, medium)] = None
                admitted += 1
                if len(keys) > self.max_keys:
                    self._drop_key(next(iter(keys)))
                continue
            media = holders.get(pod)
            if media is None:
                if len(holders) >= self.pods_per_key:
                    old = next(iter(holders))
                    for m in holders.pop(old):
                        self._pod_entries.get(old, OrderedDict()).pop((rk, m), None)
                        self.evictions += 1
                holders[pod] = {medium}
                entries[(rk, medium)] = None
                admitted += 1
                continue
            key = (rk, medium)
            if medium in media:
                entries.move_to_end(key)
                continue
            media.add(medium)
            entries[key] = None
            admitted += 1
        self.admissions += admitted
        while len(entries) > self.max_blocks_per_pod:
            (rk, m), _ = entries.popitem(last=False)
            self._unhold(rk, pod, m)

    def _drop_key(self, rk: int) -> None:
        for pod, media in self._keys.pop(rk, {}).items():
            for m in media:
                self._pod_entries.get(pod, OrderedDict()).pop((rk, m), None)
                self.evictions += 1

    def _unhold(self, rk: int, pod: str, medium: str) -> None:
        holders = self._keys.get(rk)
        if not holders:
            return
        media = holders.get(pod)
        if media is None or medium not in media:
            return
        media.discard(medium)
        self.evictions += 1
        if not media:
            del holders[pod]
            if not holders:
                del self._keys[rk]

    def remove(self, pod: str, engine_keys: Iterable[int], medium: str = DEFAULT_MEDIUM) -> None:
        """``BlockRemoved``: ``pod`` no longer holds these engine blocks on ``medium``."""
        emap = self._engine.get(pod)
        if not emap:
            return
        entries = self._pod_entries.get(pod, OrderedDict())
        keys = self._keys
        evicted = 0
        for ek in engine_keys:
            rks = emap.get(ek)
            if not rks:
                continue
            held = False  # still held on another medium: keep the mapping
            for rk in rks:  # (_unhold, inlined: this runs for every evicted block)
                entries.pop((rk, medium), None)
                holders = keys.get(rk)
                if not holders:
                    continue
                media = holders.get(pod)
                if media is None:
                    continue
                if medium in media:
                    media.discard(medium)
                    evicted += 1
                    if not media:
                        del holders[pod]
                        if not holders:
                            del keys[rk]
                        continue
                held = True
            if not held:
                del emap[ek]
        self.evictions += evicted

    def remove_keys(self, pod: str, request_keys: Iterable[int], medium: str) -> None:
        """Drop ``pod``'s entries for these request keys on ``medium``."""
        entries = self._pod_entries.get(pod)
        if entries is None:
            return
        for rk in request_keys:
            if entries.pop((rk, medium), 0) is None:
                self._unhold(rk, pod, medium)

    def clear_pod(self, pod: str) -> None:
        """Forget everything ``pod`` holds (``AllBlocksCleared``, a sequence gap or restart,
        the pod leaving)."""
        for (rk, m) in self._pod_entries.pop(pod, OrderedDict()):
            self._unhold(rk, pod, m)
        self._engine.pop(pod, None)

    # ------------------------------------------------------------------ introspection

    def pods(self) -> list[str]:
        return [p for p, e in self._pod_entries.items() if e]

    def blocks_of(self, pod: str) -> int:
        return len(self._pod_entries.get(pod, ()))

    def size(self) -> int:
        """Entries (request key, pod, medium) held."""
        return sum(len(e) for e in self._pod_entries.values())

    def stats(self) -> IndexStats:
        entries = self.size()
        engine = sum(len(m) for m in self._engine.values())
        return IndexStats(
            keys=len(self._keys), entries=entries, engine_keys=engine,
            pods=len(self.pods()),
            approx_bytes=entries * _BYTES_PER_ENTRY + engine * _BYTES_PER_ENGINE_KEY,
            admissions=self.admissions, evictions=self.evictions)

    @staticmethod
    def estimate_bytes(max_blocks_per_pod: int, pods: int) -> int:
        """Upper bound of the memory ``pods`` pods may take at ``max_blocks_per_pod``."""
        return pods * max_blocks_per_pod * (_BYTES_PER_ENTRY + _BYTES_PER_ENGINE_KEY)
