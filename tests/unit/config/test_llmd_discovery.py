"""llm-d-router's ``dataLayer.discovery`` / ``crossReplicaSyncerPluginRef`` /
``crossReplicaSyncInterval`` / ``injectDefaults`` keys (epp/config/loader.py) and the
discovery plugin as the endpoint source (epp/server/options.py), with the configs of
llm-d v0.10.0's tests and docs (copied under tests/fixtures/llm-d-router-v0.10.0)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from epp.config.loader import build, load_and_build, parse_config
from epp.discovery.llmd_file import FileDiscovery, MultiClusterFileDiscovery
from epp.errors import ConfigError
from epp.scheduling.plugins.datalayer import CoreMetricsExtractor, MetricsDataSource
from epp.scheduling.plugins.multicluster import (
    MultiClusterMetricsDataSource,
    MultiClusterMetricsExtractor,
)
from epp.server.options import (
    ConfigDiscovery,
    HaOptions,
    KubernetesSourceOptions,
    ServeOptions,
    StaticSourceOptions,
    validate,
)
from epp.server.wiring import PluginTimings, pool_label, wire

ROOT = Path(__file__).resolve().parents[3]
LLMD = ROOT / "tests/fixtures/llm-d-router-v0.10.0"
RUNNER = LLMD / "cmd/epp/runner"


def go_templates(path: Path) -> list[str]:
    """The ``fmt.Sprintf(`…`, …)`` raw-string templates of a Go test file, in order."""
    return re.findall(r"fmt\.Sprintf\(`(.*?)`,", path.read_text(), re.DOTALL)


def go_string(path: Path, var: str) -> str:
    """``var = "…"`` (a Go interpreted string literal, JSON-compatible escapes)."""
    m = re.search(rf'{var} = (".*?[^\\]")\n', path.read_text())
    assert m is not None, var
    return str(json.loads(m.group(1)))


def multicluster_config(clusters: Path, with_extractor: bool) -> str:
    """multicluster_config_test.go's multiClusterConfig, filled as the test fills it."""
    go = RUNNER / "multicluster_config_test.go"
    (template,) = go_templates(go)
    plugin = go_string(go, "extractorPlugin") if with_extractor else ""
    binding = go_string(go, "extractorBinding") if with_extractor else ""
    return template.replace("%q", json.dumps(str(clusters)), 1).replace(
        "%s", plugin, 1).replace("%s", binding, 1)


@pytest.fixture
def clusters(tmp_path: Path) -> Path:
    p = tmp_path / "clusters.yaml"
    p.write_text("endpoints:\n  - name: a\n    address: gw.cluster-a.example.com\n"
                 "    port: \"443\"\n")
    return p


def test_multicluster_config_loads(clusters: Path) -> None:
    """TestMultiClusterConfigLoad "full config loads": each name resolves to its type."""
    built = load_and_build(text=multicluster_config(clusters, True), strict=True)
    want = {"discovery": "multicluster-file-discovery",
            "metrics-source": "multicluster-metrics-data-source",
            "metrics-extractor": "multicluster-metrics-extractor",
            "session-affinity": "multicluster-session-affinity-filter",
            "kv-cache": "multicluster-kv-cache-utilization-scorer",
            "queue": "multicluster-queue-scorer"}
    for name, type_name in want.items():
        assert built.plugins[name].type_name == type_name
    assert isinstance(built.discovery, MultiClusterFileDiscovery)
    assert built.discovery.name == "discovery"
    assert built.data_layer is not None
    (entry,) = [s for s in built.data_layer.sources
                if isinstance(s.source, MultiClusterMetricsDataSource)]
    assert entry.source.name == "metrics-source"
    assert [type(e) for e in entry.extractors] == [MultiClusterMetricsExtractor]


def test_multicluster_config_without_the_extractor_fails(clusters: Path) -> None:
    """TestMultiClusterConfigLoad "missing metrics extractor fails at load"
    (ErrNoDefaultProducer)."""
    with pytest.raises(ConfigError, match="no default producer found for missing data key "
                       r"llm-d.ai/multicluster-kv-cache-utilization, consumed by kv-cache"):
        load_and_build(text=multicluster_config(clusters, False))


def test_run_with_file_discovery_smoke_config_loads(tmp_path: Path) -> None:
    """TestRunWithFileDiscovery_Smoke's config: file-discovery with injectDefaults false
    and its own metrics source."""
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text('endpoints:\n  - name: stub\n    address: 127.0.0.1\n'
                         '    port: "19999"\n')
    smoke = go_templates(RUNNER / "run_with_file_discovery_test.go")[0]
    built = load_and_build(text=smoke.replace("%q", json.dumps(str(endpoints))), strict=True)
    assert isinstance(built.discovery, FileDiscovery)
    assert (built.discovery.name, built.discovery.watch_file) == ("file-discovery", False)
    assert built.data_layer is not None
    (entry,) = built.data_layer.sources
    assert isinstance(entry.source, MetricsDataSource) and entry.source.name == "metrics-source"


def test_run_with_file_discovery_alpha_configs_name_the_test_only_type(tmp_path: Path) -> None:
    """The alpha-stability tests register a test-only plugin type: without it the error
    names it (the rest of the document is fine)."""
    for template in go_templates(RUNNER / "run_with_file_discovery_test.go")[1:]:
        text = template.replace("%q", json.dumps(str(tmp_path / "e.yaml")), 1).replace(
            "%s", "alpha-test-plugin", 1)
        with pytest.raises(ConfigError, match="unknown plugin type 'alpha-test-plugin'"):
            load_and_build(text=text)


def yaml_blocks(md: Path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", md.read_text(), re.DOTALL)


def test_docs_configs_load() -> None:
    """Every EndpointPickerConfig example of llm-d's docs/discovery.md and the plugin
    READMEs loads (their files need not exist: they are read at startup); the
    multicluster example's caCertPath must exist, as llm-d loads it at build."""
    docs = [LLMD / "docs/discovery.md", LLMD / "pkg/epp/framework/plugins/README.md",
            LLMD / "pkg/epp/framework/plugins/datalayer/discovery/file/README.md"]
    configs = [b for md in docs for b in yaml_blocks(md) if "pluginRef" in b]
    assert len(configs) >= 5
    for text in configs:
        if "type: my-discovery" in text:  # "Writing a custom discovery plugin": not built in
            with pytest.raises(ConfigError, match="unknown plugin type 'my-discovery'"):
                load_and_build(text=text)
            continue
        if "caCertPath" in text:
            with pytest.raises(ConfigError, match="caCertPath: reading CA cert"):
                load_and_build(text=text)
            text = text.replace("      caCertPath: /etc/epp/tls/ca.crt\n", "")
        built = load_and_build(text=text)
        if "discovery:" in text:
            assert built.discovery is not None


def test_docs_endpoint_files_parse() -> None:
    from epp.discovery.llmd_file import parse_endpoints

    files = [b for b in yaml_blocks(LLMD / "docs/discovery.md")
             if b.startswith("endpoints:") and "<IPv4>" not in b]  # not the schema block
    assert len(files) >= 3
    for text in files:
        parsed = parse_endpoints(text, "discovery.md")
        assert parsed.endpoints and not parsed.errors


# --- the dataLayer keys -----------------------------------------------------------------

BASE = """
plugins:
- {name: disc, type: file-discovery, parameters: {path: /x/endpoints.yaml}}
- {type: queue-scorer}
"""


def load(data_layer: str) -> object:
    return build(parse_config(BASE + data_layer, "cfg.yaml"))


@pytest.mark.parametrize(("data_layer", "error"), [
    ("dataLayer: {discovery: {}}", "cfg.yaml: dataLayer.discovery: missing 'pluginRef'"),
    ("dataLayer: {discovery: {pluginRef: disc, x: 1}}",
     "dataLayer.discovery: unknown key"),
    ("dataLayer: {discovery: {pluginRef: nope}}",
     "dataLayer.discovery.pluginRef: no plugin named 'nope'"),
    ("dataLayer: {discovery: {pluginRef: queue-scorer}}",
     r"discovery: plugin 'queue-scorer' \(queue-scorer\) does not implement EndpointDiscovery"),
    ("dataLayer: {discovery: {pluginRef: disc}, crossReplicaSyncerPluginRef: disc}",
     ("dataLayer.crossReplicaSyncerPluginRef: the plugin disc is not a "
      "fwkdl.CrossReplicaSyncer")),
    ("dataLayer: {crossReplicaSyncerPluginRef: redis}",
     "the plugin redis is not a fwkdl.CrossReplicaSyncer \\(no plugin of that name"),
    ("dataLayer: {crossReplicaSyncInterval: 5}", "expected a duration string"),
    ("dataLayer: {crossReplicaSyncInterval: soon}", "expected a duration"),
    ("dataLayer: {injectDefaults: 'no'}", "dataLayer.injectDefaults: expected true or false"),
])
def test_data_layer_key_errors(data_layer: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load(data_layer)


def test_discovery_alone_gets_the_default_data_layer() -> None:
    """llm-d's ensureDataLayer: a dataLayer with only discovery gets metrics-data-source
    feeding core-metrics-extractor (the docs' example config)."""
    built = load("dataLayer: {discovery: {pluginRef: disc}}")
    assert built.discovery is not None and built.discovery.name == "disc"  # type: ignore[attr-defined]
    dl = built.data_layer  # type: ignore[attr-defined]
    (entry,) = dl.sources
    assert isinstance(entry.source, MetricsDataSource)
    assert isinstance(entry.extractors[0], CoreMetricsExtractor)


def test_inject_defaults_false_without_sources_scrapes_nothing() -> None:
    built = load("dataLayer: {discovery: {pluginRef: disc}, injectDefaults: false}")
    assert built.data_layer.sources == ()  # type: ignore[attr-defined]


def test_sync_interval_is_accepted_without_a_syncer() -> None:
    built = load("dataLayer: {discovery: {pluginRef: disc}, crossReplicaSyncInterval: 250ms,"
                 " crossReplicaSyncerPluginRef: ''}")
    assert built.config.data_layer.sync_interval_s == 0.25  # type: ignore[attr-defined]


def test_gie_rule_kept_without_llmd_keys() -> None:
    """GIE v1.5.0: a dataLayer section without sources (and no llm-d key) fails."""
    with pytest.raises(ConfigError, match="has no data source"):
        load("dataLayer: {}")


def test_no_discovery_section_means_none() -> None:
    assert load("").discovery is None  # type: ignore[attr-defined]


# --- the endpoint source ------------------------------------------------------------------


def test_discovery_is_the_endpoint_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NAMESPACE", raising=False)
    plan = validate(ServeOptions(), discovery="disc")
    assert plan.source == ConfigDiscovery("disc", "epp", "default", 0.5)
    assert pool_label(plan) == "epp"
    assert any("pool namespace defaulted to default" in n for n in plan.notes)
    plan = validate(ServeOptions(kubernetes=KubernetesSourceOptions(
        pool_name="slurm-job-42", pool_namespace="slurm")), discovery="disc")
    assert plan.source == ConfigDiscovery("disc", "slurm-job-42", "slurm", 0.5)
    assert pool_label(plan) == "slurm-job-42"
    assert not any("pool namespace" in n for n in plan.notes)


@pytest.mark.parametrize(("options", "flag"), [
    (ServeOptions(static=StaticSourceOptions(endpoints="10.0.0.1:8000")), "--endpoints"),
    (ServeOptions(static=StaticSourceOptions(endpoints_file="e.yaml")), "--endpoints-file"),
    (ServeOptions(kubernetes=KubernetesSourceOptions(endpoint_selector="a=b",
                                                     endpoint_target_ports="8000")),
     "--endpoint-selector"),
    (ServeOptions(kubernetes=KubernetesSourceOptions(kubeconfig="k")), "--kubeconfig"),
])
def test_other_sources_conflict(options: ServeOptions, flag: str) -> None:
    with pytest.raises(ConfigError, match=f"{flag} cannot be used with the config's "
                       "discovery plugin"):
        validate(options, discovery="disc")


def test_leader_election_needs_kubernetes() -> None:
    with pytest.raises(ConfigError, match="--ha-enable-leader-election needs a Kubernetes"):
        validate(ServeOptions(ha=HaOptions(enable_leader_election=True)), discovery="disc")


def test_no_source_names_the_discovery_option() -> None:
    with pytest.raises(ConfigError, match="dataLayer.discovery.pluginRef: file-discovery"):
        validate(ServeOptions())


def test_wire_feeds_the_store_from_the_file(tmp_path: Path) -> None:
    endpoints = tmp_path / "e.yaml"
    endpoints.write_text("endpoints: [{name: a, address: 10.0.0.1, port: '8000'}]\n")
    timings = PluginTimings()
    built = load_and_build(text=f"""
plugins:
- {{name: disc, type: file-discovery, parameters: {{path: {json.dumps(str(endpoints))}}}}}
dataLayer: {{discovery: {{pluginRef: disc}}}}
""", timer=timings)
    parts = wire(validate(ServeOptions(), discovery="disc"), built, timings, None)
    assert parts.endpoints_file is not None and len(parts.store) == 0
    parts.endpoints_file.load_initial()
    assert [e.key for e in parts.store.snapshot()] == ["10.0.0.1:8000"]
