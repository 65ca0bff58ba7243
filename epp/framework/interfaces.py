"""Extension points, each a small Protocol a plugin implements by having its method
(design.md §4, §9; the contract is docs/architecture.md, "Plugin framework").

Plugins are plain synchronous code over an immutable endpoint snapshot: no I/O.
Every plugin has ``type_name`` (its config ``type``) and ``name`` (its config ``name``).
One plugin may implement several extension points (a producer is often a PreRequest,
ResponseComplete and EndpointRemoved plugin at once); the config loader finds them with
``isinstance`` against these Protocols, never by looking for attribute names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol, runtime_checkable

from epp.scheduling.types import (
    CycleState,
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    SchedulingResult,
    ScoredEndpoint,
)


@runtime_checkable
class Plugin(Protocol):
    """Every plugin."""

    type_name: str
    name: str


@runtime_checkable
class Profile(Protocol):
    """A scheduling profile as a profile handler sees it (the scheduler's
    ``SchedulerProfile``): filters → weighted scorers → picker over the candidates."""

    name: str

    def run(self, state: CycleState, request: LLMRequest,
            candidates: Sequence[Endpoint]) -> ProfileRunResult | None:
        """The profile's pick; ``None`` when its filters leave no endpoint."""
        ...


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
        profiles: Mapping[str, Profile],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, Profile]:
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


@runtime_checkable
class ChecksProfiles(Plugin, Protocol):
    """A profile handler that needs particular profiles (e.g. P/D: decode and prefill)."""

    def check_profiles(self, names: AbstractSet[str]) -> None:
        """Called once at startup with the configured profile names; raise
        ``ConfigError`` (a message without the file path) when they do not fit."""
        ...


@runtime_checkable
class DecisionClassifier(Plugin, Protocol):
    """A profile handler that labels each decision (``pd_decisions_total``)."""

    def decision(self, result: SchedulingResult) -> str:
        """The decision's kind, e.g. ``disaggregated`` or ``decode-only``."""
        ...


@runtime_checkable
class PrefixIndexOwner(Plugin, Protocol):
    """A plugin that keeps a prefix index (``inference_extension_prefix_indexer_size``)."""

    def prefix_index_size(self) -> int:
        """Entries in the index now."""
        ...


@runtime_checkable
class NeedsResponse(Plugin, Protocol):
    """A plugin that needs parts of the response the lean gateway shape does not send:
    ``response_needs`` holds ``"body"`` for response bodies (the EPP warns at the first
    such stream; docs/plugins.md)."""

    response_needs: frozenset[str]


@runtime_checkable
class ResponseUsageMetadata(Plugin, Protocol):
    """A plugin that turns the response's ``usage`` object into Envoy dynamic metadata
    (GIE's ResponseBody extension point, e.g. ``request-attribute-reporter``)."""

    def usage_metadata(self, request: LLMRequest,
                       usage: Mapping[str, Any]) -> Mapping[str, Mapping[str, float]] | None:
        """``{namespace: {key: value}}`` to send with the end of the response, or None."""
        ...


# --- data layer (the config's ``dataLayer.sources``; epp/datalayer/config.py) ---

#: What a data source produces and an extractor consumes (GIE checks the Go types).
DATA_PROMETHEUS = "prometheus-metrics"
DATA_ENDPOINT_EVENTS = "endpoint-events"
DATA_K8S_NOTIFICATIONS = "k8s-notifications"


@runtime_checkable
class DataSource(Plugin, Protocol):
    """A data-layer source: ``metrics-data-source`` (polled /metrics),
    ``endpoint-notification-source``, ``k8s-notification-source``."""

    data_output: str  # one of the DATA_* kinds


@runtime_checkable
class DataExtractor(Plugin, Protocol):
    """A data-layer extractor, attached to a source whose ``data_output`` it reads."""

    data_input: str  # one of the DATA_* kinds


@runtime_checkable
class EndpointExtractor(DataExtractor, Protocol):
    """Reads ``endpoint-notification-source`` events: an endpoint joined the pool (or
    changed) — ``"add-or-update"`` — or left it — ``"delete"``."""

    def extract_endpoint(self, event: str, endpoint: Endpoint) -> None: ...


@runtime_checkable
class RequestParser(Plugin, Protocol):
    """A plugin the config's ``parser: {pluginRef: …}`` may name."""

    parser_protocol: str  # the payload format it reads, e.g. "openai"


class PluginTimer(Protocol):
    """Receives how long each plugin call took (metrics, trace spans)."""

    def __call__(self, extension_point: str, plugin: Plugin, seconds: float) -> None: ...


def no_timer(extension_point: str, plugin: Plugin, seconds: float) -> None:
    """A :class:`PluginTimer` that records nothing."""
