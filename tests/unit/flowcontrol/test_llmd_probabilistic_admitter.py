"""``probabilistic-admitter`` (llm-d-router v0.10.0
pkg/epp/framework/plugins/requestcontrol/admitter/probabilisticadmitter), case by case as
its plugin_test.go checks it."""

from __future__ import annotations

import random
from typing import Any

import pytest

from epp.errors import ConfigError, NoCapacity
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import AdmissionPlugin
from epp.framework.registry import Registry
from epp.scheduling.plugins.admitters import (
    ProbabilisticAdmitter,
    ProbabilisticAdmitterParameters,
)
from epp.scheduling.types import ApiType, Endpoint, LLMRequest, Metrics


def make(params: dict[str, Any] | None = None, name: str = "pa") -> Any:
    reg = Registry()
    reg.register_class(ProbabilisticAdmitter)
    return reg.builder("probabilistic-admitter", "t")(name, params, "plugins[0].parameters",
                                                      PluginHandle())


def endpoint(name: str, queue: int, kv: float) -> Endpoint:
    return Endpoint(name, "10.0.0.1", 8000,
                    metrics=Metrics(waiting_queue_size=queue, kv_cache_usage=kv))


def request(priority: int) -> LLMRequest:
    return LLMRequest(request_id="r", target_model="m", incoming_model="m",
                      api=ApiType.CHAT_COMPLETIONS, prompt="", headers={}, priority=priority)


def admitter(rand: float) -> ProbabilisticAdmitter:
    return ProbabilisticAdmitter("pa", rand=lambda: rand)


def test_factory_and_defaults() -> None:
    p = make(None, "my-admitter")
    assert isinstance(p, AdmissionPlugin)
    assert (p.type_name, p.name) == ("probabilistic-admitter", "my-admitter")
    assert (p.queue_depth_threshold, p.kv_cache_util_threshold, p.power, p.k) == (
        5.0, 0.8, 5.0, 300.0)
    p = make({"queueDepthThreshold": 10, "kvCacheUtilThreshold": 0.9, "power": 3, "k": 100})
    assert (p.queue_depth_threshold, p.kv_cache_util_threshold, p.power, p.k) == (
        10.0, 0.9, 3.0, 100.0)


@pytest.mark.parametrize(("params", "message"), [
    ({"queueDepthThreshold": 0}, "queueDepthThreshold: must be > 0, got 0"),
    ({"kvCacheUtilThreshold": 0}, "kvCacheUtilThreshold: must be > 0, got 0"),
    ({"power": -1}, "power: must be > 0, got -1"),
    ({"power": 0}, "power: must be > 0, got 0"),
    ({"k": -1}, "k: must be > 0, got -1"),
    ({"k": 0}, "k: must be > 0, got 0"),
    ({"power": "x"}, "power: expected a number"),
])
def test_factory_invalid(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make(params)


def test_protected_tiers_always_admitted() -> None:
    pods = [endpoint("p0", 100, 0)]
    for priority in (0, 100):
        assert admitter(0.0).admit_request(request(priority), pods) is None


def test_sheddable_rejected_at_high_saturation_with_429() -> None:
    # queue 100 / 5 → saturation 20 → probability 1.
    with pytest.raises(NoCapacity) as info:
        admitter(0.0).admit_request(request(-1), [endpoint("p0", 100, 0)])
    assert info.value.status == 429
    assert info.value.message == ("probabilistic-admitter: rejected, "
                                  "saturation=20.000 prob=1.00")


def test_sheddable_admitted_at_zero_saturation_and_without_pods() -> None:
    assert admitter(0.0).admit_request(request(-1), [endpoint("p0", 0, 0)]) is None
    assert admitter(0.0).admit_request(request(-1), []) is None


def test_saturation_averages_over_pods() -> None:
    # max(10/5, 0) = 2 and 0 → 1.0 → probability 1.
    pods = [endpoint("a", 10, 0), endpoint("b", 0, 0)]
    assert admitter(0.0).saturation(pods) == 1.0
    with pytest.raises(NoCapacity):
        admitter(0.0).admit_request(request(-1), pods)


def test_quintic_curve() -> None:
    # KV 0.272 / 0.8 = 0.34 → 0.34^5 · 300 ≈ 1.36 → 1: refused even at rand 0.999.
    p = admitter(0.999)
    assert p.shed_probability(0.272 / 0.8) == 1.0
    with pytest.raises(NoCapacity):
        p.admit_request(request(-1), [endpoint("p0", 0, 0.272)])
    assert p.shed_probability(0.15) == pytest.approx(0.0228, abs=1e-3)
    assert p.shed_probability(0.08) < 1e-3


def test_probabilistic_shedding() -> None:
    # KV 0.16 / 0.8 = 0.2 → 0.2^5 · 300 = 0.096.
    pods = [endpoint("p0", 0, 0.16)]
    assert admitter(0.9).admit_request(request(-1), pods) is None
    with pytest.raises(NoCapacity):
        admitter(0.0).admit_request(request(-1), pods)


def test_seeded_share_matches_the_probability() -> None:
    rng = random.Random(42)
    p = ProbabilisticAdmitter("pa", ProbabilisticAdmitterParameters(), rng.random)
    pods = [endpoint("p0", 0, 0.16)]
    refused = 0
    for _ in range(5000):
        try:
            p.admit_request(request(-1), pods)
        except NoCapacity:
            refused += 1
    assert refused / 5000 == pytest.approx(0.096, abs=0.015)
