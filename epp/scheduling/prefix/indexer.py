"""Approximate prefix-cache index: which endpoint probably holds which prompt blocks.

The prompt (as the model sees it) is cut into blocks of ``block_chars`` bytes of its UTF-8
text (``blockSizeTokens`` × 4 characters, ~16 tokens); block *i*'s hash is
``xxh3_64(block_i, seed=hash_{i-1})``, the chain seeded with a hash of the model name and
``cache_salt``, so a block hash identifies the whole prefix up to it. Only the first
``max_blocks`` full blocks are hashed (a trailing partial block never is).

Each endpoint has an LRU of block hashes bounded by its capacity; a reverse map
hash → endpoints answers "longest leading run of blocks per endpoint" in one pass.
Memory is bounded by Σ capacity over endpoints (each stored hash costs one LRU entry and
one reverse-map membership, ~200 bytes in CPython).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import xxhash

_hash = xxhash.xxh3_64_intdigest


def prompt_block_hashes(prompt: str, model: str, cache_salt: str | None, block_chars: int,
                        max_blocks: int) -> list[int]:
    """Chained hashes of the first ``max_blocks`` full blocks of ``prompt``."""
    data = prompt[: block_chars * max_blocks].encode("utf-8", "surrogatepass")
    n = min(len(data) // block_chars, max_blocks)
    if n == 0:
        return []
    h = _hash(f"{model}\x00{cache_salt or ''}".encode("utf-8", "surrogatepass"))
    view = memoryview(data)
    out = []
    for i in range(n):
        h = _hash(view[i * block_chars:(i + 1) * block_chars], h)
        out.append(h)
    return out


class PrefixIndex:
    """Per-endpoint LRUs of block hashes plus a reverse map, bounded per endpoint."""

    def __init__(self, default_capacity: int) -> None:
        if default_capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.default_capacity = default_capacity
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        self._holders: dict[int, set[str]] = {}

    def set_capacity(self, endpoint: str, capacity: int) -> None:
        """Override one endpoint's capacity (autoTune); shrinking evicts at once."""
        self._capacity[endpoint] = max(1, capacity)
        lru = self._lru.get(endpoint)
        if lru is not None:
            self._evict(endpoint, lru)

    def capacity(self, endpoint: str) -> int:
        return self._capacity.get(endpoint, self.default_capacity)

    def _evict(self, endpoint: str, lru: OrderedDict[int, None]) -> None:
        cap = self.capacity(endpoint)
        holders = self._holders
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            s = holders.get(h)
            if s is not None:
                s.discard(endpoint)
                if not s:
                    del holders[h]

    def add(self, endpoint: str, hashes: Sequence[int]) -> None:
        """Record that ``endpoint`` now holds these blocks (most recent use).

        Recorded tail first, so a chain's head is its most recently used block and is
        evicted last — as vLLM frees a sequence's blocks tail first. Any block is then
        used (added or refreshed) together with every block before it in its chain, so
        the blocks of a chain an endpoint holds are always a leading run: :meth:`match`
        relies on it.
        """
        if not hashes:
            return
        lru = self._lru.get(endpoint)
        if lru is None:
            lru = self._lru[endpoint] = OrderedDict()
        holders = self._holders
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                s = holders.get(h)
                if s is None:
                    holders[h] = {endpoint}
                else:
                    s.add(endpoint)
        self._evict(endpoint, lru)

    def match(self, hashes: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """Longest leading run of ``hashes`` held by each of ``endpoints`` (0 if none).

        Only endpoints holding the first block can match. What an endpoint holds of a
        chain is a leading run (see :meth:`add`), so its length is found by binary search:
        O(log n) lookups per such endpoint instead of a pass over every block
        (bench/sched_micro.py).
        """
        result = dict.fromkeys(endpoints, 0)
        if not hashes:
            return result
        first = self._holders.get(hashes[0])
        if not first:
            return result
        n = len(hashes)
        last = hashes[n - 1]
        lrus = self._lru
        for e in first:
            if e not in result:
                continue
            lru = lrus[e]
            if last in lru:
                result[e] = n
                continue
            lo, hi = 1, n - 1  # invariant: hashes[lo - 1] held, hashes[hi] not held
            while lo < hi:
                mid = (lo + hi) // 2
                if hashes[mid] in lru:
                    lo = mid + 1
                else:
                    hi = mid
            result[e] = lo
        return result

    def remove_endpoint(self, endpoint: str) -> None:
        lru = self._lru.pop(endpoint, None)
        self._capacity.pop(endpoint, None)
        if lru is None:
            return
        holders = self._holders
        for h in lru:
            s = holders.get(h)
            if s is not None:
                s.discard(endpoint)
                if not s:
                    del holders[h]

    def size(self) -> int:
        """Blocks stored over all endpoints."""
        return sum(len(lru) for lru in self._lru.values())

    def endpoints(self) -> list[str]:
        return list(self._lru)
