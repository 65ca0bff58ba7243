"""llm-d-router v0.10.0's request data producers (issue 18): ``session-id-producer``,
``burst-prefix-cache-producer`` and ``p2p-source-producer``.

Go sources: pkg/epp/framework/plugins/requestcontrol/dataproducer/{sessionid,burstprefix,
p2psource}/ (and their *_test.go), datalayer/attribute/session/data_types.go,
scheduling/util/sessionaffinity/session_id.go (the attribute source that reads the id)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import pytest

from epp import keys
from epp.config.loader import load_and_build
from epp.errors import ConfigError
from epp.kvcache.tokenization import TokenizedPrompt
from epp.scheduling.plugins.llmd_producers import (
    HEADER_KV_CACHE_SOURCE,
    UNLIMITED,
    BurstEntry,
    BurstPrefixCacheProducer,
    BurstPrefixParameters,
    P2PSourceProducer,
    SessionIdProducer,
    assign,
    block_hashes,
    cookie_value,
    session_id_key,
    spread_fraction,
)
from epp.scheduling.plugins.precise_prefix import PrefixMatch
from epp.scheduling.plugins.token_producer import TOKENIZED_PROMPT, TokenProducer
from epp.scheduling.types import (
    ApiType,
    Endpoint,
    LLMRequest,
    Metrics,
    ProfileRunResult,
    SchedulingResult,
)
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, ServerParts, wire

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def ep(i: int, **metrics: Any) -> Endpoint:
    return Endpoint(name=f"pod-{i}", address=f"10.0.0.{i}", port=8000,
                    metrics=Metrics(**metrics))


def req(headers: Mapping[str, str] | None = None, rid: str = "r") -> LLMRequest:
    return LLMRequest(request_id=rid, target_model="m", incoming_model="m",
                      api=ApiType.CHAT_COMPLETIONS, prompt="hi", headers=dict(headers or {}))


def server(text: str) -> ServerParts:
    timings = PluginTimings()
    built = load_and_build(None, text, timer=timings, strict=True)
    return wire(validate(ServeOptions(static=StaticSourceOptions(endpoints=f"{A},{B},{C}"))),
                built, timings, None)


async def route(parts: ServerParts, rid: str, content: str = "hello there",
                **headers: str) -> tuple[str, dict[str, str]]:
    d = parts.director
    h = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": rid, **headers}
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})
    routing = await d.route(h, body, True, None)
    d.on_response_headers(routing.context, 200, {"content-type": "application/json"})
    d.on_response_body(routing.context, b"{}", True)
    d.on_done(routing.context, aborted=False)
    return routing.destination, dict(routing.set_headers)


# ----------------------------------------------------------------- session-id-producer


@pytest.mark.parametrize(("params", "error"), [
    ({}, "requires exactly one of headerName or cookieName to be set"),
    ({"headerName": "", "cookieName": ""}, "requires exactly one of headerName or cookieName"),
    ({"headerName": "x", "cookieName": "y"}, "to be set, not both"),
])
def test_session_id_producer_needs_exactly_one_source(params: dict[str, str],
                                                      error: str) -> None:
    text = orjson.dumps({"plugins": [{"type": "session-id-producer",
                                      "parameters": params}]}).decode()
    with pytest.raises(ConfigError, match=error):
        load_and_build(None, text)


async def test_session_id_from_a_header_normalized_and_trimmed() -> None:
    p = SessionIdProducer("session-id-producer", header_name=" X-Session-ID ")
    assert p.header_name == "x-session-id"
    assert dict(p.produces) == {"SessionIDDataKey/session-id-producer": "SessionID"}
    for headers, want in [({"x-session-id": "user-42"}, "user-42"),
                          ({"x-session-id": "  user-42  "}, "user-42"),
                          ({"x-session-id": ""}, None), ({"other": "x"}, None), ({}, None)]:
        r = req(headers)
        await p.prepare_request_data(r, [])
        assert r.plugin_state.get(session_id_key()) == want
        if want is None:
            assert r.plugin_state == {}


@pytest.mark.parametrize(("cookie", "want"), [
    ("llm-d-session=abc123", "abc123"),
    ("csrf=xyz; llm-d-session=abc123; theme=dark", "abc123"),
    ("csrf=xyz; theme=dark", None),
    ("", None),
    ("no-equals; llm-d-session=abc", "abc"),
    ("llm-d-session=", None),
    ("llm-d-session= abc123 ; other=v", "abc123"),
])
async def test_session_id_from_a_cookie(cookie: str, want: str | None) -> None:
    p = SessionIdProducer("sid", cookie_name="llm-d-session")
    r = req({"cookie": cookie})
    await p.prepare_request_data(r, [])
    assert r.plugin_state.get(session_id_key("sid")) == want
    assert cookie_value("a=1", "") == ""


SESSION_CONFIG = """
plugins:
- type: session-id-producer
  parameters: {cookieName: llm-d-session}
- type: session-affinity-filter
  parameters:
    strategy: session_id
    sessionIdConfig:
      sources: [{attribute: SessionIDDataKey/session-id-producer}]
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: session-affinity-filter}, {pluginRef: queue-scorer}]
"""


async def test_session_affinity_reads_the_producers_key() -> None:
    """As in llm-d, the affinity plugins read the producer's value through an
    ``attribute`` source naming its data key: a session carried in a cookie sticks."""
    parts = server(SESSION_CONFIG)
    first, _ = await route(parts, "r1", cookie="llm-d-session=s1")
    for i in range(6):
        pods = [e.key for e in parts.store.snapshot()]
        dest, _ = await route(parts, f"r{i + 2}", cookie="theme=x; llm-d-session=s1")
        assert dest == first and first in pods


# ------------------------------------------------------------ burst-prefix-cache-producer


@pytest.mark.parametrize(("params", "error"), [
    ({"windowDurationMs": 0}, "windowDurationMs: invalid configuration: must be > 0"),
    ({"windowDurationMs": 10001}, "must be <= 10000"),
    ({"maxPerReplica": 0}, "maxPerReplica: invalid configuration: must be -1 (unlimited)"),
    ({"blockSizeTokens": 0}, "blockSizeTokens: invalid configuration: must be > 0"),
    ({"maxPrefixTokensToMatch": -1}, "must be >= 0"),
    ({"maxPrefixTokensToMatch": 10}, "must be 0 or >= blockSizeTokens (64)"),
    ({"minColocateBlocks": -1}, "minColocateBlocks: invalid configuration: must be >= 0"),
    ({"maxBatchSize": 0}, "maxBatchSize: invalid configuration: must be -1 (unlimited)"),
    ({"balanceBy": "bytes"}, "balanceBy: invalid configuration: must be 'requests' or"),
])
def test_burst_parameters_are_validated(params: dict[str, Any], error: str) -> None:
    text = orjson.dumps({"plugins": [{"type": "burst-prefix-cache-producer",
                                      "parameters": params}]}).decode()
    with pytest.raises(ConfigError) as info:
        load_and_build(None, text)
    assert error in str(info.value)


def test_burst_defaults() -> None:
    built = load_and_build(None, "plugins: [{type: burst-prefix-cache-producer}]\n")
    p = built.plugins["burst-prefix-cache-producer"]
    assert isinstance(p, BurstPrefixCacheProducer)
    assert (p.window_s, p.max_blocks, p.params.max_per_replica, p.params.block_size_tokens,
            p.params.max_batch_size, p.by_tokens) == (0.1, 2048, -1, 64, 1000, False)
    assert p.produce_timeout() == pytest.approx(0.4)
    capped = BurstPrefixCacheProducer("b", BurstPrefixParameters(
        max_prefix_tokens_to_match=256))
    assert capped.max_blocks == 4


def test_block_hashes_chain_and_cap() -> None:
    h = block_hashes(list(range(130)), "m", None, 64, 2048)
    assert len(h) == 3  # the last block is partial
    assert block_hashes(list(range(64)) + [7], "m", None, 64, 2048)[0] == h[0]
    assert block_hashes(list(range(130)), "other", None, 64, 2048)[0] != h[0]
    assert block_hashes(list(range(130)), "m", "salt", 64, 2048)[0] != h[0]
    assert len(block_hashes(list(range(1000)), "m", None, 64, 2)) == 2
    assert block_hashes([], "m", None, 64, 2) == []


PODS = [ep(1), ep(2), ep(3)]


def entry(*hashes: int) -> BurstEntry:
    return BurstEntry(tuple(hashes), PODS)


def test_assign_groups_identical_prompts_on_one_replica() -> None:
    g1 = [entry(1, 2, 3) for _ in range(4)]
    g2 = [entry(7, 8) for _ in range(3)]
    alone = entry(9, 10)
    assign([*g1, *g2, alone])
    assert {e.assigned.key for e in g1 if e.assigned} == {A}  # longest prefix first
    assert {e.assigned.key for e in g2 if e.assigned} == {B}  # least loaded next
    assert alone.assigned is None  # overlaps no other request: no affinity
    assert entry().assigned is None


def test_assign_caps_a_group_per_replica() -> None:
    group = [entry(1, 2) for _ in range(5)]
    assign(group, k=2)
    placed = [e.assigned.key for e in group if e.assigned]
    assert placed.count(A) == 2 and placed.count(B) == 2 and placed.count(C) == 1


def test_assign_colocates_shared_prefixes_within_fair_share() -> None:
    # Two distinct prompts sharing 2 leading blocks: with minColocateBlocks 2 they share
    # a replica; with 0 they are not units at all (no affinity).
    two = PODS[:2]
    a1, a2 = BurstEntry((1, 2, 3), two), BurstEntry((1, 2, 4), two)
    b1, b2 = BurstEntry((5, 6, 7), two), BurstEntry((5, 6, 8), two)
    assign([a1, b1, a2, b2], min_colocate=2)
    assert a1.assigned is not None and a1.assigned is a2.assigned
    assert b1.assigned is not None and b1.assigned is b2.assigned
    assert a1.assigned is not b1.assigned
    b1, b2 = entry(1, 2, 3), entry(1, 2, 4)
    assign([b1, b2])
    assert b1.assigned is None and b2.assigned is None
    # The fair share bounds co-location: six prefix-sharing units over 3 replicas.
    units = [entry(1, 2, 100 + i) for i in range(6)]
    assign(units, min_colocate=2)
    placed = [e.assigned.key for e in units if e.assigned]
    assert sorted(placed.count(k) for k in (A, B, C)) == [2, 2, 2]


def test_assign_breaks_ties_by_running_requests() -> None:
    busy = [ep(1, running_requests=5), ep(2, running_requests=1), ep(3, running_requests=3)]
    group = [BurstEntry((1,), busy) for _ in range(2)]
    assign(group)
    assert {e.assigned.key for e in group if e.assigned} == {B}


def test_assign_by_tokens_spreads_long_prompts() -> None:
    long_a = [entry(*range(100)) for _ in range(2)]
    long_b = [entry(*range(200, 300)) for _ in range(2)]
    short = [entry(500) for _ in range(2)]
    assign([*long_a, *long_b, *short], by_tokens=True)
    assert {long_a[0].assigned.key, long_b[0].assigned.key} == {A, B}  # type: ignore[union-attr]  # placed
    assert short[0].assigned is not None and short[0].assigned.key == C


class FakeTokens:
    name = "fake"

    async def tokenize(self, body: Mapping[str, Any] | None, prompt: str) -> list[int]:
        msgs = (body or {}).get("messages") or [{"content": prompt}]
        return [len(w) * 1000 + i % 7 for m in msgs for i, w in enumerate(
            str(m["content"]).split())]

    async def close(self) -> None:
        return None


BURST_CONFIG = """
plugins:
- type: token-producer
- type: burst-prefix-cache-producer
  parameters: {windowDurationMs: %d, maxBatchSize: %d, blockSizeTokens: 4}
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: burst-prefix-cache-producer}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-scorer, weight: 2}, {pluginRef: queue-scorer}]
"""


def burst_server(window_ms: int = 50, max_batch: int = 1000) -> ServerParts:
    parts = server(BURST_CONFIG % (window_ms, max_batch))
    tp = parts.built.plugins["token-producer"]
    assert isinstance(tp, TokenProducer)
    tp.backend = FakeTokens()
    return parts


async def test_burst_routes_a_window_together() -> None:
    parts = burst_server()
    prompt = "the same shared prompt with many words in it " * 3
    got = await asyncio.gather(*(route(parts, f"r{i}", prompt) for i in range(5)))
    assert len({d for d, _ in got}) == 1
    # A lone request overlaps nothing: no affinity, and it is not held past its window.
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await route(parts, "lone", "something different")
    assert loop.time() - t0 < 1.0


async def test_burst_window_longer_than_the_default_budget() -> None:
    """ProduceTimeout: a 600 ms window is waited out (GIE's 400 ms would cut it)."""
    parts = burst_server(window_ms=600)
    prompt = "a prompt shared by the whole window " * 3
    got = await asyncio.gather(*(route(parts, f"r{i}", prompt) for i in range(4)))
    assert len({d for d, _ in got}) == 1
    producer = parts.built.plugins["burst-prefix-cache-producer"]
    assert isinstance(producer, BurstPrefixCacheProducer)
    assert producer._batch is None


async def test_burst_batch_full_gets_no_affinity() -> None:
    p = BurstPrefixCacheProducer("b", BurstPrefixParameters(window_duration_ms=20,
                                                            max_batch_size=1))
    r1, r2 = req(rid="1"), req(rid="2")
    for r in (r1, r2):
        r.plugin_state[TOKENIZED_PROMPT] = TokenizedPrompt(tuple(range(10)))
    await asyncio.gather(p.prepare_request_data(r1, PODS), p.prepare_request_data(r2, PODS))
    assert p.batches_full == 1
    assert p.match({}, r2, PODS) == (0, {})  # type: ignore[arg-type]  # no cycle state needed
    assert p.match({}, r1, PODS)[1] == {}  # type: ignore[arg-type]  # alone: no affinity


# ------------------------------------------------------------------ p2p-source-producer


class FakePrefix:
    """An approx-style producer: matched blocks per endpoint key."""

    type_name = "approx-prefix-cache-producer"
    block_size_tokens = 16

    def __init__(self, name: str, matched: dict[str, int]) -> None:
        self.name = name
        self.matched = matched

    def match(self, state: Any, request: LLMRequest, endpoints: Any) -> tuple[int, dict[str, int]]:
        return 10, dict(self.matched)


def result(primary: Endpoint, prefill: Endpoint | None = None) -> SchedulingResult:
    profiles: dict[str, ProfileRunResult | None] = {"decode": ProfileRunResult((primary,))}
    if prefill is not None:
        profiles["prefill"] = ProfileRunResult((prefill,))
    return SchedulingResult(profiles, "decode")


async def p2p(matched: dict[str, int], pods: list[Endpoint], primary: Endpoint,
              prefill: Endpoint | None = None, rid: str = "r", delta: int = 1
              ) -> Mapping[str, str]:
    p = P2PSourceProducer("p2p", min_cached_token_delta=delta)
    p.producer = FakePrefix("approx", matched)
    r = req(rid=rid)
    await p.prepare_request_data(r, pods)
    return p.request_headers(r, result(primary, prefill))


async def test_p2p_names_the_peer_holding_the_most_blocks() -> None:
    assert await p2p({B: 8, C: 2}, PODS, PODS[0]) == {HEADER_KV_CACHE_SOURCE: B}
    # under P/D the prefill pod computes the prefix
    assert await p2p({B: 8, C: 2}, PODS, PODS[2], prefill=PODS[1]) == {}
    assert await p2p({B: 8, C: 2}, PODS, PODS[1], prefill=PODS[2]) == {
        HEADER_KV_CACHE_SOURCE: B}
    assert await p2p({}, PODS, PODS[0]) == {}
    assert await p2p({B: 8}, PODS, PODS[1]) == {}  # never the computing pod itself
    # the delta is in tokens: 8 blocks vs 7 is 16 tokens
    assert await p2p({B: 8, A: 7}, PODS, PODS[0], delta=16) == {HEADER_KV_CACHE_SOURCE: B}
    assert await p2p({B: 8, A: 7}, PODS, PODS[0], delta=17) == {}


async def test_p2p_samples_within_one_block_weighted_by_queue() -> None:
    pods = [ep(1), ep(2, waiting_queue_size=0), ep(3, waiting_queue_size=0)]
    seen = {(await p2p({B: 8, C: 7}, pods, pods[0], rid=f"r{i}")).get(
        HEADER_KV_CACHE_SOURCE) for i in range(40)}
    assert seen == {B, C}  # one block short still in the band
    seen = {(await p2p({B: 8, C: 6}, pods, pods[0], rid=f"r{i}")).get(
        HEADER_KV_CACHE_SOURCE) for i in range(40)}
    assert seen == {B}
    deep = [ep(1), ep(2, waiting_queue_size=1000), ep(3)]
    picks = [(await p2p({B: 8, C: 8}, deep, deep[0], rid=f"r{i}"))[HEADER_KV_CACHE_SOURCE]
             for i in range(40)]
    assert picks.count(C) > 35
    assert 0 <= spread_fraction("abc") < 1 and spread_fraction("") == 0x811C9DC5 / 2**32


def test_p2p_parameters_and_binding() -> None:
    with pytest.raises(ConfigError, match="minCachedTokenDelta: p2p-source-producer: must be "
                       ">= 1, got 0"):
        load_and_build(None, "plugins: [{type: approx-prefix-cache-producer}, "
                       "{type: p2p-source-producer, parameters: {minCachedTokenDelta: 0}}]\n")
    with pytest.raises(ConfigError, match="set prefixMatchInfoProducerName"):
        load_and_build(None, "plugins: [{type: p2p-source-producer}]\n")
    with pytest.raises(ConfigError, match="'queue-scorer' is a queue-scorer, not a prefix"):
        load_and_build(None, "plugins: [{type: queue-scorer}, {type: p2p-source-producer, "
                       "parameters: {prefixMatchInfoProducerName: queue-scorer}}]\n")
    built = load_and_build(None, "plugins: [{type: approx-prefix-cache-producer}, "
                           "{type: p2p-source-producer}]\n")
    p = built.plugins["p2p-source-producer"]
    assert isinstance(p, P2PSourceProducer)
    assert p.producer is built.plugins["approx-prefix-cache-producer"]
    assert (p.min_delta, p.prefill_profile) == (1, "prefill")
    # an inbound header is never passed on (removed unless the plugin sets it)
    assert HEADER_KV_CACHE_SOURCE in keys.ROUTING_HEADERS


P2P_CONFIG = """
plugins:
- type: approx-prefix-cache-producer
  parameters: {blockSizeTokens: 4, balanceAbsThreshold: 0}
- type: p2p-source-producer
- type: prefix-cache-scorer
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
"""


async def test_p2p_routes_with_the_header() -> None:
    """Routed by load only: a request landing on a pod that has not seen its prompt is
    told to pull from one that has (never from itself)."""
    parts = server(P2P_CONFIG)
    prompt = "a long shared system prompt " * 20
    first, headers = await route(parts, "r1", prompt)
    assert HEADER_KV_CACHE_SOURCE not in headers
    served = {first}
    pulled = 0
    for i in range(10):
        dest, headers = await route(parts, f"r{i + 2}", prompt)
        source = headers.get(HEADER_KV_CACHE_SOURCE)
        if dest not in served:
            assert source in served
        if source is not None:
            assert source != dest and source in served
            pulled += 1
        served.add(dest)
    assert pulled >= 1 and len(served) > 1


# llm-d's assign_test.go cases, ported (replicas pod1 < pod2 < … as A < B < …).


def group(n: int, prefix: Sequence[int], replicas: Sequence[Endpoint]) -> list[BurstEntry]:
    return [BurstEntry(tuple(prefix), replicas) for _ in range(n)]


def counts(entries: Sequence[BurstEntry]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in entries:
        k = e.assigned.key if e.assigned else ""
        out[k] = out.get(k, 0) + 1
    return out


def test_go_shared_prefix_families_colocate_within_fair_share() -> None:
    two = PODS[:2]
    x1, x2 = group(2, [1, 2, 3], two), group(2, [1, 2, 4], two)
    y1, y2 = group(2, [7, 8, 5], two), group(2, [7, 8, 6], two)
    entries = [*x1, *x2, *y1, *y2]
    assign(entries, UNLIMITED, 2)
    assert x1[0].assigned is x2[0].assigned and y1[0].assigned is y2[0].assigned
    assert x1[0].assigned is not y1[0].assigned
    assert counts(entries) == {A: 4, B: 4}
    # below the threshold: placed by load, a family is split
    x1, x2 = group(2, [1, 2, 3], two), group(2, [1, 2, 4], two)
    y1, y2 = group(2, [7, 8, 5], two), group(2, [7, 8, 6], two)
    entries = [*x1, *x2, *y1, *y2]
    assign(entries, UNLIMITED, 3)
    assert x1[0].assigned is not x2[0].assigned and counts(entries) == {A: 4, B: 4}


def test_go_fair_share_and_singletons() -> None:
    four = [ep(i) for i in range(1, 5)]
    groups = [group(2, [1, 2, 3 + i], four) for i in range(4)]
    entries = [e for g in groups for e in g]
    assign(entries, UNLIMITED, 2)
    assert sorted(counts(entries).values()) == [2, 2, 2, 2]
    two = PODS[:2]
    gx, sx = group(2, [1, 2, 3], two), group(1, [1, 2, 8], two)
    gy, sy = group(2, [7, 8, 5], two), group(1, [7, 8, 9], two)
    entries = [*gx, *sx, *gy, *sy]
    assign(entries, UNLIMITED, 2)
    assert gx[0].assigned is gx[1].assigned is sx[0].assigned
    assert gy[0].assigned is sy[0].assigned and counts(entries) == {A: 3, B: 3}
    singles = [e for i in range(4) for e in group(1, [1, 2, 3 + i], two)]
    assign(singles, UNLIMITED, 2)
    assert counts(singles) == {A: 2, B: 2}


def test_go_balance_by_tokens() -> None:
    two = PODS[:2]
    long, s1, s2 = group(2, [1, 2, 3, 4], two), group(2, [5], two), group(2, [6], two)
    assign([*long, *s1, *s2], UNLIMITED, 0, False)
    assert long[0].assigned is s2[0].assigned
    long, s1, s2 = group(2, [1, 2, 3, 4], two), group(2, [5], two), group(2, [6], two)
    assign([*long, *s1, *s2], UNLIMITED, 0, True)
    assert long[0].assigned is not s1[0].assigned and s1[0].assigned is s2[0].assigned
    shared = [group(2, [*range(1, 10), 10 + i], two) for i in range(3)]
    assign([e for g in shared for e in g], UNLIMITED, 9, True)
    assert shared[0][0].assigned is shared[1][0].assigned is shared[2][0].assigned


def test_go_overflow_and_single_replica() -> None:
    two = PODS[:2]
    entries = group(8, [1, 2, 3], two)
    assign(entries, 2, 0)
    assert counts(entries) == {A: 4, B: 4}
    one = PODS[:1]
    entries = [*group(4, [1, 2, 3], one), *group(4, [9, 9, 9], one)]
    assign(entries, UNLIMITED, 2)
    assert counts(entries) == {A: 8}


class FakePrecise:
    """A precise-style producer: unweighted cached blocks and per-tier counts."""

    type_name = "precise-prefix-cache-producer"

    def __init__(self, cached: dict[str, int], tiers: dict[str, dict[str, int]]) -> None:
        self.name = "precise"
        self.info = PrefixMatch(10, cached, cached, tiers, 16)

    def match_info(self, state: Any, request: LLMRequest, endpoints: Any) -> PrefixMatch:
        return self.info

    def match(self, state: Any, request: LLMRequest, endpoints: Any) -> tuple[int, dict[str, int]]:
        return 10, dict(self.info.match_blocks)


async def test_p2p_counts_only_cpu_blocks_with_tier_data() -> None:
    async def header(cached: dict[str, int], tiers: dict[str, dict[str, int]]) -> Any:
        p = P2PSourceProducer("p2p")
        p.producer = FakePrecise(cached, tiers)
        r = req()
        await p.prepare_request_data(r, PODS)
        return p.request_headers(r, result(PODS[0])).get(HEADER_KV_CACHE_SOURCE)

    assert await header({B: 8}, {B: {"gpu": 8}}) is None  # nothing pullable
    assert await header({B: 8}, {B: {"gpu": 8, "cpu": 3}}) == B
    # the computing pod's own blocks count in every tier: A holds 8 on GPU, B 3 on CPU
    assert await header({A: 8, B: 3}, {A: {"gpu": 8}, B: {"cpu": 3}}) is None
    assert await header({B: 8}, {}) == B  # no tier data: trusted as-is
