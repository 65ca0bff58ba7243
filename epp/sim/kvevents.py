"""vLLM's KV-cache events, as a simulated pod publishes them: schema, encoding, ZMQ.

Written from vLLM's ``vllm/distributed/kv_events.py`` and ``vllm/config/kv_events.py``
(vllm-project/vllm main at 0181ea3173e5, read for the fields and the publisher; the
positional ``array_like`` layout is the one vLLM releases used before their switch to
map-encoded events, vllm-project/vllm#42892 — llm-d-router v0.10.0's vLLM adapter reads
both) and ``vllm/v1/core/block_pool.py`` (when each event is emitted).

Schema (msgpack; msgspec ``array_like=True`` structs, which encode *every* field in
declaration order, ``None`` included; ``tag=True`` puts the class name first)::

    KVEventBatch     = [ts: float64, events: [event...], data_parallel_rank: int]
    BlockStored      = ["BlockStored", block_hashes: [uint64...], parent_block_hash:
                        uint64 | nil, token_ids: [int...], block_size: int, lora_id:
                        int | nil, medium: "GPU", lora_name: str | nil, extra_keys:
                        [[lora_name] | nil, ...] | nil, group_idx: nil]
    BlockRemoved     = ["BlockRemoved", block_hashes: [uint64...], medium: "GPU",
                        group_idx: nil]
    AllBlocksCleared = ["AllBlocksCleared"]

Block hashes are the 64-bit ints of ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (vLLM's
default). Transport (``ZmqEventPublisher``): a PUB socket sends each batch as three
frames ``(topic, seq, payload)``, ``seq`` an 8-byte big-endian counter from 0 per
publisher; the last ``buffer_steps`` ``(seq, payload)`` pairs are kept for the ROUTER
replay socket, where a DEALER/REQ client sends ``(b"", start_seq as 8 bytes
big-endian)`` and gets one ``(b"", seq, payload)`` message per buffered batch with
``seq >= start_seq``, then ``(b"", -1 as 8 signed bytes, b"")``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack
import orjson
import zmq
import zmq.asyncio

__all__ = [
    "DEFAULT_ENDPOINT",
    "DEFAULT_TOPIC",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventPublisher",
    "KVEvent",
    "KVEventsConfig",
    "encode_batch",
    "offset_endpoint_port",
    "parse_kv_events_config",
    "pod_publisher",
]

log = logging.getLogger(__name__)

MEDIUM_GPU: Final = "GPU"
DEFAULT_ENDPOINT: Final = "tcp://*:5557"
"""vLLM's ``KVEventsConfig.endpoint`` default; llm-d's ``podDiscoveryConfig.socketPort``
default is the same 5557."""
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)


@dataclass(slots=True)
class BlockStored:
    """Full blocks entered the prefix cache (one request's newly cached blocks)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None

    def encode(self) -> list[Any]:
        return [
            "BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids,
            self.block_size, self.lora_id, self.medium, self.lora_name,
            None if self.extra_keys is None else [
                None if k is None else list(k) for k in self.extra_keys
            ],
            self.group_idx,
        ]


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks were evicted."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None

    def encode(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, self.medium, self.group_idx]


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""

    def encode(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(events: list[KVEvent], ts: float, data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload of one ``KVEventBatch``."""
    packed: bytes = msgpack.packb(
        [float(ts), [e.encode() for e in events], data_parallel_rank], use_bin_type=True
    )
    return packed


# ---------------------------------------------------------------- configuration


_KEYS: Final = frozenset({
    "enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps",
    "hwm", "max_queue_size", "topic",
})


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``KVEventsConfig``), same keys and defaults, except
    ``topic``: None means the simulator's per-pod default ``kv@<host>:<port>@<model>``
    (llm-d's topic convention). A given topic may use ``{host}``, ``{port}`` and
    ``{model}``, filled in per pod."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str | None = None

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """Parse ``--kv-events-config`` JSON; ValueError naming the bad key or value."""
    try:
        raw = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")  # noqa: TRY004 -- a CLI value error, reported by argparse
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(_KEYS))}")
    enable = raw.get("enable_kv_cache_events", False)
    if not isinstance(enable, bool):
        raise ValueError(  # noqa: TRY004 -- a CLI value error, reported by argparse
            "--kv-events-config: enable_kv_cache_events must be true or false")
    publisher = raw.get("publisher")
    if publisher is None:
        publisher = "zmq" if enable else "null"  # vLLM's __post_init__
    if publisher not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: publisher must be \"zmq\" or \"null\", got "
                         f"{publisher!r}")
    for key in ("endpoint", "replay_endpoint", "topic"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"--kv-events-config: {key} must be a string")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        value = raw.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--kv-events-config: {key} must be an integer >= 1")
    cfg = KVEventsConfig(
        enable_kv_cache_events=enable,
        publisher=publisher,
        endpoint=raw.get("endpoint") or DEFAULT_ENDPOINT,
        replay_endpoint=raw.get("replay_endpoint") or None,
        buffer_steps=raw.get("buffer_steps", 10_000),
        hwm=raw.get("hwm", 100_000),
        max_queue_size=raw.get("max_queue_size", 100_000),
        topic=raw.get("topic"),
    )
    for ep in (cfg.endpoint, cfg.replay_endpoint):
        if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kv-events-config: endpoint {ep!r} must start with tcp://, "
                             "ipc:// or inproc://")
    return cfg


def offset_endpoint_port(endpoint: str, offset: int) -> str:
    """vLLM's ``offset_endpoint_port``: ``tcp://host:P`` → ``tcp://host:P+offset``;
    ``inproc://x`` → ``inproc://x_dp<offset>``; unchanged when ``offset`` is 0."""
    if offset == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{offset}"
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit():
            return f"{base}:{int(port) + offset}"
        raise ValueError(f"KV events endpoint {endpoint!r} has no port to offset")
    return endpoint


def endpoint_port(endpoint: str) -> int | None:
    """The port of a ``tcp://`` endpoint (None for other transports)."""
    if not endpoint.startswith("tcp://"):
        return None
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() else None


def _binds(endpoint: str) -> bool:
    """vLLM's heuristic: bind a wildcard / ``::`` / ipc / inproc endpoint, else connect."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


# ---------------------------------------------------------------- the publisher


@dataclass
class EventPublisher:
    """One pod's ``ZmqEventPublisher``: PUB on ``endpoint`` (bound for a wildcard
    address, else connected), an optional ROUTER on ``replay_endpoint``, sequence
    numbers from 0, the last ``buffer_steps`` batches kept for replay.

    :meth:`publish` is synchronous and never blocks (a PUB socket drops messages past
    ``hwm``); the replay socket is served by a task on the running loop between
    :meth:`start` and :meth:`close`.
    """

    endpoint: str
    topic: str
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    data_parallel_rank: int = 0
    published: int = 0
    dropped: int = 0
    replays: int = 0
    _seq: int = 0
    _buffer: deque[tuple[int, bytes]] = field(default_factory=deque)
    _pub: zmq.Socket[bytes] | None = None
    _replay: zmq.asyncio.Socket | None = None
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Open the sockets (OSError-like ``zmq.ZMQError`` if a port is taken) and start
        serving replay requests on the running loop."""
        self._buffer = deque(maxlen=self.buffer_steps)
        pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        pub.set_hwm(self.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            if _binds(self.endpoint):
                pub.bind(self.endpoint)
            else:
                pub.connect(self.endpoint)
        except zmq.ZMQError:
            pub.close(linger=0)
            raise
        self._pub = pub
        if self.replay_endpoint is not None:
            replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            try:
                replay.bind(self.replay_endpoint)
            except zmq.ZMQError:
                replay.close(linger=0)
                self.close_sockets()
                raise
            self._replay = replay
            self._task = asyncio.get_running_loop().create_task(
                self._serve_replay(), name="epp-sim-kv-replay")

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: list[KVEvent], ts: float | None = None) -> int | None:
        """Send one batch now; return its sequence number (None when ``events`` is empty:
        vLLM publishes no empty batch)."""
        if not events or self._pub is None:
            return None
        seq = self._seq
        self._seq += 1
        payload = encode_batch(events, time.time() if ts is None else ts,
                               self.data_parallel_rank)
        frames = (self.topic.encode(), seq.to_bytes(8, "big"), payload)
        try:
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:
            self.dropped += 1
        self._buffer.append((seq, payload))
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            try:
                frames = await sock.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if len(frames) != 3:
                log.warning("sim KV events: invalid replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replays += 1
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start_seq:
                        await sock.send_multipart((client, b"", seq.to_bytes(8, "big"),
                                                   payload))
                await sock.send_multipart((client, b"", END_SEQ, b""))
            except zmq.ZMQError as exc:
                log.warning("sim KV events: replay answer failed: %s", exc)

    def close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub, self._replay = None, None

    async def close(self) -> None:
        """Stop serving replays and close the sockets (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.close_sockets()

    def snapshot(self) -> dict[str, Any]:
        """For ``GET /debug/state``."""
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
            "next_seq": self._seq,
            "published": self.published,
            "dropped": self.dropped,
            "replays": self.replays,
        }


DEFAULT_TOPIC: Final = "kv@{host}:{port}@{model}"
"""The per-pod topic when ``--kv-events-config`` names none: llm-d's
``kv@<pod-id>@<model>`` with the pod id ``<address>:<port>`` the EPP knows it by."""


def pod_publisher(
    cfg: KVEventsConfig,
    *,
    index: int,
    host: str,
    port: int,
    model: str,
    port_offset: int | None = None,
) -> EventPublisher | None:
    """The publisher of the pod serving HTTP on ``host:port``, the ``index``-th ``--port``
    of the process; None when events are off.

    Its endpoints are ``cfg``'s shifted by ``index`` (vLLM's data-parallel-rank offset;
    llm-d dials ``socketPort + rankIndex``), or, with ``port_offset``, shifted so that the
    PUB port is ``port + port_offset`` (the replay port keeps its distance to it).
    """
    if not cfg.enabled:
        return None
    if port_offset is None:
        shift = index
    else:
        base = endpoint_port(cfg.endpoint)
        if base is None:
            raise ValueError("--kv-events-port-offset needs a tcp:// endpoint with a port")
        shift = port + port_offset - base
    try:
        topic = (cfg.topic if cfg.topic is not None else DEFAULT_TOPIC).format(
            host=host, port=port, model=model)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"--kv-events-config topic {cfg.topic!r}: only {{host}}, {{port}} "
                         f"and {{model}} may be filled in ({exc})") from None
    return EventPublisher(
        endpoint=offset_endpoint_port(cfg.endpoint, shift),
        topic=topic,
        replay_endpoint=(None if cfg.replay_endpoint is None
                         else offset_endpoint_port(cfg.replay_endpoint, shift)),
        buffer_steps=cfg.buffer_steps,
        hwm=cfg.hwm,
    )
