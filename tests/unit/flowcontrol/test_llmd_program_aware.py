"""``program-aware-fairness`` (llm-d-router v0.10.0
pkg/epp/framework/plugins/flowcontrol/fairness/program-aware), case by case as its tests
check it (plugin_test.go, strategy_las_test.go, programmetrics_test.go)."""

from __future__ import annotations

from typing import Any

import pytest

from epp.errors import ConfigError
from epp.flowcontrol.interfaces import FairnessPolicy
from epp.flowcontrol.llmd import (
    ProgramAwareFairness,
    ProgramAwareParameters,
    ProgramMetrics,
    _range_normalize,
    jain_fairness_index,
)
from epp.flowcontrol.types import FlowControlRequest
from epp.framework.interfaces import PreRequest, ResponseComplete, ResponseUsageMetadata
from epp.framework.params import decode_params
from epp.scheduling.types import ApiType, LLMRequest, SchedulingResult
from tests.unit.flowcontrol.test_llmd_usage_limits import make
from tests.unit.flowcontrol.test_plugins import Band, Item, Queue


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def item(enqueue_time: float, request_id: str = "") -> Item:
    it = Item(enqueue_time)
    it.request = FlowControlRequest(request_id=request_id)
    return it


def policy(clock: Clock | None = None, **params: Any) -> ProgramAwareFairness:
    """The policy with ``params`` (config keys) on a fake clock."""
    decoded = decode_params(ProgramAwareParameters, params, "parameters")
    return ProgramAwareFairness("pa", decoded, clock or Clock())


def request(rid: str = "r1", fairness_id: str | None = "alpha") -> LLMRequest:
    return LLMRequest(request_id=rid, target_model="m", incoming_model="m",
                      api=ApiType.CHAT_COMPLETIONS, prompt="", headers={},
                      fairness_id=fairness_id)


RESULT: Any = SchedulingResult.__new__(SchedulingResult)  # pre_request does not read it


# ================================================================ factory


def test_factory_defaults_and_protocols() -> None:
    p = make("program-aware-fairness", None, "pa")
    assert isinstance(p, FairnessPolicy) and isinstance(p, PreRequest)
    assert isinstance(p, ResponseComplete) and isinstance(p, ResponseUsageMetadata)
    assert (p.weight_service, p.weight_head_wait, p.decay_factor, p.half_life) == (
        0.8, 0.2, 0.99997, 0.0)
    assert (p.eviction_ttl, p.eviction_sweep) == (3600.0, 300.0)
    assert p.response_needs == frozenset({"body"})
    p = make("program-aware-fairness", {"strategy": "las", "lasWeightService": 0.5,
                                        "lasHalfLifeSeconds": 60})
    assert (p.weight_service, p.half_life) == (0.5, 60.0)


@pytest.mark.parametrize(("params", "message"), [
    ({"strategy": "wfq"}, "strategy: unknown scoring strategy 'wfq'"),
    ({"evictionTtlSeconds": -1}, "evictionTtlSeconds: must be >= 0"),
    ({"evictionSweepSeconds": 0}, "evictionSweepSeconds: must be > 0"),
    ({"lasWeightService": -1}, "lasWeightService: must be >= 0"),
    ({"lasWeightHeadWait": -1}, "lasWeightHeadWait: must be >= 0"),
    ({"lasDecayFactor": 0}, r"lasDecayFactor: must be in \(0, 1\]"),
    ({"lasDecayFactor": 1.5}, r"lasDecayFactor: must be in \(0, 1\]"),
    ({"lasHalfLifeSeconds": -1}, "lasHalfLifeSeconds: must be >= 0"),
])
def test_factory_invalid(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make("program-aware-fairness", params)


# ================================================================ pick


def test_pick_all_empty_and_empty_band() -> None:
    p = policy()
    assert p.pick(Band([])) is None
    assert p.pick(Band([Queue("a"), Queue("b")])) is None


def test_pick_single_queue_stashes_enqueue_time_for_pre_request() -> None:
    clock = Clock(1000.0)
    p = policy(clock)
    q = Queue("alpha", [item(999.75, "r1")])
    assert p.pick(Band([q])) is q
    clock.now = 1000.5
    p.pre_request(request("r1"), RESULT)
    m = p.programs["alpha"]
    assert (m.dispatched, m.in_flight, m.wait_count, m.average_wait_ms) == (1, 1, 1, 750.0)


def test_pre_request_without_enqueue_time_still_dispatches() -> None:
    p = policy()
    p.pre_request(request("never-queued"), RESULT)
    m = p.programs["alpha"]
    assert (m.dispatched, m.in_flight, m.wait_count) == (1, 1, 0)


def test_pre_request_without_fairness_id_uses_the_default_flow() -> None:
    p = policy()
    p.pre_request(request(fairness_id=None), RESULT)
    assert list(p.programs) == ["default-flow"]


def test_las_prefers_lower_attained_service() -> None:
    p = policy()
    p.metrics("alpha").attained_service = 1000.0
    p.metrics("beta").attained_service = 10.0
    alpha, beta = Queue("alpha", [item(999.0)]), Queue("beta", [item(999.0)])
    assert p.pick(Band([alpha, beta])) is beta


def test_las_cold_start_uses_head_wait() -> None:
    p = policy(Clock(1000.0))
    alpha, beta = Queue("alpha", [item(990.0)]), Queue("beta", [item(999.0)])
    assert p.pick(Band([alpha, beta])) is alpha


def test_las_decays_inactive_service_per_pick() -> None:
    p = policy(lasDecayFactor=0.5)
    p.metrics("alpha").attained_service = 100.0
    p.pick(Band([Queue("alpha"), Queue("beta", [item(999.0)])]))
    assert p.programs["alpha"].attained_service == 50.0


def test_las_no_decay_while_in_flight() -> None:
    p = policy(lasDecayFactor=0.5)
    m = p.metrics("alpha")
    m.attained_service = 100.0
    m.record_dispatched(None)
    p.pick(Band([Queue("alpha")]))
    assert m.attained_service == 100.0


def test_las_usage_accumulates_weighted_cost() -> None:
    p = policy()
    assert p.usage_metadata(request(), {"prompt_tokens": 100,
                                        "completion_tokens": 50}) is None
    assert p.programs["alpha"].attained_service == 200.0  # 1*100 + 2*50
    p.usage_metadata(request(), {})  # no usage: nothing added
    assert p.programs["alpha"].attained_service == 200.0


def test_las_timed_decay_halves_at_half_life() -> None:
    clock = Clock(1000.0)
    p = policy(clock, lasHalfLifeSeconds=1.0)
    p.usage_metadata(request(), {"prompt_tokens": 100, "completion_tokens": 0})
    clock.now = 1001.0
    p.pick(Band([Queue("alpha")]))
    assert p.programs["alpha"].attained_service == pytest.approx(50.0)
    # A program never served: the first decay only anchors.
    m = ProgramMetrics(0.0)
    m.attained_service = 8.0
    m.decay(5.0, 1.0, 0.5)
    assert (m.attained_service, m.decay_anchor) == (8.0, 5.0)


def test_las_factor_decay_per_call() -> None:
    m = ProgramMetrics(0.0)
    m.attained_service = 100.0
    m.decay(0.0, 0.0, 0.9)
    m.decay(0.0, 0.0, 0.9)
    assert m.attained_service == pytest.approx(81.0)


def test_underserved_program_wins_over_a_heavy_one() -> None:
    """The point of LAS: after alpha consumed many tokens, beta is served first even
    when alpha's head has waited longer."""
    clock = Clock(1000.0)
    p = policy(clock)
    p.usage_metadata(request("x", "alpha"), {"prompt_tokens": 5000,
                                             "completion_tokens": 5000})
    alpha = Queue("alpha", [item(990.0, "a1")])
    beta = Queue("beta", [item(999.9, "b1")])
    assert p.pick(Band([alpha, beta])) is beta


# ================================================================ lifecycle and eviction


def test_response_complete_decrements_in_flight_and_stamps_completion() -> None:
    clock = Clock(1000.0)
    p = policy(clock)
    p.pre_request(request(), RESULT)
    clock.now = 1010.0
    p.response_complete(request(), "ep", aborted=False)
    m = p.programs["alpha"]
    assert (m.in_flight, m.last_completion) == (0, 1010.0)
    p.response_complete(request(), "ep", aborted=False)  # never below zero
    assert m.in_flight == 0


def test_evict_idle() -> None:
    clock = Clock(1000.0)
    p = policy(clock, evictionTtlSeconds=60)
    p.metrics("idle")
    p.metrics("busy").record_dispatched(None)
    clock.now = 1030.0
    p.metrics("recent")
    clock.now = 1061.0
    p.evict_idle(clock.now)
    assert sorted(p.programs) == ["busy", "recent"]  # never-completed ones age out too


def test_eviction_sweeps_from_pick_every_interval() -> None:
    clock = Clock(1000.0)
    p = policy(clock, evictionTtlSeconds=10, evictionSweepSeconds=100)
    p.metrics("old")
    clock.now = 1050.0
    p.pick(Band([]))
    assert "old" in p.programs  # not yet a sweep
    clock.now = 1100.0
    p.pick(Band([]))
    assert "old" not in p.programs
    p0 = policy(clock, evictionTtlSeconds=0)  # 0: never evicted
    p0.metrics("x")
    clock.now = 10_000.0
    p0.pick(Band([]))
    assert "x" in p0.programs


# ================================================================ fairness index


def test_fairness_index() -> None:
    assert jain_fairness_index([]) == 1.0
    assert jain_fairness_index([5.0]) == 1.0
    assert jain_fairness_index([100.0, 100.0, 100.0]) == pytest.approx(1.0)
    assert jain_fairness_index([10.0, 1000.0]) < 0.6
    assert jain_fairness_index([0.0, 0.0]) == 1.0


def test_range_normalize() -> None:
    assert _range_normalize(5, 5, 5) == 0.5
    assert _range_normalize(0, 0, 10) == 0.0
    assert _range_normalize(10, 0, 10) == 1.0
    assert _range_normalize(5, 0, 10) == 0.5


def test_program_metrics_running_mean() -> None:
    m = ProgramMetrics(0.0)
    m.record_dispatched(100.0)
    m.record_dispatched(300.0)
    assert (m.wait_count, m.average_wait_ms, m.dispatched, m.in_flight) == (2, 200.0, 2, 2)
    m.record_completion(7.0)
    assert (m.in_flight, m.last_completion) == (1, 7.0)
