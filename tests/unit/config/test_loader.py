"""EndpointPickerConfig loading, defaults, registry and strict parameters (design.md §5)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from epp import keys
from epp.config.loader import (
    DEFAULT_CONFIG_TEXT,
    BuiltConfig,
    build,
    load_and_build,
    load_config_file,
    parse_config,
)
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import Params, decoding, parse_duration
from epp.framework.registry import Registry
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.handlers import SingleProfileHandler
from epp.scheduling.plugins.pickers import MaxScorePicker, RandomPicker
from epp.scheduling.plugins.scorers import KVCacheUtilizationScorer, QueueScorer
from epp.scheduling.types import ApiType, Endpoint, LLMRequest, Metrics
from tests.unit.config import plugin_fixture

REPO = Path(__file__).resolve().parents[3]
SRC = "under-test.yaml"
FIXTURE = "tests.unit.config.plugin_fixture"
BUILTIN_TYPES = [
    "active-request-scorer",
    "agent-identity",
    "always-disagg-multimodal-decider",
    "always-disagg-pd-decider",
    "anthropic-parser",
    "approx-prefix-cache-producer",
    "burst-prefix-cache-producer",
    "by-label",
    "by-label-selector",
    "concurrency-detector",
    "context-length-aware",
    "core-metrics-extractor",
    "data-parallel-profile-handler",
    "dcgm-data-source",
    "dcgm-extractor",
    "decode-filter",
    "destination-endpoint-served-verifier",
    "disagg-headers-handler",
    "disagg-profile-handler",
    "disaggregatedset-rollout-screener",
    "edf-ordering-policy",
    "encode-filter",
    "endpoint-attribute-filter",
    "endpoint-attribute-scorer",
    "endpoint-notification-source",
    "fcfs-ordering-policy",
    "file-discovery",
    "global-strict-fairness-policy",
    "header-based-testing-filter",
    "header-label-affinity-scorer",
    "header-profile-handler",
    "inflight-load-producer",
    "k8s-notification-source",
    "kv-cache-utilization-scorer",
    "label-selector-filter",
    "latency-scorer",
    "latency-slo-admitter",
    "leader-filter",
    "load-aware-scorer",
    "lora-affinity-scorer",
    "max-score-picker",
    "metrics-data-source",
    "mm-embeddings-cache-producer",
    "mm-embeddings-cache-scorer",
    "models-data-extractor",
    "models-data-source",
    "multicluster-approx-prefix-cache-producer",
    "multicluster-file-discovery",
    "multicluster-kv-cache-utilization-scorer",
    "multicluster-metrics-data-source",
    "multicluster-metrics-extractor",
    "multicluster-prefix-cache-scorer",
    "multicluster-queue-scorer",
    "multicluster-session-affinity-filter",
    "no-hit-lru-scorer",
    "openai-parser",
    "p2p-source-producer",
    "passthrough-parser",
    "pd-profile-handler",
    "pending-prefill-scorer",
    "precise-prefix-cache-producer",
    "precise-prefix-cache-scorer",
    "predicted-latency-producer",
    "predicted-latency-scorer",
    "predicted-ttft-scorer",
    "prefill-filter",
    "prefill-header-handler",
    "prefix-based-pd-decider",
    "prefix-cache-affinity-filter",
    "prefix-cache-scorer",
    "priority-holdback-policy",
    "priority-then-time-eviction-order-policy",
    "probabilistic-admitter",
    "program-aware-fairness",
    "queue-scorer",
    "random-picker",
    "request-attribute-reporter",
    "round-robin-fairness-policy",
    "running-requests-size-scorer",
    "served-models-filter",
    "session-affinity-filter",
    "session-affinity-scorer",
    "session-id-producer",
    "sheddable-eviction-filter",
    "single-profile-handler",
    "slo-deadline-ordering-policy",
    "slo-headroom-tier-filter",
    "soft-reflective-ceiling-policy",
    "static-usage-limit-policy",
    "token-load-scorer",
    "token-producer",
    "tokenizer",
    "topology-affinity-filter",
    "topology-affinity-scorer",
    "topology-extractor",
    "utilization-detector",
    "utilization-filter",
    "vertexai-parser",
    "vllmgrpc-parser",
    "vllmhttp-parser",
    "weighted-random-picker",
]


def build_text(text: str, strict: bool = False) -> BuiltConfig:
    return build(parse_config(textwrap.dedent(text), SRC), strict=strict)


def config_error(text: str, *fragments: str, strict: bool = False) -> str:
    """Parse + build ``text`` expecting a ConfigError naming SRC and every fragment."""
    with pytest.raises(ConfigError) as info:
        build_text(text, strict=strict)
    msg = str(info.value)
    assert msg.startswith(f"{SRC}: "), msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


def ep(i: int, **metrics: object) -> Endpoint:
    return Endpoint(name=f"pod-{i}", address=f"10.0.0.{i}", port=8000, metrics=Metrics(**metrics))


def req() -> LLMRequest:
    return LLMRequest(request_id="r", target_model="m", incoming_model="m",
                      api=ApiType.CHAT_COMPLETIONS, prompt="hi", headers={})


def scorer_table(built: BuiltConfig, profile: str = "default") -> list[tuple[str, str, float]]:
    return [(s.name, s.type_name, w) for s, w in built.scheduler.profiles[profile].scorers]


# ================================================================ building valid configs


def test_default_config_builds() -> None:
    built = load_and_build()
    assert built.config.source == "<default config>"
    sched = built.scheduler
    assert isinstance(sched.handler, SingleProfileHandler)
    assert list(sched.profiles) == ["default"]
    profile = sched.profiles["default"]
    assert profile.filters == ()
    # The winner of `epp bench` (docs/benchmarks.md, "Choosing the default").
    assert scorer_table(built) == [
        ("prefix-cache-scorer", "prefix-cache-scorer", 3.0),
        ("active-request-scorer", "active-request-scorer", 1.0),
        ("no-hit-lru-scorer", "no-hit-lru-scorer", 1.0),
        ("queue-scorer", "queue-scorer", 1.0),
        ("kv-cache-utilization-scorer", "kv-cache-utilization-scorer", 1.0),
    ]
    assert isinstance(profile.picker, MaxScorePicker)
    assert profile.picker.name == "max-score-picker"
    assert profile.picker.max_num_of_endpoints == 1
    assert set(built.plugins) == {"queue-scorer", "kv-cache-utilization-scorer",
                                  "prefix-cache-scorer", "approx-prefix-cache-producer",
                                  "active-request-scorer", "no-hit-lru-scorer",
                                  "max-score-picker", "single-profile-handler"}
    producer = built.plugins["approx-prefix-cache-producer"]
    assert producer.balance_abs_threshold == 4  # type: ignore[attr-defined]


def test_default_config_schedules_with_weights() -> None:
    # A prompt shorter than a block: prefix 0 everywhere; nothing in flight: active 1 for
    # both; a cold request: no-hit-lru ranks the candidates in order (1, 0).
    # e1: 3*0 + 1*1 + 1*1 + 1*(10-0)/10 + 1*(1-0.9) = 3.1 ; e2: 0 + 1 + 0 + 0 + 1 = 2.0
    e1 = ep(1, waiting_queue_size=0, kv_cache_usage=0.9)
    e2 = ep(2, waiting_queue_size=10, kv_cache_usage=0.0)
    result = load_and_build().scheduler.schedule(req(), [e1, e2])
    assert result.primary_profile == "default"
    assert result.primary.endpoints == (e1,)
    assert result.primary.scores == {e1.key: pytest.approx(3.1)}


def test_default_yaml_file_matches_builtin_default() -> None:
    on_disk = (REPO / "config" / "default.yaml").read_text(encoding="utf-8")
    assert yaml.safe_load(on_disk) == yaml.safe_load(DEFAULT_CONFIG_TEXT)
    built = load_and_build(path=str(REPO / "config" / "default.yaml"))
    assert scorer_table(built) == scorer_table(load_and_build())


def test_gie_default_example_keeps_gies_weights() -> None:
    built = load_and_build(path=str(REPO / "config" / "gie-default.yaml"))
    assert [(t, w) for _, t, w in scorer_table(built)] == [
        ("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0),
        ("prefix-cache-scorer", 3.0)]


def test_queue_only_example_builds() -> None:
    path = REPO / "config" / "queue-only.yaml"
    built = load_and_build(path=str(path))
    assert built.config.source == str(path)
    assert scorer_table(built) == [("queue-scorer", "queue-scorer", 1.0)]
    picker = built.scheduler.profiles["default"].picker
    assert isinstance(picker, MaxScorePicker)
    assert picker.name == "picker" and picker.max_num_of_endpoints == 1
    e1, e2, e3 = ep(1, waiting_queue_size=3), ep(2, waiting_queue_size=1), ep(3, waiting_queue_size=9)
    result = built.scheduler.schedule(req(), [e1, e2, e3])
    assert result.primary.endpoints == (e2,)  # shortest queue


@pytest.mark.parametrize("api_version", list(keys.CONFIG_API_VERSIONS))
def test_gie_format_with_api_version_and_kind_loads(api_version: str) -> None:
    built = build_text(f"""
        apiVersion: {api_version}
        kind: EndpointPickerConfig
        featureGates: [flowControl]
        plugins:
        - type: queue-scorer
        - type: max-score-picker
          parameters: {{maxNumOfEndpoints: 2}}
        schedulingProfiles:
        - name: default
          plugins:
          - {{pluginRef: queue-scorer, weight: 3}}
          - {{pluginRef: max-score-picker}}
    """)
    assert built.config.feature_gates == ("flowControl",)
    assert scorer_table(built) == [("queue-scorer", "queue-scorer", 3.0)]
    assert built.scheduler.profiles["default"].picker.max_num_of_endpoints == 2  # type: ignore[attr-defined]


def test_llm_d_api_version_accepted() -> None:
    assert "llm-d.ai/v1alpha1" in keys.CONFIG_API_VERSIONS
    cfg = parse_config("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n", SRC)
    assert cfg.plugins == () and cfg.profiles == ()


def test_parse_config_records_paths_and_params() -> None:
    cfg = parse_config(textwrap.dedent("""
        plugins:
        - type: queue-scorer
        - name: mine
          type: max-score-picker
          parameters: {maxNumOfEndpoints: 3}
        schedulingProfiles:
        - name: p
          plugins:
          - {pluginRef: queue-scorer, weight: 2}
          - {pluginRef: mine}
    """), SRC)
    assert cfg.source == SRC
    assert [(p.name, p.type, dict(p.parameters), p.path) for p in cfg.plugins] == [
        ("queue-scorer", "queue-scorer", {}, "plugins[0]"),
        ("mine", "max-score-picker", {"maxNumOfEndpoints": 3}, "plugins[1]"),
    ]
    (profile,) = cfg.profiles
    assert profile.name == "p" and profile.path == "schedulingProfiles[0]"
    assert [(r.plugin_ref, r.weight, r.path) for r in profile.plugins] == [
        ("queue-scorer", 2.0, "schedulingProfiles[0].plugins[0]"),
        ("mine", None, "schedulingProfiles[0].plugins[1]"),
    ]


def test_name_defaults_to_type() -> None:
    built = build_text("""
        plugins:
        - type: queue-scorer
        - type: kv-cache-utilization-scorer
          name: kv
    """)
    assert isinstance(built.plugins["queue-scorer"], QueueScorer)
    assert built.plugins["queue-scorer"].name == "queue-scorer"
    assert isinstance(built.plugins["kv"], KVCacheUtilizationScorer)
    assert built.plugins["kv"].name == "kv"
    assert "kv-cache-utilization-scorer" not in built.plugins


def test_same_type_twice_with_distinct_names() -> None:
    built = build_text("""
        plugins:
        - {type: queue-scorer, name: q1}
        - {type: queue-scorer, name: q2}
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: q1, weight: 1}, {pluginRef: q2, weight: 0.5}]
    """)
    assert scorer_table(built) == [("q1", "queue-scorer", 1.0), ("q2", "queue-scorer", 0.5)]
    assert built.plugins["q1"] is not built.plugins["q2"]


def test_unweighted_scorer_has_weight_one_and_zero_is_allowed() -> None:
    built = build_text("""
        plugins:
        - type: queue-scorer
        - type: kv-cache-utilization-scorer
        schedulingProfiles:
        - name: default
          plugins:
          - pluginRef: queue-scorer
          - {pluginRef: kv-cache-utilization-scorer, weight: 0}
    """)
    assert scorer_table(built) == [
        ("queue-scorer", "queue-scorer", 1.0),
        ("kv-cache-utilization-scorer", "kv-cache-utilization-scorer", 0.0),
    ]
    weights = [w for _, w in built.scheduler.profiles["default"].scorers]
    assert all(type(w) is float for w in weights)


def test_missing_picker_is_injected() -> None:
    built = build_text("""
        plugins:
        - type: queue-scorer
        schedulingProfiles:
        - name: only-scores
          plugins: [{pluginRef: queue-scorer}]
    """)
    picker = built.scheduler.profiles["only-scores"].picker
    assert isinstance(picker, MaxScorePicker)
    assert picker.type_name == "max-score-picker"
    assert picker.max_num_of_endpoints == 1
    assert isinstance(built.scheduler.handler, SingleProfileHandler)


def test_no_profiles_gives_default_profile_with_all_declared_plugins() -> None:
    built = build_text("""
        plugins:
        - type: queue-scorer
        - type: kv-cache-utilization-scorer
        - type: random-picker
          parameters: {maxNumOfEndpoints: 2}
    """)
    assert list(built.scheduler.profiles) == ["default"]
    assert scorer_table(built) == [
        ("queue-scorer", "queue-scorer", 1.0),
        ("kv-cache-utilization-scorer", "kv-cache-utilization-scorer", 1.0),
    ]
    picker = built.scheduler.profiles["default"].picker
    assert picker is built.plugins["random-picker"]
    assert isinstance(picker, RandomPicker) and picker.max_num_of_endpoints == 2


def test_no_profiles_leaves_declared_handler_out_of_the_profile() -> None:
    built = build_text("""
        plugins:
        - {type: single-profile-handler, name: my-handler}
        - type: queue-scorer
    """)
    assert built.scheduler.handler is built.plugins["my-handler"]
    profile = built.scheduler.profiles["default"]
    assert scorer_table(built) == [("queue-scorer", "queue-scorer", 1.0)]
    assert isinstance(profile.picker, MaxScorePicker)  # injected, not the handler


def test_empty_document_builds_the_default_config() -> None:
    built = build(parse_config("", SRC))
    assert list(built.scheduler.profiles) == ["default"]
    assert [(s.type_name, w) for s, w in built.scheduler.profiles["default"].scorers] == [
        ("prefix-cache-scorer", 3.0), ("active-request-scorer", 1.0),
        ("no-hit-lru-scorer", 1.0), ("queue-scorer", 1.0),
        ("kv-cache-utilization-scorer", 1.0)]
    assert isinstance(built.scheduler.profiles["default"].picker, MaxScorePicker)


def test_declared_single_profile_handler_is_used() -> None:
    built = build_text("""
        plugins:
        - {type: single-profile-handler, name: h}
        - type: queue-scorer
        schedulingProfiles:
        - name: p
          plugins: [{pluginRef: queue-scorer}]
    """)
    assert built.scheduler.handler is built.plugins["h"]
    assert "single-profile-handler" not in built.plugins


def test_timer_reaches_built_profiles() -> None:
    calls: list[tuple[str, str]] = []

    def timer(point: str, plugin, seconds: float) -> None:  # type: ignore[no-untyped-def]
        calls.append((point, plugin.name))

    built = load_and_build(text=DEFAULT_CONFIG_TEXT, timer=timer)
    assert built.config.source == "--config-text"
    built.scheduler.schedule(req(), [ep(1), ep(2)])
    assert ("Scorer", "queue-scorer") in calls
    assert ("Scorer", "kv-cache-utilization-scorer") in calls
    assert ("Picker", "max-score-picker") in calls
    assert ("ProfilePicker", "single-profile-handler") in calls


# ================================================================ Python plugins by import path


def test_python_plugin_by_import_path_is_built_and_used() -> None:
    built = build_text(f"""
        plugins:
        - type: queue-scorer
        - name: const
          type: {FIXTURE}:ConstantScorer
          parameters: {{value: 0.25}}
        - type: max-score-picker
          parameters: {{maxNumOfEndpoints: 2}}
        schedulingProfiles:
        - name: default
          plugins:
          - pluginRef: queue-scorer
          - {{pluginRef: const, weight: 4}}
          - pluginRef: max-score-picker
    """)
    const = built.plugins["const"]
    assert isinstance(const, plugin_fixture.ConstantScorer)
    assert const.value == 0.25 and const.name == "const"
    assert scorer_table(built) == [("queue-scorer", "queue-scorer", 1.0),
                                   ("const", "constant-scorer", 4.0)]
    e1, e2 = ep(1, waiting_queue_size=0), ep(2, waiting_queue_size=8)
    result = built.scheduler.schedule(req(), [e2, e1])
    assert const.calls == 1
    # queue: e1 1, e2 0 ; const: 4 * 0.25 = 1 for both
    assert result.primary.endpoints == (e1, e2)
    assert result.primary.scores == {e1.key: pytest.approx(2.0), e2.key: pytest.approx(1.0)}


def test_python_pre_request_plugin_is_collected() -> None:
    built = build_text(f"""
        plugins:
        - {{type: "{FIXTURE}:PreRequestOnly", name: pre}}
        - type: queue-scorer
        schedulingProfiles:
        - name: default
          plugins: [{{pluginRef: queue-scorer}}]
    """)
    assert built.pre_request == [built.plugins["pre"]]
    assert built.response_complete == []


def test_python_plugin_parameter_error_names_source_and_path() -> None:
    config_error(f"""
        plugins:
        - type: {FIXTURE}:ConstantScorer
          parameters: {{value: 2}}
    """, "plugins[0].parameters.value", "must be <= 1")
    config_error(f"""
        plugins:
        - type: {FIXTURE}:ConstantScorer
          parameters: {{value: 0.5, bogus: 1}}
    """, "plugins[0].parameters.bogus", "unknown parameter", "accepts: value", strict=True)


def test_python_plugin_bad_module() -> None:
    config_error("""
        plugins:
        - type: tests.unit.no_such_module:Thing
    """, "plugins[0].type", "cannot import plugin module 'tests.unit.no_such_module'")


def test_python_plugin_missing_attribute() -> None:
    config_error(f"""
        plugins:
        - type: {FIXTURE}:Nope
    """, "plugins[0].type", f"module '{FIXTURE}' has no attribute 'Nope'")


def test_python_plugin_missing_from_params() -> None:
    config_error(f"""
        plugins:
        - type: {FIXTURE}:NoFromParams
    """, "plugins[0].type", f"{FIXTURE}:NoFromParams has no from_params(name, params, handle)")


def test_python_plugin_factory_returning_non_plugin() -> None:
    config_error(f"""
        plugins:
        - type: queue-scorer
        - type: {FIXTURE}:NotAPlugin
    """, "plugins[1]", f"{FIXTURE}:NotAPlugin did not build a plugin")


def test_plugin_that_is_not_filter_scorer_or_picker_in_profile() -> None:
    # GIE accepts it (its own request-attribute-reporter test config does this) and the
    # profile does not use it; here with a warning naming it.
    built = build_text(f"""
        plugins:
        - {{type: "{FIXTURE}:PreRequestOnly", name: pre}}
        schedulingProfiles:
        - name: p
          plugins: [{{pluginRef: pre}}]
    """)
    (warning,) = built.warnings
    assert "schedulingProfiles[0].plugins[0]" in warning
    assert "'pre' (pre-request-only) is not a filter, scorer or picker" in warning
    profile = built.scheduler.profiles["p"]
    assert not profile.filters and not profile.scorers


# ================================================================ every error path

ERROR_CASES = [
    # -------- document
    ("invalid-yaml", "plugins: [unclosed\n", ["not valid YAML"]),
    ("top-level-list", "- a\n- b\n", ["(top level): expected a mapping, got list"]),
    ("top-level-scalar", "42\n", ["(top level): expected a mapping, got int"]),
    ("unknown-top-key", "plugin: []\n",
     ["(top level): unknown key(s) 'plugin'", "allowed: apiVersion"]),
    ("data-section", "data: {}\n", ["data: 'data' is GIE v1.4's name", "rename it to 'dataLayer'"]),
    ("flow-control-unknown-key", "flowControl: {maxByte: 1}\n",
     ["flowControl: unknown key(s) 'maxByte'", "did you mean 'maxBytes'"]),
    ("wrong-api-version", "apiVersion: example.com/v9\n",
     ["apiVersion: unsupported 'example.com/v9'", "inference.networking.x-k8s.io/v1alpha1",
      "llm-d.ai/v1alpha1"]),
    ("wrong-kind", "kind: InferencePool\n",
     ["kind: expected 'EndpointPickerConfig', got 'InferencePool'"]),
    # -------- featureGates
    ("unknown-feature-gate", "featureGates: [flowControl, warpDrive]\n",
     ["featureGates[1]: unknown feature gate 'warpDrive'",
      "known: dataLayer, enableLegacyMetrics, flowControl"]),
    ("feature-gates-not-list", "featureGates: flowControl\n",
     ["featureGates: expected a list, got str"]),
    ("feature-gate-not-string", "featureGates: [3]\n",
     ["featureGates[0]: expected a non-empty string, got 3"]),
    # -------- plugins
    ("plugins-not-list", "plugins: queue-scorer\n", ["plugins: expected a list, got str"]),
    ("plugin-not-mapping", "plugins: [queue-scorer]\n",
     ["plugins[0]: expected a mapping, got str"]),
    ("plugin-missing-type", "plugins: [{name: q}]\n", ["plugins[0]: missing 'type'"]),
    ("plugin-empty-type", "plugins: [{type: ''}]\n",
     ["plugins[0].type: expected a non-empty string"]),
    ("plugin-unknown-key", "plugins: [{type: queue-scorer, params: {}}]\n",
     ["plugins[0]: unknown key(s) 'params'", "allowed: name, parameters, type"]),
    ("duplicate-plugin-name", "plugins: [{type: queue-scorer}, {type: queue-scorer}]\n",
     ["plugins[1].name: duplicate plugin name 'queue-scorer'"]),
    ("duplicate-explicit-name",
     "plugins: [{type: queue-scorer, name: x}, {type: kv-cache-utilization-scorer, name: x}]\n",
     ["plugins[1].name: duplicate plugin name 'x'"]),
    ("parameters-not-mapping", "plugins: [{type: max-score-picker, parameters: [1]}]\n",
     ["plugins[0].parameters: expected a mapping, got list"]),
    ("unknown-plugin-type", "plugins: [{type: queue-scorer}, {type: no-such-scorer}]\n",
     ["plugins[1].type: unknown plugin type 'no-such-scorer'", "known types: "]
     + BUILTIN_TYPES + ["package.module:ClassName"]),
    ("max-num-zero",
     "plugins: [{type: queue-scorer}, {type: max-score-picker, parameters: {maxNumOfEndpoints: 0}}]\n",
     ["plugins[1].parameters.maxNumOfEndpoints: must be >= 1, got 0"]),
    ("max-num-string",
     "plugins: [{type: random-picker, parameters: {maxNumOfEndpoints: x}}]\n",
     ["plugins[0].parameters.maxNumOfEndpoints: expected an integer, got 'x'"]),
    # -------- schedulingProfiles
    ("profiles-not-list", "schedulingProfiles: default\n",
     ["schedulingProfiles: expected a list, got str"]),
    ("profile-not-mapping", "schedulingProfiles: [default]\n",
     ["schedulingProfiles[0]: expected a mapping, got str"]),
    ("profile-unknown-key", "schedulingProfiles: [{name: p, scorers: []}]\n",
     ["schedulingProfiles[0]: unknown key(s) 'scorers'"]),
    ("profile-missing-name", ("plugins: [{type: queue-scorer}]\n"
     "schedulingProfiles: [{plugins: [{pluginRef: queue-scorer}]}]\n"),
     ["schedulingProfiles[0]: missing 'name'"]),
    ("profile-empty-name", "schedulingProfiles: [{name: ''}]\n",
     ["schedulingProfiles[0].name: expected a non-empty string"]),
    ("duplicate-profile", "schedulingProfiles: [{name: p}, {name: q}, {name: p}]\n",
     ["schedulingProfiles[2].name: duplicate profile name 'p'"]),
    ("profile-plugins-not-list", "schedulingProfiles: [{name: p, plugins: queue-scorer}]\n",
     ["schedulingProfiles[0].plugins: expected a list, got str"]),
    ("ref-not-mapping", ("plugins: [{type: queue-scorer}]\n"
     "schedulingProfiles: [{name: p, plugins: [queue-scorer]}]\n"),
     ["schedulingProfiles[0].plugins[0]: expected a mapping, got str"]),
    ("ref-unknown-key", ("plugins: [{type: queue-scorer}]\n"
     "schedulingProfiles: [{name: p, plugins: [{pluginRef: queue-scorer, wieght: 2}]}]\n"),
     ["schedulingProfiles[0].plugins[0]: unknown key(s) 'wieght'", "allowed: pluginRef, weight"]),
    ("ref-missing-plugin-ref", ("plugins: [{type: queue-scorer}]\n"
     "schedulingProfiles: [{name: p, plugins: [{weight: 2}]}]\n"),
     ["schedulingProfiles[0].plugins[0]: missing 'pluginRef'"]),
    ("undeclared-plugin-ref", ("plugins: [{type: queue-scorer}, {type: max-score-picker}]\n"
     "schedulingProfiles: [{name: p, plugins: [{pluginRef: queue-scorer}, {pluginRef: nope}]}]\n"),
     ["schedulingProfiles[0].plugins[1].pluginRef: no plugin named 'nope' in 'plugins'",
      "declared: max-score-picker, queue-scorer"]),
    ("undeclared-plugin-ref-none-declared",
     "schedulingProfiles: [{name: p, plugins: [{pluginRef: nope}]}]\n",
     ["schedulingProfiles[0].plugins[0].pluginRef: no plugin named 'nope'", "declared: none"]),
    ("string-weight", ("plugins: [{type: queue-scorer}]\n"
     "schedulingProfiles: [{name: p, plugins: [{pluginRef: queue-scorer, weight: heavy}]}]\n"),
     ["schedulingProfiles[0].plugins[0].weight: expected a number, got 'heavy'"]),
    ("bool-weight", ("plugins: [{type: queue-scorer}]\n"
     "schedulingProfiles: [{name: p, plugins: [{pluginRef: queue-scorer, weight: true}]}]\n"),
     ["schedulingProfiles[0].plugins[0].weight: expected a number, got True"]),
    ("two-pickers",
     ("plugins: [{type: queue-scorer}, {type: max-score-picker}, {type: random-picker}]\n"
     "schedulingProfiles: [{name: p, plugins: [{pluginRef: max-score-picker},"
     " {pluginRef: queue-scorer}, {pluginRef: random-picker}]}]\n"),
     [("schedulingProfiles[0].plugins[2]: profile 'p' has two pickers "
      "('max-score-picker', 'random-picker')")]),
    ("two-pickers-no-profiles", "plugins: [{type: max-score-picker}, {type: random-picker}]\n",
     ["plugins: profile 'default' has two pickers"]),
    ("two-profiles-without-handler", ("plugins: [{type: queue-scorer}]\n"
     "schedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer}]},"
     " {name: b, plugins: [{pluginRef: queue-scorer}]}]\n"),
     ["plugins: 2 scheduling profiles need a profile handler"]),
    ("two-profile-handlers",
     "plugins: [{type: single-profile-handler, name: h1}, {type: single-profile-handler, name: h2}]\n",
     ["plugins: more than one profile handler declared: h1, h2"]),
    # -------- saturationDetector
    ("saturation-detector-non-detector", ("plugins: [{type: queue-scorer}]\n"
     "saturationDetector: {pluginRef: queue-scorer}\n"),
     ["saturationDetector: 'queue-scorer' is not a saturation detector"]),
    ("saturation-detector-undeclared", "saturationDetector: {pluginRef: detector}\n",
     ["saturationDetector.pluginRef: no plugin named 'detector'"]),
    ("saturation-detector-not-mapping", "saturationDetector: detector\n",
     ["saturationDetector: expected a mapping, got str"]),
    ("saturation-detector-unknown-key", "saturationDetector: {name: detector}\n",
     ["saturationDetector: unknown key(s) 'name'"]),
]


@pytest.mark.parametrize(("text", "fragments"), [(t, f) for _, t, f in ERROR_CASES],
                         ids=[i for i, _, _ in ERROR_CASES])
def test_config_error(text: str, fragments: list[str]) -> None:
    config_error(text, *fragments)


# Unknown plugin parameters: GIE ignores them; so does this EPP, with one warning naming
# each, unless strict (check-config --strict, serve --strict-config).
UNKNOWN_PARAMETER_CASES = [
    ("unknown-parameter",
     "plugins: [{type: max-score-picker, parameters: {maxNumOfEndpoints: 2, foo: 1}}]\n",
     ["plugins[0].parameters.foo", "unknown parameter",
      "this plugin accepts: maxNumOfEndpoints"]),
    ("parameter-on-parameterless-plugin", "plugins: [{type: queue-scorer, parameters: {x: 1}}]\n",
     ["plugins[0].parameters.x", "unknown parameter", "accepts: none"]),
]


@pytest.mark.parametrize(("text", "fragments"), [c[1:] for c in UNKNOWN_PARAMETER_CASES],
                         ids=[c[0] for c in UNKNOWN_PARAMETER_CASES])
def test_unknown_parameters_are_errors_when_strict_and_warnings_otherwise(
        text: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        build(parse_config(text, SRC), strict=True)
    for fragment in fragments:
        assert fragment in str(info.value)
    built = build(parse_config(text, SRC))
    (warning,) = built.warnings
    assert warning.startswith(f"{SRC}: ") and "ignored" in warning
    for fragment in fragments:
        assert fragment in warning


# What GIE v1.5.0 accepts, accepted the same way (pkg/epp/config/loader in v1.5.0).
def test_what_go_accepts_loads_with_gos_defaults() -> None:
    # A weight on a non-scorer is ignored, with a warning.
    built = build_text("""\
        plugins: [{type: queue-scorer}, {type: max-score-picker}]
        schedulingProfiles: [{name: p, plugins: [{pluginRef: queue-scorer},
                                                 {pluginRef: max-score-picker, weight: 2}]}]
        """)
    assert built.warnings == [(f"{SRC}: schedulingProfiles[0].plugins[1].weight: "
                              "'max-score-picker' is not a scorer; its weight is ignored")]
    # A negative weight is a weight (Go's int).
    built = build_text("""\
        plugins: [{type: queue-scorer}]
        schedulingProfiles: [{name: p, plugins: [{pluginRef: queue-scorer, weight: -1}]}]
        """)
    assert built.scheduler.profiles["p"].scorers[0][1] == -1
    # An empty name means the type, as a missing one does.
    assert "queue-scorer" in build_text("plugins: [{type: queue-scorer, name: ''}]\n").plugins
    # saturationDetector without a pluginRef: the default utilization-detector.
    assert type(build_text("saturationDetector: {}\n").saturation_detector).__name__ == \
        "UtilizationDetector"


def test_profile_handler_used_inside_a_profile() -> None:
    built = build_text("""
        plugins:
        - type: single-profile-handler
        - type: queue-scorer
        schedulingProfiles:
        - name: p
          plugins:
          - pluginRef: queue-scorer
          - pluginRef: single-profile-handler
    """)
    (warning,) = built.warnings
    assert "schedulingProfiles[0].plugins[1]" in warning and "single-profile-handler" in warning
    assert [sc.name for sc, _ in built.scheduler.profiles["p"].scorers] == ["queue-scorer"]





def test_unknown_parameter_names_full_key_path() -> None:
    config_error("plugins: [{type: max-score-picker, parameters: {foo: 1}}]\n",
                 "plugins[0].parameters.foo", strict=True)


# ================================================================ files


def test_config_file_errors_name_the_file(tmp_path: Path) -> None:
    bad_parse = tmp_path / "bad-kind.yaml"
    bad_parse.write_text("kind: Nope\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config_file(bad_parse)
    assert str(info.value).startswith(f"{bad_parse}: kind: ")

    bad_build = tmp_path / "bad-type.yaml"
    bad_build.write_text("plugins: [{type: nope-scorer}]\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_and_build(path=str(bad_build))
    assert str(info.value).startswith(f"{bad_build}: plugins[0].type: unknown plugin type")

    bad_param = tmp_path / "bad-param.yaml"
    bad_param.write_text("plugins: [{type: max-score-picker, parameters: "
                         "{maxNumOfEndpoints: 0}}]\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_and_build(path=str(bad_param))
    assert str(info.value).startswith(
        f"{bad_param}: plugins[0].parameters.maxNumOfEndpoints: must be >= 1")


def test_unreadable_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist.yaml"
    with pytest.raises(ConfigError) as info:
        load_config_file(missing)
    assert str(info.value).startswith(f"{missing}: cannot read config file")

    with pytest.raises(ConfigError) as info:
        load_and_build(path=str(tmp_path))  # a directory
    assert str(info.value).startswith(f"{tmp_path}: cannot read config file")


def test_file_and_text_together_is_an_error() -> None:
    with pytest.raises(ConfigError, match="not both"):
        load_and_build(path="x.yaml", text="plugins: []")


def test_config_text_source_name() -> None:
    with pytest.raises(ConfigError) as info:
        load_and_build(text="kind: Nope\n")
    assert str(info.value).startswith("--config-text: kind: ")


# ================================================================ registry


def test_default_registry_types() -> None:
    assert default_registry().types == BUILTIN_TYPES


def test_registry_register_twice_is_an_error() -> None:
    reg = Registry()
    reg.register_class(QueueScorer)
    with pytest.raises(ValueError, match="'queue-scorer' registered twice"):
        reg.register_class(QueueScorer)


def test_registry_unknown_type_message() -> None:
    reg = Registry()
    reg.register_class(QueueScorer)
    with pytest.raises(ConfigError) as info:
        reg.builder("nope", "f.yaml: plugins[3].type")
    msg = str(info.value)
    assert msg.startswith("f.yaml: plugins[3].type: unknown plugin type 'nope'")
    assert "known types: queue-scorer" in msg


def test_registry_import_path_returns_from_params() -> None:
    build = default_registry().builder(f"{FIXTURE}:ConstantScorer", "p")
    plugin = build("c", {"value": 0.75}, "p.parameters", PluginHandle())
    assert isinstance(plugin, plugin_fixture.ConstantScorer)
    assert plugin.value == 0.75


def test_build_with_custom_registry() -> None:
    reg = Registry()
    reg.register_class(plugin_fixture.ConstantScorer)
    built = build(parse_config("plugins: [{type: constant-scorer, parameters: {value: 0.1}}]\n",
                               SRC), reg)
    assert scorer_table(built) == [("constant-scorer", "constant-scorer", 1.0)]
    with pytest.raises(ConfigError) as info:
        build(parse_config("plugins: [{type: queue-scorer}]\n", SRC), reg)
    assert str(info.value).startswith(f"{SRC}: plugins[0].type: unknown plugin type")


def test_plugin_handle_get() -> None:
    h = PluginHandle()
    q = QueueScorer("q")
    h.plugins["q"] = q
    assert h.get("q") is q
    assert h.get("missing") is None


# ================================================================ Params


def test_params_reads_values_and_defaults() -> None:
    p = Params({"i": 3, "f": 2, "s": "x", "b": False, "d": "250ms", "r": [1]}, "a.parameters")
    assert p.int("i", 0) == 3
    assert p.float("f", 0.0) == 2.0 and type(p.float("f", 0.0)) is float
    assert p.str("s", None) == "x"
    assert p.bool("b", True) is False
    assert p.duration("d", 1.0) == pytest.approx(0.25)
    assert p.raw("r") == [1]
    assert p.int("missing-i", 7) == 7
    assert p.float("missing-f", 0.5) == 0.5
    assert p.str("missing-s", "dflt") == "dflt"
    assert p.bool("missing-b", True) is True
    assert p.duration("missing-d", 2.0) == 2.0
    p.done()  # everything was read


def test_params_none_is_empty() -> None:
    p = Params(None, "x")
    assert p.int("n", 4) == 4
    p.done()


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda p: p.int("v", 0), "a.parameters.v: expected an integer, got 'str'"),
        (lambda p: p.float("v", 0.0), "a.parameters.v: expected a number, got 'str'"),
        (lambda p: p.bool("v", False), "a.parameters.v: expected true or false, got 'str'"),
        (lambda p: p.duration("v", 0.0), ("a.parameters.v: expected a duration like '200ms' or '2s', "
                                         "got 'str'")),
    ],
)
def test_params_type_errors_on_string(call, fragment: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as info:
        call(Params({"v": "str"}, "a.parameters"))
    assert str(info.value) == fragment


@pytest.mark.parametrize(
    ("raw", "call", "message"),
    [
        (True, lambda p: p.int("v", 0), "a.v: expected an integer, got True"),
        (2.5, lambda p: p.int("v", 0), "a.v: expected an integer, got 2.5"),
        (1, lambda p: p.int("v", 0, minimum=2), "a.v: must be >= 2, got 1"),
        (True, lambda p: p.float("v", 0.0), "a.v: expected a number, got True"),
        (-0.5, lambda p: p.float("v", 0.0, minimum=0.0), "a.v: must be >= 0.0, got -0.5"),
        (1.5, lambda p: p.float("v", 0.0, maximum=1.0), "a.v: must be <= 1.0, got 1.5"),
        (3, lambda p: p.str("v", None), "a.v: expected a string, got 3"),
        (1, lambda p: p.bool("v", False), "a.v: expected true or false, got 1"),
        (True, lambda p: p.duration("v", 0.0), "a.v: expected a duration like '200ms', got True"),
        ("5 parsecs", lambda p: p.duration("v", 0.0),
         "a.v: expected a duration like '200ms' or '2s', got '5 parsecs'"),
    ],
)
def test_params_value_errors(raw: object, call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as info:
        call(Params({"v": raw}, "a"))
    assert str(info.value) == message


def test_params_not_a_mapping() -> None:
    with pytest.raises(ConfigError) as info:
        Params([1, 2], "plugins[4].parameters")  # type: ignore[arg-type]
    assert str(info.value) == "plugins[4].parameters: parameters must be a mapping, got list"


def test_params_done_rejects_unread_keys() -> None:
    p = Params({"keep": 1, "typo": 2, "other": 3}, "plugins[0].parameters")
    p.int("keep", 0)
    p.int("absent", 0)
    with decoding(strict=True), pytest.raises(ConfigError) as info:
        p.done()
    assert str(info.value).startswith(
        "plugins[0].parameters.other, plugins[0].parameters.typo: unknown parameter; this "
        "plugin accepts: absent, keep")


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("200ms", 0.2), ("2s", 2.0), ("1.5s", 1.5), ("3m", 180.0), ("1h", 3600.0),
     ("500us", 5e-4), ("500µs", 5e-4), ("100ns", 1e-7), (" 10 ms ", 0.01), (3, 3.0), (0.25, 0.25)],
)
def test_parse_duration(value: object, seconds: float) -> None:
    assert parse_duration(value, "x") == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "ms", "-1s", "10", "1d", None, [1]])
def test_parse_duration_rejects(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^p\.q: expected a duration"):
        parse_duration(value, "p.q")
