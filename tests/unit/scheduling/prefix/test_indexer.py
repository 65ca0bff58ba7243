"""Approximate prefix cache: block hashing and the bounded index
(epp.scheduling.prefix.indexer). The plugins on top of them:
tests/unit/scheduling/plugins/test_prefix.py."""

from __future__ import annotations

from epp.scheduling.prefix.indexer import PrefixIndex, prompt_block_hashes


def test_hashes_are_chained_full_blocks_only() -> None:
    p = "a" * 64 * 3 + "b" * 10
    h = prompt_block_hashes(p, "m", None, 64, 256)
    assert len(h) == 3  # the 10-byte tail is not a full block
    # Chained: same block content at a different position hashes differently.
    assert len(set(h)) == 3
    # A shared prefix gives the same leading hashes; a different second block diverges.
    h2 = prompt_block_hashes("a" * 64 + "c" * 128, "m", None, 64, 256)
    assert h2[0] == h[0] and h2[1] != h[1]


def test_hashes_seeded_by_model_and_salt_and_capped() -> None:
    p = "x" * 64 * 10
    base = prompt_block_hashes(p, "m", None, 64, 256)
    assert prompt_block_hashes(p, "other", None, 64, 256)[0] != base[0]
    assert prompt_block_hashes(p, "m", "salt", 64, 256)[0] != base[0]
    assert prompt_block_hashes(p, "m", None, 64, 4) == base[:4]
    assert prompt_block_hashes("short", "m", None, 64, 256) == []


def test_index_longest_leading_run() -> None:
    idx = PrefixIndex(100)
    h = list(range(1, 11))
    idx.add("a", h[:6])
    idx.add("b", h[:2])
    idx.add("c", [h[0], 99])  # another chain sharing only the first block
    assert idx.match(h, ["a", "b", "c", "d"]) == {"a": 6, "b": 2, "c": 1, "d": 0}
    idx.add("a", h)
    assert idx.match(h, ["a"]) == {"a": 10}


def test_index_is_bounded_per_endpoint_lru() -> None:
    idx = PrefixIndex(5)
    idx.add("a", [1, 2, 3, 4, 5])  # recorded tail first: 1 is the most recent
    idx.add("a", [6, 7])       # evicts the chain's tail, 5 and 4, head kept (as vLLM)
    assert idx.size() == 5
    assert idx.match([1, 2, 3, 4, 5], ["a"]) == {"a": 3}
    assert idx.match([4], ["a"]) == {"a": 0}
    assert idx.match([6, 7], ["a"]) == {"a": 2}
    for i in range(1000):
        idx.add("b", [1000 + i])
    assert idx.size() == 10 and idx.capacity("b") == 5


def test_index_forgets_removed_endpoints() -> None:
    idx = PrefixIndex(10)
    idx.add("a", [1, 2])
    idx.add("b", [1, 2])
    idx.remove_endpoint("a")
    assert idx.match([1, 2], ["a", "b"]) == {"a": 0, "b": 2}
    assert idx.size() == 2 and idx.endpoints() == ["b"]


def test_set_capacity_shrinks_at_once() -> None:
    idx = PrefixIndex(10)
    idx.add("a", list(range(10)))
    idx.set_capacity("a", 3)
    # The chain's head is its most recent part (recorded tail first): kept.
    assert idx.size() == 3 and idx.match(list(range(10)), ["a"]) == {"a": 3}
    assert idx.match([9], ["a"]) == {"a": 0}
