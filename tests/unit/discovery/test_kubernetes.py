"""Kubernetes discovery: pure pod/pool rules, and list/watch against the fake API server."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from epp import keys
from epp.discovery.kubeclient import KubeApi, connect
from epp.discovery.kubernetes import (
    KubernetesOptions,
    PodInfo,
    PoolSpec,
    active_ports,
    build_endpoints,
    parse_pool,
    parse_selector,
    parse_target_ports,
    pod_info,
    pool_api_path,
    resolve_namespace,
)
from epp.discovery.reflector import Reflector, ReflectorOptions
from epp.errors import ConfigError
from tests.k8s_fake import FakeApiServer
from tests.polling import eventually
from tests.unit.conftest import FAST

APP = {"app": "vllm"}


# ------------------------------------------------------------------------ pure rules
def test_parse_selector_and_ports() -> None:
    assert parse_selector("app=vllm, env==prod") == {"app": "vllm", "env": "prod"}
    assert parse_selector("llm-d.ai/role=decode") == {"llm-d.ai/role": "decode"}
    for bad in ("", "app", "app!=x", "a=b,a=c", "bad key=x"):
        with pytest.raises(ConfigError):
            parse_selector(bad)
    assert parse_target_ports("8000, 8001") == (8000, 8001)
    for bad in ("", "0", "70000", "x", "8000,8000"):
        with pytest.raises(ConfigError):
            parse_target_ports(bad)


def test_namespace_and_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(keys.ENV_NAMESPACE, raising=False)
    assert resolve_namespace(None) == "default"
    monkeypatch.setenv(keys.ENV_NAMESPACE, "llm")
    assert resolve_namespace(None) == "llm" and resolve_namespace("x") == "x"
    assert pool_api_path(keys.K8S_POOL_GROUP, "ns") == \
        "/apis/inference.networking.k8s.io/v1/namespaces/ns/inferencepools"
    assert pool_api_path(keys.K8S_POOL_GROUP_ALPHA, "ns").startswith(
        "/apis/inference.networking.x-k8s.io/v1alpha2/")
    with pytest.raises(ConfigError):
        pool_api_path("example.com", "ns")


def test_parse_pool_v1_and_v1alpha2() -> None:
    v1 = parse_pool({"spec": {"selector": {"matchLabels": APP},
                              "targetPorts": [{"number": 8000}, {"number": 8001}],
                              "endpointPickerRef": {"name": "epp"}}})
    assert dict(v1.selector) == APP and v1.target_ports == (8000, 8001)
    alpha = parse_pool({"spec": {"selector": APP, "targetPortNumber": 9000,
                                 "extensionRef": {"name": "epp"}}})
    assert dict(alpha.selector) == APP and alpha.target_ports == (9000,)
    for bad in ({}, {"spec": {"selector": APP}},
                {"spec": {"selector": APP, "targetPorts": [{"number": "x"}]}},
                {"spec": {"selector": {"matchExpressions": [{"key": "a"}]},
                          "targetPorts": [{"number": 1}]}}):
        with pytest.raises(ValueError):
            parse_pool(bad)


def _pod(name: str, ip: str = "10.0.0.1", ready: bool = True, **kw: Any) -> PodInfo:
    return PodInfo(name=name, namespace="ns", labels=kw.get("labels", APP), ip=ip,
                   ready=ready, node_name=kw.get("node"), active_ports=kw.get("active"))


def test_pod_info_readiness_rules() -> None:
    base = {"metadata": {"name": "p", "namespace": "ns", "labels": APP},
            "spec": {"nodeName": "n1"},
            "status": {"podIP": "10.0.0.9",
                       "conditions": [{"type": "PodScheduled", "status": "True"},
                                      {"type": "Ready", "status": "True"}]}}
    info = pod_info(base)
    assert info.ready and info.ip == "10.0.0.9" and info.node_name == "n1"
    not_ready = {**base, "status": {"podIP": "10.0.0.9",
                                    "conditions": [{"type": "Ready", "status": "False"}]}}
    assert not pod_info(not_ready).ready
    terminating = {**base, "metadata": {**base["metadata"],
                                        "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert not pod_info(terminating).ready
    assert not pod_info({"metadata": {"name": "x"}}).ready


def test_endpoints_per_rank_active_ports_and_topology() -> None:
    pool = PoolSpec(APP, (8000, 8001, 8002))
    nodes = {"n1": {"topology.kubernetes.io/rack": "r1"}}
    eps = build_endpoints([
        _pod("b", "10.0.0.2", active="8002, 8000,junk,9999"),
        _pod("a", "10.0.0.1", node="n1"),
        _pod("c", "10.0.0.3", ready=False),
        _pod("d", ""),                                     # no IP yet
        _pod("e", "10.0.0.5", labels={"app": "other"}),    # not selected
    ], pool, nodes)
    assert [(e.name, e.key) for e in eps] == [
        ("a-rank-0", "10.0.0.1:8000"), ("a-rank-1", "10.0.0.1:8001"),
        ("a-rank-2", "10.0.0.1:8002"),
        ("b-rank-0", "10.0.0.2:8000"), ("b-rank-2", "10.0.0.2:8002")]
    assert eps[0].namespace == "ns" and dict(eps[0].labels) == APP
    assert eps[0].node_name == "n1" and dict(eps[0].node_labels) == nodes["n1"]
    assert dict(eps[3].node_labels) == {}
    assert active_ports(None, (1, 2)) == {1, 2} and active_ports("", (1, 2)) == set()
    # Two pods claiming one ip:port: the first by name keeps it.
    dup = build_endpoints([_pod("y", "10.0.0.1"), _pod("x", "10.0.0.1")],
                          PoolSpec(APP, (8000,)), {})
    assert [e.name for e in dup] == ["x-rank-0"]


async def test_pods_becoming_ready_not_ready_and_deleted(fake: FakeApiServer,
                                                         harness: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put_pod("a", "10.0.0.1", labels=APP)
    fake.put_pod("b", None, labels=APP, ready=False)           # starting: no IP, not ready
    fake.put_pod("other", "10.0.0.9", labels={"app": "x"})     # another workload
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert h.keys() == ["10.0.0.1:8000"] and h.store.synced
    fake.put_pod("b", "10.0.0.2", labels=APP, ready=False)     # IP, still not ready
    fake.put_pod("b", "10.0.0.2", labels=APP)                  # ready
    await eventually(lambda: h.keys() == ["10.0.0.1:8000", "10.0.0.2:8000"])
    fake.put_pod("a", "10.0.0.1", labels=APP, ready=False)     # readiness probe fails
    await eventually(lambda: h.keys() == ["10.0.0.2:8000"])
    fake.put_pod("b", "10.0.0.2", labels=APP, deleting=True)   # terminating
    await eventually(lambda: h.keys() == [])
    fake.put_pod("a", "10.0.0.1", labels=APP)
    fake.delete("pods", "b")
    await eventually(lambda: h.keys() == ["10.0.0.1:8000"])
    fake.put_pod("a", "10.0.0.1", labels={"app": "moved"})      # relabelled out of the pool
    await eventually(lambda: h.keys() == [])
    assert h.source.ready  # an empty pool is still a synced, present pool


async def test_selector_and_target_port_changes_resync(fake: FakeApiServer,
                                                       harness: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put_pod("a", "10.0.0.1", labels=APP)
    fake.put_pod("n", "10.0.0.2", labels={"app": "new"})
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert h.keys() == ["10.0.0.1:8000"]
    lists = fake.requests[("GET", "pods", "list")]
    fake.put_pool("pool", {"app": "new"}, [8000])
    await eventually(lambda: h.keys() == ["10.0.0.2:8000"])
    assert fake.requests[("GET", "pods", "list")] == lists + 1   # re-listed for the selector
    await eventually(lambda: fake.open_watches("pods") == 1)      # the old watch is gone
    fake.put_pool("pool", {"app": "new"}, [8000, 8001])
    await eventually(lambda: h.names() == ["n-rank-0", "n-rank-1"])
    fake.put_pool("pool", {"app": "new"}, [8001])
    await eventually(lambda: h.names() == ["n-rank-0"] and h.keys() == ["10.0.0.2:8001"])
    assert fake.requests[("GET", "pods", "list")] == lists + 1   # ports alone: no relist


async def test_pool_deleted_then_recreated(fake: FakeApiServer, harness: Any) -> None:
    h = await harness(pool_name="pool")
    # No pool yet: synced (nothing to serve) but not ready, like GIE.
    await eventually(lambda: h.source.synced)
    assert not h.source.ready and h.keys() == []
    fake.put_pod("a", "10.0.0.1", labels=APP)
    fake.put_pool("pool", APP, [8000])
    await eventually(lambda: h.source.ready and h.keys() == ["10.0.0.1:8000"])
    changes = h.state_changes
    fake.delete("inferencepools", "pool")
    await eventually(lambda: not h.source.ready and h.keys() == [])
    assert h.state_changes > changes  # the server hears it (readiness drops)
    assert h.source.pool_error == "not found"
    fake.put("inferencepools", {"metadata": {"name": "pool"}, "spec": {"selector": APP}})
    await eventually(lambda: h.source.pool_error is not None and "target ports" in
                     h.source.pool_error)
    assert h.keys() == []
    fake.put_pool("pool", APP, [8000])
    await eventually(lambda: h.source.ready and h.keys() == ["10.0.0.1:8000"])


async def test_other_pools_and_namespaces_are_ignored(fake: FakeApiServer,
                                                      harness: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put_pool("pool-b", APP, [9000])
    fake.put_pool("pool", APP, [7000], namespace="elsewhere")
    fake.put_pod("a", "10.0.0.1", labels=APP)
    fake.put_pod("z", "10.0.0.7", labels=APP, namespace="elsewhere")
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert h.keys() == ["10.0.0.1:8000"]


async def test_watch_dropped_mid_stream_resumes_without_relist(fake: FakeApiServer,
                                                               harness: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put_pod("a", "10.0.0.1", labels=APP)
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    await eventually(lambda: fake.open_watches("pods") == 1)
    lists = fake.requests[("GET", "pods", "list")]
    watches = fake.requests[("GET", "pods", "watch")]
    assert fake.drop_watches() >= 3  # pool, pods, nodes
    fake.put_pod("b", "10.0.0.2", labels=APP)          # happens while disconnected
    fake.put_pod("a", "10.0.0.1", labels=APP, ready=False)
    await eventually(lambda: h.keys() == ["10.0.0.2:8000"])
    assert fake.requests[("GET", "pods", "list")] == lists          # resumed, not relisted
    assert fake.requests[("GET", "pods", "watch")] > watches


@pytest.mark.parametrize("as_http", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_relists(fake: FakeApiServer, harness: Any, as_http: bool) -> None:
    fake.gone_as_http = as_http
    fake.put_pool("pool", APP, [8000])
    fake.put_pod("a", "10.0.0.1", labels=APP)
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    await eventually(lambda: fake.open_watches("pods") == 1)
    lists = fake.requests[("GET", "pods", "list")]
    fake.compact()                                     # history before now is gone
    fake.drop_watches()                                # reconnects from an old RV → 410
    fake.put_pod("b", "10.0.0.2", labels=APP)
    fake.compact()
    await eventually(lambda: fake.requests[("GET", "pods", "list")] > lists)
    await eventually(lambda: h.keys() == ["10.0.0.1:8000", "10.0.0.2:8000"])
    fake.delete("pods", "a")                           # and the new watch works
    await eventually(lambda: h.keys() == ["10.0.0.2:8000"])


async def test_bookmarks_advance_the_resource_version(fake: FakeApiServer,
                                                      api: KubeApi) -> None:
    fake.put_pod("a", "10.0.0.1", labels=APP)
    r = Reflector(api, "/api/v1/namespaces/default/pods", name="pods",
                  label_selector="app=vllm", on_change=lambda: None, options=FAST)
    r.start()
    try:
        await eventually(lambda: r.synced and fake.open_watches("pods") == 1)
        rv = int(r.resource_version)
        fake.put_node("n1", {})  # moves the global RV; invisible to a pod watch
        fake.put_node("n2", {})
        fake.bookmark()
        await eventually(lambda: int(r.resource_version) >= rv + 2)
        assert list(r.objects) == ["default/a"]
    finally:
        await r.stop()


async def test_paged_list(fake: FakeApiServer, api: KubeApi) -> None:
    for i in range(7):
        fake.put_pod(f"p{i}", f"10.0.0.{i + 1}", labels=APP)
    r = Reflector(api, "/api/v1/namespaces/default/pods", name="pods",
                  on_change=lambda: None,
                  options=ReflectorOptions(page_size=3, backoff_initial_s=0.02))
    r.start()
    try:
        await eventually(lambda: r.synced)
        assert len(r.objects) == 7 and fake.requests[("GET", "pods", "list")] == 3
    finally:
        await r.stop()


async def test_errors_back_off_then_sync(fake: FakeApiServer, harness: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put_pod("a", "10.0.0.1", labels=APP)
    fake.fail_next("/api/v1/namespaces/default/pods", 500, times=3)
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert h.keys() == ["10.0.0.1:8000"]
    assert fake.requests[("GET", "pods", "list")] == 4


async def test_node_labels_follow_the_node_watch(fake: FakeApiServer, harness: Any) -> None:
    fake.put_node("n1", {"topology.kubernetes.io/rack": "r1"})
    fake.put_pool("pool", APP, [8000])
    fake.put_pod("a", "10.0.0.1", labels=APP, node="n1")
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert dict(h.store.snapshot()[0].node_labels) == {"topology.kubernetes.io/rack": "r1"}
    fake.put_node("n1", {"topology.kubernetes.io/rack": "r2", "kubernetes.io/hostname": "n1"})
    await eventually(lambda: h.store.snapshot()[0].node_labels.get(
        "topology.kubernetes.io/rack") == "r2")


async def test_nodes_forbidden_still_syncs_without_topology(fake: FakeApiServer,
                                                            harness: Any,
                                                            caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    fake.put_node("n1", {"topology.kubernetes.io/rack": "r1"})
    fake.put_pool("pool", APP, [8000])
    fake.put_pod("a", "10.0.0.1", labels=APP, node="n1")
    fake.fail_next("/api/v1/nodes", 403, times=1000)
    h = await harness(pool_name="pool", reflector=ReflectorOptions(backoff_initial_s=5))
    assert await h.source.wait_ready(5)
    assert h.keys() == ["10.0.0.1:8000"] and dict(h.store.snapshot()[0].node_labels) == {}
    assert "cannot list Nodes (403 Forbidden)" in caplog.text


async def test_no_node_watch_option(fake: FakeApiServer, harness: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put_pod("a", "10.0.0.1", labels=APP, node="n1")
    h = await harness(pool_name="pool", watch_nodes=False)
    assert await h.source.wait_ready(5)
    assert fake.requests[("GET", "nodes", "list")] == 0


async def test_standalone_mode(fake: FakeApiServer, harness: Any) -> None:
    fake.put_pod("a", "10.0.0.1", labels={**APP, "env": "prod"},
                 annotations={keys.ANNOTATION_ACTIVE_PORTS: "8001"})
    fake.put_pod("b", "10.0.0.2", labels={**APP, "env": "dev"})
    h = await harness(standalone=PoolSpec({"app": "vllm", "env": "prod"}, (8000, 8001)))
    assert await h.source.wait_ready(5)
    assert h.names() == ["a-rank-1"] and h.keys() == ["10.0.0.1:8001"]
    assert fake.requests[("GET", "inferencepools", "list")] == 0
    fake.put_pod("a", "10.0.0.1", labels={**APP, "env": "prod"})   # annotation removed
    await eventually(lambda: h.names() == ["a-rank-0", "a-rank-1"])


async def test_v1alpha2_pool_group(fake: FakeApiServer, harness: Any) -> None:
    fake.put("inferencepools", {"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                                "metadata": {"name": "old"},
                                "spec": {"selector": APP, "targetPortNumber": 8000,
                                         "extensionRef": {"name": "epp"}}})
    fake.put_pod("a", "10.0.0.1", labels=APP)
    h = await harness(pool_name="old", pool_group=keys.K8S_POOL_GROUP_ALPHA)
    assert await h.source.wait_ready(5)
    assert h.keys() == ["10.0.0.1:8000"]


async def test_bursts_are_debounced_and_unchanged_results_not_rewritten(
        fake: FakeApiServer, harness: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    h = await harness(pool_name="pool", debounce_s=0.1)
    assert await h.source.wait_ready(5)
    applied = h.source.applied
    for i in range(50):
        fake.put_pod(f"p{i}", f"10.0.1.{i + 1}", labels=APP)
    await eventually(lambda: len(h.keys()) == 50)
    assert h.source.applied - applied <= 3
    applied = h.source.applied
    fake.put_pod("p0", "10.0.1.1", labels=APP, annotations={"unrelated": "x"})
    # Not a wait: a window (the watch delivers, the 0.1 s debounce ends, the source
    # recomputes) in which nothing may be written.
    await asyncio.sleep(0.3)
    assert h.source.applied == applied  # no endpoint changed: the store is left alone


async def test_options_validation() -> None:
    with pytest.raises(ConfigError):
        KubernetesOptions(namespace="ns")
    with pytest.raises(ConfigError):
        KubernetesOptions(namespace="ns", pool_name="p", standalone=PoolSpec(APP, (1,)))
    with pytest.raises(ConfigError):
        KubernetesOptions(namespace="ns", pool_name="p", pool_group="nope")


async def test_connect_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="no such file"):
        await connect(None)
    monkeypatch.delenv("KUBECONFIG")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="no Kubernetes configuration"):
        await connect(None)
    bad = tmp_path / "bad"
    bad.write_text("apiVersion: v1\nkind: Config\ncurrent-context: nope\n")
    with pytest.raises(ConfigError, match="kubeconfig"):
        await connect(str(bad))
