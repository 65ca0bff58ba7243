"""E/P/D through real Envoy (issue 18): llm-d-router v0.10.0's shipped E/P/D configs
(tests/fixtures/llm-d-router-v0.10.0/deploy/config/sim-e-p-d-epp-config.yaml and
sim-e-pd-epp-config.yaml) in `epp serve`, in front of `epp sim` pods labelled
``llm-d.ai/role`` encode, prefill and decode; the decode pods play llm-d's decode sidecar
(pkg/sidecar/proxy/chat_completions.go, connector_ec_common.go, connector_ec_nixl.go),
the encode pods llm-d's encoder-only simulator.

An image request is encoded by an encode pod (the EPP names it in
``x-encoder-hosts-ports``), prefilled by a prefill pod (E/P/D only:
``x-prefiller-host-port``) and decoded, streamed back through Envoy, by a decode pod; a
text request skips the encode stage.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from epp import keys
from epp.sim.sidecar import mm_hash
from epp.stack.pd import PdLayout, PdPod, PdStack
from epp.stack.procs import free_port

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parents[1] / "fixtures" / "llm-d-router-v0.10.0" / "deploy" / "config"
CONFIGS = {"E/P/D": FIXTURES / "sim-e-p-d-epp-config.yaml",
           "E/PD": FIXTURES / "sim-e-pd-epp-config.yaml"}
ENCODERS = keys.HEADER_ENCODERS
PREFILLER = keys.HEADER_PREFILLER
ENCODE_MS = 30.0
DECODE_STEP_MS = 25.0
MAX_TOKENS = 8


def layout() -> PdLayout:
    """Two encode pods, one prefill pod, two decode pods, each on its own node."""
    args: dict[str, tuple[str, ...]] = {
        "encode": ("--encode-ms-per-image", str(ENCODE_MS), "--decode-base-ms", "5"),
        "prefill": ("--prefill-ms-per-token", "0.05", "--decode-base-ms", "5"),
        "decode": ("--prefill-ms-per-token", "0.05", "--decode-base-ms", str(DECODE_STEP_MS)),
    }
    pods: list[PdPod] = []
    nodes: dict[str, dict[str, str]] = {}
    used: set[int] = set()
    for role, count in (("encode", 2), ("prefill", 1), ("decode", 2)):
        for i in range(count):
            port = free_port()
            while port in used:
                port = free_port()
            used.add(port)
            node = f"node-{role}-{i}"
            nodes[node] = {keys.LABEL_HOSTNAME: node, keys.LABEL_RACK: "rack-1"}
            pods.append(PdPod(role, "rack-1", port, f"epd-{role}-{i}", node,
                              {keys.LABEL_ROLE: role}, args[role]))
    return PdLayout(pods, nodes)


@pytest_asyncio.fixture(scope="module", params=list(CONFIGS))
async def epd(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, PdStack]]:
    name: str = request.param
    stack = PdStack(tmp_path_factory.mktemp("epd"), layout(), config_file=CONFIGS[name],
                    log_level="info")
    await stack.start()
    try:
        yield name, stack
    finally:
        await stack.stop()


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


def words(tag: str, n: int = 40) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def body(text: str, *images: str) -> dict[str, Any]:
    content: Any = [{"type": "text", "text": text}, *(image(u) for u in images)] \
        if images else text
    return {"model": "sim-model", "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": content}]}


async def stream(session: aiohttp.ClientSession, stack: PdStack,
                 data: dict[str, Any]) -> tuple[str, list[float], bytes]:
    """One streamed chat completion through Envoy: (serving pod's key, arrival times of
    the token events, the whole body)."""
    times: list[float] = []
    raw = b""
    async with session.post(f"{stack.url}/v1/chat/completions", json=data) as r:
        assert r.status == 200, await r.text()
        assert r.headers["content-type"].startswith("text/event-stream")
        server = r.headers["x-sim-server"]
        async for chunk in r.content.iter_any():
            raw += chunk
            times.extend([time.monotonic()] * chunk.count(b'"content":" tok'))
    return "127.0.0.1:" + server.removeprefix("sim-"), times, raw


async def records(session: aiohttp.ClientSession, key: str) -> list[dict[str, Any]]:
    async with session.get(f"http://{key}/debug/requests") as r:
        data: list[dict[str, Any]] = await r.json()
    return data


async def encode_stats(session: aiohttp.ClientSession, key: str) -> dict[str, Any]:
    async with session.get(f"http://{key}/debug/state") as r:
        data: dict[str, Any] = (await r.json())["encode"]
    return data


def keys_of(stack: PdStack, role: str) -> set[str]:
    return {p.key for p in stack.layout.by_role(role)}


async def test_image_request_is_encoded_prefilled_and_decoded(
        epd: tuple[str, PdStack], session: aiohttp.ClientSession) -> None:
    name, stack = epd
    await stack.clear_debug(session)
    decisions = await stack.decisions(session)
    urls = ("https://example.com/cat.png", "https://example.com/dog.png")
    decode, times, raw = await stream(session, stack, body(words("img"), *urls))

    # Decoded by a decode pod, streamed through Envoy token by token.
    assert decode in keys_of(stack, "decode")
    assert raw.count(b'"content":" tok') == MAX_TOKENS
    assert b'"usage"' in raw and raw.rstrip().endswith(b"data: [DONE]")
    # The tokens came as their steps ended (25 ms apart), not in one buffered piece.
    assert times[-1] - times[0] >= (MAX_TOKENS - 1) * DECODE_STEP_MS / 1000 * 0.5, times

    rec = (await records(session, decode))[-1]
    encoders = rec["headers"][ENCODERS].split(",")
    assert encoders and set(encoders) <= keys_of(stack, "encode")
    assert rec["encode"]["items"] == 2 and rec["encode"]["status"] == [200, 200]
    assert rec["encode"]["fallback"] is False
    assert "encoded" not in rec  # the decode pod did not encode the images itself

    # Each image went to an encode pod (item i to entry i mod n), as a one-token,
    # non-streaming request holding only that image.
    seen: dict[str, list[dict[str, Any]]] = {}
    for key in keys_of(stack, "encode"):
        seen[key] = await records(session, key)
    want = {key: 0 for key in seen}
    for i in range(len(urls)):
        want[encoders[i % len(encoders)]] += 1
    assert {key: len(recs) for key, recs in seen.items()} == want, (encoders, seen)
    for recs in seen.values():
        for r in recs:
            assert r["fields"] == {"model": "sim-model", "stream": False, "max_tokens": 1}
            assert r["encoded"] == {"items": 1, "encode_ms": ENCODE_MS}
    stats = [await encode_stats(session, k) for k in keys_of(stack, "encode")]
    assert sum(s["items"] for s in stats) >= 2

    prefill = next(iter(keys_of(stack, "prefill")))
    if name == "E/P/D":
        # Prefilled by the prefill pod, with the encode pods' ec_transfer_params.
        assert rec["headers"][PREFILLER] == prefill
        assert rec["pd"]["status"] == 200 and rec["pd"]["fallback"] is False
        prec = (await records(session, prefill))[-1]
        assert set(prec["fields"]["ec_transfer_params"]) == {mm_hash(image(u)) for u in urls}
        assert prec["fields"]["max_tokens"] == 1 and prec["fields"]["stream"] is False
        assert prec["fields"]["cache_hit_threshold"] == 0
        assert "encoded" not in prec  # the prefill pod read the encoder output
        kind = "encode-prefill-decode"
    else:
        # E/PD: no prefill stage; the decode pod prefilled locally.
        assert PREFILLER not in rec["headers"] and "pd" not in rec
        assert await records(session, prefill) == []
        kind = "encode-decode"
    after = await stack.decisions(session)
    assert after.get(kind, 0) == decisions.get(kind, 0) + 1, after


async def test_text_request_skips_encode(
        epd: tuple[str, PdStack], session: aiohttp.ClientSession) -> None:
    name, stack = epd
    await stack.clear_debug(session)
    decode, _, raw = await stream(session, stack, body(words("txt")))
    assert decode in keys_of(stack, "decode")
    assert raw.count(b'"content":" tok') == MAX_TOKENS and raw.rstrip().endswith(b"[DONE]")
    rec = (await records(session, decode))[-1]
    assert ENCODERS not in rec["headers"] and "encode" not in rec and "encoded" not in rec
    for key in keys_of(stack, "encode"):
        assert await records(session, key) == []  # no encode pod saw anything
    if name == "E/P/D":  # 40 words: over nonCachedTokens 16, so prefilled remotely
        assert rec["headers"][PREFILLER] in keys_of(stack, "prefill")
    else:
        assert PREFILLER not in rec["headers"]


async def test_a_spoofed_encoder_header_is_removed(
        epd: tuple[str, PdStack], session: aiohttp.ClientSession) -> None:
    _, stack = epd
    await stack.clear_debug(session)
    data = body(words("spoof"))
    async with session.post(f"{stack.url}/v1/chat/completions", json=data,
                            headers={ENCODERS: "127.0.0.1:9"}) as r:
        assert r.status == 200
        decode = "127.0.0.1:" + r.headers["x-sim-server"].removeprefix("sim-")
        await r.read()
    # Envoy drops the client's routing header; the EPP set none for a text request.
    assert ENCODERS not in (await records(session, decode))[-1]["headers"]
