"""Multi-node groups: `leader-filter` keeps a group's leader pod only (the per-role
autoscaling gauges: tests/unit/observability/test_metrics.py)."""

from __future__ import annotations

import pytest

from epp.config.loader import build, parse_config
from epp.errors import NoCapacity
from epp.scheduling.plugins.roles import LeaderFilter
from epp.scheduling.types import ApiType, CycleState, Endpoint, LLMRequest, Metrics
from tests.unit.scheduling.plugins.test_catalog import make, param_error

LWS = "leaderworkerset.sigs.k8s.io/worker-index"
PCSG_INDEX = "grove.io/podcliquescalinggroup-pod-index"


def ep(i: int, labels: dict[str, str], queue: int = 0, kv: float = 0.0,
       running: int = 0) -> Endpoint:
    return Endpoint(f"p{i}", f"10.0.0.{i}", 8000, labels=labels,
                    metrics=Metrics(waiting_queue_size=queue, kv_cache_usage=kv,
                                    running_requests=running))


def req() -> LLMRequest:
    return LLMRequest("r", "m", "m", ApiType.COMPLETIONS, "hi", {})


def names(eps: object) -> list[str]:
    return [e.name for e in eps]  # type: ignore[attr-defined]


def test_default_keeps_lws_leaders_and_single_pod_servers() -> None:
    f = make("leader-filter")
    assert isinstance(f, LeaderFilter)
    eps = [ep(1, {LWS: "0"}), ep(2, {LWS: "1"}), ep(3, {LWS: "2"}), ep(4, {}),
           ep(5, {PCSG_INDEX: "1"})]  # Grove index not configured: a single-pod server
    assert names(f.filter(CycleState(), req(), eps)) == ["p1", "p4", "p5"]


def test_grove_scaling_group_index_and_custom_leader() -> None:
    f = make("leader-filter", {"indexLabels": [PCSG_INDEX, LWS], "leaderIndex": 0})
    eps = [ep(1, {PCSG_INDEX: "0"}), ep(2, {PCSG_INDEX: "1"}), ep(3, {LWS: "0"}),
           ep(4, {LWS: "3"}), ep(5, {})]
    assert names(f.filter(CycleState(), req(), eps)) == ["p1", "p3", "p5"]
    g = make("leader-filter", {"indexLabels": ["rank"], "leaderIndex": "1"})
    assert names(g.filter(CycleState(), req(), [ep(1, {"rank": "0"}),
                                                 ep(2, {"rank": "1"})])) == ["p2"]


def test_bad_parameters() -> None:
    param_error("leader-filter", {"indexLabels": "x"}, "indexLabels")
    param_error("leader-filter", {"indexLabels": []}, "indexLabels")
    param_error("leader-filter", {"leaderIndex": ""}, "leaderIndex")
    param_error("leader-filter", {"selector": {}}, "selector")


def test_in_a_pd_config_workers_never_take_traffic() -> None:
    built = build(parse_config("""
plugins:
- type: disagg-profile-handler
- type: decode-filter
- type: prefill-filter
- type: leader-filter
- type: max-score-picker
schedulingProfiles:
- name: decode
  plugins: [{pluginRef: leader-filter}, {pluginRef: decode-filter}]
- name: prefill
  plugins: [{pluginRef: leader-filter}, {pluginRef: prefill-filter}]
""", "t.yaml"))
    role = "llm-d.ai/role"
    eps = [ep(1, {role: "decode", LWS: "0"}), ep(2, {role: "decode", LWS: "1"}),
           ep(3, {role: "prefill", LWS: "0"}), ep(4, {role: "prefill", LWS: "1"})]
    for _ in range(20):
        result = built.scheduler.schedule(req(), eps)
        assert result.profile_results["decode"].endpoints[0].name == "p1"
        assert result.profile_results["prefill"].endpoints[0].name == "p3"
    with pytest.raises(NoCapacity):  # only workers left: no decode endpoint
        built.scheduler.schedule(req(), [eps[1], eps[3]])


def test_unknown_plugin_parameter_names_the_path() -> None:
    param_error("leader-filter", {"matchLabels": {"a": "b"}},
                "plugins[0].parameters.matchLabels: unknown parameter")
