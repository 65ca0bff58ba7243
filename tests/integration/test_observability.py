"""Metrics, explain and /debug/decisions through real Envoy, asserted on scraped values."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import aiohttp
import orjson

from tests.integration.conftest import MAX_BODY, Upstreams, eventually, start_stack, stop_stack


def samples(text: str, name: str) -> dict[str, float]:
    """{label-string: value} for every sample of ``name``."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


async def test_metrics_count_requests_errors_and_tokens(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    # Token usage comes from the response body: GIE's shape ("inline"), not the lean one.
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path, extra_args=[
        "--metrics-endpoint-auth", str(token_file), "--enable-explain-header",
        "--explain-history", "50"], response_path="inline")
    murl = f"http://127.0.0.1:{s.epp.metrics_port}"
    auth = {"Authorization": "Bearer s3cret"}
    try:
        ok_body = orjson.dumps({"model": "food-review", "prompt": "one two three four",
                                "max_tokens": 5})
        for _ in range(7):
            async with session.post(s.url + "/v1/completions", data=ok_body,
                                    headers={"content-type": "application/json"}) as r:
                assert r.status == 200
                await r.read()
        for body, headers, want in (
                (b"not json", {}, 400), (b"not json", {}, 400),
                (ok_body, {"x-test-drop-all": "1"}, 429),
                (b'{"model":"m","prompt":"' + b"x" * (MAX_BODY + 1) + b'"}', {}, 413)):
            async with session.post(s.url + "/v1/completions", data=body, headers=headers) as r:
                assert r.status == want
        # Explain through Envoy: the decision comes back in a response header.
        async with session.post(s.url + "/v1/completions", data=ok_body,
                                headers={"x-epp-explain": "true"}) as r:
            assert r.status == 200
            decision = orjson.loads(r.headers["x-epp-explain"])
        prof = decision["profiles"]["default"]
        assert decision["model"] == "food-review" and decision["candidates"] == 3
        assert set(prof["scores"]) == {"pin", "raise", "queue-scorer"}
        assert prof["picked"] == [decision["destination"]]
        assert r.headers["x-sim-server"] == "sim-" + decision["destination"].split(":")[1]

        async with session.get(murl + "/metrics") as r:
            assert r.status == 401

        async def scrape() -> str:
            async with session.get(murl + "/metrics", headers=auth) as r:
                return await r.text()

        async def streams_closed() -> str | None:
            # A stream's outcome is counted when Envoy closes the gRPC stream, which can be
            # just after the client has its response.
            text = await scrape()
            st = samples(text, "epp_extproc_streams_total")
            done = st.get('{outcome="completed"}') == 8 and st.get('{outcome="rejected"}') == 4
            return text if done else None

        text = await eventually(streams_closed, timeout=10)
        total = samples(text, "inference_objective_request_total")
        assert total['{model_name="food-review",priority="0",target_model_name="food-review"}'] == 8
        errors = samples(text, "inference_objective_request_error_total")
        # GIE's error codes: 400 and 413 are both BadRequest, 429 ResourceExhausted.
        assert errors['{error_code="BadRequest",model_name="",target_model_name=""}'] == 3
        assert errors['{error_code="ResourceExhausted",model_name="food-review",'
                      'target_model_name="food-review"}'] == 1
        # The simulator counts words as tokens: 4 prompt tokens, 5 completion tokens each.
        lab = '{model_name="food-review",target_model_name="food-review"}'
        assert samples(text, "inference_objective_input_tokens_sum")[lab] == 8 * 4
        assert samples(text, "inference_objective_output_tokens_sum")[lab] == 8 * 5
        assert samples(text, "inference_objective_request_duration_seconds_count")[lab] == 8
        streams = samples(text, "epp_extproc_streams_total")
        assert streams['{outcome="completed"}'] == 8
        assert streams['{outcome="rejected"}'] == 4
        assert samples(text, "inference_pool_ready_pods") == {'{name="static"}': 3.0}
        assert samples(text, "inference_objective_running_requests")['{model_name="food-review"}'] == 0
        assert "inference_extension_info" in text
        plugin = samples(text, "inference_extension_plugin_duration_seconds_count")
        assert plugin['{extension_point="Scorer",plugin_name="pin",plugin_type='
                      '"tests.integration.plugins:PinScorer"}'] >= 8

        async with session.get(murl + "/debug/decisions?limit=100", headers=auth) as r:
            history = await r.json()
        assert len(history) == 9  # 8 routed + the 429 (400/413 never reached scheduling)
        assert history[-1]["request_id"] == decision["request_id"]
        rejected = [h for h in history if "error" in h]
        assert len(rejected) == 1 and rejected[0]["error"]["status"] == 429
        assert set(rejected[0]["profiles"]["default"]["dropped"].values()) == {
            "filter drop-all (tests.integration.plugins:DropAllFilter)"}
    finally:
        await stop_stack(s)


async def test_explain_header_is_ignored_unless_enabled(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path)
    try:
        body = orjson.dumps({"model": "m", "prompt": "hi"})
        async with session.post(s.url + "/v1/completions", data=body,
                                headers={"x-epp-explain": "true",
                                         "x-request-id": uuid.uuid4().hex}) as r:
            assert r.status == 200 and "x-epp-explain" not in r.headers
        async with session.get(f"http://127.0.0.1:{s.epp.metrics_port}/debug/decisions") as r:
            assert r.status == 404
    finally:
        await stop_stack(s)


async def test_tracing_propagates_traceparent_to_the_model_server(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    trace_id = uuid.uuid4().hex
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path, extra_args=["--tracing"],
                          extra_env={"OTEL_TRACES_EXPORTER": "console"})
    try:
        rid = uuid.uuid4().hex
        pin = upstreams.ports[1]
        async with session.post(s.url + "/v1/completions",
                                data=orjson.dumps({"model": "m", "prompt": "hi"}),
                                headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01",
                                         "x-request-id": rid, "x-test-pin": str(pin)}) as r:
            assert r.status == 200
        async with session.get(f"http://127.0.0.1:{pin}/debug/requests") as r:
            recs = [x for x in await r.json() if x["headers"].get("x-request-id") == rid]
        tp = recs[0]["headers"]["traceparent"].split("-")
        assert tp[1] == trace_id and tp[2] != "00f067aa0ba902b7"  # child of the client's span
    finally:
        await stop_stack(s)  # flushes the console exporter
    log = (tmp_path / "epp-1.log").read_text()
    assert '"name": "epp.request"' in log and f'"trace_id": "0x{trace_id}"' in log
    assert '"name": "epp.scheduling"' in log
