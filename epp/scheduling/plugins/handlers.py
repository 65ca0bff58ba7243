"""Profile handlers: which profiles run each cycle, and how their results combine."""

from __future__ import annotations

from typing import Mapping

from epp.config.params import Params
from epp.config.registry import PluginHandle
from epp.errors import NoCapacity
from epp.scheduling.scheduler import SchedulerProfile
from epp.scheduling.types import CycleState, LLMRequest, ProfileRunResult, SchedulingResult


class SingleProfileHandler:
    """Runs the one configured profile once; it is the primary."""

    type_name = "single-profile-handler"

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: Params, handle: PluginHandle) -> "SingleProfileHandler":
        params.done()
        return cls(name)

    def pick(
        self,
        state: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, SchedulerProfile],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, SchedulerProfile]:
        return {} if results else profiles

    def process_results(
        self,
        state: CycleState,
        request: LLMRequest,
        results: Mapping[str, ProfileRunResult | None],
    ) -> SchedulingResult:
        (name, result), = results.items()
        if result is None or not result.endpoints:
            raise NoCapacity(f"profile {name!r} filtered out every endpoint")
        return SchedulingResult(profile_results=dict(results), primary_profile=name)
