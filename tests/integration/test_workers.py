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
        assert total['{model_name="m",priority="0",target_model_name="m"}'] == 33
        errs = samples(text, "inference_objective_request_error_total")
        # GIE's error codes: 400 and 413 are both BadRequest.
        assert errs['{error_code="BadRequest",model_name="",target_model_name=""}'] == 2
        assert errs['{error_code="ResourceExhausted",model_name="m",target_model_name="m"}'] == 1
        assert errs['{error_code="Internal",model_name="m",target_model_name="m"}'] == 1
        # Token usage is read from the response body: GIE's shape only.
        tokens = samples(text, "inference_objective_output_tokens_sum").get(
            '{model_name="m",target_model_name="m"}', 0)
        assert tokens == (32 * 2 + 8 if response_path == "inline" else 0)
        assert samples(text, "inference_objective_running_requests")['{model_name="m"}'] == 0
    finally:
        await stop_stack(s)


AFFINITY_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
- type: prefix-cache-scorer
- type: no-hit-lru-scorer
  parameters: {prefixPluginName: prefix-cache-scorer}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: no-hit-lru-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""


async def _placements(upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path,
                      workers: int) -> list[str]:
    """The pod of each request of a fixed sequence: 6 prefix groups, interleaved."""
    work = tmp_path / f"w{workers}"
    work.mkdir()
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, work,
                          config=AFFINITY_CONFIG, extra_args=["--workers", str(workers)])
    try:
        out = []
        for i in range(24):
            group = i % 6
            prompt = f"group {group} " + "shared system prompt words " * 80 + f"question {i}"
            body = orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 1})
            async with session.post(s.url + "/v1/completions", data=body) as r:
                assert r.status == 200
                out.append(r.headers["x-sim-server"])
        return out
    finally:
        await stop_stack(s)


async def test_several_fronts_decide_as_one_process(upstreams: Upstreams,
                                                    session: aiohttp.ClientSession,
                                                    tmp_path: Path) -> None:
    """The same request sequence through one process and through two fronts: the core
    holds one prefix index, so the decisions have the same structure — a cold group goes
    to the least recently used pod (the first three groups to three different pods, the
    next three likewise) and every later request of a group follows its first. (Which pod
    a cold group gets first depends on the core's LRU order, not on the front that
    carried it.)"""
    for workers in (1, 2):
        placed = await _placements(upstreams, session, tmp_path, workers)
        by_group = {g: {placed[i] for i in range(g, 24, 6)} for g in range(6)}
        assert all(len(pods) == 1 for pods in by_group.values()), (workers, by_group)
        firsts = [next(iter(by_group[g])) for g in range(6)]
        assert len(set(firsts[:3])) == 3 and len(set(firsts[3:])) == 3, (workers, firsts)
