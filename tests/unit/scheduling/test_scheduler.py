"""The multi-cycle scheduler loop and SchedulerProfile.run (design.md §4)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from epp.errors import EppError, NoCapacity
from epp.framework.interfaces import Filter, Picker, ProfileHandler, Scorer
from epp.scheduling import scheduler as scheduler_mod
from epp.scheduling.plugins.handlers import SingleProfileHandler
from epp.scheduling.plugins.pickers import MaxScorePicker
from epp.scheduling.scheduler import Scheduler, SchedulerProfile
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

# ---------------------------------------------------------------- helpers


def ep(i: int, **metrics: object) -> Endpoint:
    return Endpoint(name=f"pod-{i}", address=f"10.0.0.{i}", port=8000, metrics=Metrics(**metrics))


def req(request_id: str = "r1") -> LLMRequest:
    return LLMRequest(
        request_id=request_id,
        target_model="m",
        incoming_model="m",
        api=ApiType.CHAT_COMPLETIONS,
        prompt="hello",
        headers={},
    )


class FixedScorer:
    """Scores endpoints from a key → score table; records what it was asked to score."""

    type_name = "fixed-scorer"

    def __init__(self, name: str, table: Mapping[str, float]) -> None:
        self.name = name
        self.table = dict(table)
        self.calls: list[list[str]] = []

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        self.calls.append([e.key for e in endpoints])
        return [self.table[e.key] for e in endpoints]


class WrongLengthScorer:
    type_name = "wrong-length-scorer"
    name = "wrong-length"

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        return [0.5] * (len(endpoints) + 1)


class KeepFilter:
    """Keeps endpoints whose key is in ``keep``; records its input."""

    type_name = "keep-filter"

    def __init__(self, name: str, keep: set[str]) -> None:
        self.name = name
        self.keep = keep
        self.inputs: list[list[str]] = []

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        self.inputs.append([e.key for e in endpoints])
        return [e for e in endpoints if e.key in self.keep]


class ExcludeFromStateFilter:
    """Drops the endpoint whose key the profile handler left in ``state['exclude']``."""

    type_name = "exclude-from-state-filter"
    name = "exclude-from-state"

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        excluded = state.get("exclude")
        return [e for e in endpoints if e.key != excluded]


def max_picker(n: int = 1, seed: int = 0) -> MaxScorePicker:
    return MaxScorePicker("max-score-picker", n, rng=random.Random(seed))


def single(profile: SchedulerProfile, timer=None) -> Scheduler:  # type: ignore[no-untyped-def]
    handler = SingleProfileHandler("single-profile-handler")
    if timer is None:
        return Scheduler(handler, {profile.name: profile})
    return Scheduler(handler, {profile.name: profile}, timer)


# ---------------------------------------------------------------- test plugins satisfy protocols


def test_test_plugins_satisfy_protocols() -> None:
    assert isinstance(FixedScorer("s", {}), Scorer)
    assert isinstance(KeepFilter("f", set()), Filter)
    assert isinstance(max_picker(), Picker)
    assert isinstance(SingleProfileHandler("h"), ProfileHandler)


# ---------------------------------------------------------------- single-profile handler


def test_single_profile_handler_runs_the_profile_once() -> None:
    e1, e2 = ep(1), ep(2)
    scorer = FixedScorer("s", {e1.key: 0.2, e2.key: 0.9})
    profile = SchedulerProfile("default", [], [(scorer, 1.0)], max_picker())
    result = single(profile).schedule(req(), [e1, e2])

    assert scorer.calls == [[e1.key, e2.key]]  # ran exactly once, over all candidates
    assert result.primary_profile == "default"
    assert list(result.profile_results) == ["default"]
    assert result.primary.endpoints == (e2,)
    assert result.primary.scores == {e2.key: pytest.approx(0.9)}


def test_single_handler_pick_and_process_directly() -> None:
    h = SingleProfileHandler("h")
    profile = SchedulerProfile("p", [], [], max_picker())
    profiles = {"p": profile}
    assert h.pick(CycleState(), req(), profiles, {}) == profiles
    assert h.pick(CycleState(), req(), profiles, {"p": None}) == {}
    e1 = ep(1)
    ok = ProfileRunResult((e1,), {e1.key: 1.0})
    out = h.process_results(CycleState(), req(), {"p": ok})
    assert out.primary_profile == "p"
    assert out.primary is ok


def test_profile_filtered_to_nothing_gives_none_and_no_capacity() -> None:
    e1, e2 = ep(1), ep(2)
    scorer = FixedScorer("s", {e1.key: 1.0, e2.key: 1.0})
    flt = KeepFilter("keep-none", set())
    profile = SchedulerProfile("default", [flt], [(scorer, 1.0)], max_picker())

    # The profile itself reports None, and the scorers never run.
    assert profile.run(CycleState(), req(), [e1, e2]) is None
    assert scorer.calls == []

    with pytest.raises(NoCapacity) as info:
        single(profile).schedule(req(), [e1, e2])
    assert info.value.status == 429
    assert info.value.error_type == "rate_limit_exceeded"
    assert "default" in info.value.message


def test_single_handler_empty_result_endpoints_is_no_capacity() -> None:
    h = SingleProfileHandler("h")
    with pytest.raises(NoCapacity):
        h.process_results(CycleState(), req(), {"p": ProfileRunResult(())})


def test_filters_chain_in_order() -> None:
    e1, e2, e3 = ep(1), ep(2), ep(3)
    f1 = KeepFilter("f1", {e1.key, e2.key})
    f2 = KeepFilter("f2", {e2.key, e3.key})
    scorer = FixedScorer("s", {e1.key: 1.0, e2.key: 0.0, e3.key: 1.0})
    profile = SchedulerProfile("p", [f1, f2], [(scorer, 1.0)], max_picker())
    out = profile.run(CycleState(), req(), [e1, e2, e3])

    assert f1.inputs == [[e1.key, e2.key, e3.key]]
    assert f2.inputs == [[e1.key, e2.key]]  # sees only what f1 kept
    assert scorer.calls == [[e2.key]]
    assert out is not None and out.endpoints == (e2,)


# ---------------------------------------------------------------- multi-cycle handler


class TwoStepHandler:
    """Runs 'decode' in cycle 1 and 'prefill' in cycle 2, excluding decode's pick."""

    type_name = "two-step-handler"
    name = "two-step"

    def __init__(self) -> None:
        self.cycles: list[dict[str, ProfileRunResult | None]] = []
        self.states: list[CycleState] = []

    def pick(self, state: CycleState, request: LLMRequest,
             profiles: Mapping[str, SchedulerProfile],
             results: Mapping[str, ProfileRunResult | None]) -> Mapping[str, SchedulerProfile]:
        self.cycles.append(dict(results))
        self.states.append(state)
        if not results:
            return {"decode": profiles["decode"]}
        if "prefill" not in results:
            decode = results["decode"]
            assert decode is not None
            state["exclude"] = decode.endpoints[0].key
            return {"prefill": profiles["prefill"]}
        return {}

    def process_results(self, state: CycleState, request: LLMRequest,
                        results: Mapping[str, ProfileRunResult | None]) -> SchedulingResult:
        return SchedulingResult(profile_results=dict(results), primary_profile="decode")


def test_custom_handler_runs_two_profiles_in_two_cycles() -> None:
    e1, e2, e3 = ep(1), ep(2), ep(3)
    table = {e1.key: 0.9, e2.key: 0.5, e3.key: 0.1}
    decode_scorer = FixedScorer("decode-scorer", table)
    prefill_scorer = FixedScorer("prefill-scorer", table)
    handler = TwoStepHandler()
    sched = Scheduler(handler, {
        "decode": SchedulerProfile("decode", [], [(decode_scorer, 1.0)], max_picker()),
        "prefill": SchedulerProfile("prefill", [ExcludeFromStateFilter()],
                                    [(prefill_scorer, 1.0)], max_picker()),
    })
    result = sched.schedule(req(), [e1, e2, e3])

    # Three handler calls: pick decode, pick prefill (seeing decode's result), stop.
    assert len(handler.cycles) == 3
    assert handler.cycles[0] == {}
    assert list(handler.cycles[1]) == ["decode"]
    assert handler.cycles[1]["decode"] is not None
    assert handler.cycles[1]["decode"].endpoints == (e1,)
    assert list(handler.cycles[2]) == ["decode", "prefill"]
    # One CycleState shared by every cycle.
    assert handler.states[0] is handler.states[1] is handler.states[2]
    # Each profile ran once; prefill never saw decode's endpoint.
    assert decode_scorer.calls == [[e1.key, e2.key, e3.key]]
    assert prefill_scorer.calls == [[e2.key, e3.key]]
    # Aggregated.
    assert result.primary_profile == "decode"
    assert result.primary.endpoints == (e1,)
    prefill = result.profile_results["prefill"]
    assert prefill is not None and prefill.endpoints == (e2,)


class RerunHandler:
    type_name = "rerun-handler"
    name = "rerun"

    def pick(self, state, request, profiles, results):  # type: ignore[no-untyped-def]
        return profiles  # never notices it already ran them

    def process_results(self, state, request, results):  # type: ignore[no-untyped-def]
        raise AssertionError("must not be reached")


def test_handler_rerunning_a_profile_is_500() -> None:
    e1 = ep(1)
    profile = SchedulerProfile("p", [], [], max_picker())
    with pytest.raises(EppError) as info:
        Scheduler(RerunHandler(), {"p": profile}).schedule(req(), [e1])
    assert type(info.value) is EppError
    assert info.value.status == 500
    assert "re-ran profile 'p'" in info.value.message
    assert "rerun" in info.value.message


class EndlessHandler:
    """Runs one not-yet-run profile per cycle and never says it is done."""

    type_name = "endless-handler"
    name = "endless"

    def __init__(self) -> None:
        self.picks = 0

    def pick(self, state, request, profiles, results):  # type: ignore[no-untyped-def]
        self.picks += 1
        for name, profile in profiles.items():
            if name not in results:
                return {name: profile}
        raise AssertionError("ran out of profiles before the scheduler stopped the loop")

    def process_results(self, state, request, results):  # type: ignore[no-untyped-def]
        raise AssertionError("must not be reached")


def test_handler_that_never_stops_is_500() -> None:
    e1 = ep(1)
    n = scheduler_mod.MAX_CYCLES + 4
    profiles = {f"p{i}": SchedulerProfile(f"p{i}", [], [], max_picker()) for i in range(n)}
    handler = EndlessHandler()
    with pytest.raises(EppError) as info:
        Scheduler(handler, profiles).schedule(req(), [e1])
    assert type(info.value) is EppError
    assert info.value.status == 500
    assert f"did not finish in {scheduler_mod.MAX_CYCLES} cycles" in info.value.message
    assert handler.picks == scheduler_mod.MAX_CYCLES


class GhostHandler:
    """Picks a profile under a name the scheduler was never configured with."""

    type_name = "ghost-handler"
    name = "ghost"

    def pick(self, state, request, profiles, results):  # type: ignore[no-untyped-def]
        if results:
            return {}
        return {"ghost": SchedulerProfile("ghost", [], [], max_picker())}

    def process_results(self, state, request, results):  # type: ignore[no-untyped-def]
        return SchedulingResult(profile_results=dict(results), primary_profile="ghost")


def test_handler_picking_unknown_profile_is_500() -> None:
    profiles = {"p": SchedulerProfile("p", [], [], max_picker())}
    with pytest.raises(EppError) as info:
        Scheduler(GhostHandler(), profiles).schedule(req(), [ep(1)])
    assert info.value.status == 500


def test_scheduler_needs_a_profile() -> None:
    with pytest.raises(ValueError, match="at least one profile"):
        Scheduler(SingleProfileHandler("h"), {})


# ---------------------------------------------------------------- weights, clamping, lengths


def _weighted_profile(wa: float, wb: float) -> tuple[SchedulerProfile, list[Endpoint]]:
    e1, e2, e3 = ep(1), ep(2), ep(3)
    a = FixedScorer("a", {e1.key: 1.0, e2.key: 0.0, e3.key: 0.5})
    b = FixedScorer("b", {e1.key: 0.0, e2.key: 1.0, e3.key: 0.6})
    return SchedulerProfile("p", [], [(a, wa), (b, wb)], max_picker(3)), [e1, e2, e3]


@pytest.mark.parametrize(
    ("wa", "wb", "expected_totals", "winner"),
    [
        # totals = wa * a + wb * b
        (2.0, 1.0, (2.0, 1.0, 1.6), 0),  # 2*1+1*0, 2*0+1*1, 2*.5+1*.6
        (1.0, 3.0, (1.0, 3.0, 2.3), 1),  # 1*1+3*0, 1*0+3*1, 1*.5+3*.6
        (1.0, 1.0, (1.0, 1.0, 1.1), 2),  # e3 wins only when weights are equal
        (0.0, 1.0, (0.0, 1.0, 0.6), 1),  # weight 0 silences a scorer
    ],
)
def test_weights_change_the_winner(wa: float, wb: float,
                                   expected_totals: tuple[float, float, float],
                                   winner: int) -> None:
    profile, eps = _weighted_profile(wa, wb)
    out = single(profile).schedule(req(), eps).primary
    assert out.endpoints[0] is eps[winner]
    assert out.scores == {e.key: pytest.approx(t) for e, t in zip(eps, expected_totals)}
    # Primary first, then the rest by descending total (ties in any order).
    assert set(out.endpoints) == set(eps)
    totals = [out.scores[e.key] for e in out.endpoints]
    assert totals == sorted(totals, reverse=True)


def test_scores_are_clamped_to_unit_interval() -> None:
    e1, e2, e3 = ep(1), ep(2), ep(3)
    wild = FixedScorer("wild", {e1.key: 7.0, e2.key: -3.0, e3.key: 0.4})
    profile = SchedulerProfile("p", [], [(wild, 2.0)], max_picker(3))
    out = profile.run(CycleState(), req(), [e1, e2, e3])
    assert out is not None
    assert out.scores == {e1.key: pytest.approx(2.0), e2.key: pytest.approx(0.0),
                          e3.key: pytest.approx(0.8)}
    assert out.endpoints == (e1, e3, e2)


def test_clamping_keeps_a_wild_scorer_from_outweighing_others() -> None:
    e1, e2 = ep(1), ep(2)
    wild = FixedScorer("wild", {e1.key: 100.0, e2.key: 0.0})  # clamped to 1
    sane = FixedScorer("sane", {e1.key: 0.0, e2.key: 1.0})
    profile = SchedulerProfile("p", [], [(wild, 1.0), (sane, 2.0)], max_picker(2))
    out = profile.run(CycleState(), req(), [e1, e2])
    assert out is not None
    assert out.endpoints == (e2, e1)
    assert out.scores == {e1.key: pytest.approx(1.0), e2.key: pytest.approx(2.0)}


def test_scorer_returning_wrong_length_errors() -> None:
    profile = SchedulerProfile("p", [], [(WrongLengthScorer(), 1.0)], max_picker())
    with pytest.raises(EppError) as info:
        single(profile).schedule(req(), [ep(1), ep(2)])
    assert info.value.status == 500
    assert "wrong-length" in info.value.message
    assert "3 scores for 2 endpoints" in info.value.message


def test_no_scorers_gives_zero_totals() -> None:
    e1, e2 = ep(1), ep(2)
    profile = SchedulerProfile("p", [], [], max_picker(2))
    out = profile.run(CycleState(), req(), [e1, e2])
    assert out is not None
    assert set(out.endpoints) == {e1, e2}
    assert out.scores == {e1.key: 0.0, e2.key: 0.0}


class RecordingPicker:
    """Records the scored list it receives and picks the first."""

    type_name = "recording-picker"
    name = "recording"

    def __init__(self) -> None:
        self.seen: list[list[tuple[str, float]]] = []

    def pick(self, state: CycleState, scored: Sequence[ScoredEndpoint]) -> ProfileRunResult:
        self.seen.append([(s.endpoint.key, s.score) for s in scored])
        return ProfileRunResult((scored[0].endpoint,), {scored[0].endpoint.key: scored[0].score})


def test_picker_receives_candidates_in_filtered_order_with_totals() -> None:
    e1, e2, e3 = ep(1), ep(2), ep(3)
    flt = KeepFilter("f", {e3.key, e1.key})
    s = FixedScorer("s", {e1.key: 0.25, e2.key: 1.0, e3.key: 0.75})
    picker = RecordingPicker()
    profile = SchedulerProfile("p", [flt], [(s, 4.0)], picker)
    out = profile.run(CycleState(), req(), [e3, e2, e1])
    # Candidate order is kept through filter and scoring: e3 then e1.
    assert picker.seen == [[(e3.key, pytest.approx(3.0)), (e1.key, pytest.approx(1.0))]]
    assert out == ProfileRunResult((e3,), {e3.key: pytest.approx(3.0)})


# ---------------------------------------------------------------- plugin timer


def test_timer_called_for_every_plugin_with_extension_point() -> None:
    e1, e2 = ep(1), ep(2)
    calls: list[tuple[str, str, float]] = []

    def timer(point: str, plugin, seconds: float) -> None:  # type: ignore[no-untyped-def]
        calls.append((point, plugin.name, seconds))

    f1 = KeepFilter("f1", {e1.key, e2.key})
    f2 = KeepFilter("f2", {e1.key, e2.key})
    s1 = FixedScorer("s1", {e1.key: 1.0, e2.key: 0.0})
    s2 = FixedScorer("s2", {e1.key: 0.0, e2.key: 1.0})
    picker = max_picker()
    profile = SchedulerProfile("p", [f1, f2], [(s1, 1.0), (s2, 1.0)], picker, timer)
    single(profile, timer).schedule(req(), [e1, e2])

    assert [(p, n) for p, n, _ in calls] == [
        ("ProfilePicker", "single-profile-handler"),
        ("Filter", "f1"),
        ("Filter", "f2"),
        ("Scorer", "s1"),
        ("Scorer", "s2"),
        ("Picker", "max-score-picker"),
        ("ProfilePicker", "single-profile-handler"),
        ("ProcessProfilesResults", "single-profile-handler"),
    ]
    assert all(isinstance(sec, float) and sec >= 0.0 for _, _, sec in calls)


def test_timer_stops_at_the_filter_that_empties_the_list() -> None:
    e1 = ep(1)
    calls: list[tuple[str, str]] = []

    def timer(point: str, plugin, seconds: float) -> None:  # type: ignore[no-untyped-def]
        calls.append((point, plugin.name))

    f_empty = KeepFilter("empty", set())
    f_after = KeepFilter("after", {e1.key})
    s = FixedScorer("s", {e1.key: 1.0})
    profile = SchedulerProfile("p", [f_empty, f_after], [(s, 1.0)], max_picker(), timer)
    assert profile.run(CycleState(), req(), [e1]) is None
    assert calls == [("Filter", "empty")]
    assert f_after.inputs == []


# ---------------------------------------------------------------- scheduling observer


class RecordingObserver:
    """A SchedulingObserver that writes down every hook call."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def profile_started(self, profile: str, candidates: Sequence[Endpoint]) -> None:
        self.calls.append(("profile_started", profile, [e.key for e in candidates]))

    def filtered(self, profile: str, plugin: Filter, before: Sequence[Endpoint],
                 kept: Sequence[Endpoint]) -> None:
        self.calls.append(("filtered", profile, plugin.name, [e.key for e in before],
                           [e.key for e in kept]))

    def scored(self, profile: str, plugin: Scorer, weight: float,
               endpoints: Sequence[Endpoint], scores: Sequence[float]) -> None:
        self.calls.append(("scored", profile, plugin.name, weight,
                           {e.key: s for e, s in zip(endpoints, scores)}))

    def picked(self, profile: str, plugin: Picker, scored: Sequence[ScoredEndpoint],
               result: ProfileRunResult) -> None:
        self.calls.append(("picked", profile, plugin.name,
                           {s.endpoint.key: s.score for s in scored},
                           [e.key for e in result.endpoints]))


def _observed_profile() -> tuple[SchedulerProfile, list[Endpoint]]:
    e1, e2, e3 = ep(1), ep(2), ep(3)
    flt = KeepFilter("f", {e1.key, e2.key})
    s1 = FixedScorer("s1", {e1.key: 0.2, e2.key: 1.5})  # 1.5 is clamped to 1.0
    s2 = FixedScorer("s2", {e1.key: 1.0, e2.key: 0.0})
    return SchedulerProfile("p", [flt], [(s1, 2.0), (s2, 1.0)], max_picker()), [e1, e2, e3]


def test_observer_is_told_every_plugin_outcome_in_call_order() -> None:
    profile, eps = _observed_profile()
    e1, e2, e3 = eps
    obs = RecordingObserver()
    result = single(profile).schedule(req(), eps, obs)
    assert obs.calls == [
        ("profile_started", "p", [e1.key, e2.key, e3.key]),
        ("filtered", "p", "f", [e1.key, e2.key, e3.key], [e1.key, e2.key]),
        ("scored", "p", "s1", 2.0, {e1.key: 0.2, e2.key: 1.0}),
        ("scored", "p", "s2", 1.0, {e1.key: 1.0, e2.key: 0.0}),
        ("picked", "p", "max-score-picker", {e1.key: pytest.approx(1.4), e2.key: 2.0},
         [e2.key]),
    ]
    assert result.primary.endpoints == (e2,)


def _random_scheduler(seed: int, eps: list[Endpoint]) -> Scheduler:
    rng = random.Random(seed)
    table = {e.key: rng.random() for e in eps}
    keep = {e.key for e in eps if rng.random() < 0.7} or {eps[0].key}
    return single(SchedulerProfile("p", [KeepFilter("f", keep)],
                                   [(FixedScorer("s", table), 2.0)], max_picker(2, seed)))


def test_the_decision_is_the_same_with_or_without_an_observer() -> None:
    eps = [ep(i) for i in range(1, 9)]
    for seed in range(20):
        plain = _random_scheduler(seed, eps).schedule(req(), eps)
        observed = _random_scheduler(seed, eps).schedule(req(), eps, RecordingObserver())
        assert plain == observed


def test_observer_sees_the_filter_that_empties_a_profile() -> None:
    e1 = ep(1)
    profile = SchedulerProfile("p", [KeepFilter("none", set()), KeepFilter("after", {e1.key})],
                               [(FixedScorer("s", {e1.key: 1.0}), 1.0)], max_picker())
    obs = RecordingObserver()
    state = CycleState()
    state[scheduler_mod.OBSERVER_KEY] = obs
    assert profile.run(state, req(), [e1]) is None
    assert obs.calls == [("profile_started", "p", [e1.key]),
                         ("filtered", "p", "none", [e1.key], [])]


def test_without_an_observer_nothing_is_reported_and_the_state_has_no_observer_key() -> None:
    profile, eps = _observed_profile()
    seen: list[CycleState] = []

    class StatePicker(MaxScorePicker):
        def pick(self, state: CycleState, scored: Sequence[ScoredEndpoint]) -> ProfileRunResult:
            seen.append(state)
            return super().pick(state, scored)

    profile.picker = StatePicker("max-score-picker", 1, rng=random.Random(0))
    single(profile).schedule(req(), eps)
    assert seen and scheduler_mod.OBSERVER_KEY not in seen[0]
