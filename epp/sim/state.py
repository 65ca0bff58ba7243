"""One simulated pod's state, and what the simulator's HTTP modules share.

:class:`SimState` is an app's state (``app[STATE_KEY]``, one per simulated pod, never
shared): its name, model, :class:`~epp.sim.config.SimConfig`, engine, Prometheus
registry, seeded random source, tokenizer, the ``/debug/requests`` log, the P/D
counters (:class:`PdStats`) and the E/P/D ones (:class:`EncodeStats`). Also here: the OpenAI-style error (:class:`HttpError`,
:func:`error_response`) and the small helpers :mod:`epp.sim.openai_api`,
:mod:`epp.sim.sidecar` and :mod:`epp.sim.app` all use.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from epp.sim.config import SimConfig
from epp.sim.engine import Engine
from epp.sim.tokens import SimTokenizer, WordTokenizer
from epp.sim.topology import PeerTopology

__all__ = [
    "DEBUG_LOG_SIZE",
    "DEFAULT_MAX_TOKENS",
    "JSON_CONTENT_TYPE",
    "RECORD_KEY",
    "SIM_SERVER_HEADER",
    "STATE_KEY",
    "EncodeStats",
    "HttpError",
    "Json",
    "PdStats",
    "SimState",
    "error_response",
    "json_response",
    "local_port",
]

SIM_SERVER_HEADER: Final = "x-sim-server"
DEFAULT_MAX_TOKENS: Final = 16
DEBUG_LOG_SIZE: Final = 1000
JSON_CONTENT_TYPE: Final = "application/json"

Json = dict[str, Any]


@dataclass
class SimState:
    """Per-app state (one simulated pod). Owned by its app, never shared."""

    name: str
    model: str
    config: SimConfig
    engine: Engine
    registry: CollectorRegistry
    rng: random.Random
    delay_s: float = 0.0
    requests: deque[Json] = field(default_factory=lambda: deque(maxlen=DEBUG_LOG_SIZE))
    address: str = "127.0.0.1"
    """The address this pod is known by (for finding its own entry in ``peers``)."""
    topology: dict[str, str] | None = None
    """This pod's topology (``--topology``); None: look it up in ``peers``."""
    peers: PeerTopology | None = None
    """Topologies of the pods in the endpoints file (``--peer-topology-file``)."""
    pd: PdStats = field(default_factory=lambda: PdStats())
    encode: EncodeStats = field(default_factory=lambda: EncodeStats())
    http: aiohttp.ClientSession | None = None
    tokenizer: SimTokenizer = field(default_factory=WordTokenizer)
    """Prompts and chat messages to token ids (``--tokenizer``; words by default)."""

    def inject_error(self) -> bool:
        """Draw once from the seeded source: True with probability ``error_rate``."""
        rate = self.config.error_rate
        return rate > 0 and self.rng.random() < rate

    def own_topology(self, port: int) -> dict[str, str] | None:
        if self.topology:
            return self.topology
        if self.peers is None:
            return None
        return self.peers.own(self.address, port)

    def client(self) -> aiohttp.ClientSession:
        """The HTTP client for prefill requests (created on first use, closed with the
        app)."""
        if self.http is None or self.http.closed:
            self.http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.prefill_timeout_s),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self.http


@dataclass
class PdStats:
    """Decode role: what the decode sidecar did (``GET /debug/state`` → ``pd``)."""

    remote_prefills: int = 0
    """Requests prefilled by a prefill pod (its answer was 2xx)."""
    prefill_failures: int = 0
    """Prefill pods that failed or could not be reached."""
    fallbacks: int = 0
    """Of those, requests then prefilled locally (``prefill_failure = fallback``)."""
    by_distance: dict[str, int] = field(default_factory=dict)
    """Remote prefills by the prefill pod's distance (``node`` … ``other``, ``unknown``)."""
    by_prefiller: dict[str, int] = field(default_factory=dict)
    """Remote prefills by prefill pod (``address:port``)."""

    def as_dict(self) -> Json:
        return {
            "remote_prefills": self.remote_prefills,
            "prefill_failures": self.prefill_failures,
            "fallbacks": self.fallbacks,
            "by_distance": dict(self.by_distance),
            "by_prefiller": dict(self.by_prefiller),
        }


@dataclass
class EncodeStats:
    """Multimodal encode work (``GET /debug/state`` → ``encode``): what this pod encoded
    (an ``encode``-role pod for others; any pod for itself) and, on a decode pod, what
    its sidecar had encode pods do."""

    requests: int = 0
    """Requests whose items this pod encoded (as an encode pod, or locally)."""
    items: int = 0
    """Multimodal items this pod encoded."""
    encode_ms: float = 0.0
    """Model milliseconds of encode work this pod charged (``encode_ms_per_image`` each)."""
    remote_requests: int = 0
    """Decode role: requests whose items encode pods encoded (every item answered 2xx)."""
    remote_items: int = 0
    """Decode role: items sent to encode pods and encoded there."""
    failures: int = 0
    """Decode role: requests for which an encode pod failed or could not be reached."""
    fallbacks: int = 0
    """Of those, requests then encoded locally (``encode_failure = fallback``)."""
    by_encoder: dict[str, int] = field(default_factory=dict)
    """Decode role: items encoded by encode pod (``address:port``)."""

    def charge(self, items: int, ms: float) -> None:
        """Count ``items`` encoded here at a cost of ``ms``."""
        if items:
            self.requests += 1
            self.items += items
            self.encode_ms += ms

    def as_dict(self) -> Json:
        return {
            "requests": self.requests,
            "items": self.items,
            "encode_ms": round(self.encode_ms, 6),
            "remote_requests": self.remote_requests,
            "remote_items": self.remote_items,
            "failures": self.failures,
            "fallbacks": self.fallbacks,
            "by_encoder": dict(self.by_encoder),
        }


STATE_KEY: Final = web.AppKey("sim_state", SimState)
RECORD_KEY: Final = web.RequestKey("epp_sim_debug_record", dict)
"""Request key of the request's ``/debug/requests`` record (handlers add to it)."""


class HttpError(Exception):
    """Becomes an OpenAI error response with ``status``."""

    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type=JSON_CONTENT_TYPE)


def error_response(message: str, status: int = 400,
                   err_type: str = "BadRequestError") -> web.Response:
    """An OpenAI error body ``{"error": {"message", "type", "code"}}`` with ``status``."""
    return json_response(
        {"error": {"message": message, "type": err_type, "code": status}}, status=status
    )


def local_port(request: web.Request) -> int:
    """The port ``request`` arrived on (0 if unknown)."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return int(sockname[1]) if isinstance(sockname, tuple) and len(sockname) >= 2 else 0
