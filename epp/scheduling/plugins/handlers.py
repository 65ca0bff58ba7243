"""Profile handlers: which profiles run each cycle, and how their results combine."""

from __future__ import annotations

from collections.abc import Mapping

from epp.errors import NoCapacity
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import Profile
from epp.framework.params import NoParameters
from epp.scheduling.types import CycleState, LLMRequest, ProfileRunResult, SchedulingResult


class SingleProfileHandler:
    """Runs the one configured profile once; it is the primary."""

    type_name = "single-profile-handler"
    Parameters = NoParameters

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> SingleProfileHandler:
        return cls(name)

    def pick(
        self,
        state: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, Profile],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, Profile]:
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
