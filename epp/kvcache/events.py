"""vLLM's KV-cache events: the ZMQ frames and the msgpack event batches.

Reference (read, not copied): vLLM ``vllm/distributed/kv_events.py``
(vllm-project/vllm main, commit 0181ea3173e5: ``EventBatch``, ``KVEventBatch``,
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, ``ZmqEventPublisher``) and
llm-d-router v0.10.0 ``pkg/kvevents/engineadapter/vllm_adapter.go`` / ``common.go`` /
``pkg/kvevents/zmq_subscriber.go`` (how llm-d decodes them).

Wire format
-----------
Each message on vLLM's PUB socket is three frames::

    [topic (utf-8), sequence (8 bytes, big-endian unsigned), payload (msgpack)]

The sequence starts at 0 when the publisher starts and grows by one per batch; a lower
number than the last one seen means the publisher restarted. The replay socket (a
ROUTER) takes ``[b"", start_seq (8 bytes BE)]`` from a DEALER and answers
``[b"", seq, payload]`` for every buffered batch with ``seq >= start_seq``, then
``[b"", END_SEQ, b""]`` with ``END_SEQ = (-1).to_bytes(8, "big", signed=True)``.

llm-d's topic convention is ``kv@<pod-id>@<model-name>`` (vLLM's ``--kv-events-config
'{"topic": ...}'``; llm-d subscribes with the prefix filter ``kv@``).

The payload is ``msgspec.msgpack.Encoder().encode(KVEventBatch(...))``. Two layouts exist:

* **array_like** (vLLM's structs declared ``array_like=True``, the layout llm-d's
  ``msgpackVLLMEventBatch`` reads): the batch is ``[ts, events, data_parallel_rank?]``
  and each event is a tagged array ``[tag, field1, field2, ...]`` (msgspec writes every
  field; older vLLM versions have fewer fields, so readers accept shorter arrays);
* **map** (later vLLM, vllm-project/vllm#42892): the batch is ``{"ts", "events",
  "data_parallel_rank"?}`` and each event ``{"type": tag, field: value, ...}``, fields
  equal to their default left out (``omit_defaults=True``). vLLM versions in between
  send an array batch holding map events; all three combinations decode.

The tag is the class name (msgspec ``tag=True``). Field order (llm-d's converters):

* ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window (``lora_id``, ``medium`` and ``lora_name`` have no
  default, so they are always present; the rest default to None);
* ``BlockRemoved``: block_hashes, medium, group_idx;
* ``AllBlocksCleared``: no fields.

Block hashes are 64-bit ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, vLLM's default)
or raw digest bytes; both decode to the 64-bit engine key llm-d uses
(:func:`epp.kvcache.hashing.engine_key`).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from epp.kvcache.hashing import engine_key

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventDecodeError",
    "KVEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "encode_frames",
    "parse_frames",
    "parse_topic",
]

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
TAG_STORED: Final = "BlockStored"
TAG_REMOVED: Final = "BlockRemoved"
TAG_CLEARED: Final = "AllBlocksCleared"

_STORED_FIELDS: Final = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_STORED_REQUIRED: Final = 7  # up to lora_name: fields without a default in vLLM
_REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx")
_REMOVED_REQUIRED: Final = 2


_U64: Final = (1 << 64) - 1
_INT: Final = frozenset({int})


def engine_keys(hashes: Sequence[int | bytes]) -> list[int]:
    """:func:`~epp.kvcache.hashing.engine_key` of each hash (ints, the common case, at
    C speed)."""
    if set(map(type, hashes)) <= _INT:
        return [h & _U64 for h in hashes]  # type: ignore[operator]  # ints, checked above
    return [engine_key(h) for h in hashes]


class EventDecodeError(ValueError):
    """A frame or payload that is not a vLLM KV-event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks a pod now holds. ``block_hashes`` are the engine's (int or bytes, as sent);
    :attr:`engine_keys` gives their 64-bit keys."""

    block_hashes: tuple[int | bytes, ...]
    parent_block_hash: int | bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None

    @property
    def engine_keys(self) -> list[int]:
        return engine_keys(self.block_hashes)

    @property
    def parent_engine_key(self) -> int | None:
        return None if self.parent_block_hash is None else engine_key(self.parent_block_hash)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int | bytes, ...]
    medium: str | None = None
    group_idx: int | None = None

    @property
    def engine_keys(self) -> list[int]:
        return engine_keys(self.block_hashes)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    ts: float
    events: tuple[KVEvent, ...] = field(default_factory=tuple)
    data_parallel_rank: int | None = None


# ----------------------------------------------------------------------------- frames


def parse_frames(frames: Sequence[bytes]) -> tuple[str, int, bytes]:
    """``(topic, seq, payload)`` of a PUB message; :class:`EventDecodeError` unless it is
    three frames with an 8-byte sequence (llm-d's ``parseEventFrame``)."""
    if len(frames) != 3 or len(frames[1]) < 8:
        raise EventDecodeError(
            f"malformed KV-event message: expected 3 frames [topic, seq(8 bytes), payload], "
            f"got {len(frames)} frame(s)"
        )
    try:
        topic = bytes(frames[0]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise EventDecodeError(f"KV-event topic is not UTF-8: {e}") from None
    return topic, int.from_bytes(bytes(frames[1])[:8], "big"), bytes(frames[2])


def encode_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The three frames vLLM's ``ZmqEventPublisher`` sends."""
    return [topic.encode("utf-8"), seq.to_bytes(8, "big"), payload]


def parse_topic(topic: str) -> tuple[str, str]:
    """``(pod_id, model)`` from llm-d's ``kv@<pod-id>@<model>``; ``(topic, "")`` for any
    other topic (llm-d's ``parseTopic``)."""
    parts = topic.split("@")
    if len(parts) == 3:
        return parts[1], parts[2]
    return topic, ""


# ----------------------------------------------------------------------------- decoding


def _hash(v: Any, what: str) -> int | bytes:
    if isinstance(v, bool) or not isinstance(v, int | bytes):
        raise EventDecodeError(f"{what}: expected an int or bytes block hash, got {type(v).__name__}")
    if isinstance(v, bytes) and not v:
        raise EventDecodeError(f"{what}: empty block hash")
    return v


def _hashes(v: Any, what: str) -> tuple[int | bytes, ...]:
    if not isinstance(v, list | tuple):
        raise EventDecodeError(f"{what}: expected an array, got {type(v).__name__}")
    if set(map(type, v)) <= _INT:  # the common case, checked at C speed (bool is not int)
        return tuple(v)
    return tuple(_hash(h, what) for h in v)



def _token_ids(v: Any) -> tuple[int, ...]:
    # array's conversion checks type and range in C (a negative id, one of 2**64 or more
    # or a non-integer raises); it reads msgpack's true/false as 1/0, which no engine sends.
    try:
        if not isinstance(v, list | tuple):
            raise TypeError
        array("Q", v)
    except (TypeError, OverflowError):
        raise EventDecodeError(
            "BlockStored: token_ids is not an array of non-negative 64-bit integers") from None
    return tuple(v)


def _opt_int(v: Any, what: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise EventDecodeError(f"{what}: expected an integer, got {type(v).__name__}")
    return v


def _opt_str(v: Any, what: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise EventDecodeError(f"{what}: expected a string, got {type(v).__name__}")
    return v


def _freeze(v: Any) -> Any:
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    return v


def _positional(raw: Any) -> list[Any]:
    """An event as ``[tag, fields...]`` whichever layout it came in."""
    if isinstance(raw, list | tuple):
        if not raw or not isinstance(raw[0], str):
            raise EventDecodeError("malformed tagged event: no string tag")
        return list(raw)
    if isinstance(raw, Mapping):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise EventDecodeError('map-encoded event without a string "type" tag')
        order: tuple[str, ...] = ()
        if tag == TAG_STORED:
            order = _STORED_FIELDS
        elif tag == TAG_REMOVED:
            order = _REMOVED_FIELDS
        return [tag, *(raw.get(k) for k in order)]
    raise EventDecodeError(f"event is neither an array nor a map: {type(raw).__name__}")


def _at(fields: list[Any], i: int) -> Any:
    return fields[i] if i < len(fields) else None


def _removed_fast(raw: Any) -> BlockRemoved | None:
    """The common event — vLLM removes blocks one per event — decoded without the general
    path's copies, or None when it is anything else (then decoded the general way)."""
    if type(raw) is not tuple or not 2 <= len(raw) <= 4 or raw[0] != TAG_REMOVED:
        return None
    hashes = raw[1]
    medium = raw[2] if len(raw) > 2 else None
    group = raw[3] if len(raw) > 3 else None
    if (type(hashes) is tuple and set(map(type, hashes)) <= _INT
            and (medium is None or type(medium) is str)
            and (group is None or type(group) is int)):
        return BlockRemoved(hashes, medium, group)
    return None


def decode_event(raw: Any) -> KVEvent:
    fast = _removed_fast(raw)
    if fast is not None:
        return fast
    f = _positional(raw)
    tag = f[0]
    if tag == TAG_STORED:
        if len(f) < 5:
            raise EventDecodeError(f"BlockStored: need at least 4 fields, got {len(f) - 1}")
        tokens = _token_ids(f[3])
        block_size = _opt_int(f[4], "BlockStored: block_size")
        if block_size is None:
            raise EventDecodeError("BlockStored: block_size is missing")
        extra = _at(f, 8)
        if extra is not None and not isinstance(extra, list | tuple):
            raise EventDecodeError("BlockStored: extra_keys is not an array")
        parent = f[2]
        return BlockStored(
            block_hashes=_hashes(f[1], "BlockStored: block_hashes"),
            parent_block_hash=None if parent is None else _hash(parent, "BlockStored: parent_block_hash"),
            token_ids=tokens,
            block_size=block_size,
            lora_id=_opt_int(_at(f, 5), "BlockStored: lora_id"),
            medium=_opt_str(_at(f, 6), "BlockStored: medium"),
            lora_name=_opt_str(_at(f, 7), "BlockStored: lora_name"),
            extra_keys=None if extra is None else _freeze(extra),
            group_idx=_opt_int(_at(f, 9), "BlockStored: group_idx"),
            kv_cache_spec_kind=_opt_str(_at(f, 10), "BlockStored: kv_cache_spec_kind"),
            kv_cache_spec_sliding_window=_opt_int(_at(f, 11), "BlockStored: kv_cache_spec_sliding_window"),
        )
    if tag == TAG_REMOVED:
        if len(f) < 2:
            raise EventDecodeError("BlockRemoved: block_hashes is missing")
        return BlockRemoved(
            block_hashes=_hashes(f[1], "BlockRemoved: block_hashes"),
            medium=_opt_str(_at(f, 2), "BlockRemoved: medium"),
            group_idx=_opt_int(_at(f, 3), "BlockRemoved: group_idx"),
        )
    if tag == TAG_CLEARED:
        return AllBlocksCleared()
    raise EventDecodeError(f"unknown vLLM event tag: {tag}")


def decode_batch(payload: bytes) -> KVEventBatch:
    """A ``KVEventBatch`` from its msgpack payload (array_like or map layout)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise EventDecodeError(f"KV-event payload is not msgpack: {e}") from None
    if isinstance(raw, list | tuple):
        ts, events, dp = _at(list(raw), 0), _at(list(raw), 1), _at(list(raw), 2)
    elif isinstance(raw, Mapping):
        ts, events, dp = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise EventDecodeError(f"KV-event batch is neither an array nor a map: {type(raw).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise EventDecodeError("KV-event batch: ts is not a number")
    if not isinstance(events, list | tuple):
        raise EventDecodeError("KV-event batch: events is not an array")
    return KVEventBatch(
        ts=float(ts),
        events=tuple(decode_event(e) for e in events),
        data_parallel_rank=_opt_int(dp, "KV-event batch: data_parallel_rank"),
    )


# ----------------------------------------------------------------------------- encoding


def _plain(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def _event_values(ev: KVEvent) -> tuple[str, tuple[str, ...], list[Any], int]:
    if isinstance(ev, BlockStored):
        vals = [_plain(getattr(ev, k)) for k in _STORED_FIELDS]
        return TAG_STORED, _STORED_FIELDS, vals, _STORED_REQUIRED
    if isinstance(ev, BlockRemoved):
        vals = [_plain(getattr(ev, k)) for k in _REMOVED_FIELDS]
        return TAG_REMOVED, _REMOVED_FIELDS, vals, _REMOVED_REQUIRED
    return TAG_CLEARED, (), [], 0


def encode_batch(batch: KVEventBatch, *, layout: str = "array") -> bytes:
    """The msgpack payload vLLM's publisher would send for ``batch``: ``layout="array"``
    (array_like structs, what llm-d v0.10.0 decodes natively) or ``"map"``."""
    if layout not in ("array", "map"):
        raise ValueError(f"layout must be 'array' or 'map', got {layout!r}")
    events: list[Any] = []
    for ev in batch.events:
        tag, names, vals, required = _event_values(ev)
        if layout == "array":
            # msgspec writes every field of an array_like struct (omit_defaults only
            # affects the map layout); readers must still accept shorter arrays.
            events.append([tag, *vals])
        else:
            m: dict[str, Any] = {"type": tag}
            for i, (k, v) in enumerate(zip(names, vals, strict=True)):
                if i < required or v is not None:
                    m[k] = v
            events.append(m)
    if layout == "array":
        body: Any = [batch.ts, events, batch.data_parallel_rank]
    else:
        body = {"ts": batch.ts, "events": events}
        if batch.data_parallel_rank is not None:
            body["data_parallel_rank"] = batch.data_parallel_rank
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out
