"""The shipped RBAC lets pool mode list and watch InferenceObjectives and
InferenceModelRewrites (as GIE v1.5.0's charts grant), read-only, in the pool's namespace;
standalone mode watches neither and the chart grants neither."""

from __future__ import annotations

from typing import Any

from epp import keys
from tests.unit.deploy.test_manifests import DEPLOY, _by_kind, _docs, _render

GROUP = keys.K8S_OBJECTIVE_API_VERSION.split("/")[0]
RESOURCES = {keys.K8S_OBJECTIVE_PLURAL, keys.K8S_MODEL_REWRITE_PLURAL}


def _granted(role: dict[str, Any]) -> dict[str, set[str]]:
    """resource -> verbs the Role grants on it in the objectives' group."""
    out: dict[str, set[str]] = {}
    for rule in role["rules"]:
        if GROUP in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault(res, set()).update(rule["verbs"])
    return out


def test_plain_manifests_grant_list_and_watch() -> None:
    (role,) = _by_kind(_docs(DEPLOY / "kubernetes/epp.yaml"), "Role")
    assert _granted(role) == {r: {"get", "list", "watch"} for r in RESOURCES}


def test_helm_chart_grants_them_in_pool_mode_only() -> None:
    (role,) = _by_kind(_render(), "Role")
    assert role["metadata"]["namespace"] == "default"  # namespaced, the pool's namespace
    assert _granted(role) == {r: {"get", "list", "watch"} for r in RESOURCES}
    (role,) = _by_kind(_render("--set", "standalone.selector=app=vllm",
                               "--set", "standalone.targetPorts=8000"), "Role")
    assert _granted(role) == {}
