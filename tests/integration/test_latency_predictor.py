"""GIE's latency-predictor pipeline (config/predicted-latency.yaml) through real Envoy and
simulated model servers (`epp sim`), in GIE's gateway shape (the response bodies pass the
EPP, which learns TTFT and TPOT from them): with the in-process predictor, and with GIE's
latency-predictor sidecar (a local fake of its HTTP API)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.integration.conftest import Stack, Upstreams, eventually, start_stack, stop_stack
from tests.unit.scheduling.test_latency_sidecar import FakeSidecar, fake  # noqa: F401 - fixture

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONFIG = (ROOT / "config" / "predicted-latency.yaml").read_text()


def samples(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


async def scrape(session: aiohttp.ClientSession, stack: Stack) -> str:
    async with session.get(f"http://127.0.0.1:{stack.epp.metrics_port}/metrics") as r:
        return await r.text()


async def stream(session: aiohttp.ClientSession, stack: Stack, prompt: str,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    body = orjson.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 6,
                         "stream": True, "stream_options": {"include_usage": True}})
    h = {"content-type": "application/json", "x-request-id": uuid.uuid4().hex,
         **(headers or {})}
    async with session.post(stack.url + "/v1/completions", data=body, headers=h) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


LABELS = '{model_name="sim-model",target_model_name="sim-model"}'


async def test_predicted_latency_routing_learns_and_records_gies_metrics(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path, config=CONFIG,
                          extra_args=["--enable-explain-header"], response_path="inline")
    try:
        served = set()
        # Cold start: the in-process model learns from the first 20 streamed responses;
        # meanwhile the latency-scorer routes on its composite fallback.
        for i in range(24):
            status, headers, body = await stream(session, s, f"warm up {i} " + "word " * i)
            assert status == 200 and b"[DONE]" in body
            served.add(headers["x-sim-server"])
        text = await scrape(session, s)
        warm_count = samples(text, "inference_objective_request_ttft_prediction_duration_"
                                   "seconds_count").get(LABELS, 0.0)
        assert warm_count >= 1  # predictions started during the warm-up
        # Warm: every request is predicted; an impossible TTFT SLO is violated each time.
        for i in range(6):
            status, headers, _ = await stream(session, s, "a question about latency " * 3,
                                              {"x-slo-ttft-ms": "0.001",
                                               "x-slo-tpot-ms": "100000"})
            assert status == 200
            served.add(headers["x-sim-server"])
        status, headers, _ = await stream(session, s, "explain this one",
                                          {"x-epp-explain": "true"})
        assert status == 200
        decision = orjson.loads(headers["x-epp-explain"])
        prof = decision["profiles"]["default"]
        assert set(prof["scores"]) == {"latency-scorer"}
        assert prof["scores"]["latency-scorer"]["type"] == "latency-scorer"
        assert prof["picker"] == "weighted-random-picker"
        assert prof["picked"] == [decision["destination"]]
        assert served <= {f"sim-{p}" for p in upstreams.ports[:3]}

        async def recorded() -> str | None:
            t = await scrape(session, s)
            n = samples(t, "inference_objective_request_ttft_prediction_duration_seconds_count")
            return t if n.get(LABELS, 0) >= warm_count + 7 else None

        text = await eventually(recorded, what="a prediction per warm request")
        assert samples(text, "inference_objective_request_tpot_prediction_duration_seconds_"
                             "count")[LABELS] >= warm_count + 7
        # The predicted TTFT of answered requests (> 0 once the model has learned).
        assert samples(text, "inference_objective_request_predicted_ttft_seconds_sum")[
            LABELS] > 0
        assert samples(text, "inference_objective_request_predicted_tpot_seconds_count")[
            LABELS] >= 6
        violations = samples(text, "inference_objective_request_slo_violation_total")
        assert violations['{model_name="sim-model",target_model_name="sim-model",type="ttft"}'] \
            >= 6
        assert '{model_name="sim-model",target_model_name="sim-model",type="tpot"}' \
            not in violations
        gauge = samples(text, "inference_objective_inference_request_metric")
        assert '{model_name="sim-model",target_model_name="sim-model",type="predicted_ttft"}' \
            in gauge
    finally:
        await stop_stack(s)


async def test_the_sidecar_predicts_and_trains_when_gies_variables_name_it(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path,
        fake: FakeSidecar) -> None:  # noqa: F811 - the fixture
    env = {"TRAINING_SERVER_URL": fake.url, "PREDICTION_SERVER_URL": fake.url,
           "LATENCY_FLUSH_INTERVAL_SEC": "1"}
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path, config=CONFIG,
                          extra_env=env, response_path="inline")
    try:
        for i in range(4):
            status, _, _ = await stream(session, s, f"hello sidecar {i}",
                                        {"x-slo-ttft-ms": "1000", "x-slo-tpot-ms": "1000"})
            assert status == 200
        # One bulk call per request, all three candidates in it (GIE's JSON).
        assert len(fake.bulk_calls) >= 4
        assert all(len(rows) == 3 for rows in fake.bulk_calls)
        assert fake.bulk_calls[0][0]["num_tokens_generated"] == 1
        # Training rows reach the training server with the next flush.
        await eventually(lambda: len(fake.training) >= 8, timeout=15,
                         what=lambda: f"training rows flushed ({len(fake.training)})")
        kinds = {(e["actual_ttft_ms"] > 0, e["actual_tpot_ms"] > 0) for e in fake.training}
        assert kinds == {(True, False), (False, True)}

        async def recorded() -> bool:
            t = await scrape(session, s)
            n = samples(t, "inference_objective_request_ttft_prediction_duration_seconds_count")
            return n.get(LABELS, 0) >= 4

        await eventually(recorded, what="prediction durations")
    finally:
        await stop_stack(s)


async def test_with_worker_processes_the_core_predicts_and_learns(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    """--workers N: the fronts see the responses, the core (plugins, predictor) learns from
    what they measured and predicts before scheduling."""
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path, config=CONFIG,
                          extra_args=["--workers", "2"], response_path="inline")
    try:
        for i in range(26):
            status, _, _ = await stream(session, s, f"worker request {i} " + "w " * i)
            assert status == 200

        async def predicted() -> bool:
            t = await scrape(session, s)
            n = samples(t, "inference_objective_request_ttft_prediction_duration_seconds_count")
            p = samples(t, "inference_objective_request_predicted_ttft_seconds_count")
            return n.get(LABELS, 0) >= 1 and p.get(LABELS, 0) >= 20

        await eventually(predicted, what="predictions after the cold start")
    finally:
        await stop_stack(s)
