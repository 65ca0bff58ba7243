"""The ``flowControl`` section: GIE v1.5.0's keys, defaults and validation
(apix/config/v1alpha1 FlowControlConfig; pkg/epp/flowcontrol/registry/config_test.go,
controller/config_test.go; the flow-control cases of the loader's testdata_test.go).

The config loader does not hand the section over yet, so these tests split a config: the
loader builds everything else, :func:`parse_flow_control` / :func:`build_flow_control`
the section, against the loader's plugins — what the loader will do once wired.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.config.loader import BuiltConfig, build, parse_config
from epp.errors import ConfigError
from epp.flowcontrol import (
    DEFAULT_BAND_MAX_BYTES,
    FEATURE_GATE,
    FlowControlConfig,
    FlowControlSpec,
    build_flow_control,
    default_config,
    parse_flow_control,
)
from epp.flowcontrol.config import parse_go_duration, parse_quantity
from epp.flowcontrol.interfaces import QUEUE_HEAP, QUEUE_LIST
from epp.flowcontrol.plugins import (
    FLOW_CONTROL_PLUGINS,
    EDFOrderingPolicy,
    FCFSOrderingPolicy,
    GlobalStrictFairnessPolicy,
    RoundRobinFairnessPolicy,
    SLODeadlineOrderingPolicy,
    StaticUsageLimitPolicy,
)
from epp.framework.handle import PluginHandle
from epp.framework.registry import Registry
from epp.scheduling.plugins.catalog import default_registry
from tests.unit.gie.test_config_files import go_consts, go_test_registry

SRC = "t.yaml"
EXAMPLE = Path(__file__).resolve().parents[3] / "config" / "flow-control.yaml"


def with_flow_control(reg: Registry) -> Registry:
    for cls in FLOW_CONTROL_PLUGINS:
        if getattr(cls, "type_name", "") not in reg:
            reg.register_class(cls)
    return reg


def split_load(text: str, source: str = SRC, registry: Registry | None = None,
               ) -> tuple[BuiltConfig, FlowControlSpec, PluginHandle, FlowControlConfig | None]:
    """Load a config as the wired loader will: phase 1 of the section always, phase 2
    under the feature gate, against the plugins the loader built."""
    doc = yaml.safe_load(text)
    spec = parse_flow_control(doc.pop("flowControl", None), source)
    reg = with_flow_control(registry if registry is not None else default_registry())
    built = build(parse_config(yaml.safe_dump(doc, sort_keys=False), source), reg, strict=True)
    handle = PluginHandle(built.plugins)
    config = (build_flow_control(spec, handle, source) if FEATURE_GATE in built.feature_gates
              else None)
    return built, spec, handle, config


def parse_error(raw: Any, *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_flow_control(raw, SRC)
    msg = str(info.value)
    assert msg.startswith(f"{SRC}: flowControl"), msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def build_error(raw: Any, plugins: dict[str, Any] | None, *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        build_flow_control(parse_flow_control(raw, SRC), PluginHandle(plugins), SRC)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


# ================================================================ quantities and durations


@pytest.mark.parametrize(("value", "expected"), [
    (1024, 1024), ("1024", 1024), ("0", 0), ("1Gi", 1073741824), ("500Mi", 524288000),
    ("1k", 1000), ("1M", 1_000_000), ("500M", 500_000_000), ("1G", 10 ** 9), ("1Ki", 1024),
    ("1e3", 1000), ("1E3", 1000), ("1.5k", 1500), ("1.5", 2), ("100m", 1), (" 2k ", 2000),
    (2.5, 3), ("5000", 5000), ("+7", 7), (".5Ki", 512),
])
def test_quantity(value: Any, expected: int) -> None:
    """Kubernetes resource.Quantity, as Value() reads it (rounded up)."""
    assert parse_quantity(value, "p") == expected


@pytest.mark.parametrize(("value", "fragment"), [
    ("-1", "must be non-negative"), (-5, "must be non-negative"), ("1 Gi", "is not a quantity"),
    ("1KB", "is not a quantity"), ("lots", "is not a quantity"), (True, "expected a quantity"),
    ([1], "expected a quantity"), ("1Ei" * 1, None), ("100Ei", "too large"),
])
def test_quantity_errors(value: Any, fragment: str | None) -> None:
    if fragment is None:
        assert parse_quantity(value, "p") == 2 ** 60
        return
    with pytest.raises(ConfigError, match=fragment):
        parse_quantity(value, "p")


@pytest.mark.parametrize(("value", "seconds"), [
    ("30s", 30.0), ("1m", 60.0), ("1m30s", 90.0), ("1.5h", 5400.0), ("300ms", 0.3),
    ("0", 0.0), ("0s", 0.0), ("2h45m10.5s", 9910.5), ("100us", 1e-4), ("100µs", 1e-4),
    ("5ns", 5e-9), ("+1s", 1.0),
])
def test_go_duration(value: str, seconds: float) -> None:
    assert math.isclose(parse_go_duration(value, "p"), seconds)


@pytest.mark.parametrize(("value", "fragment"), [
    (30, "expected a duration string such as '30s'"), ("30", "is not a duration"),
    ("", "is not a duration"), ("1d", "is not a duration"), ("-1s", "cannot be negative"),
    ("1m 30s", "is not a duration"), (None, "expected a duration string"),
])
def test_go_duration_errors(value: Any, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_go_duration(value, "p")


# ================================================================ phase 1


def test_empty_section_and_defaults() -> None:
    """GIE: a nil FlowControlConfig gives the system defaults."""
    spec = parse_flow_control(None, SRC)
    assert spec == FlowControlSpec()
    cfg = build_flow_control(spec, PluginHandle(), SRC)
    assert (cfg.max_bytes, cfg.max_requests, cfg.default_request_ttl) == (0, 0, 0.0)
    assert cfg.priority_bands == {}
    band = cfg.default_priority_band
    assert band.max_bytes == DEFAULT_BAND_MAX_BYTES == 1_000_000_000
    assert band.max_requests == 0 and band.queue == QUEUE_LIST
    assert isinstance(band.ordering_policy, FCFSOrderingPolicy)
    assert isinstance(band.fairness_policy, GlobalStrictFairnessPolicy)
    assert isinstance(cfg.usage_limit_policy, StaticUsageLimitPolicy)
    assert cfg.usage_limit_policy.threshold == 1.0
    assert (cfg.flow_gc_timeout, cfg.priority_band_gc_timeout) == (300.0, 600.0)
    assert parse_flow_control({}, SRC) == FlowControlSpec()


def test_full_section() -> None:
    """registry config_test.go ShouldSucceed_WithFullConfiguration and the MaxRequests
    cases."""
    spec = parse_flow_control({
        "maxBytes": "100", "maxRequests": "5000", "defaultRequestTTL": "1m",
        "priorityBands": [{"priority": 1, "maxBytes": "50", "maxRequests": 7},
                          {"priority": -2}],
        "defaultPriorityBand": {"maxBytes": "10", "maxRequests": "1k"},
        "usageLimitPolicyPluginRef": "static-usage-limit-policy",
    }, SRC)
    assert (spec.max_bytes, spec.max_requests, spec.default_request_ttl) == (100, 5000, 60.0)
    assert [(b.priority, b.max_bytes, b.max_requests, b.path) for b in spec.priority_bands] == [
        (1, 50, 7, "flowControl.priorityBands[0]"), (-2, None, None,
                                                      "flowControl.priorityBands[1]")]
    cfg = build_flow_control(spec, PluginHandle(), SRC)
    assert (cfg.max_bytes, cfg.max_requests, cfg.default_request_ttl) == (100, 5000, 60.0)
    assert cfg.priority_bands[1].max_bytes == 50 and cfg.priority_bands[1].max_requests == 7
    assert cfg.priority_bands[-2].max_bytes == DEFAULT_BAND_MAX_BYTES
    assert cfg.priority_bands[-2].max_requests == 0
    assert (cfg.default_priority_band.max_bytes, cfg.default_priority_band.max_requests) == (
        10, 1000)
    # A priority no band names gets the template.
    assert cfg.band(7).priority == 7 and cfg.band(7).max_bytes == 10
    assert cfg.band(1) is cfg.priority_bands[1]


def test_zero_capacities_mean_the_defaults() -> None:
    """ShouldApplyDefault_WhenBandMaxBytesIsZero / …DefaultPriorityBandMaxBytesIsZero /
    ShouldDefaultToZero_WhenMaxRequestsIsZero."""
    cfg = build_flow_control(parse_flow_control({
        "maxBytes": 0, "maxRequests": "0",
        "priorityBands": [{"priority": 1, "maxBytes": "0", "maxRequests": 0}],
        "defaultPriorityBand": {"maxBytes": 0}}, SRC), PluginHandle(), SRC)
    assert (cfg.max_bytes, cfg.max_requests) == (0, 0)
    assert cfg.priority_bands[1].max_bytes == DEFAULT_BAND_MAX_BYTES
    assert cfg.priority_bands[1].max_requests == 0
    assert cfg.default_priority_band.max_bytes == DEFAULT_BAND_MAX_BYTES


def test_quantity_formats_in_the_section() -> None:
    """ShouldSucceed_WithKubernetesQuantityFormat."""
    spec = parse_flow_control({"maxBytes": "1Gi",
                               "priorityBands": [{"priority": 1, "maxBytes": "500Mi"}]}, SRC)
    assert spec.max_bytes == 1073741824 and spec.priority_bands[0].max_bytes == 524288000


@pytest.mark.parametrize(("raw", "fragments"), [
    ({"maxBytes": "-1"}, ["flowControl.maxBytes: must be non-negative"]),
    ({"maxRequests": -3}, ["flowControl.maxRequests: must be non-negative"]),
    ({"priorityBands": [{"priority": 1, "maxBytes": "-100"}]},
     ["flowControl.priorityBands[0].maxBytes: must be non-negative"]),
    ({"priorityBands": [{"priority": 1, "maxRequests": "-1"}]},
     ["flowControl.priorityBands[0].maxRequests: must be non-negative"]),
    ({"defaultPriorityBand": {"maxBytes": "-5"}},
     ["flowControl.defaultPriorityBand.maxBytes: must be non-negative"]),
    ({"defaultPriorityBand": {"maxRequests": -5}},
     ["flowControl.defaultPriorityBand.maxRequests: must be non-negative"]),
    ({"maxBytes": "1GB"}, ["flowControl.maxBytes: '1GB' is not a quantity", "Gi"]),
    ({"defaultRequestTTL": "-1s"}, ["flowControl.defaultRequestTTL: cannot be negative"]),
    ({"defaultRequestTTL": 30}, ["flowControl.defaultRequestTTL: expected a duration string",
                                "quote it and add a unit"]),
    ({"defaultRequestTTL": "30"}, ["flowControl.defaultRequestTTL: '30' is not a duration"]),
    ({"maxByte": 1}, ["flowControl: unknown key(s) 'maxByte' (did you mean 'maxBytes'?)",
                      "allowed: defaultNegativePriorityBand, defaultPriorityBand, defaultRequestTTL"]),
    ({"priorityBands": [{"priority": 1, "fairnessPolicy": "x"}]},
     [("flowControl.priorityBands[0]: unknown key(s) 'fairnessPolicy' (did you mean "
      "'fairnessPolicyRef'?)")]),
    ({"priorityBands": {"priority": 1}}, ["flowControl.priorityBands: expected a list"]),
    ({"priorityBands": [5]}, ["flowControl.priorityBands[0]: expected a mapping"]),
    ({"priorityBands": [{"priority": "high"}]},
     ["flowControl.priorityBands[0].priority: expected an integer"]),
    ({"priorityBands": [{"priority": 1.5}]},
     ["flowControl.priorityBands[0].priority: expected an integer"]),
    ({"priorityBands": [{"priority": 100}, {"priority": 5}, {"priority": 100}]},
     [("flowControl.priorityBands[2].priority: duplicate priority level 100 (also at "
      "flowControl.priorityBands[0]); give each band its own priority")]),
    ({"priorityBands": [{"priority": 1, "orderingPolicyRef": 3}]},
     ["flowControl.priorityBands[0].orderingPolicyRef: expected a plugin name"]),
    ({"usageLimitPolicyPluginRef": ["a"]},
     ["flowControl.usageLimitPolicyPluginRef: expected a plugin name"]),
    ([1, 2], ["flowControl: expected a mapping, got list"]),
])
def test_parse_errors(raw: Any, fragments: list[str]) -> None:
    parse_error(raw, *fragments)


def test_priority_defaults_to_zero_and_the_template_priority_is_ignored() -> None:
    """GIE decodes ``priority`` as a plain int: omitted is 0; the default band's is a
    placeholder."""
    spec = parse_flow_control({"priorityBands": [{"maxRequests": 3}],
                               "defaultPriorityBand": {"priority": 9}}, SRC)
    assert spec.priority_bands[0].priority == 0
    assert any("defaultPriorityBand.priority: ignored" in w for w in spec.warnings)


# ================================================================ phase 2


def test_policy_references() -> None:
    """ShouldSucceed_WithPolicyReferences; the queue follows the ordering policy."""
    plugins: dict[str, Any] = {"edf-ordering-policy": EDFOrderingPolicy(),
                               "round-robin-fairness-policy": RoundRobinFairnessPolicy(),
                               "slo": SLODeadlineOrderingPolicy("slo"),
                               "lenient": StaticUsageLimitPolicy("lenient", 0.8)}
    handle = PluginHandle(plugins)
    cfg = build_flow_control(parse_flow_control({
        "usageLimitPolicyPluginRef": "lenient",
        "defaultPriorityBand": {"orderingPolicyRef": "slo"},
        "priorityBands": [{"priority": 1, "orderingPolicyRef": "edf-ordering-policy",
                           "fairnessPolicyRef": "round-robin-fairness-policy"},
                          {"priority": 2}]}, SRC), handle, SRC)
    band = cfg.priority_bands[1]
    assert band.ordering_policy is plugins["edf-ordering-policy"]
    assert band.fairness_policy is plugins["round-robin-fairness-policy"]
    assert band.queue == QUEUE_HEAP
    assert cfg.priority_bands[2].queue == QUEUE_LIST
    assert cfg.default_priority_band.ordering_policy is plugins["slo"]
    assert cfg.default_priority_band.queue == QUEUE_HEAP
    assert cfg.usage_limit_policy is plugins["lenient"]
    # The defaults the config did not declare were built once and added to the handle.
    fcfs = handle.get("fcfs-ordering-policy")
    strict = handle.get("global-strict-fairness-policy")
    assert isinstance(fcfs, FCFSOrderingPolicy) and isinstance(strict, GlobalStrictFairnessPolicy)
    assert cfg.priority_bands[2].ordering_policy is fcfs
    assert cfg.priority_bands[2].fairness_policy is strict
    assert cfg.default_priority_band.fairness_policy is strict
    assert handle.get("static-usage-limit-policy") is None  # not referenced: not injected


def test_declared_default_policies_are_used_not_replaced() -> None:
    declared = FCFSOrderingPolicy()
    handle = PluginHandle({"fcfs-ordering-policy": declared})
    cfg = build_flow_control(None, handle, SRC)
    assert cfg.default_priority_band.ordering_policy is declared


@pytest.mark.parametrize(("raw", "plugins", "fragments"), [
    ({"priorityBands": [{"priority": 100, "orderingPolicyRef": "non-existent-policy"}]}, {},
     [("t.yaml: flowControl.priorityBands[0].orderingPolicyRef: no plugin named "
      "'non-existent-policy' in 'plugins' (an ordering policy: declare one of type "
      "fcfs-ordering-policy, edf-ordering-policy or slo-deadline-ordering-policy)")]),
    ({"priorityBands": [{"priority": 100, "orderingPolicyRef": "rr"}]},
     {"rr": RoundRobinFairnessPolicy("rr")},
     [("flowControl.priorityBands[0].orderingPolicyRef: 'rr' (round-robin-fairness-policy) is "
      "not an ordering policy")]),
    ({"defaultPriorityBand": {"fairnessPolicyRef": "fcfs"}}, {"fcfs": FCFSOrderingPolicy("fcfs")},
     [("flowControl.defaultPriorityBand.fairnessPolicyRef: 'fcfs' (fcfs-ordering-policy) is "
      "not a fairness policy; use a plugin of type global-strict-fairness-policy or "
      "round-robin-fairness-policy")]),
    ({"usageLimitPolicyPluginRef": "static-usage-limit"}, {},
     ["flowControl.usageLimitPolicyPluginRef: no plugin named 'static-usage-limit'",
      "did you mean"]),
    # A default name taken by a plugin of another kind (GIE: "is not a OrderingPolicy").
    ({}, {"fcfs-ordering-policy": GlobalStrictFairnessPolicy("fcfs-ordering-policy")},
     [("flowControl.defaultPriorityBand: 'fcfs-ordering-policy' "
      "(global-strict-fairness-policy) is not an ordering policy")]),
    # An undeclared policy that is not a default is not injected (GIE neither).
    ({"priorityBands": [{"priority": 1, "orderingPolicyRef": "edf-ordering-policy"}]}, {},
     ["no plugin named 'edf-ordering-policy'"]),
])
def test_build_errors(raw: Any, plugins: dict[str, Any], fragments: list[str]) -> None:
    build_error(raw, plugins, *fragments)


def test_config_invariants() -> None:
    cfg = default_config()
    with pytest.raises(ValueError, match="priority_band_gc_timeout"):
        FlowControlConfig(cfg.default_priority_band, cfg.usage_limit_policy,
                          flow_gc_timeout=10, priority_band_gc_timeout=5)
    with pytest.raises(ValueError, match="default_request_ttl cannot be negative"):
        FlowControlConfig(cfg.default_priority_band, cfg.usage_limit_policy,
                          default_request_ttl=-1)
    with pytest.raises(ValueError, match="holds the band of priority 0"):
        FlowControlConfig(cfg.default_priority_band, cfg.usage_limit_policy,
                          priority_bands={3: cfg.default_priority_band})


# ================================================================ GIE's loader cases


def test_go_flow_control_config() -> None:
    """successFlowControlConfigText: maxBytes "1024", defaultRequestTTL 1m; the default
    ordering and fairness policies are injected under their type names."""
    _, _, handle, cfg = split_load(go_consts()["successFlowControlConfigText"], "success",
                                   go_test_registry())
    assert cfg is not None
    assert cfg.max_bytes == 1024 and cfg.default_request_ttl == 60.0
    assert isinstance(handle.get("global-strict-fairness-policy"), GlobalStrictFairnessPolicy)
    assert isinstance(handle.get("fcfs-ordering-policy"), FCFSOrderingPolicy)
    assert cfg.default_priority_band.ordering_policy.name == "fcfs-ordering-policy"
    assert cfg.default_priority_band.fairness_policy.name == "global-strict-fairness-policy"


def test_go_flow_control_disabled() -> None:
    """successflowControlConfigDisabledText: decoded, but ignored without the gate."""
    _, spec, _, cfg = split_load(go_consts()["successflowControlConfigDisabledText"],
                                 "disabled", go_test_registry())
    assert spec.max_bytes == 1024
    assert cfg is None


def test_go_complex_flow_control_config() -> None:
    """successComplexFlowControlConfigText: band 100 uses the declared, renamed policies."""
    cfg = split_load(go_consts()["successComplexFlowControlConfigText"], "complex",
                     go_test_registry())[3]
    assert cfg is not None
    band = cfg.priority_bands[100]
    assert (band.ordering_policy.name, band.ordering_policy.type_name) == (
        "customFCFS", "fcfs-ordering-policy")
    assert (band.fairness_policy.name, band.fairness_policy.type_name) == (
        "customFairness", "global-strict-fairness-policy")


@pytest.mark.parametrize(("name", "fragment"), [
    ("errorFlowControlMissingPluginText",
     "flowControl.priorityBands[0].orderingPolicyRef: no plugin named 'non-existent-policy'"),
    ("errorFlowControlWrongPluginTypeText",
     ("flowControl.priorityBands[0].orderingPolicyRef: 'testScorer' (test-scorer) is not an "
     "ordering policy")),
])
def test_go_flow_control_errors(name: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        split_load(go_consts()[name], name, go_test_registry())
    assert str(info.value).startswith(f"{name}: ") and fragment in str(info.value)


def test_example_config_loads() -> None:
    """The shipped example config (config/flow-control.yaml) loads strictly, every
    reference resolved."""
    built, spec, _handle, cfg = split_load(EXAMPLE.read_text(encoding="utf-8"), str(EXAMPLE))
    assert cfg is not None and not built.warnings and not spec.warnings
    assert (cfg.max_bytes, cfg.max_requests, cfg.default_request_ttl) == (2 ** 30, 5000, 30.0)
    assert sorted(cfg.priority_bands) == [-1, 0, 100]
    assert isinstance(cfg.priority_bands[100].ordering_policy, SLODeadlineOrderingPolicy)
    assert cfg.priority_bands[100].queue == QUEUE_HEAP
    assert isinstance(cfg.priority_bands[0].fairness_policy, RoundRobinFairnessPolicy)
    assert (cfg.priority_bands[-1].max_requests, cfg.priority_bands[-1].max_bytes) == (
        200, 64 * 2 ** 20)
    assert isinstance(cfg.priority_bands[-1].fairness_policy, GlobalStrictFairnessPolicy)
    assert cfg.default_priority_band.max_requests == 1000
    assert cfg.usage_limit_policy is built.plugins["static-usage-limit-policy"]
    assert built.saturation_detector is built.plugins["utilization-detector"]
