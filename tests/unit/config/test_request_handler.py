"""llm-d-router's top-level ``requestHandler:`` section (epp/config/loader.py) and the
llm-d-router v0.10.0 configs that use it (tests/fixtures/llm-d-router-v0.10.0).

Cases follow llm-d-router v0.10.0 pkg/epp/config/loader/testdata_test.go
(successParserConfigText, successParserWithNameConfigText,
successMultipleParsersConfigText, errorParserWrongPluginTypeText,
errorParserWrongPluginNameText)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import orjson
import pytest
import yaml

from epp.config.loader import BuiltConfig, build, load_and_build, parse_config
from epp.errors import BadRequest, ConfigError
from epp.parsing.anthropic import AnthropicUsageParser
from epp.parsing.dispatch import ParserRouter
from epp.parsing.parsers import AnthropicParser, OpenAIParser, PassthroughParser
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.datalayer import MetricsDataSource
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, wire
from epp.server.workers import _front_parser

SRC = "rh.yaml"
FIXTURES = Path(__file__).parents[2] / "fixtures" / "llm-d-router-v0.10.0"
TESTDATA = FIXTURES / "test/integration/epp/testdata"
PERF = FIXTURES / "test/perf/config/router-configs/random-passthrough-parser.yaml"

HEAD = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- name: maxScore
  type: max-score-picker
"""
PROFILE = """\
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: maxScore
"""


def build_text(text: str) -> BuiltConfig:
    return build(parse_config(textwrap.dedent(text), SRC))


def config_error(text: str, *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        build_text(text)
    msg = str(info.value)
    for f in (SRC, *fragments):
        assert f in msg, msg
    return msg


def test_one_parser() -> None:
    built = build_text(HEAD + "- type: openai-parser\n" + PROFILE
                       + "requestHandler:\n  parsers:\n  - pluginRef: openai-parser\n")
    assert isinstance(built.parser_plugin, OpenAIParser)
    assert built.config.request_handler is not None
    assert [p.plugin_ref for p in built.config.request_handler.parsers] == ["openai-parser"]


def test_one_parser_with_name_reads_every_path() -> None:
    built = build_text(HEAD + "- name: anthropicParser\n  type: anthropic-parser\n" + PROFILE
                       + "requestHandler:\n  parsers:\n  - pluginRef: anthropicParser\n")
    assert isinstance(built.parser_plugin, AnthropicParser)
    assert built.parser_plugin.name == "anthropicParser"


def test_multiple_parsers_make_a_router() -> None:
    built = build_text(HEAD + "- type: openai-parser\n- name: secondParser\n"
                       "  type: anthropic-parser\n" + PROFILE
                       + "requestHandler:\n  parsers:\n  - pluginRef: openai-parser\n"
                       "  - pluginRef: secondParser\n")
    router = built.parser_plugin
    assert isinstance(router, ParserRouter)
    assert [p.name for p in router.parsers] == ["openai-parser", "secondParser"]


@pytest.mark.parametrize("section", ["requestHandler: {}\n", "requestHandler:\n  parsers: []\n",
                                     "requestHandler:\n"])
def test_no_parsers_listed_is_the_default(section: str) -> None:
    built = build_text(HEAD + PROFILE + section)
    assert isinstance(built.parser_plugin, OpenAIParser)


def test_request_handler_wins_over_parser_with_a_warning() -> None:
    built = build_text(HEAD + "- type: openai-parser\n- type: passthrough-parser\n" + PROFILE
                       + "parser: {pluginRef: openai-parser}\n"
                       "requestHandler:\n  parsers:\n  - pluginRef: passthrough-parser\n")
    assert isinstance(built.parser_plugin, PassthroughParser)
    assert any("'requestHandler.parsers' is used" in w for w in built.warnings)


def test_wrong_plugin_type() -> None:
    config_error(HEAD + "- name: openaiParser\n  type: openai-parser\n" + PROFILE
                 + "requestHandler:\n  parsers:\n  - pluginRef: maxScore\n",
                 "requestHandler.parsers[0].pluginRef", "'maxScore' (max-score-picker) is not "
                 "a parser plugin")


def test_wrong_plugin_name() -> None:
    config_error(HEAD + "- name: openaiParser\n  type: openai-parser\n" + PROFILE
                 + "requestHandler:\n  parsers:\n  - pluginRef: wrongParser\n",
                 "requestHandler.parsers[0].pluginRef", "no plugin named 'wrongParser'")


def test_undeclared_builtin_type_is_not_injected() -> None:
    # llm-d's validateParsers: a pluginRef must name a plugin of the config.
    config_error(HEAD + PROFILE + "requestHandler:\n  parsers:\n  - pluginRef: anthropic-parser\n",
                 "requestHandler.parsers[0].pluginRef", "no plugin named 'anthropic-parser'")


@pytest.mark.parametrize(("section", "fragments"), [
    ("requestHandler: [a]\n", ["requestHandler: expected a mapping"]),
    ("requestHandler: {parser: []}\n", ["requestHandler: unknown key(s) 'parser'"]),
    ("requestHandler: {parsers: openai-parser}\n",
     ["requestHandler.parsers: expected a list"]),
    ("requestHandler: {parsers: [{}]}\n", ["requestHandler.parsers[0]: missing 'pluginRef'"]),
    ("requestHandler: {parsers: [{pluginRef: a, weight: 1}]}\n",
     ["requestHandler.parsers[0]: unknown key(s) 'weight'"]),
])
def test_malformed_section(section: str, fragments: list[str]) -> None:
    config_error(HEAD + PROFILE + section, *fragments)


# --- llm-d-router v0.10.0's shipped configs ------------------------------------------


def test_integration_default_config() -> None:
    built = load_and_build(str(TESTDATA / "default-config.yaml"), strict=True)
    assert isinstance(built.parser_plugin, OpenAIParser)


class MockMetricsSource(MetricsDataSource):
    """Stands in for llm-d's test-only ``mock-metrics-source`` (registered only by its
    integration tests)."""

    type_name = "mock-metrics-source"


@pytest.mark.parametrize("name", ["datalayer-config.yaml",
                                  "request-attribute-reporter-config.yaml"])
def test_integration_configs_with_llmd_test_source(name: str) -> None:
    reg = default_registry()
    reg.register_class(MockMetricsSource)
    built = load_and_build(str(TESTDATA / name), registry=reg)
    assert isinstance(built.parser_plugin, OpenAIParser)
    assert built.data_layer is not None
    assert [type(s.source) for s in built.data_layer.sources] == [MockMetricsSource]
    with pytest.raises(ConfigError, match="unknown plugin type 'mock-metrics-source'"):
        load_and_build(str(TESTDATA / name))  # without it: the error names it


def test_perf_passthrough_config() -> None:
    values = yaml.safe_load(PERF.read_text())
    text = values["router"]["epp"]["pluginsCustomConfig"]["optimized-baseline-plugins.yaml"]
    built = load_and_build(None, text, strict=True)
    assert isinstance(built.parser_plugin, PassthroughParser)


# The routerlib chart's default-plugins.yaml (config/charts/routerlib/templates/
# _config.yaml) rendered with ``router.epp.parsers: [openai-parser, anthropic-parser]``.
CHART_RENDER = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: "http"
    path: "/metrics"
    insecureSkipVerify: true
- type: core-metrics-extractor
- type: openai-parser
- type: anthropic-parser
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
requestHandler:
  parsers:
  - pluginRef: openai-parser
  - pluginRef: anthropic-parser
"""


async def test_chart_render_routes_openai_and_anthropic() -> None:
    timings = PluginTimings()
    built = load_and_build(None, CHART_RENDER, timer=timings, strict=True)
    parts = wire(validate(ServeOptions(static=StaticSourceOptions(
        endpoints="10.0.0.1:8000,10.0.0.2:8000"))), built, timings, None)
    d = parts.director
    h = {":method": "POST", ":path": "/v1/messages", "x-request-id": "r1"}
    routing = await d.route(h, orjson.dumps(
        {"model": "claude", "max_tokens": 16,
         "messages": [{"role": "user", "content": "Hello"}]}), True, None)
    assert routing.destination in ("10.0.0.1:8000", "10.0.0.2:8000")
    d.on_response_headers(routing.context, 200, {"content-type": "text/event-stream"})
    assert isinstance(routing.context.usage, AnthropicUsageParser)
    d.on_response_body(routing.context, b'data: {"type":"message_start","message":'
                       b'{"usage":{"input_tokens":3}}}\n\n', True)
    d.on_done(routing.context, aborted=False)
    h2 = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r2"}
    routing = await d.route(h2, orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}), True, None)
    d.on_response_headers(routing.context, 200, {"content-type": "application/json"})
    d.on_response_body(routing.context, b"{}", True)
    d.on_done(routing.context, aborted=False)
    with pytest.raises(BadRequest, match="no parser registered matching path suffix"):
        await d.route({":method": "POST", ":path": "/v1/models", "x-request-id": "r3"},
                      b"{}", True, None)


def test_workers_front_builds_the_same_router() -> None:
    built = load_and_build(None, CHART_RENDER, strict=True)
    front = _front_parser(built.parser_plugin.type_name if built.parser_plugin else None)
    assert isinstance(front, ParserRouter)
    assert [p.type_name for p in front.parsers] == ["openai-parser", "anthropic-parser"]
    assert isinstance(_front_parser("anthropic-parser"), AnthropicParser)
