"""GIE's request metrics through real Envoy, in each gateway shape (issue 14, metrics):
request sizes, scheduling attempts and the pool label everywhere; response sizes, TTFT
and TPOT only where the EPP sees response bodies (docs/observability.md)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Upstreams, eventually, start_stack, stop_stack

pytestmark = pytest.mark.integration


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name]


def _sum(text: str, name: str) -> float:
    return sum(v for _, v in _samples(text, name))


@pytest.mark.parametrize("mode,response_path,workers", [
    ("FULL_DUPLEX_STREAMED", "lean", 1), ("FULL_DUPLEX_STREAMED", "inline", 1),
    ("BUFFERED", "inline", 1), ("FULL_DUPLEX_STREAMED", "inline", 2)])
async def test_request_and_response_metrics_per_shape(
        mode: str, response_path: str, workers: int, upstreams: Upstreams,
        session: aiohttp.ClientSession, tmp_path: Path) -> None:
    s = await start_stack(mode, upstreams, tmp_path, response_path=response_path,
                          extra_args=["--workers", str(workers)])
    sizes = []
    servers = []
    try:
        plain = orjson.dumps({"model": "m", "prompt": "one two three", "max_tokens": 2})
        stream = orjson.dumps({"model": "m", "stream": True, "max_tokens": 8,
                               "stream_options": {"include_usage": True},
                               "messages": [{"role": "user", "content": "hi there"}]})
        for path, body in (("/v1/completions", plain), ("/v1/chat/completions", stream)):
            async with session.post(s.url + path, data=body) as r:
                assert r.status == 200
                await r.read()
                servers.append(r.headers["x-sim-server"])
            sizes.append(len(body))
        murl = f"http://127.0.0.1:{s.epp.metrics_port}/metrics"

        async def done() -> str | None:
            async with session.get(murl) as r:
                text = await r.text()
            ok = _sum(text, "epp_extproc_streams_total") >= 2 and \
                _sum(text, "inference_objective_running_requests") == 0
            return text if ok else None

        text = await eventually(done, timeout=10)
    finally:
        await stop_stack(s)
    # Every shape: the request side.
    assert _samples(text, "inference_objective_request_total") == [
        ({"model_name": "m", "target_model_name": "m", "priority": "0"}, 2.0)]
    assert _sum(text, "inference_objective_request_sizes_sum") == sum(sizes)
    attempts = _samples(text, "inference_extension_scheduler_attempts_total")
    assert sum(v for _, v in attempts) == 2
    for labels, _ in attempts:
        assert labels["status"] == "success" and labels["target_model_name"] == "m"
        assert labels["pod_name"] in servers and labels["port"] == labels["pod_name"][4:]
    assert _samples(text, "inference_pool_ready_pods") == [({"name": "static"}, 3.0)]
    # The response side: only where the EPP sees the response bodies.
    response_sizes = _sum(text, "inference_objective_response_sizes_count")
    ttft = _sum(text, "inference_objective_request_ttft_seconds_count")
    tpot = _sum(text, "inference_objective_request_tpot_seconds_count")
    if response_path == "lean":
        assert (response_sizes, ttft, tpot) == (0, 0, 0)
    else:
        assert response_sizes == 2
        assert _sum(text, "inference_objective_response_sizes_sum") > 0
        assert ttft == 1 and 0 < _sum(text, "inference_objective_request_ttft_seconds_sum") < 5
        assert tpot == 1
        assert _sum(text, "inference_objective_normalized_time_per_output_token_seconds_count") \
            == 2
