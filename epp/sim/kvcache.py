"""KV blocks and the prefix cache: chained block hashes, a fixed pool, LRU eviction.

Pure and synchronous (no clock, no I/O), so it is tested exactly.

Model (vLLM's automatic prefix caching, simplified)
- A prompt is cut into blocks of ``block_size`` token ids; only *full* blocks have a
  hash. Block ``i``'s hash is vLLM's: ``H((h_{i-1}, tuple(tokens_i), extra_i))`` with
  ``h_{-1} = NONE_HASH = H(seed)``, ``H`` the ``--prefix-caching-hash-algo``
  (:mod:`epp.kvcache.hashing`) and ``extra_i = (lora_name,)`` for a LoRA adapter, else
  None; the block's identity is the 64-bit int vLLM publishes in its KV events. Two
  prompts share block ``i`` only if they share every token up to its end and the
  adapter. Words are token ids by :func:`epp.sim.tokens.word_id`.
- The pool has ``capacity`` blocks. A block is *used* while at least one running
  sequence references it (``ref > 0``). A hashed block whose last reference goes away
  stays in the cache as *evictable*; evictable blocks are reused least recently released
  first (LRU), and reusing one evicts its hash. Private (unhashed) blocks hold a
  sequence's partial last prompt block and its generated tokens.
- ``usage = used / capacity`` is ``vllm:kv_cache_usage_perc``: evictable cached blocks
  are free capacity, as in vLLM.
- With ``record_events``, every eviction appends a :class:`BlockRemoved` to ``events``
  and :meth:`BlockPool.clear` an :class:`AllBlocksCleared` (or one ``BlockRemoved`` per
  forgotten block while referenced blocks stay cached); the engine adds the
  ``BlockStored`` events and publishes them (:mod:`epp.sim.kvevents`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from epp.kvcache import hashing
from epp.sim.kvevents import AllBlocksCleared, BlockRemoved, KVEvent
from epp.sim.tokens import Token, word_id

__all__ = ["DEFAULT_HASH_ALGO", "DEFAULT_HASH_SEED", "Block", "BlockPool", "block_hashes",
           "token_ids"]

DEFAULT_HASH_ALGO = hashing.DEFAULT_ALGO
"""``sha256_cbor``: what llm-d deployments pass to vLLM's ``--prefix-caching-hash-algo``."""
DEFAULT_HASH_SEED = "0"
"""The NONE_HASH seed when neither ``--hash-seed`` nor ``PYTHONHASHSEED`` is set (vLLM
would draw a random one; the simulator stays reproducible)."""


def token_ids(tokens: Sequence[Token]) -> list[int]:
    """Token ids of a token sequence: a word is :func:`~epp.sim.tokens.word_id`, an int
    is itself."""
    return [word_id(t) if isinstance(t, str) else t for t in tokens]


def block_hashes(
    tokens: Sequence[Token],
    block_size: int,
    extra: str = "",
    *,
    algo: str = DEFAULT_HASH_ALGO,
    seed: str = DEFAULT_HASH_SEED,
) -> list[int]:
    """vLLM's chained block hashes (as 64-bit event ints) of the full ``block_size``-token
    blocks of ``tokens``; ``extra`` is the LoRA adapter name ("" for the base model).

    Deterministic across processes and runs. ``len(result) == len(tokens) // block_size``.
    """
    return hashing.block_hashes(token_ids(tokens), block_size, algo=algo, seed=seed,
                                lora_name=extra or None)


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

    def __init__(self, capacity: int, *, record_events: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self.evictions = 0
        self.record_events = record_events
        self.events: list[KVEvent] = []
        """KV events since the owner last took them (only with ``record_events``)."""
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
            if self.record_events:
                self.events.append(BlockRemoved([h]))
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
        """Forget every evictable cached block (referenced blocks stay).

        Events: :class:`AllBlocksCleared` when no cached block is referenced (the cache
        is then empty, as after vLLM's ``reset_prefix_cache``), else one
        :class:`BlockRemoved` per forgotten block."""
        if self.record_events:
            if len(self._evictable) == len(self._cached):
                self.events.append(AllBlocksCleared())
            elif self._evictable:
                self.events.extend(BlockRemoved([h]) for h in self._evictable)
        for h in self._evictable:
            del self._cached[h]
        self._evictable.clear()

    def take_events(self) -> list[KVEvent]:
        """The recorded events, oldest first; the list starts again empty."""
        events, self.events = self.events, []
        return events
