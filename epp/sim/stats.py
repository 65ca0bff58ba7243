"""Counters and histograms one simulated engine accumulates (exported by epp.sim.metrics).

Plain numbers, no Prometheus objects: the metrics module turns a snapshot into text at
scrape time. Bucket bounds follow vLLM's.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "E2E_BUCKETS",
    "TPOT_BUCKETS",
    "TTFT_BUCKETS",
    "EngineStats",
    "Histogram",
]

TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS: Final = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass(slots=True)
class Histogram:
    """A cumulative-on-export histogram: per-bucket counts (``le`` upper bounds, plus
    +Inf), a sum and a count. Observations are seconds."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(self.bounds):
            raise ValueError("histogram bounds must be sorted")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose bound is >= it."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count), ..., ("+Inf", count)]`` as Prometheus exposes it."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", self.count))
        return out


@dataclass(slots=True)
class EngineStats:
    """Everything an engine counts since it was built. Token counts are tokens."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: Counter[str] = field(default_factory=Counter)
    """Finished requests by ``finished_reason`` (``length``; aborted ones not counted)."""
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    steps: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
