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
from dataclasses import dataclass
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


# --- request control around scheduling (GIE's PrepareDataPlugin and AdmissionPlugin) and
# the measured response (what GIE's per-chunk ResponseBody hooks compute) ---

#: GIE's budget for all PrepareData plugins of one request together (director.go
#: ``prepareDataTimeout``): past it they are cancelled and scheduling goes on without them.
PREPARE_DATA_TIMEOUT_S = 0.4


@runtime_checkable
class PrepareDataPlugin(Plugin, Protocol):
    """Produces per-request data before scheduling (GIE's ``PrepareDataPlugin``).

    Called once per request by the scheduling core, after the candidates are known and
    before admission and scheduling, in declaration order, within
    :data:`PREPARE_DATA_TIMEOUT_S` for all of them together. It may do I/O (the latency
    predictor's sidecar): a coroutine that never awaits anything runs without suspending.
    What it produces goes in ``request.plugin_state``. When the budget runs out the call
    is cancelled; an exception is logged and the remaining ones are skipped — either
    way the request is scheduled (GIE: "Don't fail the request if PrepareData plugins
    fail")."""

    async def prepare_request_data(self, request: LLMRequest,
                                   endpoints: Sequence[Endpoint]) -> None: ...


@runtime_checkable
class TimeoutAwareProducer(Plugin, Protocol):
    """A PrepareData plugin that needs longer than :data:`PREPARE_DATA_TIMEOUT_S`
    (llm-d-router's ``TimeoutAwareProducer``, e.g. ``burst-prefix-cache-producer``, which
    waits out its batch window): the budget of a request's PrepareData plugins is the
    largest of the default and their ``produce_timeout()`` (seconds; ≤ 0: the default)."""

    def produce_timeout(self) -> float: ...


@runtime_checkable
class AdmissionPlugin(Plugin, Protocol):
    """May refuse a request before it is scheduled (GIE's ``AdmissionPlugin``): called
    after the PrepareData plugins, in declaration order; the first refusal answers the
    request with GIE's error (500, "request cannot be admitted")."""

    def admit_request(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> str | None:
        """None admits; a string refuses, naming why (logged)."""
        ...


@runtime_checkable
class RequestHeaderProcessor(Plugin, Protocol):
    """Reads the request's metadata before admission (llm-d-router's
    ``RequestHeaderProcessor``, e.g. ``agent-identity``): called once per request, in
    declaration order, before flow control and everything else of the decision; it may
    leave values in ``request.plugin_state`` (llm-d's request attributes). After them a
    request without a fairness ID takes ``plugin_state["agent-identity"]`` when set."""

    def request_header(self, request: LLMRequest) -> None: ...


@runtime_checkable
class Screener(Plugin, Protocol):
    """Narrows the candidates before the PrepareData plugins, admission and every
    scheduling profile run (llm-d-router's ``Screener``): each screener sees the same
    candidates and the EPP keeps the endpoints all of them kept (their intersection, in
    the candidates' order); none left answers 503 "screeners eliminated all endpoint
    candidates". Runs once per request, whatever the profiles."""

    def screen(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]: ...


@dataclass(frozen=True, slots=True)
class ResponseTimings:
    """What the protocol front measured of one response whose body it saw (GIE's
    ResponseBody hooks see the same, chunk by chunk). Seconds, from the decision.

    ``seconds``: to the end of the response. ``ttft``: to the first body chunk of a
    streamed (SSE) 2xx response, else None. ``tpot``: for such a response with more than
    one completion token in its usage, (end − first chunk) / (tokens − 1), else None.
    ``output_tokens``: the usage's completion tokens, None when not reported."""

    status: int
    seconds: float
    ttft: float | None = None
    tpot: float | None = None
    output_tokens: int | None = None


@runtime_checkable
class ResponseMeasured(Plugin, Protocol):
    """Learns from a finished response (the latency predictor trains on it).

    Called once per routed request whose response ended (not aborted) and whose body the
    EPP saw (GIE's gateway shape; declare :class:`NeedsResponse` with ``"body"``), just
    before the :class:`ResponseComplete` plugins."""

    def response_measured(self, request: LLMRequest, endpoint_key: str,
                          timings: ResponseTimings) -> None: ...


@runtime_checkable
class BackgroundPlugin(Plugin, Protocol):
    """A plugin with background work (e.g. the latency predictor's sidecar client: its
    HTTP session, periodic flushes). ``epp serve`` awaits ``start_background`` once the
    ports are up and ``stop_background`` at shutdown; a plugin used without a server
    (tests, ``epp check-config``) must work without either being called."""

    async def start_background(self) -> None: ...

    async def stop_background(self) -> None: ...


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


#: The two notification events (GIE's ``EventAddOrUpdate`` and ``EventDelete``).
EVENT_ADD_OR_UPDATE = "add-or-update"
EVENT_DELETE = "delete"


@runtime_checkable
class EndpointExtractor(DataExtractor, Protocol):
    """Reads ``endpoint-notification-source`` events: an endpoint joined the pool (or
    changed) — ``"add-or-update"`` — or left it — ``"delete"``."""

    def extract_endpoint(self, event: str, endpoint: Endpoint) -> None: ...


def gvk_string(group: str, version: str, kind: str) -> str:
    """A Kubernetes GroupVersionKind as Go's ``GroupVersionKind.String()`` writes it:
    ``apps/v1, Kind=Deployment``; ``/v1, Kind=Pod`` for the core group."""
    return f"{group}/{version}, Kind={kind}"


@runtime_checkable
class NotificationExtractor(DataExtractor, Protocol):
    """Reads ``k8s-notification-source`` events (GIE's ``NotificationExtractor``), with
    ``data_input = DATA_K8S_NOTIFICATIONS``.

    ``gvk`` (:func:`gvk_string`) is the kind it handles: it must be its source's.
    ``extract_notification`` is called in event order, from the event loop, for each
    object of that kind created or changed — ``"add-or-update"``, with the object as the
    API server's JSON (a dict) — and deleted — ``"delete"``, with its last known state
    (GIE promises only ``metadata.name`` and ``metadata.namespace`` there). The dict is a
    copy the source's extractors share: read it, keep it, do not change it. An exception
    is logged and the next extractor still runs.
    """

    @property
    def gvk(self) -> str: ...

    def extract_notification(self, event: str, obj: dict[str, Any]) -> None: ...


# --- data dependencies (GIE's ProducerPlugin / ConsumerPlugin; checked at config load by
# epp/datalayer/dependencies.py) ---

#: GIE v1.5.0's data keys: the endpoint attributes its plugins produce and consume. The
#: type names are what GIE compares (a key produced as one type and consumed as another
#: fails the config).
DATA_KEY_PREFIX_CACHE_MATCH_INFO = "PrefixCacheMatchInfoKey"  # PrefixCacheMatchInfo
DATA_KEY_IN_FLIGHT_LOAD = "InFlightLoadKey"  # InFlightLoad
DATA_KEY_LATENCY_PREDICTION_INFO = "LatencyPredictionInfoKey"  # LatencyPredictionInfo
DATA_KEY_KV_CACHE_USAGE_PERCENT = "KVCacheUsagePercent"  # float64
DATA_KEY_WAITING_QUEUE_SIZE = "WaitingQueueSize"  # int
DATA_KEY_RUNNING_REQUESTS_SIZE = "RunningRequestsSize"  # int
DATA_KEY_ACTIVE_MODELS = "ActiveModels"  # map[string]int
DATA_KEY_WAITING_MODELS = "WaitingModels"  # map[string]int


@runtime_checkable
class ProducesData(Plugin, Protocol):
    """A plugin that produces data other plugins read (GIE's ``ProducerPlugin``):
    ``produces`` maps each data key to the name of its type."""

    @property
    def produces(self) -> Mapping[str, str]: ...


@runtime_checkable
class ConsumesData(Plugin, Protocol):
    """A plugin that reads data other plugins produce (GIE's ``ConsumerPlugin``):
    ``consumes`` maps each data key to the name of the type it expects."""

    @property
    def consumes(self) -> Mapping[str, str]: ...


@runtime_checkable
class RequestParser(Plugin, Protocol):
    """A plugin the config's ``parser: {pluginRef: …}`` may name."""

    parser_protocol: str  # the payload format it reads, e.g. "openai"


class PluginTimer(Protocol):
    """Receives how long each plugin call took (metrics, trace spans)."""

    def __call__(self, extension_point: str, plugin: Plugin, seconds: float) -> None: ...


def no_timer(extension_point: str, plugin: Plugin, seconds: float) -> None:
    """A :class:`PluginTimer` that records nothing."""
