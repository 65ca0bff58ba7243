"""``session-affinity-scorer`` (llm-d): keep a client session on the endpoint it started on.

The token is the standard base64 (with padding) of the endpoint's ``namespace/name``
(Kubernetes' NamespacedName string, so ``/name`` when there is no namespace), exactly as
llm-d writes it, so a token minted by either EPP routes the same way.

- Scoring: a request carrying ``x-session-token`` scores 1 on the endpoint(s) the token
  names and 0 elsewhere; without a token (or with one that does not decode) every
  endpoint scores 0, so the scorer has no effect.
- Response: the EPP sets ``x-session-token`` on the response to the token of the endpoint
  the request was routed to (the primary), so the client can send it back. The token is
  computed at ``pre_request`` and kept on the request; the Director asks for it through
  the ``ResponseHeaders`` hook when the response headers arrive.

If the named endpoint has left the pool or was filtered out, the session moves to
whichever endpoint wins and the next response carries the new token.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence

from epp import keys
from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters
from epp.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult


def session_token(endpoint: Endpoint) -> str:
    """The ``x-session-token`` value naming ``endpoint``: base64 of ``namespace/name``."""
    return base64.b64encode(f"{endpoint.namespace}/{endpoint.name}".encode()).decode("ascii")


def decode_session_token(token: str) -> str | None:
    """``namespace/name`` from a token, or None when it is not valid base64 / UTF-8."""
    try:
        return base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None


class SessionAffinityScorer:
    """1 for the endpoint named by the request's ``x-session-token``, 0 for the others."""

    type_name = "session-affinity-scorer"
    Parameters = NoParameters

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> SessionAffinityScorer:
        return cls(name)

    @staticmethod
    def _token(request: LLMRequest) -> str | None:
        return request.session_token or request.headers.get(keys.HEADER_SESSION_TOKEN)

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        token = self._token(request)
        target = decode_session_token(token) if token else None
        if target is None:
            return [0.0] * len(endpoints)
        return [1.0 if f"{e.namespace}/{e.name}" == target else 0.0 for e in endpoints]

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """Remember the token of the endpoint the request goes to (the primary)."""
        chosen = result.primary.endpoints
        if chosen:
            request.plugin_state[self.name] = session_token(chosen[0])

    def response_headers(self, request: LLMRequest, endpoint_key: str, status: int,
                         headers: Mapping[str, str]) -> Mapping[str, str] | None:
        """``{x-session-token: token}`` for a routed request, whatever the status (as llm-d)."""
        token = request.plugin_state.get(self.name)
        if not isinstance(token, str):
            return None
        return {keys.HEADER_SESSION_TOKEN: token}
