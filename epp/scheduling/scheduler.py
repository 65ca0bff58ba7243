"""The multi-cycle scheduler (design.md §4).

``Scheduler.schedule`` loops: the profile handler picks the profiles to run now (empty =
done), each picked profile runs (filters → weighted scorers → picker) and its result (or
``None`` for "filtered to nothing") is stored; finally the handler aggregates the results
into a :class:`SchedulingResult` naming the primary profile.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from epp.errors import EppError
from epp.scheduling.interfaces import Filter, Picker, Plugin, PluginTimer, ProfileHandler, Scorer
from epp.scheduling.types import (
    CycleState,
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    ScoredEndpoint,
    SchedulingResult,
)

MAX_CYCLES = 16

# CycleState key: when set to a dict, profiles record why each endpoint was kept, dropped
# and scored (the explain feature). Absent, nothing is recorded and nothing is paid.
EXPLAIN_KEY = "epp.explain"


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
        """Run the profile; ``None`` when the filters leave no endpoint."""
        explain = state.get(EXPLAIN_KEY)
        if explain is not None:
            return self._run_explained(state, request, candidates, explain)
        timer = self._timer
        endpoints: Sequence[Endpoint] = candidates
        for f in self.filters:
            t0 = time.perf_counter()
            endpoints = f.filter(state, request, endpoints)
            timer("Filter", f, time.perf_counter() - t0)
            if not endpoints:
                return None
        totals = [0.0] * len(endpoints)
        for scorer, weight in self.scorers:
            t0 = time.perf_counter()
            scores = self._scores(scorer, state, request, endpoints)
            timer("Scorer", scorer, time.perf_counter() - t0)
            for i, s in enumerate(scores):
                totals[i] += weight * s
        scored = [ScoredEndpoint(e, t) for e, t in zip(endpoints, totals)]
        t0 = time.perf_counter()
        result = self.picker.pick(state, scored)
        timer("Picker", self.picker, time.perf_counter() - t0)
        return result

    @staticmethod
    def _scores(scorer: Scorer, state: CycleState, request: LLMRequest,
                endpoints: Sequence[Endpoint]) -> list[float]:
        scores = scorer.score(state, request, endpoints)
        if len(scores) != len(endpoints):
            raise EppError(f"scorer {scorer.name!r} returned {len(scores)} scores for "
                           f"{len(endpoints)} endpoints")
        # Clamp: a misbehaving scorer must not outweigh the others.
        return [0.0 if s < 0.0 else 1.0 if s > 1.0 else float(s) for s in scores]

    def _run_explained(self, state: CycleState, request: LLMRequest,
                       candidates: Sequence[Endpoint],
                       explain: dict[str, Any]) -> ProfileRunResult | None:
        """The same run, recording per-plugin outcomes into ``explain[profile name]``."""
        rec: dict[str, Any] = {"candidates": [e.key for e in candidates], "dropped": {},
                               "scores": {}, "totals": {}, "picked": []}
        explain[self.name] = rec
        timer = self._timer
        endpoints: Sequence[Endpoint] = candidates
        for f in self.filters:
            t0 = time.perf_counter()
            kept = f.filter(state, request, endpoints)
            timer("Filter", f, time.perf_counter() - t0)
            kept_keys = {e.key for e in kept}
            for e in endpoints:
                if e.key not in kept_keys:
                    rec["dropped"][e.key] = f"filter {f.name} ({f.type_name})"
            endpoints = kept
            if not endpoints:
                rec["result"] = "no endpoint left after filters"
                return None
        totals = [0.0] * len(endpoints)
        for scorer, weight in self.scorers:
            t0 = time.perf_counter()
            scores = self._scores(scorer, state, request, endpoints)
            timer("Scorer", scorer, time.perf_counter() - t0)
            rec["scores"][scorer.name] = {
                "type": scorer.type_name, "weight": weight,
                "scores": {e.key: round(s, 4) for e, s in zip(endpoints, scores)}}
            for i, s in enumerate(scores):
                totals[i] += weight * s
        rec["totals"] = {e.key: round(t, 4) for e, t in zip(endpoints, totals)}
        t0 = time.perf_counter()
        result = self.picker.pick(state, [ScoredEndpoint(e, t) for e, t in zip(endpoints, totals)])
        timer("Picker", self.picker, time.perf_counter() - t0)
        rec["picker"] = self.picker.name
        rec["picked"] = [e.key for e in result.endpoints]
        return result


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
                 explain: dict[str, Any] | None = None) -> SchedulingResult:
        """Run the profile cycles over ``candidates`` (non-empty).

        ``explain``, when given, receives one record per profile run (see ``EXPLAIN_KEY``).
        Raises ``NoCapacity`` (from the handler) when the profiles filtered to nothing and
        ``EppError`` (500) when the handler misbehaves (loops, picks unknown profiles).
        """
        state = CycleState()
        if explain is not None:
            state[EXPLAIN_KEY] = explain
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
