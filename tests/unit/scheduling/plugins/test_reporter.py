"""request-attribute-reporter's wiring to the ext_proc handler: the ``usage`` its
expressions see (GIE's requestcontrol.Usage as JSON) and the ``response_metadata`` hook,
driven through a real Director."""

from __future__ import annotations

from pathlib import Path

import orjson

from epp.config.loader import load_and_build
from epp.datastore.store import Datastore
from epp.observability.metrics import EppMetrics
from epp.parsing.usage import Usage
from epp.requestcontrol.director import Director, SchedulingCore
from epp.scheduling.plugins.reporter import response_metadata, usage_object
from epp.scheduling.types import Endpoint

FIXTURE = (Path(__file__).resolve().parents[3] / "fixtures" / "gie-v1.5.0" / "test" /
           "integration" / "epp" / "testdata" / "request-attribute-reporter-config.yaml")

TWO_REPORTERS = """\
plugins:
- type: queue-scorer
- name: cost
  type: request-attribute-reporter
  parameters:
    attributes:
    - key: {name: cost}
      expression: usage.total_tokens
- name: cached
  type: request-attribute-reporter
  parameters:
    attributes:
    - key: {namespace: my.ns, name: cached}
      expression: usage.prompt_token_details.cached_tokens
      condition: has(usage.prompt_token_details)
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""

H = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r1"}
CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def test_usage_object_is_gies_usage_json() -> None:
    assert usage_object(None) == {"prompt_tokens": 0, "completion_tokens": 0,
                                  "total_tokens": 0}
    assert usage_object(Usage(32, 10, None)) == {"prompt_tokens": 32, "completion_tokens": 10,
                                                 "total_tokens": 42}
    assert usage_object(Usage(None, 10, 4)) == {
        "prompt_tokens": 0, "completion_tokens": 10, "total_tokens": 10,
        "prompt_token_details": {"cached_tokens": 4}}


def test_no_reporters_no_hook() -> None:
    assert response_metadata([]) is None
    assert response_metadata(load_and_build().response_usage_metadata) is None


async def _respond(config: str, body: bytes, status: int = 200) -> object:
    built = load_and_build(text=config)
    store = Datastore()
    store.set_endpoints([Endpoint("p1", "10.0.0.1", 8000)])
    d = Director(SchedulingCore(store, built.scheduler, EppMetrics(store), built.pre_request,
                                built.response_complete), built.parser_plugin)
    hook = response_metadata(built.response_usage_metadata)
    assert hook is not None
    r = await d.route(H, CHAT, True, None)
    d.on_response_headers(r.context, status, {"content-type": "application/json"})
    d.on_response_body(r.context, body, True)
    d.on_done(r.context, False)
    return hook(r.context)


async def test_gies_config_reports_completion_tokens() -> None:
    body = b'{"usage":{"completion_tokens":10,"prompt_tokens":32,"total_tokens":42}}'
    got = await _respond(FIXTURE.read_text(), body)
    assert got == {"envoy.lb": {"x-gateway-inference-request-cost": 10.0}}
    # No usage: GIE's usage has completion_tokens 0, the condition holds, zero is not sent.
    assert await _respond(FIXTURE.read_text(), b'{"choices":[]}') is None


async def test_reporters_are_merged_by_namespace() -> None:
    body = (b'{"usage":{"completion_tokens":10,"prompt_tokens":32,'
            b'"prompt_tokens_details":{"cached_tokens":16}}}')
    assert await _respond(TWO_REPORTERS, body) == {"envoy.lb": {"cost": 42.0},
                                                   "my.ns": {"cached": 16.0}}
    # An error response is still read, as GIE runs its ResponseBody plugins on every one.
    assert await _respond(TWO_REPORTERS, b'{"usage":{"prompt_tokens":3}}', 500) == {
        "envoy.lb": {"cost": 3.0}}
