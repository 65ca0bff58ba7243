"""GIE's latency-predictor plugins: ``latency-scorer``, ``slo-headroom-tier-filter``,
``latency-slo-admitter``, ``predicted-latency-producer`` and ``predicted-latency-scorer``
(issue 14). Cases follow GIE v1.5.0's plugins and their *_test.go files; predictions come
from a stub predictor so each decision follows from given numbers."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.config.loader import BuiltConfig, build, load_and_build, parse_config
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import ResponseTimings
from epp.latency.online import OnlinePredictor
from epp.latency.sampler import DecodeTokenSampler, fnv64a
from epp.latency.tracking import RunningRequests
from epp.latency.types import (
    BulkPredictionResponse,
    LatencyOutcome,
    LatencyPredictionInfo,
    PredictionRequest,
    PredictionResponse,
    PredictorError,
    TrainingEntry,
    prediction_infos,
    set_prediction_infos,
)
from epp.scheduling.plugins.latency_admitter import LatencySloAdmitter
from epp.scheduling.plugins.latency_filter import SloHeadroomTierFilter
from epp.scheduling.plugins.latency_monolith import (
    PredictedLatencyScorer,
    PredictedLatencyScorerParameters,
)
from epp.scheduling.plugins.latency_producer import (
    PredictedLatencyProducer,
    PredictedLatencyProducerParameters,
)
from epp.scheduling.plugins.latency_scorer import LatencyScorer, LatencyScorerParameters
from epp.scheduling.types import (
    ApiType,
    CycleState,
    Endpoint,
    LLMRequest,
    Metrics,
    ProfileRunResult,
    SchedulingResult,
)

# ----------------------------------------------------------------------------- helpers


def ep(name: str, kv: float = 0.5, queue: int = 0, running: int = 0,
       **labels: str) -> Endpoint:
    n = int("".join(c for c in name if c.isdigit()) or "1")
    return Endpoint(name, f"10.0.0.{n}", 8000, labels=labels,
                    metrics=Metrics(waiting_queue_size=queue, running_requests=running,
                                    kv_cache_usage=kv, updated_at=1.0))


def req(headers: dict[str, str] | None = None, priority: int = 0, rid: str = "r1",
        prompt: str = "one two three four five") -> LLMRequest:
    r = LLMRequest(request_id=rid, target_model="m", incoming_model="m",
                   api=ApiType.COMPLETIONS, prompt=prompt, headers=headers or {})
    r.priority = priority
    return r


def with_infos(request: LLMRequest, infos: dict[Endpoint, LatencyPredictionInfo]
               ) -> LLMRequest:
    set_prediction_infos(request, {e.key: i for e, i in infos.items()})
    return request


def info(ttft_valid: bool, tpot_valid: bool, ttft_h: float, tpot_h: float, ttft: float,
         tpot: float, dispatched: int = 0) -> LatencyPredictionInfo:
    return LatencyPredictionInfo(ttft_valid, tpot_valid, ttft_h, tpot_h, ttft, tpot,
                                 dispatched)


class StubPredictor:
    """Predicts from a function of the row; records training rows."""

    kind = "stub"

    def __init__(self, fn: Callable[[PredictionRequest], tuple[float, float]] | None = None,
                 fail: bool = False, delay_s: float = 0.0) -> None:
        self.fn = fn or (lambda r: (100.0 + 10 * r.num_request_waiting,
                                    10.0 + r.num_request_running))
        self.fail = fail
        self.delay_s = delay_s
        self.rows: list[list[PredictionRequest]] = []
        self.local: list[PredictionRequest] = []
        self.training: list[TrainingEntry] = []

    async def predict_bulk_strict(
            self, requests: Sequence[PredictionRequest]) -> BulkPredictionResponse:
        self.rows.append(list(requests))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # a slow predictor (the test is about timing)
        if self.fail:
            raise PredictorError("models not ready")
        return BulkPredictionResponse(tuple(PredictionResponse(*self.fn(r)) for r in requests))

    def predict_local(self, request: PredictionRequest) -> PredictionResponse | None:
        self.local.append(request)
        return PredictionResponse(*self.fn(request))

    def add_training_data_bulk(self, entries: Sequence[TrainingEntry]) -> None:
        self.training.extend(entries)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


def result_for(target: Endpoint, prefill: Endpoint | None = None) -> SchedulingResult:
    results: dict[str, ProfileRunResult | None] = {"default": ProfileRunResult((target,))}
    if prefill is not None:
        results["prefill"] = ProfileRunResult((prefill,))
    return SchedulingResult(results, "default")


def producer(predictor: StubPredictor | None = None, **params: Any) -> PredictedLatencyProducer:
    return PredictedLatencyProducer("p", PredictedLatencyProducerParameters(**params),
                                    predictor or StubPredictor())


def built(text: str) -> BuiltConfig:
    return build(parse_config(text, "t.yaml"))


# ====================================================================== latency-scorer


def scores(scorer: LatencyScorer, request: LLMRequest, eps: Sequence[Endpoint]) -> list[float]:
    return list(scorer.score(CycleState(), request, eps))


def test_scorer_positive_headroom() -> None:
    a, b = ep("pod1", 0.3, 0, 5), ep("pod2", 0.5, 0, 8)
    r = with_infos(req(), {a: info(True, True, 100, 20, 50, 10),
                           b: info(True, True, 30, 5, 120, 25)})
    s1, s2 = scores(LatencyScorer("s"), r, [a, b])
    assert s1 > 0 and s2 > 0


def test_scorer_least_prefers_the_tightest_fit_most_the_most_headroom() -> None:
    a, b = ep("ep1", 0.3, 0, 5), ep("ep2", 0.5, 0, 8)
    r = with_infos(req(), {a: info(True, True, 10, 2, 90, 28), b: info(True, True, 50, 10, 50,
                                                                          20)})
    least = scores(LatencyScorer("s"), r, [a, b])
    assert least[0] > least[1]
    assert least == [1.01, 0.01]  # int((1 − blend) × 100) + 1 hundredths, as GIE
    most = scores(LatencyScorer("s", LatencyScorerParameters(headroom_selection_strategy="most")),
                  r, [a, b])
    assert most[1] > most[0]


def test_scorer_negative_only_prefers_the_smaller_violation() -> None:
    a, b = ep("pod1", 0.5, 0, 5), ep("pod2", 0.6, 0, 8)
    r = with_infos(req(), {a: info(False, False, -10, -5, 110, 35, 1),
                           b: info(False, False, -100, -30, 200, 60, 1)})
    s1, s2 = scores(LatencyScorer("s"), r, [a, b])
    assert s1 > s2 > 0
    # "most" is never used for negative headroom.
    most = LatencyScorer("s", LatencyScorerParameters(headroom_selection_strategy="most"))
    assert scores(most, r, [a, b]) == [s1, s2]


def test_scorer_mixed_tiers_score_only_the_positive_ones() -> None:
    a, b, c = ep("pod1"), ep("pod2"), ep("pod3")
    r = with_infos(req(), {a: info(True, True, 10, 0, 90, 0), b: info(False, True, -5, 0, 105, 0),
                           c: info(True, True, 40, 0, 60, 0)})
    got = scores(LatencyScorer("s"), r, [a, b, c])
    assert got[1] == 0.0 and got[0] > got[2] > 0


def test_scorer_idle_pods_absorb_traffic_first() -> None:
    busy, idle = ep("pod1", running=5), ep("pod2", running=0)
    r = with_infos(req(), {busy: info(False, False, -50, -10, 150, 40, 5),
                           idle: info(False, False, -50, -10, 150, 40, 0)})
    s_busy, s_idle = scores(LatencyScorer("s"), r, [busy, idle])
    assert s_idle > 0 and s_busy == 0


def test_scorer_hierarchical_buckets() -> None:
    both, ttft_neg, tpot_neg = ep("pod1"), ep("pod2"), ep("pod3")
    eps = [both, ttft_neg, tpot_neg]
    # All idle (no dispatch counts, as GIE's test): every one is scored.
    r = with_infos(req(), {both: info(False, False, -50, -10, 150, 40),
                           ttft_neg: info(False, True, -30, 5, 130, 25),
                           tpot_neg: info(True, False, 10, -8, 90, 38)})
    assert all(s > 0 for s in scores(LatencyScorer("s"), r, eps))
    # All busy: only the least severe bucket (TPOT-only violations) is scored.
    r = with_infos(req(), {both: info(False, False, -50, -10, 150, 40, 2),
                           ttft_neg: info(False, True, -30, 5, 130, 25, 2),
                           tpot_neg: info(True, False, 10, -8, 90, 38, 2)})
    assert scores(LatencyScorer("s"), r, eps) == [0.0, 0.0, 0.51]  # alone: 0.5 → 51
    # Without it, TTFT-only before both.
    r = with_infos(req(), {both: info(False, False, -50, -10, 150, 40, 2),
                           ttft_neg: info(False, True, -30, 5, 130, 25, 2)})
    assert scores(LatencyScorer("s"), r, eps[:2]) == [0.0, 0.51]


def test_scorer_zero_range_dimension_gets_no_weight() -> None:
    a, b, c = ep("pod1"), ep("pod2"), ep("pod3")
    # Same TTFT headroom everywhere: the TPOT headroom alone decides (weight 1).
    r = with_infos(req(), {a: info(True, True, 10, 1, 0, 0), b: info(True, True, 10, 3, 0, 0),
                           c: info(True, True, 10, 5, 0, 0)})
    assert scores(LatencyScorer("s"), r, [a, b, c]) == [1.01, 0.51, 0.01]


def test_scorer_composite_fallback_without_predictions() -> None:
    a, b = ep("pod1", 0.2, 0, 3), ep("pod2", 0.8, 5, 10)
    s1, s2 = scores(LatencyScorer("s"), req(), [a, b])
    assert s1 > s2
    # (kv free 0.8 + relative queue 1 + prefix 0) / 3 → round(60.0) hundredths.
    assert (s1, s2) == (0.6, 0.07)
    kv_only = LatencyScorer("s", LatencyScorerParameters(
        composite_kv_weight=0, composite_queue_weight=0, composite_prefix_weight=0))
    assert scores(kv_only, req(), [a, b]) == [0.8, 0.2]


def test_scorer_composite_uses_the_prefix_producer() -> None:
    cfg = built("""
plugins:
- type: approx-prefix-cache-producer
  parameters: {blockSizeTokens: 1}
- type: latency-scorer
  parameters: {compositeKVWeight: 0, compositeQueueWeight: 0}
""")
    scorer = cfg.plugins["latency-scorer"]
    prefix = cfg.plugins["approx-prefix-cache-producer"]
    a, b = ep("pod1"), ep("pod2")
    warm = req(prompt="x" * 64)
    prefix.pre_request(warm, result_for(a))  # type: ignore[attr-defined]
    assert isinstance(scorer, LatencyScorer)
    assert scores(scorer, req(prompt="x" * 64, rid="r2"), [a, b]) == [1.0, 0.0]


# ============================================================ slo-headroom-tier-filter


def tier(eps_neg: float, request: LLMRequest, eps: list[Endpoint]) -> list[str]:
    f = SloHeadroomTierFilter("f", eps_neg)
    return [e.name for e in f.filter(CycleState(), request, eps)]


def test_filter_single_endpoint_and_no_predictions_keep_all() -> None:
    a, b = ep("pod1"), ep("pod2")
    assert tier(0, req(), [a]) == ["pod1"]
    assert tier(0, req(), [a, b]) == ["pod1", "pod2"]


def test_filter_one_tier_is_kept_whole() -> None:
    a, b = ep("pod1"), ep("pod2")
    pos = with_infos(req(), {a: info(True, True, 10, 5, 0, 0), b: info(True, True, 0, 0, 0, 0)})
    assert tier(0, pos, [a, b]) == ["pod1", "pod2"]
    neg = with_infos(req(), {a: info(False, True, -1, 5, 0, 0), b: info(True, False, 3, -2, 0, 0)})
    assert tier(1, neg, [a, b]) == ["pod1", "pod2"]


def test_filter_both_tiers_positive_unless_exploring() -> None:
    a, b, c = ep("pod1"), ep("pod2"), ep("pod3")
    r = with_infos(req(), {a: info(True, True, 10, 5, 0, 0), b: info(True, True, 20, 1, 0, 0),
                           c: info(False, False, -10, -5, 0, 0)})
    assert tier(0, r, [a, b, c]) == ["pod1", "pod2"]
    assert tier(1.0, r, [a, b, c]) == ["pod3"]
    f = SloHeadroomTierFilter("f", 0.25, rng=random.Random(7))
    picks = [len(f.filter(CycleState(), r, [a, b, c])) for _ in range(400)]
    assert 60 < picks.count(1) < 140  # ~25 % explore the negative tier


def test_filter_endpoints_without_prediction_join_the_negative_tier() -> None:
    a, b = ep("pod1"), ep("pod2")
    r = with_infos(req(), {a: info(True, True, 10, 5, 0, 0)})
    assert tier(1.0, r, [a, b]) == ["pod2"]
    assert tier(0.0, r, [a, b]) == ["pod1"]


def test_filter_epsilon_must_be_a_probability() -> None:
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.epsilonExploreNeg: "
                                          r"must be in \[0, 1\], got 1.5"):
        built("plugins:\n- type: slo-headroom-tier-filter\n  parameters: "
              "{epsilonExploreNeg: 1.5}\n")
    f = built("plugins:\n- type: slo-headroom-tier-filter\n").plugins["slo-headroom-tier-filter"]
    assert isinstance(f, SloHeadroomTierFilter) and f.epsilon_explore_neg == 0.01


# ================================================================ latency-slo-admitter

SLOS = {"x-slo-ttft-ms": "100", "x-slo-tpot-ms": "30"}


@pytest.mark.parametrize(("name", "priority", "headers", "endpoints", "infos", "admit"), [
    ("non-sheddable: always admitted", 1, SLOS, [("pod1", 0.5, 5)],
     [info(False, False, -50, -10, 150, 40)], True),
    ("no SLO headers: admitted", -1, {}, [("pod1", 0.5, 5)],
     [info(False, False, -50, -10, 150, 40)], True),
    ("all invalid, all busy, none cold: refused", -1, SLOS, [("pod1", 0.5, 5), ("pod2", 0.4, 3)],
     [info(False, False, -50, -10, 150, 40), info(False, False, -30, -5, 130, 35)], False),
    ("one pod idle: admitted", -1, SLOS, [("pod1", 0.5, 5), ("pod2", 0.4, 0)],
     [info(False, False, -50, -10, 150, 40), info(False, False, -30, -5, 130, 35)], True),
    ("a cold pod: admitted", -1, SLOS, [("pod1", 0.5, 5), ("pod2", 0.01, 3)],
     [info(False, False, -50, -10, 150, 40), info(False, False, -30, -5, 130, 35)], True),
    ("one valid endpoint: admitted", -1, SLOS, [("pod1", 0.5, 5), ("pod2", 0.4, 3)],
     [info(False, False, -50, -10, 150, 40), info(True, True, 20, 5, 80, 25)], True),
    ("no predictions: fail open", -1, SLOS, [("pod1", 0.5, 5)], [], True),
    ("TTFT SLO alone counts", -1, {"x-slo-ttft-ms": "100"}, [("pod1", 0.5, 5)],
     [info(False, True, -50, 0, 150, 0)], False),
    ("unparsable SLO header is no SLO", -1, {"x-slo-ttft-ms": "fast"}, [("pod1", 0.5, 5)],
     [info(False, True, -50, 0, 150, 0)], True),
])
def test_admitter(name: str, priority: int, headers: dict[str, str],
                  endpoints: list[tuple[str, float, int]], infos: list[LatencyPredictionInfo],
                  admit: bool) -> None:
    eps = [ep(n, kv, running=running) for n, kv, running in endpoints]
    r = with_infos(req(headers, priority), dict(zip(eps, infos, strict=False)))
    reason = LatencySloAdmitter("a").admit_request(r, eps)
    assert (reason is None) is admit, name
    if not admit:
        assert reason == "no valid endpoint available to serve the request"


# ========================================================== predicted-latency-producer


def test_producer_parameters_are_gies() -> None:
    p = built("plugins:\n- type: predicted-latency-producer\n").plugins[
        "predicted-latency-producer"]
    assert isinstance(p, PredictedLatencyProducer)
    assert p.params == PredictedLatencyProducerParameters(1000.0, 0, 1.0, 300.0, False, "", True)
    assert isinstance(p.predictor, OnlinePredictor)  # no sidecar in the environment
    text = """plugins:
- type: predicted-latency-producer
  parameters: {samplingMean: 50, maxDecodeTokenSamplesForPrediction: 3, sloBufferFactor: 0.9,
               contextTTL: 60000000000, streamingMode: true, endpointRoleLabel: llm-d.ai/role,
               predictInPrepareData: false}
"""
    q = built(text).plugins["predicted-latency-producer"]
    assert isinstance(q, PredictedLatencyProducer)
    assert q.params == PredictedLatencyProducerParameters(50.0, 3, 0.9, 60.0, True,
                                                          "llm-d.ai/role", False)
    assert q.response_needs == frozenset({"body"})


@pytest.mark.parametrize(("params", "error"), [
    ("{samplingMean: 0}", "samplingMean: must be > 0, got 0"),
    ("{maxDecodeTokenSamplesForPrediction: -1}",
     "maxDecodeTokenSamplesForPrediction: must be >= 0, got -1"),
    ("{sloBufferFactor: 0}", "sloBufferFactor: must be > 0, got 0"),
    ("{samplingMean: fast}", "samplingMean: expected a number"),
    ("{maxDecodeTokenSamplesForPrediction: 1.5}", "expected an integer"),
    ("{contextTTL: forever}", "contextTTL: expected nanoseconds"),
])
def test_producer_rejects_what_gie_rejects(params: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        built(f"plugins:\n- type: predicted-latency-producer\n  parameters: {params}\n")


@pytest.mark.parametrize(("value", "seconds"), [
    (300_000_000_000, 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), ("0", 0.0)])
def test_context_ttl_is_a_go_duration(value: object, seconds: float) -> None:
    text = f"plugins:\n- type: predicted-latency-producer\n  parameters: {{contextTTL: {value!r}}}\n"
    p = built(text.replace("'", '"')).plugins["predicted-latency-producer"]
    assert isinstance(p, PredictedLatencyProducer) and p.params.context_ttl_s == seconds


async def test_producer_publishes_predictions_with_headroom_and_dispatch_counts() -> None:
    stub = StubPredictor()
    p = producer(stub, streaming_mode=True)
    a, b = ep("pod1", queue=0, running=1), ep("pod2", queue=3, running=4)
    first = req({"x-slo-ttft-ms": "120", "x-slo-tpot-ms": "12"}, rid="first")
    await p.prepare_request_data(first, [a, b])
    p.pre_request(first, result_for(a))
    r = req({"x-slo-ttft-ms": "120", "x-slo-tpot-ms": "12"}, rid="second")
    await p.prepare_request_data(r, [a, b])
    infos = prediction_infos(r)
    # a: TTFT 100 < 120, TPOT 11 < 12; b: TTFT 130, TPOT 14 — both violated.
    assert infos[a.key] == LatencyPredictionInfo(True, True, 20.0, 1.0, 100.0, 11.0, 1)
    assert infos[b.key] == LatencyPredictionInfo(False, False, -10.0, -2.0, 130.0, 14.0, 0)
    # GIE's inputs: words of the prompt, generated tokens 1, prefill tokens in flight.
    row_a = stub.rows[-1][0]
    assert (row_a.input_token_length, row_a.num_tokens_generated, row_a.kv_cache_percentage,
            row_a.prefill_tokens_in_flight) == (5, 1, 0.5, 5)
    durations = r.plugin_state["latency.prediction-durations"]
    assert [k for k, _ in durations] == ["ttft", "tpot"]


@pytest.mark.parametrize(("name", "ttft_slo", "tpot_slo", "pod_min", "pred", "want"), [
    ("both within SLO", 100, 30, 0, (80, 25), (True, True, True, 5.0, 20.0)),
    ("TTFT exceeds SLO", 100, 30, 0, (120, 25), (False, True, False, 5.0, -20.0)),
    ("TPOT exceeds SLO", 100, 30, 0, (80, 35), (True, False, False, -5.0, 20.0)),
    ("running requests' min TPOT SLO tightens it", 100, 30, 20, (80, 25),
     (True, False, False, -5.0, 20.0)),
])
def test_validate_prediction_streaming(name: str, ttft_slo: float, tpot_slo: float,
                                       pod_min: float, pred: tuple[float, float],
                                       want: tuple[bool, bool, bool, float, float]) -> None:
    p = producer(streaming_mode=True)
    ctx = p.tracker.new_context(req())
    ctx.ttft_slo, ctx.tpot_slo = ttft_slo, tpot_slo
    assert p.tracker.validate(PredictionResponse(*pred), ctx, pod_min) == want, name


async def test_tpot_is_neutralized_outside_streaming_and_on_prefill_pods() -> None:
    slos = {"x-slo-ttft-ms": "200", "x-slo-tpot-ms": "5"}
    a = ep("pod1", running=20)  # predicted TPOT 30 > 5
    r = req(slos)
    await producer().prepare_request_data(r, [a])
    assert prediction_infos(r)[a.key].tpot_valid and prediction_infos(r)[a.key].tpot_headroom == 0
    prefill, decode = ep("pod1", running=20, role="prefill"), ep("pod2", running=20, role="decode")
    r = req(slos)
    await producer(streaming_mode=True, endpoint_role_label="role").prepare_request_data(
        r, [prefill, decode])
    got = prediction_infos(r)
    assert (got[prefill.key].tpot_valid, got[prefill.key].tpot_headroom) == (True, 0.0)
    assert (got[decode.key].tpot_valid, got[decode.key].tpot_headroom) == (False, -25.0)
    assert got[prefill.key].is_valid and not got[decode.key].is_valid


async def test_no_predictions_when_disabled_or_failing_but_tracking_goes_on() -> None:
    a = ep("pod1")
    for p in (producer(predict_in_prepare_data=False), producer(StubPredictor(fail=True))):
        r = req()
        await p.prepare_request_data(r, [a])
        assert prediction_infos(r) == {}
        p.pre_request(r, result_for(a))
        assert p.running_requests() == {a.key: 1}
        p.response_measured(r, a.key, ResponseTimings(200, 0.25))
        assert p.tracker.predictor.training[-1].actual_ttft_ms == 250.0  # type: ignore[attr-defined]
        p.response_complete(r, a.key, False)
        assert p.running_requests() == {}


async def test_running_requests_and_tokens_in_flight_follow_requests() -> None:
    p = producer(StubPredictor(), streaming_mode=True)
    a, b = ep("pod1"), ep("pod2")
    reqs = []
    for i, slo in enumerate(("30", "10", "20")):
        r = req({"x-slo-tpot-ms": slo}, rid=f"r{i}")
        await p.prepare_request_data(r, [a, b])
        p.pre_request(r, result_for(a))
        reqs.append(r)
    t = p.tracker
    assert t.running_count(a.key) == 3 and t.running_count(b.key) == 0
    assert t.min_tpot_slo(a.key) == 10.0 and t.min_tpot_slo(b.key) == 0.0
    assert t.prefill_tokens == {a.key: 15}
    p.response_complete(reqs[1], a.key, aborted=True)  # an aborted request leaves too
    assert t.running_count(a.key) == 2 and t.min_tpot_slo(a.key) == 20.0
    p.response_complete(reqs[1], a.key, aborted=True)  # exactly once
    assert t.prefill_tokens == {a.key: 10}
    for r in (reqs[0], reqs[2]):
        p.response_complete(r, a.key, aborted=False)
    assert t.running == {} and t.prefill_tokens == {}


async def test_non_streaming_mode_trains_ttft_on_the_whole_response() -> None:
    stub = StubPredictor()
    p = producer(stub)
    a = ep("pod1", kv=0.3, queue=2, running=3)
    r = req({"x-slo-ttft-ms": "200"})
    await p.prepare_request_data(r, [a])
    p.pre_request(r, result_for(a))
    p.response_measured(r, a.key, ResponseTimings(200, 0.35, ttft=0.01, tpot=0.002,
                                                  output_tokens=40))
    (sample,) = stub.training
    assert (sample.actual_ttft_ms, sample.actual_tpot_ms) == (350.0, 0.0)
    assert (sample.kv_cache_percentage, sample.num_request_waiting, sample.num_request_running,
            sample.input_token_length, sample.prefill_tokens_in_flight) == (0.3, 2, 3, 5, 5)
    # Predicted TTFT 120 ms; 350 ms > the 200 ms SLO; no TPOT outside streaming mode.
    assert r.plugin_state["latency.outcome"] == LatencyOutcome(0.12, None, True, None)


async def test_streaming_mode_trains_ttft_at_the_first_chunk_and_the_average_tpot() -> None:
    stub = StubPredictor()
    p = producer(stub, streaming_mode=True)
    a = ep("pod1", running=2)
    r = req({"x-slo-ttft-ms": "80", "x-slo-tpot-ms": "15"})
    await p.prepare_request_data(r, [a])
    p.pre_request(r, result_for(a))
    p.response_measured(r, a.key, ResponseTimings(200, 1.0, ttft=0.05, tpot=0.02,
                                                  output_tokens=48))
    ttft_row, tpot_row = stub.training
    assert (ttft_row.actual_ttft_ms, ttft_row.actual_tpot_ms) == (50.0, 0.0)
    assert (tpot_row.actual_ttft_ms, tpot_row.actual_tpot_ms) == (0.0, 20.0)
    assert (tpot_row.prefix_cache_score, tpot_row.num_tokens_generated) == (0.0, 0)
    # Predicted TTFT 100 / TPOT 12 ms (stored at scheduling); 50 ≤ 80 met; 20 > 15 violated.
    assert r.plugin_state["latency.outcome"] == LatencyOutcome(0.1, 0.012, False, True)


async def test_streaming_mode_learns_nothing_from_an_unstreamed_or_failed_response() -> None:
    stub = StubPredictor()
    p = producer(stub, streaming_mode=True)
    a = ep("pod1")
    for timings in (ResponseTimings(200, 0.4), ResponseTimings(500, 0.4, ttft=0.1, tpot=0.01,
                                                                output_tokens=9)):
        r = req()
        await p.prepare_request_data(r, [a])
        p.pre_request(r, result_for(a))
        p.response_measured(r, a.key, timings)
        p.response_complete(r, a.key, False)
        assert "latency.outcome" not in r.plugin_state
    assert stub.training == []


async def test_disaggregated_requests_train_ttft_on_the_prefill_pod() -> None:
    stub = StubPredictor()
    p = producer(stub, streaming_mode=True, endpoint_role_label="role")
    prefill = ep("pod1", kv=0.7, queue=1, role="prefill")
    decode = ep("pod2", kv=0.2, role="decode")
    r = req()
    await p.prepare_request_data(r, [prefill, decode])
    p.pre_request(r, result_for(decode, prefill))
    assert p.tracker.prefill_tokens == {prefill.key: 5, decode.key: 5}
    assert p.tracker.context(r).predicted_ttft == 110.0  # type: ignore[union-attr]
    p.response_measured(r, decode.key, ResponseTimings(200, 0.5, ttft=0.2, tpot=0.01,
                                                       output_tokens=31))
    ttft_row, tpot_row = stub.training
    assert (ttft_row.kv_cache_percentage, ttft_row.pod_type) == (0.7, "prefill")
    assert (tpot_row.kv_cache_percentage, tpot_row.pod_type) == (0.2, "decode")
    p.response_complete(r, decode.key, False)
    assert p.tracker.prefill_tokens == {}


async def test_sampled_tpot_predictions_average_into_the_predicted_tpot() -> None:
    stub = StubPredictor(lambda r: (100.0, 10.0 + r.num_tokens_generated / 10))
    p = producer(stub, streaming_mode=True, sampling_mean=5, max_decode_token_samples_for_prediction=3)
    a = ep("pod1")
    r = req(rid="sampled")
    await p.prepare_request_data(r, [a])
    p.pre_request(r, result_for(a))
    p.response_measured(r, a.key, ResponseTimings(200, 2.0, ttft=0.1, tpot=0.01,
                                                  output_tokens=500))
    tokens = [row.num_tokens_generated for row in stub.local]
    assert tokens == DecodeTokenSampler("sampled", 5, 3).sampled_tokens(500)
    assert len(tokens) == 3
    want = (10.1 + sum(10.0 + t / 10 for t in tokens)) / 4
    outcome = r.plugin_state["latency.outcome"]
    assert outcome.predicted_tpot_s == pytest.approx(want / 1000)


def test_decode_token_sampler_is_gies() -> None:
    assert fnv64a(b"") == 0xCBF29CE484222325 and fnv64a(b"a") == 0xAF63DC4C8601EC8C
    s = DecodeTokenSampler("req-1", 1000, 0)
    assert not s.should_predict(s.next_sample_token)  # max 0: never
    assert DecodeTokenSampler("req-1", 50, 5).next_sample_token == \
        DecodeTokenSampler("req-1", 50, 5).next_sample_token  # seeded by the request id
    zero = DecodeTokenSampler("x", 0, 2)
    assert zero.next_sample_token == 3  # λ <= 0: intervals of 1
    big = DecodeTokenSampler("y", 1000, 10)
    assert 800 < big.next_sample_token < 1200


def test_running_requests_queue() -> None:
    q = RunningRequests()
    assert q.add("a", 30) and q.add("b", 10) and q.add("c", 20)
    assert not q.add("a", 5) and not q.add("", 1) and not q.add("d", -1)
    assert q.peek() == 10 and len(q) == 3 and "b" in q
    assert q.remove("b") and not q.remove("b")
    assert q.peek() == 20
    for i in range(100):
        q.add(f"x{i}", 100 + i)
        q.remove(f"x{i}")
    assert len(q._heap) < 40  # stale entries are dropped


async def test_prepare_cancelled_publishes_nothing() -> None:
    p = producer(StubPredictor(delay_s=5))
    r = req()
    task = asyncio.ensure_future(p.prepare_request_data(r, [ep("pod1")]))
    await asyncio.sleep(0)  # let it reach the predictor (the point is the cancellation)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert r.plugin_state == {} or "latency.prediction-durations" not in r.plugin_state
    assert p.tracker.context(r) is None
    p.pre_request(r, result_for(ep("pod1")))
    assert p.running_requests() == {}  # GIE: no context → PreRequest skips


async def test_endpoint_removed_forgets_its_state() -> None:
    p = producer()
    a = ep("pod1")
    r = req()
    await p.prepare_request_data(r, [a])
    p.pre_request(r, result_for(a))
    p.endpoint_removed(a.key)
    assert p.tracker.running == {} and p.tracker.prefill_tokens == {}
    p.response_complete(r, a.key, False)  # nothing left to decrement: no error


# ================================================ predicted-latency-scorer (monolith)


def monolith(stub: StubPredictor | None = None, seed: int = 0,
             **params: Any) -> PredictedLatencyScorer:
    return PredictedLatencyScorer("m", PredictedLatencyScorerParameters(**params),
                                  stub or StubPredictor(), random.Random(seed))


def test_monolith_parameters_are_gies() -> None:
    p = built("plugins:\n- type: predicted-latency-scorer\n  parameters: {samplingMean: 1000.0}\n"
              ).plugins["predicted-latency-scorer"]
    assert isinstance(p, PredictedLatencyScorer)
    d = p.params
    assert (d.streaming_mode, d.selection_mode, d.headroom_selection_strategy,
            d.affinity_gate_tau, d.affinity_gate_tau_global, d.affinity_max_ttft_penalty_ms,
            d.epsilon_explore_sticky, d.epsilon_explore_neg, d.max_sampled_tokens) == (
        True, "linear", "least", 0.8, 0.99, 5000.0, 0.01, 0.01, 0)
    for params, error in (("{affinityGateTau: 2}", "affinityGateTau: must be in"),
                          ("{headroomTTFTWeight: -1}", "headroom weights must be >= 0"),
                          ("{compositeQueueWeight: -1}", "composite weights must be >= 0"),
                          ("{affinityMaxTTFTPenaltyMs: -5}", "must be >= 0"),
                          ("{maxSampledTokens: -1}", "maxSampledTokens: must be >= 0")):
        with pytest.raises(ConfigError, match=error):
            built(f"plugins:\n- type: predicted-latency-scorer\n  parameters: {params}\n")


async def test_monolith_picks_one_endpoint() -> None:
    m = monolith(selection_mode="max")
    slow, fast = ep("pod1", queue=5), ep("pod2", queue=0)
    r = req({"x-slo-ttft-ms": "500", "x-slo-tpot-ms": "50"})
    await m.prepare_request_data(r, [slow, fast])
    got = list(m.score(CycleState(), r, [slow, fast]))
    assert sorted(got) == [0.0, 1.0]
    # Both meet the SLO; "least" packs onto the tighter fit (less headroom): the slow one.
    assert got == [1.0, 0.0]
    most = monolith(selection_mode="max", headroom_selection_strategy="most")
    r = req({"x-slo-ttft-ms": "500", "x-slo-tpot-ms": "50"})
    await most.prepare_request_data(r, [slow, fast])
    assert list(most.score(CycleState(), r, [slow, fast])) == [0.0, 1.0]


async def test_monolith_without_slos_prefers_the_lowest_predicted_latency() -> None:
    m = monolith(selection_mode="max", streaming_mode=False)
    slow, fast = ep("pod1", queue=5), ep("pod2", queue=1)
    picks = []
    for i in range(20):
        r = req(rid=f"r{i}")
        await m.prepare_request_data(r, [slow, fast])
        picks.append(list(m.score(CycleState(), r, [slow, fast])))
    assert all(p == [0.0, 1.0] for p in picks)


async def test_monolith_composite_pick_without_predictions() -> None:
    m = monolith(StubPredictor(fail=True), selection_mode="max")
    full, empty = ep("pod1", kv=0.9, queue=4), ep("pod2", kv=0.1, queue=0)
    r = req()
    await m.prepare_request_data(r, [full, empty])
    assert list(m.score(CycleState(), r, [full, empty])) == [0.0, 1.0]
    # No context at all (PrepareData did not run): composite too.
    assert list(m.score(CycleState(), req(rid="x"), [full, empty])) == [0.0, 1.0]


async def test_monolith_admission_refuses_sheddable_requests_without_a_valid_endpoint() -> None:
    slos = {"x-slo-ttft-ms": "50", "x-slo-tpot-ms": "5"}
    m = monolith()
    a, b = ep("pod1", queue=1, running=3), ep("pod2", queue=2, running=3)
    for e in (a, b):  # every endpoint has a request this EPP dispatched
        r0 = req(rid=f"busy-{e.name}")
        await m.prepare_request_data(r0, [a, b])
        m.pre_request(r0, result_for(e))
    sheddable = req(slos, priority=-1, rid="s")
    await m.prepare_request_data(sheddable, [a, b])
    assert m.admit_request(sheddable, [a, b]) == \
        "no valid endpoint available to serve the request"
    critical = req(slos, priority=0, rid="c")
    await m.prepare_request_data(critical, [a, b])
    assert m.admit_request(critical, [a, b]) is None
    cold = ep("pod3", kv=0.01, running=3)
    r = req(slos, priority=-1, rid="cold")
    await m.prepare_request_data(r, [a, b, cold])
    assert m.admit_request(r, [a, b, cold]) is None
    assert m.admit_request(req(slos, priority=-1, rid="none"), [a]) is None  # fail open


async def test_monolith_negative_tier_prefers_endpoints_without_dispatched_requests() -> None:
    m = monolith(selection_mode="max")
    busy, idle = ep("pod1", queue=0), ep("pod2", queue=9)  # idle is predicted far slower
    r0 = req(rid="busy")
    await m.prepare_request_data(r0, [busy])
    m.pre_request(r0, result_for(busy))
    r = req({"x-slo-ttft-ms": "1"})  # every endpoint violates
    await m.prepare_request_data(r, [busy, idle])
    assert list(m.score(CycleState(), r, [busy, idle])) == [0.0, 1.0]


async def test_monolith_affinity_gate_keeps_sticky_endpoints_unless_too_slow() -> None:
    cfg = built("""
plugins:
- type: approx-prefix-cache-producer
  parameters: {blockSizeTokens: 1}
- type: predicted-latency-scorer
  parameters: {selectionMode: max, epsilonExploreSticky: 0, affinityMaxTTFTPenaltyMs: 50}
""")
    m = cfg.plugins["predicted-latency-scorer"]
    assert isinstance(m, PredictedLatencyScorer)
    stub = StubPredictor()
    m.tracker.predictor = stub
    prefix = cfg.plugins["approx-prefix-cache-producer"]
    sticky, other = ep("pod1", queue=2), ep("pod2", queue=0)
    prefix.pre_request(req(prompt="y" * 64, rid="w"), result_for(sticky))  # type: ignore[attr-defined]
    r = req(prompt="y" * 64)
    await m.prepare_request_data(r, [sticky, other])
    # Sticky is 20 ms slower (≤ 50): the gate keeps it alone.
    assert list(m.score(CycleState(), r, [sticky, other])) == [1.0, 0.0]
    stub.fn = lambda row: (100.0 + 100 * row.num_request_waiting, 10.0)
    r = req(prompt="y" * 64, rid="again")
    await m.prepare_request_data(r, [sticky, other])
    # Now 200 ms slower: stickiness breaks and the faster one wins.
    assert list(m.score(CycleState(), r, [sticky, other])) == [0.0, 1.0]


async def test_monolith_weighted_random_spreads_by_weight() -> None:
    m = monolith(seed=3)
    eps = [ep("pod1", queue=0), ep("pod2", queue=2), ep("pod3", queue=4)]
    counts = [0, 0, 0]
    for i in range(300):
        r = req({"x-slo-ttft-ms": "1000", "x-slo-tpot-ms": "100"}, rid=f"r{i}")
        await m.prepare_request_data(r, eps)
        counts[list(m.score(CycleState(), r, eps)).index(1.0)] += 1
    assert all(c > 0 for c in counts)
    # "least": weights int(99·(1 − blend)) + 2 = 11, 51, 91 — the tightest fit most often.
    assert counts[2] > counts[1] > counts[0]


# ============================================================ loaded from GIE's configs


def test_gies_chart_pipeline_and_dependencies_load() -> None:
    cfg = built("""
plugins:
- type: predicted-latency-producer
- name: strict-affinity-filter
  type: prefix-cache-affinity-filter
  parameters: {affinityThreshold: 0.99}
- name: loose-affinity-filter
  type: prefix-cache-affinity-filter
  parameters: {affinityThreshold: 0.80}
- type: latency-scorer
- type: weighted-random-picker
- type: slo-headroom-tier-filter
- type: latency-slo-admitter
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: predicted-latency-producer
  - pluginRef: strict-affinity-filter
  - pluginRef: slo-headroom-tier-filter
  - pluginRef: loose-affinity-filter
  - pluginRef: latency-scorer
  - pluginRef: weighted-random-picker
""")
    profile = cfg.scheduler.profiles["default"]
    assert [f.name for f in profile.filters] == ["strict-affinity-filter",
                                                 "slo-headroom-tier-filter",
                                                 "loose-affinity-filter"]
    assert [s.name for s, _ in profile.scorers] == ["latency-scorer"]
    assert cfg.plugins["predicted-latency-producer"] in cfg.pre_request


def test_a_producer_declared_after_its_consumer_is_fine_but_types_must_match() -> None:
    cfg = built("""
plugins:
- type: latency-scorer
- type: predicted-latency-producer
""")
    assert set(cfg.plugins) >= {"latency-scorer", "predicted-latency-producer"}


def test_plugin_handle_binding_without_prefix_producer() -> None:
    s = LatencyScorer("s")
    s.bind(PluginHandle())
    assert s.prefix.scores(CycleState(), req(), [ep("pod1")]) == {}


ROOT = Path(__file__).resolve().parents[3]


def test_the_shipped_example_config_loads_strictly() -> None:
    root = ROOT
    cfg = load_and_build(str(root / "config" / "predicted-latency.yaml"), strict=True)
    producer = cfg.plugins["predicted-latency-producer"]
    assert isinstance(producer, PredictedLatencyProducer) and producer.params.streaming_mode
    assert isinstance(cfg.plugins["latency-slo-admitter"], LatencySloAdmitter)


def test_gies_troubleshooting_latency_example_loads_without_its_v1_4_gate() -> None:
    """site-src/guides/troubleshooting.md's latency example (GIE v1.5.0 rejects its
    ``prepareDataPlugins`` feature gate, tests/unit/gie/test_config_files.py; the rest
    loads): the monolith alone in the profile."""
    doc = (ROOT / "tests" / "fixtures" / "gie-v1.5.0" / "site-src" /
           "guides" / "troubleshooting.md").read_text(encoding="utf-8")
    blocks = [yaml.safe_load(b)["inferenceExtension"]["pluginsCustomConfig"][
        "custom-plugins.yaml"] for b in re.findall(r"```yaml\n(.*?)```", doc, re.DOTALL)
        if "predicted-latency-scorer" in b]
    (text,) = blocks
    text = text.replace("featureGates:\n- prepareDataPlugins\n", "")
    assert "featureGates" not in text
    cfg = build(parse_config(text, "troubleshooting.md"), strict=True)
    (scorer, weight), = cfg.scheduler.profiles["default"].scorers
    assert isinstance(scorer, PredictedLatencyScorer) and weight == 1.0
    assert scorer.params.sampling_mean == 1000.0
