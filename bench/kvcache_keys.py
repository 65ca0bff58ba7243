"""Cost of the precise prefix index's block keys (issue 15).

The precise producer hashes every request's prompt into chained block keys
(:func:`epp.kvcache.hashing.request_keys`) and does the same for the ``token_ids`` of
every ``BlockStored`` event the pods publish. Cases, interleaved round by round so noise
hits each alike:

- ``xxh3``: :func:`request_keys` as the EPP runs it (XXH3-64 over packed token ids);
- ``fnv-cbor``: llm-d's ``TokensToKVBlockKeys`` scheme (FNV-64a over canonical CBOR of
  ``[parent, tokens, extra]``) written in Python, which the EPP used before — the
  reference the new keys replaced;
- ``event``: :meth:`BlockIndex.apply` of one ``BlockStored`` batch of 16 blocks (the
  event path, with the index bookkeeping).

    .venv/bin/python -m bench.kvcache_keys                # a few seconds
    .venv/bin/python -m bench.kvcache_keys --smoke        # for CI

Prints the median µs per call of each case for a ``--tokens`` prompt (3,100 by default,
block size 16); ``--json`` prints them as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from epp.kvcache.events import BlockStored, KVEventBatch
from epp.kvcache.hashing import canonical_cbor, request_keys
from epp.kvcache.index import BlockIndex

_U64 = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def _fnv1a64(data: bytes, h: int = _FNV_OFFSET) -> int:
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & _U64
    return h


def fnv_cbor_keys(tokens: Sequence[int], block_size: int, model: str) -> list[int]:
    """llm-d's request-key scheme (token_processor.go, v0.10.0) in Python."""
    prev = _fnv1a64(canonical_cbor([_fnv1a64(b""), None, model]))
    out = []
    for i in range(len(tokens) // block_size):
        prev = _fnv1a64(canonical_cbor([prev, list(tokens[i * block_size:(i + 1) * block_size]),
                                        None]))
        out.append(prev)
    return out


def _time(fn: Callable[[], Any], reps: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(reps):
        fn()
    return (time.perf_counter_ns() - t0) / reps / 1000


def run(tokens: int, rounds: int, reps: int) -> dict[str, Any]:
    rng = random.Random(7)
    prompt = [rng.randrange(1, 128_000) for _ in range(tokens)]
    block = 16
    event_tokens = prompt[: 16 * block]
    index = BlockIndex(block_size=block)
    seq = iter(range(1, 1 << 62))

    def event() -> None:
        n = next(seq)
        hashes = tuple(n * 1000 + i for i in range(16))
        index.apply("pod-a", "m", KVEventBatch(ts=0.0, events=(BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=tuple(event_tokens),
            block_size=block, lora_id=None, medium=None),)))

    cases: dict[str, Callable[[], Any]] = {
        "xxh3": lambda: request_keys(prompt, block, model_name="m"),
        "fnv-cbor": lambda: fnv_cbor_keys(prompt, block, "m"),
        "event": event,
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            samples[name].append(_time(fn, reps if name != "fnv-cbor" else max(1, reps // 10)))
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"tokens": tokens, "block_size": block, "rounds": rounds,
            "median_us": {k: round(v, 1) for k, v in med.items()},
            "speedup": round(med["fnv-cbor"] / med["xxh3"], 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=3100)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="3 rounds, 5 reps")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rounds, a.reps = 3, 5
    res = run(a.tokens, a.rounds, a.reps)
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{res['tokens']} tokens, block {res['block_size']}, median of {res['rounds']} rounds")
        for k, v in res["median_us"].items():
            print(f"  {k:9s} {v:10.1f} µs")
        print(f"  request keys: {res['speedup']}x faster than FNV-64a over CBOR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
