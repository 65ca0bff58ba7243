"""The client of GIE's latency-predictor sidecar (epp/latency/sidecar.py) against a local
aiohttp fake of its HTTP API, answering with the shapes GIE's prediction_server.py and
training_server.py answer (GIE v1.5.0 latencypredictor/)."""

from __future__ import annotations

import asyncio
import datetime as dt
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
import pytest_asyncio
from aiohttp import web

from epp.latency.sidecar import (
    SidecarConfig,
    SidecarPredictor,
    parse_coefficients,
    stratified_sample,
)
from epp.latency.types import PredictionRequest, PredictorError, TrainingEntry
from tests.polling import eventually

REQUIRED = ("kv_cache_percentage", "input_token_length", "num_request_waiting",
            "num_request_running", "num_tokens_generated", "prefix_cache_score")


@dataclass
class FakeSidecar:
    """GIE's two servers in one app: what they answer, and what they were sent."""

    model_type: str = "xgboost"
    ready: bool = True
    delay_s: float = 0.0
    bulk_calls: list[list[dict[str, Any]]] = field(default_factory=list)
    training: list[dict[str, Any]] = field(default_factory=list)
    predict_calls: list[dict[str, Any]] = field(default_factory=list)
    metrics_text: str = ""
    url: str = ""

    def _pred(self, row: dict[str, Any]) -> dict[str, Any]:
        # A recognisable "model": TTFT 10 ms per waiting request plus words/10; TPOT 2 ms
        # per running request; clipped at 0 as the server clips.
        ttft = max(0.0, 10.0 * row["num_request_waiting"] + row["input_token_length"] / 10)
        tpot = max(0.0, 2.0 * row["num_request_running"])
        return {"ttft_ms": ttft, "tpot_ms": tpot,
                "predicted_at": dt.datetime.now(dt.UTC).isoformat(),
                "model_type": self.model_type, "objective_type": "quantile",
                "quantile": 0.9, "last_model_load": None}

    async def status(self, _: web.Request) -> web.Response:
        return web.json_response({
            "is_ready": self.ready, "model_type": self.model_type,
            "objective_type": "quantile", "quantile": 0.9, "last_model_load": None,
            "training_server_url": "http://training:8000",
            "models_exist": {"ttft_model": True, "tpot_model": True},
            "ensemble_active": False})

    async def model_info(self, _: web.Request) -> web.Response:
        return web.json_response({
            "model_type": self.model_type, "quantile": 0.9, "available_endpoints": {},
            "model_status": {"ttft_model_ready": True, "tpot_model_ready": True}})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text,
                            content_type="text/plain")

    async def bulk_strict(self, request: web.Request) -> web.Response:
        body = await request.json()
        rows = body["requests"]
        self.bulk_calls.append(rows)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # a slow server (the test is about timing)
        if not self.ready:
            raise web.HTTPServiceUnavailable(text='{"detail":"Models not ready"}')
        for r in rows:
            for f in REQUIRED:
                if f not in r:
                    raise web.HTTPUnprocessableEntity(text=f"missing {f}")
        return web.Response(body=orjson.dumps({
            "predictions": [self._pred(r) for r in rows], "total_requests": len(rows),
            "successful_predictions": len(rows), "failed_predictions": 0,
            "processing_time_ms": 0.5}), content_type="application/json")

    async def bulk(self, request: web.Request) -> web.Response:
        rows = (await request.json())["requests"]
        preds: list[dict[str, Any] | None] = [
            None if r["kv_cache_percentage"] > 0.95 else self._pred(r) for r in rows]
        return web.json_response({
            "predictions": preds, "errors": [], "total_requests": len(rows),
            "successful_predictions": sum(p is not None for p in preds),
            "failed_predictions": sum(p is None for p in preds), "processing_time_ms": 1.0})

    async def predict(self, request: web.Request) -> web.Response:
        row = await request.json()
        self.predict_calls.append(row)
        return web.json_response(self._pred(row))

    async def add_training(self, request: web.Request) -> web.Response:
        entries = (await request.json())["entries"]
        for e in entries:
            if not 0 <= e["kv_cache_percentage"] <= 1 or "timestamp" not in e:
                raise web.HTTPUnprocessableEntity(text="bad entry")
        self.training.extend(entries)
        return web.json_response({"message": f"Accepted {len(entries)} training samples."},
                                 status=202)

    async def trees(self, _: web.Request) -> web.Response:
        return web.json_response([{"nodeid": 0, "leaf": 1.0}])


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeSidecar]:
    f = FakeSidecar()
    app = web.Application()
    app.router.add_get("/status", f.status)
    app.router.add_get("/model/download/info", f.model_info)
    app.router.add_get("/metrics", f.metrics)
    app.router.add_post("/predict/bulk/strict", f.bulk_strict)
    app.router.add_post("/predict/bulk", f.bulk)
    app.router.add_post("/predict", f.predict)
    app.router.add_post("/add_training_data_bulk", f.add_training)
    app.router.add_get("/model/ttft/xgb/json", f.trees)
    app.router.add_get("/model/tpot/xgb/json", f.trees)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    f.url = f"http://127.0.0.1:{port}"
    yield f
    await runner.cleanup()


def client(f: FakeSidecar, **kw: Any) -> SidecarPredictor:
    cfg = SidecarConfig(training_url=f.url, prediction_urls=(f.url,), **kw)
    return SidecarPredictor(cfg, rng=random.Random(0))


def row(waiting: int = 0, running: int = 0, words: int = 100, pod_type: str = "",
        kv: float = 0.5) -> PredictionRequest:
    return PredictionRequest(kv, words, waiting, running, 1, 0.25, pod_type, 7, 0)


async def test_bulk_strict_sends_gies_json_and_reads_the_answer(fake: FakeSidecar) -> None:
    c = client(fake, coalesce_window_s=0.0)
    try:
        bulk = await c.predict_bulk_strict([row(waiting=2), row(running=3, pod_type="decode")])
    finally:
        await c.stop()
    assert [p.ttft_ms for p in bulk.predictions] == [30.0, 10.0]
    assert [p.tpot_ms for p in bulk.predictions] == [0.0, 6.0]
    assert bulk.predictions[0].model_type == "xgboost" and bulk.total_requests == 2
    (sent,) = fake.bulk_calls
    assert sent[0] == {"kv_cache_percentage": 0.5, "input_token_length": 100,
                       "num_request_waiting": 2, "num_request_running": 0,
                       "num_tokens_generated": 1, "prefix_cache_score": 0.25,
                       "prefill_tokens_in_flight": 7, "decode_tokens_in_flight": 0}
    assert sent[1]["pod_type"] == "decode"  # omitted when empty (Go's omitempty)


async def test_concurrent_callers_are_coalesced_into_one_call(fake: FakeSidecar) -> None:
    c = client(fake, coalesce_window_s=0.05)
    try:
        a, b, d = await asyncio.gather(c.predict_bulk_strict([row(waiting=1)]),
                                       c.predict_bulk_strict([row(waiting=2), row(waiting=3)]),
                                       c.predict_bulk_strict([row(waiting=4)]))
    finally:
        await c.stop()
    assert len(fake.bulk_calls) == 1 and len(fake.bulk_calls[0]) == 4
    assert [p.ttft_ms for p in a.predictions] == [20.0]
    assert [p.ttft_ms for p in b.predictions] == [30.0, 40.0]
    assert [p.ttft_ms for p in d.predictions] == [50.0]
    assert b.total_requests == 2 and b.successful_predictions == 2


async def test_the_row_cap_dispatches_before_the_window(fake: FakeSidecar) -> None:
    c = client(fake, coalesce_window_s=30.0, max_coalesced_rows=2)
    try:
        got = await asyncio.wait_for(c.predict_bulk_strict([row(), row()]), timeout=5)
    finally:
        await c.stop()
    assert len(got.predictions) == 2 and len(fake.bulk_calls) == 1


async def test_a_server_that_is_not_ready_or_slow_fails_the_prediction(
        fake: FakeSidecar) -> None:
    fake.ready = False
    c = client(fake)
    try:
        with pytest.raises(PredictorError, match="status 503"):
            await c.predict_bulk_strict([row()])
        fake.ready, fake.delay_s = True, 2.0
        slow = client(fake, http_timeout_s=0.2, coalesce_window_s=0.0)
        try:
            with pytest.raises(PredictorError, match="TimeoutError"):
                await slow.predict_bulk_strict([row()])
        finally:
            await slow.stop()
    finally:
        await c.stop()


async def test_nothing_is_sent_for_bad_or_too_many_rows(fake: FakeSidecar) -> None:
    c = client(fake, max_bulk_size=2)
    try:
        with pytest.raises(PredictorError, match="no prediction requests"):
            await c.predict_bulk_strict([])
        with pytest.raises(PredictorError, match=r"too many requests: 3 \(max: 2\)"):
            await c.predict_bulk_strict([row()] * 3)
        with pytest.raises(PredictorError, match="validation failed for request 1"):
            await c.predict_bulk_strict([row(), row(kv=1.2)])
    finally:
        await c.stop()
    assert fake.bulk_calls == []


async def test_a_dead_sidecar_fails_fast_and_cleanly() -> None:
    c = SidecarPredictor(SidecarConfig(training_url="http://127.0.0.1:9",
                                       prediction_urls=("http://127.0.0.1:9",),
                                       coalesce_window_s=0.0))
    try:
        with pytest.raises(PredictorError, match="failed"):
            await c.predict_bulk_strict([row()])
    finally:
        await c.stop()


async def test_partial_bulk_and_single_predictions(fake: FakeSidecar) -> None:
    c = client(fake)
    try:
        bulk = await c.predict_bulk([row(waiting=1), row(kv=0.99)])
        assert [p.ttft_ms for p in bulk.predictions] == [20.0]
        assert bulk.failed_predictions == 1
        await c.refresh_server_status()
        assert c.predict_local(row()) is None  # tree models need /predict
        single = await c.predict(row(running=4))
        assert single.tpot_ms == 8.0 and len(fake.predict_calls) == 1
    finally:
        await c.stop()


COEFFICIENTS = """\
model_type{type="bayesian_ridge"} 1
ttft_intercept{} 12.500000
ttft_coef{feature="kv_cache_percentage"} 100.000000
ttft_coef{feature="input_token_length"} 0.100000
ttft_coef{feature="num_request_waiting"} 5.000000
ttft_coef{feature="num_request_running"} 1.000000
ttft_coef{feature="prefix_cache_score"} -20.000000
ttft_coef{feature="effective_input_tokens"} 3.000000
tpot_intercept{} 4.000000
tpot_coef{feature="kv_cache_percentage"} 2.000000
tpot_coef{feature="num_tokens_generated"} 0.010000
training_samples_count{model="ttft",queue_bucket="0",cache_bucket="1",prefix_bucket="2"} 40
"""


async def test_bayesian_ridge_predicts_locally_from_the_published_coefficients(
        fake: FakeSidecar) -> None:
    fake.model_type, fake.metrics_text = "bayesian_ridge", COEFFICIENTS
    c = client(fake)
    try:
        await c.refresh_metrics()
        await c.refresh_server_status()
        got = c.predict_local(PredictionRequest(0.5, 200, 2, 3, 100, 0.5))
    finally:
        await c.stop()
    assert got is not None
    # As GIE's predictBayesianRidge: the five named TTFT features (not the derived one).
    assert got.ttft_ms == pytest.approx(12.5 + 50 + 20 + 10 + 3 - 10)
    assert got.tpot_ms == pytest.approx(4 + 1 + 1)
    assert (got.model_type, got.quantile) == ("bayesian_ridge", 0.9)


def test_coefficients_parse_like_gies_client() -> None:
    c = parse_coefficients(COEFFICIENTS + "garbage line\nttft_coef{} 3\n")
    assert c.ttft_intercept == 12.5 and c.ttft["prefix_cache_score"] == -20.0
    assert c.tpot == {"kv_cache_percentage": 2.0, "num_tokens_generated": 0.01}


async def test_model_type_unknown_until_the_server_says(fake: FakeSidecar) -> None:
    c = client(fake)
    try:
        with pytest.raises(PredictorError, match="model type not yet available"):
            c.predict_local(row())
    finally:
        await c.stop()


def entry(ttft: float = 0.0, tpot: float = 0.0) -> TrainingEntry:
    return TrainingEntry(0.4, 100, 1, 2, 0, ttft, tpot, 0.5, "", 3, 0)


async def test_training_rows_are_buffered_and_flushed_in_bulk(fake: FakeSidecar) -> None:
    c = client(fake, flush_interval_s=0.05)
    try:
        c.add_training_data_bulk([entry(ttft=120.0), entry(tpot=9.5)])
        await eventually(lambda: len(fake.training) == 2, timeout=5)
        assert c.pending_training == 0
    finally:
        await c.stop()
    first = fake.training[0]
    assert first["actual_ttft_ms"] == 120.0 and first["actual_tpot_ms"] == 0.0
    assert first["prefill_tokens_in_flight"] == 3 and "pod_type" not in first
    assert first["timestamp"].endswith("Z")


async def test_stop_flushes_what_is_left(fake: FakeSidecar) -> None:
    c = client(fake, flush_interval_s=3600)
    await c.start()
    c.add_training_data_bulk([entry(ttft=50.0)])
    await c.stop()
    assert len(fake.training) == 1
    with pytest.raises(PredictorError, match="shutting down"):
        await c.predict_bulk_strict([row()])


async def test_a_flush_over_the_sample_size_keeps_each_kinds_share(fake: FakeSidecar) -> None:
    c = client(fake, max_sample_size=10, flush_interval_s=3600)
    try:
        c.add_training_data_bulk([entry(ttft=1.0)] * 60 + [entry(tpot=1.0)] * 40)
        await c.flush_training()
    finally:
        await c.stop()
    assert sum(e["actual_ttft_ms"] > 0 for e in fake.training) == 6
    assert sum(e["actual_tpot_ms"] > 0 for e in fake.training) == 4


def test_stratified_sample_rounding_goes_to_the_largest_group() -> None:
    entries = [entry(ttft=1.0)] * 5 + [entry(tpot=1.0)] * 3 + [entry()] * 2
    got = stratified_sample(entries, 4, random.Random(0))
    assert len(got) == 4
    assert sum(e.actual_ttft_ms > 0 for e in got) == 3  # int(2.0)+remainder 1
    assert stratified_sample(entries[:3], 4, random.Random(0)) == entries[:3]


def test_config_from_gies_environment_variables() -> None:
    cfg = SidecarConfig.from_env({
        "TRAINING_SERVER_URL": "http://t:8000", "PREDICTION_SERVER_URL": "http://p1, http://p2",
        "LATENCY_MAX_SAMPLE_SIZE": "50", "LATENCY_FLUSH_INTERVAL_SEC": "3",
        "LATENCY_USE_NATIVE_XGBOOST": "FALSE", "LATENCY_HTTP_TIMEOUT_SEC": "2",
        "LATENCY_METRICS_INTERVAL_SEC": "30", "LATENCY_MAX_BULK_SIZE": "20",
        "LATENCY_COALESCE_WINDOW_MS": "0", "LATENCY_MAX_COALESCED_ROWS": "64",
        "LATENCY_MAX_CONCURRENT_DISPATCHES": "4"})
    assert cfg == SidecarConfig("http://t:8000", ("http://p1", "http://p2"), 50, 3.0, False,
                                2.0, 30.0, 20, 0.0, 64, 4)
    # As GIE's ConfigFromEnv: unparsable or out-of-range values keep the defaults.
    bad = SidecarConfig.from_env({
        "LATENCY_MAX_SAMPLE_SIZE": "-1", "LATENCY_FLUSH_INTERVAL_SEC": "1.5",
        "LATENCY_MAX_BULK_SIZE": "101", "LATENCY_COALESCE_WINDOW_MS": "x",
        "LATENCY_MAX_CONCURRENT_DISPATCHES": "0"})
    assert bad == SidecarConfig()
