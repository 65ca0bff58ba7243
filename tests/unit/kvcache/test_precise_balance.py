"""``precise-prefix-cache-producer``'s optional balance guard (this project's addition)."""

from __future__ import annotations

from epp.framework.params import decode_params
from epp.scheduling.plugins.precise_prefix import (
    PrecisePrefixCacheProducer,
    PrecisePrefixParameters,
)
from epp.scheduling.types import Endpoint


def _eps() -> list[Endpoint]:
    return [Endpoint(n, "127.0.0.1", p) for n, p in (("a", 1), ("b", 2), ("c", 3))]


def test_off_by_default() -> None:
    prod = PrecisePrefixCacheProducer("p")
    prod.inflight["127.0.0.1:1"] = 100
    assert prod.hot(_eps()) == set()


def test_guard_marks_the_overloaded_endpoint() -> None:
    prod = PrecisePrefixCacheProducer("p", decode_params(
        PrecisePrefixParameters, {"balanceAbsThreshold": 2, "balanceRelThreshold": 1.5}, "p"))
    prod.inflight.update({"127.0.0.1:1": 5, "127.0.0.1:2": 2})
    assert prod.hot(_eps()) == {"127.0.0.1:1"}  # 5 > max(0 + 2, 0 * 1.5)
    for _ in range(3):
        prod.response_complete(None, "127.0.0.1:1", False)  # type: ignore[arg-type]  # unused
    assert prod.hot(_eps()) == set()
    prod.endpoint_removed("127.0.0.1:2")
    assert "127.0.0.1:2" not in prod.inflight


def test_token_ids_a_client_sent_that_cannot_be_keyed_match_nothing() -> None:
    from epp.kvcache.tokenization import TokenizedPrompt
    from epp.scheduling.plugins.token_producer import TOKENIZED_PROMPT
    from epp.scheduling.types import ApiType, LLMRequest

    prod = PrecisePrefixCacheProducer("p")
    for ids, want in (((-1,) * 32, 0), ((2**64,) * 32, 0), ((7,) * 32, 2)):
        r = LLMRequest("r", "m", "m", ApiType.COMPLETIONS, "", {})
        r.plugin_state[TOKENIZED_PROMPT] = TokenizedPrompt(ids)
        assert len(prod.block_keys(r)) == want  # 16-token blocks; bad ids: no keys, no crash


async def test_speculative_entries_follow_the_decision_and_expire() -> None:
    import asyncio

    from epp.kvcache.tokenization import TokenizedPrompt
    from epp.scheduling.plugins.token_producer import TOKENIZED_PROMPT
    from epp.scheduling.types import ApiType, LLMRequest, ProfileRunResult, SchedulingResult

    prod = PrecisePrefixCacheProducer("p", decode_params(
        PrecisePrefixParameters, {"speculativeIndexing": True, "speculativeTTL": "200ms"},
        "p"))
    r = LLMRequest("r", "m", "m", ApiType.COMPLETIONS, "", {})
    r.plugin_state[TOKENIZED_PROMPT] = TokenizedPrompt(tuple(range(64)))
    eps = _eps()
    prod.pre_request(r, SchedulingResult({"default": ProfileRunResult((eps[1],))}, "default"))
    keys = prod.block_keys(r)
    assert len(keys) == 4
    await asyncio.sleep(0)  # indexed on the loop's next turn
    assert prod.index.longest_prefix(keys, [e.key for e in eps])[1] == {eps[1].key: 4}
    await asyncio.sleep(0.3)
    assert prod.index.longest_prefix(keys, [e.key for e in eps])[1] == {}


async def test_pending_prefill_scorer_counts_blocks_until_the_engine_stores_them() -> None:
    import asyncio

    from epp.config.loader import load_and_build
    from epp.kvcache.events import BlockStored, KVEventBatch
    from epp.kvcache.hashing import block_hashes
    from epp.kvcache.tokenization import TokenizedPrompt
    from epp.scheduling.plugins.precise_prefix import PendingPrefillScorer
    from epp.scheduling.plugins.token_producer import TOKENIZED_PROMPT
    from epp.scheduling.types import (
        ApiType,
        CycleState,
        LLMRequest,
        ProfileRunResult,
        SchedulingResult,
    )

    cfg = load_and_build(text="""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
- type: precise-prefix-cache-producer
  parameters: {speculativeTTL: 300ms, kvEventsConfig: {discoverPods: false}}
- type: pending-prefill-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: pending-prefill-scorer, weight: 1}
  - {pluginRef: max-score-picker}
""")
    scorer = next(p for p in cfg.plugins.values() if isinstance(p, PendingPrefillScorer))
    prod = scorer.producer
    assert prod is not None and prod.track_pending and not prod.params.speculative_indexing
    eps = _eps()
    tokens = tuple(range(64))

    def request(rid: str, ids: tuple[int, ...]) -> LLMRequest:
        r = LLMRequest(rid, "m", "m", ApiType.COMPLETIONS, "", {})
        r.plugin_state[TOKENIZED_PROMPT] = TokenizedPrompt(ids)
        return r

    def sent(r: LLMRequest, i: int) -> None:
        prod.pre_request(r, SchedulingResult({"default": ProfileRunResult((eps[i],))},
                                             "default"))

    def cold() -> list[float]:  # a prompt no pod holds
        return list(scorer.score(CycleState(), request("cold", tuple(range(500, 564))), eps))

    r = request("r", tokens)
    assert cold() == [1.0, 1.0, 1.0]  # nothing pending anywhere
    sent(r, 1)
    await asyncio.sleep(0)  # recorded on the loop's next turn
    assert cold() == [1.0, 0.0, 1.0]
    # no speculative entries without speculativeIndexing: pending only
    assert prod.index.longest_prefix(prod.block_keys(r), [eps[1].key])[1] == {}
    # b's engine stores the first two blocks: half of its work is done
    hashes = block_hashes(list(tokens), 16, seed="0")
    prod.index.apply(eps[1].key, "m", KVEventBatch(1.0, (BlockStored(
        tuple(hashes[:2]), None, tokens[:32], 16, None, "GPU", None, None),)))
    sent(request("r2", tokens[:16]), 1)  # a block b holds is not pending
    sent(request("r3", tuple(range(900, 932))), 0)  # 2 new blocks for a
    await asyncio.sleep(0)
    assert prod.index.pending_blocks(eps[1].key) == 2
    assert cold() == [0.0, 0.0, 1.0]
    # a warm request (b holds its first blocks) scores 1 everywhere: affinity decides
    assert scorer.score(CycleState(), r, eps) == [1.0, 1.0, 1.0]
    await asyncio.sleep(0.4)  # speculativeTTL: whatever is left stops counting
    assert cold() == [1.0, 1.0, 1.0]


def test_pending_prefill_scorer_needs_a_precise_producer() -> None:
    import pytest

    from epp.config.loader import load_and_build
    from epp.errors import ConfigError

    base = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
{extra}- type: pending-prefill-scorer
  {params}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: pending-prefill-scorer}}
  - {{pluginRef: max-score-picker}}
"""
    with pytest.raises(ConfigError, match="exactly one precise-prefix-cache-producer"):
        load_and_build(text=base.format(extra="", params=""))
    with pytest.raises(ConfigError, match="'max-score-picker': a max-score-picker, not a"):
        load_and_build(text=base.format(
            extra="", params="parameters: {prefixMatchInfoProducerName: max-score-picker}"))
    with pytest.raises(ConfigError, match="must not be empty"):
        load_and_build(text=base.format(
            extra="", params="parameters: {prefixMatchInfoProducerName: ''}"))


def test_balance_popular_only_spreads_a_shared_prompt_but_keeps_one_of_many() -> None:
    """``balancePopularOnly``: the guard zeroes an overloaded holder's prefix score only
    for a prefix group whose share of the recent requests calls for more holders."""
    from epp.kvcache.tokenization import TokenizedPrompt
    from epp.scheduling.plugins.token_producer import TOKENIZED_PROMPT
    from epp.scheduling.types import ApiType, LLMRequest, ProfileRunResult, SchedulingResult

    prod = PrecisePrefixCacheProducer("p", decode_params(
        PrecisePrefixParameters, {"balanceAbsThreshold": 2, "balancePopularOnly": True}, "p"))
    eps = _eps()

    def request(first: int) -> LLMRequest:
        r = LLMRequest("r", "m", "m", ApiType.COMPLETIONS, "", {})
        r.plugin_state[TOKENIZED_PROMPT] = TokenizedPrompt(tuple(range(first, first + 64)))
        return r

    def send(r: LLMRequest, matched: dict[str, int]) -> set[str]:
        out = prod.excluded(r, eps, matched)
        prod.pre_request(r, SchedulingResult({"default": ProfileRunResult((eps[0],))},
                                             "default"))
        return out

    held = {eps[0].key: 4}  # only a holds the prompt's 4 blocks
    # one shared prompt: every request is its group's -> it calls for 3 holders
    for _ in range(6):
        send(request(0), held)
    assert prod.inflight[eps[0].key] == 6  # a is far busier than b and c (0)
    assert prod.excluded(request(0), eps, held) == {eps[0].key}
    # many groups, each seen once: a group calls for one holder, so a keeps it
    quiet = PrecisePrefixCacheProducer("q", decode_params(
        PrecisePrefixParameters, {"balanceAbsThreshold": 2, "balancePopularOnly": True}, "q"))
    quiet.inflight[eps[0].key] = 6
    for g in range(1, 40):
        r = request(1000 * g)
        assert quiet.excluded(r, eps, held) == set()
        quiet.pre_request(r, SchedulingResult({"default": ProfileRunResult((eps[1],))},
                                              "default"))
    # the same prompt held on CPU (weight 0.8: 4 blocks count 3) is the same group
    from epp.scheduling.plugins.precise_prefix import PrefixMatch

    on_cpu = request(0)
    on_cpu.plugin_state["precise-prefix/p"] = (
        tuple(e.key for e in eps), PrefixMatch(4, {eps[0].key: 3}, {eps[0].key: 4},
                                               {"CPU": {eps[0].key: 4}}, 16))
    assert prod.excluded(on_cpu, eps, {eps[0].key: 3}) == {eps[0].key}
    # without balancePopularOnly the plain guard acts on that request too
    plain = PrecisePrefixCacheProducer("g", decode_params(
        PrecisePrefixParameters, {"balanceAbsThreshold": 2}, "g"))
    plain.inflight[eps[0].key] = 6
    assert plain.excluded(request(5000), eps, held) == {eps[0].key}


def test_avoid_queueing_moves_a_request_off_a_holder_without_kv_room() -> None:
    """``avoidQueueing`` as on the approximate producer: a holder whose KV cache has no
    room for the request (last scrape less what this EPP routed there since) and whose
    predicted wait exceeds the prefill it saves loses its prefix score; its requests'
    durations are measured from routing to response end."""
    import itertools

    from epp.kvcache.tokenization import TokenizedPrompt
    from epp.scheduling.plugins.token_producer import TOKENIZED_PROMPT
    from epp.scheduling.types import (
        ApiType,
        LLMRequest,
        Metrics,
        ProfileRunResult,
        SchedulingResult,
    )

    assert PrecisePrefixCacheProducer("off").queues is None
    prod = PrecisePrefixCacheProducer("p", decode_params(
        PrecisePrefixParameters, {"avoidQueueing": True, "prefillMsPerToken": 0.1}, "p"))
    assert prod.queues is not None
    prod.queues.clock = itertools.chain([0.0, 0.4], itertools.repeat(1.0)).__next__

    def ep(i: int, at: float, running: int = 0, usage: float = 0.0) -> Endpoint:
        # 100 blocks of 16 tokens: 1,600 tokens of KV cache
        return Endpoint(f"p{i}", "127.0.0.1", i, metrics=Metrics(
            running_requests=running, kv_cache_usage=usage, num_blocks=100,
            block_size=16, updated_at=at))

    def request(first: int, n: int = 320, max_tokens: int = 16) -> LLMRequest:
        r = LLMRequest("r", "m", "m", ApiType.COMPLETIONS, "", {}, max_tokens=max_tokens)
        r.plugin_state[TOKENIZED_PROMPT] = TokenizedPrompt(tuple(range(first, first + n)))
        return r

    def route(r: LLMRequest, e: Endpoint) -> None:
        prod.pre_request(r, SchedulingResult({"default": ProfileRunResult((e,))}, "default"))

    held = {"127.0.0.1:0": 20}  # pod 0 holds all 20 blocks (320 tokens) of the prompt
    first = request(0)
    route(first, ep(0, 1.0))
    prod.response_complete(first, "127.0.0.1:0", aborted=False)
    assert prod.queues.duration["127.0.0.1:0"] == 400.0  # routed at 0.0, ended at 0.4 s
    # room on pod 0 (at 10 % usage): it keeps the prefix score
    assert prod.excluded(request(0), [ep(0, 2.0, 1, 0.1), ep(1, 2.0)], held) == set()
    # full (99.9 %) with one running: a wait of 2 x 400 / 2 = 400 ms > 32 ms of prefill
    full = [ep(0, 2.0, 1, 0.999), ep(1, 2.0)]
    assert prod.excluded(request(0), full, held) == {"127.0.0.1:0"}
    # a cheaper wait than the prefill saved keeps the affinity
    prod.queues.duration["127.0.0.1:0"] = 20.0
    assert prod.excluded(request(0), full, held) == set()
    # what it routed to pod 1 since pod 1's scrape fills pod 1: pod 1 waits too, and
    # the holder's shorter wait plus no prefill wins
    prod.queues.duration["127.0.0.1:1"] = 400.0
    for i in range(5):
        route(request(10_000 * (i + 1)), ep(1, 2.0, 1, 0.9))
    assert prod.queues.pending["127.0.0.1:1"][2] == 5
    assert prod.excluded(request(0), [ep(0, 2.0, 1, 0.999), ep(1, 2.0, 1, 0.9)],
                         held) == {"127.0.0.1:1"}
    prod.endpoint_removed("127.0.0.1:1")
    assert "127.0.0.1:1" not in prod.queues.pending
