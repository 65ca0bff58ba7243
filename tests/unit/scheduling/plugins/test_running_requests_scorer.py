"""running-requests-size-scorer: live running-request counts → scores (GIE / llm-d)."""

from __future__ import annotations

import pytest

from epp.config.loader import build, parse_config
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import decoding
from epp.framework.registry import builder_for
from epp.scheduling.plugins.scorers import RunningRequestsSizeScorer
from epp.scheduling.types import ApiType, CycleState, Endpoint, LLMRequest, Metrics


def ep(i: int, running: int) -> Endpoint:
    return Endpoint(f"p{i}", f"10.0.0.{i}", 8000, metrics=Metrics(running_requests=running))


def req() -> LLMRequest:
    return LLMRequest("r", "m", "m", ApiType.COMPLETIONS, "hi", {})


def score(*running: int) -> list[float]:
    s = RunningRequestsSizeScorer("running")
    return list(s.score(CycleState(), req(), [ep(i, r) for i, r in enumerate(running, 1)]))


def test_fewer_running_scores_higher_min_max_normalized() -> None:
    assert score(0, 5, 10) == [1.0, 0.5, 0.0]
    assert score(4, 8, 6) == [1.0, 0.0, 0.5]


def test_all_equal_or_single_is_one() -> None:
    assert score(3, 3, 3) == [1.0, 1.0, 1.0]
    assert score(7) == [1.0]


def test_relative_to_the_candidates() -> None:
    # Only the candidates of this cycle set the range.
    assert score(100, 101) == [1.0, 0.0]


def test_registered_and_parameterless() -> None:
    cfg = parse_config("plugins:\n- type: running-requests-size-scorer\n  name: running\n"
                       "schedulingProfiles:\n- name: default\n  plugins:\n"
                       "  - {pluginRef: running, weight: 2}\n")
    built = build(cfg)
    prof = built.scheduler.profiles["default"]
    assert [(s.type_name, w) for s, w in prof.scorers] == [("running-requests-size-scorer", 2.0)]
    with decoding(strict=True), pytest.raises(ConfigError, match="unknown parameter"):
        builder_for(RunningRequestsSizeScorer, "t")("x", {"k": 1}, "p", PluginHandle())
