"""Decoding vLLM's KV-event batches (fixtures: tests/fixtures/vllm-kv-events/README.md)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from epp.kvcache.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEventBatch,
    decode_batch,
    encode_batch,
    encode_frames,
    parse_frames,
    parse_topic,
)
from epp.kvcache.hashing import engine_key

FIXTURES = Path(__file__).parents[2] / "fixtures" / "vllm-kv-events"
DIGEST = bytes(range(32))


@pytest.mark.parametrize("name", ["batch_array_like", "batch_array_events_map", "batch_map"])
def test_fixture_decodes(name: str) -> None:
    batch = decode_batch((FIXTURES / f"{name}.msgpack").read_bytes())
    assert batch.ts == 1700000000.5 and batch.data_parallel_rank == 0
    stored, child, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (111, 222) and stored.parent_block_hash is None
    assert stored.token_ids == tuple(range(1, 9)) and stored.block_size == 4
    assert (stored.lora_id, stored.medium, stored.lora_name, stored.extra_keys) == (
        None, "GPU", None, None)
    assert isinstance(child, BlockStored)
    assert child.block_hashes == (DIGEST,) and child.parent_block_hash == 222
    assert child.engine_keys == [int.from_bytes(DIGEST[-8:], "big")]
    assert child.parent_engine_key == 222
    assert (child.lora_id, child.medium, child.lora_name) == (7, "CPU", "my-lora")
    assert child.extra_keys == (("my-lora",),)
    assert removed == BlockRemoved(block_hashes=(111,), medium="GPU")
    assert cleared == AllBlocksCleared()


@pytest.mark.parametrize(("name", "layout"), [("batch_array_like", "array"), ("batch_map", "map")])
def test_encoding_matches_msgspec_bytes(name: str, layout: str) -> None:
    raw = (FIXTURES / f"{name}.msgpack").read_bytes()
    assert encode_batch(decode_batch(raw), layout=layout) == raw


def test_older_shorter_arrays_decode() -> None:
    # vLLM before lora_name/extra_keys: BlockStored with 5 fields, BlockRemoved with 1.
    raw = msgpack.packb([1.0, [["BlockStored", [1], None, [5, 6], 2, None],
                               ["BlockRemoved", [1]]]])
    b = decode_batch(raw)
    assert b.events[0] == BlockStored((1,), None, (5, 6), 2)
    assert b.events[1] == BlockRemoved((1,))
    assert b.data_parallel_rank is None


def test_single_block_removals_decode_alike_in_both_layouts() -> None:
    # (the common event, decoded on a fast path)
    events = (BlockRemoved((1,), "GPU"), BlockRemoved((2**64 - 1, b"\x01"), None, 3),
              BlockRemoved((), "CPU", 0))
    for layout in ("array", "map"):
        got = decode_batch(encode_batch(KVEventBatch(1.0, events), layout=layout))
        assert got.events == events, layout


@pytest.mark.parametrize(("payload", "message"), [
    (b"\xc1", "not msgpack"),
    (msgpack.packb("x"), "neither an array nor a map"),
    (msgpack.packb([1.0, [["Nope"]]]), "unknown vLLM event tag: Nope"),
    (msgpack.packb([1.0, [["BlockStored", [1], None]]]), "need at least 4 fields"),
    (msgpack.packb([1.0, [["BlockStored", ["x"], None, [1], 1, None]]]), "block_hashes"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, ["a"], 1, None]]]), "token_ids"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [-1], 1, None]]]), "non-negative 64-bit"),
    (msgpack.packb([1.0, [{"block_hashes": [1]}]]), '"type" tag'),
    (msgpack.packb([1.0, [["BlockRemoved", [True]]]]), "BlockRemoved: block_hashes"),
    (msgpack.packb([1.0, [["BlockRemoved", [1], 7]]]), "BlockRemoved: medium"),
    (msgpack.packb([1.0, [["BlockRemoved", [1], "GPU", "x"]]]), "BlockRemoved: group_idx"),
    (msgpack.packb(["now", []]), "ts is not a number"),
])
def test_bad_payloads_are_named(payload: bytes, message: str) -> None:
    with pytest.raises(EventDecodeError, match=message):
        decode_batch(payload)


def test_frames_and_topic() -> None:
    frames = encode_frames("kv@10.0.0.1:8000@llama", 7, b"p")
    assert frames[1] == (7).to_bytes(8, "big")
    assert parse_frames(frames) == ("kv@10.0.0.1:8000@llama", 7, b"p")
    assert parse_topic("kv@10.0.0.1:8000@llama") == ("10.0.0.1:8000", "llama")
    assert parse_topic("other") == ("other", "")
    with pytest.raises(EventDecodeError, match="3 frames"):
        parse_frames([b"t", b"\0" * 8])
    with pytest.raises(EventDecodeError, match="3 frames"):
        parse_frames([b"t", b"\0", b"p"])
    assert int.from_bytes(END_SEQ, "big", signed=True) == -1


def test_engine_key_of_negative_int_hash() -> None:
    # msgpack may carry a hash above 2**63 as a negative int64 (Go's int64 decode path)
    b = decode_batch(encode_batch(KVEventBatch(1.0, (BlockRemoved((-2,)),))))
    assert b.events[0].engine_keys == [engine_key(-2)] == [2**64 - 2]  # type: ignore[union-attr]
