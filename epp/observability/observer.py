"""What watches a decision: one interface for metrics, explain records and trace spans.

The scheduling core (epp/requestcontrol/director.py) computes a decision once and tells a
:class:`DecisionObserver` about each step of its life, in this order::

    started(candidates) → [scheduling detail, plugin timings] → scheduled(result)
        → decided(headers) → … → [responded(response)] → completed(status, usage)
    (or failed(status) instead, from any point before decided)

Three implementations: ``MetricsObserver`` (epp/observability/metrics.py; shared by all
requests, always on), ``ExplainObserver`` (explain.py; one per explained request) and
``TraceObserver`` (tracing.py; one per request while tracing is on). :class:`Fanout` makes
several look like one. An observer that wants the scheduler's per-plugin outcomes sets
``detail`` (they are produced only then); one that wants per-plugin timings sets
``timings``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from epp.framework.interfaces import Filter, Picker, Plugin, Scorer
from epp.parsing.usage import Usage
from epp.scheduling.scheduler import SchedulingObserver
from epp.scheduling.types import (
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    SchedulingResult,
    ScoredEndpoint,
)


@dataclass(frozen=True, slots=True)
class ResponseStats:
    """What the protocol front measured of a response body it saw pass (GIE's gateway
    shape, or the split observer path; in the lean shape no body reaches the EPP and there
    is none). Times are seconds, measured from the moment the front got the decision.

    ``size``: response body bytes, as the model server sent them. ``ttft``: time to the
    first body chunk of a streamed (SSE) 2xx response. ``tpot``: for such a response with
    more than one completion token in its usage, (end − first chunk) / (tokens − 1), as
    GIE's latency predictor computes its average TPOT."""

    size: int
    ttft: float | None = None
    tpot: float | None = None


class DecisionObserver(SchedulingObserver, Protocol):
    """Watches decisions, each from its candidates to the end of its response.

    Every hook gets the request, so one observer may watch many requests (metrics) or
    just one (an explain record, a trace span). Hooks run synchronously on the request
    path: keep them cheap, do no I/O.
    """

    detail: bool
    """True: wants the scheduler's per-plugin outcomes (the :class:`SchedulingObserver`
    hooks). False: they are not computed at all."""

    timings: bool
    """True: wants :meth:`plugin_timed` for every plugin call while scheduling."""

    def started(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> None:
        """Scheduling starts over ``candidates`` (the snapshot, narrowed by the subset hint)."""
        ...

    def plugin_timed(self, extension_point: str, plugin: Plugin, seconds: float) -> None:
        """A plugin call of the running scheduling took ``seconds`` (it just returned)."""
        ...

    def scheduled(self, request: LLMRequest, result: SchedulingResult, seconds: float) -> None:
        """The scheduler decided ``result`` in ``seconds``."""
        ...

    def decided(self, request: LLMRequest, result: SchedulingResult,
                set_headers: dict[str, str], response_headers: dict[str, str]) -> None:
        """The request is placed: PreRequest plugins ran, ``set_headers`` holds the headers
        for the upstream request. An observer may add headers to either dict (the trace
        context upstream, the explain record for the client); the ResponseHeaders
        plugins' headers are applied over ``response_headers`` afterwards."""
        ...

    def failed(self, request: LLMRequest, status: int, message: str | None) -> None:
        """The request could not be placed: answered with ``status``. ``message`` is the
        error's, or ``None`` for an internal error (a plugin bug; its traceback is logged)."""
        ...

    def responded(self, request: LLMRequest, status: int, response: ResponseStats) -> None:
        """The placed request's response body passed the protocol front, which measured
        ``response``; called just before :meth:`completed`, only for responses that were
        not aborted and whose body the front saw."""
        ...

    def completed(self, request: LLMRequest, status: int, aborted: bool,
                  usage: Usage | None, seconds: float) -> None:
        """The placed request's response ended with ``status`` (0: none came), or its
        stream aborted; ``seconds`` since it was placed. Exactly once per decided request."""
        ...


class Observer:
    """A :class:`DecisionObserver` that does nothing: implementations override what they
    need."""

    detail: bool = False
    timings: bool = False

    def started(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> None:
        return None

    def profile_started(self, profile: str, candidates: Sequence[Endpoint]) -> None:
        return None

    def filtered(self, profile: str, plugin: Filter, before: Sequence[Endpoint],
                 kept: Sequence[Endpoint]) -> None:
        return None

    def scored(self, profile: str, plugin: Scorer, weight: float,
               endpoints: Sequence[Endpoint], scores: Sequence[float]) -> None:
        return None

    def picked(self, profile: str, plugin: Picker, scored: Sequence[ScoredEndpoint],
               result: ProfileRunResult) -> None:
        return None

    def plugin_timed(self, extension_point: str, plugin: Plugin, seconds: float) -> None:
        return None

    def scheduled(self, request: LLMRequest, result: SchedulingResult, seconds: float) -> None:
        return None

    def decided(self, request: LLMRequest, result: SchedulingResult,
                set_headers: dict[str, str], response_headers: dict[str, str]) -> None:
        return None

    def failed(self, request: LLMRequest, status: int, message: str | None) -> None:
        return None

    def responded(self, request: LLMRequest, status: int, response: ResponseStats) -> None:
        return None

    def completed(self, request: LLMRequest, status: int, aborted: bool,
                  usage: Usage | None, seconds: float) -> None:
        return None


class Fanout:
    """Several observers as one: each hook calls them in the given order (the per-plugin
    hooks only those that want them)."""

    __slots__ = ("_detailed", "_timed", "detail", "observers", "timings")

    def __init__(self, observers: Iterable[DecisionObserver]) -> None:
        self.observers = tuple(observers)
        self._detailed = tuple(o for o in self.observers if o.detail)
        self._timed = tuple(o for o in self.observers if o.timings)
        self.detail = bool(self._detailed)
        self.timings = bool(self._timed)

    def started(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> None:
        for o in self.observers:
            o.started(request, candidates)

    def profile_started(self, profile: str, candidates: Sequence[Endpoint]) -> None:
        for o in self._detailed:
            o.profile_started(profile, candidates)

    def filtered(self, profile: str, plugin: Filter, before: Sequence[Endpoint],
                 kept: Sequence[Endpoint]) -> None:
        for o in self._detailed:
            o.filtered(profile, plugin, before, kept)

    def scored(self, profile: str, plugin: Scorer, weight: float,
               endpoints: Sequence[Endpoint], scores: Sequence[float]) -> None:
        for o in self._detailed:
            o.scored(profile, plugin, weight, endpoints, scores)

    def picked(self, profile: str, plugin: Picker, scored: Sequence[ScoredEndpoint],
               result: ProfileRunResult) -> None:
        for o in self._detailed:
            o.picked(profile, plugin, scored, result)

    def plugin_timed(self, extension_point: str, plugin: Plugin, seconds: float) -> None:
        for o in self._timed:
            o.plugin_timed(extension_point, plugin, seconds)

    def scheduled(self, request: LLMRequest, result: SchedulingResult, seconds: float) -> None:
        for o in self.observers:
            o.scheduled(request, result, seconds)

    def decided(self, request: LLMRequest, result: SchedulingResult,
                set_headers: dict[str, str], response_headers: dict[str, str]) -> None:
        for o in self.observers:
            o.decided(request, result, set_headers, response_headers)

    def failed(self, request: LLMRequest, status: int, message: str | None) -> None:
        for o in self.observers:
            o.failed(request, status, message)

    def responded(self, request: LLMRequest, status: int, response: ResponseStats) -> None:
        for o in self.observers:
            o.responded(request, status, response)

    def completed(self, request: LLMRequest, status: int, aborted: bool,
                  usage: Usage | None, seconds: float) -> None:
        for o in self.observers:
            o.completed(request, status, aborted, usage, seconds)
