"""Pickers: choose 1..maxNumOfEndpoints endpoints from the scored candidates."""

from __future__ import annotations

import random
from typing import Sequence

from epp.config.params import Params
from epp.config.registry import PluginHandle
from epp.scheduling.types import CycleState, ProfileRunResult, ScoredEndpoint


class _PickerBase:
    type_name = ""

    def __init__(self, name: str, max_num_of_endpoints: int = 1,
                 rng: random.Random | None = None) -> None:
        self.name = name
        self.max_num_of_endpoints = max_num_of_endpoints
        self._rng = rng or random.Random()

    @classmethod
    def from_params(cls, name: str, params: Params, handle: PluginHandle) -> "_PickerBase":
        n = params.int("maxNumOfEndpoints", 1, minimum=1)
        params.done()
        return cls(name, n)

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
