"""Pickers: choose 1..maxNumOfEndpoints endpoints from the scored candidates."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

from epp.framework.handle import PluginHandle
from epp.framework.params import param
from epp.scheduling.types import CycleState, ProfileRunResult, ScoredEndpoint


@dataclass(frozen=True)
class PickerParameters:
    max_num_of_endpoints: int = param("maxNumOfEndpoints", 1, minimum=1)


class _PickerBase:
    type_name = ""
    Parameters = PickerParameters

    def __init__(self, name: str, max_num_of_endpoints: int = 1,
                 rng: random.Random | None = None) -> None:
        self.name = name
        self.max_num_of_endpoints = max_num_of_endpoints
        self._rng = rng or random.Random()

    @classmethod
    def from_params(cls, name: str, params: PickerParameters, handle: PluginHandle) -> Self:
        return cls(name, params.max_num_of_endpoints)

    @staticmethod
    def _result(chosen: Sequence[ScoredEndpoint]) -> ProfileRunResult:
        return ProfileRunResult(
            endpoints=tuple(s.endpoint for s in chosen),
            scores={s.endpoint.key: s.score for s in chosen},
        )


class MaxScorePicker(_PickerBase):
    """Highest total score first; ties broken randomly."""

    type_name = "max-score-picker"

    def pick(self, state: CycleState, scored: Sequence[ScoredEndpoint]) -> ProfileRunResult:
        items = list(scored)
        self._rng.shuffle(items)  # random tie-break: the sort below is stable
        items.sort(key=lambda s: s.score, reverse=True)
        return self._result(items[: self.max_num_of_endpoints])


class RandomPicker(_PickerBase):
    """Uniformly random endpoints, ignoring scores."""

    type_name = "random-picker"

    def pick(self, state: CycleState, scored: Sequence[ScoredEndpoint]) -> ProfileRunResult:
        k = min(self.max_num_of_endpoints, len(scored))
        return self._result(self._rng.sample(list(scored), k))


class WeightedRandomPicker(_PickerBase):
    """Random endpoints, each drawn with probability proportional to its total score.

    A-Res weighted sampling without replacement: each endpoint with score ``w > 0`` gets
    the key ``U^(1/w)`` (``U`` uniform in (0, 1]), and the ``maxNumOfEndpoints`` largest
    keys win (compared as ``log(U) / w``, which orders the same and never underflows).
    Endpoints scoring 0 are picked only when fewer positive ones remain (at random among
    themselves); when every score is 0 the pick is uniformly random.
    """

    type_name = "weighted-random-picker"

    def pick(self, state: CycleState, scored: Sequence[ScoredEndpoint]) -> ProfileRunResult:
        items = list(scored)
        self._rng.shuffle(items)  # random order among the zero-score endpoints
        rng = self._rng
        keyed: list[tuple[float, ScoredEndpoint]] = []
        for s in items:
            if s.score > 0.0:
                u = 1.0 - rng.random()  # (0, 1]
                keyed.append((math.log(u) / s.score, s))
            else:
                keyed.append((-math.inf, s))
        keyed.sort(key=lambda t: t[0], reverse=True)
        return self._result([s for _, s in keyed[: self.max_num_of_endpoints]])
