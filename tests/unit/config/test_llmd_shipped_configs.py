"""Every EndpointPickerConfig that llm-d-router v0.10.0 ships — and llm-d-inference-
scheduler's last release, v0.8.0 — loads here: one case per document.

The documents come from the unchanged copies under tests/fixtures/llm-d-router-v0.10.0/
and tests/fixtures/llm-d-inference-scheduler-v0.8.0/ (their READMEs list the files):
deploy/config, the routerlib Helm chart (rendered for each set of values that changes
it), the perf Helm values (``router.epp.pluginsCustomConfig``), the integration test
data, the YAML literals of the Go tests and the Markdown examples (tests/llmd_fixtures.py
extracts them at test time).

A case loads the document as ``epp check-config`` does (``parse_config`` + ``build``:
plugins built, references resolved), then runs one scheduling cycle over fake endpoints
with every llm-d role label (decode, prefill, encode, both) and the request the config
expects, and checks an endpoint was picked.

Three lists say why a document does not run:

- :data:`MISSING_TYPES`: a plugin type this EPP does not have yet (strict xfail: when the
  type lands, the case passes, XPASS fails, and the entry must go);
- :data:`GAPS`: llm-d loads the document, this EPP does not yet (strict xfail, the
  reason says what is missing);
- :data:`NOT_IN_LLMD`: llm-d's own binary refuses it too (types and gates only llm-d's
  Go tests register, intentionally invalid loader test data, schematic examples): the
  case checks that the error names the problem.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from epp import keys
from epp.config.loader import BuiltConfig, build, parse_config
from epp.errors import ConfigError
from epp.parsing.parser import Parser
from epp.requestcontrol.director import build_request
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.types import Endpoint, Metrics
from tests.llmd_fixtures import ROUTER, SCHEDULER, ShippedConfig, materialize, shipped_configs

#: Plugin types other helpers are building: a document declaring one is a strict xfail
#: ("needs <type>"). Remove the entry when the type is registered.
MISSING_TYPES: Mapping[str, str] = {}

R = "router:"
S = "scheduler:"
LOADER_TESTDATA = R + "pkg/epp/config/loader/testdata_test.go#"
_TEST_TYPE = "a plugin type only llm-d's loader tests register"
_TEST_GATE = "the feature gate 'test-feature-gate', registered only by llm-d's loader tests"
_MOCK_SOURCE = ("'mock-metrics-source', registered only by llm-d's integration tests "
                "(test/integration/epp)")
_PREPARE_DATA = ("the feature gate 'prepareDataPlugins' of older releases, which "
                 "llm-d-router v0.10.0 no longer registers (its loader fails: 'feature gate "
                 "prepareDataPlugins is unknown or unregistered')")
_SKELETON = "a schematic example ('- ....' placeholders), not a config"

#: Documents llm-d's own binary refuses too: (why, fragments our error must contain).
NOT_IN_LLMD: Mapping[str, tuple[str, tuple[str, ...]]] = {
    R + "cmd/epp/runner/multicluster_config_test.go#multiClusterConfig[1]": (
        ("the Go test's failing case: no multicluster-metrics-extractor, so nothing "
        "produces the scorer's data (llm-d: ErrNoDefaultProducer)"),
        ("no default producer", "multicluster-metrics-extractor")),
    R + "cmd/epp/runner/run_with_file_discovery_test.go#"
        "TestRunWithFileDiscovery_AlphaPluginBlockedByDefault": (
        "a plugin type the Go test registers for itself", ("'alpha-test-plugin'",)),
    R + "cmd/epp/runner/run_with_file_discovery_test.go#"
        "TestRunWithFileDiscovery_AlphaPluginAllowedWithFlag": (
        "a plugin type the Go test registers for itself", ("'alpha-test-plugin-allowed'",)),
    R + "config/charts/README.md": (
        "the chart README's custom-config example names a made-up 'custom-scorer'",
        ("unknown plugin type 'custom-scorer'",)),
    R + "docs/architecture.md#1": (_SKELETON, ("plugins[0]", "expected a mapping")),
    S + "docs/architecture.md#1": (_SKELETON, ("plugins[0]", "expected a mapping")),
    S + "docs/architecture.md#4": (
        "mis-indented YAML in the docs (prefix-based-pd-decider's parameters)",
        ("not valid YAML", "line 13")),
    R + "pkg/epp/framework/plugins/README.md": (
        ("names the CA bundle of a deployment (/etc/epp/tls/ca.crt); llm-d fails the same "
        "way without it"), ("caCertPath", "/etc/epp/tls/ca.crt")),
    R + "test/testdata/configloader_1_test.yaml": (_TEST_GATE, ("'test-feature-gate'",)),
    **{R + path: (_MOCK_SOURCE, ("'mock-metrics-source'",)) for path in (
        "test/integration/epp/dynamic_attributes_test.go#configText",
        "test/integration/epp/grpc_test.go#testConfigWithVllmGRPCParser",
        "test/integration/epp/hermetic_test.go#configText",
        "test/integration/epp/session_affinity_test.go#configText",
        "test/integration/epp/session_affinity_test.go#configText#2",
        "test/integration/epp/session_affinity_test.go#configText#3",
        "test/integration/epp/session_affinity_test.go#configText#4",
        "test/integration/epp/session_affinity_test.go#pdConfigBase[0]",
        "test/integration/epp/session_affinity_test.go#pdConfigBase[1]",
        "test/integration/epp/testdata/datalayer-config.yaml",
        "test/integration/epp/testdata/request-attribute-reporter-config.yaml",
    )},
    **{S + path: (_PREPARE_DATA, ("'prepareDataPlugins'",)) for path in (
        "deploy/config/pd-epp-config.yaml",
        "deploy/config/sim-epd-epp-config.yaml",
        "deploy/config/sim-epp-external-tokenizer-config.yaml",
        "deploy/config/sim-pd-epp-config.yaml",
        "docs/architecture.md#3",
        "docs/disaggregation.md#1",
        "docs/disaggregation.md#2",
    )},
    # llm-d-inference-scheduler v0.8.0's deprecated indexerConfig.tokenizersPoolConfig:
    # llm-d-router v0.10.0's precise-prefix-cache-scorer still reads it (its legacy producer,
    # scorer/preciseprefixcache/legacy_producer.go: llm-d-kv-cache's UDS pool) but fails
    # on each of these; here the pool's tokenizer must be local (no UDS client, no hub).
    S + "deploy/config/epp-precise-prefix-cache-config.yaml": (
        ("tokenizersPoolConfig without 'uds': llm-d's pool fails at startup ('UDS tokenizer "
         "config must be enabled')"),
        ("tokenizersPoolConfig", "cannot obtain the tokenizer of 'hf-repo/model-name'",
         "token-producer")),
    S + "deploy/config/sim-epp-kvcache-config.yaml": (
        ("tokenizersPoolConfig.hf, which llm-d-router v0.10.0's strict decoder refuses "
         "(llm-d-kv-cache v0.9's pool has no 'hf')"),
        ("tokenizersPoolConfig", ("cannot obtain the tokenizer of "
         "'TinyLlama/TinyLlama-1.1B-Chat-v1.0'"))),
    **{S + "test/e2e/configs_test.go#" + name: (
        ("indexerConfig.prefixStoreConfig, which llm-d-router v0.10.0's strict decoder "
         "refuses; its pool's tokenizer comes from the UDS sidecar, which this EPP cannot "
         "reach"),
        ("tokenizersPoolConfig", "cannot obtain the tokenizer of 'Qwen/Qwen2.5-1.5B-Instruct'",
         "UDS tokenizer sidecar at /tmp/tokenizer/tokenizer-uds.socket"))
       for name in ("kvConfig", "kvExternalTokenizerConfig")},
    # llm-d's loader test data (pkg/epp/config/loader/testdata_test.go): test-only types
    # and gates, and the documents its tests expect to fail.
    **{LOADER_TESTDATA + name: (_TEST_GATE, ("'test-feature-gate'",)) for name in (
        "successDeprecatedText", "successConfigText", "successNoProfilesText",
        "successSchedulerConfigText", "errorBadSourceReferenceText",
        "errorBadExtractorReferenceText")},
    **{LOADER_TESTDATA + name: (_TEST_TYPE, (f"unknown plugin type '{ptype}'",))
       for name, ptype in (
           ("pluginsInOrderText", "test-plugin"),
           ("pluginsOutOfOrderText", "test-with-dependencies"),
           ("pluginsRefedByPointerText", "test-with-dependencies"),
           ("pluginsRefedInNestedingText", "test-with-nested-dependencies"),
           ("successWithNoWeightText", "test-scorer"),
           ("successPickerBeforeScorerText", "test-picker"),
           ("successDataLayerExplicitConfigText", "test-source"),
           ("successFilterOrderConfigText", "test-order-filter"),
           # error cases whose test-only type fails first
           ("errorBadPluginJSONText", "test-scorer"),
           ("errorBadProfilePluginRefText", "test-profile-handler"),
           ("errorTwoPickersText", "test-picker"),
           ("errorPluginsRefedInLoopText", "test-with-dependencies"),
           ("errorFlowControlWrongPluginTypeText", "test-scorer"),
       )},
    **{LOADER_TESTDATA + name: ("invalid on purpose (llm-d's loader test expects an error)",
                                fragments) for name, fragments in (
        ("errorBadYamlText", ("plugins[0]", "expected a mapping")),
        ("errorBadPluginReferenceText", ("plugins[0]", "missing 'type'")),
        ("errorBadPluginReferencePluginText", ("unknown plugin type 'unknown-plugin-type'",)),
        ("errorUnknownFeatureGateText", ("unknown feature gate 'unknown-gate'",)),
        ("errorBadFeatureGateText", ("'qwerty' is not a valid value", "'flowControl'")),
        ("errorNoProfileNameText", ("schedulingProfiles[0]", "missing 'name'")),
        ("errorBadProfilePluginText", ("schedulingProfiles[0].plugins[0]",
                                       "missing 'pluginRef'")),
        ("errorDuplicatePluginText", ("duplicate plugin name 'test1'",)),
        ("errorDuplicateProfileText", ("duplicate profile name 'default'",)),
        ("errorTwoProfileHandlersText", ("more than one profile handler",)),
        ("errorNoProfileHandlersText", ("need a profile handler",)),
        ("errorMultiProfilesUseSingleProfileHandlerText", ("single-profile-handler",
                                                           "runs one profile")),
        ("errorFlowControlMissingPluginText", ("orderingPolicyRef",
                                               "no plugin named 'non-existent-policy'")),
        ("errorParserWrongPluginTypeText", ("'maxScore' (max-score-picker) is not a parser",)),
        ("errorParserWrongPluginNameText", ("no plugin named 'wrongParser'",)),
    )},
}

#: Documents llm-d loads and this EPP does not yet: why (strict xfail).
GAPS: Mapping[str, str] = {}

#: Request headers a document's scheduling needs (by document ID prefix).
HEADERS: Mapping[str, Mapping[str, str]] = {}

DOCS = shipped_configs(ROUTER, "router") + shipped_configs(SCHEDULER, "scheduler")


def _types(doc: ShippedConfig) -> set[str]:
    try:
        data = yaml.safe_load(doc.text)
    except yaml.YAMLError:
        return set()
    plugins = data.get("plugins") if isinstance(data, dict) else None
    return {p["type"] for p in plugins or () if isinstance(p, dict)
            and isinstance(p.get("type"), str)}


def _case(doc: ShippedConfig) -> Any:
    missing = sorted(_types(doc) & set(MISSING_TYPES))
    if missing:
        return pytest.param(doc, id=doc.id, marks=pytest.mark.xfail(
            strict=True, reason="needs " + ", ".join(missing)))
    if doc.id in GAPS:
        return pytest.param(doc, id=doc.id, marks=pytest.mark.xfail(
            strict=True, reason=GAPS[doc.id]))
    return pytest.param(doc, id=doc.id)


LOADABLE = [_case(d) for d in DOCS if d.id not in NOT_IN_LLMD]
REFUSED = [pytest.param(d, id=d.id) for d in DOCS if d.id in NOT_IN_LLMD]

ROLES = ("decode", "decode", "prefill", "prefill", "encode", "both")


def endpoints() -> list[Endpoint]:
    """One endpoint per llm-d role (``llm-d.ai/role``, and ``role`` as llm-d's docs label
    them for label-selector-filter; two decode and two prefill), idle, fresh metrics."""
    import time

    now = time.monotonic()
    return [Endpoint(name=f"pod-{i}", address=f"10.0.0.{i + 1}", port=8000,
                     namespace="default",
                     labels={keys.LABEL_ROLE: role, "role": role, "app": "vllm"},
                     metrics=Metrics(waiting_queue_size=0, kv_cache_usage=0.1,
                                     running_requests=0, updated_at=now))
            for i, role in enumerate(ROLES)]


BODY = orjson.dumps({"model": "m", "messages": [
    {"role": "user", "content": "Tell me a story about the sea, please, in a few lines."}]})


def _headers(doc: ShippedConfig) -> dict[str, str]:
    h = {":method": "POST", ":path": "/v1/chat/completions",
         "content-type": "application/json", "x-request-id": "r-1"}
    for prefix, extra in HEADERS.items():
        if doc.id.startswith(prefix):
            h.update(extra)
    return h


def load(doc: ShippedConfig, tmp_path: Path) -> BuiltConfig:
    """As ``epp check-config`` loads a file."""
    return build(parse_config(materialize(doc.text, tmp_path), doc.id))


def _grpc_generate() -> bytes:
    """A framed vLLM gRPC GenerateRequest (what the vllmgrpc-parser routes)."""
    from epp.parsing.vllm_grpc import GenerateRequest

    payload = GenerateRequest(text="Tell me a story about the sea.").SerializeToString()
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def schedule_once(built: BuiltConfig, doc: ShippedConfig) -> Sequence[Endpoint]:
    parser = built.parser_plugin if isinstance(built.parser_plugin, Parser) else None
    headers, body = _headers(doc), BODY
    if parser is not None and parser.type_name == "vllmgrpc-parser":
        headers.update({":path": "/vllm.grpc.engine.VllmEngine/Generate",
                        "content-type": "application/grpc"})
        body = _grpc_generate()
    request, _ = build_request(headers, body, True, parser)
    result = built.scheduler.schedule(request, endpoints())
    return result.primary.endpoints


@pytest.mark.parametrize("doc", LOADABLE)
def test_loads_and_schedules(doc: ShippedConfig, tmp_path: Path) -> None:
    built = load(doc, tmp_path)
    assert built.scheduler.profiles, f"{doc.id}: no scheduling profile"
    picked = schedule_once(built, doc)
    assert picked, f"{doc.id}: the cycle picked no endpoint"


@pytest.mark.parametrize("doc", REFUSED)
def test_refused_as_llmd_refuses_it_naming_the_problem(doc: ShippedConfig,
                                                        tmp_path: Path) -> None:
    why, fragments = NOT_IN_LLMD[doc.id]
    with pytest.raises(ConfigError) as info:
        load(doc, tmp_path)
    msg = str(info.value)
    assert msg.startswith(doc.id), msg  # names the document
    for fragment in fragments:
        assert fragment in msg, f"{doc.id} ({why}): {fragment!r} not in {msg!r}"


def test_lists_name_real_documents_and_types() -> None:
    ids = {d.id for d in DOCS}
    assert not set(NOT_IN_LLMD) - ids, sorted(set(NOT_IN_LLMD) - ids)
    assert not set(GAPS) - ids, sorted(set(GAPS) - ids)
    assert not set(NOT_IN_LLMD) & set(GAPS)
    # A missing type is one the registry really lacks.
    assert not set(MISSING_TYPES) & set(default_registry().types)


def test_every_source_is_collected() -> None:
    """The documents found per source (the fixture READMEs give the same counts)."""
    counts: dict[tuple[str, str], int] = {}
    for d in DOCS:
        key = (d.id.split(":")[0], d.source)
        counts[key] = counts.get(key, 0) + 1
    assert counts == COUNTS


COUNTS = {
    # deploy/config (19), test/integration/epp/testdata (3), test/testdata (1)
    ("router", "yaml"): 19 + 3 + 1,
    ("router", "helm-values"): 4,  # test/perf/config/router-configs
    ("router", "chart"): 7,  # routerlib: default-plugins.yaml × 6 value sets + payload-agnostic
    # loader testdata 50, e2e 12, integration 24 (pdConfigBase twice), cmd/epp/runner 9
    # (multiClusterConfig twice), coordinator 3
    ("router", "go"): 50 + 12 + 24 + 9 + 3,
    ("router", "markdown"): 19,  # docs/ 5, plugin READMEs 13, config/charts/README.md 1
    ("scheduler", "yaml"): 11,  # deploy/config
    ("scheduler", "go"): 11,  # test/e2e 10, test/config 1
    ("scheduler", "markdown"): 6,  # docs/architecture.md 4, docs/disaggregation.md 2
}


# ------------------------------------------------- loader behaviour these documents need

GATES_DOC = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [{gates}]
plugins:
- type: queue-scorer
- type: round-robin-fairness-policy
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""


@pytest.mark.parametrize(("gates", "flow_control"), [
    ("flowControl", True),
    ("flowControl=true", True),
    ("flowControl= TRUE", True),
    ("flowControl=1", True),
    ("flowControl=false", False),
    ("flowControl=f", False),
    ("haPopulateNonLeaderDatastore=false", False),  # llm-d's; nothing to switch here
    ("haPopulateNonLeaderDatastore, flowControl", True),
])
def test_feature_gates_take_llmds_name_equals_bool_form(gates: str, flow_control: bool) -> None:
    built = build(parse_config(GATES_DOC.format(gates=gates), "g.yaml"))
    assert (built.flow_control is not None) is flow_control
    # A fairness policy (it has a pick()) is not taken for the profile's picker.
    assert built.scheduler.profiles["default"].picker.type_name == "max-score-picker"


def test_a_bad_gate_value_names_it() -> None:
    with pytest.raises(ConfigError, match=r"g.yaml: featureGates\[0\]: 'maybe' is not a valid "
                                          r"value for the feature gate 'flowControl'"):
        parse_config(GATES_DOC.format(gates="flowControl=maybe"), "g.yaml")
