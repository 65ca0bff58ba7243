"""The KV-block index under stored / removed / cleared events, bounds and pods leaving."""

from __future__ import annotations

from epp.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from epp.kvcache.hashing import block_hashes
from epp.kvcache.index import BlockIndex, event_extra

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
TOKENS = list(range(100, 164))  # 4 blocks of 16


def stored(tokens: list[int], *, parent: int | None = None, medium: str | None = "GPU",
           lora: str | None = None, extra: tuple[object, ...] | None = None,
           block_size: int = 16, seed: str = "0") -> BlockStored:
    hashes = tuple(block_hashes(tokens, block_size, seed=seed))
    return BlockStored(hashes, parent, tuple(tokens), block_size, None, medium, lora, extra)


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(1.0, tuple(events))  # type: ignore[arg-type]


def test_stored_blocks_are_found_by_request_keys() -> None:
    idx = BlockIndex(block_size=16)
    idx.apply(A, "llama", batch(stored(TOKENS)))
    keys = idx.request_keys(TOKENS + [1, 2, 3], "llama")  # the partial block is not hashed
    assert len(keys) == 4
    scores, counts, tiers = idx.longest_prefix(keys, [A, B])
    assert scores == {A: 4.0} and counts == {A: 4} and tiers == {A: {"gpu": 4}}
    # another model's keys differ
    assert idx.longest_prefix(idx.request_keys(TOKENS, "other"), [A])[0] == {}


def test_child_block_chains_through_the_parent_engine_hash() -> None:
    idx = BlockIndex(block_size=16)
    first = stored(TOKENS[:32])
    idx.apply(A, "m", batch(first))
    parent = first.block_hashes[-1]
    assert isinstance(parent, int)
    child = BlockStored(tuple(block_hashes(TOKENS, 16, seed="0")[2:]), parent,
                        tuple(TOKENS[32:]), 16, None, "GPU", None)
    idx.apply(A, "m", batch(child))
    assert idx.longest_prefix(idx.request_keys(TOKENS, "m"), [A])[1] == {A: 4}
    # a child whose parent is unknown is skipped (llm-d does the same)
    idx.apply(B, "m", batch(child))
    assert idx.blocks_of(B) == 0


def test_removed_blocks_break_the_prefix() -> None:
    idx = BlockIndex(block_size=16)
    ev = stored(TOKENS)
    idx.apply(A, "m", batch(ev))
    idx.apply(B, "m", batch(ev))
    idx.apply(A, "m", batch(BlockRemoved((ev.block_hashes[1],), "GPU")))
    keys = idx.request_keys(TOKENS, "m")
    assert idx.longest_prefix(keys, [A, B])[1] == {A: 1, B: 4}
    idx.apply(B, "m", batch(BlockRemoved((ev.block_hashes[0],), "GPU")))
    assert idx.longest_prefix(keys, [A, B])[1] == {A: 1}


def test_medium_weights_and_offload() -> None:
    idx = BlockIndex(block_size=16)
    ev = stored(TOKENS)
    idx.apply(A, "m", batch(ev))
    # offloaded to CPU: a store without tokens names the known blocks on another medium
    idx.apply(A, "m", batch(BlockStored(ev.block_hashes, None, (), 16, None, "CPU", None)))
    idx.apply(A, "m", batch(BlockRemoved(ev.block_hashes, "GPU")))
    keys = idx.request_keys(TOKENS, "m")
    scores, counts, tiers = idx.longest_prefix(keys, [A])
    assert counts == {A: 4} and tiers == {A: {"cpu": 4}}
    assert abs(scores[A] - 3.2) < 1e-9  # CPU blocks weigh 0.8


def test_all_blocks_cleared_and_pod_leaving() -> None:
    idx = BlockIndex(block_size=16)
    idx.apply(A, "m", batch(stored(TOKENS)))
    idx.apply(B, "m", batch(stored(TOKENS)))
    idx.apply(A, "m", batch(AllBlocksCleared()))
    keys = idx.request_keys(TOKENS, "m")
    assert idx.longest_prefix(keys, [A, B])[1] == {B: 4}
    idx.clear_pod(B)
    assert idx.size() == 0 and idx.pods() == []
    assert idx.stats().engine_keys == 0


def test_per_pod_bound_drops_the_oldest_blocks() -> None:
    idx = BlockIndex(block_size=16, max_blocks_per_pod=3)
    first, second = list(range(32)), list(range(1000, 1032))
    idx.apply(A, "m", batch(stored(first)))
    idx.apply(A, "m", batch(stored(second)))
    assert idx.blocks_of(A) == 3
    assert idx.longest_prefix(idx.request_keys(first, "m"), [A])[1] == {}  # oldest gone
    assert idx.longest_prefix(idx.request_keys(second, "m"), [A])[1] == {A: 2}
    # B is not affected by A's bound
    idx.apply(B, "m", batch(stored(first)))
    assert idx.blocks_of(B) == 2
    assert idx.stats().approx_bytes > 0


def test_pods_per_key_and_max_keys() -> None:
    idx = BlockIndex(block_size=16, pods_per_key=1)
    idx.apply(A, "m", batch(stored(TOKENS[:16])))
    idx.apply(B, "m", batch(stored(TOKENS[:16])))
    keys = idx.request_keys(TOKENS[:16], "m")
    assert idx.longest_prefix(keys, [A, B])[1] == {B: 1}
    assert idx.blocks_of(A) == 0
    small = BlockIndex(block_size=16, max_keys=2)
    small.apply(A, "m", batch(stored(TOKENS)))
    assert small.stats().keys == 2


def test_engine_block_size_differs_from_the_epps() -> None:
    # engine blocks of 32 tokens, EPP blocks of 16: keys recomputed, removal maps back
    idx = BlockIndex(block_size=16)
    ev = stored(TOKENS, block_size=32)
    idx.apply(A, "m", batch(ev))
    keys = idx.request_keys(TOKENS, "m")
    assert idx.longest_prefix(keys, [A])[1] == {A: 4}
    idx.apply(A, "m", batch(BlockRemoved((ev.block_hashes[1],), "GPU")))
    assert idx.longest_prefix(keys, [A])[1] == {A: 2}


def test_lora_and_cache_salt_keys() -> None:
    idx = BlockIndex(block_size=16)
    extra = (("adapter", "salt"),) + (("adapter",),) * 3
    idx.apply(A, "base", batch(stored(TOKENS, lora="adapter", extra=extra)))
    # the request names the adapter as its model and carries the salt
    assert idx.longest_prefix(idx.request_keys(TOKENS, "adapter", "salt"), [A])[1] == {A: 4}
    assert idx.longest_prefix(idx.request_keys(TOKENS, "adapter"), [A])[1] == {}
    assert event_extra(stored(TOKENS, lora="adapter", extra=extra), 4) == [
        [{"Hash": "salt"}], None, None, None]


def test_speculative_keys_can_be_removed() -> None:
    idx = BlockIndex(block_size=16)
    keys = idx.request_keys(TOKENS, "m")
    idx.add(A, keys, "speculative")
    assert idx.longest_prefix(keys, [A])[1] == {A: 4}
    idx.remove_keys(A, keys, "speculative")
    assert idx.size() == 0
