"""Value types the scheduler works on.

Scheduling runs on an immutable snapshot of endpoint state taken at the start of a cycle
(design.md §4): :class:`Endpoint` and :class:`Metrics` are frozen; the datastore replaces
them, never mutates them. :class:`LLMRequest` is the compact request the scheduler sees —
model, prompt view, headers — so the protocol front can live in another process.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

_EMPTY: Mapping[str, str] = MappingProxyType({})


class ApiType(enum.StrEnum):
    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat_completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class Metrics:
    """Load signals of one endpoint, as last scraped.

    ``updated_at`` is the ``time.monotonic()`` of the last successful scrape, ``None`` when
    the endpoint was never scraped: scorers treat such endpoints as equally loaded.
    The metrics scraper refreshes it in the datastore at least every
    ``ScrapeOptions.freshness_resolution_s`` while scrapes succeed (always when a value
    changes), so :meth:`age` may over-state the true age by that much.

    ``stale`` is set by the scraper when the last successful scrape is older than its
    staleness threshold (``--metrics-staleness-threshold``): the values are the last
    ones seen, kept rather than dropped. It is the authoritative freshness signal;
    :meth:`is_stale` combines it with a caller's own threshold.

    ``unreachable`` is set by the scraper when the endpoint's metrics port refuses or
    drops connections (or times out several polls in a row, see
    epp/datalayer/scraper.py): the pod is most likely dead. The datastore leaves such
    endpoints out of :meth:`Datastore.routable` — the candidates the scheduler gets —
    unless every endpoint is unreachable (fail open). The pod's next HTTP answer clears it.
    """

    waiting_queue_size: int = 0
    running_requests: int = 0
    kv_cache_usage: float = 0.0
    active_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    max_loras: int = 0
    block_size: int | None = None
    num_blocks: int | None = None
    updated_at: float | None = None
    stale: bool = False
    unreachable: bool = False
    attributes: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}), hash=False)  # named scalar values from data sources (llm-d's ScalarMetricValue endpoint attributes)

    def age(self, now: float) -> float | None:
        """Seconds since the last successful scrape, or None if never scraped."""
        return None if self.updated_at is None else max(0.0, now - self.updated_at)

    def is_stale(self, now: float, threshold: float | None = None) -> bool:
        """True when marked stale, or (given ``threshold``) never scraped or older than it."""
        if self.stale:
            return True
        if threshold is None:
            return False
        return self.updated_at is None or now - self.updated_at > threshold


NO_METRICS = Metrics()


def host_port(address: str, port: int) -> str:
    """``address:port`` (IPv6 addresses in brackets), as Envoy's destination header wants."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


@dataclass(frozen=True, slots=True, eq=False)
class Endpoint:
    """One serving endpoint: a pod's target port. ``key`` is ``address:port``."""

    name: str
    address: str
    port: int
    namespace: str = ""
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    node_name: str | None = None
    node_labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    metrics: Metrics = NO_METRICS
    node_address: str | None = None  # the node's IP (pod.status.hostIP; llm-d's NodeAddress)
    key: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", host_port(self.address, self.port))

    def same_identity(self, other: Endpoint) -> bool:
        """True when only metrics differ (discovery updates keep metrics of such endpoints)."""
        return (
            self.key == other.key
            and self.name == other.name
            and self.namespace == other.namespace
            and dict(self.labels) == dict(other.labels)
            and self.node_name == other.node_name
            and dict(self.node_labels) == dict(other.node_labels)
            and self.node_address == other.node_address
        )


@dataclass(slots=True)
class LLMRequest:
    """The compact request the scheduler sees.

    ``prompt`` is the prompt text as the model sees it (all chat messages in order, with
    roles), used by prefix-affinity plugins. ``target_model`` is the model after any
    rewrite; ``incoming_model`` is what the client asked for.
    """

    request_id: str
    target_model: str
    incoming_model: str
    api: ApiType
    prompt: str
    headers: Mapping[str, str]
    stream: bool = False
    max_tokens: int | None = None
    cache_salt: str | None = None
    user: str | None = None
    objective: str | None = None
    fairness_id: str | None = None
    session_token: str | None = None
    request_size_bytes: int = 0  # the body sent upstream (GIE's LLMRequest.RequestSizeBytes)
    # The priority of the request's InferenceObjective (``objective``; GIE's
    # RequestObjectives.Priority): 0 without one. Higher is more important; negative allowed.
    priority: int = 0
    # The InferenceModelRewrite that chose ``target_model`` (None: no rule matched).
    model_rewrite: str | None = None
    # Per-request data plugins compute once and share (e.g. prompt block hashes), keyed
    # by plugin name.
    plugin_state: dict[str, Any] = field(default_factory=dict)


class CycleState(dict[str, Any]):
    """Per-scheduling-cycle scratch space shared by plugins (keys are plugin-chosen)."""


@dataclass(frozen=True, slots=True)
class ScoredEndpoint:
    endpoint: Endpoint
    score: float


@dataclass(frozen=True, slots=True)
class ProfileRunResult:
    """The endpoints one profile chose, primary first (the rest are fallbacks)."""

    endpoints: tuple[Endpoint, ...]
    scores: Mapping[str, float] = field(default_factory=dict)  # endpoint key -> total weighted score
    # Every candidate the profile scored with its weighted total, picked or not (llm-d's
    # ScoredCandidates; set by SchedulerProfile.run): --emit-endpoint-scores.
    candidates: tuple[ScoredEndpoint, ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    """Every profile's result (None = that profile filtered to nothing) and the primary.

    ``destination_port``: send the request to each primary endpoint's address at this
    port instead of the endpoint's own (llm-d's ``primaryPort``: a data-parallel pod's
    sidecar, which forwards to the rank named in ``x-data-parallel-host-port``).
    """

    profile_results: Mapping[str, ProfileRunResult | None]
    primary_profile: str
    destination_port: int | None = None

    @property
    def primary(self) -> ProfileRunResult:
        result = self.profile_results[self.primary_profile]
        assert result is not None, "primary profile must have a result"
        return result

    def destination(self) -> str:
        """What goes in ``x-gateway-destination-endpoint``: the primary endpoints, in
        order, comma-separated (the first is the pick, the rest fallbacks)."""
        port = self.destination_port
        if port is None:
            return ",".join(e.key for e in self.primary.endpoints)
        return ",".join(dict.fromkeys(host_port(e.address, port)
                                      for e in self.primary.endpoints))
