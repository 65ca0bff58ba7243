"""Session affinity (llm-d): ``session-affinity-scorer`` and ``session-affinity-filter``.

Both follow llm-d-router v0.10.0 (pkg/epp/framework/plugins/scheduling/{scorer,filter}/
sessionaffinity and util/sessionaffinity) and share its two strategies, chosen by the
``strategy`` parameter:

- ``encoded_endpoint_header`` (the default), stateless: the request header
  ``encodedEndpointHeaderConfig.header`` (default ``x-session-token``) carries the standard
  base64 (with padding) of the endpoint's ``namespace/name`` (Kubernetes' NamespacedName
  string, so ``/name`` when there is no namespace), exactly as llm-d writes it, so a token
  minted by either EPP routes the same way. The plugin sets that header on the response to
  the token of the endpoint the request went to (the primary, or the first endpoint of
  profile ``profileName`` when set; no header when that profile did not run), so the
  client can send it back. The token is computed at ``pre_request`` and kept on the
  request; the Director asks for it through the ``ResponseHeaders`` hook.
- ``session_id``, stateful: an opaque session id is read from ``sessionIdConfig.sources``
  in order (each a request ``header``, or an ``attribute`` — a string another plugin left
  in ``request.plugin_state`` under that key, e.g. ``agent-identity`` or
  ``session-id-producer``'s ``SessionIDDataKey/session-id-producer``, as llm-d's plugins
  read its producer — first non-blank wins; default one header source ``x-session-id``). The plugin keeps a server-side binding session id →
  ``namespace/name`` of the endpoint that served it (the primary, or ``profileName``'s),
  refreshed by every request of the session and dropped when unused for
  ``evictionTtlSeconds`` (default 300; expired bindings are swept at most every
  ``evictionSweepSeconds``, default 10, on the next request). An unbound session has no
  preference. A bound session whose endpoint is among the candidates prefers it; when it
  is not among them the request goes elsewhere and the session moves to where it went.
  When the bound endpoint was a candidate but lost (a scorer outvoted it), the binding is
  kept. Nothing is written back to the client.

The scorer gives 1 to the session's endpoint(s) and 0 to the others (no session: 0
everywhere, no effect). The filter keeps only the session's endpoint when it is a
candidate, and every candidate otherwise (it never empties the set).
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epp import keys
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, param, report_unknown
from epp.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult

log = logging.getLogger(__name__)

STRATEGY_ENCODED_ENDPOINT_HEADER = "encoded_endpoint_header"
STRATEGY_SESSION_ID = "session_id"
DEFAULT_SESSION_ID_HEADER = "x-session-id"
DEFAULT_EVICTION_TTL_S = 300.0
DEFAULT_EVICTION_SWEEP_S = 10.0


def session_token(endpoint: Endpoint) -> str:
    """The ``x-session-token`` value naming ``endpoint``: base64 of ``namespace/name``."""
    return base64.b64encode(endpoint_id(endpoint).encode()).decode("ascii")


def endpoint_id(endpoint: Endpoint) -> str:
    """``namespace/name``: llm-d's endpoint ID string (what tokens and bindings name)."""
    return f"{endpoint.namespace}/{endpoint.name}"


def decode_session_token(token: str) -> str | None:
    """``namespace/name`` from a token, or None when it is not valid base64 / UTF-8."""
    try:
        return base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None


def normalize_header(name: str, default: str = keys.HEADER_SESSION_TOKEN) -> str:
    """Lower-cased and trimmed; ``default`` when blank (llm-d's ``NormalizeHeader``)."""
    return name.strip().lower() or default


# ------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class SessionIdSource:
    """One place a session id is read from: a request ``header`` or an ``attribute``."""

    header: str = ""
    attribute: str = ""


@dataclass(frozen=True)
class SessionIdConfig:
    """llm-d's ``sessionIdConfig`` (0 or absent values take the defaults)."""

    sources: tuple[SessionIdSource, ...] = ()
    eviction_ttl_s: float = 0.0
    eviction_sweep_s: float = 0.0

    def with_defaults(self) -> SessionIdConfig:
        return SessionIdConfig(
            self.sources or (SessionIdSource(header=DEFAULT_SESSION_ID_HEADER),),
            self.eviction_ttl_s or DEFAULT_EVICTION_TTL_S,
            self.eviction_sweep_s or DEFAULT_EVICTION_SWEEP_S)


def _str_field(raw: Mapping[str, Any], key: str, path: str) -> str:
    v = raw.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ConfigError(f"{path}.{key}: expected a string, got {v!r}")
    return v


def _number_field(raw: Mapping[str, Any], key: str, path: str) -> float:
    v = raw.get(key)
    if v is None:
        return 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{path}.{key}: expected a number of seconds, got {v!r}")
    return float(v)


def _mapping(v: Any, path: str, accepted: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{path}: expected a mapping with keys {', '.join(accepted)}, "
                          f"got {v!r}")
    report_unknown(path, set(v) - set(accepted), accepted)
    return v


def parse_encoded_endpoint_header_config(v: Any, path: str) -> str:
    """``encodedEndpointHeaderConfig`` → its ``header`` ("" when unset)."""
    return _str_field(_mapping(v, path, ("header",)), "header", path)


def parse_session_id_config(v: Any, path: str) -> SessionIdConfig:
    """``sessionIdConfig`` → :class:`SessionIdConfig` (types checked; values by
    :func:`check_session_id_config`, which llm-d runs only under ``session_id``)."""
    raw = _mapping(v, path, ("evictionSweepSeconds", "evictionTtlSeconds", "sources"))
    sources_raw = raw.get("sources") or []
    if not isinstance(sources_raw, list):
        raise ConfigError(f"{path}.sources: expected a list of {{header: NAME}} or "
                          f"{{attribute: KEY}}, got {sources_raw!r}")
    sources = []
    for i, s in enumerate(sources_raw):
        spath = f"{path}.sources[{i}]"
        s = _mapping(s, spath, ("attribute", "header"))
        sources.append(SessionIdSource(_str_field(s, "header", spath),
                                       _str_field(s, "attribute", spath)))
    return SessionIdConfig(tuple(sources), _number_field(raw, "evictionTtlSeconds", path),
                           _number_field(raw, "evictionSweepSeconds", path))


def check_session_id_config(c: SessionIdConfig) -> None:
    """llm-d's ``SessionIDConfig.Validate`` (after defaults), as a :class:`ParameterError`."""
    for i, s in enumerate(c.sources):
        if bool(s.header) == bool(s.attribute):
            raise ParameterError(f"sessionIdConfig.sources[{i}]",
                                 "exactly one of header or attribute must be set")
    if c.eviction_ttl_s <= 0:
        raise ParameterError("sessionIdConfig.evictionTtlSeconds",
                             f"must be > 0, got {c.eviction_ttl_s:g}")
    if c.eviction_sweep_s <= 0:
        raise ParameterError("sessionIdConfig.evictionSweepSeconds",
                             f"must be > 0, got {c.eviction_sweep_s:g}")


@dataclass(frozen=True)
class SessionAffinityParameters:
    strategy: str = param("strategy", STRATEGY_ENCODED_ENDPOINT_HEADER)
    profile_name: str = param("profileName", "")
    encoded_header: str = param("encodedEndpointHeaderConfig", "",
                                parse=parse_encoded_endpoint_header_config)
    session_id_config: SessionIdConfig = param(  # noqa: RUF009 -- param() is the framework's field(); frozen default
        "sessionIdConfig", SessionIdConfig(), parse=parse_session_id_config)

    def __post_init__(self) -> None:
        if self.strategy == STRATEGY_SESSION_ID:
            check_session_id_config(self.session_id_config.with_defaults())
        elif self.strategy != STRATEGY_ENCODED_ENDPOINT_HEADER:
            raise ParameterError("strategy", f"must be {STRATEGY_ENCODED_ENDPOINT_HEADER!r} or "
                                 f"{STRATEGY_SESSION_ID!r}, got {self.strategy!r}")


# ------------------------------------------------------------------------- strategies


def _profile_endpoint(result: SchedulingResult, profile: str) -> Endpoint | None:
    """The first endpoint of ``profile`` (the primary when ""), None when it has none."""
    r = result.profile_results.get(profile or result.primary_profile)
    return r.endpoints[0] if r is not None and r.endpoints else None


class SessionBindings:
    """llm-d's ``SessionIDHeader``: session id → endpoint ID, refreshed on use, evicted
    when unused for ``ttl`` seconds (swept at most every ``sweep`` seconds)."""

    def __init__(self, name: str, config: SessionIdConfig, profile_name: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        config = config.with_defaults()
        self.name = name
        self.sources = config.sources
        self.profile_name = profile_name
        self.ttl = config.eviction_ttl_s
        self.sweep_interval = config.eviction_sweep_s
        self.clock = clock
        self.bindings: dict[str, tuple[str, float]] = {}  # id -> (endpoint ID, last seen)
        self._last_sweep = clock()
        self._presence_key = f"{name}/session-bound-endpoint-present"

    def session_id(self, request: LLMRequest) -> str:
        """The first non-blank id from the sources, in order; "" when none."""
        for s in self.sources:
            if s.header:
                v: Any = request.headers.get(normalize_header(s.header, DEFAULT_SESSION_ID_HEADER))
            else:
                v = request.plugin_state.get(s.attribute)
            if isinstance(v, str) and v.strip():
                return v.strip()
        return ""

    def _sweep(self) -> None:
        now = self.clock()
        if now - self._last_sweep < self.sweep_interval:
            return
        self._last_sweep = now
        for sid, (_, seen) in list(self.bindings.items()):
            if now - seen > self.ttl:
                del self.bindings[sid]

    def bound(self, session_id: str) -> str | None:
        self._sweep()
        b = self.bindings.get(session_id)
        return b[0] if b is not None else None

    def choose(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> Endpoint | None:
        """The candidate the request's session is bound to; None when there is no session,
        no binding, or the bound endpoint is not a candidate (remembered for
        :meth:`pre_request`)."""
        if not endpoints:
            return None
        sid = self.session_id(request)
        if not sid:
            return None
        target_id = self.bound(sid)
        if target_id is None:
            return None
        target = None
        for e in endpoints:
            if endpoint_id(e) == target_id:
                target = e
        request.plugin_state[self._presence_key] = target is not None
        return target

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """Bind a new session; refresh a binding the request kept; move a binding whose
        endpoint was not a candidate to the endpoint the request went to."""
        sid = self.session_id(request)
        if not sid:
            return
        picked = _profile_endpoint(result, self.profile_name)
        if picked is None:
            return
        now = self.clock()
        existing = self.bindings.get(sid)
        if existing is None or existing[0] == endpoint_id(picked):
            self.bindings[sid] = (endpoint_id(picked), now)
            return
        if request.plugin_state.get(self._presence_key) is False:  # genuinely absent
            log.debug("session affinity %s: session moved from %s to %s",
                      self.name, existing[0], endpoint_id(picked))
            self.bindings[sid] = (endpoint_id(picked), now)


class _SessionAffinity:
    """What the scorer and the filter share: parameters, token/binding bookkeeping, and
    the ``pre_request`` / ``response_headers`` hooks."""

    type_name = ""
    Parameters = SessionAffinityParameters

    def __init__(self, name: str, strategy: str = STRATEGY_ENCODED_ENDPOINT_HEADER,
                 header: str = "", profile_name: str = "",
                 session_id_config: SessionIdConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.strategy = strategy
        self.header = normalize_header(header)
        self.profile_name = profile_name
        self.sessions: SessionBindings | None = None
        if strategy == STRATEGY_SESSION_ID:
            self.sessions = SessionBindings(name, session_id_config or SessionIdConfig(),
                                            profile_name, clock)

    @classmethod
    def from_params(cls, name: str, params: SessionAffinityParameters,
                    handle: PluginHandle) -> Any:
        return cls(name, params.strategy, params.encoded_header, params.profile_name,
                   params.session_id_config)

    def _token(self, request: LLMRequest) -> str | None:
        if self.header == keys.HEADER_SESSION_TOKEN and request.session_token:
            return request.session_token
        return request.headers.get(self.header)

    def _token_target(self, request: LLMRequest) -> str | None:
        """``namespace/name`` named by the request's token (encoded strategy)."""
        token = self._token(request)
        return decode_session_token(token) if token else None

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        if self.sessions is not None:
            self.sessions.pre_request(request, result)
            return
        chosen = _profile_endpoint(result, self.profile_name)
        if chosen is not None:
            request.plugin_state[self.name] = session_token(chosen)

    def response_headers(self, request: LLMRequest, endpoint_key: str, status: int,
                         headers: Mapping[str, str]) -> Mapping[str, str] | None:
        """``{header: token}`` for a routed request, whatever the status (as llm-d)."""
        if self.sessions is not None:
            return None
        token = request.plugin_state.get(self.name)
        if not isinstance(token, str):
            return None
        return {self.header: token}


class SessionAffinityScorer(_SessionAffinity):
    """1 for the endpoint(s) of the request's session, 0 for the others."""

    type_name = "session-affinity-scorer"

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        if self.sessions is not None:
            target = self.sessions.choose(request, endpoints)
            return [1.0 if e is target else 0.0 for e in endpoints]
        target_id = self._token_target(request)
        if target_id is None:
            return [0.0] * len(endpoints)
        return [1.0 if endpoint_id(e) == target_id else 0.0 for e in endpoints]


class SessionAffinityFilter(_SessionAffinity):
    """Only the session's endpoint when it is a candidate; every candidate otherwise."""

    type_name = "session-affinity-filter"

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        if self.sessions is not None:
            target = self.sessions.choose(request, endpoints)
            return [target] if target is not None else endpoints
        target_id = self._token_target(request)
        if target_id:
            for e in endpoints:
                if endpoint_id(e) == target_id:
                    return [e]
        return endpoints
