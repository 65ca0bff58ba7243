"""llm-d-router v0.10.0's ``agent-identity`` request-header processor (issue 18) and the
RequestHeaderProcessor extension point: the identity becomes the fairness ID of a
request without ``x-gateway-inference-fairness-id`` (llm-d's Director).

Go sources: pkg/epp/framework/plugins/requestcontrol/requestheader/agentidentity/
{agent_identity.go,agent_identity_test.go,README.md}, pkg/epp/requestcontrol/director.go
(runRequestHeaderProcessors and the FairnessID derivation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from epp.config.loader import load_and_build
from epp.errors import ConfigError
from epp.framework.interfaces import RequestHeaderProcessor
from epp.requestcontrol.agent_identity import AGENT_IDENTITY_KEY, AgentIdentity
from epp.requestcontrol.director import build_request
from epp.scheduling.types import ApiType, LLMRequest
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, ServerParts, wire


def req(headers: dict[str, str]) -> LLMRequest:
    return LLMRequest(request_id="r", target_model="m", incoming_model="m",
                      api=ApiType.CHAT_COMPLETIONS, prompt="hi", headers=headers)


def identity(headers: dict[str, str], extra: tuple[str, ...] = ()) -> Any:
    r = req(headers)
    AgentIdentity("agent-identity", extra).request_header(r)
    return r.plugin_state.get(AGENT_IDENTITY_KEY)


@pytest.mark.parametrize(("headers", "want"), [
    ({"x-claude-code-session-id": "cc-1"}, "cc-1"),
    ({"x-session-affinity": "oc-1"}, "oc-1"),
    ({"session-id": "codex-1"}, "codex-1"),
    ({"session_id": "codex-old"}, "codex-old"),
    # the built-in order decides between several
    ({"session_id": "d", "session-id": "c", "x-session-affinity": "b",
      "x-claude-code-session-id": "a"}, "a"),
    ({"x-claude-code-session-id": "", "x-session-affinity": "b"}, "b"),  # empty skipped
    ({"x-other": "z"}, None),
    ({}, None),
])
def test_builtin_headers(headers: dict[str, str], want: str | None) -> None:
    assert identity(headers) == want


def test_additional_headers_come_first_lowercased() -> None:
    both = {"x-my-agent": "mine", "x-claude-code-session-id": "cc"}
    assert identity(both, ("X-My-Agent",)) == "mine"
    assert identity({"x-claude-code-session-id": "cc"}, ("x-my-agent",)) == "cc"
    p = AgentIdentity("a", ("X-A", "", "x-a"))
    assert p.priority_headers[:3] == ("x-a", "", "x-a")  # kept as given, as llm-d
    assert isinstance(p, RequestHeaderProcessor)


def test_parameters() -> None:
    built = load_and_build(None, "plugins: [{type: agent-identity, parameters: "
                           "{additionalSessionHeaders: [x-my-agent-session, X-Other]}}]\n")
    p = built.plugins["agent-identity"]
    assert isinstance(p, AgentIdentity)
    assert p.priority_headers[:2] == ("x-my-agent-session", "x-other")
    assert isinstance(load_and_build(None, "plugins: [{type: agent-identity}]\n")
                      .plugins["agent-identity"], AgentIdentity)
    with pytest.raises(ConfigError, match="additionalSessionHeaders: expected a list of "
                       "header names"):
        load_and_build(None, "plugins: [{type: agent-identity, parameters: "
                       "{additionalSessionHeaders: x-one}}]\n")


CONFIG = """
plugins:
- type: agent-identity
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
"""


def server(text: str) -> ServerParts:
    timings = PluginTimings()
    built = load_and_build(None, text, timer=timings, strict=True)
    return wire(validate(ServeOptions(static=StaticSourceOptions(
        endpoints="10.0.0.1:8000,10.0.0.2:8000"))), built, timings, None)


async def fairness_of(parts: ServerParts, **headers: str) -> str | None:
    """The fairness ID of a request the core decided (what flow control reads)."""
    request, _ = build_request({":path": "/v1/chat/completions", **headers}, orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}), True)
    decision = await parts.core.decide_request(request, None)
    parts.core.complete(decision.ticket, 0, True, None)
    return request.fairness_id


async def test_agent_identity_becomes_the_fairness_id() -> None:
    parts = server(CONFIG)
    assert [p.name for p in parts.core.request_header_processors] == ["agent-identity"]
    assert await fairness_of(parts, **{"x-session-affinity": "agent-7"}) == "agent-7"
    # the explicit header wins
    assert await fairness_of(parts, **{"x-session-affinity": "agent-7",
                                       "x-gateway-inference-fairness-id": "team-a"}) == "team-a"
    assert await fairness_of(parts) is None  # flow control reads it as default-flow


def test_example_config_loads() -> None:
    """config/examples/llmd-agent-sessions.yaml: the agent identity as the session
    affinity's fallback source after session-id-producer's cookie."""
    root = Path(__file__).parents[3]
    built = load_and_build(str(root / "config/examples/llmd-agent-sessions.yaml"),
                           strict=True)
    assert isinstance(built.plugins["agent-identity"], AgentIdentity)
    scorer = built.plugins["session-affinity-scorer"]
    sessions = getattr(scorer, "sessions", None)
    assert sessions is not None
    assert [s.attribute for s in sessions.sources] == [
        "SessionIDDataKey/session-id-producer", AGENT_IDENTITY_KEY]
