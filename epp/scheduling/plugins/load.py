"""Load scorers: ``load-aware-scorer``, ``active-request-scorer``, ``token-load-scorer``,
and the ``inflight-load-producer`` the token-load scorer reads.

``load-aware-scorer`` (llm-d) reads the scraped waiting queue. The other two count what
the EPP itself has in flight per endpoint, so they react to a routing decision at once,
before the next metrics scrape shows it: a request is counted at ``pre_request`` (the
first endpoint of every profile result — decode and prefill in a P/D setup) and released
at ``response_complete``, which the Director calls exactly once per routed request, on
normal completion or on a stream abort. A ``requestTimeout`` additionally drops requests
never released (a safety net; llm-d's active-request scorer has the same).

State is kept per endpoint key (``address:port``), is bounded by the number of requests in
flight, and forgets endpoints that leave the pool. These plugins are called from the
event loop only; they are not thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from epp import keys as epp_keys
from epp.errors import ConfigError
from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.params import param, positive_duration
from epp.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult

if TYPE_CHECKING:
    from epp.observability.metrics import EppMetrics

CHARS_PER_TOKEN = 4.0
OUTPUT_RATIO = 1.5


def estimate_tokens(request: LLMRequest) -> int:
    """GIE's simple estimate of a request's tokens: input + expected output.

    input = max(1, round(len(prompt) / 4)); output = round(input × 1.5), capped at the
    request's ``max_tokens`` when it gives one.
    """
    inp = max(1, round(len(request.prompt) / CHARS_PER_TOKEN))
    out = round(inp * OUTPUT_RATIO)
    if request.max_tokens is not None and request.max_tokens >= 0:
        out = min(out, request.max_tokens)
    return inp + out


@dataclass(slots=True)
class _Entry:
    keys: tuple[str, ...]
    tokens: int
    deadline: float
    tag: Any = None  # the owner's, handed to ``on_undo`` (the producer's metric labels)


class InFlightTracker:
    """In-flight requests and estimated tokens per endpoint key.

    ``add`` returns an entry id; ``release`` undoes exactly that entry (a second release
    of the same id is a no-op). With ``timeout`` (seconds), entries older than it are
    dropped by :meth:`expire`, which ``add`` and ``release`` call. Memory is bounded by
    the number of live entries plus one counter per endpoint with work in flight.
    """

    def __init__(self, timeout: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._clock = clock
        self.requests: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self._entries: dict[int, _Entry] = {}  # insertion order = deadline order
        self._last_id = 0
        # Called with each entry undone (released or expired) that carries a tag.
        self.on_undo: Callable[[_Entry], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, keys: Sequence[str], tokens: int = 0, tag: Any = None) -> int:
        self.expire()
        self._last_id += 1
        deadline = (self._clock() + self.timeout) if self.timeout is not None else float("inf")
        entry = _Entry(tuple(keys), tokens, deadline, tag)
        self._entries[self._last_id] = entry
        for k in entry.keys:
            self.requests[k] = self.requests.get(k, 0) + 1
            if tokens:
                self.tokens[k] = self.tokens.get(k, 0) + tokens
        return self._last_id

    def release(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id, None)
        if entry is not None:
            self._undo(entry)
        self.expire()

    def expire(self) -> None:
        """Drop entries whose deadline has passed (oldest first)."""
        if self.timeout is None or not self._entries:
            return
        now = self._clock()
        while self._entries:
            eid, entry = next(iter(self._entries.items()))
            if entry.deadline > now:
                break
            del self._entries[eid]
            self._undo(entry)

    def remove_endpoint(self, key: str) -> None:
        self.requests.pop(key, None)
        self.tokens.pop(key, None)

    def _undo(self, entry: _Entry) -> None:
        for k in entry.keys:
            _dec(self.requests, k, 1)
            if entry.tokens:
                _dec(self.tokens, k, entry.tokens)
        if entry.tag is not None and self.on_undo is not None:
            self.on_undo(entry)


def _dec(counts: dict[str, int], key: str, n: int) -> None:
    left = counts.get(key, 0) - n
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _primary_keys(result: SchedulingResult) -> list[str]:
    """The first endpoint of every profile that produced one (llm-d's accounting)."""
    return [r.endpoints[0].key for r in result.profile_results.values()
            if r is not None and r.endpoints]


class _Tracking:
    """PreRequest / ResponseComplete / EndpointRemoved over an :class:`InFlightTracker`.

    The entry id rides on the request (``request.plugin_state[self.name]``), so a client
    reusing an ``x-request-id`` cannot release another request's entry.
    """

    name: str
    tracker: InFlightTracker
    count_tokens = False

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        keys = _primary_keys(result)
        if not keys:
            return
        tokens = estimate_tokens(request) if self.count_tokens else 0
        request.plugin_state[self.name] = self.tracker.add(keys, tokens)

    def response_complete(self, request: LLMRequest, endpoint_key: str, aborted: bool) -> None:
        entry_id = request.plugin_state.pop(self.name, None)
        if isinstance(entry_id, int):
            self.tracker.release(entry_id)

    def endpoint_removed(self, key: str) -> None:
        self.tracker.remove_endpoint(key)




# ---------------------------------------------------------------- load-aware-scorer


class LoadAwareScorer:
    """llm-d's queue-threshold scorer: 0.5 for an empty queue, falling linearly to 0 at
    ``threshold`` waiting requests (and staying 0 above it):
    ``q == 0 → 0.5``, else ``0.5 × (1 − min(q, threshold) / threshold)``.

    Unlike ``queue-scorer`` the score is absolute, not relative to the other candidates.
    """

    type_name = "load-aware-scorer"
    DEFAULT_THRESHOLD = 128

    @dataclass(frozen=True)
    class Parameters:
        threshold: int = param("threshold", 128, minimum=1)

    def __init__(self, name: str, threshold: int = DEFAULT_THRESHOLD) -> None:
        self.name = name
        self.threshold = threshold

    @classmethod
    def from_params(cls, name: str, params: LoadAwareScorer.Parameters,
                    handle: PluginHandle) -> LoadAwareScorer:
        return cls(name, params.threshold)

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        t = float(self.threshold)
        out: list[float] = []
        for e in endpoints:
            q = e.metrics.waiting_queue_size
            out.append(0.5 if q <= 0 else 0.5 * (1.0 - min(q, t) / t))
        return out


# ---------------------------------------------------------------- active-request-scorer


class ActiveRequestScorer(_Tracking):
    """Fewer requests in flight (counted by this EPP) scores higher.

    With ``c`` the endpoint's in-flight count and ``max`` the largest among the candidates:
    ``(max − c) / max``; 1 for every candidate when none has work in flight. Parameter
    ``requestTimeout`` (Go duration, default ``2m``): a request not released by then is
    dropped from the counts.
    """

    type_name = "active-request-scorer"
    DEFAULT_TIMEOUT = 120.0

    @dataclass(frozen=True)
    class Parameters:
        request_timeout: float = param("requestTimeout", 120.0, parse=positive_duration)

    def __init__(self, name: str, request_timeout: float = DEFAULT_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.request_timeout = request_timeout
        self.tracker = InFlightTracker(request_timeout, clock)

    @classmethod
    def from_params(cls, name: str, params: ActiveRequestScorer.Parameters,
                    handle: PluginHandle) -> ActiveRequestScorer:
        return cls(name, params.request_timeout)

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        counts = self.tracker.requests
        active = [counts.get(e.key, 0) for e in endpoints]
        top = max(active, default=0)
        if top <= 0:
            return [1.0] * len(endpoints)
        return [(top - c) / top for c in active]


# ---------------------------------------------------------------- token-load-scorer


class InFlightLoadProducer(_Tracking):
    """GIE's ``inflight-load-producer``: in-flight requests and estimated tokens per
    endpoint, for ``token-load-scorer``. Tokens per request are :func:`estimate_tokens`.
    Optional parameter ``requestTimeout`` (no timeout by default: the Director releases
    every routed request exactly once).
    """

    type_name = "inflight-load-producer"
    produces = MappingProxyType({fw.DATA_KEY_IN_FLIGHT_LOAD: "InFlightLoad"})
    count_tokens = True

    @dataclass(frozen=True)
    class Parameters:
        request_timeout: float | None = param("requestTimeout", None, parse=positive_duration)

    def __init__(self, name: str, request_timeout: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.tracker = InFlightTracker(request_timeout, clock)
        self._metrics: EppMetrics | None = None

    @classmethod
    def from_params(cls, name: str, params: InFlightLoadProducer.Parameters,
                    handle: PluginHandle) -> InFlightLoadProducer:
        return cls(name, params.request_timeout)

    def bind_metrics(self, metrics: EppMetrics) -> None:
        """Export what it counts as llm-d's ``llm_d_epp_inflight_{requests,tokens}``
        (per endpoint, fairness ID and priority; inflightload/metrics.go)."""
        self._metrics = metrics
        self.tracker.on_undo = self._released

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        m = self._metrics
        if m is None:
            super().pre_request(request, result)
            return
        # As llm-d's PreRequest: the first endpoint of every profile result, +1 request
        # and +tokens each; the entry remembers the labels for the release (_released).
        eps = [r.endpoints[0] for r in result.profile_results.values()
               if r is not None and r.endpoints]
        if not eps:
            return
        tokens = estimate_tokens(request)
        fairness = request.fairness_id or epp_keys.DEFAULT_FAIRNESS_ID
        priority = request.priority
        request.plugin_state[self.name] = self.tracker.add(
            [e.key for e in eps], tokens, (eps, fairness, priority))
        for e in eps:
            m.record_inflight(self, e.name, e.namespace, fairness, priority, 1, tokens)

    def _released(self, entry: _Entry) -> None:
        """An entry released or expired: −1 request and −tokens on its series."""
        m = self._metrics
        if m is None:
            return
        eps, fairness, priority = entry.tag
        for e in eps:
            m.record_inflight(self, e.name, e.namespace, fairness, priority, -1, -entry.tokens)

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        """0 for every endpoint: lets GIE configs that list the producer in a profile
        (``{pluginRef: inflight-load, weight: 0}``) load unchanged; it never changes a
        ranking."""
        return [0.0] * len(endpoints)


class TokenLoadScorer:
    """Fewer estimated tokens in flight scores higher, on an absolute scale:
    ``1 − min(tokens, queueThresholdTokens) / queueThresholdTokens`` (1 when idle).

    Reads the ``inflight-load-producer`` declared in the config, or creates one (named
    ``<name>-producer``) when none is declared. ``queueThresholdTokens`` defaults to
    4,194,304 (128 requests of 32k tokens), as in GIE.
    """

    type_name = "token-load-scorer"
    consumes = MappingProxyType({fw.DATA_KEY_IN_FLIGHT_LOAD: "InFlightLoad"})
    DEFAULT_THRESHOLD = 4_194_304

    @dataclass(frozen=True)
    class Parameters:
        queue_threshold_tokens: int = param("queueThresholdTokens", 4_194_304, minimum=1)

    def __init__(self, name: str, threshold_tokens: int = DEFAULT_THRESHOLD) -> None:
        self.name = name
        self.threshold_tokens = threshold_tokens
        self.producer: InFlightLoadProducer | None = None

    @classmethod
    def from_params(cls, name: str, params: TokenLoadScorer.Parameters,
                    handle: PluginHandle) -> TokenLoadScorer:
        return cls(name, params.queue_threshold_tokens)

    def bind(self, handle: PluginHandle) -> None:
        """After every plugin is built: find the producer, or create one."""
        producers = handle.of_type(InFlightLoadProducer)
        if len(producers) > 1:
            raise ConfigError(f"{self.name}: more than one inflight-load-producer; keep one")
        if producers:
            self.producer = producers[0]
            return
        self.producer = InFlightLoadProducer(f"{self.name}-producer")
        handle.add(self.producer)

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        assert self.producer is not None, "bind() not called"
        tokens = self.producer.tracker.tokens
        t = float(self.threshold_tokens)
        out: list[float] = []
        for e in endpoints:
            n = tokens.get(e.key, 0)
            out.append(1.0 if n <= 0 else 1.0 - min(n, t) / t)
        return out
