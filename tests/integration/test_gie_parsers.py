"""Parser plugins through real Envoy (issue 14; GIE v1.5.0 test/integration/epp/grpc_test.go
and hermetic_test.go "passthrough parser success").

- ``vllmgrpc-parser``: a gRPC client calls vLLM's ``Generate`` through Envoy; the EPP
  parses the framed ``GenerateRequest``, picks a pod, and the request reaches that pod's
  gRPC server (a tiny in-test echo upstream, HTTP/2) with its message byte for byte and the
  ``x-gateway-destination-endpoint`` header naming it; the usage in the streamed
  ``GenerateResponse`` reaches the EPP's token metrics. A body that is not a
  ``GenerateRequest`` is refused before any pod sees it.
- ``passthrough-parser``: arbitrary bytes (not JSON) are routed and arrive unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web

from epp.parsing import vllm_grpc as g
from epp.stack.envoy import EnvoyProcess, render_envoy_config
from epp.stack.procs import free_port
from tests.integration.conftest import Epp, eventually

pytestmark = pytest.mark.integration

SCORERS = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: {parser}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: prefix-cache-scorer
parser:
  pluginRef: {parser}
"""


@dataclass
class Seen:
    port: int
    headers: dict[str, str]
    body: bytes


@dataclass
class Upstreams:
    ports: list[int]
    seen: list[Seen] = field(default_factory=list)


def h2_upstream(config_yaml: str) -> str:
    """The rendered Envoy config with the routing cluster speaking HTTP/2 (gRPC pods)."""
    doc = yaml.safe_load(config_yaml)
    for cluster in doc["static_resources"]["clusters"]:
        if cluster["name"] == "original_destination_cluster":
            cluster["typed_extension_protocol_options"] = {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                             "HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}}}
    return str(yaml.safe_dump(doc, sort_keys=False))


async def start(tmp: Path, parser: str, body_mode: str, ports: list[int],
                grpc_upstream: bool) -> tuple[Epp, EnvoyProcess, int]:
    epp = Epp(tmp, tmp / "endpoints.yaml", config=SCORERS.format(parser=parser),
              extra_args=["--no-metrics-scraping"])
    epp.write_endpoints(ports)
    await epp.start()
    port = free_port()
    cfg = render_envoy_config(listen_port=port, epp_port=epp.grpc_port, admin_port=free_port(),
                              body_mode=body_mode, response_path="inline")
    envoy = EnvoyProcess()
    try:
        await envoy.start(h2_upstream(cfg) if grpc_upstream else cfg, tmp)
        await envoy.wait_ready()
    except BaseException:
        await envoy.stop()
        await epp.stop()
        raise
    return epp, envoy, port


# --- vllmgrpc-parser ------------------------------------------------------------------

USAGE = g.GenerateResponse(complete=g.message_class("GenerateComplete")(
    finish_reason="stop", prompt_tokens=7, completion_tokens=10, cached_tokens=3))
FIRST = g.GenerateResponse(chunk=g.message_class("GenerateStreamChunk")(token_ids=[1, 2, 3]))


@pytest.fixture
async def grpc_pods() -> AsyncIterator[Upstreams]:
    """Two vLLM-gRPC-like pods: Generate records the raw request message and streams a
    chunk, then the completion with usage."""
    ups = Upstreams([free_port(), free_port()])
    servers = []
    for port in ups.ports:
        def make(port: int) -> Any:
            async def generate(request: bytes, context: grpc.aio.ServicerContext[Any, Any]
                               ) -> AsyncIterator[bytes]:
                md = {k: str(v) for k, v in context.invocation_metadata() or ()}
                ups.seen.append(Seen(port, md, request))
                yield FIRST.SerializeToString()
                yield USAGE.SerializeToString()
            return generate
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "vllm.grpc.engine.VllmEngine",
            {"Generate": grpc.unary_stream_rpc_method_handler(make(port))}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        servers.append(server)
    yield ups
    for server in servers:
        await server.stop(None)


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
async def test_grpc_generate_is_routed_byte_exact(tmp_path: Path, grpc_pods: Upstreams,
                                                  body_mode: str) -> None:
    epp, envoy, port = await start(tmp_path, "vllmgrpc-parser", body_mode, grpc_pods.ports,
                                   grpc_upstream=True)
    try:
        request = g.GenerateRequest(
            request_id="req-1", text="Hello world " * 200, stream=True,
            sampling_params=g.SamplingParams(max_tokens=16, temperature=0.5,
                                             stop=["\n"]))
        sent = request.SerializeToString()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")
            replies = [r async for r in call(sent, metadata=(("x-request-id", "grpc-1"),),
                                             timeout=20)]
            assert replies == [FIRST.SerializeToString(), USAGE.SerializeToString()]

            assert len(grpc_pods.seen) == 1
            seen = grpc_pods.seen[0]
            assert seen.body == sent  # the message arrived byte for byte
            assert seen.headers["x-gateway-destination-endpoint"] == f"127.0.0.1:{seen.port}"

            # Usage from the streamed GenerateResponse (GIE: "response streaming with token
            # usage"); the proto names no model, so the labels are empty.
            async with aiohttp.ClientSession() as session:
                async def input_tokens() -> float:
                    return await epp.metric(session, "inference_objective_input_tokens_sum")
                assert await eventually(input_tokens) == 7

            # Not a GenerateRequest (a valid frame, but no text or tokenized input):
            # refused by the EPP (GIE: 400 "not supported request inputType"), no pod sees it.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [r async for r in call(b"plain text not grpc payload style", timeout=20)]
            assert e.value.code() is not grpc.StatusCode.OK
            # Envoy turns the 400 into a gRPC status carrying the EPP's message (as GIE's).
            assert "parsing gRPC payload for Generate" in (e.value.details() or "")
            assert len(grpc_pods.seen) == 1
    finally:
        await envoy.stop()
        await epp.stop()


# --- passthrough-parser ---------------------------------------------------------------


@pytest.fixture
async def http_pods() -> AsyncIterator[Upstreams]:
    ups = Upstreams([free_port(), free_port(), free_port()])
    runners = []
    for port in ups.ports:
        def make(port: int) -> Any:
            async def handle(request: web.Request) -> web.Response:
                ups.seen.append(Seen(port, dict(request.headers), await request.read()))
                return web.Response(body=b"ok", content_type="application/octet-stream")
            return handle
        app = web.Application(client_max_size=8 << 20)
        app.router.add_route("*", "/{tail:.*}", make(port))
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    yield ups
    for runner in runners:
        await runner.cleanup()


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
async def test_passthrough_routes_arbitrary_bytes(tmp_path: Path, http_pods: Upstreams,
                                                  body_mode: str) -> None:
    epp, envoy, port = await start(tmp_path, "passthrough-parser", body_mode, http_pods.ports,
                                   grpc_upstream=False)
    try:
        bodies = [b"passthrough-parser", bytes(range(256)) * 700, b"{not json"]
        async with aiohttp.ClientSession() as session:
            for i, body in enumerate(bodies):
                async with session.post(f"http://127.0.0.1:{port}/any/path",
                                        data=body, headers={
                                            "content-type": "application/octet-stream",
                                            "x-request-id": f"p-{i}"}) as r:
                    assert r.status == 200, await r.text()
                    assert await r.read() == b"ok"
        assert [s.body for s in http_pods.seen] == bodies
        for s in http_pods.seen:
            assert s.headers["x-gateway-destination-endpoint"] == f"127.0.0.1:{s.port}"
    finally:
        await envoy.stop()
        await epp.stop()
