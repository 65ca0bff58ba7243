"""Per-request and per-event costs of the precise prefix path (issue 15).

Cases, interleaved round by round so noise hits each alike, for a chat of a ``--words``
system prompt and a 200-word question, tokenized with the bench's word-level tokenizer
(:mod:`epp.bench.tokenizer`):

- ``tokenize-whole``: ``token-producer`` ``local`` without a prefix store (chat template
  rendered, the prompt encoded);
- ``tokenize-covered``: with the prefix store, the system prompt seen before (a new
  question): the leading ids come from the store;
- ``tokenize-leading``: with the prefix store, a system prompt not seen before, as
  ``token-producer`` serves it beside ``precise-prefix-cache-producer``: until its
  leading ids are there (the probe; the whole tokenization, left to the tokenizer's thread
  and waited for untimed, is ``tokenize-whole``);
- ``tokenize-tail``: with the prefix store, a conversation's next turn (300 words more
  than a stored prompt): only the rest is encoded;
- ``store-add``: recording one whole tokenization in the store;
- ``chat-template``: rendering the chat template alone (the system prompt, the question
  and the conversation's next turn: three messages);
- ``store-lookup``: the prefix store's lookup alone for a prompt it covers (the block
  keys of the text and the stored ids gathered);
- ``events``: decoding one vLLM batch of a ``BlockStored`` with the prompt's blocks and a
  ``BlockRemoved`` of as many, and applying both to a fresh index (what every cache miss
  costs the EPP when the pods publish their KV events);
- ``lookup``: the prompt's block keys and the longest prefix each of 4 pods holds, in an
  index holding 4 × 20,000 blocks (one pod the whole prompt, one half of it).

    .venv/bin/python -m bench.precise_path             # a few seconds
    .venv/bin/python -m bench.precise_path --smoke     # for CI

Prints the median µs per call of each case; ``--json`` prints them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.kvcache_keys import _time
from epp.bench.tokenizer import write_bench_tokenizer
from epp.bench.traces import words
from epp.kvcache.events import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from epp.kvcache.index import BlockIndex
from epp.kvcache.prefix_store import TokenPrefixStore
from epp.kvcache.tokenization import LocalTokenizer


def run(n_words: int, rounds: int, reps: int) -> dict[str, Any]:
    rng = random.Random(11)
    system = words(rng, n_words)
    questions = [words(rng, 200) for _ in range(reps + 1)]
    turn = words(rng, 300)
    vocab = {w for t in (system, turn, *questions) for w in t.split()}
    tmp = Path(tempfile.mkdtemp(prefix="epp-bench-precise-"))
    path = str(write_bench_tokenizer(tmp, vocab))

    def chat(*contents: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": c} for c in contents]}

    loop = asyncio.new_event_loop()
    wait = loop.run_until_complete  # (tokenizing runs in the tokenizer's thread)
    whole = LocalTokenizer(path)
    covered = LocalTokenizer(path, prefix_store=TokenPrefixStore(), min_prefix_overlap=0.8)
    wait(covered.tokenize_prefix(chat(system, questions[-1]), ""))
    q = iter(range(1 << 62))
    base = chat(system, questions[0])
    text = whole.render_chat(base)
    enc = whole._tok.encode(text, add_special_tokens=False)
    ids, offsets = enc.ids, enc.offsets
    grown = chat(system, questions[0], turn)

    tailer = LocalTokenizer(path, prefix_store=TokenPrefixStore(), min_prefix_overlap=1.0)
    tailer._tail_checks = 0  # measured after the checks

    def tail() -> None:  # (less one store-add: the stored earlier turn, set up each time)
        tailer.prefix_store = store = TokenPrefixStore()
        store.add(text, ids, offsets)
        wait(tailer.tokenize_prefix(grown, ""))
    leader = LocalTokenizer(path, prefix_store=TokenPrefixStore(), min_prefix_overlap=0.8)

    def leading() -> float:  # µs until the leading ids, per call (each a new prompt)
        spent = 0
        for _ in range(reps):
            body = chat(f"{next(q)} {system}", questions[0])
            t0 = time.perf_counter_ns()
            _, _, rest = wait(leader.tokenize_leading(body, ""))
            spent += time.perf_counter_ns() - t0
            if rest is not None:
                wait(rest)
        return spent / reps / 1000

    block = 16
    n_blocks = len(ids) // block
    hashes = tuple(rng.randrange(1 << 64) for _ in range(n_blocks))
    payload = encode_batch(KVEventBatch(ts=1.0, events=(
        BlockStored(hashes, None, tuple(ids[:n_blocks * block]), block, None, "GPU"),
        BlockRemoved(hashes, "GPU"))))

    def events() -> None:
        BlockIndex(block_size=block).apply("pod-a", "m", decode_batch(payload))

    full = BlockIndex(block_size=block)
    pods = [f"pod-{c}" for c in "abcd"]
    for i in range(400):
        full.add(pods[i % 4], [rng.randrange(1 << 64) for _ in range(200)])
    prompt_keys = full.request_keys(ids, "m")
    full.add(pods[0], prompt_keys)
    full.add(pods[1], prompt_keys[:len(prompt_keys) // 2])

    def lookup() -> None:
        full.longest_prefix(full.request_keys(ids, "m"), pods)

    looked_up = covered.render_chat(chat(system, questions[-1]))
    store = covered.prefix_store
    assert store is not None

    cases: dict[str, Callable[[], Any]] = {
        "tokenize-whole": lambda: wait(whole.tokenize_prefix(base, "")),
        "tokenize-covered": lambda: wait(covered.tokenize_prefix(
            chat(system, questions[next(q) % reps]), "")),
        "tokenize-tail": tail,
        "store-add": lambda: TokenPrefixStore().add(text, ids, offsets),
        "chat-template": lambda: whole.render_chat(grown),
        "store-lookup": lambda: store.lookup(looked_up),
        "events": events,
        "lookup": lookup,
    }
    samples: dict[str, list[float]] = {k: [] for k in [*cases, "tokenize-leading"]}
    for _ in range(rounds):
        for name, fn in cases.items():
            samples[name].append(_time(fn, reps))
        samples["tokenize-leading"].append(leading())
    med = {k: statistics.median(v) for k, v in samples.items()}
    med["tokenize-tail"] = max(0.0, med["tokenize-tail"] - med["store-add"])
    for t in (whole, covered, tailer, leader):
        loop.run_until_complete(t.close())
    loop.close()
    return {"words": n_words, "tokens": len(ids), "blocks": n_blocks, "rounds": rounds,
            "median_us": {k: round(v, 1) for k, v in med.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--words", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="2 rounds, 3 reps, 300 words")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rounds, a.reps, a.words = 2, 3, 300
    res = run(a.words, a.rounds, a.reps)
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{res['words']}-word system prompt + 200-word question = {res['tokens']} "
              f"tokens ({res['blocks']} blocks of 16), median of {res['rounds']} rounds")
        for k, v in res["median_us"].items():
            print(f"  {k:17s} {v:10.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
