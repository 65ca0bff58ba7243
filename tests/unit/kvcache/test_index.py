"""The KV-block index under stored / removed / cleared events, bounds and pods leaving."""

from __future__ import annotations

from itertools import takewhile

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


def test_max_keys_bounds_the_entries_over_all_pods() -> None:
    small = BlockIndex(block_size=16, max_keys=6)
    small.apply(A, "m", batch(stored(TOKENS)))
    small.apply(B, "m", batch(stored(TOKENS)))
    assert small.size() == 6 and small.stats().entries == 6
    assert small.blocks_of(A) == 4 and small.blocks_of(B) == 2  # B's oldest dropped
    keys = small.request_keys(TOKENS, "m")
    assert small.longest_prefix(keys, [A, B])[1] == {A: 4}  # B lost the chain's start


def test_a_key_held_by_many_pods_is_known_on_all() -> None:
    # llm-d's podCacheSize (pods remembered per key) has no counterpart here
    idx = BlockIndex(block_size=16)
    pods = [f"10.0.1.{i}:8000" for i in range(15)]
    for pod in pods:
        idx.apply(pod, "m", batch(stored(TOKENS[:16])))
    keys = idx.request_keys(TOKENS[:16], "m")
    assert idx.longest_prefix(keys, pods)[1] == dict.fromkeys(pods, 1)
    assert idx.stats().keys == 1 and idx.stats().entries == 15


def test_speculative_entries_and_engine_removals_mix() -> None:
    idx = BlockIndex(block_size=16)
    ev = stored(TOKENS)
    keys = idx.request_keys(TOKENS, "m")
    idx.add(A, keys[:3], "speculative")
    idx.apply(A, "m", batch(stored(TOKENS[:32])))  # the engine holds the first two
    scores, counts, tiers = idx.longest_prefix(keys, [A])
    assert scores == {A: 3.0} and counts == {A: 3}
    assert tiers == {A: {"gpu": 2, "speculative": 3}}
    # the engine evicts block 0: the speculative entry still covers it
    idx.apply(A, "m", batch(BlockRemoved((ev.block_hashes[0],), "GPU")))
    assert idx.longest_prefix(keys, [A])[1] == {A: 3}
    idx.remove_keys(A, keys, "speculative")
    assert idx.longest_prefix(keys, [A])[1] == {}
    assert idx.size() == 1 and idx.stats().engine_keys == 1


def test_re_stored_blocks_become_the_newest() -> None:
    idx = BlockIndex(block_size=16, max_blocks_per_pod=4)
    first, second = list(range(32)), list(range(1000, 1032))
    idx.apply(A, "m", batch(stored(first)))
    idx.apply(A, "m", batch(stored(second)))
    idx.add(A, idx.request_keys(first, "m"), "gpu")  # touched again
    idx.apply(A, "m", batch(stored(list(range(2000, 2032)))))  # drops the oldest two
    assert idx.longest_prefix(idx.request_keys(first, "m"), [A])[1] == {A: 2}
    assert idx.longest_prefix(idx.request_keys(second, "m"), [A])[1] == {}
    assert idx.size() == 4 and idx.stats().admissions == 6


def test_matches_a_plain_reference_model_under_random_events() -> None:
    """Random stores, removals, offloads, speculation and clears on three pods, checked
    after every step against a dict-of-sets model of llm-d's semantics."""
    import random

    rng = random.Random(5)
    idx = BlockIndex(block_size=4)
    pods = [A, B, "10.0.0.3:8000"]
    prompts = [[rng.randrange(50) for _ in range(rng.choice((4, 8, 16, 24)))]
               for _ in range(12)]
    ref: dict[tuple[str, str], set[int]] = {}  # (pod, medium) -> request keys
    engine: dict[tuple[str, int], int] = {}  # (pod, engine hash) -> request key
    weights = {"gpu": 1.0, "cpu": 0.8}
    for step in range(600):
        pod = rng.choice(pods)
        toks = rng.choice(prompts)
        hashes = tuple(block_hashes(toks, 4, seed="0"))
        rks = idx.request_keys(toks, "m")
        op = rng.random()
        if op < 0.4:
            idx.apply(pod, "m", batch(BlockStored(hashes, None, tuple(toks), 4, None, "GPU")))
            ref.setdefault((pod, "gpu"), set()).update(rks)
            engine.update({(pod, h): rk for h, rk in zip(hashes, rks, strict=True)})
        elif op < 0.65:
            drop = hashes[rng.randrange(len(hashes)):]
            medium = rng.choice(("GPU", "CPU"))
            idx.apply(pod, "m", batch(BlockRemoved(drop, medium)))
            for h in drop:
                rk = engine.get((pod, h))
                if rk is not None:
                    ref.get((pod, medium.lower()), set()).discard(rk)
        elif op < 0.75:
            known = [h for h in hashes if (pod, h) in engine]
            idx.apply(pod, "m", batch(BlockStored(hashes, None, (), 4, None, "CPU")))
            ref.setdefault((pod, "cpu"), set()).update(engine[(pod, h)] for h in known)
        elif op < 0.9:
            idx.add(pod, rks, "speculative")
            ref.setdefault((pod, "speculative"), set()).update(rks)
            if rng.random() < 0.5:
                idx.remove_keys(pod, rks, "speculative")
                ref[(pod, "speculative")].difference_update(rks)
        elif op < 0.93:
            idx.clear_pod(pod)
            for k in [k for k in ref if k[0] == pod]:
                del ref[k]
            for k in [k for k in engine if k[0] == pod]:
                del engine[k]
        # (engine mappings of blocks no longer held on GPU or CPU may be forgotten)
        for k in [k for k in engine if not any(
                engine[k] in ref.get((k[0], m), ()) for m in ("gpu", "cpu"))]:
            del engine[k]
        probe = idx.request_keys(rng.choice(prompts), "m")
        scores, counts, tiers = idx.longest_prefix(probe, pods, weights)
        want_counts: dict[str, int] = {}
        want_scores: dict[str, float] = {}
        for p in pods:
            n, score = 0, 0.0
            for rk in probe:
                media = [m for m in ("gpu", "cpu", "speculative") if rk in ref.get((p, m), ())]
                if not media:
                    break
                n += 1
                score += max(weights.get(m, 1.0) for m in media)
            if n:
                want_counts[p], want_scores[p] = n, score
        assert counts == want_counts, step
        assert scores.keys() == want_scores.keys() and all(
            abs(scores[p] - want_scores[p]) < 1e-9 for p in scores), step
        assert idx.size() == sum(len(v) for v in ref.values()), step
        for p, by in tiers.items():
            for m, n in by.items():
                assert n == len(list(takewhile(ref.get((p, m), set()).__contains__, probe)))


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


def test_runs_of_single_block_removals_apply_in_order() -> None:
    # vLLM sends one BlockRemoved per evicted block; a run is applied as one removal, but
    # never across a store or a change of medium
    idx = BlockIndex(block_size=16)
    ev = stored(TOKENS)
    h = ev.block_hashes
    idx.apply(A, "m", batch(ev))
    keys = idx.request_keys(TOKENS, "m")
    idx.apply(A, "m", batch(
        BlockRemoved((h[3],), "GPU"), BlockRemoved((h[2],), "GPU"),
        BlockRemoved((h[1],), "GPU"), BlockRemoved((h[0],), "GPU"),
        stored(TOKENS[:32]),  # blocks 0 and 1 stored again after their removal
        BlockRemoved((h[1],), "CPU")))  # nothing held on CPU: no effect
    assert idx.longest_prefix(keys, [A])[1] == {A: 2}
    assert idx.size() == 2


def test_pending_blocks_are_those_not_held_until_the_engine_stores_them() -> None:
    idx = BlockIndex(block_size=16, max_blocks_per_pod=100)
    idx.apply(A, "m", batch(stored(TOKENS[:32])))  # A holds the first 2 blocks
    keys = idx.request_keys(TOKENS, "m")
    assert idx.add_pending(A, keys) == 2  # only the 2 it lacks are to be computed
    assert idx.add_pending(B, keys) == 4 and idx.pending_blocks(B) == 4
    assert idx.add_pending(A, keys) == 0  # the same prompt again: still 2
    # speculative entries (a medium no event named) are not "held"
    idx.add(B, keys, "speculative")
    assert idx.add_pending(B, keys) == 0 and idx.pending_blocks(B) == 4
    # the engine reports the blocks stored: no longer pending
    idx.apply(A, "m", batch(stored(TOKENS[32:], parent=block_hashes(TOKENS[:32], 16,
                                                                        seed="0")[-1])))
    assert idx.pending_blocks(A) == 0
    idx.remove_pending(B, keys[:3])
    assert idx.pending_blocks(B) == 1
    idx.clear_pod(B)
    assert idx.pending_blocks(B) == 0
    assert idx.pending_blocks("nobody") == 0
    # bounded per pod like the media
    small = BlockIndex(block_size=16, max_blocks_per_pod=3)
    small.add_pending(A, keys)
    assert small.pending_blocks(A) == 3
