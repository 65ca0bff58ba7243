"""The multi-cycle scheduler (design.md §4).

``Scheduler.schedule`` loops: the profile handler picks the profiles to run now (empty =
done), each picked profile runs (filters → weighted scorers → picker) and its result (or
``None`` for "filtered to nothing") is stored; finally the handler aggregates the results
into a :class:`SchedulingResult` naming the primary profile.

Every plugin call is timed into the ``PluginTimer`` given at construction. Per-plugin
outcomes (what each filter kept, each scorer's scores, the totals, the pick) go to a
:class:`SchedulingObserver` only when one is passed to :meth:`Scheduler.schedule` (the
explain feature): without one a profile run pays one ``None`` test per plugin call.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from epp.errors import EppError
from epp.framework.interfaces import Filter, Picker, Plugin, PluginTimer, ProfileHandler, Scorer
from epp.scheduling.types import (
    CycleState,
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    SchedulingResult,
    ScoredEndpoint,
)

MAX_CYCLES = 16

# CycleState key holding the SchedulingObserver of this scheduling run, when there is one
# (Profile.run's signature is the framework's, so the observer travels in the state).
OBSERVER_KEY = "epp.observer"


class SchedulingObserver(Protocol):
    """Wants the outcome of every plugin call of a scheduling run, in call order.

    ``profile`` is the running profile's name. The sequences passed are the scheduler's
    own: read them during the call, do not keep or change them.
    """

    def profile_started(self, profile: str, candidates: Sequence[Endpoint]) -> None:
        """The profile starts over ``candidates``."""
        ...

    def filtered(self, profile: str, plugin: Filter, before: Sequence[Endpoint],
                 kept: Sequence[Endpoint]) -> None:
        """``plugin`` kept ``kept`` of ``before``; empty ``kept`` ends the profile (``None``)."""
        ...

    def scored(self, profile: str, plugin: Scorer, weight: float,
               endpoints: Sequence[Endpoint], scores: Sequence[float]) -> None:
        """``plugin`` (weighted by ``weight``) scored ``endpoints``: ``scores``, clamped."""
        ...

    def picked(self, profile: str, plugin: Picker, scored: Sequence[ScoredEndpoint],
               result: ProfileRunResult) -> None:
        """``plugin`` picked ``result`` from ``scored`` (the weighted totals)."""
        ...


def _no_timer(extension_point: str, plugin: Plugin, seconds: float) -> None:
    return None


class SchedulerProfile:
    """One profile: filters narrow the candidates, scorers are summed by weight, a picker picks."""

    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
        timer: PluginTimer = _no_timer,
    ) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        self._timer = timer

    def run(
        self, state: CycleState, request: LLMRequest, candidates: Sequence[Endpoint]
    ) -> ProfileRunResult | None:
        """Run the profile; ``None`` when the filters leave no endpoint.

        Reports each plugin's outcome to the run's observer (``OBSERVER_KEY``) if any.
        """
        observer: SchedulingObserver | None = state.get(OBSERVER_KEY)
        timer = self._timer
        name = self.name
        if observer is not None:
            observer.profile_started(name, candidates)
        endpoints: Sequence[Endpoint] = candidates
        for f in self.filters:
            t0 = time.perf_counter()
            kept = f.filter(state, request, endpoints)
            timer("Filter", f, time.perf_counter() - t0)
            if observer is not None:
                observer.filtered(name, f, endpoints, kept)
            if not kept:
                return None
            endpoints = kept
        totals = [0.0] * len(endpoints)
        for scorer, weight in self.scorers:
            t0 = time.perf_counter()
            scores = self._scores(scorer, state, request, endpoints)
            timer("Scorer", scorer, time.perf_counter() - t0)
            if observer is not None:
                observer.scored(name, scorer, weight, endpoints, scores)
            for i, s in enumerate(scores):
                totals[i] += weight * s
        scored = [ScoredEndpoint(e, t) for e, t in zip(endpoints, totals)]
        t0 = time.perf_counter()
        result = self.picker.pick(state, scored)
        timer("Picker", self.picker, time.perf_counter() - t0)
        if observer is not None:
            observer.picked(name, self.picker, scored, result)
        # llm-d's ScoredCandidates: every scored candidate, not only the picked ones.
        return ProfileRunResult(result.endpoints, result.scores, tuple(scored))

    @staticmethod
    def _scores(scorer: Scorer, state: CycleState, request: LLMRequest,
                endpoints: Sequence[Endpoint]) -> list[float]:
        scores = scorer.score(state, request, endpoints)
        if len(scores) != len(endpoints):
            raise EppError(f"scorer {scorer.name!r} returned {len(scores)} scores for "
                           f"{len(endpoints)} endpoints")
        # Clamp: a misbehaving scorer must not outweigh the others.
        return [0.0 if s < 0.0 else 1.0 if s > 1.0 else float(s) for s in scores]


class Scheduler:
    def __init__(
        self,
        handler: ProfileHandler,
        profiles: Mapping[str, SchedulerProfile],
        timer: PluginTimer = _no_timer,
    ) -> None:
        if not profiles:
            raise ValueError("scheduler needs at least one profile")
        self.handler = handler
        self.profiles = dict(profiles)
        self._timer = timer

    def schedule(self, request: LLMRequest, candidates: Sequence[Endpoint],
                 observer: SchedulingObserver | None = None) -> SchedulingResult:
        """Run the profile cycles over ``candidates`` (non-empty).

        ``observer``, when given, is told every plugin call's outcome of every profile run
        (see :class:`SchedulingObserver`); the decision is the same with or without one.
        Raises ``NoCapacity`` (from the handler) when the profiles filtered to nothing and
        ``EppError`` (500) when the handler misbehaves (loops, picks unknown profiles).
        """
        state = CycleState()
        if observer is not None:
            state[OBSERVER_KEY] = observer
        results: dict[str, ProfileRunResult | None] = {}
        for _ in range(MAX_CYCLES):
            t0 = time.perf_counter()
            picked = self.handler.pick(state, request, self.profiles, results)
            self._timer("ProfilePicker", self.handler, time.perf_counter() - t0)
            if not picked:
                break
            for name, profile in picked.items():
                if name not in self.profiles:
                    raise EppError(f"profile handler {self.handler.name!r} picked unknown "
                                   f"profile {name!r}")
                if name in results:
                    raise EppError(f"profile handler {self.handler.name!r} re-ran profile {name!r}")
                results[name] = profile.run(state, request, candidates)
        else:
            raise EppError(f"profile handler {self.handler.name!r} did not finish in {MAX_CYCLES} cycles")
        t0 = time.perf_counter()
        out = self.handler.process_results(state, request, results)
        self._timer("ProcessProfilesResults", self.handler, time.perf_counter() - t0)
        return out
