"""GIE v1.5.0 test/integration/epp/request_attribute_reporter_test.go and
request_attribute_reporter_streaming_test.go (config: testdata/
request-attribute-reporter-config.yaml, copied under tests/fixtures/gie-v1.5.0) through real
Envoy → `epp serve` → a fake pod.

Go reads the ``ProcessingResponse`` that answers the last response body message and finds
``dynamic_metadata["envoy.lb"]["x-gateway-inference-request-cost"] == 10`` (the response's
``usage.completion_tokens``). Here the same metadata must reach Envoy: Envoy's access log
(tests/integration/gie_harness.py) writes the ``envoy.lb`` dynamic metadata each request
ended with, and the test reads the cost there — a number, next to the routing metadata the
EPP set on the request (``x-gateway-destination-endpoint``), which Envoy keeps.

Beyond Go's two cases: both request body modes (FULL_DUPLEX_STREAMED, BUFFERED: there the
response body is STREAMED, not full duplex), a gRPC response (``vllmgrpc-parser``: the
usage comes in the last message and the response ends with trailers), and a response
without usage (nothing reported, the routing metadata alone).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from epp.parsing import vllm_grpc as g
from tests.integration.gie_harness import (
    FIXTURES,
    GENERATE,
    MODEL_MY_TARGET,
    TEST_NAMESPACE,
    GrpcReply,
    P,
    Reply,
    Stack,
    client_session,
    llm_body,
    llm_headers,
    send,
    stacks,
)

pytestmark = pytest.mark.integration

CONFIG = (FIXTURES / "test/integration/epp/testdata/"
          "request-attribute-reporter-config.yaml").read_text()
COST = "x-gateway-inference-request-cost"
DESTINATION = "x-gateway-destination-endpoint"
BODY_MODES = ["FULL_DUPLEX_STREAMED", "BUFFERED"]

# request_attribute_reporter_test.go's response.
JSON_RESPONSE = (
    b'{"choices":[{"finish_reason":"stop","index":0,"logprobs":null,"message":{"content":'
    b'"Hello! How can I help you today?","role":"assistant"}}],"created":1773675992,"id":'
    b'"chatcmpl-63a9a231-a267-4d15-a799-39e9dceef8a5","model":"modelName","object":'
    b'"chat.completion","usage":{"completion_tokens":10,"prompt_tokens":32,'
    b'"total_tokens":42}}')

# request_attribute_reporter_streaming_test.go's response, chunk by chunk (each event
# ends in one newline, as Go's).
SSE_CHUNKS = (
    (b'data: {"choices":[{"delta":{"content":"Hello! "},"index":0,"finish_reason":null}],'
     b'"id":"123","created":1,"model":"modelName","object":"chat.completion.chunk"}\n'),
    (b'data: {"choices":[{"delta":{},"index":0,"finish_reason":"stop"}],"id":"123",'
     b'"created":1,"model":"modelName","object":"chat.completion.chunk","usage":'
     b'{"completion_tokens":10,"prompt_tokens":32,"total_tokens":42}}\n'),
    b"data: [DONE]\n",
)


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Any]:
    async with stacks(tmp_path) as s:
        yield s.start


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with client_session() as s:
        yield s


async def hello(session: aiohttp.ClientSession, h: Stack, request_id: str) -> bytes:
    """Go's ReqLLM(reqLogger, "hello", "modelName", "modelName"); returns the body the
    client got."""
    headers = {**llm_headers("modelName", "modelName"), "x-request-id": request_id}
    status, _, body = await send(session, h, headers, llm_body("hello", "modelName"))
    assert status == 200, body[:300]
    return body


@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_request_attribute_reporter(stack: Any, session: aiohttp.ClientSession,
                                          body_mode: str) -> None:
    h = await stack([P(0, 0.1, MODEL_MY_TARGET)], CONFIG, Reply((JSON_RESPONSE,)),
                    body_mode=body_mode)
    assert await hello(session, h, "reporter-json") == JSON_RESPONSE
    entry = await h.access_entry("reporter-json")
    assert entry["lb"] == {DESTINATION: h.key(0), COST: 10}, entry


@pytest.mark.parametrize("body_mode", BODY_MODES)
async def test_request_attribute_reporter_streaming(stack: Any,
                                                    session: aiohttp.ClientSession,
                                                    body_mode: str) -> None:
    h = await stack([P(0, 0.1, MODEL_MY_TARGET)], CONFIG,
                    Reply(SSE_CHUNKS, content_type="text/event-stream"), body_mode=body_mode)
    assert await hello(session, h, "reporter-sse") == b"".join(SSE_CHUNKS)
    entry = await h.access_entry("reporter-sse")
    assert entry["lb"] == {DESTINATION: h.key(0), COST: 10}, entry


async def test_no_usage_reports_nothing(stack: Any, session: aiohttp.ClientSession) -> None:
    """The condition ``has(usage.completion_tokens)`` holds (GIE's usage always has the
    field), the value is 0: GIE writes no zero, so Envoy has the routing metadata only."""
    h = await stack([P(0, 0.1, MODEL_MY_TARGET)], CONFIG, Reply((b'{"choices":[]}',)))
    await hello(session, h, "reporter-none")
    entry = await h.access_entry("reporter-none")
    assert entry["lb"] == {DESTINATION: h.key(0)}, entry


GRPC_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: queue-scorer
  - type: vllmgrpc-parser
  - name: total-tokens-cost-reporter
    type: request-attribute-reporter
    parameters:
      attributes:
        - key:
            namespace: envoy.lb
            name: x-gateway-inference-request-cost
          expression: usage.prompt_tokens + usage.completion_tokens
          condition: "has(usage.completion_tokens)"
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
      - pluginRef: total-tokens-cost-reporter
parser:
  pluginRef: vllmgrpc-parser
featureGates:
  - enableLegacyMetrics
"""


async def test_grpc_response_metadata_rides_on_the_trailers(stack: Any) -> None:
    """A gRPC response ends with trailers, after its last body chunk went back: the
    metadata rides on the trailers answer (GIE: on the body answer it sends just before
    it); Envoy keeps it all the same. Cost = prompt 7 + completion 10."""
    chunk = g.GenerateResponse(chunk=g.message_class("GenerateStreamChunk")(
        token_ids=[1, 2, 3])).SerializeToString()
    complete = g.GenerateResponse(complete=g.message_class("GenerateComplete")(
        prompt_tokens=7, completion_tokens=10)).SerializeToString()
    h = await stack([P(0, 0.1)], GRPC_CONFIG, grpc_reply=GrpcReply(generate=(chunk, complete)),
                    layout="addresses")
    async with grpc.aio.insecure_channel(h.target) as channel:
        generate: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = \
            channel.unary_stream(GENERATE)
        replies = [r async for r in generate(
            g.GenerateRequest(text="hello", stream=True).SerializeToString(),
            metadata=(("x-request-id", "reporter-grpc"),), timeout=20)]
    assert replies == [chunk, complete]
    entry = await h.access_entry("reporter-grpc")
    assert entry["lb"] == {DESTINATION: h.key(0), COST: 17}, entry


@pytest.mark.parametrize("accepted", [True, False], ids=["accepted", "not-accepted"])
async def test_other_namespace_needs_the_gateways_consent(
        stack: Any, session: aiohttp.ClientSession, accepted: bool) -> None:
    """A reporter's own namespace reaches Envoy only when the ext_proc filter lists it in
    ``metadata_options.receiving_namespaces`` (docs/configuration.md); otherwise Envoy
    drops it (the routing metadata in ``envoy.lb`` is unaffected)."""
    config = CONFIG.replace("namespace: envoy.lb", f"namespace: {TEST_NAMESPACE}")
    assert TEST_NAMESPACE in config
    h = await stack([P(0, 0.1, MODEL_MY_TARGET)], config, Reply((JSON_RESPONSE,)),
                    receive=[TEST_NAMESPACE] if accepted else [])
    await hello(session, h, "reporter-ns")
    entry = await h.access_entry("reporter-ns")
    assert entry["lb"] == {DESTINATION: h.key(0)}, entry
    assert entry["test"] == ({COST: 10} if accepted else None), entry
