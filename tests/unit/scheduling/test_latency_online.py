"""The in-process latency predictor (epp/latency/online.py): it learns a known linear
cost from synthetic observations, keeps a bounded memory, follows drift, and refuses to
predict in its cold start."""

from __future__ import annotations

import random

import pytest

from epp.latency.online import OnlinePredictor, RecursiveLeastSquares
from epp.latency.predictor import LatencyPredictor, predictor_from_env
from epp.latency.sidecar import SidecarPredictor
from epp.latency.types import PredictionRequest, PredictorError, PredictorNotReady, TrainingEntry


def ttft_cost(kv: float, words: int, waiting: int, running: int, prefix: float) -> float:
    """A known linear TTFT cost (ms) in GIE's features."""
    effective = (1 - prefix) * words
    return 20 + 50 * kv + 0.2 * effective + 30 * waiting + 5 * running + 10 * (waiting > 0)


def tpot_cost(kv: float, words: int, waiting: int, running: int, generated: int) -> float:
    return 8 + 12 * kv + 0.001 * words + 0.5 * running + 0.01 * generated


def sample(rng: random.Random) -> tuple[float, int, int, int, float, int]:
    return (rng.random(), rng.randrange(10, 2000), rng.randrange(0, 8), rng.randrange(0, 32),
            rng.random(), rng.randrange(1, 500))


def entry(kv: float, words: int, waiting: int, running: int, prefix: float,
          ttft: float = 0.0, tpot: float = 0.0, generated: int = 0,
          pod_type: str = "") -> TrainingEntry:
    return TrainingEntry(kv, words, waiting, running, generated, ttft, tpot, prefix, pod_type)


def test_learns_a_linear_ttft_and_tpot_cost() -> None:
    rng = random.Random(1)
    p = OnlinePredictor()
    for _ in range(400):
        kv, words, waiting, running, prefix, gen = sample(rng)
        p.add_training_data_bulk([
            entry(kv, words, waiting, running, prefix, ttft=ttft_cost(kv, words, waiting,
                                                                       running, prefix)),
            entry(kv, words, waiting, running, 0.0, generated=gen,
                  tpot=tpot_cost(kv, words, waiting, running, gen))])
    for _ in range(50):
        kv, words, waiting, running, prefix, gen = sample(rng)
        got = p.predict_local(PredictionRequest(kv, words, waiting, running, gen, prefix))
        want_ttft = ttft_cost(kv, words, waiting, running, prefix)
        assert got.ttft_ms == pytest.approx(want_ttft, rel=0.02, abs=1.0)
        assert got.tpot_ms == pytest.approx(tpot_cost(kv, words, waiting, running, gen),
                                            rel=0.02, abs=0.2)
        assert got.model_type == "online-linear" and got.objective_type == "mean"


def test_converges_with_noise_and_ranks_endpoints_like_the_true_cost() -> None:
    rng = random.Random(2)
    p = OnlinePredictor()
    for _ in range(2000):
        kv, words, waiting, running, prefix, _ = sample(rng)
        y = ttft_cost(kv, words, waiting, running, prefix) * rng.uniform(0.9, 1.1)
        p.add_training_data_bulk([entry(kv, words, waiting, running, prefix, ttft=y)])
    idle = PredictionRequest(0.1, 500, 0, 1, 1, 0.0)
    busy = PredictionRequest(0.9, 500, 6, 30, 1, 0.0)
    cached = PredictionRequest(0.1, 500, 0, 1, 1, 0.9)
    t_idle, t_busy, t_cached = (p.predict_local(r).ttft_ms for r in (idle, busy, cached))
    assert t_cached < t_idle < t_busy
    assert t_idle == pytest.approx(ttft_cost(0.1, 500, 0, 1, 0.0), rel=0.1)


def test_memory_is_bounded_whatever_the_traffic() -> None:
    rng = random.Random(3)
    p = OnlinePredictor()
    size = p.size()
    for _ in range(5000):
        kv, words, waiting, running, prefix, _ = sample(rng)
        p.add_training_data_bulk([entry(kv, words, waiting, running, prefix, ttft=100,
                                        pod_type=rng.choice(["", "prefill", "decode",
                                                             f"role-{rng.random()}"]))])
    # One d×d covariance and one weight vector per model: TTFT (9 inputs + intercept) and
    # TPOT (8 + intercept) for each of GIE's three pod types — unknown types share "".
    assert p.size() == size == 3 * ((10 * 10 + 10) + (9 * 9 + 9))


def test_cold_start_refuses_ttft_and_zero_tpot_until_trained() -> None:
    p = OnlinePredictor(min_samples=5)
    row = PredictionRequest(0.5, 100, 1, 2, 1, 0.0)
    with pytest.raises(PredictorNotReady, match="0 of 5 TTFT samples"):
        p.predict_local(row)
    for i in range(5):
        p.add_training_data_bulk([entry(0.5, 100, 1, 2, 0.0, ttft=100.0 + i)])
    got = p.predict_local(row)
    assert got.ttft_ms > 0
    assert got.tpot_ms == 0.0  # no TPOT sample yet (non-streaming traffic never trains it)
    assert p.samples() == (5, 0)
    # A pod type has its own model: a prefill pod is still cold.
    with pytest.raises(PredictorNotReady):
        p.predict_local(PredictionRequest(0.5, 100, 1, 2, 1, 0.0, pod_type="prefill"))


async def test_bulk_prediction_is_strict_and_validates_inputs() -> None:
    p = OnlinePredictor(min_samples=1)
    p.add_training_data_bulk([entry(0.5, 100, 0, 0, 0.0, ttft=50.0)])
    ok = PredictionRequest(0.2, 10, 0, 0, 1, 0.0)
    bulk = await p.predict_bulk_strict([ok, ok])
    assert len(bulk.predictions) == 2 and bulk.successful_predictions == 2
    with pytest.raises(PredictorError, match="kv_cache_percentage must be between"):
        await p.predict_bulk_strict([ok, PredictionRequest(1.5, 10, 0, 0, 1, 0.0)])
    with pytest.raises(PredictorError, match="prefix_cache_score"):
        p.predict_local(PredictionRequest(0.2, 10, 0, 0, 1, -0.1))


def test_predictions_are_never_negative() -> None:
    p = OnlinePredictor(min_samples=2)
    for words in (100, 200, 300, 400):
        p.add_training_data_bulk([entry(0.0, words, 0, 0, 0.0, ttft=float(words))])
    assert p.predict_local(PredictionRequest(0.0, 0, 0, 0, 1, 1.0)).ttft_ms >= 0.0


def test_forgetting_follows_a_pod_that_slows_down() -> None:
    rng = random.Random(4)
    p = OnlinePredictor(forgetting=0.99)
    for scale in (1.0, 3.0):
        for _ in range(1500):
            kv, words, waiting, running, prefix, _ = sample(rng)
            p.add_training_data_bulk([entry(kv, words, waiting, running, prefix,
                                            ttft=scale * ttft_cost(kv, words, waiting,
                                                                   running, prefix))])
    row = PredictionRequest(0.5, 800, 2, 10, 1, 0.3)
    assert p.predict_local(row).ttft_ms == pytest.approx(
        3.0 * ttft_cost(0.5, 800, 2, 10, 0.3), rel=0.05)


def test_rls_ignores_non_finite_samples_and_stays_bounded_without_excitation() -> None:
    m = RecursiveLeastSquares(2, forgetting=0.9, prior=10.0)
    m.update([1.0, float("nan")], 1.0)
    m.update([1.0, 0.0], float("inf"))
    assert m.samples == 0
    for _ in range(10_000):  # the second input never varies: no covariance wind-up
        m.update([1.0, 0.0], 5.0)
    assert m.predict([1.0, 0.0]) == pytest.approx(5.0, rel=1e-4)
    assert all(m.p[i][i] <= m.prior + 1e-9 for i in range(2))
    with pytest.raises(ValueError):
        RecursiveLeastSquares(2, forgetting=0.0)


def test_the_environment_chooses_the_predictor() -> None:
    assert isinstance(predictor_from_env({}), OnlinePredictor)
    side = predictor_from_env({"PREDICTION_SERVER_URL": "http://a:1, http://b:2"})
    assert isinstance(side, SidecarPredictor)
    assert side.config.prediction_urls == ("http://a:1", "http://b:2")
    assert side.config.training_url == "http://localhost:8000"  # GIE's default
    assert isinstance(predictor_from_env({"TRAINING_SERVER_URL": "http://t:8000"}),
                      SidecarPredictor)
    for p in (OnlinePredictor(), side):
        assert isinstance(p, LatencyPredictor)
