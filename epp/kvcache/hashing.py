"""vLLM's prefix-cache block hashes, as they appear in vLLM's KV events.

Reference (read, not copied): vLLM ``vllm/v1/core/kv_cache_utils.py``
(``init_none_hash``, ``hash_block_tokens``, ``get_request_block_hasher``,
``generate_block_hash_extra_keys``, ``maybe_convert_block_hash``) and
``vllm/utils/hashing.py`` (``sha256``, ``sha256_cbor``, ``xxhash``,
``xxhash_cbor``), vllm-project/vllm main at commits 001cabc1be16 / ac621345a4eb
(the v0.11+ layout: 32-byte ``BlockHash`` bytes, ``sha256`` default for
``--prefix-caching-hash-algo``); ``vllm/envs.py`` for
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default ``1``).

The computation, block by block (full blocks only; a trailing partial block is
never hashed)::

    NONE_HASH  = H(seed)                        # seed = PYTHONHASHSEED (a str)
    hash[0]    = H((NONE_HASH, tuple(block0_tokens), extra_keys0))
    hash[i]    = H((hash[i-1], tuple(block_i_tokens), extra_keys_i))

where ``H`` is the serializer + digest named by ``algo``:

====================  =========================================  =========
algo                  serialization                              digest
====================  =========================================  =========
``sha256``            ``pickle.dumps(obj, HIGHEST_PROTOCOL)``    SHA-256
``sha256_cbor``       canonical CBOR (``cbor2.dumps(canonical)``)  SHA-256
``xxhash``            pickle                                     XXH3-128
``xxhash_cbor``       canonical CBOR                             XXH3-128
====================  =========================================  =========

``extra_keys`` is ``None`` for a plain text block, else a tuple built as
``lora_keys + mm_keys + cache_salt_keys``: the LoRA adapter *name* on every
block, the multimodal identifiers overlapping the block, and the cache salt on
the first block only (vLLM adds the salt only where ``start_token_idx == 0``).
:func:`block_extra_keys` builds that tuple.

When the seed is not set, vLLM draws ``NONE_HASH`` from ``os.urandom(32)`` once
per process, so its hashes cannot be reproduced elsewhere; here ``seed=None``
does the same (one random value per process). Anyone who wants reproducible
hashes (the simulator, the EPP's consistency checks) passes the seed that the
model server's ``PYTHONHASHSEED`` holds.

What ``BlockStored.block_hashes`` carries: vLLM's ``maybe_convert_block_hash``
turns each 32/16-byte digest into ``int.from_bytes(digest, "big") & (2**64-1)``
(the digest's last 8 bytes, big-endian) when
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on, which is vLLM's default; with it
off, the raw digest bytes travel. :func:`block_hashes` therefore returns those
64-bit ints by default (``as_bytes=True`` gives the raw digests), and
:func:`engine_key` maps either form to the 64-bit key llm-d's
``getHashAsUint64`` uses (last 8 bytes, big-endian), which is what the index
stores.

The EPP's own request-side keys (:func:`request_keys`, the role of llm-d's
``token_processor.go``) are a *different* hash that the index maps engine keys onto:
chained like llm-d's, but XXH3-64 over packed token ids where llm-d uses FNV-64a over
canonical CBOR (they never leave the EPP, so only speed matters).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Final

import xxhash as _xxh

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGO",
    "block_extra_keys",
    "block_hashes",
    "canonical_cbor",
    "engine_key",
    "hash_block_tokens",
    "hash_function",
    "none_hash",
    "request_keys",
]

ALGORITHMS: Final = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# vLLM's --prefix-caching-hash-algo default; llm-d deployments set sha256_cbor
# (language-neutral), hence the module default below.
DEFAULT_ALGO: Final = "sha256_cbor"

_U64: Final = (1 << 64) - 1


# --------------------------------------------------------------------------------------
# canonical CBOR (RFC 8949 §4.2.1 "core deterministic" as cbor2 canonical=True writes
# it for the types block hashing uses)
# --------------------------------------------------------------------------------------


def _head(major: int, value: int) -> bytes:
    mt = major << 5
    if value < 24:
        return bytes((mt | value,))
    if value <= 0xFF:
        return bytes((mt | 24, value))
    if value <= 0xFFFF:
        return bytes((mt | 25,)) + struct.pack(">H", value)
    if value <= 0xFFFFFFFF:
        return bytes((mt | 26,)) + struct.pack(">I", value)
    return bytes((mt | 27,)) + struct.pack(">Q", value)


def _encode(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xF6)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    elif isinstance(obj, int):
        if obj >= 0:
            if obj <= _U64:
                out += _head(0, obj)
            else:  # bignum, tag 2
                out += _head(6, 2)
                _encode(obj.to_bytes((obj.bit_length() + 7) // 8, "big"), out)
        else:
            n = -1 - obj
            if n <= _U64:
                out += _head(1, n)
            else:  # negative bignum, tag 3
                out += _head(6, 3)
                _encode(n.to_bytes((n.bit_length() + 7) // 8, "big"), out)
    elif isinstance(obj, bytes | bytearray | memoryview):
        data = bytes(obj)
        out += _head(2, len(data))
        out += data
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        out += _head(3, len(data))
        out += data
    elif isinstance(obj, list | tuple):
        out += _head(4, len(obj))
        for item in obj:
            _encode(item, out)
    elif isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            key_buf = bytearray()
            _encode(k, key_buf)
            items.append((bytes(key_buf), v))
        # canonical: shorter encoded key first, then bytewise
        items.sort(key=lambda kv: (len(kv[0]), kv[0]))
        out += _head(5, len(items))
        for key_bytes, v in items:
            out += key_bytes
            _encode(v, out)
    else:
        raise TypeError(f"canonical_cbor: unsupported type {type(obj).__name__}")


def canonical_cbor(obj: Any) -> bytes:
    """Canonical CBOR of None/bool/int/bytes/str/list/tuple/dict (what ``cbor2.dumps(obj,
    canonical=True)`` writes for them)."""
    out = bytearray()
    _encode(obj, out)
    return bytes(out)


# --------------------------------------------------------------------------------------
# vLLM's hash functions
# --------------------------------------------------------------------------------------


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(canonical_cbor(obj)).digest()


def _xxhash(obj: Any) -> bytes:
    return _xxh.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _xxhash_cbor(obj: Any) -> bytes:
    return _xxh.xxh3_128_digest(canonical_cbor(obj))


_FUNCTIONS: Final[dict[str, Callable[[Any], bytes]]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
    "xxhash_cbor": _xxhash_cbor,
}


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name``: the serializer+digest named by ``algo``."""
    try:
        return _FUNCTIONS[algo]
    except KeyError:
        raise ValueError(
            f"unsupported block hash algorithm {algo!r}: use one of {', '.join(ALGORITHMS)} "
            "(vLLM's --prefix-caching-hash-algo)"
        ) from None


_RANDOM_NONE_HASH: bytes | None = None


def none_hash(algo: str = DEFAULT_ALGO, seed: str | None = None) -> bytes:
    """vLLM's ``NONE_HASH``: ``H(seed)`` when the seed (``PYTHONHASHSEED``) is set, else
    32 random bytes drawn once per process."""
    global _RANDOM_NONE_HASH
    fn = hash_function(algo)
    if seed is None:
        if _RANDOM_NONE_HASH is None:
            _RANDOM_NONE_HASH = os.urandom(32)
        return _RANDOM_NONE_HASH
    return fn(seed)


def hash_block_tokens(
    algo: str,
    parent: bytes | None,
    tokens: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
    *,
    seed: str | None = None,
) -> bytes:
    """vLLM's ``hash_block_tokens``: ``H((parent or NONE_HASH, tuple(tokens), extra))``."""
    fn = hash_function(algo)
    if not parent:
        parent = none_hash(algo, seed)
    return fn((parent, tuple(tokens), extra_keys))


def block_extra_keys(
    block_index: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_keys: Sequence[Any] = (),
) -> tuple[Any, ...] | None:
    """vLLM's ``generate_block_hash_extra_keys`` for one block: ``lora + mm + salt``
    (the salt on block 0 only), ``None`` when empty."""
    keys: list[Any] = []
    if lora_name:
        keys.append(lora_name)
    keys.extend(mm_keys)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


ExtraKeys = (
    Sequence[tuple[Any, ...] | None] | Callable[[int], tuple[Any, ...] | None] | None
)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = DEFAULT_ALGO,
    seed: str | None = None,
    extra_keys: ExtraKeys = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    parent: bytes | None = None,
    as_bytes: bool = False,
) -> list[Any]:
    """The block hashes of the full blocks of ``token_ids``, chained from ``parent``
    (``None``: the first block of a sequence, chained from ``NONE_HASH``).

    ``extra_keys``: one entry per full block (a sequence) or a function of the block
    index; when not given, built from ``lora_name``/``cache_salt`` as vLLM does.
    Returns the 64-bit ints vLLM publishes in ``BlockStored.block_hashes`` by default
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), or the raw digests with
    ``as_bytes=True`` (needed to continue a chain: pass the last one as ``parent``).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be greater than 0, got {block_size}")
    fn = hash_function(algo)
    n_blocks = len(token_ids) // block_size
    if isinstance(extra_keys, Sequence) and len(extra_keys) < n_blocks:
        raise ValueError(
            f"extra_keys has {len(extra_keys)} entries for {n_blocks} full blocks"
        )
    prev = parent if parent else none_hash(algo, seed)
    out: list[Any] = []
    for i in range(n_blocks):
        chunk = tuple(token_ids[i * block_size : (i + 1) * block_size])
        if extra_keys is None:
            extra = block_extra_keys(i, lora_name=lora_name, cache_salt=cache_salt)
        elif callable(extra_keys):
            extra = extra_keys(i)
        else:
            extra = extra_keys[i]
        prev = fn((prev, chunk, extra))
        out.append(prev if as_bytes else engine_key(prev))
    return out


def engine_key(block_hash: bytes | int) -> int:
    """The 64-bit key of an engine block hash as llm-d keeps it (``getHashAsUint64``):
    an int as is (two's complement for negatives), bytes as their last 8 bytes read
    big-endian (left-padded when shorter) — identical to vLLM's int conversion."""
    if isinstance(block_hash, bool):
        raise TypeError("block hash must be int or bytes, not bool")
    if isinstance(block_hash, int):
        return block_hash & _U64
    if not block_hash:
        raise ValueError("block hash byte string is empty")
    return int.from_bytes(block_hash[-8:], "big")


# --------------------------------------------------------------------------------------
# the EPP's request-side keys (the role of llm-d's TokensToKVBlockKeys,
# pkg/kvcache/kvblock/token_processor.go v0.10.0, with a faster hash)
# --------------------------------------------------------------------------------------

_ROOTS: dict[tuple[str, str], int] = {}


def _root(hash_seed: str, model_name: str) -> int:
    root = _ROOTS.get((hash_seed, model_name))
    if root is None:
        root = _xxh.xxh3_64_intdigest(canonical_cbor([hash_seed, model_name]))
        if len(_ROOTS) < 4096:
            _ROOTS[(hash_seed, model_name)] = root
    return root


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        return array("Q", token_ids).tobytes()
    except (OverflowError, TypeError):
        raise ValueError("token ids must be non-negative 64-bit integers") from None


def request_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    model_name: str = "",
    hash_seed: str = "",
    parent: int | None = None,
    extra: Sequence[Any] | None = None,
) -> list[int]:
    """The EPP's block keys for a token sequence (full blocks only), chained as llm-d's
    ``TokensToKVBlockKeys`` chains them: block ``i``'s key is a 64-bit hash of (block
    ``i-1``'s key, block ``i``'s tokens, block ``i``'s extra inputs); the chain starts at
    a root derived from ``hashSeed`` and the model (or LoRA) name, or at ``parent``.

    llm-d hashes each block with FNV-64a over canonical CBOR; these keys never leave the
    EPP (the index maps the engines' own hashes onto them), so XXH3-64 over the tokens'
    packed bytes serves the same purpose at a fraction of the cost: about 0.3 µs per
    block, against ~18 µs for FNV-over-CBOR in Python (bench/kvcache_keys.py). ``extra``:
    per-block multimodal/salt inputs (canonical CBOR folded into that block's key).
    """
    if block_size <= 0:
        raise ValueError(f"blockSizeTokens must be greater than 0, got {block_size}")
    n = len(token_ids) // block_size
    if n == 0:
        return []
    prev = parent if parent is not None else _root(hash_seed, model_name)
    data = _token_bytes(token_ids[: n * block_size])
    step = 8 * block_size
    h = _xxh.xxh3_64_intdigest
    out: list[int] = []
    append = out.append
    if extra is None:
        for off in range(0, n * step, step):
            prev = h(data[off : off + step], prev)
            append(prev)
        return out
    for i in range(n):
        ex = extra[i] if i < len(extra) else None
        chunk = data[i * step : (i + 1) * step]
        if ex is not None:
            chunk += canonical_cbor(ex)
        prev = h(chunk, prev)
        append(prev)
    return out
