"""The latency predictor the predicted-latency plugins use, and which one they get.

Two implementations of :class:`LatencyPredictor`:

- :class:`~epp.latency.sidecar.SidecarPredictor`: GIE's latency-predictor sidecar
  (a training server and prediction servers, latencypredictor/ in GIE), spoken to as
  GIE's Go client does (sidecars/latencypredictorasync). Chosen when
  ``TRAINING_SERVER_URL`` or ``PREDICTION_SERVER_URL`` is set — the variables GIE's EPP
  reads (with GIE's other ``LATENCY_*`` variables, :class:`SidecarConfig`).
- :class:`~epp.latency.online.OnlinePredictor`: a model learned in this process from the
  EPP's own observations. The default: GIE's Go EPP always uses a sidecar (on
  ``localhost:8000``/``8001`` when the variables are unset); this EPP predicts without one.

:class:`~epp.latency.sidecar.SidecarConfig` reads GIE's other ``LATENCY_*`` variables.

Each predicted-latency plugin makes its own predictor, as GIE's factories do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from epp import keys
from epp.latency.online import OnlinePredictor
from epp.latency.sidecar import SidecarConfig, SidecarPredictor
from epp.latency.types import (
    BulkPredictionResponse,
    PredictionRequest,
    PredictionResponse,
    TrainingEntry,
)


@runtime_checkable
class LatencyPredictor(Protocol):
    """GIE's ``PredictorInterface``, with Python's split between waiting and not."""

    kind: str  # "sidecar" or "in-process" (logs, docs)

    async def predict_bulk_strict(
            self, requests: Sequence[PredictionRequest]) -> BulkPredictionResponse:
        """One prediction per request, in order; raises ``PredictorError`` when any
        fails (GIE's ``PredictBulkStrict``)."""
        ...

    def predict_local(self, request: PredictionRequest) -> PredictionResponse | None:
        """A prediction made without I/O, or None when this predictor needs a round trip
        for it (the sidecar's tree models). Raises ``PredictorError``."""
        ...

    def add_training_data_bulk(self, entries: Sequence[TrainingEntry]) -> None:
        """Learn from observed latencies (the sidecar client buffers them for its next
        flush; the in-process model learns at once). Never raises."""
        ...

    async def start(self) -> None:
        """Start background work (idempotent; also started lazily on first use)."""
        ...

    async def stop(self) -> None:
        """Stop background work; the sidecar client flushes what it buffered."""
        ...


def sidecar_configured(env: Mapping[str, str]) -> bool:
    """True when the environment names GIE's latency-predictor sidecar."""
    return bool(env.get(keys.ENV_TRAINING_SERVER_URL) or env.get(keys.ENV_PREDICTION_SERVER_URL))


def predictor_from_env(env: Mapping[str, str] | None = None) -> LatencyPredictor:
    """The sidecar client when the environment names a sidecar, else the in-process
    model (module doc)."""
    env = os.environ if env is None else env
    if sidecar_configured(env):
        return SidecarPredictor(SidecarConfig.from_env(env))
    return OnlinePredictor()
