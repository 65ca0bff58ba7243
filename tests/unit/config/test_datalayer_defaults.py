"""The default metrics source under llm-d-router's loader rules (epp/config/loader.py
``_data_layer``; llm-d-router v0.10.0 pkg/epp/config/loader/defaults.go
``ensureDataLayer``, apix/config/v1alpha1 ``DataLayerConfig.InjectDefaults``).

llm-d adds ``metrics-data-source`` → ``core-metrics-extractor`` to the data layer unless
``injectDefaults: false`` or a metrics source is already listed: into an empty
``dataLayer: {}`` and beside other sources (additive). GIE v1.5.0 adds it only when the
section is absent and fails on a section without sources. Here llm-d's rules apply to a
document with ``apiVersion: llm-d.ai/v1alpha1`` or an llm-d-only ``dataLayer`` key; GIE's
otherwise.
"""

from __future__ import annotations

import pytest

from epp.config.loader import BuiltConfig, build, parse_config
from epp.datalayer.config import DataLayerConfig
from epp.errors import ConfigError
from epp.scheduling.plugins.datalayer import CoreMetricsExtractor, MetricsDataSource

LLMD = "apiVersion: llm-d.ai/v1alpha1\n"
GIE = "apiVersion: inference.networking.x-k8s.io/v1alpha1\n"
BASE = """kind: EndpointPickerConfig
plugins:
- {name: maxScore, type: max-score-picker}
- {name: dcgm, type: dcgm-data-source}
- {name: gpu, type: dcgm-extractor}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: maxScore}]
"""
DEFAULT_PAIR = ("metrics-data-source", ("core-metrics-extractor",))
DCGM_ONLY = "dataLayer:\n  sources:\n  - pluginRef: dcgm\n    extractors: [{pluginRef: gpu}]\n"


def load(text: str) -> BuiltConfig:
    return build(parse_config(text, "cfg.yaml"))


def layer(built: BuiltConfig) -> DataLayerConfig:
    assert built.data_layer is not None
    return built.data_layer


def types(built: BuiltConfig) -> list[tuple[str, tuple[str, ...]]]:
    return [(s.source.type_name, tuple(e.type_name for e in s.extractors))
            for s in layer(built).sources]


def test_empty_data_layer_gets_the_default_pair() -> None:
    """llm-d's successDataLayerNoSourcesText: 'dataLayer: {}', injectDefaults unset."""
    built = load(LLMD + BASE + "dataLayer: {}\n")
    (entry,) = layer(built).sources
    assert isinstance(entry.source, MetricsDataSource)
    assert [type(e) for e in entry.extractors] == [CoreMetricsExtractor]
    assert layer(built).injected
    # Injected plugins are named by their type, as llm-d's registerDefaultPlugin does.
    assert entry.source.name == "metrics-data-source"
    assert entry.extractors[0].name == "core-metrics-extractor"


def test_empty_data_layer_with_inject_defaults_true_is_the_same() -> None:
    assert types(load(GIE + BASE + "dataLayer: {injectDefaults: true}\n")) == [DEFAULT_PAIR]


@pytest.mark.parametrize("api", [LLMD, GIE])
def test_inject_defaults_false_scrapes_nothing(api: str) -> None:
    """successDataLayerOptOutText (written with GIE's apiVersion in llm-d's tests)."""
    assert layer(load(api + BASE + "dataLayer: {injectDefaults: false}\n")).sources == ()


def test_the_pair_joins_other_sources() -> None:
    """ensureDataLayer is additive (successDataLayerExplicitConfigText): a dcgm-only data
    layer also gets the metrics source, after the listed ones."""
    assert types(load(LLMD + BASE + DCGM_ONLY)) == [
        ("dcgm-data-source", ("dcgm-extractor",)), DEFAULT_PAIR]


def test_a_declared_metrics_pair_is_the_one_added() -> None:
    """registerDefaultPlugin runs only for a name not declared: the declared plugins (with
    their parameters) are reused."""
    text = (LLMD + BASE.replace("plugins:\n", "plugins:\n- {type: metrics-data-source, "
                                "parameters: {path: /m}}\n- {type: core-metrics-extractor}\n",
                                1) + DCGM_ONLY)
    built = load(text)
    assert types(built) == [("dcgm-data-source", ("dcgm-extractor",)), DEFAULT_PAIR]
    assert layer(built).sources[1].source is built.plugins["metrics-data-source"]


def test_a_listed_metrics_source_is_not_doubled() -> None:
    text = (LLMD + BASE.replace("plugins:\n", "plugins:\n- {name: m, type: metrics-data-source}"
                                "\n- {name: x, type: core-metrics-extractor}\n", 1)
            + DCGM_ONLY + "  - pluginRef: m\n    extractors: [{pluginRef: x}]\n")
    built = load(text)
    assert types(built) == [("dcgm-data-source", ("dcgm-extractor",)), DEFAULT_PAIR]
    assert layer(built).sources[1].source.name == "m"


def test_inject_defaults_false_keeps_only_the_listed_sources() -> None:
    text = LLMD + BASE + DCGM_ONLY + "  injectDefaults: false\n"
    assert types(load(text)) == [("dcgm-data-source", ("dcgm-extractor",))]


# ------------------------------------------------------------------ GIE's rules stay


def test_gie_document_without_sources_still_fails() -> None:
    """GIE v1.5.0: its runner fails on a data layer without sources."""
    with pytest.raises(ConfigError, match="dataLayer.sources: the data layer is on but has "
                                          "no data source"):
        load(GIE + BASE + "dataLayer: {}\n")


def test_gie_document_keeps_its_sources_as_listed() -> None:
    assert types(load(GIE + BASE + DCGM_ONLY)) == [("dcgm-data-source", ("dcgm-extractor",))]


@pytest.mark.parametrize("api", [LLMD, GIE])
def test_no_section_gets_the_default_under_both(api: str) -> None:
    assert types(load(api + BASE)) == [DEFAULT_PAIR]


def test_a_plugin_named_metrics_data_source_of_another_type_is_named() -> None:
    text = (LLMD + BASE.replace("plugins:\n", "plugins:\n- {name: metrics-data-source, "
                                "type: queue-scorer}\n", 1) + DCGM_ONLY)
    with pytest.raises(ConfigError, match="'metrics-data-source' \\(queue-scorer\\) is not a "
                                          "data source"):
        load(text)
