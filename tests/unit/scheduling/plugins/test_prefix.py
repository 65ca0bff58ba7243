"""Approximate prefix cache: the producer and scorer plugins (the hashing and the bounded
index they use: tests/unit/scheduling/prefix/test_indexer.py)."""

from __future__ import annotations

from typing import Any

import pytest

from epp.config.loader import build, load_and_build, parse_config
from epp.scheduling.plugins.prefix import (
    ApproxPrefixCacheProducer,
    PrefixCacheScorer,
    PrefixPopularity,
)
from epp.scheduling.types import (
    ApiType,
    CycleState,
    Endpoint,
    LLMRequest,
    Metrics,
    ProfileRunResult,
    SchedulingResult,
)


def req(prompt: str, model: str = "m", salt: str | None = None) -> LLMRequest:
    return LLMRequest("r", model, model, ApiType.COMPLETIONS, prompt, {}, cache_salt=salt)


def eps(n: int) -> list[Endpoint]:
    return [Endpoint(f"p{i}", f"10.0.0.{i}", 8000) for i in range(n)]


def went_to(producer: ApproxPrefixCacheProducer, r: LLMRequest, e: Endpoint) -> None:
    producer.pre_request(r, SchedulingResult({"default": ProfileRunResult((e,))}, "default"))


def test_scorer_scores_matched_over_total_and_index_follows_decisions() -> None:
    prod = ApproxPrefixCacheProducer("prod", block_size_tokens=4)  # 16-char blocks
    scorer = PrefixCacheScorer("s")
    scorer.producer = prod
    e = eps(3)
    system = "You are helpful." * 4  # 4 blocks
    r1 = req(system + "question one, please?")  # 16*4 + 21 chars -> 5 blocks
    assert scorer.score(CycleState(), r1, e) == [0.0, 0.0, 0.0]
    went_to(prod, r1, e[1])
    r2 = req(system + "question two, please?")
    scores = scorer.score(CycleState(), r2, e)
    assert scores[0] == 0 and scores[2] == 0 and scores[1] == pytest.approx(4 / 5)
    assert scorer.score(CycleState(), req(r1.prompt), e)[1] == 1.0
    prod.endpoint_removed(e[1].key)
    assert scorer.score(CycleState(), r2, e) == [0.0, 0.0, 0.0]


def test_hashes_computed_once_per_request() -> None:
    prod = ApproxPrefixCacheProducer("prod")
    r = req("z" * 1000)
    first = prod.hashes(r)
    assert prod.hashes(r) is first


def test_auto_tune_sets_capacity_from_cache_config_info() -> None:
    prod = ApproxPrefixCacheProducer("prod", block_size_tokens=16)
    e = Endpoint("p", "10.0.0.1", 8000, metrics=Metrics(block_size=16, num_blocks=100))
    prod.match(CycleState(), req("q" * 64 * 3), [e])
    assert prod.index.capacity(e.key) == 100


def test_chat_history_changes_affinity_only_after_shared_part() -> None:
    # Every message counts: two chats sharing a long first message but differing later
    # match for the shared blocks only.
    prod = ApproxPrefixCacheProducer("prod", block_size_tokens=4)
    scorer = PrefixCacheScorer("s")
    scorer.producer = prod
    e = eps(2)
    shared = "<|system|>\n" + "be brief. " * 20 + "\n"
    a = req(shared + "<|user|>\nfirst question about billing\n")
    went_to(prod, a, e[0])
    b = req(shared + "<|user|>\nsecond question about storage\n")
    s = scorer.score(CycleState(), b, e)
    total = len(prod.hashes(b))
    assert 0 < s[0] < 1 and s[1] == 0
    assert s[0] == pytest.approx((len(shared.encode()) // 16) / total)


def test_config_scorer_alone_creates_its_producer_from_gie_parameters() -> None:
    built = build(parse_config("""
plugins:
- type: prefix-cache-scorer
  parameters: {hashBlockSize: 32, maxPrefixBlocksToMatch: 8, lruCapacityPerServer: 50}
- type: max-score-picker
""", "t.yaml"))
    scorer = built.plugins["prefix-cache-scorer"]
    assert isinstance(scorer, PrefixCacheScorer) and scorer.producer is not None
    assert scorer.producer.block_chars == 32 and scorer.producer.max_blocks == 8
    assert scorer.producer.index.default_capacity == 50
    assert scorer.producer in built.pre_request and scorer.producer in built.endpoint_removed


def test_config_declared_producer_is_shared() -> None:
    built = load_and_build()
    scorer = built.plugins["prefix-cache-scorer"]
    assert isinstance(scorer, PrefixCacheScorer)
    assert scorer.producer is built.plugins["approx-prefix-cache-producer"]


def test_scorer_parameters_beside_a_declared_producer_are_ignored_with_a_warning() -> None:
    # GIE's scorer then reads the declared producer; its own parameters are not used.
    built = build(parse_config("""
plugins:
- type: prefix-cache-scorer
  parameters: {blockSizeTokens: 8}
- type: approx-prefix-cache-producer
""", "t.yaml"))
    (warning,) = built.warnings
    assert warning.startswith("t.yaml: prefix-cache-scorer: parameters on prefix-cache-scorer "
                              "are ignored") and "set them there" in warning
    scorer = built.plugins["prefix-cache-scorer"]
    assert scorer.producer is built.plugins["approx-prefix-cache-producer"]  # type: ignore[attr-defined]
    assert scorer.producer.block_size_tokens == 16  # type: ignore[attr-defined]


def test_default_config_routes_repeat_prompts_to_the_same_endpoint() -> None:
    built = load_and_build()
    e = eps(4)
    prompt = "tell me about the history of the printing press " * 20
    chosen = set()
    for _ in range(10):
        r = req(prompt)
        result = built.scheduler.schedule(r, e)
        for p in built.pre_request:
            p.pre_request(r, result)
        key = result.primary.endpoints[0].key
        chosen.add(key)
        for p in built.response_complete:  # sequential: each finishes before the next
            p.response_complete(r, key, False)
    assert len(chosen) == 1


def test_balance_guard_spreads_a_shared_prompt_under_load() -> None:
    """The hot-spot trap: one shared prompt, many concurrent requests."""
    built = load_and_build()
    e = eps(4)
    prompt = "one system prompt shared by all traffic " * 40
    placed: dict[str, int] = {}
    for _ in range(40):  # 40 concurrent requests, none finishes
        r = req(prompt)
        result = built.scheduler.schedule(r, e)
        for p in built.pre_request:
            p.pre_request(r, result)
        key = result.primary.endpoints[0].key
        placed[key] = placed.get(key, 0) + 1
    assert len(placed) == 4
    # No pod exceeds the least loaded by more than balanceAbsThreshold (4) + 1.
    assert max(placed.values()) - min(placed.values()) <= 5


def test_balance_guard_off_piles_onto_one_pod() -> None:
    prod = ApproxPrefixCacheProducer("prod", balance_abs_threshold=0)
    scorer = PrefixCacheScorer("s")
    scorer.producer = prod
    e = eps(3)
    r = req("shared " * 100)
    for _ in range(20):
        went_to(prod, req(r.prompt), e[0])
    assert scorer.score(CycleState(), req(r.prompt), e)[0] == 1.0


def test_balance_guard_uses_inflight_and_scraped_load() -> None:
    prod = ApproxPrefixCacheProducer("prod", balance_abs_threshold=2, balance_rel_threshold=1.5)
    e = eps(3)
    prod.inflight = {e[0].key: 3}
    assert prod.hot(e) == {e[0].key}           # 3 > max(0 + 2, 0 * 1.5)
    prod.inflight = {e[0].key: 2}
    assert prod.hot(e) == set()                # 2 is not > 2
    x = Endpoint("x", "10.0.1.1", 8000, metrics=Metrics(waiting_queue_size=4, running_requests=4))
    y = Endpoint("y", "10.0.1.2", 8000, metrics=Metrics(running_requests=5))
    assert prod.hot([x, y]) == {"10.0.1.1:8000"}   # 8 > max(5 + 2, 7.5)
    y2 = Endpoint("y", "10.0.1.2", 8000, metrics=Metrics(running_requests=6))
    assert prod.hot([x, y2]) == set()              # 8 is not > max(6 + 2, 9)
    r = req("q" * 200)
    went_to(prod, r, e[1])
    assert prod.inflight[e[1].key] == 1
    prod.response_complete(r, e[1].key, aborted=True)
    assert e[1].key not in prod.inflight       # aborts release too


def test_popularity_share_fades_and_sets_replicas() -> None:
    pop = PrefixPopularity(window=10)
    for _ in range(9):
        pop.count(1)
    pop.count(None)  # a request with no cached prefix: the total only
    assert pop.replicas(1, 4) == 4       # ~90 % of the requests: ceil(0.9 * 4)
    assert pop.replicas(2, 4) == 1       # never seen
    for _ in range(30):
        pop.count(2)
    # group 1 went quiet: its weight fades (9 × 0.9^30 ≈ 0.4 of ~10), group 2 took over
    assert pop.replicas(1, 4) == 1
    assert pop.replicas(2, 4) == 4
    steady = PrefixPopularity(window=1000)
    for _ in range(200):  # 40 % and 60 % of the requests: 1.6 and 2.4 holders' worth
        for g in (1, 3, 1, 3, 3):
            steady.count(g)
    assert (steady.replicas(1, 4), steady.replicas(3, 4)) == (2, 3)


def test_popularity_forgets_quiet_groups_beyond_its_bound() -> None:
    pop = PrefixPopularity(window=2)
    for g in range(PrefixPopularity.MAX_GROUPS + 10):
        pop.count(g)
    assert len(pop._groups) <= PrefixPopularity.MAX_GROUPS
    assert pop.replicas(PrefixPopularity.MAX_GROUPS + 9, 4) == 2  # weight 1 of ~2


def test_replicate_hot_prefixes_spreads_a_hot_prompt_and_keeps_a_cold_one() -> None:
    prod = ApproxPrefixCacheProducer("prod", block_size_tokens=4, balance_abs_threshold=0,
                                     replicate_hot_prefixes=True)
    scorer = PrefixCacheScorer("s")
    scorer.producer = prod
    e = eps(4)
    placed = dict.fromkeys(e, 0)

    def route(prompt: str) -> list[float]:
        # the best prefix score wins; among equals the pod with the fewest requests (the
        # load scorers' part)
        r = req(prompt)
        scores = scorer.score(CycleState(), r, e)
        pick = max(e, key=lambda x: (scores[e.index(x)], -placed[x]))
        placed[pick] += 1
        went_to(prod, r, pick)
        return scores

    hot = "You are helpful." * 8  # 8 blocks, shared by every request
    seen = [route(hot + f"question {i}") for i in range(12)]
    # The hot prompt calls for all 4 pods: while it had fewer holders, theirs scored 0
    # and the request went to a pod without it; now all 4 hold it and affinity is back.
    assert any(s.count(0.0) == 4 for s in seen[1:])
    assert all(placed[x] > 0 for x in e)
    assert route(hot + "one more") == [1.0] * 4
    # a conversation among many hot requests is not hot: its next turn keeps its pod
    convo = "Another prompt!!" * 8
    route(convo + "turn 1")
    holder = max(e, key=lambda x: prod.index.match(prod.hashes(req(convo)), (x.key,)).get(
        x.key, 0))
    scores = route(convo + "turn 2 ...")
    assert scores[e.index(holder)] == 1.0
    assert sorted(scores) == [0.0, 0.0, 0.0, 1.0]


def _built_with_producer(parameters: str) -> Any:
    """A config of the approximate producer with ``parameters`` (YAML flow mapping), the
    prefix scorer and a picker, built."""
    return build(parse_config(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\n"
        "kind: EndpointPickerConfig\n"
        "plugins:\n"
        "- type: approx-prefix-cache-producer\n"
        f"  parameters: {parameters}\n"
        "- type: prefix-cache-scorer\n"
        "- type: max-score-picker\n"
        "schedulingProfiles:\n"
        "- name: default\n"
        "  plugins: [{pluginRef: prefix-cache-scorer}, {pluginRef: max-score-picker}]\n"))


def test_balance_popular_only_guards_a_shared_prompt_but_not_one_of_many_groups() -> None:
    built = _built_with_producer("{balancePopularOnly: true, balanceAbsThreshold: 2}")
    prod = next(p for p in built.plugins.values() if isinstance(p, ApproxPrefixCacheProducer))
    scorer = next(p for p in built.plugins.values() if isinstance(p, PrefixCacheScorer))
    assert prod.balance_popular_only and prod.popularity is not None
    assert not prod.replicate_hot_prefixes
    assert not ApproxPrefixCacheProducer("x").balance_popular_only
    e = eps(3)

    def score(prompt: str) -> list[float]:
        return list(scorer.score(CycleState(), req(prompt), e))

    def route(prompt: str, to: Endpoint) -> None:
        r = req(prompt)
        scorer.score(CycleState(), r, e)  # finds the request's group, counted when routed
        went_to(prod, r, to)

    # 30 groups, each held by one pod, requested in turn: each is 1/30 of the traffic
    groups = [f"group {g} system prompt " * 20 for g in range(30)]
    for _ in range(3):
        for g, prompt in enumerate(groups):
            route(prompt + "q", e[g % 3])
    # pod 0 is far busier than the others: the guard alone would zero its prefix score
    prod.inflight = {e[0].key: 6}
    assert prod.hot(e) == {e[0].key}
    assert score(groups[0] + "q") == [1.0, 0.0, 0.0]  # one of many groups keeps its pod
    # one prompt becomes most of the traffic: it calls for more holders, so the guard acts
    shared = "the one shared system prompt " * 20
    for _ in range(200):
        route(shared + "q", e[0])
    prod.inflight = {e[0].key: 6}
    assert score(shared + "q")[0] == 0.0
    prod.inflight = {}
    assert score(shared + "q")[0] == 1.0             # not hot: affinity is back
    # the plain guard (balancePopularOnly off) zeroes pod 0 for every prefix
    plain = ApproxPrefixCacheProducer("plain", balance_abs_threshold=2)
    plain.index = prod.index
    plain.inflight = {e[0].key: 6}
    assert plain.excluded(req(groups[0] + "q"), e, {e[0].key: 5}) == {e[0].key}


def test_replicate_hot_prefixes_is_off_by_default_and_parsed() -> None:
    assert ApproxPrefixCacheProducer("prod").popularity is None
    built = _built_with_producer("{replicateHotPrefixes: true}")
    prod = next(p for p in built.plugins.values() if isinstance(p, ApproxPrefixCacheProducer))
    assert prod.popularity is not None



def _scraped(i: int, at: float, waiting: int = 0, running: int = 0,
             usage: float = 0.0) -> Endpoint:
    """An endpoint of 100 blocks of 16 tokens (1,600 tokens, 6,400 prompt characters)."""
    return Endpoint(f"p{i}", f"10.0.0.{i}", 8000, metrics=Metrics(
        waiting_queue_size=waiting, running_requests=running, kv_cache_usage=usage,
        num_blocks=100, block_size=16, updated_at=at))




def test_avoid_queueing_weighs_the_wait_for_kv_room_against_the_saved_prefill() -> None:
    prod = ApproxPrefixCacheProducer("prod", balance_abs_threshold=0, avoid_queueing=True)
    a, b = "10.0.0.0:8000", "10.0.0.1:8000"
    r = req("x" * 4000)  # 1,000 tokens: 50 ms of prefill at 0.05 ms/token
    cached = {a: 62}     # a holds 992 of them (62 blocks of 16 tokens), b none
    running = req(r.prompt)  # the same prompt in flight on a: its blocks are in use there
    assert prod.queues is not None

    def need(request: LLMRequest, key: str) -> float:
        assert prod.queues is not None
        return prod.queues.need(key, prod.hashes(request), len(request.prompt) / 4,
                                prod.block_chars / 4,
                                request.max_tokens)

    went_to(prod, running, _scraped(0, 0.5))
    assert need(r, a) == 8.0 and need(r, b) == 1000
    prod.queues.duration = {a: 400.0, b: 400.0}
    # a runs one request and has room for the 8 tokens the new one adds: no wait
    assert prod.full(r, [_scraped(0, 1.0, running=1, usage=0.9), _scraped(1, 1.0)],
                     cached) == set()
    # ... but not for its output as well (200 tokens): it would wait half a response
    # (200 ms) there to save 50 ms of prefill
    long_answer = LLMRequest("r", "m", "m", ApiType.COMPLETIONS, r.prompt, {}, max_tokens=200)
    assert prod.full(long_answer, [_scraped(0, 1.0, running=1, usage=0.9), _scraped(1, 1.0)],
                     cached) == {a}
    assert prod.full(r, [_scraped(0, 1.0, running=1, usage=0.999), _scraped(1, 1.0)],
                     cached) == {a}
    # a wait shorter than the prefill saved keeps the affinity
    prod.queues.duration[a] = 80.0
    assert prod.full(r, [_scraped(0, 1.0, running=1, usage=0.999), _scraped(1, 1.0)],
                     cached) == set()
    prod.queues.duration[a] = 400.0
    # what this EPP routed to a since its last scrape takes a's free room (160 tokens)
    other = req("y" * 4000)
    went_to(prod, other, _scraped(0, 2.0, running=1, usage=0.9))
    assert prod.queues.pending[a] == (2.0, 1000.0, 1)
    assert prod.full(r, [_scraped(0, 2.0, running=1, usage=0.9), _scraped(1, 2.0)],
                     cached) == {a}
    # 1 ahead, and the running one ends after half its duration on average: 2 x 400 / 2
    assert prod.queues.wait(_scraped(0, 2.0, running=1, usage=0.9), 8.0) == 400.0
    # a newer scrape already counts it
    assert prod.full(r, [_scraped(0, 3.0, running=2, usage=0.5), _scraped(1, 3.0)],
                     cached) == set()
    # an idle pod never waits; both full: the shorter wait plus prefill keeps its affinity
    assert prod.queues.wait(_scraped(0, 4.0, usage=1.0), 8.0) == 0.0
    assert prod.full(r, [_scraped(0, 4.0, running=2, usage=1.0),
                         _scraped(1, 4.0, waiting=1, running=1, usage=1.0)], cached) == {b}
    # responses that end free their blocks
    prod.response_complete(running, a, aborted=False)
    assert need(r, a) == 1000.0
    # no response measured on a pod yet, or no cache_config_info: nothing to weigh
    fresh = ApproxPrefixCacheProducer("f", balance_abs_threshold=0, avoid_queueing=True)
    assert fresh.full(r, [_scraped(0, 1.0, running=1, usage=1.0), _scraped(1, 1.0)],
                      cached) == set()
    bare = Endpoint("p0", "10.0.0.0", 8000, metrics=Metrics(running_requests=9,
                                                            kv_cache_usage=1.0))
    assert prod.queues.wait(bare, 8.0) == 0.0
    prod.endpoint_removed(a)
    q = prod.queues
    assert a not in q.pending and a not in q.duration and a not in q.flight

def test_avoid_queueing_measures_durations_and_zeroes_the_prefix_score() -> None:
    built = _built_with_producer(
        "{avoidQueueing: true, balanceAbsThreshold: 0, prefillMsPerToken: 0.1}")
    prod = next(p for p in built.plugins.values() if isinstance(p, ApproxPrefixCacheProducer))
    scorer = next(p for p in built.plugins.values() if isinstance(p, PrefixCacheScorer))
    assert prod.queues is not None and prod.queues.prefill_ms_per_token == 0.1
    assert ApproxPrefixCacheProducer("x").queues is None
    prompt = "a long shared document " * 200  # 4,600 characters
    e0 = _scraped(0, 1.0)
    first = req(prompt)
    went_to(prod, first, e0)
    prod.response_complete(first, e0.key, aborted=False)
    assert prod.queues.duration[e0.key] >= 0.0
    prod.queues.duration[e0.key] = 10_000.0  # as if that response had taken 10 s
    quiet = [_scraped(0, 1.5, running=1), _scraped(1, 1.5)]  # a scrape after that request
    assert scorer.score(CycleState(), req(prompt), quiet)[0] == 1.0
    starved = [_scraped(0, 2.0, waiting=1, running=1, usage=1.0), _scraped(1, 2.0)]
    assert scorer.score(CycleState(), req(prompt), starved) == [0.0, 0.0]
