"""llm-d-router's single-profile handlers: ``header-profile-handler`` and
``data-parallel-profile-handler`` (v0.10.0, pkg/epp/framework/plugins/scheduling/
profilehandler/{headerprofile,dataparallel}).

- ``header-profile-handler`` runs the one profile named by the request header
  ``headerName`` (default ``EPP-Profile``, matched case-insensitively), or
  ``defaultProfile`` (default ``decode``) when the header is absent or blank. With a
  single configured profile it always runs that one. A header naming no profile (or a
  missing header with no ``defaultProfile`` profile) runs nothing and the request fails
  with "no capacity" naming the header.
- ``data-parallel-profile-handler`` (deprecated in llm-d) runs the one profile and sends
  the request to the chosen pod's address at ``primaryPort`` (default 8000), with the
  chosen rank's ``address:port`` in ``x-data-parallel-host-port`` for the pod's sidecar.
  It needs exactly one scheduling profile.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from epp import keys
from epp.errors import ConfigError, EppError, NoCapacity
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import Profile
from epp.framework.params import param
from epp.scheduling.types import CycleState, LLMRequest, ProfileRunResult, SchedulingResult

log = logging.getLogger(__name__)

DEFAULT_PROFILE_HEADER = "EPP-Profile"
DEFAULT_PROFILE = "decode"


def _single_result(handler: str, results: Mapping[str, ProfileRunResult | None]
                   ) -> tuple[str, ProfileRunResult]:
    if len(results) != 1:
        raise EppError(f"{handler} is intended to run a single profile per request, "
                       f"got {len(results)}")
    (name, result), = results.items()
    if result is None or not result.endpoints:
        raise NoCapacity(f"profile {name!r} filtered out every endpoint")
    return name, result


@dataclass(frozen=True)
class HeaderProfileHandlerParameters:
    header_name: str = param("headerName", "")
    default_profile: str = param("defaultProfile", "")


class HeaderProfileHandler:
    """Runs the profile the request header names (or the default profile)."""

    type_name = "header-profile-handler"
    Parameters = HeaderProfileHandlerParameters

    def __init__(self, name: str, header_name: str = "", default_profile: str = "") -> None:
        self.name = name
        self.header_name = header_name.strip().lower() or DEFAULT_PROFILE_HEADER.lower()
        self.default_profile = default_profile.strip() or DEFAULT_PROFILE

    @classmethod
    def from_params(cls, name: str, params: HeaderProfileHandlerParameters,
                    handle: PluginHandle) -> HeaderProfileHandler:
        return cls(name, params.header_name, params.default_profile)

    def _requested(self, request: LLMRequest) -> str:
        return request.headers.get(self.header_name, "").strip()

    def _no_match(self, requested: str) -> str:
        if not requested:
            return f"header profile handler: missing {self.header_name!r} header"
        return (f"header profile handler: no scheduling profile configured for "
                f"{self.header_name!r} header value {requested!r}")

    def pick(self, state: CycleState, request: LLMRequest,
             profiles: Mapping[str, Profile],
             results: Mapping[str, ProfileRunResult | None]) -> Mapping[str, Profile]:
        if results:
            return {}
        if len(profiles) == 1:
            return dict(profiles)
        requested = self._requested(request)
        name = requested or self.default_profile
        profile = profiles.get(name)
        if profile is None:
            log.info("%s: no scheduling profile selected for request %s (%s; profiles: %s)",
                     self.name, request.request_id,
                     self._no_match(requested) if requested else
                     f"defaultProfile {self.default_profile!r} is not a configured "
                     "scheduling profile", ", ".join(sorted(profiles)))
            return {}
        return {name: profile}

    def process_results(self, state: CycleState, request: LLMRequest,
                        results: Mapping[str, ProfileRunResult | None]) -> SchedulingResult:
        if not results:
            raise NoCapacity(self._no_match(self._requested(request)))
        name, _ = _single_result("header profile handler", results)
        return SchedulingResult(profile_results=dict(results), primary_profile=name)


@dataclass(frozen=True)
class DataParallelProfileHandlerParameters:
    primary_port: int = param("primaryPort", 8000, minimum=0, maximum=65535)


class DataParallelProfileHandler:
    """One profile; the request goes to the pod's ``primaryPort`` with the chosen rank
    in ``x-data-parallel-host-port``."""

    type_name = "data-parallel-profile-handler"
    Parameters = DataParallelProfileHandlerParameters

    def __init__(self, name: str, primary_port: int = 8000) -> None:
        self.name = name
        self.primary_port = primary_port or None

    @classmethod
    def from_params(cls, name: str, params: DataParallelProfileHandlerParameters,
                    handle: PluginHandle) -> DataParallelProfileHandler:
        log.info("%s: data-parallel-profile-handler is deprecated in llm-d (use "
                 "single-profile-handler with Istio >= 1.28.1)", name)
        return cls(name, params.primary_port)

    def check_profiles(self, names: AbstractSet[str]) -> None:
        if len(names) != 1:
            raise ConfigError(f"{self.name}: data-parallel-profile-handler requires exactly "
                              f"one scheduling profile, got {len(names)} "
                              f"({', '.join(sorted(names))})")

    def pick(self, state: CycleState, request: LLMRequest,
             profiles: Mapping[str, Profile],
             results: Mapping[str, ProfileRunResult | None]) -> Mapping[str, Profile]:
        if len(profiles) == len(results) or len(profiles) != 1:
            return {}
        return dict(profiles)

    def process_results(self, state: CycleState, request: LLMRequest,
                        results: Mapping[str, ProfileRunResult | None]) -> SchedulingResult:
        name, _ = _single_result("data parallel profile handler", results)
        return SchedulingResult(profile_results=dict(results), primary_profile=name,
                                destination_port=self.primary_port)

    def request_headers(self, request: LLMRequest, result: SchedulingResult) -> Mapping[str, str]:
        """``x-data-parallel-host-port``: the chosen rank's own ``address:port``."""
        return {keys.HEADER_DATA_PARALLEL: result.primary.endpoints[0].key}
