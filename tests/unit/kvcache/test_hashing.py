"""Parity of epp.kvcache.hashing with vLLM's block hashing.

Expected values: computed by following vLLM's code literally —
vllm-project/vllm ``vllm/v1/core/kv_cache_utils.py`` (commit 001cabc1be16:
``init_none_hash``: ``NONE_HASH = hash_fn(PYTHONHASHSEED)``; ``hash_block_tokens``:
``hash_fn((parent_block_hash or NONE_HASH, tuple(tokens), extra_keys))``;
``generate_block_hash_extra_keys``: ``lora + mm + cache_salt (block 0 only)``) and
``vllm/utils/hashing.py`` (commit ac621345a4eb: ``sha256`` =
``sha256(pickle.dumps(x, HIGHEST_PROTOCOL))``, ``sha256_cbor`` =
``sha256(cbor2.dumps(x, canonical=True))``; ``xxhash_cbor`` =
``xxh3_128_digest(cbor2.dumps(x, canonical=True))`` from the later hashing.py),
run with cbor2 6.3.0 / Python 3.11. ``_vllm_literal`` below repeats that
computation; it runs against cbor2 when installed.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from typing import Any

import pytest

from epp.kvcache import hashing

A = [  # sha256_cbor, PYTHONHASHSEED=0, tokens 0..39, block 16
    "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c",
    "fedd9e4abebebbe6f6cf96b682f08d316063fe2f22a5c552192dd62904fcccac",
]
B = [  # sha256 (pickle), PYTHONHASHSEED=42, tokens 1000..1049, block 16
    "c066f06e34db5c73ef4051801d117ec365ccc55cb2c7fe43834131d0f4d6a549",
    "6d04bec6e6c8013d7168f015a24e42ec6c9e082193e4419e909a1796e260622b",
    "fe4580809dbf4cbc59933d1bdf45ced68e574c4eaf7b0444b5b15232f71c90ce",
]
C = [  # sha256_cbor, seed 0, tokens 0..31, LoRA "my-lora", cache_salt "salt"
    "7cd6f066786427505de6f60576a0ebec4066d387f7f4338e398c3b1a8dc54451",
    "b5666d48692c2a6e6c107d727852950831b9a745c43e7e90b230e942d6f8a106",
]
D = [  # xxhash_cbor, seed 0, tokens 0..39, block 16
    "209f5d549fc07c8e39d823615ede61ce",
    "03888914ee75b87e89df867a21beb72b",
]
E = [  # sha256_cbor, seed 0, tokens 0..16, block 4 (the 17th token is a partial block)
    "8d4c7c828f1611f485f1ebfc2b19f0fe1c90d0a71d00cd90948a1fa5e8c9e91f",
    "ed6fa5d37a067707ede9aff44aa2819ab639263ca4ca66e8d36d02ffac952d33",
    "1b7047f472ffe29f9649139ce64bf3c05228f5a99bb7792568bb68f2d7410c30",
    "bc3ffb7fd0c74a14baed79d7009a7ee5d0cfc21a4a0aa1c342754a915e780a0a",
]


def _hex(xs: list[Any]) -> list[str]:
    return [x.hex() for x in xs]


def test_sha256_cbor_parity() -> None:
    assert _hex(hashing.block_hashes(list(range(40)), 16, seed="0", as_bytes=True)) == A


def test_sha256_pickle_parity() -> None:
    got = hashing.block_hashes(list(range(1000, 1050)), 16, algo="sha256", seed="42", as_bytes=True)
    assert _hex(got) == B


def test_lora_and_cache_salt_extra_keys() -> None:
    got = hashing.block_hashes(
        list(range(32)), 16, seed="0", lora_name="my-lora", cache_salt="salt", as_bytes=True
    )
    assert _hex(got) == C
    explicit = hashing.block_hashes(
        list(range(32)), 16, seed="0", extra_keys=[("my-lora", "salt"), ("my-lora",)], as_bytes=True
    )
    assert _hex(explicit) == C
    assert hashing.block_extra_keys(0, lora_name="l", cache_salt="s") == ("l", "s")
    assert hashing.block_extra_keys(1, lora_name="l", cache_salt="s") == ("l",)
    assert hashing.block_extra_keys(3) is None


def test_xxhash_cbor_parity() -> None:
    got = hashing.block_hashes(list(range(40)), 16, algo="xxhash_cbor", seed="0", as_bytes=True)
    assert _hex(got) == D


def test_full_blocks_only_and_parent_chaining() -> None:
    toks = list(range(17))
    full = hashing.block_hashes(toks, 4, seed="0", as_bytes=True)
    assert _hex(full) == E  # 4 full blocks, the 17th token is never hashed
    # Continuing the chain from the second block's hash gives the remaining ones.
    tail = hashing.block_hashes(toks[8:], 4, seed="0", parent=full[1], as_bytes=True)
    assert tail == full[2:]
    assert hashing.block_hashes(toks[:3], 4, seed="0") == []


def test_event_form_is_last_8_bytes_big_endian() -> None:
    ints = hashing.block_hashes(list(range(40)), 16, seed="0")
    # vLLM maybe_convert_block_hash: int.from_bytes(digest, "big") & (2**64 - 1)
    assert ints == [int.from_bytes(bytes.fromhex(h), "big") & (2**64 - 1) for h in A]
    assert hashing.engine_key(bytes.fromhex(A[0])) == ints[0]
    assert hashing.engine_key(ints[0]) == ints[0]
    assert hashing.engine_key(-1) == 2**64 - 1
    assert hashing.engine_key(b"\x01\x02") == 0x0102
    with pytest.raises(ValueError, match="empty"):
        hashing.engine_key(b"")


def test_seed_unset_is_random_per_process_but_stable() -> None:
    a = hashing.block_hashes(list(range(16)), 16)
    b = hashing.block_hashes(list(range(16)), 16)
    assert a == b
    assert a != hashing.block_hashes(list(range(16)), 16, seed="0")


def test_bad_algo_and_block_size() -> None:
    with pytest.raises(ValueError, match="unsupported block hash algorithm 'md5'"):
        hashing.block_hashes([1], 1, algo="md5")
    with pytest.raises(ValueError, match="block_size must be greater than 0"):
        hashing.block_hashes([1], 0)


def _vllm_literal(fn: Callable[[Any], bytes], seed: str, toks: list[int], bs: int) -> list[str]:
    none_hash = fn(seed)
    parent: bytes | None = None
    out = []
    start = 0
    while start + bs <= len(toks):
        p = parent if parent else none_hash
        parent = fn((p, tuple(toks[start : start + bs]), None))
        out.append(parent.hex())
        start += bs
    return out


def test_literal_vllm_against_cbor2() -> None:
    cbor2 = pytest.importorskip("cbor2")

    def sha256_cbor(x: Any) -> bytes:
        return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()

    assert _vllm_literal(sha256_cbor, "0", list(range(40)), 16) == A
    for obj in [None, 0, 24, 2**32, 2**64 - 1, -25, b"x" * 300, "é", (1, (2,)), {"b": 1, "aa": 2}]:
        assert hashing.canonical_cbor(obj) == cbor2.dumps(obj, canonical=True)


def test_literal_vllm_pickle() -> None:
    def sha256(x: Any) -> bytes:
        return hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    assert _vllm_literal(sha256, "42", list(range(1000, 1050)), 16) == B




def test_request_keys_chain() -> None:
    tokens = list(range(40))
    keys = hashing.request_keys(tokens, 16, model_name="m")
    assert len(keys) == 2 and all(0 <= k < 2**64 for k in keys)  # partial block not hashed
    assert keys != hashing.request_keys(tokens, 16, model_name="other")
    assert keys != hashing.request_keys(tokens, 16, model_name="m", hash_seed="42")
    assert hashing.request_keys(list(range(32, 33)), 16) == []
    # continuing from a parent key gives the same chain as hashing the whole sequence
    assert hashing.request_keys(tokens[16:], 16, model_name="m", parent=keys[0]) == keys[1:]
    # a block's key depends on every token before it, and on its extra inputs
    changed = [*tokens[:3], 999, *tokens[4:]]
    other = hashing.request_keys(changed, 16, model_name="m")
    assert other[0] != keys[0] and other[1] != keys[1]
    salted = hashing.request_keys(tokens, 16, model_name="m", extra=[[{"Hash": "s"}], None])
    assert salted[0] != keys[0] and salted[1] != keys[1]
    assert hashing.request_keys(tokens, 16, model_name="m", extra=[None, None]) == keys
    for bad in (2**64, -1, 1.5):
        with pytest.raises(ValueError, match="non-negative 64-bit"):
            hashing.request_keys([bad] * 16, 16)
    with pytest.raises(ValueError, match="greater than 0"):
        hashing.request_keys(tokens, 0)
