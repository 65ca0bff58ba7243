"""Real Envoy in front of the EPP and simulated pods, in both request body modes."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections import Counter
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.integration.conftest import (
    MAX_BODY,
    Stack,
    Upstreams,
    eventually,
    start_stack,
    stop_stack,
)

pytestmark = pytest.mark.integration


def completion(prompt: str = "hello world", **extra: object) -> bytes:
    return orjson.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 4, **extra})


async def post(session: aiohttp.ClientSession, stack: Stack, body: bytes,
               path: str = "/v1/completions", headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, str], bytes]:
    h = {"content-type": "application/json", **(headers or {})}
    async with session.post(stack.url + path, data=body, headers=h) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def seen_by(session: aiohttp.ClientSession, ups: Upstreams, request_id: str) -> list[int]:
    """Ports of the upstreams whose debug log has this request id."""
    out = []
    for p in ups.ports:
        for rec in await ups.requests(session, p):
            if rec["headers"].get("x-request-id") == request_id:  # type: ignore[union-attr]
                out.append(p)
    return out


async def record(session: aiohttp.ClientSession, ups: Upstreams, port: int,
                 request_id: str) -> dict[str, object]:
    for rec in await ups.requests(session, port):
        if rec["headers"].get("x-request-id") == request_id:  # type: ignore[union-attr]
            return rec
    raise AssertionError(f"request {request_id} not seen by upstream {port}")


async def test_requests_go_to_the_endpoint_the_epp_chose(
        stack: Stack, session: aiohttp.ClientSession) -> None:
    ups = stack.upstreams
    for port in ups.ports[:3]:
        for _ in range(3):
            rid = uuid.uuid4().hex
            status, headers, _ = await post(session, stack, completion(),
                                            headers={"x-test-pin": str(port), "x-request-id": rid})
            assert status == 200
            assert headers["x-sim-server"] == f"sim-{port}"
            assert await seen_by(session, ups, rid) == [port]
            rec = await record(session, ups, port, rid)
            # The upstream saw the EPP's decision header naming itself.
            assert rec["headers"]["x-gateway-destination-endpoint"] == f"127.0.0.1:{port}"  # type: ignore[index]


async def test_unpinned_traffic_spreads_over_all_endpoints(
        stack: Stack, session: aiohttp.ClientSession) -> None:
    served: Counter[str] = Counter()
    for _ in range(30):
        status, headers, _ = await post(session, stack, completion())
        assert status == 200
        served[headers["x-sim-server"]] += 1
    # Equal scores → random tie-break over the 3 configured endpoints; never the 4th.
    assert set(served) == {f"sim-{p}" for p in stack.upstreams.ports[:3]}


async def test_client_routing_headers_do_not_change_the_route(
        stack: Stack, session: aiohttp.ClientSession) -> None:
    a, b = stack.upstreams.ports[0], stack.upstreams.ports[1]
    fourth = stack.upstreams.ports[3]  # not in the pool at all
    for forged in (f"127.0.0.1:{b}", f"127.0.0.1:{fourth}"):
        rid = uuid.uuid4().hex
        status, headers, _ = await post(session, stack, completion(), headers={
            "x-test-pin": str(a), "x-request-id": rid,
            "x-gateway-destination-endpoint": forged,
            "x-prefiller-host-port": "127.0.0.1:1"})
        assert status == 200 and headers["x-sim-server"] == f"sim-{a}"
        rec = await record(session, stack.upstreams, a, rid)
        assert rec["headers"]["x-gateway-destination-endpoint"] == f"127.0.0.1:{a}"  # type: ignore[index]
        assert "x-prefiller-host-port" not in rec["headers"]  # type: ignore[operator]


async def test_one_megabyte_body_arrives_byte_exact(
        stack: Stack, session: aiohttp.ClientSession) -> None:
    port = stack.upstreams.ports[2]
    body = completion("lorem ipsum dolor sit amet " * 40_000)  # ~1.08 MB
    assert len(body) > 1_000_000
    rid = uuid.uuid4().hex
    status, _, resp = await post(session, stack, body,
                                 headers={"x-test-pin": str(port), "x-request-id": rid})
    assert status == 200, resp[:300]
    rec = await record(session, stack.upstreams, port, rid)
    assert rec["body_len"] == len(body)
    assert rec["body_sha256"] == hashlib.sha256(body).hexdigest()


async def test_sse_streams_through_and_usage_is_counted(
        inline_stack: Stack, session: aiohttp.ClientSession) -> None:
    # Usage is read from the response body: GIE's shape (the lean shape never sends the
    # body to the EPP; test_gateway_shapes.py covers SSE there).
    stack = inline_stack
    before = await stack.epp.metric(session, "inference_objective_output_tokens_sum")
    body = orjson.dumps({"model": "sim-model", "stream": True, "max_tokens": 20,
                         "stream_options": {"include_usage": True},
                         "messages": [{"role": "user", "content": "tell me a story"}]})
    async with session.post(stack.url + "/v1/chat/completions", data=body,
                            headers={"content-type": "application/json"}) as r:
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        reads = []
        async for chunk in r.content.iter_any():
            reads.append(chunk)
    text = b"".join(reads).decode()
    events = [e for e in text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert sum('"content"' in e for e in events) >= 20
    usage = orjson.loads(events[-2][len("data: "):])["usage"]
    assert usage["completion_tokens"] == 20

    async def counted() -> bool:
        after = await stack.epp.metric(session, "inference_objective_output_tokens_sum")
        return after - before == 20
    await eventually(counted, timeout=5)


@pytest.mark.parametrize("body,headers,status,needle", [
    (b"{not json", {}, 400, "not valid JSON"),
    (orjson.dumps({"prompt": "x"}), {}, 400, "model"),
    (orjson.dumps({"model": "m", "prompt": 5}), {}, 400, "prompt"),
    (b'{"model":"m","prompt":"' + b"x" * (MAX_BODY + 10) + b'"}', {}, 413, "limit"),
    (completion(), {"x-test-drop-all": "1"}, 429, "filtered out"),
    (completion(), {"x-test-raise": "1"}, 500, "internal error"),
])
async def test_error_rows_reach_the_client(stack: Stack, session: aiohttp.ClientSession,
                                           body: bytes, headers: dict[str, str], status: int,
                                           needle: str) -> None:
    got, h, resp = await post(session, stack, body, headers=headers)
    assert got == status, resp[:300]
    assert h["content-type"] == "application/json"
    err = orjson.loads(resp)["error"]
    assert err["code"] == status and needle in err["message"]


async def test_header_only_get_is_routed(stack: Stack, session: aiohttp.ClientSession) -> None:
    async with session.get(stack.url + "/v1/models") as r:
        assert r.status == 200
        assert r.headers["x-sim-server"] in {f"sim-{p}" for p in stack.upstreams.ports[:3]}
        assert (await r.json())["data"]


async def test_no_endpoints_is_503(upstreams: Upstreams, session: aiohttp.ClientSession,
                                   tmp_path: Path) -> None:
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path, endpoint_ports=[])
    try:
        status, _, resp = await post(session, s, completion())
        assert status == 503
        assert "no ready endpoints" in orjson.loads(resp)["error"]["message"]
    finally:
        await stop_stack(s)


async def test_epp_restart_envoy_reconnects(upstreams: Upstreams,
                                            session: aiohttp.ClientSession,
                                            tmp_path: Path) -> None:
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path)
    try:
        assert (await post(session, s, completion()))[0] == 200
        await s.epp.stop()
        status, _, _ = await post(session, s, completion())
        assert status >= 500  # fail-closed while the EPP is down
        await s.epp.start()

        async def routed() -> bool:
            return (await post(session, s, completion()))[0] == 200
        await eventually(routed, timeout=15, interval=0.2)
        for _ in range(5):
            assert (await post(session, s, completion()))[0] == 200
    finally:
        await stop_stack(s)


async def test_endpoints_file_edit_moves_traffic(upstreams: Upstreams,
                                                 session: aiohttp.ClientSession,
                                                 tmp_path: Path) -> None:
    a, b, c = upstreams.ports[:3]
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path, endpoint_ports=[a, b])
    try:
        served = Counter()
        for _ in range(12):
            status, h, _ = await post(session, s, completion())
            assert status == 200
            served[h["x-sim-server"]] += 1
        assert set(served) == {f"sim-{a}", f"sim-{b}"}

        s.epp.write_endpoints([b, c])

        async def switched() -> bool:
            _, h, _ = await post(session, s, completion(), headers={"x-test-pin": str(c)})
            return h.get("x-sim-server") == f"sim-{c}"
        await eventually(switched, timeout=10)
        served.clear()
        for _ in range(20):
            status, h, _ = await post(session, s, completion())
            assert status == 200
            served[h["x-sim-server"]] += 1
        assert set(served) == {f"sim-{b}", f"sim-{c}"}

        # A broken edit is ignored: the last good set stays in force.
        s.epp.endpoints_file.write_text("endpoints: [{address: nope}]\n")
        assert s.epp.proc is not None
        log = s.epp.proc.log_path
        await eventually(lambda: "endpoints file change ignored" in log.read_text(),
                         what="the EPP to read (and reject) the broken edit")
        status, h, _ = await post(session, s, completion(), headers={"x-test-pin": str(c)})
        assert status == 200 and h["x-sim-server"] == f"sim-{c}"
    finally:
        await stop_stack(s)


async def test_fallback_endpoints_are_used_when_the_primary_is_down(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    """maxNumOfEndpoints 2 + Envoy's override_host policy: the dead primary is skipped."""
    from epp.stack.procs import free_port
    from tests.integration.plugins import FALLBACK_CONFIG

    dead = free_port()  # nothing listens here
    a, b = upstreams.ports[:2]
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path,
                          endpoint_ports=[dead, a, b], config=FALLBACK_CONFIG,
                          override_host=True)
    try:
        # Healthy primary: served by it; the header names primary then fallback.
        rid = uuid.uuid4().hex
        status, h, _ = await post(session, s, completion(),
                                  headers={"x-test-pin": f"{b},{a}", "x-request-id": rid})
        assert status == 200 and h["x-sim-server"] == f"sim-{b}"
        rec = await record(session, upstreams, b, rid)
        assert rec["headers"]["x-gateway-destination-endpoint"] == (  # type: ignore[index]
            f"127.0.0.1:{b},127.0.0.1:{a}")
        # Dead primary: Envoy retries on the fallback (round robin would also pick b).
        for _ in range(8):
            rid = uuid.uuid4().hex
            status, h, _ = await post(session, s, completion(),
                                      headers={"x-test-pin": f"{dead},{a}", "x-request-id": rid})
            assert status == 200 and h["x-sim-server"] == f"sim-{a}"
            assert await seen_by(session, upstreams, rid) == [a]
    finally:
        await stop_stack(s)


async def test_subset_hint_from_envoy_metadata_narrows_candidates(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    """A header_to_metadata filter before ext_proc sets envoy.lb.subset_hint from a header."""
    import yaml

    a, b, c = upstreams.ports[:3]
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path)
    await s.envoy.stop()
    doc = yaml.safe_load((tmp_path / "envoy.yaml").read_text())
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(0, {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{"header": "x-subset", "on_header_present": {
                "metadata_namespace": "envoy.lb.subset_hint",
                "key": "x-gateway-destination-endpoint-subset", "type": "STRING"}}]}})
    from epp.stack.envoy import EnvoyProcess

    s.envoy = EnvoyProcess()
    await s.envoy.start(yaml.safe_dump(doc), tmp_path / "e2")
    await s.envoy.wait_ready()
    try:
        served = Counter()
        for _ in range(12):
            status, h, _ = await post(session, s, completion(),
                                      headers={"x-subset": f"127.0.0.1:{b},127.0.0.1:{c}"})
            assert status == 200
            served[h["x-sim-server"]] += 1
        assert set(served) == {f"sim-{b}", f"sim-{c}"}
        # Pinning an endpoint outside the subset does not escape it.
        status, h, _ = await post(session, s, completion(), headers={
            "x-subset": f"127.0.0.1:{b}", "x-test-pin": str(a)})
        assert status == 200 and h["x-sim-server"] == f"sim-{b}"
        # A subset that matches no endpoint is 503.
        status, _, resp = await post(session, s, completion(), headers={"x-subset": "10.9.9.9:1"})
        assert status == 503 and "subset" in orjson.loads(resp)["error"]["message"]
    finally:
        await stop_stack(s)


async def test_default_config_keeps_a_prompt_on_the_pod_that_cached_it(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    """Built-in default config through real Envoy: prefix affinity."""
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path, config=None)
    try:
        spread = Counter()
        for i in range(8):
            prompt = f"conversation {i}: " + "the quick brown fox jumps over the lazy dog " * 30
            servers = set()
            for _ in range(5):
                status, h, _ = await post(session, s, completion(prompt))
                assert status == 200
                servers.add(h["x-sim-server"])
            assert len(servers) == 1, servers  # every repeat on the same pod
            spread[servers.pop()] += 1
        # Distinct prompts are not all piled onto one pod (ties break randomly; all 8 on
        # one of 3 pods has probability 3 ** -7).
        assert len(spread) >= 2
    finally:
        await stop_stack(s)


async def test_primary_port_routes_to_the_sidecar_with_the_rank_header(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    """llm-d's primaryPort through real Envoy: the EPP picks a rank endpoint, Envoy sends
    the request to that pod's primary port (here a fourth sim, standing in for the
    data-parallel sidecar), and the sidecar gets the rank in x-data-parallel-host-port —
    the EPP's, never the client's."""
    ranks, sidecar = upstreams.ports[:3], upstreams.ports[3]
    config = f"""\
plugins:
- type: disagg-profile-handler
  parameters: {{deciders: {{prefill: never}}, primaryPort: {sidecar}}}
- {{type: prefix-based-pd-decider, name: never, parameters: {{nonCachedTokens: 0}}}}
- {{type: tests.integration.plugins:PinScorer, name: pin}}
- type: decode-filter
- type: max-score-picker
schedulingProfiles:
- name: decode
  plugins: [{{pluginRef: decode-filter}}, {{pluginRef: pin}}, {{pluginRef: max-score-picker}}]
"""
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path, endpoint_ports=ranks,
                          config=config)
    try:
        for rank in ranks + ranks[::-1]:
            rid = uuid.uuid4().hex
            status, h, _ = await post(session, s, completion(), headers={
                "x-test-pin": str(rank), "x-request-id": rid,
                "x-data-parallel-host-port": "10.6.6.6:666"})
            assert status == 200 and h["x-sim-server"] == f"sim-{sidecar}"
            assert await seen_by(session, upstreams, rid) == [sidecar]
            rec = await record(session, upstreams, sidecar, rid)
            headers = rec["headers"]
            assert headers["x-data-parallel-host-port"] == f"127.0.0.1:{rank}"  # type: ignore[index]
            assert headers["x-gateway-destination-endpoint"] == (  # type: ignore[index]
                f"127.0.0.1:{sidecar}")
    finally:
        await stop_stack(s)


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
async def test_observer_response_path_through_envoy(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path,
        mode: str) -> None:
    """The split response path with real Envoy: routing filter + observability-mode filter.
    Requests are routed as before, the response reaches the EPP through the observer (usage
    counted, every request completed, nothing left in flight), and a forged token never
    reaches the upstream."""
    s = await start_stack(mode, upstreams, tmp_path, response_path="observer")
    try:
        a = upstreams.ports[0]
        out_before = await s.epp.metric(session, "inference_objective_output_tokens_sum")
        rid = uuid.uuid4().hex
        status, h, body = await post(session, s, completion(max_tokens=7), headers={
            "x-test-pin": str(a), "x-request-id": rid, "x-epp-observe": "forged"})
        assert status == 200 and h["x-sim-server"] == f"sim-{a}"
        assert orjson.loads(body)["usage"]["completion_tokens"] == 7
        token = (await record(session, upstreams, a, rid))["headers"]["x-epp-observe"]  # type: ignore[index]
        assert token != "forged" and len(token) == 24
        # A streamed chat completion: events arrive, usage is counted from the observer.
        req = orjson.dumps({"model": "sim-model", "stream": True, "max_tokens": 20,
                            "stream_options": {"include_usage": True},
                            "messages": [{"role": "user", "content": "tell me a story"}]})
        async with session.post(s.url + "/v1/chat/completions", data=req,
                                headers={"content-type": "application/json"}) as r:
            assert r.status == 200
            text = (await r.read()).decode()
        assert text.rstrip().endswith("data: [DONE]")
        # Several concurrent requests, then: all completed, none in flight.
        results = await asyncio.gather(*(post(session, s, completion(f"p{i}"))
                                         for i in range(12)))
        assert all(st == 200 for st, _, _ in results)

        async def settled() -> bool:
            out = await s.epp.metric(session, "inference_objective_output_tokens_sum")
            done = await s.epp.metric(session, 'epp_extproc_streams_total{outcome="completed"}')
            running = await s.epp.metric(session, "inference_objective_running_requests")
            return out - out_before == 7 + 20 + 12 * 4 and done >= 14 and running == 0
        await eventually(settled, timeout=10)
        assert await s.epp.metric(session, 'epp_extproc_streams_total{outcome="aborted"}') == 0
    finally:
        await stop_stack(s)


async def test_observer_path_client_gone_mid_stream_is_aborted(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    """A client that leaves mid-answer: the observer stream closes without the response's
    end, and the request counts as aborted — nothing stays in flight."""
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path, response_path="observer")
    try:
        body = orjson.dumps({"model": "sim-model", "stream": True, "max_tokens": 400,
                             "messages": [{"role": "user", "content": "a long story"}]})
        async with aiohttp.ClientSession() as own, \
                own.post(s.url + "/v1/chat/completions", data=body,
                         headers={"content-type": "application/json"}) as r:
            assert r.status == 200
            await r.content.readany()  # the first events, then hang up
            r.close()

        async def aborted() -> bool:
            n = await s.epp.metric(session, 'epp_extproc_streams_total{outcome="aborted"}')
            running = await s.epp.metric(session, "inference_objective_running_requests")
            return n == 1 and running == 0
        await eventually(aborted, timeout=10)
    finally:
        await stop_stack(s)
