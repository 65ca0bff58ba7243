"""The token prefix store (token-producer ``local.prefixStore``): what it returns is always
a prefix of the real tokenization, with a byte-level BPE tokenizer trained in the test."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, normalizers, trainers

from epp import keys
from epp.config.loader import load_and_build
from epp.errors import ConfigError
from epp.kvcache.prefix_store import TokenPrefixStore
from epp.kvcache.tokenization import LocalTokenizer
from epp.scheduling.plugins.llmd_filters import context_length
from epp.scheduling.plugins.token_producer import tokenized
from epp.scheduling.types import ApiType, LLMRequest
from tests.tokenizer_util import text


def test_hits_are_prefixes_of_the_real_tokenization(bpe: Tokenizer) -> None:
    rng = random.Random(1)
    store = TokenPrefixStore(block_chars=32)
    hits = 0
    for _ in range(300):
        shared = text(rng, rng.randrange(5, 80))
        first = shared + rng.choice(["", " ", "x"]) + text(rng, rng.randrange(0, 20))
        enc = bpe.encode(first)
        store.add(first, enc.ids, enc.offsets)
        # a second prompt that shares the first's leading characters, then parts anywhere
        cut = rng.randrange(0, len(first) + 1)
        second = first[:cut] + rng.choice(["", "q", " beta", "lph"]) + text(rng, 5)
        got = store.lookup(second)
        real = bpe.encode(second).ids
        assert got.token_ids == real[:len(got.token_ids)]
        assert got.covered % 32 == 0 and got.covered <= cut + 32
        assert got.coverage == got.covered / len(second)
        hits += bool(got.token_ids)
    assert hits > 150  # the property was checked on real hits, not only on misses


def test_whole_blocks_the_last_matched_one_dropped(bpe: Tokenizer) -> None:
    store = TokenPrefixStore(block_chars=16)
    t = text(random.Random(2), 30)
    enc = bpe.encode(t)
    assert store.lookup(t).token_ids == [] and store.misses == 1
    store.add(t, enc.ids, enc.offsets)
    got = store.lookup(t)
    n = len(t) // 16
    assert got.covered == (n - 1) * 16 and store.hits == 1
    expect = [i for i, (_, end) in zip(enc.ids, enc.offsets, strict=True)
              if end <= (n - 1) * 16]
    assert got.token_ids == expect
    assert len(store) == n


def test_salt_separates_and_lru_evicts(bpe: Tokenizer) -> None:
    t = text(random.Random(3), 20)
    enc = bpe.encode(t)
    store = TokenPrefixStore(block_chars=8)
    store.add(t, enc.ids, enc.offsets, salt=1)
    assert store.lookup(t, salt=0).token_ids == []
    assert store.lookup(t, salt=1).token_ids
    small = TokenPrefixStore(block_chars=8, capacity=10)
    small.add(t, enc.ids, enc.offsets)
    assert len(small) == 10 < len(t) // 8  # capacity: the oldest blocks went first ...
    assert small.lookup(t).covered == 0  # ... which were the leading ones
    with pytest.raises(ValueError, match="positive"):
        TokenPrefixStore(block_chars=0)


def test_special_tokens_and_non_ascii(bpe: Tokenizer) -> None:
    store = TokenPrefixStore(block_chars=4)
    t = "ünï cödé " * 6
    ids = [999] + list(range(len(t)))  # a BOS at (0, 0), then one id per character
    offsets = [(0, 0)] + [(i, i + 1) for i in range(len(t))] + [(0, 0)]
    store.add(t, ids + [998], offsets)  # a special token after the text is not stored
    got = store.lookup(t + "zz")
    assert got.covered == (len(t) // 4 - 1) * 4  # the last matched block dropped
    assert got.token_ids == ids[:1 + got.covered]


def _request(body: dict[str, Any]) -> LLMRequest:
    r = LLMRequest("r", "m", "m", ApiType.CHAT_COMPLETIONS, "", {})
    r.plugin_state[keys.PLUGIN_STATE_REQUEST_BODY] = body
    return r


CONFIG = """
plugins:
- type: token-producer
  parameters:
    local:
      path: {path}
      prefixStore: {store}
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: token-producer}}]
"""


async def test_token_producer_with_a_prefix_store(bpe: Tokenizer, tmp_path: Path) -> None:
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")}))
    built = load_and_build(text=CONFIG.format(path=tmp_path, store="{blockSize: 64}"),
                           strict=True)
    prod: Any = built.plugins["token-producer"]
    assert isinstance(prod.backend, LocalTokenizer)
    store = prod.backend.prefix_store
    assert store is not None and store.block_chars == 64
    assert prod.backend.min_prefix_overlap == 0.8
    rng = random.Random(4)
    system = text(rng, 400)

    def body() -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": text(rng, 10)}]}

    first = _request(body())
    await prod.prepare_request_data(first, [])
    tp = tokenized(first)
    assert tp is not None and tp.estimated_total == 0  # tokenized whole, and stored
    assert list(tp.token_ids) == await prod.backend.tokenize(
        first.plugin_state[keys.PLUGIN_STATE_REQUEST_BODY], "")
    second = _request(body())
    await prod.prepare_request_data(second, [])
    tp2 = tokenized(second)
    real = await prod.backend.tokenize(second.plugin_state[keys.PLUGIN_STATE_REQUEST_BODY], "")
    assert tp2 is not None and 0 < len(tp2.token_ids) < len(real)
    assert list(tp2.token_ids) == real[:len(tp2.token_ids)]
    assert abs(tp2.estimated_total - len(real)) <= 0.1 * len(real)
    assert context_length(second) == tp2.estimated_total
    # a prompt the store covers less than minPrefixOverlapRatio of is tokenized whole
    third = _request({"messages": [{"role": "user", "content": text(rng, 400)}]})
    await prod.prepare_request_data(third, [])
    tp3 = tokenized(third)
    assert tp3 is not None and tp3.estimated_total == 0


@pytest.mark.parametrize("store, error", [
    ("{minPrefixOverlapRatio: 1.5}", "minPrefixOverlapRatio: must be <= 1.0"),
    ("{blockSize: 0}", "blockSize: must be >= 1"),
    ("{cacheSize: big}", "cacheSize: expected an integer"),
])
def test_bad_prefix_store_parameters(bpe: Tokenizer, tmp_path: Path, store: str,
                                     error: str) -> None:
    bpe.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=error):
        load_and_build(text=CONFIG.format(path=tmp_path, store=store), strict=True)


def test_memory_estimate_and_ids_beyond_32_bits() -> None:
    store = TokenPrefixStore(block_chars=4)
    t = "abcdefgh"
    store.add(t, [1, 2], [(0, 4), (4, 8)])
    assert len(store) == 2 and store.memory_bytes() == 2 * (4 + 4 + 150)
    other = TokenPrefixStore(block_chars=4)
    other.add(t, [2**40, 2], [(0, 4), (4, 8)])  # not a tokenizer's id: nothing stored
    assert len(other) == 0


def _local(tok: Tokenizer, tmp_path: Path, ratio: float = 0.8) -> LocalTokenizer:
    tok.save(str(tmp_path / "tokenizer.json"))
    return LocalTokenizer(str(tmp_path), prefix_store=TokenPrefixStore(block_chars=32),
                          min_prefix_overlap=ratio)


def test_a_growing_prompt_tokenizes_only_its_rest(bpe: Tokenizer, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    local = _local(bpe, tmp_path, ratio=1.0)  # never the store's ids alone: always a tail
    rng = random.Random(6)
    prompt = text(rng, 200)
    encoded: list[int] = []
    real_encode = local._tok.encode
    real_batch = local._tok.encode_batch

    def counting_batch(ts: list[str], add_special_tokens: bool = True) -> Any:
        encoded.extend(map(len, ts))
        return real_batch(ts, add_special_tokens=add_special_tokens)

    def counting(t: str, add_special_tokens: bool = True) -> Any:
        encoded.append(len(t))
        return real_encode(t, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(local._tok, "encode_batch", counting_batch)  # (long texts)
    monkeypatch.setattr(local._tok, "encode", counting)
    for turn in range(24):  # a conversation: each turn adds to the end
        prompt = prompt + rng.choice([" ", "\n", "  "]) + text(rng, 60)
        ids, est = asyncio.run(local.tokenize_prefix(None, prompt))
        assert est == 0 and ids == real_encode(prompt).ids, turn
    # after the checked ones, only the rest of each prompt went to the tokenizer
    assert local._tail_checks == 0
    assert max(encoded[-5:]) < 0.2 * len(prompt)


def test_tails_turn_off_where_they_would_differ(tmp_path: Path) -> None:
    # Llama 2's style: a normalizer prepends "▁" to whatever is tokenized, so the rest of a
    # prompt tokenized on its own starts with one more than in the whole prompt
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    rng = random.Random(7)
    tok.train_from_iterator([text(rng, 40) for _ in range(100)],
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    local = _local(tok, tmp_path, ratio=1.0)
    prompt = text(rng, 30)
    for _ in range(4):
        prompt = prompt + " " + text(rng, len(prompt.split()))
        ids, est = asyncio.run(local.tokenize_prefix(None, prompt))
        assert est == 0 and ids == tok.encode(prompt).ids  # never a wrong id
    assert local._tail_checks == -1


def test_long_texts_are_encoded_in_the_tokenizers_thread(bpe: Tokenizer, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from epp.kvcache import tokenization

    local = _local(bpe, tmp_path, ratio=1.0)
    rng = random.Random(8)
    prompt = text(rng, 300)
    inline = asyncio.run(local.tokenize(None, prompt))
    assert local._pool is None  # short: encoded in place
    monkeypatch.setattr(tokenization, "THREAD_MIN_CHARS", 1)
    threaded = asyncio.run(local.tokenize(None, prompt))
    assert local._pool is not None and threaded == inline == bpe.encode(prompt).ids
    asyncio.run(local.close())
    assert local._pool is None


def test_a_tail_in_flight_when_tails_turn_off_gets_the_whole_ids(
        bpe: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = _local(bpe, tmp_path, ratio=1.0)
    rng = random.Random(9)
    prompt = text(rng, 200)
    asyncio.run(local.tokenize_prefix(None, prompt))  # stored whole
    local._tail_checks = 0  # checks done: the next tail is not checked
    real = local._encode_off_loop
    encoded: list[str] = []

    async def turned_off_meanwhile(*texts: tuple[str, bool]) -> list[Any]:
        local._tail_checks = -1  # as if a concurrent prompt's check had failed
        encoded.extend(t for t, _ in texts)
        return await real(*texts)

    monkeypatch.setattr(local, "_encode_off_loop", turned_off_meanwhile)
    grown = prompt + " " + text(rng, 60)
    ids, est = asyncio.run(local.tokenize_prefix(None, grown))
    assert est == 0 and ids == bpe.encode(grown).ids
    assert encoded[-1] == grown  # the whole prompt, encoded after the tail
    assert local._tail_checks == -1
    # a checked tail finishing after tails turned off does not turn them back on
    local._tail_checks = 1
    longer = grown + " " + text(rng, 60)
    asyncio.run(local.tokenize_prefix(None, longer))
    assert local._tail_checks == -1
