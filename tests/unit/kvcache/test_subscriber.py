"""ZMQ subscribers against an in-test PUB socket (and a ROUTER replay socket)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from epp.kvcache.events import END_SEQ, BlockStored, KVEventBatch, encode_batch, encode_frames
from epp.kvcache.hashing import block_hashes
from epp.kvcache.index import BlockIndex
from epp.kvcache.subscriber import SubscriberManager, ZmqSubscriber, zmq_addresses
from tests.polling import eventually

POD = "127.0.0.1:8000"
TOPIC = f"kv@{POD}@llama"


def payload(tokens: list[int], seed: str = "0") -> bytes:
    ev = BlockStored(tuple(block_hashes(tokens, 16, seed=seed)), None, tuple(tokens), 16,
                     None, "GPU", None)
    return encode_batch(KVEventBatch(1.0, (ev,)))


def held(index: BlockIndex, tokens: list[int], pod: str = POD) -> int:
    return index.longest_prefix(index.request_keys(tokens, "llama"), [pod])[1].get(pod, 0)


class Publisher:
    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.address: str = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

    async def send(self, seq: int, data: bytes, topic: str = TOPIC) -> None:
        await self.pub.send_multipart(encode_frames(topic, seq, data))

    def close(self) -> None:
        self.pub.close(linger=0)


@pytest_asyncio.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def connected(pub: Publisher, sub: ZmqSubscriber, index: BlockIndex) -> None:
    """Slow-joiner: publish a probe (sequence 0, repeated: duplicates) until the
    subscriber has it; the tests' own sequences start at 1."""
    probe = list(range(9000, 9016))

    async def seen() -> bool:
        await pub.send(0, payload(probe))
        return held(index, probe) == 1

    await eventually(seen, interval=0.05)
    await asyncio.sleep(0.1)  # let the last probes in flight arrive
    sub.stats.messages = 0


async def test_stored_events_reach_the_index(ctx: zmq.asyncio.Context) -> None:
    index = BlockIndex(block_size=16)
    pub = Publisher(ctx)
    sub = ZmqSubscriber(index, pub.address, pod=POD, ctx=ctx)
    sub.start()
    try:
        await connected(pub, sub, index)
        toks = list(range(64))
        await pub.send(1, payload(toks))
        await eventually(lambda: held(index, toks) == 4)
        # a malformed frame and an undecodable payload are counted, not fatal
        await pub.pub.send_multipart([TOPIC.encode(), b"\0"])
        await pub.send(2, b"\xc1")
        await pub.send(3, payload(list(range(100, 116))))
        await eventually(lambda: held(index, list(range(100, 116))) == 1)
        assert sub.stats.errors == {"frame": 1, "decode": 1}
    finally:
        await sub.stop()
        pub.close()


async def test_gap_and_restart_drop_the_pods_entries(ctx: zmq.asyncio.Context) -> None:
    index = BlockIndex(block_size=16)
    pub = Publisher(ctx)
    sub = ZmqSubscriber(index, pub.address, pod=POD, ctx=ctx)
    sub.start()
    try:
        await connected(pub, sub, index)
        a, b, c = list(range(16)), list(range(100, 116)), list(range(200, 216))
        await pub.send(1, payload(a))
        await pub.send(2, payload(b))
        await eventually(lambda: held(index, b) == 1)
        await pub.send(5, payload(c))  # 3, 4 lost: what was indexed may be stale
        await eventually(lambda: held(index, c) == 1)
        assert held(index, a) == 0 and held(index, b) == 0 and sub.stats.gaps == 1
        await pub.send(6, payload(a))
        await eventually(lambda: held(index, a) == 1)
        await pub.send(0, payload(b))  # sequence back to 0: the publisher restarted
        await eventually(lambda: held(index, b) == 1)
        assert held(index, a) == 0 and held(index, c) == 0 and sub.stats.restarts == 1
        await pub.send(0, payload(c))  # a duplicate is dropped
        await asyncio.sleep(0.05)
        assert held(index, c) == 0
    finally:
        await sub.stop()
        pub.close()


async def test_gap_is_filled_from_the_replay_socket(ctx: zmq.asyncio.Context) -> None:
    index = BlockIndex(block_size=16)
    pub = Publisher(ctx)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    replay_addr = router.getsockopt_string(zmq.LAST_ENDPOINT)
    buffered = {seq: payload(list(range(seq * 100, seq * 100 + 16))) for seq in range(6)}
    requests: list[int] = []

    async def serve_replays() -> None:
        while True:
            ident, _, start = await router.recv_multipart()
            requests.append(int.from_bytes(start, "big"))
            for seq, data in sorted(buffered.items()):
                if seq >= requests[-1]:
                    await router.send_multipart([ident, b"", seq.to_bytes(8, "big"), data])
            await router.send_multipart([ident, b"", END_SEQ, b""])

    server = asyncio.create_task(serve_replays())
    sub = ZmqSubscriber(index, pub.address, pod=POD, replay_endpoint=replay_addr, ctx=ctx)
    try:
        # joining mid-stream (the first sequence seen is 2 > 0): 0 and 1 are replayed
        await sub.handle(TOPIC, 2, buffered[2])
        assert [held(index, list(range(s * 100, s * 100 + 16))) for s in range(3)] == [1] * 3
        await sub.handle(TOPIC, 4, buffered[4])  # 3 missed: replayed, nothing dropped
        assert [held(index, list(range(s * 100, s * 100 + 16))) for s in range(5)] == [1] * 5
        assert requests == [0, 3] and sub.stats.replays == 2 and sub.stats.gaps == 1
        # a replay that cannot deliver what was missed (the buffer moved on): dropped
        del buffered[5]
        await sub.handle(TOPIC, 6, payload(list(range(600, 616))))
        assert index.blocks_of(POD) == 1 and held(index, list(range(600, 616))) == 1
    finally:
        server.cancel()
        router.close(linger=0)
        pub.close()


async def test_global_socket_names_pods_by_topic(ctx: zmq.asyncio.Context) -> None:
    index = BlockIndex(block_size=16)
    probe = ctx.socket(zmq.PUB)
    probe.bind("tcp://127.0.0.1:*")
    port = probe.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    probe.close(linger=0)
    sub = ZmqSubscriber(index, f"tcp://127.0.0.1:{port}", bind=True, ctx=ctx)
    sub.start()
    pub = ctx.socket(zmq.PUB)  # an engine connecting to the EPP's socket
    pub.setsockopt(zmq.LINGER, 0)
    await eventually(lambda: sub.connected.is_set())
    pub.connect(f"tcp://127.0.0.1:{port}")
    toks = list(range(16))
    try:
        async def seen() -> bool:
            await pub.send_multipart(encode_frames("kv@10.1.1.1:8000@llama", 0, payload(toks)))
            return held(index, toks, "10.1.1.1:8000") == 1

        await eventually(seen, interval=0.05)
        assert index.pods() == ["10.1.1.1:8000"]
    finally:
        await sub.stop()
        pub.close(linger=0)


async def test_manager_reconnects_and_drops_pods_that_leave(ctx: zmq.asyncio.Context) -> None:
    index = BlockIndex(block_size=16)
    pub = Publisher(ctx)
    manager = SubscriberManager(index)
    sub = manager.ensure(POD, pub.address)
    sub._ctx = ctx  # type: ignore[assignment]  # the test's context (started lazily below)
    try:
        toks = list(range(16))
        # well above what the restarted publisher reaches while the SUB reconnects (its
        # first batches can be lost then): its sequence must read as going back, not as a gap
        seq = 100

        async def seen() -> bool:
            nonlocal seq
            seq += 1
            await pub.send(seq, payload(toks))
            return held(index, toks) == 1

        await eventually(seen, interval=0.05)
        assert manager.active() == [POD]
        # the publisher restarts on the same port: ZMQ reconnects by itself, and the
        # sequence starting again at 0 drops what the old process had announced
        address = pub.address
        pub.close()
        await asyncio.sleep(0.1)
        pub2 = ctx.socket(zmq.PUB)
        pub2.setsockopt(zmq.LINGER, 0)
        pub2.bind(address)
        other = list(range(500, 516))
        seq2 = -1

        async def seen2() -> bool:
            nonlocal seq2
            seq2 += 1
            await pub2.send_multipart(encode_frames(TOPIC, seq2, payload(other)))
            return held(index, other) == 1

        await eventually(seen2, interval=0.05)
        assert held(index, toks) == 0 and sub.stats.restarts == 1
        manager.remove(POD)
        assert index.pods() == [] and manager.active() == []
        pub2.close(linger=0)
    finally:
        await manager.shutdown()


def test_zmq_address_rule() -> None:
    assert zmq_addresses("10.0.0.1", 5557) == ("tcp://10.0.0.1:5557", None)
    assert zmq_addresses("10.0.0.1", 5557, 5558, rank=2) == (
        "tcp://10.0.0.1:5559", "tcp://10.0.0.1:5560")
    assert zmq_addresses("fd00::1", 5557)[0] == "tcp://[fd00::1]:5557"


@pytest.mark.parametrize("seed", ["0"])
def test_payload_helper(seed: str) -> None:
    assert payload(list(range(16)), seed)
