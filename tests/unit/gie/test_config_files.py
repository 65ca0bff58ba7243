"""Every EndpointPickerConfig found in GIE v1.5.0 (issue 14), loaded here as GIE loads it.

The files are under tests/fixtures/gie-v1.5.0/ (README.md there lists them): GIE's Helm
chart (rendered with Helm's engine), the conformance config, the e2e and integration test
configs, the configs of the site-src guides and plugin READMEs, and the configs of GIE's
own loader tests (pkg/epp/config/loader/testdata_test.go, run against test plugins that
stand in for GIE's mocks). Each config GIE accepts loads — with the default (lenient)
parameters and with ``strict=True`` — and each it rejects is rejected, for the same
reason.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.config.loader import BuiltConfig, build, parse_config
from epp.datalayer.config import DataLayerConfig
from epp.errors import ConfigError
from epp.flowcontrol import FlowControlConfig
from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters
from epp.framework.registry import Registry
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.datalayer import CoreMetricsExtractor, MetricsDataSource
from epp.scheduling.types import ApiType, CycleState, Endpoint, LLMRequest

GIE = Path(__file__).resolve().parents[2] / "fixtures" / "gie-v1.5.0"
ROOT = Path(__file__).resolve().parents[3]


def load(text: str, source: str, registry: Registry | None = None,
         strict: bool = False) -> BuiltConfig:
    return build(parse_config(text, source), registry, strict=strict)


def load_both(text: str, source: str, registry: Registry | None = None) -> BuiltConfig:
    """GIE accepts it: it loads leniently and strictly (no unknown parameter)."""
    built = load(text, source, registry)
    load(text, source, registry, strict=True)
    return built


def rejected(text: str, source: str, *fragments: str, registry: Registry | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load(text, source, registry)
    msg = str(info.value)
    assert msg.startswith(source), msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def md_yaml_blocks(path: str) -> list[str]:
    text = (GIE / path).read_text(encoding="utf-8")
    return re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)


def configmap_configs(path: str) -> dict[str, str]:
    out = {}
    for doc in yaml.safe_load_all((GIE / path).read_text(encoding="utf-8")):
        if doc and doc.get("kind") == "ConfigMap":
            for key, value in (doc.get("data") or {}).items():
                if "EndpointPickerConfig" in value:
                    out[f"{doc['metadata']['name']}/{key}"] = value
    return out


def request(headers: dict[str, str] | None = None) -> LLMRequest:
    return LLMRequest(request_id="r", target_model="m", incoming_model="m",
                      api=ApiType.CHAT_COMPLETIONS, prompt="hi", headers=headers or {})


def scorer_table(built: BuiltConfig, profile: str = "default") -> list[tuple[str, float]]:
    return [(s.type_name, w) for s, w in built.scheduler.profiles[profile].scorers]


# ============================================================ GIE's Helm chart (rendered)

_RENDER = textwrap.dedent("""\
    import json, sys
    import helm_python as helm
    with helm.Chart.load(sys.argv[1]) as chart:
        out = chart.render(json.loads(sys.argv[2]), name="vllm", namespace="ns",
                           is_install=True)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GIE's inferencepool chart with its library chart in charts/ (as `helm dependency
    build` would put it)."""
    root = tmp_path_factory.mktemp("chart") / "inferencepool"
    shutil.copytree(GIE / "config/charts/inferencepool", root)
    shutil.copytree(GIE / "config/charts/epplib", root / "charts" / "epplib")
    return root


def render_config(chart: Path, values: dict[str, Any]) -> str:
    """The chart's EndpointPickerConfig (its ConfigMap's default-plugins.yaml), rendered
    by Helm's engine in a subprocess (keeps its Go runtime out of the test process)."""
    values = {"inferencePool": {"modelServers": {"matchLabels": {"app": "vllm"}}}, **values}
    r = subprocess.run([sys.executable, "-c", _RENDER, str(chart), json.dumps(values)],
                       capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    for text in json.loads(r.stdout).values():
        for doc in yaml.safe_load_all(text):
            if (isinstance(doc, dict) and doc.get("kind") == "ConfigMap"
                    and "default-plugins.yaml" in doc["data"]):
                config: str = doc["data"]["default-plugins.yaml"]
                return config
    raise AssertionError("no EndpointPickerConfig ConfigMap rendered")


def test_chart_default_config(chart: Path) -> None:
    text = render_config(chart, {})
    assert "type: metrics-data-source" in text
    built = load_both(text, "chart")
    assert scorer_table(built) == [("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0),
                                   ("prefix-cache-scorer", 3.0)]
    # No dataLayer section: GIE's default data layer, over the chart's declared plugins.
    dl = built.data_layer
    assert dl is not None and dl.injected
    (entry,) = dl.sources
    assert entry.source is built.plugins["metrics-data-source"]
    assert isinstance(entry.source, MetricsDataSource)
    assert (entry.source.scheme, entry.source.path, entry.source.insecure_skip_verify) == (
        "http", "/metrics", True)
    assert entry.extractors == (built.plugins["core-metrics-extractor"],)
    assert built.parser is None and built.parser_plugin is not None
    assert built.parser_plugin.type_name == "openai-parser"
    assert built.saturation_detector is not None
    assert built.saturation_detector.type_name == "utilization-detector"
    assert built.warnings == []


@pytest.mark.parametrize(("engine", "default_engine"), [
    ("sglang", "sglang"), ("triton-tensorrt-llm", "triton-tensorrt-llm"),
    ("trtllm-serve", "trtllm-serve")])
def test_chart_model_server_type(chart: Path, engine: str, default_engine: str) -> None:
    text = render_config(chart, {"inferencePool": {
        "modelServers": {"matchLabels": {"app": "vllm"}}, "modelServerType": engine}})
    built = load_both(text, f"chart[{engine}]")
    extractor = built.plugins["core-metrics-extractor"]
    assert isinstance(extractor, CoreMetricsExtractor)
    assert extractor.default_engine == default_engine
    unlabelled = Endpoint(name="p", address="10.0.0.1", port=8000)
    assert extractor.engine_mappings().for_endpoint(unlabelled).engine == default_engine


def test_chart_vllm_grpc_uses_the_vllmgrpc_parser(chart: Path) -> None:
    text = render_config(chart, {"inferencePool": {
        "modelServers": {"matchLabels": {"app": "vllm"}}, "modelServerProtocol": "grpc"}})
    assert "parser:" in text
    built = load_both(text, "chart[grpc]")
    assert built.parser is not None and built.parser.plugin_ref == "vllmgrpc-parser"
    assert built.parser_plugin is built.plugins["vllmgrpc-parser"]


def test_chart_latency_predictor_config(chart: Path) -> None:
    text = render_config(chart, {"inferenceExtension": {"latencyPredictor": {"enabled": True}}})
    assert "type: prefix-cache-affinity-filter" in text
    missing = [t for t in ("predicted-latency-producer", "latency-scorer",
                           "slo-headroom-tier-filter", "latency-slo-admitter")
               if t not in default_registry()]
    if missing:
        # The latency-predictor plugins are another issue's; until they land the config
        # fails on the first of them, naming it.
        rejected(text, "chart[latency]", f"unknown plugin type {missing[0]!r}")
        return
    load_both(text, "chart[latency]")  # pragma: no cover - once the predictor lands


def test_chart_values_and_readme_custom_config_examples() -> None:
    """values.yaml's commented example and the chart README's: a `custom-scorer` that no
    EPP has — GIE's binary rejects it too."""
    (block,) = [b for b in md_yaml_blocks("config/charts/inferencepool/README.md")
                if "pluginsCustomConfig" in b]
    text = yaml.safe_load(block)["inferenceExtension"]["pluginsCustomConfig"][
        "custom-plugins.yaml"]
    rejected(text, "README", "plugins[0].type: unknown plugin type 'custom-scorer'")
    commented = (GIE / "config/charts/inferencepool/values.yaml").read_text(encoding="utf-8")
    example = re.search(r"  # pluginsCustomConfig:\n((?:  #.*\n)+)", commented)
    assert example is not None
    values = yaml.safe_load("\n".join(line[4:] for line in example.group(1).splitlines()))
    rejected(values["custom-plugins.yaml"], "values.yaml", "unknown plugin type 'custom-scorer'")


# =================================================== conformance, e2e and integration


def test_conformance_config() -> None:
    (text,) = configmap_configs("conformance/resources/base.yaml").values()
    built = load_both(text, "conformance")
    profile = built.scheduler.profiles["conformance-profile"]
    assert [f.type_name for f in profile.filters] == ["header-based-testing-filter"]
    assert profile.picker.type_name == "max-score-picker"
    verifier = built.plugins["destination-endpoint-served-verifier"]
    assert verifier in built.response_headers
    # The filter keeps the endpoint the conformance client names.
    e1 = Endpoint(name="a", address="10.0.0.1", port=3000)
    e2 = Endpoint(name="b", address="10.0.0.2", port=3000)
    req = request({"test-epp-endpoint-selection": "10.0.0.2"})
    result = built.scheduler.schedule(req, [e1, e2])
    assert result.primary.endpoints == (e2,)


@pytest.mark.parametrize("path", ["test/testdata/inferencepool-e2e.yaml",
                                  "test/testdata/inferencepool-leader-election-e2e.yaml"])
def test_e2e_configs(path: str) -> None:
    (text,) = configmap_configs(path).values()
    built = load_both(text, path)
    assert scorer_table(built) == [("queue-scorer", 1.0), ("kv-cache-utilization-scorer", 1.0),
                                   ("prefix-cache-scorer", 1.0)]


def test_integration_default_config_legacy_metrics() -> None:
    path = "test/integration/epp/testdata/default-config.yaml"
    built = load_both((GIE / path).read_text(encoding="utf-8"), path)
    assert built.data_layer is None  # enableLegacyMetrics: the flags drive the scraper
    assert "enableLegacyMetrics" in built.feature_gates
    assert built.parser_plugin is built.plugins["openai-parser"]


class MockMetricsSource:
    """GIE's integration harness registers `mock-metrics-source` (a test-only source)."""

    type_name = "mock-metrics-source"
    Parameters = NoParameters
    data_output = "prometheus-metrics"

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> MockMetricsSource:
        return cls(name)


def test_integration_datalayer_config() -> None:
    path = "test/integration/epp/testdata/datalayer-config.yaml"
    text = (GIE / path).read_text(encoding="utf-8")
    # GIE's EPP binary does not register the harness's mock source.
    rejected(text, path, "unknown plugin type 'mock-metrics-source'",
             "did you mean 'metrics-data-source'?")
    registry = default_registry()
    registry.register_class(MockMetricsSource)
    built = load_both(text, path, registry)
    assert isinstance(built.data_layer, DataLayerConfig) and not built.data_layer.injected
    (entry,) = built.data_layer.sources
    assert entry.source is built.plugins["mock-metrics-source"] and entry.extractors == ()


def test_integration_request_attribute_reporter_config(caplog: pytest.LogCaptureFixture) -> None:
    path = "test/integration/epp/testdata/request-attribute-reporter-config.yaml"
    with caplog.at_level(logging.WARNING):
        built = load_both((GIE / path).read_text(encoding="utf-8"), path)
    reporter = built.plugins["total-tokens-cost-reporter"]
    assert built.response_usage_metadata == [reporter]
    assert reporter.usage_metadata(  # type: ignore[attr-defined]
        request(), {"prompt_tokens": 3, "completion_tokens": 7}) == {
            "envoy.lb": {"x-gateway-inference-request-cost": 7.0}}
    # GIE ignores plugins of no scheduling role in a profile; so does this, with a warning.
    profile = built.scheduler.profiles["default"]
    assert profile.filters == () and profile.scorers == ()
    assert any("'openai-parser' (openai-parser) is not a filter, scorer or picker" in w
               for w in built.warnings)


@pytest.mark.parametrize("path", [
    "test/integration/epp/inline/grpc_test.testConfigWithVllmGRPCParser.yaml",
    "test/integration/epp/inline/hermetic_test.passthrough-parser-success.yaml"])
def test_integration_inline_configs(path: str) -> None:
    built = load_both((GIE / path).read_text(encoding="utf-8"), path)
    assert built.parser is not None
    assert built.parser_plugin is built.plugins[built.parser.plugin_ref]


def test_stale_loader_test_data_is_rejected() -> None:
    """test/testdata/configloader_1_test.yaml (used by nothing in v1.5.0) still has
    v1.2's inline saturationDetector thresholds: GIE's strict decoding rejects them."""
    path = "test/testdata/configloader_1_test.yaml"
    rejected((GIE / path).read_text(encoding="utf-8"), path,
             "saturationDetector: unknown key(s) 'metricsStalenessThreshold'")


# ============================================================ site-src and READMEs


def test_config_text_guide() -> None:
    path = "site-src/guides/epp-configuration/config-text.md"
    blocks = md_yaml_blocks(path)
    assert len(blocks) == 15
    # The form overview and the data-layer example use `data`, GIE v1.4's spelling that
    # v1.5.0's strict decoding rejects.
    for i in (0, 9):
        rejected(blocks[i], f"{path}#{i}", "data: 'data' is GIE v1.4's name", "'dataLayer'")
    # The complete example, the same given inline with --config-text in a Deployment, and
    # its "after defaults" form.
    inline = re.search(r"- --config-text\n\s*- \|\n((?: {10}.*\n)+)", blocks[3])
    assert inline is not None
    for i, text in ((1, blocks[1]), (3, textwrap.dedent(inline.group(1))), (4, blocks[4])):
        built = load_both(text, f"{path}#{i}")
        assert scorer_table(built) == [("prefix-cache-scorer", 50.0)]
        assert built.scheduler.profiles["default"].picker.type_name == "max-score-picker"
        producer = built.plugins["prefix-cache-scorer-producer"]
        assert producer.block_size_tokens == 5  # type: ignore[attr-defined]
    # The plugin-entry and profile-entry forms are list fragments, not configs.
    for i in (5, 6):
        rejected(blocks[i], f"{path}#{i}", "(top level): expected a mapping, got list")
    # The saturation detector example.
    built = load_both(blocks[7], f"{path}#7")
    assert built.saturation_detector is built.plugins["utilization-detector"]
    assert built.saturation_detector.queue_depth_threshold == 8  # type: ignore[attr-defined]
    # Flow control: the section alone is decoded and ignored (no feature gate, as in GIE);
    # under the gate it is GIE's configuration.
    built = load_both(blocks[8], f"{path}#8")
    assert built.flow_control is None
    assert any("flowControl: ignored" in w for w in built.warnings)
    built = load_both("featureGates: [flowControl]\n" + blocks[8], f"{path}#8")
    fc = built.flow_control
    assert fc is not None
    assert (fc.max_bytes, fc.default_request_ttl) == (10 * 2**30, 60.0)
    assert (fc.default_priority_band.max_bytes, fc.default_priority_band.max_requests) == (
        10 * 2**30, 5000)
    band = fc.priority_bands[100]
    assert (band.max_bytes, band.max_requests) == (5 * 2**30, 500)
    assert band.ordering_policy is built.plugins["fcfs-ordering-policy"]
    assert band.fairness_policy is built.plugins["global-strict-fairness-policy"]
    # Unresolved merge-conflict markers (the parser example of that section is the parser
    # README's, loaded below): not YAML, for GIE either.
    rejected(blocks[10], f"{path}#10", "not valid YAML at line 5, column 9")
    # The engineConfigs example (LoRA disabled for vLLM: the whole entry replaced).
    built = load_both(blocks[11], f"{path}#11")
    extractor = built.plugins["core-metrics-extractor"]
    assert isinstance(extractor, CoreMetricsExtractor)
    assert extractor.table["vllm"].lora_info is None
    assert [str(s) for s in extractor.table["vllm"].kv_usage] == ["vllm:kv_cache_usage_perc"]
    # The parameter references of core-metrics-extractor and metrics-data-source.
    for i, ptype in ((12, "core-metrics-extractor"), (13, "metrics-data-source")):
        params = yaml.safe_load(blocks[i])["parameters"]
        text = yaml.safe_dump({"plugins": [{"type": ptype, "parameters": params}]})
        built = load_both(text, f"{path}#{i}")
        assert built.data_layer is not None
        assert built.plugins[ptype] in (built.data_layer.sources[0].source,
                                        *built.data_layer.sources[0].extractors)
    # The feature gates example: both gates known, dataLayer a deprecated no-op.
    built = load_both(blocks[14], f"{path}#14")
    assert built.feature_gates == {"dataLayer", "flowControl"}
    assert any("'dataLayer' is deprecated" in w for w in built.warnings)


def test_troubleshooting_guide_configs() -> None:
    path = "site-src/guides/troubleshooting.md"
    configs = [yaml.safe_load(b)["inferenceExtension"]["pluginsCustomConfig"][
        "custom-plugins.yaml"] for b in md_yaml_blocks(path) if "pluginsCustomConfig" in b]
    assert len(configs) == 2
    built = load_both(configs[0], f"{path}#0")
    # `blockSize` is GIE's deprecated character size: accepted, ignored, warned about.
    assert any("blockSize (64) is deprecated and ignored" in w for w in built.warnings)
    producer = built.plugins["prefix-cache-scorer-producer"]
    assert producer.max_blocks == 512  # type: ignore[attr-defined]
    # The latency example names a v1.4 feature gate GIE v1.5.0 no longer registers.
    rejected(configs[1], f"{path}#1", "feature gate 'prepareDataPlugins' is removed in "
             "GIE v1.5.0")


def test_model_servers_guide_configs() -> None:
    path = "site-src/implementations/model-servers.md"
    blocks = [b for b in md_yaml_blocks(path) if "EndpointPickerConfig" in b]
    assert len(blocks) == 2
    built = load_both(blocks[0], f"{path}#0")
    assert any("'dataLayer' is deprecated" in w for w in built.warnings)
    extractor = built.plugins["core-metrics-extractor"]
    assert isinstance(extractor, CoreMetricsExtractor) and extractor.default_engine == "sglang"
    built = load_both(blocks[1], f"{path}#1")
    extractor = built.plugins["core-metrics-extractor"]
    assert isinstance(extractor, CoreMetricsExtractor)
    triton = extractor.table["triton"]
    assert [str(s) for s in triton.waiting] == ["nv_trt_llm_request_metrics{request_type=waiting}"]
    assert triton.running == () and triton.lora_info is None


def test_flow_control_guide_configs() -> None:
    path = "site-src/guides/flow-control.md"
    blocks = md_yaml_blocks(path)
    rejected(blocks[0], f"{path}#0", "apiVersion: unsupported 'config.x-k8s.io/v1alpha1'")
    built = load_both(blocks[1], f"{path}#1")
    assert built.saturation_detector is built.plugins["utilization-detector"]
    built = load_both(blocks[2], f"{path}#2")
    detector = built.saturation_detector
    assert detector is built.plugins["concurrency-detector"]
    assert detector.max_concurrency == 110  # type: ignore[union-attr]
    # The flowControl section of the guide, under the gate its first block turns on.
    built = load_both("featureGates: [flowControl]\n" + blocks[3], f"{path}#3")
    fc = built.flow_control
    assert fc is not None
    assert (fc.max_bytes, fc.default_request_ttl) == (1_000_000_000, 30.0)
    band = fc.priority_bands[100]
    assert band.max_bytes == 500_000_000
    assert band.fairness_policy.type_name == "global-strict-fairness-policy"
    assert band.ordering_policy.type_name == "fcfs-ordering-policy"


def test_parsers_readme_config() -> None:
    path = "pkg/epp/framework/plugins/requesthandling/parsers/README.md"
    (block,) = md_yaml_blocks(path)
    built = load_both(block, path)
    assert built.parser_plugin is built.plugins["vllmgrpcParser"]


def test_request_attribute_reporter_readme_config() -> None:
    path = "pkg/epp/framework/plugins/requestcontrol/requestattributereporter/README.md"
    (block,) = md_yaml_blocks(path)
    # The README's apiVersion is not the one GIE's scheme registers.
    rejected(block, path, "apiVersion: unsupported "
             "'config.apix.gateway-api-inference-extension.sigs.k8s.io/v1alpha1'")
    fixed = block.replace("config.apix.gateway-api-inference-extension.sigs.k8s.io",
                          "inference.networking.x-k8s.io")
    built = load_both(fixed, path)
    reporter = built.plugins["total-tokens-cost-reporter"]
    assert reporter.value({"prompt_tokens": 2, "completion_tokens": 5}) == 7  # type: ignore[attr-defined]
    assert reporter.value({"prompt_tokens": 2}) is None  # type: ignore[attr-defined]


def test_notification_sources_readme_configs() -> None:
    path = "pkg/epp/framework/plugins/datalayer/source/notifications/README.md"
    blocks = [b for b in md_yaml_blocks(path) if "pluginRef" in b]
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        rejected(block, f"{path}#{i}", "data: 'data' is GIE v1.4's name")
        # Spelled as v1.5.0 reads it, only the user-provided extractors are missing.
        fixed = block.replace("\ndata:", "\ndataLayer:")
        msg = rejected(fixed, f"{path}#{i}", "unknown plugin type 'my-")
        assert "plugins[1].type" in msg


# ========================================== GIE's loader tests (testdata_test.go consts)


class _Mock:
    type_name = ""
    Parameters = NoParameters

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: Any, handle: PluginHandle) -> Any:
        return cls(name)


class MockPlugin(_Mock):
    type_name = "test-plugin"


class MockScorer(_Mock):
    type_name = "test-scorer"

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        return [0.0] * len(endpoints)


class MockPicker(_Mock):
    type_name = "test-picker"

    def pick(self, state: CycleState, scored: Sequence[Any]) -> Any:
        raise NotImplementedError


class MockHandler(_Mock):
    type_name = "test-profile-handler"

    def pick(self, state: CycleState, request: LLMRequest, profiles: Any, results: Any) -> Any:
        raise NotImplementedError

    def process_results(self, state: CycleState, request: LLMRequest, results: Any) -> Any:
        raise NotImplementedError


class MockSource(_Mock):
    type_name = "test-source"
    data_output = "test-data"


class MockExtractor(_Mock):
    type_name = "test-extractor"
    data_input = "test-data"


def _scorer_with_block_size(name: str, raw: Any, path: str, handle: PluginHandle) -> MockScorer:
    if raw and not isinstance(raw.get("blockSize", 0), int):
        raise ConfigError(f"{path}.blockSize: expected an integer, got {raw['blockSize']!r}")
    return MockScorer(name)


def go_test_registry() -> Registry:
    """GIE's registerTestPlugins: the mocks and the real system defaults."""
    reg = default_registry()
    for cls in (MockPlugin, MockPicker, MockHandler, MockSource, MockExtractor):
        reg.register(cls.type_name, _ignoring_parameters(cls))
    reg.register("test-scorer", _scorer_with_block_size)
    return reg


def _ignoring_parameters(cls: type[_Mock]) -> Any:
    """GIE's mock factories never read their parameters."""
    return lambda name, raw, path, handle: cls(name)


def go_consts() -> dict[str, str]:
    text = (GIE / "pkg/epp/config/loader/testdata_test.go").read_text(encoding="utf-8")
    return dict(re.findall(r"const (\w+) = `\n(.*?)`", text, re.DOTALL))


# What GIE's configloader_test.go expects of each (LoadRawConfig, then
# InstantiateAndConfigure): "ok", or the fragment our error names.
GO_CASES: dict[str, str] = {
    "successConfigText": "ok",
    "successNoProfilesText": "ok",
    "successSchedulerConfigText": "ok",
    "successWithNoWeightText": "ok",
    "successWithNoProfileHandlersText": "ok",
    "successPickerBeforeScorerText": "ok",
    "successParserConfigText": "ok",
    "successWithNoParserConfigText": "ok",
    "successParserWithNameConfigText": "ok",
    "successDataLayerAutoDefaultText": "ok",
    "successDataLayerDisabledText": "ok",
    "successDataLayerExplicitConfigText": "ok",
    "errorBadYamlText": "plugins[0]: expected a mapping, got str",
    "errorBadPluginReferenceText": "plugins[0]: missing 'type'",
    "errorBadPluginReferencePluginText": "plugins[0].type: unknown plugin type "
                                         "'unknown-plugin-type'",
    "errorBadPluginJsonText": "plugins[1].parameters.blockSize: expected an integer",
    "errorUnknownFeatureGateText": "featureGates[0]: unknown feature gate 'unknown-gate'",
    "errorNoProfileNameText": "schedulingProfiles[0]: missing 'name'",
    "errorBadProfilePluginText": "schedulingProfiles[0].plugins[0]: missing 'pluginRef'",
    "errorBadProfilePluginRefText": "no plugin named 'non-existent-plugin'",
    "errorUndefinedSaturationDetectorPluginText": "saturationDetector.pluginRef: no plugin "
                                                  "named 'unknown-plugin'",
    "errorDuplicatePluginText": "plugins[1].name: duplicate plugin name 'test1'",
    "errorDuplicateProfileText": "schedulingProfiles[1].name: duplicate profile name 'default'",
    "errorTwoPickersText": "profile 'default' has two pickers",
    "errorTwoProfileHandlersText": "more than one profile handler declared",
    "errorNoProfileHandlersText": "2 scheduling profiles need a profile handler",
    "errorMultiProfilesUseSingleProfileHandlerText": "(single-profile-handler) runs one profile",
    "errorBadSourceReferenceText": "plugins[0].type: unknown plugin type 'test-one'",
    "errorBadExtractorReferenceText": "dataLayer.sources[0].extractors[0]: expected a mapping",
    "errorParserWrongPluginTypeText": "'maxScore' (max-score-picker) is not a parser plugin",
    "errorParserWrongPluginNameText": "parser.pluginRef: no plugin named 'wrongParser'",
    # GIE's empty-sources case passes its loader but fails its runner at startup.
    "successDataLayerNoSourcesText": "the data layer is on but has no data source",
}
# Flow control: GIE's outcomes, checked in detail below.
GO_FLOW_CONTROL = {
    "successFlowControlConfigText": "ok",
    "successflowControlConfigDisabledText": "ok",
    "successComplexFlowControlConfigText": "ok",
    "errorFlowControlMissingPluginText": "flowControl.priorityBands[0].orderingPolicyRef: no "
                                         "plugin named 'non-existent-policy'",
    "errorFlowControlWrongPluginTypeText": "flowControl.priorityBands[0].orderingPolicyRef: "
                                           "'testScorer' (test-scorer) is not an ordering "
                                           "policy",
}


def test_every_go_loader_case_is_covered() -> None:
    assert set(go_consts()) == set(GO_CASES) | set(GO_FLOW_CONTROL) | {
        "successFilterOrderConfigText"}


@pytest.mark.parametrize("name", sorted(GO_CASES))
def test_go_loader_case(name: str) -> None:
    text = go_consts()[name]
    expected = GO_CASES[name]
    if expected == "ok":
        load_both(text, name, go_test_registry())
    else:
        rejected(text, name, expected, registry=go_test_registry())


@pytest.mark.parametrize("name", sorted(GO_FLOW_CONTROL))
def test_go_loader_flow_control_case(name: str) -> None:
    text = go_consts()[name]
    expected = GO_FLOW_CONTROL[name]
    if expected == "ok":
        load_both(text, name, go_test_registry())
    else:
        rejected(text, name, expected, registry=go_test_registry())


def test_go_flow_control_cases_as_gie_checks_them() -> None:
    """configloader_test.go's checks of its three flow-control successes."""
    reg = go_test_registry()
    consts = go_consts()
    # The gate on: the section's values; the default policies injected under their type
    # names and wired into the default band.
    built = load(consts["successFlowControlConfigText"], "fc", reg)
    fc = built.flow_control
    assert isinstance(fc, FlowControlConfig)
    assert (fc.max_bytes, fc.default_request_ttl) == (1024, 60.0)
    for name in ("global-strict-fairness-policy", "fcfs-ordering-policy",
                 "static-usage-limit-policy"):
        assert built.plugins[name].type_name == name
    assert fc.default_priority_band.ordering_policy is built.plugins["fcfs-ordering-policy"]
    assert fc.default_priority_band.fairness_policy is built.plugins[
        "global-strict-fairness-policy"]
    # The section without the gate: decoded, not built.
    built = load(consts["successflowControlConfigDisabledText"], "off", reg)
    assert built.config.flow_control is not None and built.flow_control is None
    # Declared policies under their own names.
    built = load(consts["successComplexFlowControlConfigText"], "complex", reg)
    assert built.flow_control is not None
    band = built.flow_control.priority_bands[100]
    assert (band.ordering_policy.name, band.ordering_policy.type_name) == (
        "customFCFS", "fcfs-ordering-policy")
    assert (band.fairness_policy.name, band.fairness_policy.type_name) == (
        "customFairness", "global-strict-fairness-policy")


def test_go_filter_order_case_keeps_declaration_order() -> None:
    cfg = parse_config(go_consts()["successFilterOrderConfigText"], "order")
    assert [r.plugin_ref for r in cfg.profiles[0].plugins] == [
        "filter-A", "filter-B", "filter-C", "scorer-X", "scorer-Y", "maxScorePicker"]


def test_go_defaults_injected() -> None:
    """The Go test's checks of injected defaults: weights, picker, handler, data layer,
    parser, saturation detector."""
    reg = go_test_registry()
    consts = go_consts()
    built = load(consts["successWithNoWeightText"], "w", reg)
    assert [w for _, w in built.scheduler.profiles["default"].scorers] == [1.0]
    assert built.scheduler.profiles["default"].picker.type_name == "max-score-picker"
    built = load(consts["successWithNoProfileHandlersText"], "h", reg)
    assert built.scheduler.handler.type_name == "single-profile-handler"
    built = load(consts["successSchedulerConfigText"], "s", reg)
    assert built.scheduler.profiles["default"].picker is built.plugins["maxScorePicker"]
    assert [w for _, w in built.scheduler.profiles["default"].scorers] == [50.0]
    assert built.data_layer is not None and not built.data_layer.injected
    assert built.data_layer.sources[0].source is built.plugins["testSource"]
    assert built.saturation_detector is not None
    built = load(consts["successDataLayerAutoDefaultText"], "d", reg)
    assert built.data_layer is not None and built.data_layer.injected
    assert [type(s.source) for s in built.data_layer.sources] == [MetricsDataSource]
    assert load(consts["successDataLayerDisabledText"], "l", reg).data_layer is None
    built = load(consts["successParserWithNameConfigText"], "p", reg)
    assert built.parser_plugin is built.plugins["openaiParser"]
    built = load(consts["successWithNoParserConfigText"], "np", reg)
    assert built.parser_plugin is not None
    assert (built.parser_plugin.name, built.parser_plugin.type_name) == (
        "openai-parser", "openai-parser")
    built = load(consts["successPickerBeforeScorerText"], "pb", reg)
    assert built.scheduler.profiles["default"].picker is built.plugins["test-picker"]
    assert [w for _, w in built.scheduler.profiles["default"].scorers] == [1.0]
    built = load(consts["successConfigText"], "c", reg)
    assert "flowControl" in built.feature_gates
    assert built.scheduler.handler is built.plugins["profileHandler"]
