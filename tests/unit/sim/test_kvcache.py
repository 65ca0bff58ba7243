"""The simulator's KV block pool and chained block hashes (epp.sim.kvcache): exact, no clock."""

from __future__ import annotations

import pytest

from epp.sim.kvcache import BlockPool, block_hashes
from epp.sim.tokens import messages_tokens, prompt_tokens


def words(n: int, tag: str = "w") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def test_block_hashes_chain_and_ignore_the_partial_block() -> None:
    a = block_hashes(words(35), 16)
    assert len(a) == 2  # 35 tokens: two full blocks, the partial third has no hash
    assert block_hashes(words(35), 16) == a  # deterministic
    assert len(set(a)) == 2
    b = words(35)
    b[20] = "changed"  # inside block 1: block 0 is shared, block 1 is not
    hb = block_hashes(b, 16)
    assert hb[0] == a[0] and hb[1] != a[1]
    c = words(35)
    c[0] = "changed"  # block 0 differs: every later block differs too (chained)
    hc = block_hashes(c, 16)
    assert hc[0] != a[0] and hc[1] != a[1]
    # The adapter name is part of every hash.
    assert set(block_hashes(words(35), 16, "lora-a")).isdisjoint(a)
    # Same tokens at a different position hash differently.
    assert block_hashes(words(32)[16:] + words(16), 16)[1] != a[0]


def test_tokens_are_whitespace_words_and_ids() -> None:
    assert prompt_tokens("a  b\nc") == ["a", "b", "c"]
    assert prompt_tokens(["a b", "c"]) == ["a", "b", "c"]
    assert prompt_tokens([[1, 2], [3]]) == [1, 2, 3]
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi there"}, {"type": "image"}]},
    ]
    assert messages_tokens(msgs) == ["be", "brief", "hi", "there"]


def test_pool_lookup_acquire_release_and_lru_eviction() -> None:
    pool = BlockPool(6)
    ha, hb = block_hashes(words(12, "a"), 4), block_hashes(words(12, "b"), 4)
    # Sequence A: 3 private blocks, then registered as cached as they are computed.
    assert pool.allocate(3) and pool.used == 3
    blocks_a = [pool.register(h) for h in ha]
    assert all(b is not None for b in blocks_a)
    assert pool.register(ha[0]) is None  # already cached: stays private
    pool.release([b for b in blocks_a if b is not None], 0)
    assert pool.used == 0 and pool.num_evictable == 3 and pool.usage == 0.0
    # A hit revives an evictable block: it counts as used again.
    hits = pool.lookup(ha, 2)
    assert len(hits) == 2
    assert pool.can_allocate(4, hits) and not pool.can_allocate(5, hits)
    pool.acquire(hits)
    assert pool.used == 2 and pool.num_evictable == 1
    pool.release(hits, 0)
    # Sequence B fills the pool: never-used blocks first, then the LRU evictable ones.
    assert pool.allocate(3)
    assert pool.evictions == 0
    blocks_b = [pool.register(h) for h in hb]
    assert pool.allocate(1)  # needs one eviction: A's tail (released first) goes first
    assert pool.evictions == 1
    assert ha[2] not in pool and ha[0] in pool and ha[1] in pool
    assert not pool.allocate(3)  # only 2 free (both evictable)
    assert pool.used == 4 and pool.usage == pytest.approx(4 / 6)
    pool.release([b for b in blocks_b if b is not None], 1)
    assert pool.used == 0
    pool.clear()
    assert pool.num_cached == 0


def test_shared_block_is_evictable_only_when_every_holder_released_it() -> None:
    pool = BlockPool(2)
    (h,) = block_hashes(words(4), 4)
    assert pool.allocate(1)
    block = pool.register(h)
    assert block is not None
    hits = pool.lookup([h], 1)
    pool.acquire(hits)  # a second sequence shares it
    assert block.ref == 2 and pool.used == 1
    pool.release([block], 0)
    assert pool.num_evictable == 0 and pool.used == 1
    pool.release(hits, 0)
    assert pool.num_evictable == 1 and pool.used == 0


def test_pool_rejects_bad_capacity() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
