"""What the predicted-latency plugins share: the prefix cache scores they read (GIE's
``PrefixCacheMatchInfo`` attribute), GIE's ``contextTTL`` decoding, and the predictor
they get.

The prefix cache score of an endpoint is matched / total prompt blocks in the config's
``approx-prefix-cache-producer`` — the one declared, or the one ``prefix-cache-scorer``
creates — 0 without a producer (GIE: no attribute, score 0).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from epp import keys
from epp.errors import ConfigError
from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import ResponseTimings
from epp.latency.predictor import LatencyPredictor, predictor_from_env
from epp.latency.tracking import LatencyTracker, prefix_score
from epp.scheduling.plugins.prefix import ApproxPrefixCacheProducer
from epp.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult

CONSUMES_PREFIX = {fw.DATA_KEY_PREFIX_CACHE_MATCH_INFO: "PrefixCacheMatchInfo"}
CONSUMES_LATENCY = {fw.DATA_KEY_LATENCY_PREDICTION_INFO: "LatencyPredictionInfo"}
PRODUCES_LATENCY = CONSUMES_LATENCY
# What the plugins need to see of the response (docs/plugins.md, "Response bodies").
NEEDS_BODY = frozenset({"body"})

assert keys.PLUGIN_STATE_LATENCY_PREDICTIONS == fw.DATA_KEY_LATENCY_PREDICTION_INFO


class PrefixScores:
    """The config's prefix cache match, per endpoint (module doc)."""

    def __init__(self) -> None:
        self._handle: PluginHandle | None = None
        self._producer: ApproxPrefixCacheProducer | None = None

    def bind(self, handle: PluginHandle) -> None:
        # The producer may be created by a prefix-cache-scorer bound after this plugin:
        # look it up at the first request.
        self._handle = handle

    def producer(self) -> ApproxPrefixCacheProducer | None:
        if self._producer is None and self._handle is not None:
            found = self._handle.of_type(ApproxPrefixCacheProducer)
            self._producer = found[0] if found else None
        return self._producer

    def scores(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> dict[str, float]:
        producer = self.producer()
        if producer is None or not endpoints:
            return {}
        total, matched = producer.match(state, request, endpoints)
        return {e.key: prefix_score(total, matched.get(e.key, 0)) for e in endpoints}


_GO_DURATION = re.compile(r"([0-9]*(?:\.[0-9]*)?)(ns|us|µs|μs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
             "m": 60.0, "h": 3600.0}


def parse_context_ttl(value: Any, path: str) -> float:
    """``contextTTL`` in seconds. GIE decodes it as a Go ``time.Duration`` from JSON — an
    integer of nanoseconds (``300000000000`` is 5m); a Go duration string (``"5m"``,
    ``"1h30m"``), which GIE's JSON decoding rejects, is accepted too."""
    if isinstance(value, bool):
        raise ConfigError(f"{path}: expected nanoseconds (an integer) or a duration like "
                          f"'5m', got {value!r}")
    if isinstance(value, int):
        return value / 1e9
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.lstrip("+-")
        if text == "0":
            return 0.0
        pos, total = 0, 0.0
        while pos < len(text):
            m = _GO_DURATION.match(text, pos)
            if m is None or m.group(1) in ("", "."):
                break
            total += float(m.group(1)) * _GO_UNITS[m.group(2)]
            pos = m.end()
        if pos == len(text) and pos > 0:
            return sign * total
    raise ConfigError(f"{path}: expected nanoseconds (an integer, as GIE decodes a "
                      f"time.Duration) or a duration like '5m', got {value!r}")


def make_predictor(predictor: LatencyPredictor | None) -> LatencyPredictor:
    """``predictor``, or the one the environment selects (epp/latency/predictor.py)."""
    return predictor if predictor is not None else predictor_from_env()


class TrackedPredictor:
    """The request lifecycle and background hooks the two predictor plugins share
    (``predicted-latency-producer`` and ``predicted-latency-scorer``): each hands them to
    its :class:`~epp.latency.tracking.LatencyTracker` (``self.tracker``) and starts and
    stops its predictor (``self.predictor``: the sidecar client's tasks)."""

    tracker: LatencyTracker
    predictor: LatencyPredictor

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        self.tracker.pre_request(request, result)

    def response_measured(self, request: LLMRequest, endpoint_key: str,
                          timings: ResponseTimings) -> None:
        self.tracker.response_measured(request, endpoint_key, timings)

    def response_complete(self, request: LLMRequest, endpoint_key: str, aborted: bool) -> None:
        self.tracker.response_complete(request, endpoint_key, aborted)

    def endpoint_removed(self, key: str) -> None:
        self.tracker.endpoint_removed(key)

    async def start_background(self) -> None:
        await self.predictor.start()

    async def stop_background(self) -> None:
        await self.predictor.stop()
