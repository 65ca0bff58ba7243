"""``agent-identity`` (llm-d-router): who the agent session of a request is.

llm-d-router v0.10.0 ``pkg/epp/framework/plugins/requestcontrol/requestheader/
agentidentity`` (``agent_identity.go``, its README): a RequestHeaderProcessor
(:class:`~epp.framework.interfaces.RequestHeaderProcessor`) that walks a list of agent
session headers and leaves the first non-empty value in ``request.plugin_state
["agent-identity"]`` (llm-d's request attribute of that name). The headers, in order:
``additionalSessionHeaders`` (lower-cased, order kept), then the built-in
``x-claude-code-session-id`` (Claude Code), ``x-session-affinity`` (OpenCode),
``session-id`` and ``session_id`` (Codex). Nothing matches: nothing is stored.

The plugin does not set the fairness ID itself; the scheduling core does, as llm-d's
Director: a request without ``x-gateway-inference-fairness-id`` takes the agent identity
as its flow-control fairness ID (else ``default-flow``), so every turn of an agent session
lands in the same fairness queue. ``session-affinity-scorer``/``-filter`` can read it too
(``sessionIdConfig.sources: [{attribute: agent-identity}]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import param
from epp.scheduling.types import LLMRequest

#: The request attribute (``plugin_state`` key) holding the identity (llm-d's
#: ``AgentIdentityKey``).
AGENT_IDENTITY_KEY: Final = "agent-identity"
DEFAULT_SESSION_HEADERS: Final = (
    "x-claude-code-session-id",  # Claude Code
    "x-session-affinity",  # OpenCode
    "session-id",  # Codex >= 0.131.0
    "session_id",  # Codex 0.130.x
)


def _header_list(v: Any, path: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(h, str) for h in v):
        raise ConfigError(f"{path}: expected a list of header names, got {v!r}")
    return tuple(v)


@dataclass(frozen=True)
class AgentIdentityParameters:
    additional_session_headers: tuple[str, ...] = param(
        "additionalSessionHeaders", (), parse=_header_list)


class AgentIdentity:
    type_name = "agent-identity"
    Parameters = AgentIdentityParameters

    def __init__(self, name: str, additional: Sequence[str] = ()) -> None:
        self.name = name
        # Extras first, then the defaults, lower-cased (request headers are); duplicates
        # and blanks kept, as llm-d: the first non-empty match wins anyway.
        self.priority_headers = tuple(h.lower() for h in (*additional,
                                                          *DEFAULT_SESSION_HEADERS))

    @classmethod
    def from_params(cls, name: str, params: AgentIdentityParameters,
                    handle: PluginHandle) -> AgentIdentity:
        return cls(name, params.additional_session_headers)

    def request_header(self, request: LLMRequest) -> None:
        for header in self.priority_headers:
            value = request.headers.get(header)
            if value:
                request.plugin_state[AGENT_IDENTITY_KEY] = value
                return
