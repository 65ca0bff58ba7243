"""llm-d-router's ``llm_d_epp_*`` metrics through real Envoy (issue 18): the llm-d twins
move with their GIE series when requests are served, with llm-d's extra labels."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import orjson

from tests.integration.conftest import Upstreams, eventually, start_stack, stop_stack


def samples(text: str, name: str) -> dict[str, float]:
    """{label-string: value} for every sample of ``name``."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


async def test_llm_d_series_move_with_served_requests(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    # Token usage and response sizes come from the response body: GIE's shape ("inline").
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, tmp_path,
                          extra_args=["--metrics-endpoint-auth", "false"],
                          response_path="inline")
    murl = f"http://127.0.0.1:{s.epp.metrics_port}"
    try:
        body = orjson.dumps({"model": "food-review", "prompt": "one two three four",
                             "max_tokens": 5})
        for headers in ({}, {}, {"x-gateway-inference-fairness-id": "tenant-a"}):
            async with session.post(s.url + "/v1/completions", data=body,
                                    headers={"content-type": "application/json",
                                             **headers}) as r:
                assert r.status == 200
                await r.read()
        async with session.post(s.url + "/v1/completions", data=b"not json") as r:
            assert r.status == 400

        async def scraped() -> str | None:
            async with session.get(murl + "/metrics") as r:
                text = await r.text()
            st = samples(text, "epp_extproc_streams_total")
            done = st.get('{outcome="completed"}') == 3 and st.get('{outcome="rejected"}') == 1
            return text if done else None

        text = await eventually(scraped, timeout=10)
        lab = 'model_name="food-review",priority="0",target_model_name="food-review"'
        total = samples(text, "llm_d_epp_request_total")
        assert total['{fairness_id="default-flow",' + lab + "}"] == 2
        assert total['{fairness_id="tenant-a",' + lab + "}"] == 1
        assert samples(text, "inference_objective_request_total")["{" + lab + "}"] == 3
        running = samples(text, "llm_d_epp_request_running")
        assert set(running.values()) == {0.0}
        # The simulator counts words as tokens: 4 prompt tokens, 5 completion tokens each.
        assert samples(text, "llm_d_epp_request_input_tokens_sum")[
            '{fairness_id="default-flow",' + lab + "}"] == 2 * 4
        assert samples(text, "llm_d_epp_request_output_tokens_sum")[
            '{fairness_id="tenant-a",' + lab + "}"] == 5
        ttft = samples(text, "llm_d_epp_request_ttft_seconds_count")
        assert sum(ttft.values()) == 3
        assert all('streaming="false"' in k for k in ttft)
        errors = samples(text, "llm_d_epp_request_error_total")
        assert errors['{error_code="BadRequest",fairness_id="default-flow",model_name="",'
                      'priority="0",target_model_name=""}'] == 1
        # Twins of the GIE series: the same values under llm-d's names and labels.
        assert samples(text, "llm_d_epp_scheduler_e2e_duration_seconds_count") == \
            samples(text, "inference_extension_scheduler_e2e_duration_seconds_count")
        attempts = samples(text, "llm_d_epp_scheduler_attempts_total")
        assert sum(attempts.values()) == 3
        assert all("endpoint_name=" in k and "pod_name=" not in k for k in attempts)
        assert samples(text, "llm_d_epp_ready_endpoints") == {'{name="static"}': 3.0}
        assert len(samples(text, "llm_d_epp_per_endpoint_queue_size")) == 3
        assert 'llm_d_epp_info{' in text
    finally:
        await stop_stack(s)
