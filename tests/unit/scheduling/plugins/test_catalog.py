"""The rest of the plugin catalog (issue 4 §2): scoring rules, parameter defaults, errors."""

from __future__ import annotations

import base64
import math
import random
import textwrap
from collections import Counter
from typing import Any

import pytest

from epp import keys
from epp.config.loader import BuiltConfig, build, parse_config
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import Filter, ResponseHeaders, SaturationDetector, Scorer
from epp.framework.params import decoding
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.filters import ByLabelSelectorFilter, LabelSelectorFilter
from epp.scheduling.plugins.load import (
    ActiveRequestScorer,
    InFlightLoadProducer,
    InFlightTracker,
    LoadAwareScorer,
    TokenLoadScorer,
    estimate_tokens,
)
from epp.scheduling.plugins.lora import LoraAffinityScorer
from epp.scheduling.plugins.nohit import NoHitLRUScorer
from epp.scheduling.plugins.pickers import WeightedRandomPicker
from epp.scheduling.plugins.prefix import ApproxPrefixCacheProducer, PrefixCacheScorer
from epp.scheduling.plugins.saturation import UtilizationDetector
from epp.scheduling.plugins.session import (
    SessionAffinityScorer,
    decode_session_token,
    session_token,
)
from epp.scheduling.types import (
    ApiType,
    CycleState,
    Endpoint,
    LLMRequest,
    Metrics,
    ProfileRunResult,
    SchedulingResult,
    ScoredEndpoint,
)

SRC = "catalog.yaml"


def ep(i: int, *, name: str | None = None, namespace: str = "",
       labels: dict[str, str] | None = None, **metrics: Any) -> Endpoint:
    return Endpoint(name=name or f"pod-{i}", address=f"10.0.0.{i}", port=8000, namespace=namespace,
                    labels=labels or {}, metrics=Metrics(**metrics))


def req(prompt: str = "p", model: str = "m", rid: str = "r", headers: dict[str, str] | None = None,
        max_tokens: int | None = None, session: str | None = None) -> LLMRequest:
    return LLMRequest(request_id=rid, target_model=model, incoming_model=model,
                      api=ApiType.COMPLETIONS, prompt=prompt, headers=headers or {},
                      max_tokens=max_tokens, session_token=session)


def result(*endpoints: Endpoint, prefill: Endpoint | None = None) -> SchedulingResult:
    results: dict[str, ProfileRunResult | None] = {"decode": ProfileRunResult(tuple(endpoints))}
    if prefill is not None:
        results["prefill"] = ProfileRunResult((prefill,))
    return SchedulingResult(results, "decode")


def make(type_name: str, params: dict[str, Any] | None = None, name: str | None = None) -> Any:
    """Build one plugin through the registry, as the loader does."""
    build = default_registry().builder(type_name, "t")
    return build(name or type_name, params, "plugins[0].parameters", PluginHandle())


def build_text(text: str) -> BuiltConfig:
    return build(parse_config(textwrap.dedent(text), SRC))


def param_error(type_name: str, params: dict[str, Any], *fragments: str) -> None:
    """The strict decoder's error (an unknown key is only a warning without strict mode,
    tests/unit/config/test_loader.py)."""
    with decoding(strict=True), pytest.raises(ConfigError) as info:
        make(type_name, params)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"


def test_every_catalog_plugin_is_registered() -> None:
    types = set(default_registry().types)
    assert {"lora-affinity-scorer", "token-load-scorer", "active-request-scorer",
            "load-aware-scorer", "session-affinity-scorer", "no-hit-lru-scorer",
            "weighted-random-picker", "label-selector-filter", "by-label-selector",
            "utilization-detector", "inflight-load-producer"} <= types


@pytest.mark.parametrize("type_name", ["lora-affinity-scorer"])
def test_parameterless_plugins_reject_parameters(type_name: str) -> None:
    param_error(type_name, {"x": 1}, "plugins[0].parameters.x: unknown parameter",
                "accepts: none")


# ================================================================ lora-affinity-scorer


def test_lora_rule_order() -> None:
    s = LoraAffinityScorer("l")
    eps = [
        ep(1, active_loras=frozenset({"ad"}), max_loras=1),                 # active
        ep(2, active_loras=frozenset({"x"}), max_loras=4),                  # free slot
        ep(3, active_loras=frozenset({"x"}), waiting_loras=frozenset({"ad"}),
           max_loras=2),                                                    # waiting, full
        ep(4, active_loras=frozenset({"x", "y"}), max_loras=2),             # full, not there
        ep(5),                                                              # no LoRA support
    ]
    assert list(s.score(CycleState(), req(model="ad"), eps)) == [1.0, 0.8, 0.6, 0.0, 0.0]


def test_lora_free_slot_beats_waiting() -> None:
    # Waiting here but a slot is also free: GIE checks the free slot first (0.8).
    e = ep(1, waiting_loras=frozenset({"ad"}), max_loras=4)
    assert list(LoraAffinityScorer("l").score(CycleState(), req(model="ad"), [e])) == [0.8]


def test_lora_active_beats_full_server() -> None:
    e = ep(1, active_loras=frozenset({"ad", "b"}), waiting_loras=frozenset({"c"}), max_loras=2)
    assert list(LoraAffinityScorer("l").score(CycleState(), req(model="ad"), [e])) == [1.0]


def test_lora_defaults() -> None:
    assert isinstance(make("lora-affinity-scorer"), LoraAffinityScorer)


# ================================================================ load-aware-scorer


def test_load_aware_formula() -> None:
    s = LoadAwareScorer("la", threshold=10)
    eps = [ep(1, waiting_queue_size=0), ep(2, waiting_queue_size=5), ep(3, waiting_queue_size=10),
           ep(4, waiting_queue_size=50)]
    assert list(s.score(CycleState(), req(), eps)) == pytest.approx([0.5, 0.25, 0.0, 0.0])


def test_load_aware_is_absolute_not_relative() -> None:
    s = LoadAwareScorer("la", threshold=128)
    one = s.score(CycleState(), req(), [ep(1, waiting_queue_size=64)])
    assert list(one) == pytest.approx([0.25])


def test_load_aware_params() -> None:
    assert make("load-aware-scorer").threshold == 128
    assert make("load-aware-scorer", {"threshold": 7}).threshold == 7
    param_error("load-aware-scorer", {"threshold": 0}, "threshold: must be >= 1, got 0")
    param_error("load-aware-scorer", {"threshold": "x"}, "threshold: expected an integer")
    param_error("load-aware-scorer", {"queueThreshold": 3}, "queueThreshold: unknown parameter",
                "accepts: threshold")


# ================================================================ in-flight tracking


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_estimate_tokens() -> None:
    assert estimate_tokens(req(prompt="x" * 400)) == 100 + 150
    assert estimate_tokens(req(prompt="")) == 1 + 2  # at least one input token
    assert estimate_tokens(req(prompt="x" * 400, max_tokens=10)) == 110  # output capped


def test_tracker_add_release_and_idempotence() -> None:
    t = InFlightTracker()
    a = t.add(["e1", "e2"], 10)
    b = t.add(["e1"], 5)
    assert t.requests == {"e1": 2, "e2": 1} and t.tokens == {"e1": 15, "e2": 10}
    t.release(a)
    t.release(a)  # a second release changes nothing
    assert t.requests == {"e1": 1} and t.tokens == {"e1": 5}
    t.release(b)
    assert t.requests == {} and t.tokens == {} and len(t) == 0


def test_tracker_timeout_expires_oldest_first() -> None:
    clock = Clock()
    t = InFlightTracker(timeout=10.0, clock=clock)
    t.add(["e1"])
    clock.t += 6
    t.add(["e2"])
    clock.t += 5  # first is 11 s old, second 5 s
    t.expire()
    assert t.requests == {"e2": 1} and len(t) == 1


def test_tracker_remove_endpoint_then_release_does_not_go_negative() -> None:
    t = InFlightTracker()
    a = t.add(["e1"], 3)
    t.remove_endpoint("e1")
    assert t.requests == {}
    t.release(a)
    assert t.requests == {} and t.tokens == {}


# ================================================================ active-request-scorer


def test_active_request_counts_and_releases_on_complete_and_abort() -> None:
    s = ActiveRequestScorer("ar")
    e1, e2, e3 = ep(1), ep(2), ep(3)
    eps = [e1, e2, e3]
    assert list(s.score(CycleState(), req(), eps)) == [1.0, 1.0, 1.0]  # nothing in flight
    reqs = [req(rid=f"r{i}") for i in range(4)]
    for r, e in zip(reqs, [e1, e1, e2, e1], strict=True):
        s.pre_request(r, result(e))
    # e1: 3, e2: 1, e3: 0 → (3 − c) / 3
    assert list(s.score(CycleState(), req(), eps)) == pytest.approx([0.0, 2 / 3, 1.0])
    s.response_complete(reqs[0], e1.key, aborted=False)
    s.response_complete(reqs[1], e1.key, aborted=True)  # a stream abort releases too
    assert s.tracker.requests == {e1.key: 1, e2.key: 1}
    s.response_complete(reqs[1], e1.key, aborted=True)  # a second call changes nothing
    assert s.tracker.requests == {e1.key: 1, e2.key: 1}


def test_active_request_same_request_id_does_not_cross_release() -> None:
    s = ActiveRequestScorer("ar")
    a, b = req(rid="same"), req(rid="same")
    s.pre_request(a, result(ep(1)))
    s.pre_request(b, result(ep(2)))
    s.response_complete(a, ep(1).key, aborted=False)
    assert s.tracker.requests == {ep(2).key: 1}


def test_active_request_counts_every_profile_primary() -> None:
    s = ActiveRequestScorer("ar")
    s.pre_request(req(), result(ep(1), ep(2), prefill=ep(3)))  # ep(2) is a fallback: not counted
    assert s.tracker.requests == {ep(1).key: 1, ep(3).key: 1}


def test_active_request_timeout_and_endpoint_removed() -> None:
    clock = Clock()
    s = ActiveRequestScorer("ar", request_timeout=120.0, clock=clock)
    s.pre_request(req(rid="old"), result(ep(1)))
    clock.t += 121
    s.pre_request(req(rid="new"), result(ep(2)))  # expiry runs on the hook
    assert s.tracker.requests == {ep(2).key: 1}
    s.endpoint_removed(ep(2).key)
    assert s.tracker.requests == {}


def test_active_request_params() -> None:
    assert make("active-request-scorer").request_timeout == 120.0
    assert make("active-request-scorer", {"requestTimeout": "30s"}).request_timeout == 30.0
    assert make("active-request-scorer", {"requestTimeout": "1m"}).request_timeout == 60.0
    param_error("active-request-scorer", {"requestTimeout": "soon"},
                "requestTimeout: expected a duration")
    param_error("active-request-scorer", {"requestTimeout": "0s"}, "requestTimeout: must be > 0")


# ================================================================ token-load-scorer


def test_token_load_formula_and_release() -> None:
    producer = InFlightLoadProducer("p")
    s = TokenLoadScorer("tl", threshold_tokens=1000)
    s.producer = producer
    e1, e2, e3 = ep(1), ep(2), ep(3)
    r1 = req(prompt="x" * 400)               # 100 + 150 = 250 tokens
    r2 = req(prompt="x" * 4000, max_tokens=0)  # 1000 tokens
    producer.pre_request(r1, result(e1))
    producer.pre_request(r2, result(e2))
    assert list(s.score(CycleState(), req(), [e1, e2, e3])) == pytest.approx([0.75, 0.0, 1.0])
    producer.response_complete(r2, e2.key, aborted=True)
    assert list(s.score(CycleState(), req(), [e1, e2, e3])) == pytest.approx([0.75, 1.0, 1.0])


def test_token_load_creates_or_binds_a_producer() -> None:
    own = build_text("""
        plugins:
        - type: token-load-scorer
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: token-load-scorer}]
        """)
    scorer = own.plugins["token-load-scorer"]
    assert isinstance(scorer, TokenLoadScorer)
    assert scorer.producer is own.plugins["token-load-scorer-producer"]
    assert scorer.producer in own.pre_request and scorer.producer in own.response_complete
    declared = build_text("""
        plugins:
        - {type: inflight-load-producer, name: inflight-load}
        - {type: token-load-scorer, parameters: {queueThresholdTokens: 5000}}
        schedulingProfiles:
        - name: default
          plugins:
          - {pluginRef: inflight-load, weight: 0}   # as GIE's README lists it
          - {pluginRef: token-load-scorer}
        """)
    scorer = declared.plugins["token-load-scorer"]
    assert isinstance(scorer, TokenLoadScorer) and scorer.threshold_tokens == 5000
    assert scorer.producer is declared.plugins["inflight-load"]


def test_token_load_params() -> None:
    assert make("token-load-scorer").threshold_tokens == 4_194_304
    param_error("token-load-scorer", {"queueThresholdTokens": 0},
                "queueThresholdTokens: must be >= 1")
    param_error("inflight-load-producer", {"x": 1}, "x: unknown parameter")
    assert make("inflight-load-producer").tracker.timeout is None
    assert make("inflight-load-producer", {"requestTimeout": "5m"}).tracker.timeout == 300.0


def test_two_inflight_producers_are_an_error() -> None:
    with pytest.raises(ConfigError, match="more than one inflight-load-producer"):
        build_text("""
            plugins:
            - {type: inflight-load-producer, name: a}
            - {type: inflight-load-producer, name: b}
            - {type: token-load-scorer}
            """)


# ================================================================ session-affinity-scorer


def test_session_token_is_llmd_format() -> None:
    e = ep(1, name="vllm-0", namespace="llm")
    assert session_token(e) == base64.b64encode(b"llm/vllm-0").decode()
    assert decode_session_token(session_token(e)) == "llm/vllm-0"
    assert session_token(ep(2, name="p")) == base64.b64encode(b"/p").decode()
    assert decode_session_token("***") is None


def test_session_scores_named_endpoint_only() -> None:
    s = SessionAffinityScorer("s")
    eps = [ep(1, name="a", namespace="ns"), ep(2, name="b", namespace="ns")]
    token = session_token(eps[1])
    assert list(s.score(CycleState(), req(session=token), eps)) == [0.0, 1.0]
    # The header is read when the Director did not fill session_token.
    hdr = {keys.HEADER_SESSION_TOKEN: token}
    assert list(s.score(CycleState(), req(headers=hdr), eps)) == [0.0, 1.0]
    assert list(s.score(CycleState(), req(), eps)) == [0.0, 0.0]
    assert list(s.score(CycleState(), req(session="not base64!"), eps)) == [0.0, 0.0]
    other = session_token(ep(9, name="gone", namespace="ns"))
    assert list(s.score(CycleState(), req(session=other), eps)) == [0.0, 0.0]


def test_session_sets_response_header_for_routed_endpoint() -> None:
    s = SessionAffinityScorer("s")
    assert isinstance(s, ResponseHeaders)
    chosen = ep(1, name="a", namespace="ns")
    r = req()
    assert s.response_headers(r, chosen.key, 200, {}) is None  # not routed through pre_request
    s.pre_request(r, result(chosen, ep(2)))
    assert s.response_headers(r, chosen.key, 200, {}) == {
        keys.HEADER_SESSION_TOKEN: session_token(chosen)}
    # The token round-trips: the next request carrying it scores the same endpoint 1.
    sent = s.response_headers(r, chosen.key, 200, {})
    assert sent is not None
    nxt = req(session=sent[keys.HEADER_SESSION_TOKEN])
    assert list(s.score(CycleState(), nxt, [ep(2), chosen])) == [0.0, 1.0]


def test_response_headers_plugins_are_collected() -> None:
    built = build_text("plugins: [{type: session-affinity-scorer}, {type: queue-scorer}]\n")
    assert [p.name for p in built.response_headers] == ["session-affinity-scorer"]
    assert built.plugins["session-affinity-scorer"] in built.pre_request


# ================================================================ no-hit-lru-scorer


def nohit_with_prefix(**kw: Any) -> tuple[NoHitLRUScorer, ApproxPrefixCacheProducer]:
    producer = ApproxPrefixCacheProducer("prefix", block_size_tokens=4)  # 16-char blocks
    scorer = NoHitLRUScorer("nh", **kw)
    handle = PluginHandle({"prefix": producer})
    scorer.prefix_plugin_name = "prefix"
    scorer.bind(handle)
    return scorer, producer


def route(scorer: NoHitLRUScorer, producer: ApproxPrefixCacheProducer, r: LLMRequest,
          eps: list[Endpoint]) -> list[float]:
    """Score like a profile does, then record the best endpoint as chosen."""
    state = CycleState()
    scores = list(scorer.score(state, r, eps))
    best = eps[max(range(len(eps)), key=lambda i: (scores[i], -i))]
    res = result(best)
    producer.pre_request(r, res)
    scorer.pre_request(r, res)
    return scores


def test_nohit_cold_requests_rotate_over_lru() -> None:
    scorer, producer = nohit_with_prefix()
    eps = [ep(1), ep(2), ep(3)]
    # Never-used endpoints share the top score (no list-order bias, as llm-d's map order).
    assert route(scorer, producer, req("a" * 32, rid="1"), eps) == [1.0, 1.0, 1.0]
    # ep1 is now the most recently used; the never-used ones rank first, together.
    assert route(scorer, producer, req("b" * 32, rid="2"), eps) == [0.0, 1.0, 1.0]
    assert route(scorer, producer, req("c" * 32, rid="3"), eps) == [0.5, 0.0, 1.0]
    # All used (order ep1, ep2, ep3): least recently used first.
    assert route(scorer, producer, req("d" * 32, rid="4"), eps) == [1.0, 0.5, 0.0]
    assert route(scorer, producer, req("e" * 32, rid="5"), eps) == [0.0, 1.0, 0.5]


def test_nohit_warm_request_is_neutral_and_does_not_touch_lru() -> None:
    scorer, producer = nohit_with_prefix()
    eps = [ep(1), ep(2)]
    route(scorer, producer, req("a" * 32, rid="1"), eps)  # cold → ep1, indexed
    before = list(scorer._lru)
    assert route(scorer, producer, req("a" * 32 + "z" * 16, rid="2"), eps) == [0.5, 0.5]
    assert list(scorer._lru) == before


def test_nohit_short_prompt_is_cold_and_single_endpoint_scores_one() -> None:
    scorer, _ = nohit_with_prefix()
    assert list(scorer.score(CycleState(), req("tiny"), [ep(1)])) == [1.0]


def test_nohit_lru_size_and_endpoint_removed() -> None:
    scorer, _ = nohit_with_prefix(lru_size=2)
    for k in ("e1", "e2", "e3"):
        scorer._touch(k)
    assert list(scorer._lru) == ["e2", "e3"]
    scorer.endpoint_removed("e2")
    assert list(scorer._lru) == ["e3"]


def test_nohit_touches_prefill_profile_too() -> None:
    scorer, _ = nohit_with_prefix()
    r = req("q" * 32)
    scorer.score(CycleState(), r, [ep(1), ep(2)])
    scorer.pre_request(r, result(ep(1), prefill=ep(2)))
    assert list(scorer._lru) == [ep(1).key, ep(2).key]


def test_nohit_without_prefix_plugin_treats_all_as_cold() -> None:
    built = build_text("plugins: [{type: no-hit-lru-scorer}]\n")
    s = built.plugins["no-hit-lru-scorer"]
    assert isinstance(s, NoHitLRUScorer) and s.is_cold(CycleState(), req("x" * 200), [ep(1)])


def test_nohit_binds_to_prefix_scorer_by_default_name_or_the_only_one() -> None:
    built = build_text("plugins: [{type: no-hit-lru-scorer}, {type: prefix-cache-scorer}]\n")
    s = built.plugins["no-hit-lru-scorer"]
    assert isinstance(s, NoHitLRUScorer)
    assert isinstance(s._prefix, PrefixCacheScorer) and s._producer() is not None
    other = build_text("plugins: [{type: no-hit-lru-scorer}, "
                       "{type: prefix-cache-scorer, name: my-prefix}]\n")
    assert other.plugins["no-hit-lru-scorer"]._prefix is other.plugins["my-prefix"]  # type: ignore[attr-defined]


def test_nohit_prefer_fast_endpoints_leaves_slow_pods_out_of_the_rotation() -> None:
    scorer, producer = nohit_with_prefix(prefer_fast_endpoints=True)
    now = [100.0]
    scorer.clock = lambda: now[0]
    eps = [ep(1), ep(2), ep(3)]

    def finish(r: LLMRequest, key: str, after_s: float, aborted: bool = False) -> None:
        now[0] += after_s
        scorer.response_complete(r, key, aborted)

    # No measured time yet: the LRU rank, as without the parameter.
    r1, r2, r3 = req("a" * 32, rid="1"), req("b" * 32, rid="2"), req("c" * 32, rid="3")
    assert route(scorer, producer, r1, eps) == [1.0, 1.0, 1.0]
    assert route(scorer, producer, r2, eps) == [0.0, 1.0, 1.0]
    finish(r2, ep(2).key, 0.4)  # ep2: 400 ms
    # one candidate unmeasured: still the LRU rank over all three
    assert route(scorer, producer, r3, eps) == [0.5, 0.0, 1.0]
    finish(r3, ep(3).key, 0.5)  # ep3: 500 ms (routed at 100.4)
    finish(r1, ep(1).key, 0.1)  # ep1: 1,000 ms (routed at 100.0)
    assert scorer.duration == {ep(1).key: pytest.approx(1000.0),
                               ep(2).key: pytest.approx(400.0), ep(3).key: pytest.approx(500.0)}
    # ep1 takes more than twice the fastest's time: out of the rotation, although it is
    # the least recently used; the others keep their LRU order among themselves.
    assert list(scorer.score(CycleState(), req("d" * 32), eps)) == [0.0, 1.0, 0.0]
    # Warm requests stay neutral.
    assert list(scorer.score(CycleState(), req("a" * 32 + "z" * 16), eps)) == [0.5] * 3
    # A later response moves the mean by a tenth of its difference: ep2 slows to 800 ms,
    # the limit rises to 1,000 (ep3's 500 × 2) and ep1 is back, first in the LRU order.
    r4 = req("e" * 32, rid="4")
    scorer.pre_request(r4, result(ep(2)))
    finish(r4, ep(2).key, 4.4)
    assert scorer.duration[ep(2).key] == pytest.approx(800.0)
    assert list(scorer.score(CycleState(), req("d" * 32), eps)) == [1.0, 0.5, 0.0]
    # An aborted response, one from another endpoint than the one routed to, or an
    # unrouted request change nothing.
    for aborted, key in ((True, ep(1).key), (False, ep(2).key)):
        r = req("f" * 32)
        scorer.pre_request(r, result(ep(1)))
        finish(r, key, 9.0, aborted)
    scorer.response_complete(req("g" * 32), ep(1).key, False)
    assert scorer.duration[ep(1).key] == pytest.approx(1000.0)
    scorer.endpoint_removed(ep(1).key)
    assert ep(1).key not in scorer.duration


def test_nohit_without_prefer_fast_endpoints_measures_nothing() -> None:
    scorer, producer = nohit_with_prefix()
    r = req("a" * 32, rid="1")
    route(scorer, producer, r, [ep(1), ep(2)])
    scorer.response_complete(r, ep(1).key, False)
    assert scorer.duration == {}


def test_nohit_params() -> None:
    s = make("no-hit-lru-scorer")
    assert (s.prefix_plugin_name, s.prefill_profile, s.lru_size, s.prefer_fast_endpoints) == (
        None, "prefill", 1024, False)
    s = make("no-hit-lru-scorer", {"prefixPluginName": "p", "prefillProfile": "pf", "lruSize": 8,
                                   "preferFastEndpoints": True})
    assert (s.prefix_plugin_name, s.prefill_profile, s.lru_size, s.prefer_fast_endpoints) == (
        "p", "pf", 8, True)
    param_error("no-hit-lru-scorer", {"lruSize": 0}, "lruSize: must be >= 1")
    param_error("no-hit-lru-scorer", {"prefixPluginName": 3}, "prefixPluginName: expected a string")
    with pytest.raises(ConfigError, match="prefixPluginName 'nope': no such plugin"):
        build_text("plugins: [{type: no-hit-lru-scorer, parameters: {prefixPluginName: nope}}]\n")
    with pytest.raises(ConfigError, match="'queue-scorer' is a queue-scorer, not a prefix"):
        build_text("plugins: [{type: queue-scorer}, "
                   "{type: no-hit-lru-scorer, parameters: {prefixPluginName: queue-scorer}}]\n")


# ================================================================ weighted-random-picker


def scored(*scores: float) -> list[ScoredEndpoint]:
    return [ScoredEndpoint(ep(i + 1), s) for i, s in enumerate(scores)]


def test_weighted_random_proportional_to_score() -> None:
    p = WeightedRandomPicker("w", rng=random.Random(7))
    counts: Counter[str] = Counter()
    n = 20_000
    for _ in range(n):
        counts[p.pick(CycleState(), scored(1.0, 2.0, 5.0)).endpoints[0].name] += 1
    for name, share in (("pod-1", 1 / 8), ("pod-2", 2 / 8), ("pod-3", 5 / 8)):
        assert counts[name] / n == pytest.approx(share, abs=0.015)


def test_weighted_random_zero_scores_only_when_nothing_else() -> None:
    p = WeightedRandomPicker("w", max_num_of_endpoints=2, rng=random.Random(1))
    for _ in range(200):
        chosen = p.pick(CycleState(), scored(0.0, 0.3, 0.0)).endpoints
        assert chosen[0].name == "pod-2" and chosen[1].name in ("pod-1", "pod-3")
        assert len(chosen) == 2


def test_weighted_random_all_zero_is_uniform() -> None:
    p = WeightedRandomPicker("w", rng=random.Random(3))
    counts = Counter(p.pick(CycleState(), scored(0.0, 0.0, 0.0, 0.0)).endpoints[0].name
                     for _ in range(8000))
    assert set(counts) == {"pod-1", "pod-2", "pod-3", "pod-4"}
    assert all(abs(c / 8000 - 0.25) < 0.03 for c in counts.values())


def test_weighted_random_max_num_and_distinct() -> None:
    p = WeightedRandomPicker("w", max_num_of_endpoints=5, rng=random.Random(2))
    res = p.pick(CycleState(), scored(0.1, 0.9, 0.5))
    assert sorted(e.name for e in res.endpoints) == ["pod-1", "pod-2", "pod-3"]
    assert set(res.scores) == {e.key for e in res.endpoints}


def test_weighted_random_tiny_scores_do_not_underflow() -> None:
    p = WeightedRandomPicker("w", rng=random.Random(4))
    counts = Counter(p.pick(CycleState(), scored(1e-9, 2e-9)).endpoints[0].name
                     for _ in range(3000))
    assert counts["pod-2"] / 3000 == pytest.approx(2 / 3, abs=0.05)


def test_weighted_random_params() -> None:
    assert make("weighted-random-picker").max_num_of_endpoints == 1
    assert make("weighted-random-picker", {"maxNumOfEndpoints": 3}).max_num_of_endpoints == 3
    param_error("weighted-random-picker", {"maxNumOfEndpoints": 0},
                "maxNumOfEndpoints: must be >= 1")


# ================================================================ label-selector-filter


LABELLED = [
    ep(1, name="nginx-1", labels={"app": "nginx", "version": "v1.0", "tier": "frontend"}),
    ep(2, name="nginx-2", labels={"app": "nginx", "version": "v1.1", "tier": "frontend"}),
    ep(3, name="coredns-1", labels={"app": "coredns", "tier": "system"}),
    ep(4, name="redis-1", labels={"app": "redis", "tier": "backend", "deprecated": "true"}),
    ep(5, name="web-1", labels={"app": "web", "tier": "frontend", "environment": "production"}),
    ep(6, name="bare"),
]


@pytest.mark.parametrize(("params", "expected"), [
    ({"matchLabels": {"app": "nginx"}}, ["nginx-1", "nginx-2"]),
    ({"matchLabels": {"app": "nginx", "version": "v1.0"}}, ["nginx-1"]),
    ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["frontend", "backend"]}]},
     ["nginx-1", "nginx-2", "redis-1", "web-1"]),
    # NotIn also matches endpoints without the label (Kubernetes semantics).
    ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["system"]}]},
     ["nginx-1", "nginx-2", "redis-1", "web-1", "bare"]),
    ({"matchExpressions": [{"key": "deprecated", "operator": "Exists"}]}, ["redis-1"]),
    ({"matchExpressions": [{"key": "deprecated", "operator": "DoesNotExist"}]},
     ["nginx-1", "nginx-2", "coredns-1", "web-1", "bare"]),
    ({"matchLabels": {"tier": "frontend"},
      "matchExpressions": [{"key": "environment", "operator": "Exists"}]}, ["web-1"]),
    ({}, ["nginx-1", "nginx-2", "coredns-1", "redis-1", "web-1", "bare"]),
    ({"matchLabels": {"app": "nonexistent"}}, []),
])
def test_label_selector(params: dict[str, Any], expected: list[str]) -> None:
    f = make("label-selector-filter", params)
    assert isinstance(f, Filter)
    assert [e.name for e in f.filter(CycleState(), req(), LABELLED)] == expected


def test_label_selector_old_name() -> None:
    f = make("by-label-selector", {"matchLabels": {"app": "web"}})
    assert isinstance(f, ByLabelSelectorFilter) and isinstance(f, LabelSelectorFilter)
    assert [e.name for e in f.filter(CycleState(), req(), LABELLED)] == ["web-1"]


@pytest.mark.parametrize(("params", "fragment"), [
    ({"matchLabels": ["app"]}, "parameters.matchLabels: expected a mapping"),
    ({"matchLabels": {"idx": 0}},
     'parameters.matchLabels.idx: expected a string value, got 0 (quote it: "0")'),
    ({"matchExpressions": {"key": "a"}}, "parameters.matchExpressions: expected a list"),
    ({"matchExpressions": [{"key": "a", "operator": "Equals", "values": ["x"]}]},
     ("parameters.matchExpressions[0].operator: expected one of In, NotIn, Exists, "
      "DoesNotExist; got 'Equals'")),
    ({"matchExpressions": [{"operator": "Exists"}]},
     "parameters.matchExpressions[0]: missing 'key'"),
    ({"matchExpressions": [{"key": "a", "operator": "In"}]},
     "parameters.matchExpressions[0].values: operator In needs a non-empty list"),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": []}]},
     "operator NotIn needs a non-empty list"),
    ({"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
     "parameters.matchExpressions[0].values: operator Exists takes no values"),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": [1]}]},
     "parameters.matchExpressions[0].values[0]: expected a string"),
    ({"matchExpressions": [{"key": "a", "operator": "Exists", "value": "x"}]},
     "parameters.matchExpressions[0]: unknown key(s) 'value'"),
    ({"selector": {}}, "parameters.selector: unknown parameter"),
])
def test_label_selector_errors(params: dict[str, Any], fragment: str) -> None:
    param_error("label-selector-filter", params, fragment)


def test_label_selector_error_names_file_and_plugin() -> None:
    with pytest.raises(ConfigError) as info:
        build_text("""
            plugins:
            - type: queue-scorer
            - type: label-selector-filter
              parameters: {matchExpressions: [{key: a, operator: Bad}]}
            """)
    assert str(info.value).startswith(
        f"{SRC}: plugins[1].parameters.matchExpressions[0].operator: expected one of")


# ================================================================ utilization-detector


def fresh(i: int, q: int = 0, kv: float = 0.0, age: float = 0.0) -> Endpoint:
    return ep(i, waiting_queue_size=q, kv_cache_usage=kv, updated_at=1000.0 - age)


def detector(**kw: Any) -> UtilizationDetector:
    return UtilizationDetector("u", clock=lambda: 1000.0, **kw)


def test_detector_defaults() -> None:
    d = make("utilization-detector")
    assert isinstance(d, UtilizationDetector) and isinstance(d, SaturationDetector)
    assert isinstance(d, Filter) and not isinstance(d, Scorer)
    assert (d.queue_depth_threshold, d.kv_cache_util_threshold,
            d.metrics_staleness_threshold, d.headroom) == (5, 0.8, 0.2, 0.0)


def test_detector_params() -> None:
    d = make("utilization-detector", {"queueDepthThreshold": 10, "kvCacheUtilThreshold": 0.9,
                                      "metricsStalenessThreshold": "1s", "headroom": 0.2})
    assert (d.queue_depth_threshold, d.kv_cache_util_threshold,
            d.metrics_staleness_threshold, d.headroom) == (10, 0.9, 1.0, 0.2)
    param_error("utilization-detector", {"queueDepthThreshold": 0},
                "queueDepthThreshold: must be >= 1")
    param_error("utilization-detector", {"kvCacheUtilThreshold": 0},
                "kvCacheUtilThreshold: must be in (0, 1], got 0")
    param_error("utilization-detector", {"kvCacheUtilThreshold": 1.5},
                "kvCacheUtilThreshold: must be <= 1.0")
    param_error("utilization-detector", {"metricsStalenessThreshold": "0ms"},
                "metricsStalenessThreshold: must be > 0")
    param_error("utilization-detector", {"metricsStalenessThreshold": "fast"},
                "metricsStalenessThreshold: expected a duration")
    param_error("utilization-detector", {"headroom": -0.1}, "headroom: must be >= 0.0")


def test_detector_is_saturated_when_no_endpoint_has_capacity() -> None:
    d = detector()
    assert d.is_saturated([])
    # At the thresholds is still good capacity (GIE: saturated only above them).
    assert not d.is_saturated([fresh(1, q=5, kv=0.8)])
    assert d.is_saturated([fresh(1, q=6), fresh(2, kv=0.81)])
    assert not d.is_saturated([fresh(1, q=6), fresh(2, q=1)])
    # Stale metrics count as saturated: too old, marked stale, or never scraped.
    assert d.is_saturated([fresh(1, age=0.3)])
    assert not d.is_saturated([fresh(1, age=0.1)])
    assert d.is_saturated([ep(1, updated_at=1000.0, stale=True)])
    assert d.is_saturated([ep(1)])


def test_detector_saturation_gradient() -> None:
    d = detector()
    assert d.saturation([]) == 1.0
    # max(5/5, 0.4/0.8) = 1.0; max(0, 0.2/0.8) = 0.25; stale = 1.0
    assert d.saturation([fresh(1, q=5, kv=0.4), fresh(2, kv=0.2), fresh(3, age=1)]) == \
        pytest.approx((1.0 + 0.25 + 1.0) / 3)


def test_detector_as_filter() -> None:
    d = detector()
    eps = [fresh(1, q=4), fresh(2, q=5), fresh(3, kv=0.8), fresh(4, kv=0.79), fresh(5, age=0.5)]
    kept = d.filter(CycleState(), req(), eps)
    assert [e.name for e in kept] == ["pod-1", "pod-4"]  # limits are strict; stale dropped


def test_detector_filter_headroom_and_fail_open() -> None:
    d = detector(headroom=0.2)  # queue < 6, kv < 0.96
    kept = d.filter(CycleState(), req(), [fresh(1, q=5), fresh(2, q=6), fresh(3, kv=0.9)])
    assert [e.name for e in kept] == ["pod-1", "pod-3"]
    everyone_busy = [fresh(1, q=50), fresh(2, age=9)]
    assert list(d.filter(CycleState(), req(), everyone_busy)) == everyone_busy


def test_saturation_detector_config() -> None:
    built = build_text("""
        plugins:
        - type: queue-scorer
        - type: utilization-detector
          parameters: {queueDepthThreshold: 3, kvCacheUtilThreshold: 0.9,
                       metricsStalenessThreshold: 500ms}
        - type: max-score-picker
        schedulingProfiles:
        - name: default
          plugins:
          - pluginRef: utilization-detector
          - pluginRef: queue-scorer
          - pluginRef: max-score-picker
        saturationDetector: {pluginRef: utilization-detector}
        """)
    d = built.saturation_detector
    assert isinstance(d, UtilizationDetector) and d is built.plugins["utilization-detector"]
    assert d.queue_depth_threshold == 3 and d.metrics_staleness_threshold == 0.5
    assert built.scheduler.profiles["default"].filters == (d,)


def test_saturation_detector_must_be_a_detector() -> None:
    with pytest.raises(ConfigError) as info:
        build_text("plugins: [{type: queue-scorer}]\n"
                   "saturationDetector: {pluginRef: queue-scorer}\n")
    assert str(info.value) == (f"{SRC}: saturationDetector: 'queue-scorer' is not a saturation "
                               "detector (use a utilization-detector or concurrency-detector "
                               "plugin)")


def test_default_saturation_detector_is_injected_as_go_does() -> None:
    # GIE injects a utilization-detector with its defaults when none is named.
    detector = build_text("plugins: [{type: queue-scorer}]\n").saturation_detector
    assert isinstance(detector, UtilizationDetector)
    assert detector.queue_depth_threshold == UtilizationDetector.DEFAULT_QUEUE_DEPTH


def test_catalog_profile_end_to_end() -> None:
    """A profile with several catalog plugins schedules and tracks load across requests."""
    built = build_text("""
        plugins:
        - {type: label-selector-filter, parameters: {matchLabels: {role: serve}}}
        - type: utilization-detector
        - type: active-request-scorer
        - {type: load-aware-scorer, parameters: {threshold: 10}}
        - type: lora-affinity-scorer
        - type: session-affinity-scorer
        - type: weighted-random-picker
        schedulingProfiles:
        - name: default
          plugins:
          - pluginRef: label-selector-filter
          - pluginRef: utilization-detector
          - {pluginRef: active-request-scorer, weight: 2}
          - pluginRef: load-aware-scorer
          - pluginRef: lora-affinity-scorer
          - {pluginRef: session-affinity-scorer, weight: 100}
          - pluginRef: weighted-random-picker
        """)
    eps = [ep(i, name=f"p{i}", labels={"role": "serve" if i < 4 else "other"}) for i in range(1, 6)]
    target = eps[2]
    active = built.plugins["active-request-scorer"]
    assert isinstance(active, ActiveRequestScorer)
    wins = 0
    for i in range(200):
        r = req(rid=f"r{i}", session=session_token(target))
        res = built.scheduler.schedule(r, eps)
        chosen = res.primary.endpoints[0]
        assert chosen.labels["role"] == "serve"
        assert math.isfinite(res.primary.scores[chosen.key])
        wins += chosen is target
        for hook in built.pre_request:
            hook.pre_request(r, res)
        for done in built.response_complete:
            done.response_complete(r, chosen.key, aborted=i % 2 == 0)
    # Weighted random: the session endpoint's total (~103) dwarfs the others' (~3.5).
    assert wins >= 150
    assert active.tracker.requests == {}  # every request released (completed or aborted)
