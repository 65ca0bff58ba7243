"""predicted-ttft-scorer (issue 17): the TTFT model, its online learning, cold start,
bounded state, pod removal; and the project default's cold start (no-hit-lru fix)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from epp.config.loader import load_and_build
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import ResponseTimings
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.predicted_ttft import PodModel, PredictedTTFTScorer
from epp.scheduling.plugins.prefix import ApproxPrefixCacheProducer
from epp.scheduling.types import (
    ApiType,
    CycleState,
    Endpoint,
    LLMRequest,
    Metrics,
    ProfileRunResult,
    SchedulingResult,
)


def ep(i: int, **metrics: Any) -> Endpoint:
    return Endpoint(name=f"pod-{i}", address=f"10.0.0.{i}", port=8000, namespace="",
                    labels={}, metrics=Metrics(**metrics))


def req(prompt: str, rid: str = "r") -> LLMRequest:
    return LLMRequest(request_id=rid, target_model="m", incoming_model="m",
                      api=ApiType.COMPLETIONS, prompt=prompt, headers={})


def result(e: Endpoint) -> SchedulingResult:
    return SchedulingResult({"default": ProfileRunResult((e,))}, "default")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def scorer(**params: Any) -> tuple[PredictedTTFTScorer, ApproxPrefixCacheProducer, Clock]:
    clock = Clock()
    handle = PluginHandle()
    producer = ApproxPrefixCacheProducer("prefix")
    handle.add(producer)
    built = default_registry().builder("predicted-ttft-scorer", "t")(
        "ttft", params or None, "plugins[0].parameters", handle)
    assert isinstance(built, PredictedTTFTScorer)
    built._clock = clock
    built.bind(handle)
    assert built.producer is producer
    return built, producer, clock


def route(s: PredictedTTFTScorer, producer: ApproxPrefixCacheProducer, r: LLMRequest,
          eps: list[Endpoint], to: int | None = None) -> list[float]:
    """Score, pick (the best, or ``to``), and run the PreRequest hooks."""
    scores = list(s.score(CycleState(), r, eps))
    chosen = eps[to] if to is not None else eps[max(range(len(eps)), key=lambda i: scores[i])]
    producer.pre_request(r, result(chosen))
    s.pre_request(r, result(chosen))
    return scores


PREFIX = "s" * 8000  # 2,000 tokens


def test_prediction_from_queued_tokens_and_cache() -> None:
    s, producer, _ = scorer()
    a, b = ep(1), ep(2)
    warm = req(PREFIX + "q1", "1")
    route(s, producer, warm, [a, b], to=0)  # a now holds the prefix, 2,001 tokens queued
    s.response_complete(warm, a.key, False)  # … and is idle again
    r = req(PREFIX + "q2", "2")
    uncached = s.uncached_tokens(CycleState(), r, [a, b])
    assert uncached[0] < 10 and uncached[1] == 2000
    preds = s.predictions(CycleState(), r, [a, b])
    c, d, _ = s.prior
    assert preds[0] == pytest.approx(c * uncached[0] + d)
    assert preds[1] == pytest.approx(c * 2000 + d)
    # Queued work ahead on a: prefill tokens, not request count.
    busy = req("x" * 40000, "3")  # 10,000 tokens routed to a, not finished
    route(s, producer, busy, [a, b], to=0)
    q, _, running = s.features(CycleState(), r, [a, b])[0]
    assert q == 10000 and running == 1
    preds = s.predictions(CycleState(), r, [a, b])
    assert preds[0] == pytest.approx(c * (10000 + uncached[0]) + d + s.prior[2] * 1)


def test_affinity_wins_until_the_queue_outweighs_the_saved_prefill() -> None:
    s, producer, _ = scorer()
    a, b = ep(1), ep(2)
    r0 = req(PREFIX + "q0", "0")
    route(s, producer, r0, [a, b], to=0)
    s.response_complete(req("", "x"), a.key, False)  # no plugin state: no-op
    s.response_complete(r0, a.key, False)
    # equal queues: the pod holding the prefix wins
    r1 = req(PREFIX + "q1", "1")
    scores = route(s, producer, r1, [a, b])
    assert scores[0] == 1.0 and scores[1] < 1.0
    # Queued work on a against the 2,000 tokens it saves: 1,000 ahead → still a;
    # 3,000 ahead → b.
    s2, p2, _ = scorer()
    route(s2, p2, req(PREFIX + "q0", "0"), [a, b], to=0)
    s2.pods[a.key].queued_tokens = 0
    route(s2, p2, req("y" * 4000, "big"), [a, b], to=0)  # 1,000 tokens on a: still a
    assert next(iter(s2.score(CycleState(), req(PREFIX + "q1", "1"), [a, b]))) == 1.0
    route(s2, p2, req("z" * 8000, "bigger"), [a, b], to=0)  # 3,000 tokens ahead on a
    scores = list(s2.score(CycleState(), req(PREFIX + "q2", "2"), [a, b]))
    assert scores[1] == 1.0 and scores[0] < 1.0


def test_learning_converges_to_a_known_per_token_cost() -> None:
    rng = random.Random(7)
    m = PodModel((0.05, 10.0, 0.1), window=200)
    for _ in range(400):
        tokens = rng.randrange(50, 8000)
        running = rng.randrange(0, 32)
        ttft = 0.2 * tokens + 4.0 + 0.5 * running + rng.gauss(0, 1.0)
        m.observe(tokens, running, ttft)
    c, _, e = m.theta
    assert c == pytest.approx(0.2, rel=0.01)
    assert e == pytest.approx(0.5, abs=0.1)
    # d absorbs what little c is off by; the predictions are what count.
    for tokens, running in ((100, 0), (3000, 8), (7000, 30)):
        want = 0.2 * tokens + 4.0 + 0.5 * running
        assert m.predict(tokens, running) == pytest.approx(want, rel=0.03, abs=3.0)


def test_learning_through_the_hooks_changes_the_pick() -> None:
    # Pod a is 4x slower per token than the prior says; after a few observed TTFTs the
    # scorer sends a cold request to b even though a has less queued.
    s, producer, _ = scorer()
    a, b = ep(1), ep(2)
    for i in range(60):
        r = req(f"{i:04d}" + "w" * (1600 * (1 + i % 10)), f"a{i}")  # 400 to 4,000 tokens
        route(s, producer, r, [a, b], to=0)
        _, _, tokens, _ = r.plugin_state["ttft"]
        s.response_measured(r, a.key, ResponseTimings(200, 1.0, ttft=(0.2 * tokens + 10) / 1000))
        s.response_complete(r, a.key, False)
    c, _, _ = s.models[a.key].theta
    assert c == pytest.approx(0.2, rel=0.05)
    route(s, producer, req("b" * 2000, "b0"), [a, b], to=1)  # 500 tokens queued on b
    scores = list(s.score(CycleState(), req("n" * 4000, "new"), [a, b]))
    assert scores[1] == 1.0 and scores[0] < 1.0
    # without learning it would have gone to a (nothing queued there)
    s2, p2, _ = scorer(learn=False)
    route(s2, p2, req("b" * 2000, "b0"), [a, b], to=1)
    assert next(iter(s2.score(CycleState(), req("n" * 4000, "new"), [a, b]))) == 1.0


def test_errors_and_foreign_pods_do_not_train() -> None:
    s, producer, _ = scorer()
    a, b = ep(1), ep(2)
    r = req("q" * 400, "1")
    route(s, producer, r, [a, b], to=0)
    s.response_measured(r, a.key, ResponseTimings(500, 1.0, ttft=5.0))
    s.response_measured(r, b.key, ResponseTimings(200, 1.0, ttft=5.0))
    s.response_measured(r, a.key, ResponseTimings(200, 1.0, ttft=None))
    assert s.models == {}


@pytest.mark.parametrize("order", [0, 1, 2])
def test_cold_start_prefers_less_load_whatever_the_list_order(order: int) -> None:
    s, _, _ = scorer()
    eps = [ep(1, waiting_queue_size=3, kv_cache_usage=0.2),
           ep(2, waiting_queue_size=0, kv_cache_usage=0.1),
           ep(3, waiting_queue_size=10, kv_cache_usage=0.2)]
    eps = eps[order:] + eps[:order]
    scores = list(s.score(CycleState(), req("hello world test1"), eps))
    best = eps[max(range(3), key=lambda i: scores[i])]
    assert best.name == "pod-2"
    assert scores.count(1.0) == 1


@pytest.mark.parametrize("order", [0, 1])
def test_ties_are_broken_by_load_not_list_order(order: int) -> None:
    # Same prediction (the scraped running requests are below this EPP's in-flight
    # count, which the model uses), different scraped load: the less loaded pod wins.
    s, _, _ = scorer(decodeMsPerRunning=0)
    eps = [ep(1, running_requests=5), ep(2, running_requests=1)]
    eps = eps[order:] + eps[:order]
    scores = list(s.score(CycleState(), req("hello"), eps))
    assert scores[[e.name for e in eps].index("pod-2")] == 1.0
    assert 1.0 - 1e-5 < min(scores) < 1.0


def test_fcfs_completion_and_scrape_release_queued_tokens() -> None:
    s, producer, clock = scorer()
    a = ep(1)
    rs = [req(f"{i}" + "p" * 400, f"r{i}") for i in range(4)]
    for r in rs:
        route(s, producer, r, [a], to=0)
        clock.t += 1
    assert s.pods[a.key].queued_tokens == 4 * 100
    s.response_complete(rs[1], a.key, False)  # r0 and r1 prefilled
    assert s.pods[a.key].queued_tokens == 2 * 100 and s.pods[a.key].inflight == 3
    # A scrape after all four were routed shows 1 waiting: only the newest stays queued.
    scraped = ep(1, waiting_queue_size=1, updated_at=clock.t)
    assert s.queued_tokens(scraped, 1.0) == 100
    # The scraped queue counts when it is longer than what this EPP knows of.
    other = ep(2, waiting_queue_size=5)
    assert s.queued_tokens(other, 1.0) == round(5 * s.mean_tokens)  # type: ignore[operator]


def test_bounded_state_and_timeout() -> None:
    s, producer, clock = scorer(maxEndpoints=2, requestTimeout="10s")
    eps = [ep(i) for i in range(1, 5)]
    for i, e in enumerate(eps):
        r = req(f"{i}" + "m" * 400, f"r{i}")
        route(s, producer, r, eps, to=i)
        s.response_measured(r, e.key, ResponseTimings(200, 1.0, ttft=0.02))
    models, _, inflight = s.state_size()
    assert models == 2 and inflight == 4
    assert list(s.models) == [eps[2].key, eps[3].key]  # least recently used dropped
    clock.t += 11
    route(s, producer, req("late" * 100, "late"), eps, to=0)
    assert s.state_size()[2] == 1  # the four old ones expired
    assert sum(p.queued_tokens for p in s.pods.values()) == s.pods[eps[0].key].queued_tokens


def test_pod_removal_forgets_it() -> None:
    s, producer, _ = scorer()
    a, b = ep(1), ep(2)
    r = req("q" * 400, "1")
    route(s, producer, r, [a, b], to=0)
    s.response_measured(r, a.key, ResponseTimings(200, 1.0, ttft=0.02))
    s.endpoint_removed(a.key)
    assert a.key not in s.models and a.key not in s.pods and s.state_size()[2] == 0
    s.response_complete(r, a.key, False)  # a late completion is harmless


def test_parameters_and_binding_errors() -> None:
    build = default_registry().builder("predicted-ttft-scorer", "t")
    with pytest.raises(ConfigError, match="prefillMsPerToken"):
        build("x", {"prefillMsPerToken": 0}, "plugins[0].parameters", PluginHandle())
    with pytest.raises(ConfigError, match="observationWindow"):
        build("x", {"observationWindow": 0}, "plugins[0].parameters", PluginHandle())
    s = build("x", {"prefixPluginName": "nope"}, "plugins[0].parameters", PluginHandle())
    assert isinstance(s, PredictedTTFTScorer)
    with pytest.raises(ConfigError, match="nope"):
        s.bind(PluginHandle())
    # Without a producer declared, the scorer creates one.
    handle = PluginHandle()
    s = build("x", None, "plugins[0].parameters", handle)
    assert isinstance(s, PredictedTTFTScorer)
    s.bind(handle)
    assert isinstance(handle.get("x-producer"), ApproxPrefixCacheProducer)


def test_shipped_config_builds() -> None:
    built = load_and_build("config/predicted-ttft.yaml")
    assert any(isinstance(p, PredictedTTFTScorer) for p in built.plugins.values())


def test_project_default_cold_start_picks_the_least_queue() -> None:
    # GIE's hermetic "least queue" case under the built-in default: no-hit-lru must not
    # rank the never-used pods by list order (issue 17).
    for order in range(3):
        built = load_and_build(None)
        for plugin in built.plugins.values():
            if hasattr(plugin, "_rng"):
                plugin._rng = random.Random(order)
        eps = [ep(1, waiting_queue_size=3, kv_cache_usage=0.2),
               ep(2, waiting_queue_size=0, kv_cache_usage=0.1),
               ep(3, waiting_queue_size=10, kv_cache_usage=0.2)]
        eps = eps[order:] + eps[:order]
        res = built.scheduler.schedule(req("test1"), eps)
        assert res.primary.endpoints[0].name == "pod-2"
