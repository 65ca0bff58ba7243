"""A long new prompt's leading ids first, its whole tokenization after
(``LocalTokenizer.tokenize_leading``, ``TokenizedPrompt.whole``), and how
``precise-prefix-cache-producer`` uses them: it routes on the leading blocks when no
candidate holds all of them, waits for the whole prompt otherwise, and indexes the rest of
a decision's blocks once they are known."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from epp.config.loader import load_and_build
from epp.kvcache import tokenization
from epp.kvcache.prefix_store import TokenPrefixStore
from epp.kvcache.tokenization import LocalTokenizer
from epp.scheduling.plugins.precise_prefix import PrecisePrefixCacheProducer
from epp.scheduling.plugins.token_producer import (
    TokenProducer,
    tokenized,
    whole_tokenization,
)
from epp.scheduling.types import (
    ApiType,
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    SchedulingResult,
)
from tests.tokenizer_util import text


def _local(tok: Tokenizer, tmp_path: Path) -> LocalTokenizer:
    tok.save(str(tmp_path / "tokenizer.json"))
    return LocalTokenizer(str(tmp_path), prefix_store=TokenPrefixStore(block_chars=64))


async def test_a_long_new_prompt_gets_its_leading_ids_at_once(bpe: Tokenizer,
                                                              tmp_path: Path) -> None:
    local = _local(bpe, tmp_path)
    rng = random.Random(1)
    prompt = text(rng, 1500)  # ~10,000 characters
    assert len(prompt) >= tokenization.THREAD_MIN_CHARS
    real = bpe.encode(prompt).ids
    lead, est, whole = await local.tokenize_leading(None, prompt)
    assert whole is not None and 0 < len(lead) < len(real)
    assert lead == real[:len(lead)]  # the probe is the whole tokenization's beginning
    assert abs(est - len(real)) <= 0.15 * len(real)
    assert await whole == real
    # stored: the same prompt again is covered by the store, nothing left to wait for
    again, est2, whole2 = await local.tokenize_leading(None, prompt)
    assert whole2 is None and again == real[:len(again)] and est2 > 0
    # a short prompt is tokenized in place, whole
    short = text(rng, 50)
    ids, est3, whole3 = await local.tokenize_leading(None, short)
    assert whole3 is None and est3 == 0 and ids == bpe.encode(short).ids
    await local.close()


async def test_a_partial_store_hit_with_a_long_rest_hands_out_the_stored_ids(
        bpe: Tokenizer, tmp_path: Path) -> None:
    local = _local(bpe, tmp_path)
    rng = random.Random(2)
    head = text(rng, 1500)
    await local.tokenize_prefix(None, head)  # stored
    prompt = head + " " + text(rng, 1500)  # the store covers about half
    lead, est, whole = await local.tokenize_leading(None, prompt)
    real = bpe.encode(prompt).ids
    assert whole is not None and lead == real[:len(lead)] and len(lead) > len(real) // 3
    assert abs(est - len(real)) <= 0.15 * len(real)
    assert await whole == real
    await local.close()


async def test_a_probe_that_differs_turns_probes_off(bpe: Tokenizer, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture
                                                     ) -> None:
    local = _local(bpe, tmp_path)
    rng = random.Random(3)
    real_probe = local._probe

    def wrong(t: str, add: bool) -> tuple[list[int], int]:
        ids, cut = real_probe(t, add)
        return [ids[0] + 1, *ids[1:]], cut

    monkeypatch.setattr(local, "_probe", wrong)
    prompt = text(rng, 1500)
    _, _, whole = await local.tokenize_leading(None, prompt)
    assert whole is not None and await whole == bpe.encode(prompt).ids
    assert "probes are off" in caplog.text
    other = text(rng, 1500)
    ids, est, whole2 = await local.tokenize_leading(None, other)
    assert whole2 is None and est == 0 and ids == bpe.encode(other).ids
    await local.close()


async def test_a_probe_without_a_whole_token_waits_for_the_whole(
        bpe: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = _local(bpe, tmp_path)
    monkeypatch.setattr(local, "_probe", lambda t, add: ([], 768))
    prompt = text(random.Random(5), 1500)
    ids, est, whole = await local.tokenize_leading(None, prompt)
    assert whole is None and est == 0 and ids == bpe.encode(prompt).ids
    await local.close()


CONFIG = """
plugins:
- type: token-producer
  parameters: {{local: {{path: {path}, prefixStore: {{blockSize: 64}}}}}}
- type: precise-prefix-cache-producer
  parameters:
    speculativeIndexing: true
    speculativeTTL: 5s
    kvEventsConfig: {{discoverPods: false}}
    tokenProcessorConfig: {{blockSizeTokens: 16}}
- type: precise-prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: precise-prefix-cache-scorer}}
  - {{pluginRef: max-score-picker}}
"""


def _request(rid: str, prompt: str) -> LLMRequest:
    return LLMRequest(rid, "m", "m", ApiType.COMPLETIONS, prompt, {})


async def test_precise_routes_on_leading_blocks_only_when_no_pod_holds_them(
        bpe: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bpe.save(str(tmp_path / "tokenizer.json"))
    built = load_and_build(text=CONFIG.format(path=tmp_path), strict=True)
    tp_plugin = next(p for p in built.plugins.values() if isinstance(p, TokenProducer))
    prod = next(p for p in built.plugins.values() if isinstance(p, PrecisePrefixCacheProducer))
    assert tp_plugin.early  # the precise producer asked for leading ids first
    backend: Any = tp_plugin.backend
    gate = asyncio.Event()  # holds every whole tokenization until set
    real_rest = backend._rest

    async def gated(*args: Any) -> list[int]:
        await gate.wait()
        ids: list[int] = await real_rest(*args)
        return ids

    monkeypatch.setattr(backend, "_rest", gated)
    eps = [Endpoint(n, "127.0.0.1", p) for n, p in (("a", 1), ("b", 2))]
    rng = random.Random(4)
    prompt = text(rng, 1500)
    real = bpe.encode(prompt).ids
    whole_keys = prod.index.request_keys(real, "m", None)

    # cold: no pod holds the first block, so the leading blocks decide
    cold = _request("cold", prompt)
    await tp_plugin.prepare_request_data(cold, eps)
    lead = tokenized(cold)
    assert lead is not None and lead.whole is not None
    await prod.prepare_request_data(cold, eps)  # did not wait for the (held) whole
    assert not lead.whole.done()
    info = prod.match_info({}, cold, eps)  # type: ignore[arg-type]
    assert info.cached_blocks == {}
    leading_keys = prod.block_keys(cold)
    assert 0 < len(leading_keys) < len(whole_keys)
    assert leading_keys == whole_keys[:len(leading_keys)]
    # the decision's blocks are indexed: the leading ones at once, the rest once known
    prod.pre_request(cold, SchedulingResult({"default": ProfileRunResult((eps[1],))},
                                            "default"))
    await asyncio.sleep(0)
    assert prod.index.longest_prefix(whole_keys, [e.key for e in eps])[1] == {
        eps[1].key: len(leading_keys)}
    gate.set()
    done = await whole_tokenization(cold)
    assert done is not None and list(done.token_ids) == real and done.whole is None
    for _ in range(3):
        await asyncio.sleep(0)
    assert prod.index.longest_prefix(whole_keys, [e.key for e in eps])[1] == {
        eps[1].key: len(whole_keys)}

    # warm: b holds every leading block (speculatively), so the producer waits for the
    # whole prompt and sees how far b's blocks go
    longer = prompt + " " + text(rng, 1500)
    tp_plugin.backend.prefix_store = TokenPrefixStore(block_chars=64)  # type: ignore[attr-defined]
    warm = _request("warm", longer)
    await tp_plugin.prepare_request_data(warm, eps)
    got = tokenized(warm)
    assert got is not None and got.whole is not None and not got.whole.done()
    gate.clear()
    preparing = asyncio.ensure_future(prod.prepare_request_data(warm, eps))
    await asyncio.sleep(0.05)
    assert not preparing.done()  # waiting for the whole prompt
    gate.set()
    await preparing
    after = tokenized(warm)
    assert after is not None and after.whole is None  # waited for the whole
    info = prod.match_info({}, warm, eps)  # type: ignore[arg-type]
    # all of the shorter prompt's blocks but the last (cut differently in the longer one)
    assert info.cached_blocks[eps[1].key] >= len(whole_keys) - 1
    await tp_plugin.stop_background()


def test_only_configs_with_a_precise_producer_get_leading_ids(bpe: Tokenizer,
                                                               tmp_path: Path) -> None:
    bpe.save(str(tmp_path / "tokenizer.json"))
    built = load_and_build(text=f"""
plugins:
- type: token-producer
  parameters: {{local: {{path: {tmp_path}}}}}
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: token-producer}}]
""", strict=True)
    prod: Any = built.plugins["token-producer"]
    assert not prod.early
