"""The simulator's KV events (epp.sim.kvevents, the engine's event path): the bytes on the
wire decode with vLLM's schema (plain ``msgpack`` here, independent of the encoder, and
epp.kvcache.events), stored / removed / cleared follow the LRU cache, sequence numbers,
replay, and the per-pod endpoint and topic conventions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from epp.kvcache import events as epp_events
from epp.kvcache import hashing
from epp.sim.app import build_app
from epp.sim.config import SimConfig
from epp.sim.kvevents import (
    EventPublisher,
    KVEventsConfig,
    parse_kv_events_config,
    pod_publisher,
)
from epp.sim.options import build_parser, kv_events_from_args
from epp.sim.tokens import word_id
from epp.stack.procs import free_port
from tests.polling import eventually

MODEL = "m"
BS = 4


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def ids(text: str) -> list[int]:
    return [word_id(w) for w in text.split()]


class Sub:
    """A SUB socket on a pod's PUB endpoint that keeps every message it got."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.got: list[list[bytes]] = []
        self.min_seq = 0  # batches numbered below it (published before a test) are dropped

    async def drain(self) -> list[list[bytes]]:
        while await self.sock.poll(0):
            msg = await self.sock.recv_multipart()
            if int.from_bytes(msg[1], "big") >= self.min_seq:
                self.got.append(msg)
        return self.got

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
async def pod() -> AsyncIterator[tuple[TestClient[Any, Any], EventPublisher, Sub, int]]:
    pub_port, replay_port = free_port(), free_port()
    publisher = EventPublisher(endpoint=f"tcp://*:{pub_port}", topic=f"kv@127.0.0.1:8000@{MODEL}",
                               replay_endpoint=f"tcp://*:{replay_port}", buffer_steps=100)
    cfg = SimConfig(time_scale=0.0, block_size=BS, num_gpu_blocks=6, loras=("sql",))
    app = build_app("sim-a", MODEL, config=cfg, events=publisher)
    async with TestClient(TestServer(app)) as client:
        sub = Sub(pub_port)
        try:
            # Slow joiner: publish (empty-cache resets) until the subscription is live.
            async def joined() -> bool:
                await client.post("/reset_prefix_cache")
                return bool(await sub.drain())

            await eventually(joined, interval=0.05, what="SUB receives the pod's events")
            # A joining reset can still be on its way: keep only what the test publishes.
            sub.min_seq = publisher.next_seq
            sub.got.clear()
            yield client, publisher, sub, replay_port
        finally:
            sub.close()


def decode(msg: list[bytes]) -> tuple[str, int, list[Any]]:
    """vLLM's wire format read with msgpack alone: (topic, seq, [ts, events, dp_rank])."""
    assert len(msg) == 3
    topic, seq, payload = msg
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) == 3
    assert isinstance(batch[0], float) and batch[2] == 0
    return topic.decode(), int.from_bytes(seq, "big"), batch


async def post(client: TestClient[Any, Any], prompt: str, model: str = MODEL) -> None:
    resp = await client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                      "max_tokens": 1})
    assert resp.status == 200, await resp.text()


async def test_events_follow_the_lru_cache_and_decode_with_vllms_schema(pod: Any) -> None:
    client, publisher, sub, _ = pod
    a, b = words(9, "a"), words(17, "b")
    ha = hashing.block_hashes(ids(a), BS, seed="0")
    hb = hashing.block_hashes(ids(b), BS, seed="0")
    first_seq = publisher.next_seq

    await post(client, a)  # 2 full blocks cached (the 9th word is a partial block)
    await post(client, b)  # 5 blocks needed, 4 never used: A's tail (block 1) is evicted
    resp = await client.post("/reset_prefix_cache")  # nothing referenced: all cleared
    assert resp.status == 200
    msgs = await eventually(lambda: _at_least(sub, 3), what="three batches")
    decoded = [decode(m) for m in msgs]
    assert [t for t, _, _ in decoded] == [f"kv@127.0.0.1:8000@{MODEL}"] * 3
    assert [s for _, s, _ in decoded] == [first_seq, first_seq + 1, first_seq + 2]

    (stored_a,) = decoded[0][2][1]
    assert stored_a == ["BlockStored", ha, None, ids(a)[:8], BS, None, "GPU", None,
                        [None, None], None]
    removed, stored_b = decoded[1][2][1]
    assert removed == ["BlockRemoved", [ha[1]], "GPU", None]
    assert stored_b == ["BlockStored", hb, None, ids(b)[:16], BS, None, "GPU", None,
                        [None] * 4, None]
    assert decoded[2][2][1] == [["AllBlocksCleared"]]

    # The EPP's decoder reads the same bytes the same way.
    batch = epp_events.decode_batch(msgs[1][2])
    ev_removed, ev_stored = batch.events
    assert isinstance(ev_removed, epp_events.BlockRemoved)
    assert ev_removed.engine_keys == [ha[1]] and ev_removed.medium == "GPU"
    assert isinstance(ev_stored, epp_events.BlockStored)
    assert ev_stored.engine_keys == hb and ev_stored.parent_block_hash is None
    assert list(ev_stored.token_ids) == ids(b)[:16] and ev_stored.block_size == BS
    assert batch.data_parallel_rank == 0
    assert epp_events.parse_topic(epp_events.parse_frames(msgs[0])[0]) == ("127.0.0.1:8000",
                                                                          MODEL)


async def test_a_continued_prefix_stores_its_new_blocks_with_the_parent(pod: Any) -> None:
    client, _, sub, _ = pod
    base = words(8, "p")
    await post(client, base)  # blocks 0-1
    await post(client, base + " " + words(5, "q"))  # blocks 0-1 hit, block 2 new
    msgs = await eventually(lambda: _at_least(sub, 2), what="two batches")
    full = ids(base + " " + words(5, "q"))
    h = hashing.block_hashes(full, BS, seed="0")
    (stored,) = decode(msgs[1])[2][1]
    assert stored[1] == [h[2]] and stored[2] == h[1] and stored[3] == full[8:12]


async def test_lora_blocks_carry_the_adapter(pod: Any) -> None:
    client, _, sub, _ = pod
    text = words(8, "l")
    await post(client, text, model="sql")
    (msg,) = await eventually(lambda: _at_least(sub, 1), what="one batch")
    (stored,) = decode(msg)[2][1]
    h = hashing.block_hashes(ids(text), BS, seed="0", lora_name="sql")
    assert h != hashing.block_hashes(ids(text), BS, seed="0")
    assert stored == ["BlockStored", h, None, ids(text), BS, 1, "GPU", "sql",
                      [["sql"], ["sql"]], None]


async def test_replay_returns_buffered_batches_then_the_end_marker(pod: Any) -> None:
    client, publisher, sub, replay_port = pod
    start = publisher.next_seq
    await post(client, words(8, "r"))
    await post(client, words(8, "s"))
    live = await eventually(lambda: _at_least(sub, 2), what="two batches")
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        await dealer.send_multipart([b"", (start + 1).to_bytes(8, "big")])
        got = []
        while True:
            frames = await dealer.recv_multipart()
            assert frames[0] == b""
            if frames[1] == (-1).to_bytes(8, "big", signed=True):
                assert frames[2] == b""
                break
            got.append(frames[1:])
        assert got == [[live[1][1], live[1][2]]]  # only seq >= start + 1, same bytes
    finally:
        dealer.close(linger=0)
    assert publisher.replays == 1


async def _at_least(sub: Sub, n: int) -> list[list[bytes]] | None:
    got = await sub.drain()
    return got[:n] if len(got) >= n else None


# ---------------------------------------------------------------- configuration


def test_kv_events_config_is_vllms() -> None:
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert cfg.enabled and cfg.publisher == "zmq" and cfg.endpoint == "tcp://*:5557"
    assert (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size) == (10_000, 100_000, 100_000)
    assert not parse_kv_events_config('{"enable_kv_cache_events": false}').enabled
    assert not parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for bad, words_in_error in [
        ("[1]", "JSON object"), ("{", "not valid JSON"), ('{"endpont": "x"}', "endpont"),
        ('{"publisher": "kafka"}', "publisher"), ('{"hwm": 0}', "hwm"),
        ('{"endpoint": "http://x:1"}', "tcp://"),
    ]:
        with pytest.raises(ValueError, match=words_in_error):
            parse_kv_events_config(bad)


def test_each_pod_gets_its_endpoint_and_topic() -> None:
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                         replay_endpoint="tcp://*:6557")
    # vLLM's data-parallel offset (llm-d dials socketPort + rank index): the n-th --port.
    p0 = pod_publisher(cfg, index=0, host="10.0.0.5", port=8000, model="llama")
    p1 = pod_publisher(cfg, index=1, host="10.0.0.5", port=8001, model="llama")
    assert p0 is not None and p1 is not None
    assert (p0.endpoint, p0.replay_endpoint) == ("tcp://*:5557", "tcp://*:6557")
    assert (p1.endpoint, p1.replay_endpoint) == ("tcp://*:5558", "tcp://*:6558")
    assert p0.topic == "kv@10.0.0.5:8000@llama"
    # Derived from the HTTP port instead.
    p = pod_publisher(cfg, index=3, host="127.0.0.1", port=8003, model="m", port_offset=1000)
    assert p is not None and (p.endpoint, p.replay_endpoint) == ("tcp://*:9003",
                                                                  "tcp://*:10003")
    custom = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="kv@{port}@x")
    p = pod_publisher(custom, index=0, host="h", port=7, model="m")
    assert p is not None and p.topic == "kv@7@x"
    assert pod_publisher(KVEventsConfig(), index=0, host="h", port=1, model="m") is None


def test_cli_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(["--port", "8000", "--kv-events-config",
                              '{"enable_kv_cache_events": true, "topic": "t"}'])
    assert kv_events_from_args(args).topic == "t"
    args = parser.parse_args(["--port", "8000", "--kv-events-port-offset", "100"])
    with pytest.raises(ValueError, match="kv-events-config"):
        kv_events_from_args(args)
