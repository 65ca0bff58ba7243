"""Extension points of the scheduler, each a small Protocol (design.md §4, §9).

Plugins are plain synchronous code over an immutable endpoint snapshot: no I/O.
Every plugin has ``type_name`` (its config ``type``) and ``name`` (its config ``name``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol, Sequence, runtime_checkable

from epp.scheduling.types import (
    CycleState,
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    ScoredEndpoint,
    SchedulingResult,
)

if TYPE_CHECKING:
    from epp.scheduling.scheduler import SchedulerProfile


@runtime_checkable
class Plugin(Protocol):
    """Every plugin. Optional class attribute ``response_needs: frozenset[str]`` —
    ``{"body"}`` for a plugin that needs response bodies, which the lean gateway shape
    does not send (the EPP warns at the first such stream; docs/plugins.md)."""

    type_name: str
    name: str


@runtime_checkable
class Filter(Plugin, Protocol):
    def filter(
        self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        """Return the endpoints that stay candidates (a subset, order kept)."""
        ...


@runtime_checkable
class Scorer(Plugin, Protocol):
    def score(
        self, state: CycleState, request: LLMRequest, endpoints: Sequence[Endpoint]
    ) -> Sequence[float]:
        """Return one score in [0, 1] per endpoint, aligned with ``endpoints``."""
        ...


@runtime_checkable
class Picker(Plugin, Protocol):
    def pick(self, state: CycleState, scored: Sequence[ScoredEndpoint]) -> ProfileRunResult:
        """Choose 1..maxNumOfEndpoints endpoints from a non-empty scored list."""
        ...


@runtime_checkable
class ProfileHandler(Plugin, Protocol):
    def pick(
        self,
        state: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, SchedulerProfile],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, SchedulerProfile]:
        """Profiles to run in the next cycle; empty means scheduling is done."""
        ...

    def process_results(
        self,
        state: CycleState,
        request: LLMRequest,
        results: Mapping[str, ProfileRunResult | None],
    ) -> SchedulingResult:
        """Aggregate profile results; raise ``NoCapacity`` when nothing usable remains."""
        ...


@runtime_checkable
class PreRequest(Plugin, Protocol):
    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """Called once the Director has decided where the request goes."""
        ...


@runtime_checkable
class ResponseComplete(Plugin, Protocol):
    def response_complete(self, request: LLMRequest, endpoint_key: str, aborted: bool) -> None:
        """Called once per routed request when its response ends (or the stream aborts)."""
        ...


@runtime_checkable
class RequestHeaders(Plugin, Protocol):
    def request_headers(self, request: LLMRequest, result: SchedulingResult) -> Mapping[str, str]:
        """Headers to set on the request sent upstream (e.g. ``x-prefiller-host-port``)."""
        ...


@runtime_checkable
class EndpointRemoved(Plugin, Protocol):
    def endpoint_removed(self, key: str) -> None:
        """The endpoint ``key`` left the pool: drop any state kept for it."""
        ...


@runtime_checkable
class ResponseHeaders(Plugin, Protocol):
    def response_headers(self, request: LLMRequest, endpoint_key: str, status: int,
                         headers: Mapping[str, str]) -> Mapping[str, str] | None:
        """Headers to set on the response to the client (e.g. ``x-session-token``).

        Called once per routed request, at decision time (``status`` 0, ``headers`` empty),
        so the decision, headers included, can travel to a protocol front in one message;
        the headers are set when the upstream response headers arrive.
        """
        ...


@runtime_checkable
class SaturationDetector(Plugin, Protocol):
    def is_saturated(self, endpoints: Sequence[Endpoint]) -> bool:
        """True when none of ``endpoints`` has capacity for more work (empty → True)."""
        ...


class PluginTimer(Protocol):
    def __call__(self, extension_point: str, plugin: Plugin, seconds: float) -> None: ...
