"""The Envoy template and process supervision (epp.stack.envoy) against the real `envoy`.

Besides `envoy --mode validate`, one test per body mode sends real traffic through Envoy,
a tiny ext_proc picker defined here (it always routes to one fixed simulator) and the
simulator, to prove the rendered config routes by `x-gateway-destination-endpoint`, fails
closed, accepts big BUFFERED bodies and streams SSE.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from epp.keys import HEADER_DESTINATION, METADATA_NAMESPACE_LB
from epp.sim.server import SIM_SERVER_HEADER, STATE_KEY, serving
from epp.stack.envoy import BODY_MODES, EnvoyProcess, envoy_binary, render_envoy_config
from epp.stack.procs import free_port
from tests.integration.conftest import SUITE_SIM_CONFIG

pytestmark = pytest.mark.integration


def _render(body_mode: str, **kw: Any) -> tuple[str, dict[str, int]]:
    ports = {"listen_port": free_port(), "epp_port": free_port(), "admin_port": free_port()}
    config = render_envoy_config(
        body_mode=body_mode,
        listen_port=ports["listen_port"],
        epp_port=ports["epp_port"],
        admin_port=ports["admin_port"],
        **kw,
    )
    return config, ports


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------- rendering


@pytest.mark.parametrize("body_mode", BODY_MODES)
def test_rendered_config_passes_envoy_validate(body_mode: str, tmp_path: Path) -> None:
    config, ports = _render(
        body_mode, max_body_bytes=8 << 20, message_timeout_s=2.5, epp_keepalive_s=5
    )
    doc = yaml.safe_load(config)
    assert doc["admin"]["address"]["socket_address"]["port_value"] == ports["admin_port"]
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert hcm["http_filters"][0]["name"] == "envoy.filters.http.ext_proc"
    assert hcm["http_filters"][1]["name"] == "envoy.filters.http.router"
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["message_timeout"] == "2.5s"
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    assert ext_proc["processing_mode"]["request_body_mode"] == body_mode
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    assert clusters["original_destination_cluster"]["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": HEADER_DESTINATION,
    }
    assert doc["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] == 8 << 20
    http2 = clusters["epp"]["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]["explicit_http_config"]["http2_protocol_options"]
    assert http2 == {"max_concurrent_streams": 32,
                     "connection_keepalive": {"interval": "5s", "timeout": "5s"}}

    path = tmp_path / "envoy.yaml"
    path.write_text(config)
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


# Trailers SEND keeps the stream open until the response ends (SKIP closes it after the
# response headers in FULL_DUPLEX_STREAMED: test_gateway_shapes.py holds the timing).
_LEAN_RESPONSE = {"response_header_mode": "SEND", "response_body_mode": "NONE",
                  "response_trailer_mode": "SEND"}
#: (body mode, response path) → the routing filter's exact ProcessingMode.
_PROCESSING_MODES = {
    ("FULL_DUPLEX_STREAMED", "lean"): {
        "request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND", **_LEAN_RESPONSE},
    ("BUFFERED", "lean"): {
        "request_header_mode": "SEND", "request_body_mode": "BUFFERED",
        "request_trailer_mode": "SKIP", **_LEAN_RESPONSE},
    ("FULL_DUPLEX_STREAMED", "inline"): {
        "request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND", "response_header_mode": "SEND",
        "response_body_mode": "FULL_DUPLEX_STREAMED", "response_trailer_mode": "SEND"},
    ("BUFFERED", "inline"): {
        "request_header_mode": "SEND", "request_body_mode": "BUFFERED",
        "request_trailer_mode": "SKIP", "response_header_mode": "SEND",
        "response_body_mode": "STREAMED", "response_trailer_mode": "SKIP"},
}


@pytest.mark.parametrize("body_mode,response_path", sorted(_PROCESSING_MODES))
def test_gateway_shapes_render_their_processing_mode(body_mode: str, response_path: str,
                                                     tmp_path: Path) -> None:
    """Lean (the default: response headers only, no response body or trailers) and GIE's
    inline shape, each with one ext_proc filter Envoy accepts."""
    config = render_envoy_config(listen_port=1001, epp_port=1002, admin_port=1003,
                                 body_mode=body_mode, response_path=response_path)
    if response_path == "lean":
        assert config == render_envoy_config(listen_port=1001, epp_port=1002,
                                             admin_port=1003, body_mode=body_mode)
    hcm = yaml.safe_load(config)["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.ext_proc",
                                                        "envoy.filters.http.router"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["processing_mode"] == _PROCESSING_MODES[(body_mode, response_path)]
    assert "initial_metadata" not in ext_proc["grpc_service"]
    assert ext_proc["response_attributes"] == ["response.flags", "upstream.address"]
    path = tmp_path / "envoy.yaml"
    path.write_text(config)
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("body_mode", BODY_MODES)
def test_observer_response_path_renders_two_filters_envoy_accepts(body_mode: str,
                                                                   tmp_path: Path) -> None:
    config = render_envoy_config(listen_port=1001, epp_port=1002, admin_port=1003,
                                 body_mode=body_mode, response_path="observer")
    hcm = yaml.safe_load(config)["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.ext_proc"] * 2 + ["envoy.filters.http.router"]
    route, observe = (f["typed_config"] for f in hcm["http_filters"][:2])
    assert route["grpc_service"]["initial_metadata"] == [
        {"key": "x-epp-response-path", "value": "observer"}]
    assert route["processing_mode"]["request_body_mode"] == body_mode
    assert (route["processing_mode"]["response_header_mode"],
            route["processing_mode"]["response_body_mode"],
            route["processing_mode"]["response_trailer_mode"]) == ("SKIP", "NONE", "SKIP")
    assert observe["observability_mode"] is True and "initial_metadata" not in \
        observe["grpc_service"]
    assert observe["processing_mode"]["request_header_mode"] == "SEND"
    path = tmp_path / "envoy.yaml"
    path.write_text(config)
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    with pytest.raises(ValueError, match="response_path"):
        render_envoy_config(listen_port=1, epp_port=2, admin_port=3, response_path="both")


def test_unknown_body_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="body_mode"):
        render_envoy_config(listen_port=1, epp_port=2, admin_port=3, body_mode="STREAMED")
    with pytest.raises(ValueError):
        render_envoy_config(listen_port=0, epp_port=2, admin_port=3)
    with pytest.raises(ValueError):
        render_envoy_config(listen_port=1, epp_port=2, admin_port=3, epp_keepalive_s=0)


# ---------------------------------------------------------------- process lifecycle


async def test_envoy_process_starts_ready_and_stops(tmp_path: Path) -> None:
    config, _ = _render("FULL_DUPLEX_STREAMED")
    config2, ports2 = _render("BUFFERED")
    async with EnvoyProcess() as envoy, EnvoyProcess() as envoy2:
        # Two at once: they must not collide on Envoy's base id / shared memory.
        await envoy.start(config, tmp_path / "a", concurrency=1)
        await envoy2.start(config2, tmp_path / "b", concurrency=1)
        await asyncio.gather(envoy.wait_ready(), envoy2.wait_ready())
        assert envoy.process is not None and envoy2.process is not None
        pid, pid2 = envoy.process.pid, envoy2.process.pid
        assert pid is not None and pid2 is not None
        assert _pid_alive(pid) and _pid_alive(pid2)
        assert (tmp_path / "a" / "envoy.yaml").read_text() == config
        assert (tmp_path / "a" / "envoy.log").exists()
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{ports2['admin_port']}/ready"
            async with session.get(url) as resp:
                assert resp.status == 200
    assert envoy.returncode is not None and envoy2.returncode is not None
    assert not _pid_alive(pid) and not _pid_alive(pid2)
    assert await envoy.stop() == envoy.returncode  # idempotent


async def test_wait_ready_reports_an_envoy_that_exits(tmp_path: Path) -> None:
    config, _ = _render("BUFFERED")
    broken = config.replace("lb_policy: CLUSTER_PROVIDED", "lb_policy: NO_SUCH_POLICY")
    async with EnvoyProcess() as envoy:
        await envoy.start(broken, tmp_path)
        with pytest.raises(RuntimeError, match="NO_SUCH_POLICY"):
            await envoy.wait_ready(timeout=15)


# ---------------------------------------------------------------- traffic through Envoy


class _FixedPicker(pb_grpc.ExternalProcessorServicer):
    """A minimal ext_proc picker: every request goes to `destination` (envoy-notes.md 6-7).

    FULL_DUPLEX_STREAMED: the headers answer is withheld until the body is complete, then
    headers (routing mutation), then the body back as one streamed chunk, then trailers;
    response messages are passed through. BUFFERED: empty headers answer, routing in the
    body answer.
    """

    def __init__(self, destination: str, body_mode: str) -> None:
        self.destination = destination
        self.full_duplex = body_mode == "FULL_DUPLEX_STREAMED"

    def _routing(self) -> pb.CommonResponse:
        option = base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(
                key=HEADER_DESTINATION, raw_value=self.destination.encode()
            ),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        return pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=[option]), clear_route_cache=True
        )

    def _metadata(self) -> struct_pb2.Struct:
        md = struct_pb2.Struct()
        md.update({METADATA_NAMESPACE_LB: {HEADER_DESTINATION: self.destination}})
        return md

    async def Process(  # gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        body = b""
        async for req in request_iterator:
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                if req.request_headers.end_of_stream:
                    yield pb.ProcessingResponse(
                        request_headers=pb.HeadersResponse(response=self._routing()),
                        dynamic_metadata=self._metadata(),
                    )
                elif not self.full_duplex:
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif kind == "request_body":
                if not self.full_duplex:
                    yield pb.ProcessingResponse(
                        request_body=pb.BodyResponse(response=self._routing()),
                        dynamic_metadata=self._metadata(),
                    )
                    continue
                body += req.request_body.body
                if req.request_body.end_of_stream:
                    yield pb.ProcessingResponse(
                        request_headers=pb.HeadersResponse(response=self._routing()),
                        dynamic_metadata=self._metadata(),
                    )
                    for i in range(0, max(len(body), 1), 62_000):
                        piece = body[i : i + 62_000]
                        last = i + 62_000 >= len(body)
                        yield pb.ProcessingResponse(
                            request_body=pb.BodyResponse(
                                response=pb.CommonResponse(
                                    body_mutation=pb.BodyMutation(
                                        streamed_response=pb.StreamedBodyResponse(
                                            body=piece, end_of_stream=last
                                        )
                                    )
                                )
                            )
                        )
            elif kind == "request_trailers":
                yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind == "response_body":
                if self.full_duplex:
                    chunk = req.response_body
                    yield pb.ProcessingResponse(
                        response_body=pb.BodyResponse(
                            response=pb.CommonResponse(
                                body_mutation=pb.BodyMutation(
                                    streamed_response=pb.StreamedBodyResponse(
                                        body=chunk.body, end_of_stream=chunk.end_of_stream
                                    )
                                )
                            )
                        )
                    )
                else:
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
            elif kind == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


@pytest.mark.parametrize("response_path", ["lean", "inline"])
@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_traffic_routes_through_ext_proc(body_mode: str, response_path: str,
                                               tmp_path: Path) -> None:
    sim_port = free_port()
    config, ports = _render(body_mode, max_body_bytes=16 << 20, message_timeout_s=10,
                            response_path=response_path)
    base = f"http://127.0.0.1:{ports['listen_port']}"
    timeout = aiohttp.ClientTimeout(total=30)

    async with serving("127.0.0.1", [sim_port], "m", config=SUITE_SIM_CONFIG) as (sim,), \
            EnvoyProcess() as envoy:
        await envoy.start(config, tmp_path)
        await envoy.wait_ready()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            # EPP down (nothing listening): fail closed with a 500, nothing reaches a pod.
            # (Do not bind the EPP port before serving: a port that accepts TCP but never
            # speaks HTTP/2 stalls FULL_DUPLEX_STREAMED requests, see render_envoy_config.)
            async with session.post(f"{base}/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == 500
            assert len(sim.app[STATE_KEY].requests) == 0

            server = grpc.aio.server()
            pb_grpc.add_ExternalProcessorServicer_to_server(
                _FixedPicker(f"127.0.0.1:{sim_port}", body_mode), server
            )
            server.add_insecure_port(f"127.0.0.1:{ports['epp_port']}")
            await server.start()
            try:
                # A 3 MB body (over Envoy's 1 MiB default buffer) arrives intact; a client's
                # own destination header does not decide the route.
                payload = b'{"model": "m", "prompt": "' + b"w " * (3 << 19) + b'"}'
                async with session.post(
                    f"{base}/v1/completions",
                    data=payload,
                    headers={"content-type": "application/json", HEADER_DESTINATION: "127.0.0.1:1"},
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers[SIM_SERVER_HEADER] == f"sim-{sim_port}"
                    assert (await resp.json())["usage"]["prompt_tokens"] == 3 << 19
                async with session.get(f"http://127.0.0.1:{sim_port}/debug/requests") as resp:
                    record = (await resp.json())[-1]
                assert record["body_sha256"] == hashlib.sha256(payload).hexdigest()
                assert record["headers"][HEADER_DESTINATION] == f"127.0.0.1:{sim_port}"

                # SSE streams through with every event.
                async with session.post(
                    f"{base}/v1/chat/completions",
                    json={
                        "model": "m",
                        "stream": True,
                        "max_tokens": 5,
                        "stream_options": {"include_usage": True},
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                ) as resp:
                    assert resp.status == 200
                    text = await resp.text()
                assert text.count("data: ") == 1 + 5 + 1 + 1
                assert text.rstrip().endswith("data: [DONE]")

                # No body: routed from headers alone.
                async with session.get(f"{base}/v1/models") as resp:
                    assert resp.status == 200
                    assert resp.headers[SIM_SERVER_HEADER] == f"sim-{sim_port}"
            finally:
                await server.stop(grace=None)


async def test_keepalive_fails_requests_to_a_mute_epp(tmp_path: Path) -> None:
    """An EPP port that accepts TCP but never speaks HTTP/2 would stall FULL_DUPLEX
    requests forever; the keepalive turns that into a prompt 500."""
    config, ports = _render("FULL_DUPLEX_STREAMED", epp_keepalive_s=0.5)
    mute = socket.socket()
    mute.bind(("127.0.0.1", ports["epp_port"]))
    mute.listen(16)  # the kernel completes handshakes; nobody ever reads
    try:
        async with EnvoyProcess() as envoy:
            await envoy.start(config, tmp_path)
            await envoy.wait_ready()
            base = f"http://127.0.0.1:{ports['listen_port']}"
            timeout = aiohttp.ClientTimeout(total=20)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(f"{base}/v1/completions", json={"prompt": "x"}) as resp,
            ):
                assert resp.status == 500
    finally:
        mute.close()
