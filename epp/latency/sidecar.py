"""A client of GIE's latency-predictor sidecar, speaking its HTTP API as GIE's Go client
does (sidecars/latencypredictorasync in GIE v1.5.0; servers: latencypredictor/
prediction_server.py and training_server.py).

Endpoints, on a prediction server (one of ``PREDICTION_SERVER_URL``, picked at random per
call; the training server when none is given) and the training server
(``TRAINING_SERVER_URL``):

- ``POST {prediction}/predict/bulk/strict`` ``{"requests": [PredictionRequest…]}`` →
  ``{"predictions": [PredictionResponse…], "total_requests", "successful_predictions",
  "failed_predictions", "processing_time_ms"}``: the per-request bulk prediction of the
  plugins. Concurrent callers are coalesced (``LATENCY_COALESCE_WINDOW_MS``, default 1 ms;
  ``LATENCY_MAX_COALESCED_ROWS`` dispatches early; ``LATENCY_MAX_CONCURRENT_DISPATCHES``
  calls in flight at most) into one call whose answer is sliced back to each caller.
- ``POST {prediction}/predict/bulk`` (partial failures allowed) and ``POST
  {prediction}/predict`` (one row; tree models) — :meth:`SidecarPredictor.predict_bulk`,
  :meth:`SidecarPredictor.predict`.
- ``POST {training}/add_training_data_bulk`` ``{"entries": [TrainingEntry…]}`` → 202:
  training rows are buffered and flushed every ``LATENCY_FLUSH_INTERVAL_SEC`` (1 s), at
  most ``LATENCY_MAX_SAMPLE_SIZE`` (1000) per flush, stratified like GIE's (TTFT, TPOT
  and other rows keep their shares).
- ``GET {prediction}/status`` (model type, objective, quantile), ``GET
  {training}/model/download/info`` (model type) and, every
  ``LATENCY_METRICS_INTERVAL_SEC`` (60 s), ``GET {training}/metrics`` (Bayesian-ridge
  coefficients in Prometheus text, for predictions without a round trip) or the XGBoost
  trees (``/model/{ttft,tpot}/xgb/json``, cached as GIE caches them).

Every call has ``LATENCY_HTTP_TIMEOUT_SEC`` (10 s); the plugins bound the prediction of a
request by GIE's PrepareData budget (400 ms) as well. A failed call raises
``PredictorError`` and the plugins go on without predictions. Background work (the flush
and refresh loop) starts on first use or :meth:`SidecarPredictor.start` and ends with
:meth:`SidecarPredictor.stop` (a last flush).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from epp import keys
from epp.latency.types import (
    MODEL_BAYESIAN_RIDGE,
    MODEL_LIGHTGBM,
    MODEL_XGBOOST,
    OBJECTIVE_QUANTILE,
    BulkPredictionResponse,
    PredictionRequest,
    PredictionResponse,
    PredictorError,
    TrainingEntry,
    validate_prediction_request,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SidecarConfig:
    """GIE's client ``Config`` (types.go ``DefaultConfig``), read from the environment as
    ``ConfigFromEnv`` does — an unparsable or out-of-range value keeps the default."""

    training_url: str = "http://localhost:8000"
    prediction_urls: tuple[str, ...] = ("http://localhost:8001",)
    max_sample_size: int = 1000
    flush_interval_s: float = 1.0
    use_native_xgboost: bool = True
    http_timeout_s: float = 10.0
    metrics_refresh_interval_s: float = 60.0
    max_bulk_size: int = 100
    coalesce_window_s: float = 0.001
    max_coalesced_rows: int = 0
    max_concurrent_dispatches: int = 36

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SidecarConfig:
        d = cls()
        training = env.get(keys.ENV_TRAINING_SERVER_URL) or d.training_url
        urls = d.prediction_urls
        raw_urls = env.get(keys.ENV_PREDICTION_SERVER_URL)
        if raw_urls:
            urls = tuple(u.strip() for u in raw_urls.split(","))

        def positive(name: str, default: int, limit: int | None = None) -> int:
            v = _int(env.get(name))
            if v is None or v <= 0 or (limit is not None and v > limit):
                return default
            return v

        def non_negative(name: str, default: int) -> int:
            v = _int(env.get(name))
            return default if v is None or v < 0 else v

        native = d.use_native_xgboost
        raw_native = env.get(keys.ENV_LATENCY_USE_NATIVE_XGBOOST)
        if raw_native:
            native = raw_native.lower() == "true"
        dispatches = _int(env.get(keys.ENV_LATENCY_MAX_CONCURRENT_DISPATCHES))
        if env.get(keys.ENV_LATENCY_MAX_CONCURRENT_DISPATCHES) and (
                dispatches is None or dispatches <= 0):
            log.warning("%s=%r is invalid (must be > 0), using default %d",
                        keys.ENV_LATENCY_MAX_CONCURRENT_DISPATCHES,
                        env.get(keys.ENV_LATENCY_MAX_CONCURRENT_DISPATCHES),
                        d.max_concurrent_dispatches)
        return cls(
            training_url=training,
            prediction_urls=urls,
            max_sample_size=positive(keys.ENV_LATENCY_MAX_SAMPLE_SIZE, d.max_sample_size),
            flush_interval_s=float(positive(keys.ENV_LATENCY_FLUSH_INTERVAL_SEC, 1)),
            use_native_xgboost=native,
            http_timeout_s=float(positive(keys.ENV_LATENCY_HTTP_TIMEOUT_SEC, 10)),
            metrics_refresh_interval_s=float(positive(keys.ENV_LATENCY_METRICS_INTERVAL_SEC,
                                                      60)),
            max_bulk_size=positive(keys.ENV_LATENCY_MAX_BULK_SIZE, d.max_bulk_size, 100),
            coalesce_window_s=non_negative(keys.ENV_LATENCY_COALESCE_WINDOW_MS, 1) / 1000.0,
            max_coalesced_rows=non_negative(keys.ENV_LATENCY_MAX_COALESCED_ROWS,
                                            d.max_coalesced_rows),
            max_concurrent_dispatches=(dispatches if dispatches is not None and dispatches > 0
                                       else d.max_concurrent_dispatches),
        )


@dataclass
class ModelCoefficients:
    """The Bayesian-ridge coefficients the training server publishes on /metrics."""

    ttft_intercept: float = 0.0
    ttft: dict[str, float] = field(default_factory=dict)
    tpot_intercept: float = 0.0
    tpot: dict[str, float] = field(default_factory=dict)


def parse_coefficients(text: str) -> ModelCoefficients:
    """GIE's ``parsePrometheusMetrics``: ``ttft_intercept``, ``tpot_intercept``,
    ``ttft_coef{feature="…"}``, ``tpot_coef{feature="…"}``; other lines are skipped."""
    c = ModelCoefficients()
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        metric, _, value_text = line.rpartition(" ")
        if not metric:
            continue
        try:
            value = float(value_text)
        except ValueError:
            continue
        name, _, labels = metric.strip().partition("{")
        if name == "ttft_intercept":
            c.ttft_intercept = value
        elif name == "tpot_intercept":
            c.tpot_intercept = value
        elif name in ("ttft_coef", "tpot_coef"):
            feature = _label(labels, "feature")
            if feature:
                (c.ttft if name == "ttft_coef" else c.tpot)[feature] = value
    return c


def _label(labels: str, name: str) -> str:
    marker = f'{name}="'
    start = labels.find(marker)
    if start < 0:
        return ""
    start += len(marker)
    end = labels.find('"', start)
    return labels[start:end] if end >= 0 else ""


def stratified_sample(entries: Sequence[TrainingEntry], max_size: int,
                      rng: random.Random) -> list[TrainingEntry]:
    """GIE's ``randomSample``: at most ``max_size`` entries, TTFT rows (actual TTFT > 0),
    TPOT rows and the rest each keeping its share; the rounding remainder goes to the
    largest group."""
    if len(entries) <= max_size:
        return list(entries)
    groups: list[list[TrainingEntry]] = [[], [], []]
    for e in entries:
        groups[0 if e.actual_ttft_ms > 0 else 1 if e.actual_tpot_ms > 0 else 2].append(e)
    total = len(entries)
    sizes = [int(len(g) / total * max_size) for g in groups]
    taken = sum(sizes)
    lengths = [len(g) for g in groups]
    if taken < max_size:
        # to the largest original group (ties: TTFT, then TPOT, then other)
        i = 0 if lengths[0] >= lengths[1] and lengths[0] >= lengths[2] else (
            1 if lengths[1] >= lengths[2] else 2)
        sizes[i] += max_size - taken
    elif taken > max_size:
        i = 0 if sizes[0] >= sizes[1] and sizes[0] >= sizes[2] else (
            1 if sizes[1] >= sizes[2] else 2)
        sizes[i] -= taken - max_size
    out: list[TrainingEntry] = []
    for g, n in zip(groups, sizes, strict=True):
        if n > 0 and g:
            out.extend(g if len(g) <= n else rng.sample(g, n))
    return out


@dataclass
class _Submission:
    rows: Sequence[PredictionRequest]
    future: asyncio.Future[BulkPredictionResponse]


class SidecarPredictor:
    """GIE's latency-predictor sidecar client (module doc)."""

    kind = "sidecar"

    def __init__(self, config: SidecarConfig | None = None,
                 rng: random.Random | None = None) -> None:
        self.config = config or SidecarConfig()
        self._rng = rng or random.Random()
        self._session: aiohttp.ClientSession | None = None
        self._background: asyncio.Task[None] | None = None
        self._closed = False
        self._pending: list[TrainingEntry] = []
        # What the servers said (GIE's serverStatus, modelInfo, cachedMetrics).
        self.server_status: dict[str, Any] | None = None
        self.model_info: dict[str, Any] | None = None
        self.coefficients: ModelCoefficients | None = None
        self.xgboost_trees: tuple[Any, Any] | None = None
        # The coalescer of predict_bulk_strict callers.
        self._batch: list[_Submission] = []
        self._batch_rows = 0
        self._timer: asyncio.TimerHandle | None = None
        self._dispatch_slots: asyncio.Semaphore | None = None
        self._dispatches: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._ensure_running()

    def _ensure_running(self) -> None:
        """Open the HTTP session and start the background loop (needs the running loop;
        the first status and model-info refresh happen in the background)."""
        if self._session is not None or self._closed:
            return
        loop = asyncio.get_running_loop()
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.config.http_timeout_s))
        self._dispatch_slots = asyncio.Semaphore(self.config.max_concurrent_dispatches)
        self._background = loop.create_task(self._run_background())
        log.info("latency predictor sidecar client started: training %s, prediction %s, "
                 "max sample size %d, flush interval %gs, max bulk size %d",
                 self.config.training_url, ", ".join(self.config.prediction_urls),
                 self.config.max_sample_size, self.config.flush_interval_s,
                 self.config.max_bulk_size)

    async def stop(self) -> None:
        """Stop the loop, fail queued predictions, flush the training buffer and refresh
        once more (as GIE's ``Stop``), close the session."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for sub in self._batch:
            if not sub.future.done():
                sub.future.set_exception(PredictorError("predictor shutting down"))
        self._batch, self._batch_rows = [], 0
        if self._background is not None:
            self._background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._background
        for task in list(self._dispatches):
            task.cancel()
        for task in list(self._dispatches):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            with contextlib.suppress(PredictorError):
                await self.flush_training()
            with contextlib.suppress(PredictorError):
                await self.refresh_metrics()
            await self._session.close()
            self._session = None

    async def _run_background(self) -> None:
        """GIE's ``backgroundLoop``: flush every flush interval; refresh metrics and the
        server status every metrics interval (once at start too)."""
        cfg = self.config
        for refresh in (self.refresh_server_status, self.refresh_metrics):
            try:
                await refresh()
            except PredictorError as e:
                log.warning("latency predictor: %s (will retry in the background)", e)
        loop = asyncio.get_running_loop()
        next_refresh = loop.time() + cfg.metrics_refresh_interval_s
        while True:
            await asyncio.sleep(cfg.flush_interval_s)
            try:
                await self.flush_training()
            except PredictorError as e:
                log.warning("latency predictor: %s", e)
            if loop.time() >= next_refresh:
                next_refresh = loop.time() + cfg.metrics_refresh_interval_s
                try:
                    await self.refresh_metrics()
                    await self.refresh_server_status()
                except PredictorError as e:
                    log.warning("latency predictor: %s", e)

    # ------------------------------------------------------------------ HTTP

    def _prediction_url(self) -> str:
        urls = self.config.prediction_urls
        if not urls:
            return self.config.training_url
        return urls[0] if len(urls) == 1 else urls[self._rng.randrange(len(urls))]

    async def _call(self, method: str, url: str, payload: Any = None,
                    expect: int = 200) -> bytes:
        self._ensure_running()
        session = self._session
        if session is None:
            raise PredictorError("predictor shutting down")
        data = None if payload is None else orjson.dumps(payload)
        headers = {"content-type": "application/json"} if data is not None else None
        try:
            async with session.request(method, url, data=data, headers=headers) as resp:
                body = await resp.read()
                if resp.status != expect:
                    raise PredictorError(f"{method} {url}: status {resp.status}, body: "
                                         f"{body[:200].decode('utf-8', 'replace')}")
                return body
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise PredictorError(f"{method} {url} failed: {type(e).__name__}: {e}") from e

    async def _json(self, method: str, url: str, payload: Any = None) -> Any:
        body = await self._call(method, url, payload)
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise PredictorError(f"{method} {url}: answer is not JSON: {e}") from e

    # ------------------------------------------------------------------ status, models

    async def refresh_server_status(self) -> None:
        status = await self._json("GET", self._prediction_url() + "/status")
        if not isinstance(status, dict):
            raise PredictorError(f"/status answered {status!r}")
        self.server_status = status

    async def refresh_model_info(self) -> None:
        info = await self._json("GET", self.config.training_url + "/model/download/info")
        if not isinstance(info, dict):
            raise PredictorError(f"/model/download/info answered {info!r}")
        self.model_info = info

    async def refresh_metrics(self) -> None:
        """GIE's ``refreshMetrics``: the model type, then what predicting locally needs."""
        await self.refresh_model_info()
        model_type = (self.model_info or {}).get("model_type") or ""
        if model_type == MODEL_BAYESIAN_RIDGE:
            text = (await self._call("GET", self.config.training_url + "/metrics")).decode(
                "utf-8", "replace")
            self.coefficients = parse_coefficients(text)
        elif model_type == MODEL_XGBOOST and self.config.use_native_xgboost:
            ttft = await self._json("GET", self.config.training_url + "/model/ttft/xgb/json")
            tpot = await self._json("GET", self.config.training_url + "/model/tpot/xgb/json")
            self.xgboost_trees = (ttft, tpot)

    def model_type(self) -> str:
        """The server status's model type, else the model info's ("": not known yet)."""
        for source in (self.server_status, self.model_info):
            if source is not None:
                return str(source.get("model_type") or "")
        return ""

    def _objective(self) -> tuple[str, float]:
        for source in (self.server_status, self.model_info):
            if source is not None:
                q = source.get("quantile")
                return (str(source.get("objective_type") or OBJECTIVE_QUANTILE),
                        float(q) if isinstance(q, (int, float)) and q > 0 else 0.9)
        return OBJECTIVE_QUANTILE, 0.9

    # ------------------------------------------------------------------ predictions

    def _check(self, requests: Sequence[PredictionRequest]) -> None:
        if not requests:
            raise PredictorError("no prediction requests provided")
        if len(requests) > self.config.max_bulk_size:
            raise PredictorError(
                f"too many requests: {len(requests)} (max: {self.config.max_bulk_size})")
        for i, r in enumerate(requests):
            try:
                validate_prediction_request(r)
            except PredictorError as e:
                raise PredictorError(f"validation failed for request {i}: {e}") from None

    async def predict_bulk_strict(
            self, requests: Sequence[PredictionRequest]) -> BulkPredictionResponse:
        """GIE's ``PredictBulkStrict`` (coalesced when the window is > 0)."""
        self._check(requests)
        if self.config.coalesce_window_s > 0:
            return await self._submit(requests)
        return await self._bulk_strict_http(requests)

    async def _bulk_strict_http(
            self, requests: Sequence[PredictionRequest]) -> BulkPredictionResponse:
        url = self._prediction_url() + "/predict/bulk/strict"
        return _bulk_response(await self._json(
            "POST", url, {"requests": [r.to_json() for r in requests]}), url)

    async def predict_bulk(self, requests: Sequence[PredictionRequest]) -> BulkPredictionResponse:
        """GIE's ``PredictBulk``: failed rows are left out of ``predictions``."""
        self._check(requests)
        url = self._prediction_url() + "/predict/bulk"
        return _bulk_response(await self._json(
            "POST", url, {"requests": [r.to_json() for r in requests]}), url, partial=True)

    async def predict(self, request: PredictionRequest) -> PredictionResponse:
        """GIE's ``Predict``: Bayesian ridge from the cached coefficients, tree models
        over HTTP (``POST /predict``)."""
        local = self.predict_local(request)
        if local is not None:
            return local
        return PredictionResponse.from_json(
            await self._json("POST", self._prediction_url() + "/predict", request.to_json()))

    def predict_local(self, request: PredictionRequest) -> PredictionResponse | None:
        """A Bayesian-ridge prediction from the cached coefficients (GIE's
        ``predictBayesianRidge``); None for tree models (they need ``/predict``)."""
        model_type = self.model_type()
        if not model_type:
            raise PredictorError("model type not yet available from server")
        if model_type in (MODEL_XGBOOST, MODEL_LIGHTGBM):
            return None
        if model_type != MODEL_BAYESIAN_RIDGE:
            raise PredictorError(f"unsupported or unknown model type: {model_type}")
        c = self.coefficients
        if c is None:
            raise PredictorError("no cached Bayesian Ridge coefficients available for "
                                 "prediction")
        r = request
        ttft = (c.ttft_intercept
                + c.ttft.get("kv_cache_percentage", 0.0) * r.kv_cache_percentage
                + c.ttft.get("input_token_length", 0.0) * r.input_token_length
                + c.ttft.get("num_request_waiting", 0.0) * r.num_request_waiting
                + c.ttft.get("num_request_running", 0.0) * r.num_request_running
                + c.ttft.get("prefix_cache_score", 0.0) * r.prefix_cache_score)
        tpot = (c.tpot_intercept
                + c.tpot.get("kv_cache_percentage", 0.0) * r.kv_cache_percentage
                + c.tpot.get("input_token_length", 0.0) * r.input_token_length
                + c.tpot.get("num_request_waiting", 0.0) * r.num_request_waiting
                + c.tpot.get("num_request_running", 0.0) * r.num_request_running
                + c.tpot.get("num_tokens_generated", 0.0) * r.num_tokens_generated)
        objective, quantile = self._objective()
        return PredictionResponse(ttft, tpot, MODEL_BAYESIAN_RIDGE, objective, quantile)

    # --- coalescing (GIE's coalescer.go)

    async def _submit(self, rows: Sequence[PredictionRequest]) -> BulkPredictionResponse:
        if self._closed:
            raise PredictorError("predictor shutting down")
        self._ensure_running()
        loop = asyncio.get_running_loop()
        sub = _Submission(rows, loop.create_future())
        self._batch.append(sub)
        self._batch_rows += len(rows)
        if self._timer is None:
            self._timer = loop.call_later(self.config.coalesce_window_s, self._dispatch)
        cap = self.config.max_coalesced_rows
        if cap > 0 and self._batch_rows >= cap:
            self._dispatch()
        return await sub.future

    def _dispatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._batch, self._batch_rows = self._batch, [], 0
        if batch:
            task = asyncio.get_running_loop().create_task(self._dispatch_batch(batch))
            self._dispatches.add(task)
            task.add_done_callback(self._dispatches.discard)

    async def _dispatch_batch(self, batch: list[_Submission]) -> None:
        """One HTTP call for every caller of the window; each gets its own slice."""
        assert self._dispatch_slots is not None
        rows = [r for sub in batch for r in sub.rows]
        try:
            async with self._dispatch_slots:
                log.debug("dispatching coalesced batch: %d callers, %d rows", len(batch),
                          len(rows))
                resp: BulkPredictionResponse | None = await self._bulk_strict_http(rows)
                error: PredictorError | None = None
        except PredictorError as e:
            resp, error = None, e
        except asyncio.CancelledError:
            resp, error = None, PredictorError("predictor shutting down")
        offset = 0
        for sub in batch:
            n = len(sub.rows)
            start, offset = offset, offset + n
            if sub.future.done():  # its caller gave up (PrepareData budget)
                continue
            if resp is None:
                sub.future.set_exception(error or PredictorError("bulk prediction failed"))
            elif start + n > len(resp.predictions):
                sub.future.set_exception(PredictorError(
                    f"coalesced response too short: expected items [{start}:{start + n}] "
                    f"but got {len(resp.predictions)} predictions"))
            else:
                sub.future.set_result(BulkPredictionResponse(
                    resp.predictions[start:start + n], n, n, 0, resp.processing_time_ms))

    # ------------------------------------------------------------------ training

    def add_training_data_bulk(self, entries: Sequence[TrainingEntry]) -> None:
        """Buffer ``entries`` for the next flush (GIE's ``AddTrainingDataBulk``)."""
        self._pending.extend(entries)
        with contextlib.suppress(RuntimeError):  # no running loop: the next use starts it
            self._ensure_running()

    @property
    def pending_training(self) -> int:
        return len(self._pending)

    async def flush_training(self) -> None:
        """POST the buffered entries (sampled down to the max sample size); GIE's
        ``flushTraining``: a failed flush drops them."""
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        if len(batch) > self.config.max_sample_size:
            original = len(batch)
            batch = stratified_sample(batch, self.config.max_sample_size, self._rng)
            log.debug("sampled training entries for flush: %d of %d", len(batch), original)
        t0 = time.perf_counter()
        await self._call("POST", self.config.training_url + "/add_training_data_bulk",
                         {"entries": [e.to_json() for e in batch]}, expect=202)
        log.debug("flushed %d training entries in %.1f ms", len(batch),
                  1000 * (time.perf_counter() - t0))


def _bulk_response(doc: Any, url: str, partial: bool = False) -> BulkPredictionResponse:
    if not isinstance(doc, Mapping) or not isinstance(doc.get("predictions"), list):
        raise PredictorError(f"{url}: answer has no predictions list")
    preds = [PredictionResponse.from_json(p) for p in doc["predictions"]
             if not (partial and p is None)]

    def num(key: str) -> float:
        v = doc.get(key)
        return float(v) if isinstance(v, (int, float)) else 0.0

    return BulkPredictionResponse(tuple(preds), int(num("total_requests")),
                                  int(num("successful_predictions")),
                                  int(num("failed_predictions")), num("processing_time_ms"))


def _int(raw: str | None) -> int | None:
    """Go's ``strconv.Atoi``: an optional sign and digits."""
    if not raw:
        return None
    body = raw[1:] if raw[0] in "+-" else raw
    if not body.isascii() or not body.isdigit():
        return None
    return int(raw)
