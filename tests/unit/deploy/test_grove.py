"""deploy/grove/: the manifests parse, the HPAs scale Grove PodCliques on metrics the EPP
really exports, through the prometheus-adapter rule, and sim commands are real flags."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epp.datastore.store import Datastore
from epp.observability.metrics import EppMetrics

ROOT = Path(__file__).resolve().parents[3]
GROVE = ROOT / "deploy" / "grove"


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((GROVE / name).read_text()) if d is not None]


def exported() -> dict[str, set[str]]:
    """EPP metric name → its label names (as scraped)."""
    out: dict[str, set[str]] = {}
    m = EppMetrics(Datastore(), "llm-pool")
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def pcs_clique_names(doc: dict[str, Any]) -> set[str]:
    """PodClique names Grove creates: <pcs>-<replica>-<clique> (standalone cliques)."""
    name = doc["metadata"]["name"]
    cliques = [c["name"] for c in doc["spec"]["template"]["cliques"]]
    return {f"{name}-{i}-{c}" for i in range(doc["spec"]["replicas"]) for c in cliques}


def check_external_metric(spec: dict[str, Any], metrics: dict[str, set[str]]) -> str:
    assert spec["type"] == "External"
    m = spec["external"]["metric"]
    assert m["name"] in metrics, m["name"]
    sel = m["selector"]["matchLabels"]
    assert set(sel) <= metrics[m["name"]], (sel, metrics[m["name"]])
    assert sel["role"] in ("prefill", "decode")
    target = spec["external"]["target"]
    assert target["type"] == "Value" and str(target["value"])
    return str(sel["role"])


def test_every_grove_manifest_parses() -> None:
    files = sorted(GROVE.glob("*.yaml"))
    assert {f.name for f in files} >= {"podcliqueset.yaml", "podcliqueset-autoscaling.yaml",
                                        "hpa-prefill.yaml", "hpa-decode.yaml",
                                        "prometheus-adapter.yaml"}
    for f in files:
        assert docs(f.name), f


def test_hpas_scale_grove_cliques_on_epp_role_metrics() -> None:
    metrics = exported()
    (pcs,) = docs("podcliqueset.yaml")
    assert pcs["apiVersion"] == "grove.io/v1alpha1" and pcs["kind"] == "PodCliqueSet"
    cliques = pcs_clique_names(pcs)
    roles = {c["name"]: c["labels"]["llm-d.ai/role"] for c in pcs["spec"]["template"]["cliques"]}
    assert roles == {"prefill": "prefill", "decode": "decode"}
    for name, role in (("hpa-prefill.yaml", "prefill"), ("hpa-decode.yaml", "decode")):
        (hpa,) = docs(name)
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["kind"] == "HorizontalPodAutoscaler"
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["apiVersion"] == "grove.io/v1alpha1" and ref["kind"] == "PodClique"
        assert ref["name"] in cliques and ref["name"].endswith(f"-{role}")
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert {check_external_metric(m, metrics) for m in hpa["spec"]["metrics"]} == {role}


def test_grove_autoscaling_config_variant() -> None:
    metrics = exported()
    (pcs,) = docs("podcliqueset-autoscaling.yaml")
    for clique in pcs["spec"]["template"]["cliques"]:
        cfg = clique["spec"]["autoScalingConfig"]
        assert 1 <= cfg["minReplicas"] <= cfg["maxReplicas"]
        role = clique["labels"]["llm-d.ai/role"]
        assert {check_external_metric(m, metrics) for m in cfg["metrics"]} == {role}


def test_prometheus_adapter_rule_serves_the_role_gauges() -> None:
    metrics = exported()
    (values,) = docs("prometheus-adapter.yaml")
    (rule,) = values["rules"]["external"]
    pattern = re.search(r'__name__=~"(.+?)"', rule["seriesQuery"]).group(1)  # type: ignore[union-attr]
    served = {m for m in metrics if re.fullmatch(pattern, m)}
    assert served == {"epp_role_average_queue_size", "epp_role_average_kv_cache_utilization",
                      "epp_role_average_running_requests", "epp_role_ready_pods"}
    used = set()
    for name in ("hpa-prefill.yaml", "hpa-decode.yaml"):
        for m in docs(name)[0]["spec"]["metrics"]:
            used.add(m["external"]["metric"]["name"])
    assert used <= served
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_sim_commands_use_real_flags() -> None:
    out = subprocess.run([sys.executable, "-m", "epp.cli", "sim", "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=60, check=True).stdout
    flags = set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", out))
    for name in ("podcliqueset.yaml", "podcliqueset-autoscaling.yaml"):
        for clique in docs(name)[0]["spec"]["template"]["cliques"]:
            (container,) = clique["spec"]["podSpec"]["containers"]
            cmd = container["command"]
            assert cmd[:2] == ["epp", "sim"]
            for a in cmd[2:]:
                if a.startswith("--"):
                    assert a in flags, a
            assert cmd[cmd.index("--role") + 1] == clique["labels"]["llm-d.ai/role"]
