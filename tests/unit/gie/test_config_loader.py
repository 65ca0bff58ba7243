"""The EndpointPickerConfig loader against GIE v1.5.0's rules (issue 14): the schema
(dataLayer, parser, feature gates), the defaults GIE injects, the configs GIE rejects at
load, unknown parameters (a warning, or an error in strict mode), error messages
(file, path, "did you mean"), and the ``--strict`` / ``--strict-config`` switches."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest

from epp.cli import build_parser, main, serve_options
from epp.config.loader import BuiltConfig, build, load_and_build, parse_config
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import Params, decode_params, decoding, report_unknown
from epp.scheduling.plugins.pickers import RandomPicker
from epp.scheduling.plugins.scorers import QueueScorer

SRC = "gie.yaml"


def built(text: str, strict: bool = False) -> BuiltConfig:
    return build(parse_config(textwrap.dedent(text), SRC), strict=strict)


def error(text: str, *fragments: str, strict: bool = False) -> str:
    with pytest.raises(ConfigError) as info:
        built(text, strict)
    msg = str(info.value)
    assert msg.startswith(f"{SRC}"), msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


# ================================================================ GIE rejects at load


def test_single_profile_handler_with_two_profiles_is_rejected_at_load() -> None:
    error("""
        plugins:
        - type: single-profile-handler
        - type: queue-scorer
        schedulingProfiles:
        - {name: a, plugins: [{pluginRef: queue-scorer}]}
        - {name: b, plugins: [{pluginRef: queue-scorer}]}
    """, "schedulingProfiles: 'single-profile-handler' (single-profile-handler) runs one "
         "profile; 2 are configured (a, b)")


def test_plugin_types_are_checked_before_references() -> None:
    error("""
        plugins:
        - type: queue-scorer
        - type: queue-scorrer
        schedulingProfiles:
        - {name: p, plugins: [{pluginRef: nope}]}
    """, "plugins[1].type: unknown plugin type 'queue-scorrer' (did you mean 'queue-scorer'?)")


def test_undeclared_reference_suggests_a_name() -> None:
    error("""
        plugins: [{type: queue-scorer}]
        schedulingProfiles:
        - {name: p, plugins: [{pluginRef: queue-scorr}]}
    """, "schedulingProfiles[0].plugins[0].pluginRef: no plugin named 'queue-scorr' in "
         "'plugins' (did you mean 'queue-scorer'?)")


@pytest.mark.parametrize(("text", "fragments"), [
    ("data: {sources: []}\n", ["data: 'data' is GIE v1.4's name", "rename it to 'dataLayer'"]),
    ("featureGates: [prepareDataPlugins]\n",
     ["featureGates[0]: feature gate 'prepareDataPlugins' is removed in GIE v1.5.0"]),
    ("featureGates: [dataLayr]\n",
     ["unknown feature gate 'dataLayr' (did you mean 'dataLayer'?)",
      "known: dataLayer, enableLegacyMetrics, flowControl"]),
    ("plugin: []\n", ["unknown key(s) 'plugin' (did you mean 'plugins'?)"]),
    ("parser: {pluginRef: p, name: x}\n", ["parser: unknown key(s) 'name'"]),
    ("parser: {}\n", ["parser.pluginRef: expected a non-empty string"]),
    ("dataLayer: {sources: [{pluginRef: s, extractor: []}]}\n",
     ["dataLayer.sources[0]: unknown key(s) 'extractor' (did you mean 'extractors'?)"]),
    ("dataLayer: {sources: [{extractors: []}]}\n", ["dataLayer.sources[0]: missing 'pluginRef'"]),
    ("plugins: [{type: queue-scorer}]\nplugins: []\n",
     ["not valid YAML at line 2, column 1", "duplicate key 'plugins' (first at line 1)"]),
    ("plugins: [{type: queue-scorer, name: q, name: r}]\n", ["duplicate key 'name'"]),
    ("plugins:\n  - type: [\n", ["not valid YAML at line"]),
    ("schedulingProfiles: [{name: p, plugins: [{pluginRef: q, weight: '2'}]}]\n",
     ["schedulingProfiles[0].plugins[0].weight: expected a number, got '2'"]),
])
def test_structure_errors(text: str, fragments: list[str]) -> None:
    error(text, *fragments)


def test_yaml_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text("plugins:\n- type: queue-scorer\n  parameters: {a: 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{path}: not valid YAML at line \d+, column \d+"):
        load_and_build(str(path))


def test_data_layer_errors() -> None:
    error("dataLayer: {sources: []}\nplugins: [{type: queue-scorer}]\n",
          "dataLayer.sources: the data layer is on but has no data source",
          "--no-metrics-scraping")
    error("""
        plugins: [{type: queue-scorer}]
        dataLayer: {sources: [{pluginRef: queue-scorer}]}
    """, "dataLayer.sources[0].pluginRef: 'queue-scorer' (queue-scorer) is not a data source")
    error("""
        plugins: [{type: queue-scorer}, {type: metrics-data-source}]
        dataLayer: {sources: [{pluginRef: metrics-data-source, extractors: [{pluginRef: x}]}]}
    """, "dataLayer.sources[0].extractors[0].pluginRef: no plugin named 'x'")
    error("""
        plugins: [{type: queue-scorer}, {type: endpoint-notification-source},
                  {type: core-metrics-extractor}]
        dataLayer:
          sources:
          - pluginRef: endpoint-notification-source
            extractors: [{pluginRef: core-metrics-extractor}]
    """, "extractor 'core-metrics-extractor' (core-metrics-extractor) reads prometheus-metrics, "
         "but source 'endpoint-notification-source' (endpoint-notification-source) produces "
         "endpoint-events")
    error("""
        plugins:
        - type: queue-scorer
        - {type: k8s-notification-source, name: a, parameters: {version: v1, kind: Pod}}
        - {type: k8s-notification-source, name: b, parameters: {version: v1, kind: Pod}}
        dataLayer: {sources: [{pluginRef: a}, {pluginRef: b}]}
    """, "dataLayer.sources[1].pluginRef: duplicate notification source GVK /v1, Kind=Pod")
    error("""
        plugins: [{type: queue-scorer}, {type: metrics-data-source, name: m1},
                  {type: metrics-data-source, name: m2}]
        dataLayer: {sources: [{pluginRef: m1}, {pluginRef: m2}]}
    """, "more than one metrics-data-source is not supported")
    # The default data layer reads the plugins of GIE's default names.
    error("plugins: [{type: queue-scorer, name: metrics-data-source}]\n",
          "'metrics-data-source' (queue-scorer) is not a data source")


def test_parser_errors() -> None:
    error("plugins: [{type: queue-scorer}]\nparser: {pluginRef: queue-scorer}\n",
          "parser.pluginRef: 'queue-scorer' (queue-scorer) is not a parser plugin")
    error("plugins: [{type: queue-scorer}, {type: openai-parser, name: oai}]\n"
          "parser: {pluginRef: oia}\n",
          "parser.pluginRef: no plugin named 'oia' in 'plugins' (did you mean 'oai'?)")


def test_saturation_detector_errors() -> None:
    error("plugins: [{type: queue-scorer}]\nsaturationDetector: {pluginRef: queue-scorer}\n",
          "saturationDetector: 'queue-scorer' is not a saturation detector")
    error("plugins: [{type: queue-scorer}]\nsaturationDetector: {pluginRef: concurency}\n",
          "saturationDetector.pluginRef: no plugin named 'concurency'")


# ================================================================ what GIE accepts


def test_sections_parsed_and_exposed() -> None:
    b = built("""
        apiVersion: inference.networking.x-k8s.io/v1alpha1
        kind: EndpointPickerConfig
        featureGates: [flowControl]
        plugins:
        - type: queue-scorer
        - {type: passthrough-parser, name: raw}
        - {type: metrics-data-source, parameters: {scheme: https, path: metrics}}
        - {type: core-metrics-extractor, name: cme}
        - {type: endpoint-notification-source}
        - {type: concurrency-detector, parameters: {maxConcurrency: 10}}
        saturationDetector: {pluginRef: concurrency-detector}
        parser: {pluginRef: raw}
        dataLayer:
          sources:
          - pluginRef: metrics-data-source
            extractors: [{pluginRef: cme}]
          - pluginRef: endpoint-notification-source
    """)
    assert b.config.parser is not None and b.config.parser.plugin_ref == "raw"
    assert b.parser is b.config.parser and b.parser_plugin is b.plugins["raw"]
    assert b.saturation_detector is b.plugins["concurrency-detector"]
    assert b.data_layer is not None and not b.data_layer.injected
    metrics, events = b.data_layer.sources
    assert metrics.source is b.plugins["metrics-data-source"]
    assert metrics.source.path == "/metrics"  # type: ignore[attr-defined]
    assert metrics.extractors == (b.plugins["cme"],)
    assert events.source is b.plugins["endpoint-notification-source"] and events.extractors == ()
    assert b.feature_gates == {"flowControl"}
    assert b.warnings == []


def test_defaults_injected_as_gie_does() -> None:
    b = built("plugins: [{type: queue-scorer}]\n")
    assert b.scheduler.handler.type_name == "single-profile-handler"
    assert b.scheduler.profiles["default"].picker.type_name == "max-score-picker"
    assert b.saturation_detector is not None
    assert (b.saturation_detector.name, b.saturation_detector.type_name) == (
        "utilization-detector", "utilization-detector")
    assert b.parser is None and b.parser_plugin is not None
    assert b.parser_plugin.type_name == "openai-parser"
    assert b.data_layer is not None and b.data_layer.injected
    (entry,) = b.data_layer.sources
    assert (entry.source.type_name, [e.type_name for e in entry.extractors]) == (
        "metrics-data-source", ["core-metrics-extractor"])
    # Injected plugins are not declared ones.
    assert set(b.plugins) == {"queue-scorer", "single-profile-handler"}


def test_empty_saturation_detector_ref_means_utilization_detector() -> None:
    b = built("plugins: [{type: queue-scorer}]\nsaturationDetector: {}\n")
    assert b.saturation_detector is not None
    assert b.saturation_detector.type_name == "utilization-detector"
    b = built("plugins: [{type: queue-scorer}]\nsaturationDetector: {pluginRef: utilization-detector}\n")
    assert b.saturation_detector is not None  # injected although not declared, as in GIE


def test_legacy_metrics_gate_turns_the_data_layer_off() -> None:
    b = built("""
        featureGates: [enableLegacyMetrics]
        plugins: [{type: queue-scorer}, {type: metrics-data-source}]
        dataLayer: {sources: [{pluginRef: metrics-data-source}]}
    """)
    assert b.data_layer is None
    assert any("dataLayer: ignored under the enableLegacyMetrics feature gate" in w
               for w in b.warnings)


def test_profile_without_picker_reuses_the_declared_picker() -> None:
    b = built("""
        plugins:
        - {type: random-picker, parameters: {maxNumOfEndpoints: 2}}
        - type: queue-scorer
        schedulingProfiles:
        - {name: default, plugins: [{pluginRef: queue-scorer}]}
    """)
    picker = b.scheduler.profiles["default"].picker
    assert isinstance(picker, RandomPicker) and picker is b.plugins["random-picker"]


def test_ignored_in_profiles_with_warnings() -> None:
    b = built("""
        plugins:
        - type: queue-scorer
        - type: max-score-picker
        - type: single-profile-handler
        - type: openai-parser
        schedulingProfiles:
        - name: p
          plugins:
          - {pluginRef: queue-scorer, weight: -2}
          - {pluginRef: max-score-picker, weight: 5}
          - pluginRef: single-profile-handler
          - pluginRef: openai-parser
    """)
    assert [w for _, w in b.scheduler.profiles["p"].scorers] == [-2.0]  # GIE takes any number
    joined = "\n".join(b.warnings)
    assert "schedulingProfiles[0].plugins[1].weight: 'max-score-picker' is not a scorer" in joined
    assert "schedulingProfiles[0].plugins[2]: 'single-profile-handler' is a profile handler" in joined
    assert "'openai-parser' (openai-parser) is not a filter, scorer or picker" in joined
    assert all(w.startswith(f"{SRC}: ") for w in b.warnings)


def test_empty_name_defaults_to_type() -> None:
    b = built("plugins: [{type: queue-scorer, name: ''}]\n")
    assert isinstance(b.plugins["queue-scorer"], QueueScorer)


# ================================================================ unknown parameters


def test_unknown_parameter_is_a_warning_by_default(caplog: pytest.LogCaptureFixture) -> None:
    text = "plugins: [{type: max-score-picker, parameters: {maxNumOfEndpoint: 2, foo: 1}}]\n"
    with caplog.at_level(logging.WARNING, logger="epp.framework.params"):
        b = built(text)
    assert b.warnings == [
        (f"{SRC}: plugins[0].parameters.foo: unknown parameter, ignored; this plugin accepts: "
        "maxNumOfEndpoints"),
        (f"{SRC}: plugins[0].parameters.maxNumOfEndpoint: unknown parameter, ignored (did you "
        "mean 'maxNumOfEndpoints'?); this plugin accepts: maxNumOfEndpoints"),
    ]
    assert [r.getMessage() for r in caplog.records] == b.warnings  # logged once each
    assert b.scheduler.profiles["default"].picker.max_num_of_endpoints == 1  # type: ignore[attr-defined]
    error(text, "plugins[0].parameters.foo, plugins[0].parameters.maxNumOfEndpoint: unknown "
          "parameter (did you mean 'maxNumOfEndpoints'?)", "strict mode", strict=True)


def test_unknown_nested_keys_follow_the_same_switch() -> None:
    text = """
        plugins:
        - type: core-metrics-extractor
          parameters:
            engineConfigs: [{name: e, queuedRequestSpec: q}]
    """
    b = built(text)
    assert any("engineConfigs[0].queuedRequestSpec: unknown parameter, ignored (did you mean "
               "'queuedRequestsSpec'?)" in w for w in b.warnings)
    error(text, "engineConfigs[0].queuedRequestSpec: unknown parameter", strict=True)


def test_gie_parameter_names_accepted() -> None:
    b = built("""
        plugins:
        - type: prefix-cache-scorer
          parameters: {blockSize: 64, maxPrefixTokensToMatch: 320, blockSizeTokens: 16}
    """, strict=True)
    producer = b.plugins["prefix-cache-scorer-producer"]
    assert producer.max_blocks == 20  # type: ignore[attr-defined]  # 320 tokens / 16
    assert any("blockSize (64) is deprecated and ignored" in w for w in b.warnings)


def test_parameters_on_scorer_and_producer_warn() -> None:
    b = built("""
        plugins:
        - {type: approx-prefix-cache-producer, parameters: {blockSizeTokens: 8}}
        - {type: prefix-cache-scorer, parameters: {blockSizeTokens: 32}}
    """)
    assert b.plugins["prefix-cache-scorer"].producer is b.plugins[  # type: ignore[attr-defined]
        "approx-prefix-cache-producer"]
    assert any("parameters on prefix-cache-scorer are ignored" in w for w in b.warnings)


def test_decode_policy_outside_the_loader() -> None:
    # Outside a build: lenient, logged. Inside decoding(strict=True): an error.
    assert decode_params(QueueScorer.Parameters, {"x": 1}, "p") is not None
    with decoding(strict=True), pytest.raises(ConfigError, match=r"p\.x: unknown parameter"):
        decode_params(QueueScorer.Parameters, {"x": 1}, "p")
    with decoding(source="f.yaml") as policy:
        params = Params({"a": 1, "b": 2}, "q")
        params.int("a", 0)
        params.done()
        report_unknown("r", {"z"}, ("y",))
    assert policy.warnings == [
        "f.yaml: q.b: unknown parameter, ignored; this plugin accepts: a",
        "f.yaml: r.z: unknown parameter, ignored; this plugin accepts: y"]
    assert isinstance(QueueScorer.from_params("q", QueueScorer.Parameters(), PluginHandle()),
                      QueueScorer)


# ================================================================ command line


def test_check_config_strict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("plugins: [{type: queue-scorer, parameters: {weight: 3}}]\n",
                    encoding="utf-8")
    assert main(["check-config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"epp: warning: {path}: plugins[0].parameters.weight: unknown parameter, ignored" in err
    assert "saturation detector: utilization-detector" in out
    assert "data source metrics-data-source -> core-metrics-extractor" in out
    assert "parser: openai-parser" in out and out.rstrip().endswith(f"{path}: OK")
    assert main(["check-config", "--strict", str(path)]) == 1
    _, err = capsys.readouterr()
    assert err.startswith(f"epp: error: {path}: plugins[0].parameters.weight: unknown parameter")


def test_serve_strict_config_flag() -> None:
    args = build_parser().parse_args(["serve", "--endpoints", "10.0.0.1:8000"])
    assert serve_options(args).config.strict is False
    args = build_parser().parse_args(["serve", "--endpoints", "10.0.0.1:8000",
                                      "--strict-config"])
    assert serve_options(args).config.strict is True


def test_load_and_build_strict() -> None:
    text = "plugins: [{type: queue-scorer, parameters: {x: 1}}]\n"
    assert load_and_build(text=text).warnings
    with pytest.raises(ConfigError, match=r"^--config-text: plugins\[0\]\.parameters\.x"):
        load_and_build(text=text, strict=True)


def test_check_config_prints_flow_control(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parents[3]
    assert main(["check-config", str(root / "config" / "flow-control.yaml")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("flow control:"))
    assert "100 (round-robin-fairness-policy, slo-deadline-ordering-policy)" in line
    assert "maxRequests 5000" in line and "TTL 30s" in line
    # Without the gate: no flow-control line.
    assert main(["check-config", str(root / "config" / "default.yaml")]) == 0
    assert "flow control:" not in capsys.readouterr().out
