"""Multi-node groups (`leader-filter`) and the per-role autoscaling gauges."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epp.config.loader import build, parse_config
from epp.datastore.store import Datastore
from epp.errors import ConfigError, NoCapacity
from epp.observability.metrics import EppMetrics
from epp.scheduling.plugins.roles import LeaderFilter
from epp.scheduling.types import ApiType, CycleState, Endpoint, LLMRequest, Metrics
from tests.unit.test_catalog import make, param_error

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


def _samples(m: EppMetrics) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        if fam.name.startswith("epp_role_"):
            for s in fam.samples:
                out[(s.name, s.labels["role"])] = s.value
                assert s.labels["name"] == "pool-a"
    return out


def test_per_role_gauges_are_computed_at_scrape_time() -> None:
    store = Datastore()
    m = EppMetrics(store, "pool-a")
    s = _samples(m)
    assert s[("epp_role_ready_pods", "prefill")] == 0
    assert s[("epp_role_average_queue_size", "decode")] == 0
    role = "llm-d.ai/role"
    store.set_endpoints([
        ep(1, {role: "prefill"}, queue=4, kv=0.2, running=2),
        ep(2, {role: "Prefill"}, queue=2, kv=0.4, running=4),
        ep(3, {role: "decode"}, queue=1, kv=0.9, running=10),
        ep(4, {"nvidia.com/dynamo-sub-component-type": "decode"}, queue=3, kv=0.5, running=6),
        ep(5, {}, queue=7),
    ])
    s = _samples(m)
    assert s[("epp_role_ready_pods", "prefill")] == 2
    assert s[("epp_role_average_queue_size", "prefill")] == 3
    assert s[("epp_role_average_kv_cache_utilization", "prefill")] == pytest.approx(0.3)
    assert s[("epp_role_average_running_requests", "prefill")] == 3
    assert s[("epp_role_ready_pods", "decode")] == 2
    assert s[("epp_role_average_queue_size", "decode")] == 2
    assert s[("epp_role_average_kv_cache_utilization", "decode")] == pytest.approx(0.7)
    assert s[("epp_role_average_queue_size", "unlabelled")] == 7
    store.set_endpoints([])
    assert _samples(m)[("epp_role_ready_pods", "decode")] == 0


def test_unknown_plugin_parameter_names_the_path() -> None:
    with pytest.raises(ConfigError, match="plugins\\[0\\].parameters"):
        make("leader-filter", {"matchLabels": {"a": "b"}})
