"""llm-d-router v0.10.0's ``anthropic-parser`` and ``vertexai-parser`` through real Envoy
(issue 18), listed with the ``openai-parser`` in ``requestHandler.parsers`` (each request
goes to the parser claiming its path: llm-d's ParserRegistry).

- Anthropic Messages (``POST /v1/messages``) to `epp sim` pods, which answer it as
  llm-d's inference simulator does (``/v1/messages``, Anthropic's JSON and events).
- Vertex AI (``PredictionService/ChatCompletions``, gRPC) to in-test gRPC pods (llm-d's
  simulator serves no Vertex method): each records the request and streams
  ``google.api.HttpBody`` frames of OpenAI JSON with usage.

Either way a pod chosen by the scheduler serves the request (the same prompt twice: the
same pod, by prefix affinity), the EPP reads the usage of the answer (the inline gateway
shape: the response passes through the EPP), and a bad body is refused with a clear 4xx
before any pod sees it.

Go sources: pkg/epp/framework/plugins/requesthandling/parsers/{anthropic,vertexai}/
(README, *_test.go); pkg/epp/framework/plugins/requesthandling/registry.go.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
import pytest_asyncio
import yaml

from epp.parsing import vertexai as vx
from epp.stack.envoy import EnvoyProcess, render_envoy_config
from epp.stack.procs import ManagedProcess, free_port, wait_port
from tests.integration.conftest import ROOT, SUITE_SIM_ARGS, Epp, eventually

pytestmark = pytest.mark.integration

CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: openai-parser
- type: anthropic-parser
- type: vertexai-parser
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
requestHandler:
  parsers:
  - pluginRef: openai-parser
  - pluginRef: anthropic-parser
  - pluginRef: vertexai-parser
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
"""
SERVICE = "google.cloud.aiplatform.v1.PredictionService"
CHAT_METHOD = f"/{SERVICE}/ChatCompletions"
DEST = "x-gateway-destination-endpoint"


def words(tag: str, n: int = 300) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def start_front(tmp: Path, ports: list[int], *, grpc_upstream: bool,
                      epp_args: list[str] | None = None) -> tuple[Epp, EnvoyProcess, int]:
    """`epp serve` with CONFIG over ``ports`` and Envoy in front (GIE's inline shape:
    responses pass through the EPP); ``grpc_upstream``: the pods speak HTTP/2."""
    epp = Epp(tmp, tmp / "endpoints.yaml", config=CONFIG, extra_args=epp_args or [])
    epp.write_endpoints(ports)
    await epp.start()
    port = free_port()
    cfg = render_envoy_config(listen_port=port, epp_port=epp.grpc_port, admin_port=free_port(),
                              body_mode="FULL_DUPLEX_STREAMED", response_path="inline")
    if grpc_upstream:
        doc = yaml.safe_load(cfg)
        for cluster in doc["static_resources"]["clusters"]:
            if cluster["name"] == "original_destination_cluster":
                cluster["typed_extension_protocol_options"] = {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                                 "HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}}}
        cfg = yaml.safe_dump(doc, sort_keys=False)
    envoy = EnvoyProcess()
    try:
        await envoy.start(cfg, tmp)
        await envoy.wait_ready()
    except BaseException:
        await envoy.stop()
        await epp.stop()
        raise
    return epp, envoy, port


async def affinity(send: Any, prompts: list[str]) -> dict[str, str]:
    """Send each prompt twice; assert both landed on the same pod; prompt → pod."""
    chosen = {}
    for text in prompts:
        first = await send(text)
        assert await send(text) == first, text
        chosen[text] = first
    return chosen


# ===================================================================== Anthropic


@dataclass
class Front:
    epp: Epp
    envoy: EnvoyProcess
    port: int
    pods: list[int]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest_asyncio.fixture(scope="module")
async def anthropic(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Front]:
    tmp = tmp_path_factory.mktemp("anthropic")
    ports = [free_port() for _ in range(3)]
    argv = [sys.executable, "-m", "epp.cli", "sim", *SUITE_SIM_ARGS]
    for p in ports:
        argv += ["--port", str(p)]
    sims = ManagedProcess(argv, log_path=tmp / "sim.log", cwd=ROOT)
    await sims.start()
    try:
        for p in ports:
            await wait_port("127.0.0.1", p, timeout=20)
        epp, envoy, port = await start_front(tmp, ports, grpc_upstream=False)
        try:
            yield Front(epp, envoy, port, ports)
        finally:
            await envoy.stop()
            await epp.stop()
    finally:
        await sims.stop()


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


def message(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "max_tokens": 4, "system": "be brief",
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
            **extra}


async def records(session: aiohttp.ClientSession, port: int) -> list[dict[str, Any]]:
    async with session.get(f"http://127.0.0.1:{port}/debug/requests") as r:
        data: list[dict[str, Any]] = await r.json()
    return data


async def test_anthropic_messages_reach_the_scheduled_pod(
        anthropic: Front, session: aiohttp.ClientSession) -> None:
    async def send(text: str) -> str:
        async with session.post(f"{anthropic.url}/v1/messages", json=message(text),
                                headers={"anthropic-version": "2023-06-01"}) as r:
            body = await r.json()
            assert r.status == 200, body
            assert body["type"] == "message" and body["content"][0]["type"] == "text"
            assert body["usage"]["output_tokens"] == 4
            return str(r.headers["x-sim-server"])

    before = await anthropic.epp.metric(session, "inference_objective_input_tokens_count")
    chosen = await affinity(send, [words(f"p{i}-") for i in range(3)])
    assert set(chosen.values()) <= {f"sim-{p}" for p in anthropic.pods}
    # The pod got the Anthropic body at /v1/messages, with the EPP's destination header.
    port = int(next(iter(chosen.values())).removeprefix("sim-"))
    rec = (await records(session, port))[-1]
    assert rec["path"] == "/v1/messages" and rec["headers"][DEST] == f"127.0.0.1:{port}"
    assert rec["fields"]["max_tokens"] == 4
    # The anthropic-parser read each answer's usage (input_tokens).

    async def counted() -> bool:
        n = await anthropic.epp.metric(session, "inference_objective_input_tokens_count")
        return n >= before + 6

    await eventually(counted)


async def test_anthropic_stream_through_envoy(anthropic: Front,
                                              session: aiohttp.ClientSession) -> None:
    async with session.post(f"{anthropic.url}/v1/messages",
                            json=message(words("stream-"), stream=True)) as r:
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = [line.removeprefix("event: ") for line in raw.splitlines()
              if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.count("content_block_delta") == 4


@pytest.mark.parametrize(("body", "fragment"), [
    (orjson.dumps({"model": "sim-model", "max_tokens": 4, "messages": []}),
     "invalid messages request: must have at least one message"),
    (orjson.dumps({"model": "sim-model", "max_tokens": 4, "messages": "hi"}),
     "invalid messages request: 'messages' must be an array"),
    (b"{not json", "request body is not valid JSON"),
    (orjson.dumps({"model": "sim-model", "max_tokens": 4, "system": 7,
                   "messages": [{"role": "user", "content": "x"}]}),
     "'system' must be a string or an array of content blocks"),
])
async def test_anthropic_bad_bodies_are_4xx(anthropic: Front, session: aiohttp.ClientSession,
                                            body: bytes, fragment: str) -> None:
    seen = [len(await records(session, p)) for p in anthropic.pods]
    async with session.post(f"{anthropic.url}/v1/messages", data=body,
                            headers={"content-type": "application/json"}) as r:
        text = await r.text()
        assert r.status == 400, text
    err = orjson.loads(text)["error"]
    assert fragment in err["message"] and err["code"] == 400
    assert [len(await records(session, p)) for p in anthropic.pods] == seen  # no pod saw it


# ===================================================================== Vertex AI


@dataclass
class Seen:
    port: int
    metadata: dict[str, str]
    body: bytes


@dataclass
class GrpcPods:
    ports: list[int]
    seen: list[Seen] = field(default_factory=list)


def http_body(obj: dict[str, Any]) -> bytes:
    return bytes(vx.MESSAGES["HttpBody"](content_type="application/json",
                                         data=orjson.dumps(obj)).SerializeToString())


CHUNK = {"id": "c", "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": {"content": "hi"}}]}
USAGE = {"id": "c", "object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}}


@pytest_asyncio.fixture(scope="module")
async def vertex(tmp_path_factory: pytest.TempPathFactory
                 ) -> AsyncIterator[tuple[Front, GrpcPods]]:
    """Three Vertex-like gRPC pods (ChatCompletions streams a chunk, then the usage)."""
    pods = GrpcPods([free_port() for _ in range(3)])
    servers = []

    def handler(port: int) -> Any:
        async def chat(request: bytes, context: grpc.aio.ServicerContext[Any, Any]
                       ) -> AsyncIterator[bytes]:
            md = {k: str(v) for k, v in context.invocation_metadata() or ()}
            pods.seen.append(Seen(port, md, request))
            yield http_body(CHUNK)
            yield http_body(USAGE)
        return chat

    try:
        for port in pods.ports:
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
                SERVICE, {"ChatCompletions": grpc.unary_stream_rpc_method_handler(
                    handler(port))}),))
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            servers.append(server)
        tmp = tmp_path_factory.mktemp("vertex")
        # gRPC pods have no /metrics: routing needs no scrape.
        epp, envoy, port = await start_front(tmp, pods.ports, grpc_upstream=True,
                                             epp_args=["--no-metrics-scraping"])
        try:
            yield Front(epp, envoy, port, pods.ports), pods
        finally:
            await envoy.stop()
            await epp.stop()
    finally:
        for server in servers:
            await server.stop(None)


def vertex_request(text: str) -> bytes:
    inner = {"model": "sim-model", "stream": True,
             "messages": [{"role": "user", "content": text}]}
    req = vx.MESSAGES["ChatCompletionsRequest"](
        endpoint="projects/p/locations/l/endpoints/e",
        http_body=vx.MESSAGES["HttpBody"](content_type="application/json",
                                          data=orjson.dumps(inner)))
    return bytes(req.SerializeToString())


async def test_vertex_chat_completions_reach_the_scheduled_pod(
        vertex: tuple[Front, GrpcPods], session: aiohttp.ClientSession) -> None:
    front, pods = vertex
    before = await front.epp.metric(session, "inference_objective_input_tokens_sum")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as channel:
        call = channel.unary_stream(CHAT_METHOD)

        async def send(text: str) -> int:
            sent = vertex_request(text)
            replies = [r async for r in call(sent, timeout=20)]
            assert replies == [http_body(CHUNK), http_body(USAGE)]
            seen = pods.seen[-1]
            assert seen.body == sent  # the protobuf arrived byte for byte
            assert seen.metadata[DEST] == f"127.0.0.1:{seen.port}"
            return seen.port

        chosen = await affinity(send, [words(f"v{i}-") for i in range(3)])
    assert set(chosen.values()) <= set(pods.ports)

    async def counted() -> bool:  # the vertexai-parser read the HttpBody frames' usage
        n = await front.epp.metric(session, "inference_objective_input_tokens_sum")
        return n >= before + 6 * 11

    await eventually(counted)


@pytest.mark.parametrize(("payload", "fragment"), [
    (b"\x0a\x03abc\x12\x05\x12\x03{no",
     "parsing ChatCompletionsRequest: request body is not valid JSON"),
    (bytes(vx.MESSAGES["ChatCompletionsRequest"](endpoint="e").SerializeToString()),
     "ChatCompletionsRequest has no HttpBody"),
    (b"\xff\xff\xff", "unmarshaling ChatCompletionsRequest"),
    (bytes(vx.MESSAGES["ChatCompletionsRequest"](http_body=vx.MESSAGES["HttpBody"](
        data=orjson.dumps({"messages": "x"}))).SerializeToString()),
     "parsing ChatCompletionsRequest"),
])
async def test_vertex_bad_requests_are_refused(vertex: tuple[Front, GrpcPods],
                                               payload: bytes, fragment: str) -> None:
    front, pods = vertex
    seen = len(pods.seen)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as channel:
        call = channel.unary_stream(CHAT_METHOD)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [r async for r in call(payload, timeout=20)]
    # Envoy turns the EPP's 400 into a gRPC status carrying its message.
    assert e.value.code() is not grpc.StatusCode.OK
    assert fragment in (e.value.details() or ""), e.value.details()
    assert len(pods.seen) == seen  # no pod saw it
