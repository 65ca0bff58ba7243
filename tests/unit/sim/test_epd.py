"""The simulator's E/P/D mode (issue 18) and its Anthropic Messages route.

- ``epp sim --role encode``: an encoder-only pod (vLLM ``--mm-encoder-only``, as llm-d's
  inference simulator plays it): one token, each multimodal item priced at
  ``encode_ms_per_image``, ``ec_transfer_params`` keyed by the item's hash.
- ``--role decode`` with ``x-encoder-hosts-ports``: llm-d's decode sidecar
  (llm-d-router v0.10.0 pkg/sidecar/proxy/connector_ec_common.go, connector_ec_nixl.go)
  sends each item to an encode pod (round-robin, one request each), then prefills
  (remotely with ``x-prefiller-host-port``, else locally) without encoding again.
- ``POST /v1/messages``: Anthropic's Messages API, read as a chat request.

Real servers on 127.0.0.1 (aiohttp test servers).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from epp.sim.app import build_app
from epp.sim.config import SimConfig
from epp.sim.options import build_parser, config_from_args
from epp.sim.sidecar import EC_SIZE_BYTES, encoder_request, mm_hash, mm_items

MODEL = "m"
Client = TestClient[Any, Any]
ENCODERS = "x-encoder-hosts-ports"
PREFILLER = "x-prefiller-host-port"
FAST = SimConfig(time_scale=0.0)


@asynccontextmanager
async def pod(config: SimConfig, name: str) -> AsyncIterator[Client]:
    async with TestClient(TestServer(build_app(name, MODEL, config=config))) as c:
        yield c


def key(c: Client) -> str:
    return f"127.0.0.1:{c.server.port}"


async def log(c: Client) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = await (await c.get("/debug/requests")).json()
    return data


async def encode_stats(c: Client) -> dict[str, Any]:
    data: dict[str, Any] = (await (await c.get("/debug/state")).json())["encode"]
    return data


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts: Any, text: str = "what is in these pictures", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 3, **extra, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": text}, *parts]}]}


# ----------------------------------------------------------------- helpers


def test_mm_items_follow_llmd_sidecar() -> None:
    body = chat(image("a"), {"type": "input_audio", "input_audio": {"data": "x"}},
                image("a"), {"type": "video_url", "video_url": {"url": "v"}},
                {"type": "input_audio", "input_audio": {"data": "x"}},
                {"type": "image", "source": {}}, "text part", 3)
    kinds = [i["type"] for i in mm_items(body)]
    # the repeated URL counts once; inline items all count; other types are not media
    assert kinds == ["image_url", "input_audio", "video_url", "input_audio"]
    for other in ({}, {"messages": "x"}, {"messages": [1, {"content": "text"}]},
                  {"prompt": "x"}):
        assert mm_items(other) == []
    assert mm_hash(image("a")) == mm_hash({"type": "image_url", "image_url": {"url": "a"}})
    assert mm_hash(image("a")) != mm_hash(image("b"))


def test_encoder_request_is_llmd_build_encoder_request() -> None:
    body = chat(image("a"), image("b"), stream=True, stream_options={"include_usage": True},
                max_completion_tokens=9)
    out = encoder_request(body, image("b"))
    assert out["messages"] == [{"role": "user", "content": [image("b")]}]
    assert (out["max_tokens"], out["max_completion_tokens"], out["stream"]) == (1, 1, False)
    assert "stream_options" not in out and body["stream"] is True  # the original unchanged
    assert "max_completion_tokens" not in encoder_request(chat(image("a")), image("a"))


# ----------------------------------------------------------------- encode role


async def test_encode_pod_answers_one_token_and_ec_transfer_params() -> None:
    async with pod(SimConfig(role="encode", time_scale=0.0), "enc") as enc:
        resp = await enc.post("/v1/chat/completions", json=chat(image("u1"), max_tokens=50))
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        assert body["usage"]["completion_tokens"] == 1
        ec = body["ec_transfer_params"]
        assert list(ec) == [mm_hash(image("u1"))]
        assert ec[mm_hash(image("u1"))]["peer_port"] == enc.server.port
        assert ec[mm_hash(image("u1"))]["size_bytes"] == EC_SIZE_BYTES
        stats = await encode_stats(enc)
        assert (stats["requests"], stats["items"]) == (1, 1)
        assert stats["encode_ms"] == SimConfig().encode_ms_per_image
        assert (await log(enc))[-1]["encoded"]["items"] == 1
        # a text request: nothing to encode, no params
        body = await (await enc.post("/v1/chat/completions", json=chat())).json()
        assert body["ec_transfer_params"] == {} and (await encode_stats(enc))["items"] == 1


async def test_encode_cost_is_per_item_in_the_admitting_step() -> None:
    cfg = SimConfig(role="encode", encode_ms_per_image=150.0, prefill_ms_per_token=0.0,
                    decode_base_ms=0.0, decode_per_seq_ms=0.0)
    async with pod(cfg, "enc") as enc:
        t0 = time.perf_counter()
        assert (await enc.post("/v1/chat/completions", json=chat())).status == 200
        text_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert (await enc.post("/v1/chat/completions",
                               json=chat(image("a"), image("b")))).status == 200
        two_s = time.perf_counter() - t0
    assert text_s < 0.15 and 0.3 <= two_s < 2.0


async def test_a_monolithic_pod_encodes_locally_but_not_what_was_encoded() -> None:
    async with pod(FAST, "both") as c:
        assert (await c.post("/v1/chat/completions", json=chat(image("a"), image("b")))).status \
            == 200
        assert (await log(c))[-1]["encoded"] == {"items": 2,
                                                 "encode_ms": 2 * FAST.encode_ms_per_image}
        params = {"h": {"peer_host": "x", "peer_port": 1}}
        assert (await c.post("/v1/chat/completions",
                             json=chat(image("a"), ec_transfer_params=params))).status == 200
        rec = (await log(c))[-1]
        assert "encoded" not in rec and rec["fields"]["ec_transfer_params"] == params
        assert (await encode_stats(c))["items"] == 2


# ----------------------------------------------------------------- decode sidecar


async def test_decode_sidecar_fans_items_out_round_robin() -> None:
    async with pod(SimConfig(role="encode", time_scale=0.0), "e1") as e1, \
            pod(SimConfig(role="encode", time_scale=0.0), "e2") as e2, \
            pod(SimConfig(role="decode", time_scale=0.0), "d") as d:
        hdr = {ENCODERS: f"{key(e1)}, {key(e2)}"}
        body = chat(image("a"), image("b"), image("a"), image("c"), stream=True,
                    stream_options={"include_usage": True})
        resp = await d.post("/v1/chat/completions", json=body, headers=hdr)
        assert resp.status == 200
        raw = await resp.read()
        assert raw.rstrip().endswith(b"data: [DONE]")
        assert raw.count(b'"content":" tok') == 3  # decoded locally, streamed
        e1_log, e2_log = await log(e1), await log(e2)
        assert len(e1_log) == 2 and len(e2_log) == 1  # items 0 and 2 to e1, item 1 to e2
        for rec in e1_log + e2_log:
            assert rec["fields"] == {"model": MODEL, "stream": False, "max_tokens": 1}
            assert rec["headers"]["x-request-id"].rsplit("-enc-", 1)[1] in {"0", "1", "2"}
        drec = (await log(d))[-1]
        assert drec["encode"]["encoders"] == [key(e1), key(e2)]
        assert drec["encode"]["items"] == 3 and drec["encode"]["status"] == [200, 200, 200]
        assert "encoded" not in drec  # the decode pod encoded nothing itself
        stats = await encode_stats(d)
        assert (stats["remote_requests"], stats["remote_items"], stats["items"]) == (1, 3, 0)
        assert stats["by_encoder"] == {key(e1): 2, key(e2): 1}
        assert (await encode_stats(e1))["items"] == 2 and (await encode_stats(e2))["items"] == 1


async def test_epd_encode_then_remote_prefill_then_decode() -> None:
    async with pod(SimConfig(role="encode", time_scale=0.0), "e") as e, \
            pod(SimConfig(role="prefill", time_scale=0.0), "p") as p, \
            pod(SimConfig(role="decode", time_scale=0.0), "d") as d:
        hdr = {ENCODERS: key(e), PREFILLER: key(p)}
        resp = await d.post("/v1/chat/completions", json=chat(image("a"), image("b")),
                            headers=hdr)
        assert resp.status == 200
        assert (await resp.json())["usage"]["completion_tokens"] == 3
        prec = (await log(p))[-1]
        assert set(prec["fields"]["ec_transfer_params"]) == {mm_hash(image("a")),
                                                             mm_hash(image("b"))}
        assert prec["fields"]["cache_hit_threshold"] == 0
        assert prec["fields"]["max_tokens"] == 1
        assert "encoded" not in prec  # the prefill pod read the encoder output
        drec = (await log(d))[-1]
        assert drec["pd"]["status"] == 200 and drec["encode"]["status"] == [200, 200]
        assert (await encode_stats(p))["items"] == 0 and (await encode_stats(e))["items"] == 2


async def test_text_request_skips_the_encoders() -> None:
    async with pod(SimConfig(role="encode", time_scale=0.0), "e") as e, \
            pod(SimConfig(role="decode", time_scale=0.0), "d") as d:
        resp = await d.post("/v1/chat/completions", json=chat(), headers={ENCODERS: key(e)})
        assert resp.status == 200
        assert await log(e) == []
        rec = (await log(d))[-1]
        assert rec["encode"]["items"] == 0 and "cache_hit_threshold" not in rec["fields"]


async def test_encode_pod_failure_is_502_or_a_local_encode() -> None:
    bad = SimConfig(role="encode", error_rate=1.0, time_scale=0.0)
    async with pod(bad, "e") as e, pod(SimConfig(role="decode", time_scale=0.0), "d") as d:
        resp = await d.post("/v1/chat/completions", json=chat(image("a")),
                            headers={ENCODERS: key(e)})
        assert resp.status == 502
        assert f"encode pod {key(e)} answered 500" in (await resp.json())["error"]["message"]
        assert (await encode_stats(d))["failures"] == 1
    async with pod(bad, "e") as e, \
            pod(SimConfig(role="decode", encode_failure="fallback", time_scale=0.0), "d") as d:
        resp = await d.post("/v1/chat/completions", json=chat(image("a")),
                            headers={ENCODERS: f"{key(e)},nonsense"})
        assert resp.status == 200
        rec = (await log(d))[-1]
        assert rec["encode"]["fallback"] is True and rec["encoded"]["items"] == 1
        stats = await encode_stats(d)
        assert (stats["failures"], stats["fallbacks"], stats["items"]) == (1, 1, 1)


# ----------------------------------------------------------------- options


def test_cli_encode_options() -> None:
    args = build_parser().parse_args(["--port", "1", "--role", "encode",
                                      "--encode-ms-per-image", "3.5",
                                      "--encode-failure", "fallback"])
    cfg = config_from_args(args)
    assert (cfg.role, cfg.encode_ms_per_image, cfg.encode_failure) == ("encode", 3.5,
                                                                        "fallback")
    default = config_from_args(build_parser().parse_args(["--port", "1"]))
    assert (default.role, default.encode_failure) == ("both", "error")
    with pytest.raises(ValueError, match="encode_ms_per_image must be >= 0"):
        SimConfig(encode_ms_per_image=-1)
    with pytest.raises(ValueError, match="encode_failure must be one of"):
        SimConfig(encode_failure="retry")  # type: ignore[arg-type]  # an invalid value on purpose


# ----------------------------------------------------------------- /v1/messages


ANTHROPIC = {"model": MODEL, "max_tokens": 4, "system": "be brief",
             "messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]}


async def test_messages_answers_anthropic_shapes() -> None:
    async with pod(FAST, "a") as c:
        resp = await c.post("/v1/messages", json=ANTHROPIC)
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        assert body["type"] == "message" and body["id"].startswith("msg_")
        assert body["content"][0]["type"] == "text" and body["stop_reason"] == "max_tokens"
        assert body["usage"]["input_tokens"] == 4 and body["usage"]["output_tokens"] == 4
        resp = await c.post("/v1/messages", json={**ANTHROPIC, "stream": True})
        raw = (await resp.read()).decode()
        events = [line.removeprefix("event: ") for line in raw.splitlines()
                  if line.startswith("event: ")]
        assert events == ["message_start", "content_block_start", "ping",
                          *["content_block_delta"] * 4, "content_block_stop",
                          "message_delta", "message_stop"]
        deltas = [orjson.loads(line[6:]) for line in raw.splitlines()
                  if line.startswith("data: ")]
        assert deltas[-2]["usage"] == {"output_tokens": 4}
        assert "[DONE]" not in raw


@pytest.mark.parametrize(("body", "fragment"), [
    ({"model": MODEL, "max_tokens": 2, "messages": []}, "'messages' must be a non-empty"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "'max_tokens' is req"),
    ({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image"}]}]}, "missing required 'source'"),
    ({"model": MODEL, "max_tokens": 2, "system": 3,
      "messages": [{"role": "user", "content": "x"}]}, "'system' must be"),
])
async def test_messages_rejects_bad_bodies(body: dict[str, Any], fragment: str) -> None:
    async with pod(FAST, "a") as c:
        resp = await c.post("/v1/messages", json=body)
        assert resp.status == 400
        assert fragment in (await resp.json())["error"]["message"]
