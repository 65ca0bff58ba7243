"""dcgm-data-source ``useNodeAddress: true`` (llm-d-router v0.10.0,
pkg/epp/framework/plugins/datalayer/source/dcgm and source/http ``getEndpoint``): a DCGM
exporter DaemonSet scraped at the node IP (the pod's ``status.hostIP``, recorded by the
Kubernetes discovery), the pod IP when an endpoint has none (static discovery), and the
extractor keeping each endpoint to its own pod's samples of the shared node page."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from epp.config.loader import load_and_build
from epp.datalayer import promparse
from epp.datalayer.polling import PollingRunner
from epp.datastore.store import Datastore
from epp.discovery.kubernetes import PodInfo, PoolSpec, build_endpoints, pod_info
from epp.framework.handle import PluginHandle
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.dcgm import GPU_UTILIZATION_KEY, DCGMDataSource, DCGMExtractor
from epp.scheduling.types import Endpoint
from tests.k8s_fake import FakeApiServer
from tests.polling import eventually

KEY = GPU_UTILIZATION_KEY
APP = {"app": "vllm"}


def make(type_name: str, params: dict[str, Any] | None = None) -> Any:
    build = default_registry().builder(type_name, "t")
    return build(type_name, params, "plugins[0].parameters", PluginHandle())


def ep(i: int, name: str, node_address: str | None = None, port: int = 8000) -> Endpoint:
    return Endpoint(name=name, address=f"127.0.0.{i}", port=port, node_address=node_address)


def dcgm_text(samples: list[tuple[dict[str, str], float]]) -> str:
    lines = ["# TYPE DCGM_FI_DEV_GPU_UTIL gauge"]
    for labels, v in samples:
        lbl = ",".join(f'{k}="{val}"' for k, val in labels.items())
        lines.append(f"DCGM_FI_DEV_GPU_UTIL{{{lbl}}} {v}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------ the source


def test_use_node_address_is_accepted_and_scrapes_the_node_ip(
        caplog: pytest.LogCaptureFixture) -> None:
    src = make("dcgm-data-source", {"useNodeAddress": True, "port": 9500})
    assert isinstance(src, DCGMDataSource) and src.use_node_address
    assert src.url(ep(1, "a", node_address="192.168.0.7")) == "http://192.168.0.7:9500/metrics"
    assert src.url(ep(1, "a", node_address="fd00::7")) == "http://[fd00::7]:9500/metrics"
    # no node address (static discovery): the pod IP, as llm-d, with one warning
    with caplog.at_level(logging.WARNING):
        assert src.url(ep(2, "b")) == "http://127.0.0.2:9500/metrics"
        assert src.url(ep(2, "b")) == "http://127.0.0.2:9500/metrics"
    warnings = [r for r in caplog.records if "has no node address" in r.getMessage()]
    assert len(warnings) == 1
    assert "useNodeAddress needs Kubernetes discovery" in warnings[0].getMessage()
    # the default (sidecar) ignores the node address
    side = make("dcgm-data-source")
    assert not side.use_node_address
    assert side.url(ep(1, "a", node_address="192.168.0.7")) == "http://127.0.0.1:9400/metrics"


def test_use_node_address_rejects_non_bool() -> None:
    from epp.errors import ConfigError
    with pytest.raises(ConfigError, match="useNodeAddress: expected true or false"):
        make("dcgm-data-source", {"useNodeAddress": "yes"})


def test_extractor_matches_kubernetes_rank_endpoints_to_their_pod() -> None:
    """Kubernetes endpoints are named <pod>-rank-<i>; the exporter labels samples with
    the pod name (llm-d compares EndpointMetadata.Name, the pod's)."""
    payload = promparse.parse(dcgm_text([({"gpu": "0", "pod": "vllm-a"}, 30),
                                         ({"gpu": "1", "pod": "vllm-b"}, 90)]))
    x = DCGMExtractor()
    assert x.extract_poll(payload, ep(1, "vllm-a-rank-0")) == {KEY: 0.3}
    assert x.extract_poll(payload, ep(1, "vllm-a-rank-1")) == {KEY: 0.3}
    assert x.extract_poll(payload, ep(2, "vllm-b")) == {KEY: 0.9}
    with pytest.raises(ValueError, match="no samples for pod 'vllm-c-rank-0'"):
        x.extract_poll(payload, ep(3, "vllm-c-rank-0"))


def test_llmd_readme_daemonset_config_loads() -> None:
    text = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: dcgm-data-source
  name: dcgm-source
  parameters:
    port: 9400
    useNodeAddress: true
    interval: "1s"
- type: dcgm-extractor
  name: dcgm-extractor
- type: max-score-picker
dataLayer:
  sources:
  - pluginRef: dcgm-source
    extractors:
    - pluginRef: dcgm-extractor
"""
    built = load_and_build(None, text, strict=True)
    src = built.plugins["dcgm-source"]
    assert isinstance(src, DCGMDataSource) and src.use_node_address and src.interval_s == 1.0


# ---------------------------------------------------- the node address from Kubernetes


def test_pod_info_and_endpoints_carry_the_host_ip() -> None:
    pod: dict[str, Any] = {"metadata": {"name": "p", "namespace": "ns", "labels": APP},
                           "spec": {"nodeName": "n1"},
                           "status": {"podIP": "10.0.0.9", "hostIP": "192.168.0.7",
                                      "conditions": [{"type": "Ready", "status": "True"}]}}
    info = pod_info(pod)
    assert info.host_ip == "192.168.0.7"
    eps = build_endpoints([info], PoolSpec(APP, (8000, 8001)), {})
    assert [e.node_address for e in eps] == ["192.168.0.7", "192.168.0.7"]
    no_host = PodInfo(name="q", namespace="ns", labels=APP, ip="10.0.0.8", ready=True,
                      node_name=None, active_ports=None)
    assert build_endpoints([no_host], PoolSpec(APP, (8000,)), {})[0].node_address is None
    # a changed node address is a changed endpoint (the datastore replaces it)
    a, b = eps[0], build_endpoints([pod_info({**pod, "status": {
        **pod["status"], "hostIP": "192.168.0.8"}})], PoolSpec(APP, (8000,)), {})[0]
    assert not a.same_identity(b)


async def test_discovery_records_the_host_ip(fake: FakeApiServer, harness: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put("pods", {"metadata": {"name": "a", "namespace": "default", "labels": APP},
                      "spec": {"nodeName": "n1"},
                      "status": {"podIP": "10.0.0.1", "hostIP": "192.168.0.7",
                                 "conditions": [{"type": "Ready", "status": "True"}]}})
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert h.store.snapshot()[0].node_address == "192.168.0.7"
    fake.put("pods", {"metadata": {"name": "a", "namespace": "default", "labels": APP},
                      "spec": {"nodeName": "n2"},
                      "status": {"podIP": "10.0.0.1", "hostIP": "192.168.0.8",
                                 "conditions": [{"type": "Ready", "status": "True"}]}})
    await eventually(lambda: h.store.snapshot()[0].node_address == "192.168.0.8")


# ------------------------------------------------------------ a fake DaemonSet exporter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NodeExporter:
    """One DCGM exporter per node IP (127.0.0.9 and 127.0.0.10), each listing the GPUs
    of the pods on its node; it records the address each scrape came in on."""

    def __init__(self) -> None:
        self.pages: dict[str, list[tuple[dict[str, str], float]]] = {}
        self.addresses: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        tr = request.transport
        local = tr.get_extra_info("sockname")[0] if tr else ""
        self.addresses.append(local)
        return web.Response(text=dcgm_text(self.pages.get(local, [])))


@pytest.fixture
async def node_exporter() -> AsyncIterator[tuple[NodeExporter, int]]:
    fake = NodeExporter()
    app = web.Application()
    app.router.add_get("/metrics", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    try:
        yield fake, port
    finally:
        await runner.cleanup()


async def test_daemonset_scrape_at_the_node_ip(node_exporter: tuple[NodeExporter, int]) -> None:
    fake, port = node_exporter
    fake.pages = {
        "127.0.0.9": [({"gpu": "0", "pod": "vllm-a"}, 20), ({"gpu": "1", "pod": "vllm-b"}, 60)],
        "127.0.0.10": [({"gpu": "0", "pod": "vllm-c"}, 80)],
    }
    store = Datastore()
    a, b = ep(1, "vllm-a-rank-0", "127.0.0.9"), ep(2, "vllm-b-rank-0", "127.0.0.9")
    c = ep(3, "vllm-c-rank-0", "127.0.0.10")
    store.set_endpoints([a, b, c])
    src = DCGMDataSource("d", port=port, use_node_address=True)
    runner = PollingRunner(store, [(src, [DCGMExtractor()])], 0.02)
    runner.start()
    try:
        def util(e: Endpoint) -> float | None:
            got = store.get(e.key)
            return None if got is None else got.metrics.attributes.get(KEY)
        await eventually(lambda: (util(a), util(b), util(c)) == (0.2, 0.6, 0.8))
        # every scrape went to a node address, none to a pod IP
        assert set(fake.addresses) == {"127.0.0.9", "127.0.0.10"}
    finally:
        await runner.stop()
