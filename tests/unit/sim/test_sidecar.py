"""The simulator's P/D mode: `epp sim --role decode` as llm-d's decode sidecar.

A decode pod that receives ``x-prefiller-host-port`` first sends the named prefill pod
the request with ``max_tokens: 1`` and remote-decode ``kv_transfer_params``, then
decodes locally, pricing the pulled KV by the pair's distance. Real servers on
127.0.0.1 (aiohttp test servers); timings use generous bounds.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from epp.sim.app import build_app
from epp.sim.config import SimConfig
from epp.sim.options import build_parser, config_from_args, topology_from_args
from epp.sim.topology import PeerTopology, distance, parse_level_costs, parse_topology

MODEL = "m"
Client = TestClient[Any, Any]
HEADER = "x-prefiller-host-port"


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@asynccontextmanager
async def pod(config: SimConfig, name: str, **kw: Any) -> AsyncIterator[Client]:
    async with TestClient(TestServer(build_app(name, MODEL, config=config, **kw))) as c:
        yield c


def key(c: Client) -> str:
    return f"127.0.0.1:{c.server.port}"


async def log(c: Client) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = await (await c.get("/debug/requests")).json()
    return data


async def ttft_ms(c: Client, prompt: str, headers: dict[str, str] | None = None,
                  max_tokens: int = 2) -> tuple[float, dict[str, Any]]:
    """Stream a completion; (ms to the first token, usage)."""
    t0 = time.perf_counter()
    resp = await c.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True}}, headers=headers or {})
    assert resp.status == 200, await resp.text()
    first = None
    usage: dict[str, Any] = {}
    async for line in resp.content:
        if not line.startswith(b"data: {"):
            continue
        event = orjson.loads(line[6:])
        if event["choices"] and first is None:
            first = (time.perf_counter() - t0) * 1000
        if event.get("usage"):
            usage = event["usage"]
    assert first is not None
    return first, usage


FAST = SimConfig(time_scale=0.0)


async def test_decode_sends_the_prefill_pod_a_one_token_request() -> None:
    async with pod(SimConfig(role="prefill", time_scale=0), "p") as p, \
            pod(SimConfig(role="decode", time_scale=0), "d") as d:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a b c"}],
                "max_tokens": 5, "max_completion_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}}
        resp = await d.post("/v1/chat/completions", json=body, headers={HEADER: key(p)})
        assert resp.status == 200
        text = await resp.text()
        assert text.count('"content":" tok') == 5  # the decode pod generates every token
        (prec,) = await log(p)
        assert prec["path"] == "/v1/chat/completions"
        f = prec["fields"]
        assert f["max_tokens"] == 1 and f["max_completion_tokens"] == 1
        assert f["stream"] is False and "stream_options" not in f
        assert f["kv_transfer_params"] == {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
        assert prec["headers"].get("x-request-id")
        assert HEADER not in prec["headers"]  # not forwarded: no prefill loops
        (drec,) = await log(d)
        assert drec["headers"][HEADER] == key(p)
        assert drec["pd"]["status"] == 200 and drec["pd"]["fallback"] is False
        assert drec["pd"]["distance"] is None  # no topology given: unknown distance
        state = await (await d.get("/debug/state")).json()
        assert state["pd"]["remote_prefills"] == 1
        assert state["pd"]["by_distance"] == {"unknown": 1}
        assert state["pd"]["by_prefiller"] == {key(p): 1}


async def test_responses_and_completions_limit_fields() -> None:
    async with pod(SimConfig(role="prefill", time_scale=0), "p") as p, \
            pod(SimConfig(role="decode", time_scale=0), "d") as d:
        r = await d.post("/v1/responses", json={"model": MODEL, "input": "x y",
                                                "max_output_tokens": 3},
                         headers={HEADER: key(p)})
        assert r.status == 200
        assert (await r.json())["usage"]["output_tokens"] == 3
        r = await d.post("/v1/completions", json={"model": MODEL, "prompt": "x y",
                                                  "max_tokens": 4}, headers={HEADER: key(p)})
        assert (await r.json())["usage"]["completion_tokens"] == 4
        recs = await log(p)
        assert recs[0]["fields"]["max_output_tokens"] == 1
        assert recs[1]["fields"]["max_tokens"] == 1
        assert "max_completion_tokens" not in recs[1]["fields"]


async def test_without_the_header_the_decode_pod_serves_everything() -> None:
    cfg = SimConfig(role="decode", prefill_ms_per_token=0.2, time_scale=1.0)
    async with pod(cfg, "d") as d:
        t, _ = await ttft_ms(d, words(300, "a"))
        assert t >= 55  # 300 tokens x 0.2 ms, computed locally
        (rec,) = await log(d)
        assert "pd" not in rec
        state = await (await d.get("/debug/state")).json()
        assert state["pd"]["remote_prefills"] == 0


async def test_other_roles_ignore_the_header() -> None:
    async with pod(SimConfig(time_scale=0), "both") as b:
        r = await b.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                         headers={HEADER: "127.0.0.1:1"})
        assert r.status == 200
        assert "pd" not in (await log(b))[0]


async def test_transfer_is_priced_by_distance_and_cached_prefix_skips_it(tmp_path: Path) -> None:
    decode_cfg = SimConfig(role="decode", prefill_ms_per_token=1.0,
                           kv_transfer_ms_per_token_by_level=(("rack", 0.01), ("other", 0.3)),
                           decode_base_ms=1.0, time_scale=1.0)
    async with pod(SimConfig(role="prefill", prefill_ms_per_token=0.001), "p1") as p1, \
            pod(SimConfig(role="prefill", prefill_ms_per_token=0.001), "p2") as p2:
        peers_file = tmp_path / "endpoints.yaml"
        peers_file.write_text(yaml.safe_dump({
            "endpoints": [
                {"address": "127.0.0.1", "port": p1.server.port, "nodeName": "n1"},
                {"address": "127.0.0.1", "port": p2.server.port, "nodeName": "n9"},
            ],
            "nodes": [
                {"name": "n1", "labels": {"topology.kubernetes.io/rack": "r1"}},
                {"name": "n9", "labels": {"topology.kubernetes.io/rack": "r9"}},
            ]}))
        peers = PeerTopology(peers_file, min_check_s=0)
        async with pod(decode_cfg, "d", topology={"node": "nd", "rack": "r1"},
                       peers=peers) as d:
            near, _ = await ttft_ms(d, words(400, "n"), {HEADER: key(p1)})
            far, _ = await ttft_ms(d, words(400, "f"), {HEADER: key(p2)})
            # 400 tokens: 4 ms from the same rack, 120 ms from another; a local prefill
            # would take 400 ms.
            assert far - near > 60, (near, far)
            assert far < 300, far
            again, usage = await ttft_ms(d, words(400, "f"), {HEADER: key(p2)})
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 384
            assert again < far / 2, (again, far)
            recs = await log(d)
            assert [r["pd"]["distance"] for r in recs] == ["rack", "other", "other"]
            assert recs[0]["pd"]["transfer_ms_per_token"] == 0.01
            state = await (await d.get("/debug/state")).json()
            assert state["pd"]["by_distance"] == {"rack": 1, "other": 2}
            assert state["topology"] == {"node": "nd", "rack": "r1"}


async def test_own_topology_from_the_endpoints_file(tmp_path: Path) -> None:
    f = tmp_path / "endpoints.yaml"
    async with pod(SimConfig(role="prefill", time_scale=0), "p") as p:
        f.write_text(yaml.safe_dump({"endpoints": []}))
        peers = PeerTopology(f, min_check_s=0)
        async with pod(SimConfig(role="decode", time_scale=0), "d", peers=peers) as d:
            labels = {"topology.kubernetes.io/rack": "r1", "topology.kubernetes.io/block": "b1"}
            f.write_text(yaml.safe_dump({"endpoints": [
                {"address": "127.0.0.1", "port": d.server.port, "nodeName": "nd",
                 "labels": labels},
                {"address": "127.0.0.1", "port": p.server.port, "nodeName": "np",
                 "labels": {"topology.kubernetes.io/rack": "r2",
                            "topology.kubernetes.io/block": "b1"}},
            ]}))
            r = await d.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                             headers={HEADER: key(p)})
            assert r.status == 200
            assert (await log(d))[0]["pd"]["distance"] == "block"
            state = await (await d.get("/debug/state")).json()
            assert state["topology"] == {"node": "nd", "rack": "r1", "block": "b1"}


@pytest.mark.parametrize("mode", ["fallback", "error"])
async def test_failing_prefill_pod(mode: str) -> None:
    failing = SimConfig(role="prefill", error_rate=1.0, time_scale=0)
    async with pod(failing, "p") as p, \
            pod(SimConfig(role="decode", prefill_failure=mode, time_scale=0), "d") as d:  # type: ignore[arg-type]
        r = await d.post("/v1/completions", json={"prompt": "a b", "max_tokens": 3},
                         headers={HEADER: key(p)})
        rec = (await log(d))[0]["pd"]
        assert rec["status"] == 500 and "answered 500" in rec["error"]
        state = (await (await d.get("/debug/state")).json())["pd"]
        assert state["prefill_failures"] == 1 and state["remote_prefills"] == 0
        if mode == "fallback":
            assert r.status == 200
            assert (await r.json())["usage"]["completion_tokens"] == 3
            assert rec["fallback"] is True and state["fallbacks"] == 1
        else:
            assert r.status == 500
            assert "prefill pod" in (await r.json())["error"]["message"]
            assert state["fallbacks"] == 0


@pytest.mark.parametrize("mode,status", [("fallback", 200), ("error", 502)])
async def test_unreachable_or_malformed_prefill_pod(mode: str, status: int) -> None:
    cfg = SimConfig(role="decode", prefill_failure=mode, prefill_timeout_s=5,  # type: ignore[arg-type]
                    time_scale=0)
    async with pod(cfg, "d") as d:
        for peer in ("127.0.0.1:1", "not-a-host-port"):
            r = await d.post("/v1/completions", json={"prompt": "a", "max_tokens": 1},
                             headers={HEADER: peer})
            assert r.status == status
        recs = await log(d)
        assert "unreachable" in recs[0]["pd"]["error"]
        assert "malformed" in recs[1]["pd"]["error"]


async def test_prefill_pod_without_kv_params_means_a_local_prefill() -> None:
    # A `both` pod answers without kv_transfer_params: the decode pod computes the prompt.
    cfg = SimConfig(role="decode", prefill_ms_per_token=0.2, kv_transfer_ms_per_token=0,
                    kv_transfer_ms_per_token_by_level=(), time_scale=1.0)
    async with pod(SimConfig(role="both", time_scale=0), "b") as b, pod(cfg, "d") as d:
        t, _ = await ttft_ms(d, words(300, "z"), {HEADER: key(b)})
        assert t >= 55


def test_topology_helpers(tmp_path: Path) -> None:
    assert parse_topology("rack=r1, block=b1,zone=z") == {"rack": "r1", "block": "b1",
                                                          "zone": "z"}
    for bad in ("rack", "row=1", "rack="):
        with pytest.raises(ValueError):
            parse_topology(bad)
    assert parse_level_costs("node=0.1,other=2") == {"node": 0.1, "other": 2.0}
    for bad in ("x=1", "rack=-1", "rack=a", "rack"):
        with pytest.raises(ValueError):
            parse_level_costs(bad)
    a = {"node": "n1", "rack": "r1", "block": "b1", "zone": "z1"}
    assert distance(a, dict(a)) == "node"
    assert distance(a, {**a, "node": "n2"}) == "rack"
    assert distance(a, {"rack": "r2", "block": "b1"}) == "block"
    assert distance(a, {"zone": "z1"}) == "zone"
    assert distance(a, {"zone": "z2"}) == "other"
    assert distance(a, {}) is None and distance(None, a) is None
    with pytest.raises(ValueError, match="not valid YAML|cannot read"):
        PeerTopology(tmp_path / "missing.yaml")
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump({"endpoints": [
        {"address": "10.0.0.1", "port": 8000, "labels": {"my/rack": "R"}}]}))
    peers = PeerTopology(f, {"rack": "my/rack"}, min_check_s=0)
    assert peers.lookup("10.0.0.1:8000") == {"rack": "R"}
    assert peers.own("127.0.0.1", 8000) == {"rack": "R"}  # the only entry on port 8000
    f.write_text("endpoints: [")  # a bad change keeps the last good set
    assert peers.lookup("10.0.0.1:8000") == {"rack": "R"}


def test_cli_flags() -> None:
    args = build_parser().parse_args([
        "--port", "1", "--role", "decode", "--kv-transfer-cost", "rack=0.01,other=1",
        "--kv-transfer-cost", "zone=0.5", "--topology", "rack=r1,zone=z",
        "--prefill-failure", "error", "--prefill-timeout-s", "3"])
    cfg = config_from_args(args)
    costs = dict(cfg.kv_transfer_ms_per_token_by_level)
    assert costs["rack"] == 0.01 and costs["other"] == 1 and costs["zone"] == 0.5
    assert costs["node"] == 0.0002  # defaults kept for levels not given
    assert cfg.prefill_failure == "error" and cfg.prefill_timeout_s == 3
    assert topology_from_args(args) == ({"rack": "r1", "zone": "z"}, None)
    bad = build_parser().parse_args(["--port", "1", "--topology-label", "rack=k"])
    with pytest.raises(ValueError, match="needs --peer-topology-file"):
        topology_from_args(bad)
    with pytest.raises(ValueError):
        SimConfig(kv_transfer_ms_per_token_by_level=(("row", 1.0),))
    with pytest.raises(ValueError):
        SimConfig(prefill_failure="retry")  # type: ignore[arg-type]
    assert SimConfig().transfer_cost("rack") == SimConfig().kv_transfer_ms_per_token
