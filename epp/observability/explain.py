"""Explained decisions: why each request went where it went.

A decision record holds, per profile run, the candidates, the endpoints each filter
dropped (and by which filter), every scorer's score per endpoint with its weight, the
weighted totals and what the picker picked. Records are built only when asked for — by a
client header the operator has allowed (``--enable-explain-header``) or for the in-memory
history behind the admin endpoint (``--explain-history N``, served at
``GET /debug/decisions`` on the metrics port): then the scheduling core gives the request
an :class:`ExplainObserver`, the only decision observer that asks the scheduler for
per-plugin detail. Otherwise the scheduler reports nothing and nothing is paid.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from epp import keys
from epp.framework.interfaces import Filter, Picker, Scorer
from epp.observability.observer import Observer
from epp.scheduling.types import (
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    SchedulingResult,
    ScoredEndpoint,
)

MAX_HEADER_BYTES = 8192


class DecisionLog:
    """The last ``keep`` decision records, newest last."""

    def __init__(self, keep: int) -> None:
        self._records: deque[dict[str, Any]] = deque(maxlen=max(1, keep))

    def add(self, record: dict[str, Any]) -> None:
        self._records.append(record)

    def last(self, n: int | None = None) -> list[dict[str, Any]]:
        records = list(self._records)
        return records if n is None else records[-n:] if n > 0 else []


def new_record(request_id: str, model: str, target_model: str, candidates: int) -> dict[str, Any]:
    return {"time": time.time(), "request_id": request_id, "model": model,
            "target_model": target_model, "candidates": candidates, "profiles": {}}


def header_value(record: dict[str, Any]) -> str:
    """The record as one-line JSON for a response header, summarised if it is too large."""
    full = orjson.dumps(record)
    if len(full) <= MAX_HEADER_BYTES:
        return full.decode()
    short = {k: v for k, v in record.items() if k != "profiles"}
    short["profiles"] = {}
    for name, rec in record.get("profiles", {}).items():
        totals = sorted(rec.get("totals", {}).items(), key=lambda kv: -kv[1])[:5]
        short["profiles"][name] = {"picked": rec.get("picked", []), "top_totals": dict(totals),
                                   "dropped": len(rec.get("dropped", {}))}
    short["truncated"] = True
    return orjson.dumps(short).decode()[:MAX_HEADER_BYTES]


def asks_for_explain(headers: Mapping[str, str]) -> bool:
    """The client sent ``x-epp-explain: true`` (or ``1``, ``yes``)."""
    return headers.get(keys.HEADER_EXPLAIN, "").lower() in ("1", "true", "yes")


class ExplainObserver(Observer):
    """Builds the decision record of one request (a DecisionObserver with ``detail``).

    The record is started with the candidates, filled by the scheduler's per-plugin hooks
    (one entry per profile run) and finished when the request is placed or fails: kept in
    ``log`` (the history) when there is one, and sent back in the ``x-epp-explain``
    response header when ``header`` is set. A request that fails before it has
    candidates, or with an internal error, leaves no record.
    """

    detail = True

    def __init__(self, log: DecisionLog | None, header: bool) -> None:
        self.log = log
        self.header = header
        self.record: dict[str, Any] | None = None
        self._profiles: dict[str, dict[str, Any]] = {}

    @classmethod
    def for_request(cls, request: LLMRequest, log: DecisionLog | None,
                    header_allowed: bool) -> ExplainObserver | None:
        """The observer ``request`` needs, or ``None`` when nobody wants its record:
        there is no history and the header is not allowed or not asked for."""
        header = header_allowed and asks_for_explain(request.headers)
        if log is None and not header:
            return None
        return cls(log, header)

    def started(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> None:
        self.record = new_record(request.request_id, request.incoming_model,
                                 request.target_model, len(candidates))
        self._profiles = self.record["profiles"]

    def profile_started(self, profile: str, candidates: Sequence[Endpoint]) -> None:
        self._profiles[profile] = {"candidates": [e.key for e in candidates], "dropped": {},
                                   "scores": {}, "totals": {}, "picked": []}

    def filtered(self, profile: str, plugin: Filter, before: Sequence[Endpoint],
                 kept: Sequence[Endpoint]) -> None:
        rec = self._profiles[profile]
        kept_keys = {e.key for e in kept}
        dropped = rec["dropped"]
        for e in before:
            if e.key not in kept_keys:
                dropped[e.key] = f"filter {plugin.name} ({plugin.type_name})"
        if not kept:
            rec["result"] = "no endpoint left after filters"

    def scored(self, profile: str, plugin: Scorer, weight: float,
               endpoints: Sequence[Endpoint], scores: Sequence[float]) -> None:
        self._profiles[profile]["scores"][plugin.name] = {
            "type": plugin.type_name, "weight": weight,
            "scores": {e.key: round(s, 4) for e, s in zip(endpoints, scores)}}

    def picked(self, profile: str, plugin: Picker, scored: Sequence[ScoredEndpoint],
               result: ProfileRunResult) -> None:
        rec = self._profiles[profile]
        rec["totals"] = {s.endpoint.key: round(s.score, 4) for s in scored}
        rec["picker"] = plugin.name
        rec["picked"] = [e.key for e in result.endpoints]

    def decided(self, request: LLMRequest, result: SchedulingResult,
                set_headers: dict[str, str], response_headers: dict[str, str]) -> None:
        record = self.record
        if record is None:
            return
        record["primary_profile"] = result.primary_profile
        record["destination"] = result.destination()
        if set_headers:
            record["headers"] = dict(set_headers)
        if self.log is not None:
            self.log.add(record)
        if self.header:
            response_headers[keys.HEADER_EXPLAIN] = header_value(record)

    def failed(self, request: LLMRequest, status: int, message: str | None) -> None:
        record = self.record
        if record is None or message is None:
            return
        record["error"] = {"status": status, "message": message}
        if self.log is not None:
            self.log.add(record)
