"""llm-d-router v0.10.0's usage-limit policies, case by case as its tests check them
(pkg/epp/framework/plugins/flowcontrol/usagelimits/{softreflectiveceiling/policy_test.go,
priorityholdback/priority_holdback_test.go})."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from epp.errors import ConfigError
from epp.flowcontrol.interfaces import UsageLimitPolicy
from epp.flowcontrol.llmd import (
    LLMD_FLOW_CONTROL_PLUGINS,
    PriorityHoldbackPolicy,
    SoftReflectiveCeilingPolicy,
)
from epp.framework.handle import PluginHandle
from epp.framework.params import decoding
from epp.framework.registry import Registry


def make(type_name: str, params: dict[str, Any] | None = None, name: str = "x") -> Any:
    reg = Registry()
    for cls in LLMD_FLOW_CONTROL_PLUGINS:
        reg.register_class(cls)
    return reg.builder(type_name, "t")(name, params, "plugins[0].parameters", PluginHandle())


# ================================================================ soft reflective ceiling


def test_soft_reflective_factory() -> None:
    p = make("soft-reflective-ceiling-policy", None, "soft-reflective")
    assert isinstance(p, UsageLimitPolicy)
    assert (p.type_name, p.name) == ("soft-reflective-ceiling-policy", "soft-reflective")
    make("soft-reflective-ceiling-policy", {})  # an empty block is fine


def test_soft_reflective_takes_no_parameters() -> None:
    with decoding(strict=True), pytest.raises(ConfigError, match="threshold: unknown"):
        make("soft-reflective-ceiling-policy", {"threshold": 0.5})


def test_soft_reflective_no_bands_and_single_band() -> None:
    p = SoftReflectiveCeilingPolicy()
    assert list(p.compute_limit(0.9, [])) == []
    for sat in (0.0, 0.5, 0.99, 1.0):
        assert list(p.compute_limit(sat, [100])) == [1.0]


def test_soft_reflective_critical_band_never_gated() -> None:
    p = SoftReflectiveCeilingPolicy()
    for sat in (0.0, 0.3, 0.5, 0.7, 0.99, 1.0, 1.5):
        assert p.compute_limit(sat, [100, 0, -50])[0] == 1.0


def test_soft_reflective_below_ceiling_all_open() -> None:
    # N=3, saturation 0.3: reflective ceilings [1, 0.85, 0.70]; all above 0.3.
    assert list(SoftReflectiveCeilingPolicy().compute_limit(0.3, [100, 0, -50])) == [1.0] * 3


def test_soft_reflective_fully_saturated() -> None:
    assert list(SoftReflectiveCeilingPolicy().compute_limit(1.0, [100, 0, -50])) == [
        1.0, 0.0, 0.0]


def test_soft_reflective_formula() -> None:
    # N=4, saturation 0.7: reflective [1, 0.7667, 0.5333, 0.3]: band 1 open, 2-3 gated.
    got = list(SoftReflectiveCeilingPolicy().compute_limit(0.7, [100, 50, 0, -50]))
    assert got[:2] == [1.0, 1.0]
    assert all(c in (0.0, 1.0) for c in got[2:])


def test_soft_reflective_alternation() -> None:
    # N=2, saturation 0.7: period round(0.7/0.3) = 2 → closed, open, …
    p = SoftReflectiveCeilingPolicy()
    got = [p.compute_limit(0.7, [100, -50]) for _ in range(6)]
    assert [c[0] for c in got] == [1.0] * 6
    assert [c[1] for c in got] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]


def test_soft_reflective_alternation_longer_period() -> None:
    # saturation 0.75: period round(0.75/0.25) = 3.
    p = SoftReflectiveCeilingPolicy()
    assert [p.compute_limit(0.75, [100, -50])[1] for _ in range(6)] == [
        0.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_soft_reflective_tick_only_advances_in_the_alternating_regime() -> None:
    p = SoftReflectiveCeilingPolicy()
    p.compute_limit(0.3, [1, 0])  # below every ceiling: pure, no tick
    p.compute_limit(1.0, [1, 0])  # saturated: no tick
    assert p.tick == 0
    assert p.compute_limit(0.7, [1, 0])[1] == 0.0 and p.tick == 1


def test_soft_reflective_growing_priorities() -> None:
    p = SoftReflectiveCeilingPolicy()
    p.compute_limit(0.7, [100, -50])
    got = p.compute_limit(0.7, [100, 50, 0, -50])
    assert len(got) == 4 and got[0] == 1.0


def test_soft_reflective_no_starvation_under_rising_saturation() -> None:
    """Gated bands open together: one shared tick, so the dispatch loop (which stops at
    the first gated band) never starves a lower one."""
    p = SoftReflectiveCeilingPolicy()
    priorities = [100, 0, -50]
    for _ in range(3):
        p.compute_limit(0.6, priorities)
    band1 = band2 = 0
    for _ in range(100):
        got = p.compute_limit(0.7, priorities)
        band1 += got[1] == 1.0
        band2 += got[2] == 1.0
        assert not (got[2] == 1.0 and got[1] != 1.0)
    assert band1 == band2 > 0


# ================================================================ priority holdback


@pytest.mark.parametrize("params", [
    {"domain": "rank", "minCeiling": 0.5},
    {"domain": "value", "minCeiling": 0.3, "maxCeiling": 0.9},
    {"domain": "rank", "minCeiling": 0.2, "maxCeiling": 0.8},
    {"minCeiling": 0.5},
    {"shape": "linear", "minCeiling": 0.5},
    {"minCeiling": 0.0},
])
def test_priority_holdback_valid_configs(params: dict[str, Any]) -> None:
    p = make("priority-holdback-policy", params)
    assert isinstance(p, UsageLimitPolicy)
    assert p.min_ceiling == params["minCeiling"]
    assert p.max_ceiling == params.get("maxCeiling", 1.0)
    assert p.domain == params.get("domain", "rank")


@pytest.mark.parametrize(("params", "message"), [
    ({"domain": "rank"}, "minCeiling: is required"),
    ({}, "minCeiling: is required"),
    (None, "minCeiling: is required"),
    ({"shape": "sigmoid", "minCeiling": 0.5}, "shape: unsupported shape 'sigmoid'"),
    ({"domain": "unknown", "minCeiling": 0.5}, "domain: unsupported domain 'unknown'"),
    ({"minCeiling": -0.1}, r"minCeiling: must be in \[0.0, 1.0\), got -0.1"),
    ({"minCeiling": 1.0}, r"minCeiling: must be in \[0.0, 1.0\), got 1"),
    ({"minCeiling": 0.5, "maxCeiling": 0.0}, r"maxCeiling: must be in \(0.0, 1.0\]"),
    ({"minCeiling": 0.5, "maxCeiling": 1.1}, r"maxCeiling: must be in \(0.0, 1.0\]"),
    ({"minCeiling": 0.5, "maxCeiling": 0.5}, "must be strictly less than maxCeiling"),
    ({"minCeiling": 0.8, "maxCeiling": 0.5}, "must be strictly less than maxCeiling"),
    ({"minCeiling": "x"}, "minCeiling: expected a number"),
])
def test_priority_holdback_invalid_configs(params: dict[str, Any] | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        make("priority-holdback-policy", params)
    assert "plugins[0].parameters" in str(info.value)


def holdback(lo: float, hi: float, domain: str = "rank") -> PriorityHoldbackPolicy:
    return PriorityHoldbackPolicy("h", lo, hi, domain)


def test_priority_holdback_empty_and_single() -> None:
    assert list(holdback(0.5, 1.0).compute_limit(0.5, [])) == []
    for domain in ("rank", "value"):
        assert list(holdback(0.5, 1.0, domain).compute_limit(0.5, [7])) == [1.0]
    assert list(holdback(0.5, 0.9).compute_limit(0.5, [7])) == [0.9]


@pytest.mark.parametrize(("lo", "hi", "priorities", "want"), [
    (0.5, 1.0, [100, 10], [1.0, 0.5]),
    (0.5, 1.0, [100, 50, 10], [1.0, 0.75, 0.5]),
    (0.5, 1.0, [100, 75, 50, 10], [1.0, 0.8333333, 0.6666666, 0.5]),
    (0.5, 1.0, [1000, 2, 1], [1.0, 0.75, 0.5]),  # rank ignores the values
    (0.0, 1.0, [10, 5, 1], [1.0, 0.5, 0.0]),
    (0.8, 0.9, [10, 5, 1], [0.9, 0.85, 0.8]),
])
def test_priority_holdback_rank(lo: float, hi: float, priorities: list[int],
                                want: list[float]) -> None:
    assert holdback(lo, hi).compute_limit(0.0, priorities) == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize(("lo", "hi", "priorities", "want"), [
    (0.5, 1.0, [100, 10], [1.0, 0.5]),
    (0.5, 1.0, [90, 50, 10], [1.0, 0.75, 0.5]),
    (0.5, 1.0, [100, 50, 10], [1.0, 0.7222222, 0.5]),
    (0.5, 1.0, [100, 2, 1], [1.0, 0.505050, 0.5]),
    (0.5, 1.0, [10, 10, 10], [1.0, 1.0, 1.0]),
    (0.5, 1.0, [100, 10, 10], [1.0, 0.5, 0.5]),
    (0.0, 1.0, [10, 5, 1], [1.0, 4 / 9, 0.0]),
])
def test_priority_holdback_value(lo: float, hi: float, priorities: list[int],
                                 want: list[float]) -> None:
    assert holdback(lo, hi, "value").compute_limit(0.0, priorities) == pytest.approx(
        want, abs=1e-5)


def test_priority_holdback_monotone_and_domains() -> None:
    for domain in ("rank", "value"):
        c = holdback(0.2, 0.9, domain).compute_limit(0.0, [50, 40, 30, 20, 10])
        assert all(a >= b for a, b in itertools.pairwise(c))
    # Evenly spaced priorities: both domains agree; skewed ones: they diverge.
    even = [100, 55, 10]
    assert holdback(0.5, 1.0).compute_limit(0, even) == pytest.approx(
        holdback(0.5, 1.0, "value").compute_limit(0, even))
    skew = [100, 2, 1]
    rank = holdback(0.5, 1.0).compute_limit(0, skew)
    value = holdback(0.5, 1.0, "value").compute_limit(0, skew)
    assert value[1] < 0.51 and rank[1] - value[1] > 0.2
