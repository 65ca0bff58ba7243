"""Built-in scorers and pickers (design.md §4)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import decoding
from epp.framework.registry import builder_for
from epp.scheduling.plugins.pickers import MaxScorePicker, RandomPicker
from epp.scheduling.plugins.scorers import KVCacheUtilizationScorer, QueueScorer
from epp.scheduling.types import (
    ApiType,
    CycleState,
    Endpoint,
    LLMRequest,
    Metrics,
    ScoredEndpoint,
)


def ep(i: int, **metrics: object) -> Endpoint:
    return Endpoint(name=f"pod-{i}", address=f"10.0.0.{i}", port=8000, metrics=Metrics(**metrics))


def req() -> LLMRequest:
    return LLMRequest(request_id="r", target_model="m", incoming_model="m",
                      api=ApiType.COMPLETIONS, prompt="p", headers={})


def scored(*scores: float) -> list[ScoredEndpoint]:
    return [ScoredEndpoint(ep(i + 1), s) for i, s in enumerate(scores)]


# ---------------------------------------------------------------- queue-scorer


def test_queue_scorer_formula() -> None:
    eps = [ep(1, waiting_queue_size=2), ep(2, waiting_queue_size=10),
           ep(3, waiting_queue_size=4), ep(4, waiting_queue_size=6)]
    out = QueueScorer("q").score(CycleState(), req(), eps)
    # min 2, max 10: (10 - q) / 8
    assert list(out) == pytest.approx([1.0, 0.0, 0.75, 0.5])


def test_queue_scorer_all_equal_is_one() -> None:
    eps = [ep(1, waiting_queue_size=5), ep(2, waiting_queue_size=5), ep(3, waiting_queue_size=5)]
    assert list(QueueScorer("q").score(CycleState(), req(), eps)) == [1.0, 1.0, 1.0]


def test_queue_scorer_single_endpoint_is_one() -> None:
    assert list(QueueScorer("q").score(CycleState(), req(), [ep(1, waiting_queue_size=99)])) == [1.0]


def test_queue_scorer_relative_to_candidates_not_absolute() -> None:
    # Same spread at a higher level scores the same.
    low = QueueScorer("q").score(CycleState(), req(),
                                 [ep(1, waiting_queue_size=0), ep(2, waiting_queue_size=4)])
    high = QueueScorer("q").score(CycleState(), req(),
                                  [ep(1, waiting_queue_size=100), ep(2, waiting_queue_size=104)])
    assert list(low) == list(high) == [1.0, 0.0]


# ---------------------------------------------------------------- kv-cache-utilization-scorer


def test_kv_cache_scorer_is_one_minus_usage() -> None:
    eps = [ep(1, kv_cache_usage=0.0), ep(2, kv_cache_usage=0.3), ep(3, kv_cache_usage=1.0)]
    out = KVCacheUtilizationScorer("kv").score(CycleState(), req(), eps)
    assert list(out) == pytest.approx([1.0, 0.7, 0.0])


def test_kv_cache_scorer_clamps_usage() -> None:
    eps = [ep(1, kv_cache_usage=1.7), ep(2, kv_cache_usage=-0.4)]
    assert list(KVCacheUtilizationScorer("kv").score(CycleState(), req(), eps)) == [0.0, 1.0]


def test_kv_cache_scorer_never_scraped_counts_as_empty() -> None:
    e = Endpoint(name="p", address="10.0.0.9", port=8000)
    assert list(KVCacheUtilizationScorer("kv").score(CycleState(), req(), [e])) == [1.0]


def test_scorer_from_params_rejects_parameters() -> None:
    with decoding(strict=True), \
            pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.x: unknown parameter"):
        builder_for(QueueScorer, "t")("q", {"x": 1}, "plugins[0].parameters", PluginHandle())
    built = builder_for(KVCacheUtilizationScorer, "t")("kv", None, "p", PluginHandle())
    assert built.name == "kv" and built.type_name == "kv-cache-utilization-scorer"


# ---------------------------------------------------------------- max-score-picker


def test_max_score_picker_returns_highest() -> None:
    items = scored(0.2, 0.9, 0.5)
    out = MaxScorePicker("m", rng=random.Random(1)).pick(CycleState(), items)
    assert out.endpoints == (items[1].endpoint,)
    assert out.scores == {items[1].endpoint.key: 0.9}


def test_max_score_picker_breaks_ties_randomly() -> None:
    items = scored(0.7, 1.5, 0.1, 1.5)
    picker = MaxScorePicker("m", rng=random.Random(12345))
    counts = Counter(picker.pick(CycleState(), items).endpoints[0].key for _ in range(400))
    tied = {items[1].endpoint.key, items[3].endpoint.key}
    assert set(counts) == tied  # only the tied top endpoints, never the others
    for key in tied:
        assert counts[key] > 100  # both picked a fair share (expected ~200 each)


def test_max_score_picker_seeded_rng_is_reproducible() -> None:
    items = scored(1.0, 1.0, 1.0, 1.0)
    a = MaxScorePicker("m", rng=random.Random(7))
    b = MaxScorePicker("m", rng=random.Random(7))
    seq_a = [a.pick(CycleState(), items).endpoints[0].key for _ in range(30)]
    seq_b = [b.pick(CycleState(), items).endpoints[0].key for _ in range(30)]
    assert seq_a == seq_b
    assert len(set(seq_a)) > 1


def test_max_score_picker_max_num_returns_n_sorted_desc() -> None:
    items = scored(0.3, 0.9, 0.1, 0.6, 0.8)
    out = MaxScorePicker("m", 3, rng=random.Random(0)).pick(CycleState(), items)
    assert out.endpoints == (items[1].endpoint, items[4].endpoint, items[3].endpoint)
    assert out.scores == {items[1].endpoint.key: 0.9, items[4].endpoint.key: 0.8,
                          items[3].endpoint.key: 0.6}


def test_max_score_picker_max_num_larger_than_candidates() -> None:
    items = scored(0.3, 0.9)
    out = MaxScorePicker("m", 5, rng=random.Random(0)).pick(CycleState(), items)
    assert out.endpoints == (items[1].endpoint, items[0].endpoint)


def test_max_score_picker_does_not_mutate_input() -> None:
    items = scored(0.1, 0.9, 0.5)
    snapshot = list(items)
    MaxScorePicker("m", 3, rng=random.Random(0)).pick(CycleState(), items)
    assert items == snapshot


# ---------------------------------------------------------------- random-picker


def test_random_picker_returns_k_distinct() -> None:
    items = scored(0.1, 0.2, 0.3, 0.4, 0.5)
    picker = RandomPicker("r", 3, rng=random.Random(3))
    for _ in range(50):
        out = picker.pick(CycleState(), items)
        assert len(out.endpoints) == 3
        assert len({e.key for e in out.endpoints}) == 3
        assert set(out.endpoints) <= {s.endpoint for s in items}
        assert set(out.scores) == {e.key for e in out.endpoints}


def test_random_picker_caps_at_candidate_count() -> None:
    items = scored(0.1, 0.2)
    out = RandomPicker("r", 5, rng=random.Random(3)).pick(CycleState(), items)
    assert sorted(e.key for e in out.endpoints) == sorted(s.endpoint.key for s in items)


def test_random_picker_ignores_scores() -> None:
    items = scored(0.0, 1.0, 1.0)
    picker = RandomPicker("r", rng=random.Random(11))
    counts = Counter(picker.pick(CycleState(), items).endpoints[0].key for _ in range(300))
    assert set(counts) == {s.endpoint.key for s in items}
    assert counts[items[0].endpoint.key] > 50  # the zero-score endpoint is picked ~1/3


# ---------------------------------------------------------------- picker parameters


@pytest.mark.parametrize("cls", [MaxScorePicker, RandomPicker])
def test_picker_from_params(cls: type) -> None:
    p = builder_for(cls, "t")("pk", {"maxNumOfEndpoints": 4}, "plugins[2].parameters",
                              PluginHandle())
    assert p.name == "pk" and p.max_num_of_endpoints == 4
    default = builder_for(cls, "t")("pk", {}, "x", PluginHandle())
    assert default.max_num_of_endpoints == 1


@pytest.mark.parametrize(
    ("value", "fragment"),
    [(0, "must be >= 1, got 0"), (-2, "must be >= 1, got -2"),
     ("x", "expected an integer, got 'x'"), (True, "expected an integer, got True"),
     (1.5, "expected an integer, got 1.5")],
)
def test_picker_bad_max_num(value: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        builder_for(MaxScorePicker, "t")("pk", {"maxNumOfEndpoints": value},
                                         "plugins[2].parameters", PluginHandle())
    assert "plugins[2].parameters.maxNumOfEndpoints" in str(info.value)
    assert fragment in str(info.value)
