"""The simulator's latency and cache model (epp.sim.engine) checked through its HTTP API.

Timings are compared with the formulas of docs/simulator.md with tolerances: a lower
bound close to the model (the engine never answers early) and a generous upper bound
(a loaded CI machine answers late). Nothing sleeps to synchronise: conditions are
polled with bounded timeouts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from epp.sim.app import build_app
from epp.sim.config import SimConfig
from epp.sim.engine import Engine
from epp.sim.state import STATE_KEY
from tests.polling import eventually

MODEL = "m"
Client = TestClient[Any, Any]


@asynccontextmanager
async def sim(config: SimConfig, name: str = "sim-t") -> AsyncIterator[Client]:
    async with TestClient(TestServer(build_app(name, MODEL, config=config))) as c:
        yield c


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def stream(c: Client, prompt: str, max_tokens: int, **extra: Any) -> tuple[list[float], Any]:
    """POST a streaming completion; return each token's arrival (ms after the POST) and
    the usage chunk."""
    t0 = time.perf_counter()
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    resp = await c.post("/v1/completions", json=body)
    assert resp.status == 200
    times: list[float] = []
    usage = None
    async for line in resp.content:
        if not line.startswith(b"data: {"):
            continue
        event = orjson.loads(line[len(b"data: ") :])
        if event["choices"]:
            times.append((time.perf_counter() - t0) * 1000)
        else:
            usage = event["usage"]
    return times, usage


async def complete(c: Client, prompt: str, max_tokens: int = 1, **extra: Any) -> Any:
    resp = await c.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra},
    )
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def metric_samples(c: Client) -> list[Any]:
    """Every sample of /metrics, through prometheus_client's own parser."""
    text = await (await c.get("/metrics")).text()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


async def metric(c: Client, name: str, **labels: str) -> float:
    for s in await metric_samples(c):
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            assert s.labels["model_name"] == MODEL
            return float(s.value)
    raise AssertionError(f"{name} {labels} not exported")


def near(measured: float, model: float, slack_ms: float = 40.0, early_ms: float = 2.0) -> bool:
    """Not earlier than the model (minus timer granularity), not much later."""
    return model - early_ms <= measured <= model * 1.3 + slack_ms


def mean_gap(times: list[float], first: int, last: int) -> tuple[float, float]:
    """Mean inter-token gap over ``times[first..last]`` and how early it may look: a late
    read of ``times[first]`` (a busy client) shortens the span by up to ~25 ms."""
    n = last - first
    return (times[last] - times[first]) / n, 25.0 / n


# ---------------------------------------------------------------- prefill and the prefix cache


async def test_ttft_is_prefill_of_uncached_tokens() -> None:
    cfg = SimConfig(prefill_ms_per_token=0.5, decode_base_ms=1.0, block_size=16)
    async with sim(cfg) as c:
        prompt = words(200)
        times, usage = await stream(c, prompt, 2)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert near(times[0], 200 * 0.5), times  # TTFT = 200 uncached tokens * 0.5 ms
        # The same prompt again: 12 blocks (192 tokens) cached, (200 - 1) // 16 = 12.
        times2, usage2 = await stream(c, prompt, 2)
        assert usage2["prompt_tokens_details"]["cached_tokens"] == 192
        assert near(times2[0], 8 * 0.5) and times2[0] < times[0] / 3, (times, times2)
        # A prompt sharing its first 100 words: 6 full blocks (96 tokens) hit.
        times3, usage3 = await stream(c, words(100) + " " + words(100, "x"), 2)
        assert usage3["prompt_tokens_details"]["cached_tokens"] == 96
        assert near(times3[0], (200 - 96) * 0.5), times3
        # Cache counters are in tokens.
        assert await metric(c, "vllm:prefix_cache_queries_total") == 600
        assert await metric(c, "vllm:prefix_cache_hits_total") == 192 + 96


async def test_time_scale_scales_every_duration() -> None:
    cfg = SimConfig(prefill_ms_per_token=1.0, decode_base_ms=20.0, time_scale=0.5)
    async with sim(cfg) as c:
        times, _ = await stream(c, words(160), 16)
        assert near(times[0], 160 * 1.0 * 0.5), times
        itl, early = mean_gap(times, 0, 15)
        assert near(itl, 20.0 * 0.5, slack_ms=5, early_ms=early), times
        # Server side, every gap is the scaled step time (late steps are caught up).
        tpot_sum = await metric(c, "vllm:time_per_output_token_seconds_sum")
        tpot_count = await metric(c, "vllm:time_per_output_token_seconds_count")
        assert tpot_count == 15
        assert near(tpot_sum / tpot_count * 1000, 10.0, slack_ms=5, early_ms=1.0)


async def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_steps() -> None:
    engine = Engine(SimConfig(max_num_batched_tokens=64, time_scale=0.0))
    try:
        req = engine.submit(words(256).split(), 1)
        await asyncio.wait_for(req.result(), 5)
        assert req.prefill_chunks == [64, 64, 64, 64]
        # Submitted together: A (10 tokens) prefills, then decodes taking 1 token of each
        # step's budget; B gets the rest of every step.
        a = engine.submit(words(10, "a").split(), 5)
        b = engine.submit(words(126, "b").split(), 1)
        await asyncio.wait_for(asyncio.gather(a.result(), b.result()), 5)
        assert a.prefill_chunks == [10]
        assert b.prefill_chunks == [54, 63, 9]
    finally:
        await engine.stop()


async def test_lru_eviction_when_the_cache_is_small() -> None:
    # 8 blocks of 4 tokens; each 16-word prompt holds 4 blocks while it runs.
    cfg = SimConfig(block_size=4, num_gpu_blocks=8, time_scale=0.0)
    async with sim(cfg) as c:
        a, b, d = words(16, "a"), words(16, "b"), words(16, "d")

        async def cached(prompt: str) -> int:
            body = await complete(c, prompt)
            return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert await cached(a) == 0
        assert await cached(a) == 12  # (16 - 1) // 4 = 3 blocks
        assert await cached(b) == 0  # fits beside A's cached blocks
        assert await cached(d) == 0  # evicts A, the least recently used
        assert await cached(a) == 0  # A was evicted (and now evicts B)
        assert await cached(d) == 12  # D survived
        state = await (await c.get("/debug/state")).json()
        assert state["engine"]["prefix_cache_evictions"] >= 8
        # A prompt that could never fit is a 400, not a hang.
        resp = await c.post("/v1/completions", json={"prompt": words(30), "max_tokens": 5})
        assert resp.status == 400
        assert "KV blocks" in (await resp.json())["error"]["message"]


# ---------------------------------------------------------------- batching


async def test_decode_step_time_grows_with_batch_size() -> None:
    cfg = SimConfig(prefill_ms_per_token=0.0, decode_base_ms=10.0, decode_per_seq_ms=5.0)
    async with sim(cfg) as c:

        async def itl() -> tuple[float, float]:
            times, _ = await stream(c, "a b", 20)
            return mean_gap(times, 4, 19)  # steady state: every stream is decoding

        alone, early = await itl()
        assert near(alone, 10 + 5 * 1, slack_ms=5, early_ms=early), alone
        four = await asyncio.gather(*(itl() for _ in range(4)))
        for value, early in four:
            assert near(value, 10 + 5 * 4, slack_ms=5, early_ms=early), four
        # TPOT histogram: one observation per token after the first.
        assert await metric(c, "vllm:time_per_output_token_seconds_count") == 5 * 19


async def test_requests_beyond_max_num_seqs_wait() -> None:
    cfg = SimConfig(max_num_seqs=2, prefill_ms_per_token=0.0, decode_base_ms=20.0)
    async with sim(cfg) as c:
        tasks = [asyncio.create_task(complete(c, f"p{i}", 12)) for i in range(5)]

        async def queued() -> bool:
            running = await metric(c, "vllm:num_requests_running")
            waiting = await metric(c, "vllm:num_requests_waiting")
            return (running, waiting) == (2.0, 3.0)

        await eventually(queued)
        bodies = await asyncio.gather(*tasks)
        assert all(b["usage"]["completion_tokens"] == 12 for b in bodies)
        assert await metric(c, "vllm:num_requests_waiting") == 0
        assert await metric(c, "vllm:num_requests_running") == 0
        assert await metric(c, "vllm:request_queue_time_seconds_count") == 5
        assert await metric(c, "vllm:request_success_total", finished_reason="length") == 5
        # Two waited for one batch of 12 steps, the last for two (less the up to one step
        # by which each arrived after the first request started the engine).
        queue_sum = await metric(c, "vllm:request_queue_time_seconds_sum")
        assert queue_sum >= (12 + 12 + 24 - 5) * 0.020 - 0.005


async def test_kv_usage_is_blocks_held_over_capacity() -> None:
    cfg = SimConfig(
        block_size=16, num_gpu_blocks=100, prefill_ms_per_token=0.0, decode_base_ms=60.0
    )
    async with sim(cfg) as c:
        # 63 prompt tokens: 4 blocks; the 3rd token's step needs a 5th (63 + 2 > 64).
        task = asyncio.create_task(complete(c, words(63), 3))
        seen: set[float] = set()

        async def done() -> bool:
            values = {
                s.name: s.value
                for s in await metric_samples(c)
                if s.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
            }
            assert values["vllm:kv_cache_usage_perc"] == values["vllm:gpu_cache_usage_perc"]
            seen.add(values["vllm:kv_cache_usage_perc"])
            return task.done()

        await eventually(done, interval=0.005)  # also samples the usage while it runs
        assert {0.04, 0.05} <= seen <= {0.0, 0.04, 0.05}
        assert await metric(c, "vllm:kv_cache_usage_perc") == 0.0


async def test_preemption_when_the_kv_cache_is_full() -> None:
    # Two sequences of 8 + 8 tokens need 4 blocks each; the pool has 6.
    cfg = SimConfig(block_size=4, num_gpu_blocks=6, time_scale=0.0)
    async with sim(cfg) as c:
        bodies = await asyncio.gather(complete(c, words(8, "a"), 8), complete(c, words(8, "b"), 8))
        assert [b["usage"]["completion_tokens"] for b in bodies] == [8, 8]
        assert await metric(c, "vllm:num_preemptions_total") >= 1
        assert await metric(c, "vllm:kv_cache_usage_perc") == 0.0


async def test_client_disconnect_frees_the_sequence() -> None:
    cfg = SimConfig(decode_base_ms=10.0)
    async with sim(cfg) as c:
        resp = await c.post(
            "/v1/completions", json={"prompt": words(40), "max_tokens": 500, "stream": True}
        )
        await resp.content.readline()  # the first token arrived
        assert await metric(c, "vllm:num_requests_running") == 1
        resp.close()

        async def freed() -> bool:
            return (
                await metric(c, "vllm:num_requests_running") == 0
                and await metric(c, "vllm:kv_cache_usage_perc") == 0
            )

        await eventually(freed)


# ---------------------------------------------------------------- LoRA


async def test_lora_slot_limit_makes_other_adapters_wait() -> None:
    cfg = SimConfig(
        loras=("ad-a", "ad-b"),
        max_loras=1,
        prefill_ms_per_token=0.0,
        decode_base_ms=20.0,
        lora_load_ms=0.0,
    )
    async with sim(cfg) as c:
        models = [m["id"] for m in (await (await c.get("/v1/models")).json())["data"]]
        assert models == [MODEL, "ad-a", "ad-b"]
        first = asyncio.create_task(complete(c, "x", 15, model="ad-a"))

        async def a_running() -> bool:
            return await metric(c, "vllm:num_requests_running") == 1

        await eventually(a_running)
        second = asyncio.create_task(complete(c, "y", 2, model="ad-b"))

        async def b_waiting() -> bool:
            return await metric(c, "vllm:num_requests_waiting") == 1

        await eventually(b_waiting)
        info = [s for s in await metric_samples(c) if s.name == "vllm:lora_requests_info"]
        newest = max(info, key=lambda s: s.value)
        assert newest.labels["running_lora_adapters"] == "ad-a"
        assert newest.labels["waiting_lora_adapters"] == "ad-b"
        assert newest.labels["max_lora"] == "1"
        assert newest.value > time.time() - 60  # a timestamp
        # The base model is not held up by a waiting adapter.
        assert (await complete(c, "z", 1))["usage"]["completion_tokens"] == 1
        state = (await (await c.get("/debug/state")).json())["engine"]
        assert state["lora_waiting"] == ["ad-b"] and state["lora_running"] == ["ad-a"]
        await first
        await second
        state = (await (await c.get("/debug/state")).json())["engine"]
        assert state["lora_loaded"] == ["ad-b"]  # a's slot went to b


async def test_loading_an_adapter_costs_lora_load_ms() -> None:
    cfg = SimConfig(loras=("ad",), prefill_ms_per_token=0.0, decode_base_ms=1.0, lora_load_ms=80)
    async with sim(cfg) as c:
        first, _ = await stream(c, "q", 1, model="ad")
        again, _ = await stream(c, "q", 1, model="ad")
        assert near(first[0], 80), first
        assert again[0] < 40, again


# ---------------------------------------------------------------- roles and failures


async def test_roles() -> None:
    params = {"kv_transfer_params": {"do_remote_decode": True}}
    async with sim(SimConfig(role="prefill", time_scale=0.0)) as c:
        body = await complete(c, "a b c", 10, **params)
        assert body["usage"]["completion_tokens"] == 1  # a prefill pod answers one token
        assert body["kv_transfer_params"]["do_remote_prefill"] is True
        assert "kv_transfer_params" not in await complete(c, "a b c", 10)
    cfg = SimConfig(role="decode", prefill_ms_per_token=0.5, kv_transfer_ms_per_token=0.05)
    async with sim(cfg) as c:
        local, _ = await stream(c, words(200), 1)
        remote, _ = await stream(
            c, words(200, "r"), 1, kv_transfer_params={"do_remote_prefill": True}
        )
        assert near(local[0], 100), local
        assert near(remote[0], 10, slack_ms=30) and remote[0] < local[0] / 2, remote


async def test_error_rate_is_deterministic_with_a_seed() -> None:
    async def statuses(seed: int, bad_too: bool = False) -> list[int]:
        cfg = SimConfig(error_rate=0.5, seed=seed, time_scale=0.0)
        async with sim(cfg, name="sim-e") as c:
            out = []
            for _ in range(30):
                if bad_too:  # a 400 draws nothing: the sequence is unchanged
                    resp = await c.post("/v1/completions", data=b"nope")
                    assert resp.status == 400
                resp = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                if resp.status == 500:
                    err = (await resp.json())["error"]
                    assert err["code"] == 500 and err["type"] == "InternalServerError"
                out.append(resp.status)
            recorded = await (await c.get("/debug/requests")).json()
            assert len(recorded) == (60 if bad_too else 30)  # every POST is recorded
            return out

    first = await statuses(7)
    assert set(first) == {200, 500}
    assert await statuses(7) == first
    assert await statuses(7, bad_too=True) == first
    assert await statuses(8) != first


async def test_slow_start() -> None:
    cfg = SimConfig(
        slow_start_s=0.4, slow_start_factor=4.0, prefill_ms_per_token=1.0, decode_base_ms=1.0
    )
    async with sim(cfg) as c:
        assert (await c.get("/health")).status == 503
        slow, _ = await stream(c, words(25), 1)

        async def healthy() -> bool:
            return (await c.get("/health")).status == 200

        await eventually(healthy, timeout=3)
        fast, _ = await stream(c, words(25, "f"), 1)
        assert near(slow[0], 25 * 4.0), slow
        assert near(fast[0], 25.0), fast


# ---------------------------------------------------------------- metrics


async def test_metrics_parse_and_count() -> None:
    async with sim(SimConfig(time_scale=0.0)) as c:
        for _ in range(3):
            await complete(c, words(40), 5)
        samples = await metric_samples(c)
        assert all(s.labels.get("model_name") == MODEL for s in samples)
        names = {s.name for s in samples}
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc",
            "vllm:cache_config_info",
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:request_success_total",
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:e2e_request_latency_seconds_sum",
            "vllm:time_per_output_token_seconds_count",
        ):
            assert name in names, name
        assert "vllm:lora_requests_info" not in names  # only with adapters configured
        assert await metric(c, "vllm:prompt_tokens_total") == 120
        assert await metric(c, "vllm:generation_tokens_total") == 15
        assert await metric(c, "vllm:prefix_cache_hits_total") == 2 * 32
        assert await metric(c, "vllm:time_to_first_token_seconds_count") == 3
        assert await metric(c, "vllm:e2e_request_latency_seconds_count") == 3
        assert await metric(c, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 3
        info = await metric(c, "vllm:cache_config_info", block_size="16", num_gpu_blocks=str(SimConfig().num_gpu_blocks))
        assert info == 1.0


async def test_engine_stop_fails_pending_requests_with_503() -> None:
    async with sim(SimConfig(decode_base_ms=50.0)) as c:
        task = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}))

        async def running() -> bool:
            return await metric(c, "vllm:num_requests_running") == 1

        await eventually(running)
        await c.app[STATE_KEY].engine.stop()
        resp = await task
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == 503


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 0},
        {"error_rate": 1.5},
        {"role": "other"},
        {"time_scale": -1.0},
        {"loras": ("a", "a")},
        {"loras": ("a",), "max_loras": 0},
        {"slow_start_factor": 0.5},
    ],
)
def test_config_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SimConfig(**kwargs)
