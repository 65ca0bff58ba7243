"""Explained decisions: why each request went where it went.

A decision record holds, per profile run, the candidates, the endpoints each filter
dropped (and by which filter), every scorer's score per endpoint with its weight, the
weighted totals and what the picker picked. Records are built only when asked for (the
scheduler records nothing otherwise) — by a client header the operator has allowed
(``--enable-explain-header``) or for the in-memory history behind the admin endpoint
(``--explain-history N``, served at ``GET /debug/decisions`` on the metrics port).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import orjson

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
