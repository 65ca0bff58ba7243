"""``concurrency-detector`` (GIE): saturation from the requests (or estimated tokens) the
EPP has in flight, usable as the config's ``saturationDetector`` and as a filter.

- Saturation: in-flight / capacity over the endpoints, capacity = endpoints ×
  ``maxConcurrency`` (``tokens`` mode: × ``maxTokenConcurrency``); 1.0 when there are no
  endpoints. The pool is saturated at >= 1.0 (GIE's legacy admission rule).
- Filter: keeps the endpoints whose in-flight count is below ``max × (1 + headroom)``
  (truncated to an integer, as GIE does); no fail-open — with every endpoint at its limit
  the profile fails.

In-flight counts come from the config's ``inflight-load-producer`` (counted when a
request is routed, released when its response ends); when none is declared the detector
creates one (``<name>-producer``). Parameters (GIE's): ``concurrencyMode`` (``requests``
or ``tokens``), ``maxConcurrency`` (100, > 0), ``maxTokenConcurrency`` (1000000, > 0),
``headroom`` (0, >= 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import param
from epp.scheduling.plugins.load import InFlightLoadProducer
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

MODE_REQUESTS = "requests"
MODE_TOKENS = "tokens"


def _mode(value: Any, path: str) -> str:
    if value not in (MODE_REQUESTS, MODE_TOKENS):
        raise ConfigError(f"{path}: unsupported concurrencyMode {value!r}; use "
                          f"{MODE_REQUESTS!r} or {MODE_TOKENS!r}")
    return str(value)


@dataclass(frozen=True)
class ConcurrencyDetectorParameters:
    concurrency_mode: str = param("concurrencyMode", MODE_REQUESTS, parse=_mode)
    max_concurrency: int = param("maxConcurrency", 100, minimum=1)
    max_token_concurrency: int = param("maxTokenConcurrency", 1_000_000, minimum=1)
    headroom: float = param("headroom", 0.0, minimum=0.0)


class ConcurrencyDetector:
    type_name = "concurrency-detector"
    Parameters = ConcurrencyDetectorParameters

    def __init__(self, name: str, mode: str = MODE_REQUESTS, max_concurrency: int = 100,
                 max_token_concurrency: int = 1_000_000, headroom: float = 0.0) -> None:
        self.name = name
        self.mode = mode
        self.max_concurrency = max_concurrency
        self.max_token_concurrency = max_token_concurrency
        self.headroom = headroom
        self.producer: InFlightLoadProducer | None = None

    @classmethod
    def from_params(cls, name: str, params: ConcurrencyDetectorParameters,
                    handle: PluginHandle) -> ConcurrencyDetector:
        return cls(name, params.concurrency_mode, params.max_concurrency,
                   params.max_token_concurrency, params.headroom)

    def bind(self, handle: PluginHandle) -> None:
        """After every plugin is built: find the in-flight producer, or create one."""
        producers = handle.of_type(InFlightLoadProducer)
        if producers:
            self.producer = producers[0]
            return
        self.producer = InFlightLoadProducer(f"{self.name}-producer")
        handle.add(self.producer)

    @property
    def _capacity(self) -> int:
        return self.max_token_concurrency if self.mode == MODE_TOKENS else self.max_concurrency

    def _load(self, e: Endpoint) -> int:
        if self.producer is None:
            return 0
        tracker = self.producer.tracker
        counts = tracker.tokens if self.mode == MODE_TOKENS else tracker.requests
        return counts.get(e.key, 0)

    # --- SaturationDetector ---

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        if not endpoints:
            return 1.0
        return sum(self._load(e) for e in endpoints) / (self._capacity * len(endpoints))

    def is_saturated(self, endpoints: Sequence[Endpoint]) -> bool:
        return self.saturation(endpoints) >= 1.0

    # --- Filter ---

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        limit = int(self._capacity * (1.0 + self.headroom))
        return [e for e in endpoints if self._load(e) < limit]
