"""``epp serve`` in llm-d's file-discovery mode (EppServer): the config's
``dataLayer.discovery`` plugin is the endpoint source — no Kubernetes, no --endpoints —
the file is read before the ports are bound, reloaded with ``watchFile``, and a
``k8s-notification-source`` is inactive (llm-d: it never binds) rather than fatal."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from epp.errors import ConfigError
from epp.server.app import EppServer
from epp.server.options import (
    ConfigOptions,
    KubernetesSourceOptions,
    ListenOptions,
    ScrapingOptions,
    ServeOptions,
)
from tests.polling import eventually


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def options(config: str, kubernetes: KubernetesSourceOptions | None = None) -> ServeOptions:
    return ServeOptions(listen=ListenOptions(grpc_port=free_port(),
                                             grpc_health_port=free_port(),
                                             metrics_port=free_port(),
                                             bind_address="127.0.0.1"),
                        config=ConfigOptions(text=config),
                        scraping=ScrapingOptions(enabled=False),
                        kubernetes=kubernetes or KubernetesSourceOptions())


def config(path: Path, watch: bool = True) -> str:
    return f"""
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- name: file-disc
  type: file-discovery
  parameters: {{path: {json.dumps(str(path))}, watchFile: {str(watch).lower()}}}
- {{name: pods, type: k8s-notification-source, parameters: {{version: v1, kind: Pod}}}}
- type: queue-scorer
dataLayer:
  discovery: {{pluginRef: file-disc}}
  sources:
  - pluginRef: pods
"""


async def test_serves_from_the_file_without_kubernetes(tmp_path: Path) -> None:
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints: [{name: a, address: 10.0.0.1, port: '8000'}]\n")
    server = EppServer(options(config(endpoints), kubernetes=KubernetesSourceOptions(
        pool_name="slurm-job-42", pool_namespace="slurm")))
    await server.start()
    try:
        assert [e.key for e in server.store.snapshot()] == ["10.0.0.1:8000"]
        assert server.k8s_source is None
        assert server.parts.health.ready
        assert server.parts.metrics.registry.get_sample_value(
            "inference_pool_ready_pods", {"name": "slurm-job-42"}) == 1
        tmp = tmp_path / "new.yaml"
        tmp.write_text("endpoints: [{name: b, address: 10.0.0.2, port: '8000'},"
                       " {name: c, address: 10.0.0.3, port: '8000'}]\n")
        tmp.replace(endpoints)
        await eventually(lambda: [e.key for e in server.store.snapshot()]
                         == ["10.0.0.2:8000", "10.0.0.3:8000"], timeout=5)
    finally:
        await server.stop(0)


async def test_a_bad_file_fails_startup(tmp_path: Path) -> None:
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints: [{name: a, address: not-an-ip, port: '8000'}]\n")
    server = EppServer(options(config(endpoints)))
    with pytest.raises(ConfigError, match="initial load failed: .*invalid IPv4 address"):
        await server.start()
    await server.stop(0)
