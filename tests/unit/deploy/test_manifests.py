"""deploy/: manifests parse, the Helm chart renders (with Helm's own engine) and lints,
and every container argument is a flag `epp serve` / `epp sim` really accepts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.cli import build_parser
from epp.config.loader import load_and_build

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
RENDER = DEPLOY / "helm" / "render.py"


def _help_flags(*command: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "epp.cli", *command, "--help"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    return set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", out.stdout))


@pytest.fixture(scope="module")
def serve_flags() -> set[str]:
    return _help_flags("serve")


@pytest.fixture(scope="module")
def sim_flags() -> set[str]:
    return _help_flags("sim")


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _render(*args: str) -> list[dict[str, Any]]:
    """`helm template` through deploy/helm/render.py, in a subprocess (keeps the Go
    runtime of helm-python-sdk out of the test process)."""
    r = subprocess.run([sys.executable, str(RENDER), *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d is not None]


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _check_args(args: list[str], flags: set[str], command: str) -> None:
    for a in args:
        if a.startswith("--"):
            assert a.split("=", 1)[0] in flags, f"`epp {command}` does not accept {a}"


def _check_deployment(dep: dict[str, Any], serve_flags: set[str]) -> list[str]:
    """Cross-check the EPP container's args against `epp serve --help`, and parse them
    with the real argument parser; returns the args."""
    (container,) = [c for c in dep["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "epp"]
    args = [str(a) for a in container["args"]]
    _check_args(args, serve_flags, "serve")
    build_parser().parse_args(["serve", *args])  # values parse too (types, choices)
    probes = {p: container[p]["grpc"] for p in ("livenessProbe", "readinessProbe")}
    health = [a for a in args if a.startswith("--grpc-health-port=")]
    port = int(health[0].split("=")[1]) if health else 9003
    assert probes["livenessProbe"] == {"port": port, "service": "liveness"}
    assert probes["readinessProbe"] == {"port": port, "service": "readiness"}
    return args


def test_every_manifest_parses() -> None:
    files = sorted(DEPLOY.glob("kubernetes/*.yaml")) + sorted(DEPLOY.glob("gateways/*.yaml"))
    assert len(files) >= 7
    for f in files:
        docs = _docs(f)
        assert docs, f
        for d in docs:
            assert {"apiVersion", "kind", "metadata"} <= set(d), (f, d)
            assert d["metadata"].get("name"), (f, d)
    for f in (DEPLOY / "helm/epp/Chart.yaml", DEPLOY / "helm/epp/values.yaml"):
        assert yaml.safe_load(f.read_text())


def test_plain_manifests(serve_flags: set[str], sim_flags: set[str]) -> None:
    docs = _docs(DEPLOY / "kubernetes/epp.yaml")
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["ServiceAccount", "Role", "RoleBinding", "ClusterRole",
                            "ClusterRoleBinding", "ConfigMap", "Deployment", "Service"])
    args = _check_deployment(_by_kind(docs, "Deployment")[0], serve_flags)
    assert "--pool-name=vllm-pool" in args and "--ha-enable-leader-election=true" in args
    # RBAC: read-only on what discovery reads; the Lease is the only thing written.
    role = _by_kind(docs, "Role")[0]
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"])
             for r in role["rules"]}
    assert rules == {(("",), ("pods",)): {"get", "list", "watch"},
                     (("inference.networking.k8s.io",), ("inferencepools",)):
                         {"get", "list", "watch"},
                     (("inference.networking.x-k8s.io",),
                      ("inferenceobjectives", "inferencemodelrewrites")):
                         {"get", "list", "watch"},
                     (("scheduler.grove.io",), ("podgangs",)): {"get", "list", "watch"},
                     (("coordination.k8s.io",), ("leases",)): {"get", "create", "update"}}
    assert _by_kind(docs, "ClusterRole")[0]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    svc = _by_kind(docs, "Service")[0]
    assert sorted(p["port"] for p in svc["spec"]["ports"]) == [9002, 9090]
    # The EndpointPickerConfig in the ConfigMap is valid.
    load_and_build(None, _by_kind(docs, "ConfigMap")[0]["data"]["config.yaml"])
    # The pool points at the EPP Service.
    (pool,) = _docs(DEPLOY / "kubernetes/inferencepool.yaml")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["endpointPickerRef"]["name"] == svc["metadata"]["name"]
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == 9002
    # The simulated model servers: selected by the pool, `epp sim` flags that exist.
    (sim,) = _docs(DEPLOY / "kubernetes/sim-model-servers.yaml")
    labels = sim["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    command = sim["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["epp", "sim"]
    _check_args(command[2:], sim_flags, "sim")


def test_gateway_snippets_route_to_the_pool() -> None:
    for name in ("envoy-gateway", "istio", "kgateway"):
        docs = _docs(DEPLOY / f"gateways/{name}.yaml")
        (route,) = _by_kind(docs, "HTTPRoute")
        (ref,) = route["spec"]["rules"][0]["backendRefs"]
        assert ref == {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                       "name": "vllm-pool"}
        assert _by_kind(docs, "Gateway")
    (dr,) = _by_kind(_docs(DEPLOY / "gateways/istio.yaml"), "DestinationRule")
    assert dr["spec"]["host"] == "vllm-pool-epp"
    cm = _by_kind(_docs(DEPLOY / "gateways/envoy-standalone.yaml"), "ConfigMap")[0]
    envoy = yaml.safe_load(cm["data"]["envoy.yaml"])
    clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
    assert clusters["original_destination_cluster"]["original_dst_lb_config"][
        "http_header_name"] == "x-gateway-destination-endpoint"
    assert clusters["epp"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"] == {"address": "vllm-pool-epp",
                                                     "port_value": 9002}
    # The standalone gateway ships the default (lean) gateway shape, exactly as the tested
    # template renders it.
    from epp.stack.envoy import render_envoy_config

    def ext_proc_mode(doc: dict[str, object]) -> object:
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0][  # type: ignore[index]
            "filters"][0]["typed_config"]
        (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
        return ext_proc["typed_config"]["processing_mode"]
    rendered = yaml.safe_load(render_envoy_config(listen_port=1, epp_port=2, admin_port=3))
    assert ext_proc_mode(envoy) == ext_proc_mode(rendered)
    assert ext_proc_mode(envoy)["response_body_mode"] == "NONE"  # type: ignore[index]


def test_dockerfile() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["epp", "serve"]' in text
    assert re.search(r"^EXPOSE 9002 9003 9090$", text, re.MULTILINE)
    for src in re.findall(r"^COPY (?!--)(\S+)", text, re.MULTILINE):
        assert (ROOT / src).exists(), src
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    assert "!epp/**" in ignore and "!pyproject.toml" in ignore


def test_helm_chart_lints() -> None:
    r = subprocess.run([sys.executable, str(RENDER), "--lint"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["errors"] == []
    assert not [m for m in report["messages"] if m["severity"] >= 2], report


def test_helm_chart_renders_defaults(serve_flags: set[str]) -> None:
    docs = _render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["ClusterRole", "ClusterRoleBinding", "Deployment",
                            "InferencePool", "Role", "RoleBinding", "Service",
                            "ServiceAccount"])
    dep = _by_kind(docs, "Deployment")[0]
    args = _check_deployment(dep, serve_flags)
    assert "--pool-name=vllm-pool" in args and "--pool-namespace=default" in args
    assert "--secure-serving=true" in args
    assert not any(a.startswith("--ha-") for a in args)
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "epp:0.1.0"
    pool = _by_kind(docs, "InferencePool")[0]
    svc = _by_kind(docs, "Service")[0]
    assert pool["spec"]["endpointPickerRef"]["name"] == svc["metadata"]["name"]
    assert pool["spec"]["selector"] == {"matchLabels": {"app": "vllm"}}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    role_resources = {r for rule in _by_kind(docs, "Role")[0]["rules"]
                      for r in rule["resources"]}
    # No Lease access without HA.
    assert role_resources == {"pods", "inferencepools", "podgangs", "inferenceobjectives",
                              "inferencemodelrewrites"}


def test_helm_chart_renders_non_default_values(tmp_path: Path,
                                               serve_flags: set[str]) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "inferencePool": {"name": "llama", "targetPorts": [8000, 8001],
                          "modelServers": {"matchLabels": {"app": "llama", "tier": "gpu"}}},
        "replicas": 3,
        "leaderElection": {"enabled": True, "leaseDuration": "20s"},
        "config": (ROOT / "config/default.yaml").read_text(),
        "image": {"repository": "registry.example/epp", "tag": "1.2.3"},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "certSecret": "epp-tls",
        "nodeLabels": False,
        "extraArgs": ["--refresh-metrics-interval=100ms"],
    }))
    docs = _render("-f", str(values), "--namespace", "llm", "--set", "logLevel=debug")
    dep = _by_kind(docs, "Deployment")[0]
    args = _check_deployment(dep, serve_flags)
    for want in ("--pool-name=llama", "--pool-namespace=llm", "--ha-enable-leader-election=true",
                 "--ha-lease-duration=20s", "--ha-renew-deadline=10s", "--ha-retry-period=2s",
                 "--config-file=/config/config.yaml", "--cert-path=/certs", "--no-node-labels",
                 "--log-level=debug", "--refresh-metrics-interval=100ms"):
        assert want in args, want
    assert dep["spec"]["replicas"] == 3 and dep["metadata"]["name"] == "llama-epp"
    spec = dep["spec"]["template"]["spec"]
    assert spec["containers"][0]["image"] == "registry.example/epp:1.2.3"
    assert {v["name"] for v in spec["volumes"]} == {"config", "certs"}
    assert "checksum/config" in dep["spec"]["template"]["metadata"]["annotations"]
    assert not _by_kind(docs, "ClusterRole")                 # no node watch, no cluster RBAC
    assert _by_kind(docs, "ServiceMonitor")
    role = _by_kind(docs, "Role")[0]
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
            "verbs": ["get", "create", "update"]} in role["rules"]
    cm = _by_kind(docs, "ConfigMap")[0]
    load_and_build(None, cm["data"]["config.yaml"])
    pool = _by_kind(docs, "InferencePool")[0]
    assert pool["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]
    assert all(d["metadata"].get("namespace") in ("llm", None) for d in docs)


def test_helm_chart_standalone_mode(serve_flags: set[str]) -> None:
    docs = _render("--set", "standalone.selector=app=vllm\\,env=prod",
                   "--set", "standalone.targetPorts=8000\\,8001")
    args = _check_deployment(_by_kind(docs, "Deployment")[0], serve_flags)
    assert "--endpoint-selector=app=vllm,env=prod" in args
    assert "--endpoint-target-ports=8000,8001" in args
    assert not _by_kind(docs, "InferencePool")
    resources = {r for rule in _by_kind(docs, "Role")[0]["rules"] for r in rule["resources"]}
    assert resources == {"pods", "podgangs"}
