"""GIE v1.5.0's data-dependency check (pkg/epp/datalayer/data_graph.go and its test,
data_graph_test.go): producers and consumers of data keys, checked when the config loads.

Go's mocks are ``mockPrepareRequestDataP`` (a PrepareData plugin: request-control layer,
with ``Produces``/``Consumes`` maps), ``MockSchedulingPlugin`` (a scorer that consumes)
and ``MockConsumerFairnessPolicy`` (flow control; this EPP has no flow-control policy
plugins yet, so a scheduling producer with a request-control consumer stands for the
invalid layer order).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from epp.config.loader import BuiltConfig, build, parse_config
from epp.datalayer.dependencies import (
    LAYER_DEFAULT,
    LAYER_REQUEST_CONTROL,
    LAYER_SCHEDULING,
    DependencyError,
    check_data_dependencies,
    execution_layer,
)
from epp.errors import ConfigError
from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters
from epp.framework.registry import Registry
from epp.scheduling.plugins.catalog import BUILTIN_PLUGINS, default_registry
from epp.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult

ROOT = Path(__file__).resolve().parents[3]
GIE = ROOT / "tests" / "fixtures" / "gie-v1.5.0"


class PrepareData:
    """Go's ``mockPrepareRequestDataP``: request control (here: a PreRequest plugin)."""

    type_name = "mock"

    def __init__(self, name: str, produces: Mapping[str, str] | None = None,
                 consumes: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.produces = produces or {}
        self.consumes = consumes or {}

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        pass


class SchedulingPlugin:
    """Go's ``MockSchedulingPlugin``: a scorer that consumes (and here may produce)."""

    type_name = "mock-scorer"

    def __init__(self, name: str, produces: Mapping[str, str] | None = None,
                 consumes: Mapping[str, str] | None = None) -> None:
        self.name = name
        if produces is not None:
            self.produces = produces
        if consumes is not None:
            self.consumes = consumes

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        return [0.0] * len(endpoints)


def names(plugins: Sequence[Any]) -> list[str]:
    return [p.name for p in plugins]


# ================================================================ data_graph_test.go

def test_validate_plugin_execution_order() -> None:
    """TestValidatePluginExecutionOrder."""
    a = PrepareData("A", produces={"keyA": "nil"})
    assert names(check_data_dependencies([a])) == ["A"]
    # A scheduling plugin may depend on a request-control plugin.
    consumer = SchedulingPlugin("MockSchedulingPlugin", consumes={"keyA": "nil"})
    assert names(check_data_dependencies([consumer, a])) == ["A", "MockSchedulingPlugin"]
    # The other way round is an invalid layer execution order (Go's case uses a
    # flow-control consumer of a request-control producer).
    producer = SchedulingPlugin("S", produces={"keyS": "int"})
    late = PrepareData("R", consumes={"keyS": "int"})
    with pytest.raises(DependencyError, match="invalid plugin layer execution order") as e:
        check_data_dependencies([producer, late])
    assert e.value.plugin is late


A = PrepareData("A", produces={"keyA": "nil"})
B = PrepareData("B", consumes={"keyA": "nil"}, produces={"keyB": "nil"})
C = PrepareData("C", consumes={"keyB": "nil"})
D = PrepareData("D", consumes={"keyA": "nil"})
E = PrepareData("E")  # no dependencies
X = PrepareData("X", produces={"keyX": "nil"}, consumes={"keyY": "nil"})
Y = PrepareData("Y", produces={"keyY": "nil"}, consumes={"keyX": "nil"})
Z1 = PrepareData("Z1", produces={"keyZ": "int"})
Z2 = PrepareData("Z2", consumes={"keyZ": "string"})


@pytest.mark.parametrize(("plugins", "after"), [
    ([], {}),                                               # No plugins
    ([A, E], {}),                                           # no dependencies
    ([C, B, A], {"B": ["A"], "C": ["B"]}),                  # linear C -> B -> A
    ([D, B, A, E], {"B": ["A"], "D": ["A"]}),               # B -> A, D -> A, E alone
])
def test_dag_and_topological_order(plugins: list[Any], after: dict[str, list[str]]) -> None:
    """TestDAGAndTopologicalOrder, the accepted graphs: every producer comes before its
    consumers."""
    order = names(check_data_dependencies(plugins))
    assert sorted(order) == sorted(p.name for p in plugins)
    for consumer, producers in after.items():
        for producer in producers:
            assert order.index(producer) < order.index(consumer)


def test_cycle_and_type_mismatch() -> None:
    """TestDAGAndTopologicalOrder, the rejected graphs."""
    with pytest.raises(DependencyError, match=r"data dependency cycle: 'X' reads 'keyY' from "
                       r"'Y', 'Y' reads 'keyX' from 'X' \(GIE: cycle detected"):
        check_data_dependencies([X, Y])
    with pytest.raises(DependencyError, match=r"data key 'keyZ': 'Z2' \(mock\) consumes it as "
                       r"string, but 'Z1' \(mock\) produces int \(GIE: data type mismatch"):
        check_data_dependencies([Z1, Z2])


def test_a_plugin_is_never_its_own_producer() -> None:
    both = PrepareData("both", produces={"k": "int"}, consumes={"k": "int"})
    assert names(check_data_dependencies([both])) == ["both"]


def test_layers() -> None:
    reg = default_registry()
    handle = PluginHandle()

    def layer(type_name: str) -> int:
        return execution_layer(reg.create(type_name, type_name, handle))

    assert layer("approx-prefix-cache-producer") == LAYER_REQUEST_CONTROL  # PreRequest
    assert layer("inflight-load-producer") == LAYER_REQUEST_CONTROL  # PreRequest (+ scorer)
    assert layer("session-affinity-scorer") == LAYER_REQUEST_CONTROL  # + ResponseHeader
    assert layer("queue-scorer") == LAYER_SCHEDULING
    assert layer("max-score-picker") == LAYER_SCHEDULING
    assert layer("metrics-data-source") == LAYER_DEFAULT


# ===================================== the built-in plugins declare what GIE's declare

# GIE v1.5.0's Produces()/Consumes() of the plugins this EPP implements (the Go files in
# the module docstring of epp/framework/interfaces.py's data keys): type → (produces,
# consumes). The Go declarations are values (``int(0)``, ``float64(0)``,
# ``map[string]int{}``, ``attrprefix.PrefixCacheMatchInfo{}``, ``&InFlightLoad{}``); here
# their type names.
GIE_DECLARATIONS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "approx-prefix-cache-producer": (
        {"PrefixCacheMatchInfoKey": "PrefixCacheMatchInfo"}, {}),
    "prefix-cache-scorer": ({}, {"PrefixCacheMatchInfoKey": "PrefixCacheMatchInfo"}),
    "inflight-load-producer": ({"InFlightLoadKey": "InFlightLoad"}, {}),
    "token-load-scorer": ({}, {"InFlightLoadKey": "InFlightLoad"}),
    "queue-scorer": ({}, {"WaitingQueueSize": "int"}),
    "kv-cache-utilization-scorer": ({}, {"KVCacheUsagePercent": "float64"}),
    "running-requests-size-scorer": ({}, {"RunningRequestsSize": "int"}),
    "lora-affinity-scorer": ({}, {"ActiveModels": "map[string]int",
                                  "WaitingModels": "map[string]int"}),
    "prefix-cache-affinity-filter": ({}, {
        "LatencyPredictionInfoKey": "LatencyPredictionInfo",
        "PrefixCacheMatchInfoKey": "PrefixCacheMatchInfo"}),
    "predicted-latency-producer": ({"LatencyPredictionInfoKey": "LatencyPredictionInfo"},
                                   {"PrefixCacheMatchInfoKey": "PrefixCacheMatchInfo"}),
    "predicted-latency-scorer": ({"LatencyPredictionInfoKey": "LatencyPredictionInfo"},
                                 {"PrefixCacheMatchInfoKey": "PrefixCacheMatchInfo"}),
    "latency-scorer": ({}, {"LatencyPredictionInfoKey": "LatencyPredictionInfo",
                            "PrefixCacheMatchInfoKey": "PrefixCacheMatchInfo"}),
    "slo-headroom-tier-filter": ({}, {"LatencyPredictionInfoKey": "LatencyPredictionInfo"}),
    "latency-slo-admitter": ({}, {"LatencyPredictionInfoKey": "LatencyPredictionInfo"}),
}


# The plugin types GIE v1.5.0's binary registers (cmd/epp/runner/runner.go,
# registerInTreePlugins): their declarations must be Go's. The project's own and llm-d's
# plugins (token-producer, precise-prefix-cache-producer, …) declare their own keys.
GIE_TYPES = frozenset({
    "prefix-cache-scorer", "max-score-picker", "random-picker", "weighted-random-picker",
    "single-profile-handler", "kv-cache-utilization-scorer", "queue-scorer",
    "running-requests-size-scorer", "lora-affinity-scorer", "token-load-scorer",
    "global-strict-fairness-policy", "round-robin-fairness-policy", "fcfs-ordering-policy",
    "edf-ordering-policy", "slo-deadline-ordering-policy", "static-usage-limit-policy",
    "approx-prefix-cache-producer", "predicted-latency-scorer", "predicted-latency-producer",
    "latency-slo-admitter", "prefix-cache-affinity-filter", "slo-headroom-tier-filter",
    "latency-scorer", "inflight-load-producer", "header-based-testing-filter",
    "destination-endpoint-served-verifier", "metrics-data-source", "core-metrics-extractor",
    "k8s-notification-source", "endpoint-notification-source", "request-attribute-reporter",
    "openai-parser", "vllmgrpc-parser", "passthrough-parser", "concurrency-detector",
    "utilization-detector",
})


def test_gie_types_are_all_registered() -> None:
    assert GIE_TYPES <= {cls.type_name for cls in BUILTIN_PLUGINS}


def test_builtin_declarations_are_gies() -> None:
    for cls in BUILTIN_PLUGINS:
        if cls.type_name not in GIE_TYPES:
            continue
        produces = dict(getattr(cls, "produces", {}))
        consumes = dict(getattr(cls, "consumes", {}))
        want = GIE_DECLARATIONS.get(cls.type_name, ({}, {}))
        assert (produces, consumes) == want, cls.type_name


def test_the_table_is_read_from_gies_source() -> None:
    """GIE's Go source (tests/fixtures/gie-v1.5.0): each Produces()/Consumes() map
    literal, its key constants resolved, is :data:`GIE_DECLARATIONS`'s entry."""
    plugins = GIE / "pkg/epp/framework/plugins"
    files = {
        "approx-prefix-cache-producer":
            "requestcontrol/dataproducer/approximateprefix/plugin.go",
        "prefix-cache-scorer": "scheduling/scorer/prefix/plugin.go",
        "inflight-load-producer": "requestcontrol/requestdataproducer/inflightload/producer.go",
        "token-load-scorer": "scheduling/scorer/tokenload/token_load.go",
        "queue-scorer": "scheduling/scorer/queuedepth/queue.go",
        "kv-cache-utilization-scorer": "scheduling/scorer/kvcacheutilization/"
                                       "kvcache_utilization.go",
        "running-requests-size-scorer": "scheduling/scorer/runningrequests/runningrequest.go",
        "lora-affinity-scorer": "scheduling/scorer/loraaffinity/lora_affinity.go",
        "prefix-cache-affinity-filter": "scheduling/filter/prefixcacheaffinity/plugin.go",
        "predicted-latency-producer":
            "requestcontrol/requestdataproducer/predictedlatency/preparedata_hooks.go",
        "predicted-latency-scorer": "scheduling/scorer/predictedlatency/preparedata_hooks.go",
        "latency-scorer": "scheduling/scorer/latency/plugin.go",
        "slo-headroom-tier-filter": "scheduling/filter/sloheadroomtier/plugin.go",
        "latency-slo-admitter": "requestcontrol/admitter/latencyslo/plugin.go",
    }
    constants: dict[str, str] = {}
    for path in ("datalayer/extractor/metrics/extractor.go",
                 "datalayer/attribute/concurrency/data_types.go",
                 "datalayer/attribute/latency/data_types.go",
                 "datalayer/attribute/prefix/data_types.go"):
        constants.update(re.findall(r"(\w+Key)\s*=\s*\"(\w+)\"",
                                    (plugins / path).read_text(encoding="utf-8")))
    go_types = {"int(0)": "int", "float64(0)": "float64", "map[string]int{}": "map[string]int"}
    for type_name, path in files.items():
        src = (plugins / path).read_text(encoding="utf-8")
        got: list[dict[str, str]] = []
        for method in ("Produces", "Consumes"):
            m = re.search(rf"\) {method}\(\) map\[string\]any \{{\s*return (.*?)\n\}}", src,
                          re.DOTALL)
            decl: dict[str, str] = {}  # no such method: declares nothing
            if m and m.group(1).strip() != "nil":
                for key, value in re.findall(r"(?:\w+\.)?(\w+Key):\s*([^,\n]+?),?\n",
                                             m.group(1) + "\n"):
                    value = value.strip().rstrip("}").strip()
                    decl[constants[key]] = go_types.get(
                        value, value.lstrip("&").split(".")[-1].rstrip("{}"))
            got.append(decl)
        assert (got[0], got[1]) == GIE_DECLARATIONS[type_name], type_name


# ======================================================== at config load (the loader)

class Maker:
    """A user plugin that produces and consumes what its parameters say (Python plugins
    declare ``produces``/``consumes`` as class or instance attributes)."""

    Parameters = NoParameters
    type_name = ""

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: Any, handle: PluginHandle) -> Any:
        return cls(name)


class TokensProducer(Maker):
    type_name = "tokens-producer"
    produces = MappingProxyType({"Tokens": "int"})

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        pass


class TokensAsFloatScorer(Maker):
    type_name = "tokens-float-scorer"
    consumes = MappingProxyType({"Tokens": "float64"})

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        return [0.0] * len(endpoints)


class ScoreMaker(Maker):
    """A scorer that produces data a request-control plugin reads: wrong order."""

    type_name = "score-maker"
    produces = MappingProxyType({"Late": "int"})

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        return [0.0] * len(endpoints)


class LateReader(Maker):
    type_name = "late-reader"
    consumes = MappingProxyType({"Late": "int"})

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        pass


class PingPlugin(Maker):
    type_name = "ping"
    produces = MappingProxyType({"Ping": "int"})
    consumes = MappingProxyType({"Pong": "int"})

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        pass


class PongPlugin(Maker):
    type_name = "pong"
    produces = MappingProxyType({"Pong": "int"})
    consumes = MappingProxyType({"Ping": "int"})

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        pass


def registry() -> Registry:
    reg = default_registry()
    for cls in (TokensProducer, TokensAsFloatScorer, ScoreMaker, LateReader, PingPlugin,
                PongPlugin):
        reg.register_class(cls)
    return reg


def load(text: str) -> BuiltConfig:
    return build(parse_config(text, "cfg.yaml"), registry())


def rejected(text: str, *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(text)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, msg
    return msg


def test_loader_fails_as_go_fails() -> None:
    rejected("""
        plugins: [{type: tokens-producer}, {type: tokens-float-scorer}]
    """, "cfg.yaml: plugins[1]: data key 'Tokens': 'tokens-float-scorer' "
         "(tokens-float-scorer) consumes it as float64, but 'tokens-producer' "
         "(tokens-producer) produces int (GIE: data type mismatch between produced and "
         "consumed data for key: Tokens); make the types agree, or remove one")
    rejected("""
        plugins: [{type: score-maker}, {type: late-reader}]
    """, "cfg.yaml: plugins[1]: 'late-reader' (late-reader) (request control) consumes "
         "'Late', produced by 'score-maker' (score-maker) (scheduling), which runs after it",
         "invalid plugin layer execution order")
    rejected("""
        plugins: [{type: queue-scorer}, {type: ping}, {type: pong}]
    """, "cfg.yaml: plugins: data dependency cycle: 'ping' reads 'Pong' from 'pong', "
         "'pong' reads 'Ping' from 'ping'", "cycle detected: graph is not a DAG")
    # A user plugin that consumes a built-in's key with GIE's type is fine; with another
    # type it is not.
    load("""
        plugins:
        - {type: approx-prefix-cache-producer}
        - {type: prefix-cache-scorer}
    """)


def test_consumed_data_needs_no_producer() -> None:
    """As in GIE: queue-scorer consumes WaitingQueueSize, which no plugin declares it
    produces (the data layer's extractors are not producers), and loads."""
    built = load("plugins: [{type: queue-scorer}, {type: tokens-float-scorer}]\n")
    assert "queue-scorer" in built.plugins


def test_inflight_producer_with_token_load_scorer_loads() -> None:
    """GIE v1.5.0 compares the pointers ``&InFlightLoad{}`` and rejects this pair (fixed
    after v1.5.0, GIE #2819); here the types are names and it loads."""
    built = load("""
        plugins: [{type: inflight-load-producer}, {type: token-load-scorer}]
    """)
    assert built.plugins["token-load-scorer"].producer is built.plugins[  # type: ignore[attr-defined]
        "inflight-load-producer"]


def test_injected_producers_are_checked_too() -> None:
    """The producer prefix-cache-scorer creates (GIE: the one the loader injects) is a
    plugin of the config: a consumer of its key with another type fails."""
    reg = registry()

    class WrongPrefix(Maker):
        type_name = "wrong-prefix"
        consumes = MappingProxyType({fw.DATA_KEY_PREFIX_CACHE_MATCH_INFO: "int"})

        def score(self, state: CycleState, request: LLMRequest,
                  endpoints: Sequence[Endpoint]) -> Sequence[float]:
            return [0.0] * len(endpoints)

    reg.register_class(WrongPrefix)
    with pytest.raises(ConfigError, match=r"plugins\[1\]: data key 'PrefixCacheMatchInfoKey': "
                       r"'wrong-prefix' \(wrong-prefix\) consumes it as int, but "
                       r"'prefix-cache-scorer-producer' \(approx-prefix-cache-producer\)"):
        build(parse_config("plugins: [{type: prefix-cache-scorer}, {type: wrong-prefix}]\n",
                           "cfg.yaml"), reg)


def test_shipped_configs_load() -> None:
    """Every config under config/ (and the built-in default) passes the check."""
    from epp.config.loader import load_and_build

    for path in sorted((ROOT / "config").glob("*.yaml")):
        load_and_build(str(path))
    load_and_build()


def test_declarations_module_names_gies_keys() -> None:
    """The DATA_KEY_* constants are GIE's key strings."""
    tree = ast.parse((ROOT / "epp/framework/interfaces.py").read_text(encoding="utf-8"))
    keys = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name) and t.id.startswith("DATA_KEY_")
            and isinstance(n.value, ast.Constant)}
    assert set(keys.values()) == {k for p, c in GIE_DECLARATIONS.values() for k in {**p, **c}}
