"""KV blocks and the prefix cache: chained block hashes, a fixed pool, LRU eviction.

Pure and synchronous (no clock, no I/O), so it is tested exactly.

Model (vLLM's automatic prefix caching, simplified)
- A prompt is cut into blocks of ``block_size`` tokens; only *full* blocks have a hash.
  Block ``i``'s hash chains the previous one: ``h_i = xxh3_64(h_{i-1} ‖ extra ‖ tokens_i)``
  with ``h_{-1} = 0`` and ``extra`` the LoRA adapter name (empty for the base model), so
  two prompts share block ``i`` only if they share every token up to its end and the
  adapter.
- The pool has ``capacity`` blocks. A block is *used* while at least one running
  sequence references it (``ref > 0``). A hashed block whose last reference goes away
  stays in the cache as *evictable*; evictable blocks are reused least recently released
  first (LRU), and reusing one evicts its hash. Private (unhashed) blocks hold a
  sequence's partial last prompt block and its generated tokens.
- ``usage = used / capacity`` is ``vllm:kv_cache_usage_perc``: evictable cached blocks
  are free capacity, as in vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from epp.sim.tokens import Token

__all__ = ["Block", "BlockPool", "block_hashes"]

_SEP = "\x1f"


def block_hashes(tokens: Sequence[Token], block_size: int, extra: str = "") -> list[int]:
    """Chained 64-bit hashes of the full ``block_size``-token blocks of ``tokens``.

    Deterministic across processes and runs. ``len(result) == len(tokens) // block_size``.
    """
    out: list[int] = []
    parent = 0
    prefix = extra.encode() + b"\x00"
    words = tokens if all(type(t) is str for t in tokens) else [str(t) for t in tokens]
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, len(words) - block_size + 1, block_size):
        data = _SEP.join(words[start : start + block_size]).encode()  # type: ignore[arg-type]
        parent = digest(parent.to_bytes(8, "little") + prefix + data)
        out.append(parent)
    return out


@dataclass(slots=True, eq=False)
class Block:
    """A cached (hashed) KV block and how many running sequences reference it."""

    hash: int
    ref: int = 0


class BlockPool:
    """A fixed pool of ``capacity`` KV blocks with a hash-addressed prefix cache.

    Invariants: ``0 <= used <= capacity``; ``used + len(evictable) <= capacity``; every
    block in ``evictable`` has ``ref == 0`` and is in the cache; every cached block with
    ``ref > 0`` is counted in ``used``.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self.evictions = 0
        self._cached: dict[int, Block] = {}
        self._evictable: OrderedDict[int, Block] = OrderedDict()

    # ------------------------------------------------------------ queries

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by running sequences (0..1)."""
        return self.used / self.capacity

    @property
    def free(self) -> int:
        """Blocks not referenced by any sequence (never-used plus evictable)."""
        return self.capacity - self.used

    @property
    def num_cached(self) -> int:
        """Hashed blocks in the cache (referenced or evictable)."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[Block]:
        """The cached blocks of the longest cached prefix of ``hashes`` (at most
        ``max_blocks``). Does not change the cache."""
        hits: list[Block] = []
        for h in hashes[: max(0, max_blocks)]:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, new_blocks: int, hits: Iterable[Block] = ()) -> bool:
        """Whether :meth:`acquire` of ``hits`` then :meth:`allocate` of ``new_blocks``
        would succeed (evictable hits stop being free once acquired)."""
        revived = sum(1 for b in hits if b.ref == 0)
        return new_blocks + revived <= self.free

    # ------------------------------------------------------------ changes

    def acquire(self, hits: Iterable[Block]) -> None:
        """Reference cached blocks (prefix hits); an evictable one becomes used."""
        for b in hits:
            if b.ref == 0:
                del self._evictable[b.hash]
                self.used += 1
            b.ref += 1

    def allocate(self, n: int) -> bool:
        """Take ``n`` private blocks, evicting LRU cached blocks as needed.

        Returns False (and changes nothing) when fewer than ``n`` blocks are free.
        """
        if n > self.free:
            return False
        never_used = self.capacity - self.used - len(self._evictable)
        for _ in range(max(0, n - never_used)):
            h, _block = self._evictable.popitem(last=False)
            del self._cached[h]
            self.evictions += 1
        self.used += n
        return True

    def register(self, block_hash: int) -> Block | None:
        """Turn one private block (already counted in ``used``) into the cached block
        ``block_hash`` with one reference. Returns None, leaving the block private, when
        that hash is already cached (another sequence computed the same block)."""
        if block_hash in self._cached:
            return None
        block = Block(block_hash, ref=1)
        self._cached[block_hash] = block
        return block

    def release(self, blocks: Sequence[Block], private: int) -> None:
        """Drop one reference to each of ``blocks`` and free ``private`` private blocks.

        Blocks are released last first, so a chain's tail is evicted before its head.
        """
        for b in reversed(blocks):
            b.ref -= 1
            if b.ref == 0:
                self.used -= 1
                self._evictable[b.hash] = b
        self.used -= private

    def clear(self) -> None:
        """Forget every evictable cached block (referenced blocks stay)."""
        for h in self._evictable:
            del self._cached[h]
        self._evictable.clear()
