"""`epp serve --workers 2`: fronts in other processes, one scheduling core, real Envoy."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.integration.conftest import (
    MAX_BODY,
    Upstreams,
    eventually,
    start_stack,
    stop_stack,
)
from tests.integration.test_observability import samples

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode,response_path", [
    ("FULL_DUPLEX_STREAMED", "lean"), ("BUFFERED", "lean"),
    ("FULL_DUPLEX_STREAMED", "inline"), ("BUFFERED", "inline")])
async def test_workers_route_reject_and_count_like_one_process(
        mode: str, response_path: str, upstreams: Upstreams, session: aiohttp.ClientSession,
        tmp_path: Path) -> None:
    s = await start_stack(mode, upstreams, tmp_path, extra_args=["--workers", "2"],
                          response_path=response_path)
    try:
        body = orjson.dumps({"model": "m", "prompt": "one two three", "max_tokens": 2})
        for port in upstreams.ports[:3]:
            for _ in range(4):
                rid = uuid.uuid4().hex
                async with session.post(s.url + "/v1/completions", data=body, headers={
                        "x-test-pin": str(port), "x-request-id": rid,
                        "x-gateway-destination-endpoint": f"127.0.0.1:{upstreams.ports[3]}"}) as r:
                    assert r.status == 200 and r.headers["x-sim-server"] == f"sim-{port}"
        # Unpinned traffic spreads (ties broken randomly in the one core).
        seen = Counter()
        for _ in range(20):
            async with session.post(s.url + "/v1/completions", data=body) as r:
                assert r.status == 200
                seen[r.headers["x-sim-server"]] += 1
        assert len(seen) == 3
        for data, headers, want in ((b"nope", {}, 400), (body, {"x-test-drop-all": "1"}, 429),
                                    (body, {"x-test-raise": "1"}, 500),
                                    (b'{"model":"m","prompt":"' + b"x" * (MAX_BODY + 1) + b'"}',
                                     {}, 413)):
            async with session.post(s.url + "/v1/completions", data=data, headers=headers) as r:
                assert r.status == want
                assert orjson.loads(await r.read())["error"]["code"] == want
        stream = orjson.dumps({"model": "m", "stream": True, "max_tokens": 8,
                               "stream_options": {"include_usage": True},
                               "messages": [{"role": "user", "content": "hi there"}]})
        async with session.post(s.url + "/v1/chat/completions", data=stream) as r:
            text = (await r.read()).decode()
        assert text.rstrip().endswith("data: [DONE]")

        last: dict[str, str] = {}

        async def counted() -> str | None:
            async with session.get(f"http://127.0.0.1:{s.epp.metrics_port}/metrics") as r:
                t = await r.text()
            last["t"] = t
            st = samples(t, "epp_extproc_streams_total")
            return t if st.get('{outcome="completed"}') == 33 else None

        try:
            text = await eventually(counted, timeout=10)
        except AssertionError:
            raise AssertionError(samples(last["t"], "epp_extproc_streams_total")) from None
        total = samples(text, "inference_objective_request_total")
        assert total['{model_name="m",target_model_name="m"}'] == 33
        errs = samples(text, "inference_objective_request_error_total")
        assert errs['{error_code="400",model_name="",target_model_name=""}'] == 1
        assert errs['{error_code="413",model_name="",target_model_name=""}'] == 1
        assert errs['{error_code="429",model_name="m",target_model_name="m"}'] == 1
        assert errs['{error_code="500",model_name="m",target_model_name="m"}'] == 1
        # Token usage is read from the response body: GIE's shape only.
        tokens = samples(text, "inference_objective_output_tokens_sum").get(
            '{model_name="m",target_model_name="m"}', 0)
        assert tokens == (32 * 2 + 8 if response_path == "inline" else 0)
        assert samples(text, "inference_objective_running_requests")['{model_name="m"}'] == 0
    finally:
        await stop_stack(s)
