"""EppMetrics' scrape-time collectors (epp.observability.metrics): the per-role
autoscaling gauges."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epp.datastore.store import Datastore
from epp.observability.metrics import EppMetrics
from epp.scheduling.types import Endpoint, Metrics


def ep(i: int, labels: dict[str, str], queue: int = 0, kv: float = 0.0,
       running: int = 0) -> Endpoint:
    return Endpoint(f"p{i}", f"10.0.0.{i}", 8000, labels=labels,
                    metrics=Metrics(waiting_queue_size=queue, kv_cache_usage=kv,
                                    running_requests=running))


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
