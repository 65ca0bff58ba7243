"""The ``flowControl`` section and feature gate in the config loader (GIE v1.5.0:
pkg/epp/config/loader/configloader.go; cmd/epp/runner/runner.go's deprecated
``ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER`` switch)."""

from __future__ import annotations

import pytest

from epp.config.loader import (
    ENV_FLOW_CONTROL,
    FEATURE_FLOW_CONTROL,
    apply_env_feature_gates,
    build,
    load_and_build,
    parse_config,
)
from epp.errors import ConfigError

SECTION = "flowControl: {maxRequests: 10, defaultRequestTTL: 5s}\n"


def test_section_without_the_gate_is_checked_not_built() -> None:
    built = build(parse_config(SECTION, "c.yaml"))
    assert built.config.flow_control is not None
    assert built.config.flow_control.max_requests == 10
    assert built.flow_control is None
    assert any("c.yaml: flowControl: ignored" in w and "featureGates: [flowControl]" in w
               for w in built.warnings)
    # Still decoded strictly: a bad value fails without the gate too (as in GIE).
    with pytest.raises(ConfigError, match=r"c.yaml: flowControl.defaultRequestTTL: expected a "
                       "duration string"):
        parse_config("flowControl: {defaultRequestTTL: 5}\n", "c.yaml")


def test_gate_without_section_gets_gies_defaults() -> None:
    built = build(parse_config("featureGates: [flowControl]\n", "c.yaml"))
    fc = built.flow_control
    assert fc is not None
    assert (fc.max_bytes, fc.max_requests, fc.default_request_ttl) == (0, 0, 0.0)
    assert not fc.priority_bands
    assert fc.default_priority_band.ordering_policy is built.plugins["fcfs-ordering-policy"]
    assert fc.usage_limit_policy is built.plugins["static-usage-limit-policy"]
    assert not built.warnings


def test_gate_and_section() -> None:
    built = build(parse_config("featureGates: [flowControl]\n" + SECTION, "c.yaml"))
    assert built.flow_control is not None
    assert (built.flow_control.max_requests, built.flow_control.default_request_ttl) == (
        10, 5.0)


def test_bad_reference_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        build(parse_config("featureGates: [flowControl]\nplugins: [{type: queue-scorer}]\n"
                           "flowControl: {usageLimitPolicyPluginRef: queue-scorer}\n", "c.yaml"))
    assert str(info.value).startswith("c.yaml: flowControl.usageLimitPolicyPluginRef: "
                                      "'queue-scorer' (queue-scorer) is not a usage limit policy")


@pytest.mark.parametrize("value", ["true", "1", "t", "T", "TRUE", "True"])
def test_deprecated_env_switch_turns_the_gate_on(value: str) -> None:
    cfg = apply_env_feature_gates(parse_config("", "c.yaml"), {ENV_FLOW_CONTROL: value})
    assert cfg.feature_gates == (FEATURE_FLOW_CONTROL,)
    assert len(cfg.warnings) == 1 and "is deprecated" in cfg.warnings[0]
    assert build(cfg).flow_control is not None


@pytest.mark.parametrize("value", ["false", "0", "F"])
def test_deprecated_env_switch_off(value: str) -> None:
    cfg = apply_env_feature_gates(parse_config("", "c.yaml"), {ENV_FLOW_CONTROL: value})
    assert cfg.feature_gates == ()
    assert len(cfg.warnings) == 1 and "is deprecated" in cfg.warnings[0]


def test_deprecated_env_switch_not_a_boolean_reads_false() -> None:
    cfg = apply_env_feature_gates(parse_config("", "c.yaml"), {ENV_FLOW_CONTROL: "yes"})
    assert cfg.feature_gates == ()
    assert any("'yes' is not a boolean" in w for w in cfg.warnings)


def test_env_switch_absent_or_gate_already_on() -> None:
    cfg = parse_config("featureGates: [flowControl]\n", "c.yaml")
    assert apply_env_feature_gates(cfg, {}) is cfg
    on = apply_env_feature_gates(cfg, {ENV_FLOW_CONTROL: "true"})
    assert on.feature_gates == (FEATURE_FLOW_CONTROL,)  # not twice


def test_load_and_build_reads_the_environment_it_is_given() -> None:
    assert load_and_build(environ={ENV_FLOW_CONTROL: "true"}).flow_control is not None
    assert load_and_build(environ={}).flow_control is None
    assert load_and_build().flow_control is None  # no environment: not read
