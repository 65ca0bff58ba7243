"""The InferenceObjective / InferenceModelRewrite store: precedence, weighted targets,
priorities, and parsing the CRDs' objects.

The precedence cases translate GIE v1.5.0's pkg/epp/datastore/modelrewritestore_test.go
(``TestModelRewriteStore``), the weighted choice its pkg/epp/requestcontrol/director_test.go
(``TestDirector_SelectWeightedModel``); the field coverage is checked against GIE's CRDs
(tests/fixtures/gie-v1.5.0/config/crd/bases/).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp import keys
from epp.datastore.objectives import (
    DEFAULT_PRIORITY,
    InvalidObject,
    ModelRewrite,
    Objective,
    ObjectiveStore,
    PoolRef,
    RewriteRule,
    TargetModel,
    parse_object,
    selects_pool,
)

CRDS = Path(__file__).resolve().parents[2] / "fixtures/gie-v1.5.0/config/crd/bases"
NOW = 1_700_000_000.0
MINUTE_AGO = NOW - 60


def exact(model: str, *targets: str | tuple[str, int]) -> RewriteRule:
    return RewriteRule((model,), _targets(targets))


def generic(*targets: str | tuple[str, int]) -> RewriteRule:
    return RewriteRule((), _targets(targets), generic=True)


def _targets(targets: tuple[str | tuple[str, int], ...]) -> tuple[TargetModel, ...]:
    return tuple(TargetModel(t) if isinstance(t, str) else TargetModel(*t) for t in targets)


# Go's fixtures: ruleModel1V1, ruleModel1V2, ruleGeneric and the rewrites holding them.
RULE_V1 = exact("model1", "model1-v1")
RULE_V2 = exact("model1", "model1-v2")
RULE_GENERIC = generic("generic-fallback")
OLD = ModelRewrite("rewrite-old", (RULE_V1,), MINUTE_AGO)
NEW = ModelRewrite("rewrite-new", (RULE_V2,), NOW)
GENERIC_OLD = ModelRewrite("rewrite-generic-old", (RULE_GENERIC,), MINUTE_AGO)
GENERIC_NEW = ModelRewrite("rewrite-generic-new", (generic("new-generic"),), NOW)
UPDATED = ModelRewrite("rewrite-old", (RULE_V2,), NOW)  # same name as OLD


GIE_CASES = {  # name: (initial state, operation, model, rule, rewrite name, all names)
    "Simple exact match": ([OLD], None, "model1", RULE_V1, "rewrite-old", ["rewrite-old"]),
    "Simple generic match": ([GENERIC_OLD], None, "model2", RULE_GENERIC,
                             "rewrite-generic-old", ["rewrite-generic-old"]),
    "No match": ([OLD], None, "model2", None, "", ["rewrite-old"]),
    "Precedence: Exact match wins over generic": (
        [OLD, GENERIC_OLD], None, "model1", RULE_V1, "rewrite-old",
        ["rewrite-generic-old", "rewrite-old"]),
    "Precedence: Fallback to generic when no exact match": (
        [OLD, GENERIC_OLD], None, "model2", RULE_GENERIC, "rewrite-generic-old",
        ["rewrite-generic-old", "rewrite-old"]),
    "Precedence: Oldest exact match wins": (
        [NEW, OLD], None, "model1", RULE_V1, "rewrite-old", ["rewrite-new", "rewrite-old"]),
    "Precedence: Oldest generic match wins": (
        [GENERIC_NEW, GENERIC_OLD], None, "any-model", RULE_GENERIC, "rewrite-generic-old",
        ["rewrite-generic-new", "rewrite-generic-old"]),
    "Delete: successfully deletes a rewrite": (
        [OLD, GENERIC_OLD], "delete rewrite-old", "model1", RULE_GENERIC,
        "rewrite-generic-old", ["rewrite-generic-old"]),
    "Delete: non-existent rewrite does nothing": (
        [OLD], "delete non-existent", "model1", RULE_V1, "rewrite-old", ["rewrite-old"]),
    "Update: Setting a rewrite with the same name replaces the old one": (
        [OLD], "set updated", "model1", RULE_V2, "rewrite-old", ["rewrite-old"]),
}


@pytest.mark.parametrize("case", list(GIE_CASES))
def test_model_rewrite_store_gie_cases(case: str) -> None:
    """GIE's TestModelRewriteStore, case by case (same names)."""
    initial, op, model, want_rule, want_name, want_all = GIE_CASES[case]
    store = ObjectiveStore()
    for rw in initial:
        store.set_rewrite(rw)
    if op == "delete rewrite-old":
        assert store.delete_rewrite("rewrite-old")
    elif op == "delete non-existent":
        assert not store.delete_rewrite("non-existent")
    elif op == "set updated":
        store.set_rewrite(UPDATED)
    got = store.rule_for(model)
    assert (got[0] if got else None) == want_rule
    assert (got[1] if got else "") == want_name
    assert sorted(r.name for r in store.rewrites()) == want_all


def test_first_rule_in_list_order_wins_within_a_rewrite() -> None:
    store = ObjectiveStore()
    first, second = exact("m", "first"), exact("m", "second")
    store.set_rewrite(ModelRewrite("rw", (generic("g"), first, second)))
    assert store.rule_for("m") == (first, "rw")
    assert store.rewrite("m") == ("first", "rw")
    assert store.rewrite("other") == ("g", "rw")  # the generic rule


def test_a_rule_matches_any_of_its_models() -> None:
    store = ObjectiveStore()
    rule = RewriteRule(("a", "b"), (TargetModel("t"),))
    store.set_rewrite(ModelRewrite("rw", (rule,)))
    assert store.rewrite("a") == ("t", "rw") == store.rewrite("b")
    assert store.rewrite("c") is None


def test_same_second_ties_go_to_file_order_then_name() -> None:
    store = ObjectiveStore()
    store.replace_rewrites([ModelRewrite("b", (exact("m", "from-b"),), NOW, order=0),
                            ModelRewrite("a", (exact("m", "from-a"),), NOW, order=1)])
    assert store.rewrite("m") == ("from-b", "b")
    store.replace_rewrites([ModelRewrite("b", (exact("m", "from-b"),), NOW),
                            ModelRewrite("a", (exact("m", "from-a"),), NOW)])
    assert store.rewrite("m") == ("from-a", "a")  # Kubernetes objects: by name


def test_a_winning_rule_without_targets_keeps_the_model() -> None:
    """GIE would rewrite to an empty model; here the rule still wins (the generic rule
    does not apply) and the model stays."""
    store = ObjectiveStore()
    store.replace_rewrites([ModelRewrite("none", (RewriteRule(("m",)),), MINUTE_AGO),
                            ModelRewrite("g", (generic("fallback"),), NOW)])
    assert store.rule_for("m") is not None
    assert store.rewrite("m") is None
    assert store.rewrite("other") == ("fallback", "g")


def test_a_match_without_a_model_matches_nothing_and_is_not_generic() -> None:
    obj = _rewrite_obj([{"matches": [{}], "targets": [{"modelRewrite": "t"}]}])
    rw = parse_object(obj, "x", strict=False)
    assert isinstance(rw, ModelRewrite)
    assert rw.rules[0] == RewriteRule((), (TargetModel("t"),), generic=False)
    store = ObjectiveStore()
    store.set_rewrite(rw)
    assert store.rule_for("anything") is None


@pytest.mark.parametrize(("targets", "possible"), [
    ([("model-a", 100)], {"model-a"}),
    ([("model-a", 50), ("model-b", 50)], {"model-a", "model-b"}),
    ([("model-x", 70), ("model-y", 30)], {"model-x", "model-y"}),
    ([("model-z1", 0), ("model-z2", 0)], {"model-z1", "model-z2"}),
], ids=["single target", "equal weights", "different weights", "zero total weight"])
def test_select_weighted_model(targets: list[tuple[str, int]], possible: set[str]) -> None:
    """GIE's TestDirector_SelectWeightedModel: 1000 picks, each share within 20% of its
    weight's (an equal share when no target has a weight)."""
    store = ObjectiveStore(rng=random.Random(7))
    rule = RewriteRule(("m",), tuple(TargetModel(m, w) for m, w in targets))
    runs = 1000
    counts = Counter(store.choose_target(rule) for _ in range(runs))
    assert set(counts) <= possible
    total = sum(w for _, w in targets)
    if len(targets) > 1:
        for model, weight in targets:
            want = runs / len(targets) if total == 0 else runs * weight / total
            assert abs(counts[model] - want) <= want * 0.2, (model, counts)


def test_unweighted_targets_among_weighted_ones_are_never_picked() -> None:
    store = ObjectiveStore(rng=random.Random(1))
    rule = RewriteRule(("m",), (TargetModel("w", 5), TargetModel("unweighted")))
    assert {store.choose_target(rule) for _ in range(200)} == {"w"}
    assert store.choose_target(RewriteRule(("m",))) is None


def test_priorities_and_gies_default() -> None:
    store = ObjectiveStore()
    store.replace_objectives([Objective("critical", 10), Objective("sheddable", -1),
                              Objective("unset")])
    assert store.priority("critical") == 10
    assert store.priority("sheddable") == -1
    assert store.priority("unset") == DEFAULT_PRIORITY == 0
    assert store.priority("unknown") == 0
    assert store.priority(None) == 0 and store.priority("") == 0
    assert store.objective("critical") == Objective("critical", 10)
    assert store.delete_objective("critical") and store.priority("critical") == 0
    assert not store.delete_objective("critical")


def test_listeners_hear_changes_only() -> None:
    store = ObjectiveStore()
    calls: list[int] = []
    unsubscribe = store.on_change(lambda: calls.append(store.version))
    assert store.replace_objectives([Objective("a", 1)])
    assert not store.replace_objectives([Objective("a", 1)])  # unchanged: no call
    store.set_objective(Objective("a", 1))
    store.set_rewrite(OLD)
    store.set_rewrite(OLD)
    assert not store.replace(store.objectives(), store.rewrites())
    assert calls == [1, 2]

    def broken() -> None:
        raise RuntimeError("listener bug")
    store.on_change(broken)
    unsubscribe()
    assert store.replace([], [])  # a raising listener is logged, the change stays
    assert len(store) == 0 and calls == [1, 2]


def test_export_and_load_round_trip() -> None:
    """What the core sends its --workers fronts."""
    src = ObjectiveStore()
    src.replace([Objective("p", 3), Objective("q")],
                [OLD, GENERIC_NEW, ModelRewrite("w", (exact("c", ("c1", 70), ("c2", 30)),),
                                                NOW, order=2)])
    dst = ObjectiveStore()
    assert dst.load(src.export())
    assert dst.priority("p") == 3 and dst.objective("q") == Objective("q")
    for model in ("model1", "c", "other"):
        assert dst.rule_for(model) == src.rule_for(model)
    assert not dst.load(src.export())
    assert dst.load({}) and len(dst) == 0


# ------------------------------------------------------------------------------ parsing
def _objective_obj(spec: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return {"apiVersion": keys.K8S_OBJECTIVE_API_VERSION, "kind": "InferenceObjective",
            "metadata": {"name": "o", **meta}, "spec": spec}


def _rewrite_obj(rules: Any, pool: str | None = "pool", **meta: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"rules": rules}
    if pool is not None:
        spec["poolRef"] = {"name": pool}
    return {"apiVersion": keys.K8S_OBJECTIVE_API_VERSION, "kind": "InferenceModelRewrite",
            "metadata": {"name": "rw", **meta}, "spec": spec}


# Every field of the two CRDs' spec, once (the drift test below checks the list).
FULL_OBJECTIVE = _objective_obj({"priority": -5, "poolRef": {
    "group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pool"}})
FULL_REWRITE = _rewrite_obj([
    {"matches": [{"model": {"type": "Exact", "value": "llama"}}],
     "targets": [{"modelRewrite": "llama-v2", "weight": 90},
                 {"modelRewrite": "llama-v3", "weight": 10}]},
    {"targets": [{"modelRewrite": "fallback"}]},
], creationTimestamp="2025-06-01T12:00:00Z")
FULL_REWRITE["spec"]["poolRef"] = {"group": "inference.networking.k8s.io",
                                   "kind": "InferencePool", "name": "pool"}


def _paths(value: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(prefix + k)
            out |= _paths(v, prefix + k + ".")
    elif isinstance(value, list):
        for v in value:
            out |= _paths(v, prefix.rstrip(".") + "[].")
    return out


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in (schema.get("properties") or {}).items():
        out.add(prefix + k)
        if v.get("type") == "array":
            out |= _schema_paths(v.get("items") or {}, prefix + k + "[].")
        else:
            out |= _schema_paths(v, prefix + k + ".")
    return out


@pytest.mark.parametrize(("crd", "full"), [
    ("inference.networking.x-k8s.io_inferenceobjectives.yaml", FULL_OBJECTIVE),
    ("inference.networking.x-k8s.io_inferencemodelrewrites.yaml", FULL_REWRITE),
])
def test_every_crd_spec_field_parses(crd: str, full: dict[str, Any]) -> None:
    doc = yaml.safe_load((CRDS / crd).read_text())
    (version,) = doc["spec"]["versions"]
    assert doc["spec"]["group"] + "/" + version["name"] == keys.K8S_OBJECTIVE_API_VERSION
    assert doc["spec"]["names"]["kind"] == full["kind"]
    assert doc["spec"]["names"]["plural"] in (keys.K8S_OBJECTIVE_PLURAL,
                                              keys.K8S_MODEL_REWRITE_PLURAL)
    spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert _schema_paths(spec_schema) == _paths(full["spec"])
    parse_object(full, "crd", strict=True)  # the strict (file) parser takes all of them


def test_parse_objective_with_the_crd_defaults() -> None:
    o = parse_object(FULL_OBJECTIVE, "x", strict=True)
    assert o == Objective("o", -5, PoolRef("pool"))
    bare = parse_object(_objective_obj({"poolRef": {"name": "pool"}}), "x", strict=True)
    assert bare == Objective("o", None, PoolRef("pool", keys.K8S_POOL_GROUP, "InferencePool"))
    assert isinstance(bare, Objective) and bare.effective_priority == 0


def test_parse_model_rewrite() -> None:
    rw = parse_object(FULL_REWRITE, "x", strict=True)
    assert rw == ModelRewrite(
        "rw", (RewriteRule(("llama",), (TargetModel("llama-v2", 90),
                                        TargetModel("llama-v3", 10))),
               RewriteRule((), (TargetModel("fallback"),), generic=True)),
        created=1748779200.0, pool_ref=PoolRef("pool"))


def test_yaml_decoded_timestamps() -> None:
    """YAML turns an unquoted timestamp into a datetime."""
    doc = yaml.safe_load("apiVersion: inference.networking.x-k8s.io/v1alpha2\n"
                         "kind: InferenceModelRewrite\n"
                         "metadata: {name: rw, creationTimestamp: 2025-06-01T12:00:00Z}\n"
                         "spec: {rules: []}\n")
    rw = parse_object(doc, "x", strict=True, require_pool_ref=False)
    assert isinstance(rw, ModelRewrite) and rw.created == 1748779200.0


@pytest.mark.parametrize(("obj", "message"), [
    ({**FULL_OBJECTIVE, "apiVersion": "inference.networking.k8s.io/v1"}, "apiVersion"),
    ({**FULL_OBJECTIVE, "kind": "InferenceModel"}, "kind: expected InferenceObjective"),
    ({**FULL_OBJECTIVE, "metadata": {}}, "metadata.name"),
    ({**FULL_OBJECTIVE, "extra": 1}, "unknown field(s) ['extra']"),
    (_objective_obj({"priority": "high", "poolRef": {"name": "p"}}), "spec.priority"),
    (_objective_obj({"priority": True, "poolRef": {"name": "p"}}), "spec.priority"),
    (_objective_obj({"priority": 1}), "spec.poolRef: required"),
    (_objective_obj({"poolRef": {"name": "p"}, "targetModels": []}),
     "spec: unknown field(s) ['targetModels']"),
    (_objective_obj({"poolRef": {"name": ""}}), "spec.poolRef.name"),
    (_objective_obj({"poolRef": {"name": "p", "group": "Bad/Group"}}), "spec.poolRef.group"),
    (_objective_obj({"poolRef": {"name": "p"}}, creationTimestamp="yesterday"),
     "creationTimestamp"),
    (_rewrite_obj(None), "spec.rules: required"),
    (_rewrite_obj({"a": 1}), "spec.rules: expected a list"),
    (_rewrite_obj([{"matches": [{"model": {"value": "m", "type": "Prefix"}}],
                    "targets": [{"modelRewrite": "t"}]}]), "spec.rules[0].matches[0].model.type"),
    (_rewrite_obj([{"matches": [{"model": {"value": ""}}]}]), "model.value"),
    (_rewrite_obj([{"matches": [{}]}]), "spec.rules[0].matches[0].model: required"),
    (_rewrite_obj([{"targets": []}]), "spec.rules[0].targets: at least one target"),
    (_rewrite_obj([{"targets": [{"weight": 1}]}]), "targets[0].modelRewrite"),
    (_rewrite_obj([{"targets": [{"modelRewrite": "t", "weight": 0}]}]),
     "targets[0].weight: expected an integer 1..1000000"),
    (_rewrite_obj([{"targets": [{"modelRewrite": "t", "weight": 1_000_001}]}]), "weight"),
    (_rewrite_obj([{"targets": [{"modelRewrite": "t", "wieght": 1}]}]),
     "targets[0]: unknown field(s) ['wieght']"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_strict_parse_errors_name_the_field(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidObject) as e:
        parse_object(obj, "f.yaml: document 1", strict=True)
    assert "f.yaml: document 1" in str(e.value)
    assert message in str(e.value), str(e.value)


def test_lenient_parse_ignores_what_the_api_server_would_prune() -> None:
    """Objects from the API server: unknown fields (GIE's own hermetic test data still
    has ``targetModels``) are ignored; a missing poolRef is no error (it selects no pool)."""
    obj = _objective_obj({"priority": 2, "poolRef": {"name": "p"},
                          "targetModels": [{"name": "x", "weight": 100}]})
    assert parse_object(obj, "x", strict=False) == Objective("o", 2, PoolRef("p"))
    no_ref = parse_object(_rewrite_obj([], pool=None), "x", strict=False)
    assert isinstance(no_ref, ModelRewrite) and no_ref.pool_ref is None
    with pytest.raises(InvalidObject):  # a wrong type is still an error
        parse_object(_objective_obj({"priority": "x"}), "x", strict=False)


def test_pool_selection_is_gies_predicate() -> None:
    assert selects_pool(PoolRef("pool"), "pool", keys.K8S_POOL_GROUP)
    assert not selects_pool(PoolRef("other"), "pool", keys.K8S_POOL_GROUP)
    assert not selects_pool(PoolRef("pool", keys.K8S_POOL_GROUP_ALPHA), "pool",
                            keys.K8S_POOL_GROUP)
    assert selects_pool(PoolRef("pool", keys.K8S_POOL_GROUP, "Whatever"), "pool",
                        keys.K8S_POOL_GROUP)  # GIE compares name and group only
    assert not selects_pool(None, "pool", keys.K8S_POOL_GROUP)
