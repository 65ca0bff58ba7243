"""The latency-predictor plugins inside the scheduling core (epp/requestcontrol/director.py):
PrepareData before scheduling within GIE's 400 ms budget, admission, training from the
front's measurements, and the five predictor metrics (GIE's names, labels, buckets)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epp.config.loader import BuiltConfig, build, parse_config
from epp.datastore.store import Datastore
from epp.errors import EppError
from epp.framework.interfaces import (
    AdmissionPlugin,
    PrepareDataPlugin,
    ResponseMeasured,
)
from epp.observability.metrics import EppMetrics
from epp.observability.observer import ResponseStats
from epp.parsing.usage import Usage
from epp.requestcontrol.director import LocalCore, SchedulingCore
from epp.scheduling.plugins.latency_monolith import PredictedLatencyScorer
from epp.scheduling.plugins.latency_producer import PredictedLatencyProducer
from epp.scheduling.types import ApiType, Endpoint, LLMRequest, Metrics
from tests.unit.scheduling.test_latency_plugins import StubPredictor

CHART = """
plugins:
- type: predicted-latency-producer
  parameters: {streamingMode: true}
- type: latency-scorer
- type: max-score-picker
- type: slo-headroom-tier-filter
  parameters: {epsilonExploreNeg: 0}
- type: latency-slo-admitter
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: slo-headroom-tier-filter
  - pluginRef: latency-scorer
  - pluginRef: max-score-picker
"""


def endpoints() -> list[Endpoint]:
    return [Endpoint(f"pod{i}", f"10.0.0.{i}", 8000,
                     metrics=Metrics(waiting_queue_size=i, running_requests=2, kv_cache_usage=0.5,
                                     updated_at=1.0))
            for i in (1, 2, 3)]


def core_for(text: str, stub: StubPredictor) -> tuple[SchedulingCore, BuiltConfig]:
    built = build(parse_config(text, "t.yaml"))
    for p in built.plugins.values():
        if isinstance(p, (PredictedLatencyProducer, PredictedLatencyScorer)):
            p.predictor = p.tracker.predictor = stub
    store = Datastore()
    store.set_endpoints(endpoints())
    plugins = list(built.plugins.values())
    core = SchedulingCore(
        store, built.scheduler, EppMetrics(store), built.pre_request, built.response_complete,
        prepare_data=[p for p in plugins if isinstance(p, PrepareDataPlugin)],
        admission=[p for p in plugins if isinstance(p, AdmissionPlugin)],
        response_measured=[p for p in plugins if isinstance(p, ResponseMeasured)])
    return core, built


def request(headers: dict[str, str] | None = None, priority: int = 0,
            rid: str = "r") -> LLMRequest:
    r = LLMRequest(rid, "target", "incoming", ApiType.COMPLETIONS, "a b c d", headers or {})
    r.priority = priority
    return r


def samples(core: SchedulingCore, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = generate_latest(core.metrics.registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


LABELS = (("model_name", "incoming"), ("target_model_name", "target"))


async def test_predictions_route_and_the_metrics_follow() -> None:
    stub = StubPredictor()  # TTFT 100 + 10 × waiting, TPOT 10 + running
    core, _ = core_for(CHART, stub)
    local = LocalCore(core)
    d = await local.decide(request({"x-slo-ttft-ms": "115", "x-slo-tpot-ms": "20"}), None)
    # pod1 (110 ms) is the only one within the TTFT SLO.
    assert d.destination == "10.0.0.1:8000"
    assert len(stub.rows) == 1 and len(stub.rows[0]) == 3
    assert samples(core, "inference_objective_request_ttft_prediction_duration_seconds_count") \
        == {LABELS: 1.0}
    assert samples(core, "inference_objective_request_tpot_prediction_duration_seconds_count") \
        == {LABELS: 1.0}
    # The response: first chunk at 150 ms (> 115: a TTFT violation), 15 ms per token.
    local.complete(d.ticket, 200, False, Usage(4, 21, None), ResponseStats(500, 0.15, 0.015))
    assert samples(core, "inference_objective_request_predicted_ttft_seconds_sum") == \
        {LABELS: pytest.approx(0.11)}
    assert samples(core, "inference_objective_request_predicted_tpot_seconds_sum") == \
        {LABELS: pytest.approx(0.012)}
    assert samples(core, "inference_objective_request_slo_violation_total") == \
        {(*LABELS, ("type", "ttft")): 1.0}
    gauge = samples(core, "inference_objective_inference_request_metric")
    assert gauge[(*LABELS, ("type", "ttft_slo_violation"))] == 1.0
    assert gauge[(*LABELS, ("type", "tpot_slo_violation"))] == 0.0
    assert gauge[(*LABELS, ("type", "predicted_ttft"))] == pytest.approx(0.11)
    # Trained: one TTFT row (150 ms) and one TPOT row (15 ms), pod1's inputs.
    assert [(e.actual_ttft_ms, e.actual_tpot_ms) for e in stub.training] == [
        (pytest.approx(150.0), 0.0), (0.0, pytest.approx(15.0))]


async def test_admission_refuses_with_gies_error() -> None:
    core, _ = core_for(CHART, StubPredictor())
    local = LocalCore(core)
    # Everything busy (scraped running requests), nothing cold, nothing within 50 ms.
    with pytest.raises(EppError) as info:
        await local.decide(request({"x-slo-ttft-ms": "50"}, priority=-1), None)
    assert (info.value.status, info.value.message) == (500, "request cannot be admitted")
    assert samples(core, "inference_objective_request_error_total") == {
        (("error_code", "Internal"), ("model_name", "incoming"),
         ("target_model_name", "target")): 1.0}
    # Its prediction was made and is counted, as GIE counts it.
    assert samples(core, "inference_objective_request_ttft_prediction_duration_seconds_count") \
        == {LABELS: 1.0}
    # The same request, not sheddable, goes through.
    d = await local.decide(request({"x-slo-ttft-ms": "50"}, priority=0, rid="r2"), None)
    assert d.destination.startswith("10.0.0.")


async def test_a_slow_predictor_is_cut_off_after_gies_400_ms() -> None:
    stub = StubPredictor(delay_s=5.0)
    core, built = core_for(CHART, stub)
    t0 = time.monotonic()
    d = await LocalCore(core).decide(request({"x-slo-ttft-ms": "115"}), None)
    assert time.monotonic() - t0 < 2.0
    assert d.destination.startswith("10.0.0.")
    producer = built.plugins["predicted-latency-producer"]
    assert isinstance(producer, PredictedLatencyProducer)
    assert producer.running_requests() == {}  # no context: nothing tracked, as GIE
    core.complete(d.ticket, 200, False, None, ResponseStats(10, 0.1, None))


class Exploding:
    type_name = "exploding"
    name = "exploding"

    async def prepare_request_data(self, request: LLMRequest,
                                   endpoints: Sequence[Endpoint]) -> None:
        raise RuntimeError("bug")


async def test_a_failing_prepare_data_plugin_does_not_fail_the_request(
        caplog: pytest.LogCaptureFixture) -> None:
    core, _ = core_for(CHART, StubPredictor())
    core.prepare_data = (Exploding(), *core.prepare_data)
    d = await LocalCore(core).decide(request(), None)
    assert d.destination.startswith("10.0.0.")
    assert "PrepareData plugin exploding failed" in caplog.text


async def test_no_prepare_data_plugins_no_suspension() -> None:
    core, _ = core_for("plugins:\n- type: queue-scorer\n", StubPredictor())
    assert core.prepare_data == ()
    coro = core.decide_prepared(request(), None)
    # It finishes at the first step: nothing awaited.
    with pytest.raises(StopIteration):
        coro.send(None)


async def test_aborted_and_unseen_responses_train_nothing_but_are_cleaned_up() -> None:
    stub = StubPredictor()
    core, built = core_for(CHART, stub)
    producer = built.plugins["predicted-latency-producer"]
    assert isinstance(producer, PredictedLatencyProducer)
    local = LocalCore(core)
    a = await local.decide(request(rid="a"), None)
    b = await local.decide(request(rid="b"), None)
    assert sum(producer.running_requests().values()) == 2
    local.complete(a.ticket, 200, True, None, ResponseStats(10, 0.1, 0.01))  # aborted
    local.complete(b.ticket, 200, False, None, None)  # the body did not pass the EPP
    assert stub.training == [] and producer.running_requests() == {}
