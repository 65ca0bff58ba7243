"""The model-server simulator's HTTP surface (epp.sim.app, epp.sim.openai_api,
epp.sim.server): OpenAI routes, SSE, usage, metrics, debug log, CLI. The latency model is
checked in test_engine.py."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from epp.sim import server
from epp.sim.app import build_app
from epp.sim.config import SimConfig
from epp.sim.options import build_parser, config_from_args
from epp.sim.server import main, serving
from epp.sim.state import DEBUG_LOG_SIZE, DEFAULT_MAX_TOKENS, SIM_SERVER_HEADER, STATE_KEY
from epp.stack.procs import ManagedProcess, free_port, wait_port
from tests.polling import eventually

MODEL = "test-model"


FAST = SimConfig(time_scale=0.0)  # the API's shape, not its timing (test_engine.py)


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(build_app("sim-a", MODEL, config=FAST))) as c:
        yield c


async def _sse_events(resp: aiohttp.ClientResponse) -> tuple[list[bytes], int]:
    """Read an SSE body; return its `data:` payloads and how many HTTP chunks carried it."""
    raw = b""
    http_chunks = 0
    async for data, end_of_http_chunk in resp.content.iter_chunks():
        raw += data
        if end_of_http_chunk:
            http_chunks += 1
    events = [e for e in raw.split(b"\n\n") if e]
    datas = []
    for event in events:
        for line in event.split(b"\n"):
            if line.startswith(b"data: "):
                datas.append(line[len(b"data: ") :])
    return datas, http_chunks


# ---------------------------------------------------------------- non-streaming


async def test_completions_json_usage_and_header(client: TestClient[Any, Any]) -> None:
    resp = await client.post(
        "/v1/completions",
        json={"model": "other", "prompt": "one two  three\nfour", "max_tokens": 5},
    )
    assert resp.status == 200
    assert resp.headers[SIM_SERVER_HEADER] == "sim-a"
    body = await resp.json()
    assert body["object"] == "text_completion"
    assert body["model"] == "other"  # the request's model is echoed
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 5,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_completions_prompt_shapes(client: TestClient[Any, Any]) -> None:
    for prompt, expected in ((["a b", "c"], 3), ([1, 2, 3, 4], 4), ([[1, 2], [3]], 3)):
        resp = await client.post("/v1/completions", json={"prompt": prompt})
        body = await resp.json()
        assert body["usage"]["prompt_tokens"] == expected
        assert body["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
        assert body["model"] == MODEL


async def test_chat_json_counts_every_message(client: TestClient[Any, Any]) -> None:
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "max_completion_tokens": 3,
            "messages": [
                {"role": "system", "content": "you are terse"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hello there"},
                        {"type": "image_url", "image_url": {"url": "data:"}},
                    ],
                },
            ],
        },
    )
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_embeddings(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/v1/embeddings", json={"model": MODEL, "input": ["a b", "c d e"]})
    assert resp.status == 200
    body = await resp.json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 0


async def test_responses_api(client: TestClient[Any, Any]) -> None:
    resp = await client.post(
        "/v1/responses",
        json={"model": MODEL, "input": "why is the sky blue", "max_output_tokens": 4},
    )
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "response"
    assert body["status"] == "completed"
    assert body["usage"]["input_tokens"] == 5
    assert body["usage"]["output_tokens"] == 4
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 0}


async def test_get_routes(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/v1/models")
    assert resp.status == 200
    assert (await resp.json())["data"][0]["id"] == MODEL
    resp = await client.get("/health")
    assert resp.status == 200
    assert resp.headers[SIM_SERVER_HEADER] == "sim-a"


# ---------------------------------------------------------------- streaming


@pytest.mark.parametrize("include_usage", [True, False])
async def test_chat_sse(client: TestClient[Any, Any], include_usage: bool) -> None:
    req: dict[str, Any] = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "a b c"}],
    }
    if include_usage:
        req["stream_options"] = {"include_usage": True}
    resp = await client.post("/v1/chat/completions", json=req)
    assert resp.status == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers[SIM_SERVER_HEADER] == "sim-a"
    datas, http_chunks = await _sse_events(resp)
    assert datas[-1] == b"[DONE]"
    chunks = [orjson.loads(d) for d in datas[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c for c in chunks if c["choices"] and "content" in c["choices"][0]["delta"]][1:]
    assert len(content) == 4  # one chunk per completion token
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    if include_usage:
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["prompt_tokens"] == 3
        assert chunks[-1]["usage"]["completion_tokens"] == 4
    else:
        assert all("usage" not in c for c in chunks)
    # Each event was written on its own: at least one HTTP chunk per event.
    assert http_chunks >= len(datas)


async def test_completions_sse(client: TestClient[Any, Any]) -> None:
    resp = await client.post(
        "/v1/completions",
        json={
            "prompt": "x y",
            "stream": True,
            "max_tokens": 2,
            "stream_options": {"include_usage": True},
        },
    )
    datas, _ = await _sse_events(resp)
    assert datas[-1] == b"[DONE]"
    chunks = [orjson.loads(d) for d in datas[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == [" tok0", " tok1"]
    assert chunks[-1]["usage"]["prompt_tokens"] == 2


async def test_responses_sse(client: TestClient[Any, Any]) -> None:
    resp = await client.post(
        "/v1/responses", json={"input": "x y z", "stream": True, "max_output_tokens": 2}
    )
    datas, _ = await _sse_events(resp)
    events = [orjson.loads(d) for d in datas]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.completed",
    ]
    assert events[-1]["response"]["usage"]["input_tokens"] == 3


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("path", "data"),
    [
        ("/v1/completions", b"not json"),
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/completions", b'{"model": "m"}'),
        ("/v1/chat/completions", b'{"messages": "hi"}'),
        ("/v1/embeddings", b"{"),
        ("/v1/responses", b'{"model": "m"}'),
    ],
)
async def test_bad_requests_are_400(client: TestClient[Any, Any], path: str, data: bytes) -> None:
    resp = await client.post(path, data=data, headers={"content-type": "application/json"})
    assert resp.status == 400
    assert resp.headers[SIM_SERVER_HEADER] == "sim-a"
    err = (await resp.json())["error"]
    assert err["code"] == 400 and err["type"] and err["message"]


# ---------------------------------------------------------------- debug log and metrics


async def test_debug_log_records_and_clears(client: TestClient[Any, Any]) -> None:
    payload = orjson.dumps({"prompt": "hello", "max_tokens": 1})
    resp = await client.post(
        "/v1/completions",
        data=payload,
        headers={"X-Custom": "Yes", "content-type": "application/json"},
    )
    assert resp.status == 200
    await client.post("/v1/chat/completions", data=b"bad")  # a 400 is recorded too
    log = await (await client.get("/debug/requests")).json()
    assert [r["path"] for r in log] == ["/v1/completions", "/v1/chat/completions"]
    first = log[0]
    assert first["body_len"] == len(payload)
    assert first["body_sha256"] == hashlib.sha256(payload).hexdigest()
    assert first["headers"]["x-custom"] == "Yes"
    assert all(k == k.lower() for k in first["headers"])
    resp = await client.delete("/debug/requests")
    assert resp.status == 204
    assert await (await client.get("/debug/requests")).json() == []
    assert build_app("x", MODEL)[STATE_KEY].requests.maxlen == DEBUG_LOG_SIZE


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            assert f'model_name="{MODEL}"' in line
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from metrics")


async def test_metrics_count_running_requests() -> None:
    slow = SimConfig(decode_base_ms=20.0, decode_per_seq_ms=0.0)
    async with TestClient(TestServer(build_app("sim-slow", MODEL, config=slow))) as c:

        async def gauges() -> tuple[float, float, float]:
            text = await (await c.get("/metrics")).text()
            return (
                _gauge(text, "vllm:num_requests_running"),
                _gauge(text, "vllm:num_requests_waiting"),
                _gauge(text, "vllm:kv_cache_usage_perc"),
            )

        assert await gauges() == (0.0, 0.0, 0.0)
        task = asyncio.create_task(
            c.post("/v1/completions", json={"prompt": "p q r", "max_tokens": 10})
        )

        async def running() -> bool:
            return (await gauges())[0] == 1.0

        await eventually(running)  # 10 steps of 20 ms: observable while it decodes
        _, waiting, kv = await gauges()
        assert waiting == 0.0 and kv > 0.0
        resp = await task
        assert resp.status == 200
        assert await gauges() == (0.0, 0.0, 0.0)


async def test_delay_s_is_recorded_first_and_delays_the_answer() -> None:
    app = build_app("sim-delay", MODEL, delay_s=0.2, config=FAST)
    async with TestClient(TestServer(app)) as c:
        t0 = time.monotonic()
        task = asyncio.create_task(c.post("/v1/completions", json={"prompt": "p"}))

        async def recorded() -> bool:
            return len(await (await c.get("/debug/requests")).json()) == 1

        await eventually(recorded)  # recorded before the delay starts
        assert not task.done()
        assert (await task).status == 200
        assert time.monotonic() - t0 >= 0.19


def test_build_app_rejects_negative_delay() -> None:
    with pytest.raises(ValueError, match="delay_s"):
        build_app("x", MODEL, delay_s=-1)


# ---------------------------------------------------------------- real ports, CLI


async def test_serving_names_apps_by_port() -> None:
    ports = [free_port(), free_port()]
    async with serving("127.0.0.1", ports, MODEL), aiohttp.ClientSession() as session:
        for port in ports:
            async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                assert resp.headers[SIM_SERVER_HEADER] == f"sim-{port}"


async def test_module_entry_point(tmp_path: Path) -> None:
    port = free_port()
    proc = ManagedProcess(
        [sys.executable, "-m", "epp.sim.server", "--port", str(port), "--model", MODEL],
        log_path=tmp_path / "sim.log",
    )
    async with proc:
        await wait_port("127.0.0.1", port, timeout=15)
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "a"}) as resp,
        ):
            assert resp.status == 200
            assert resp.headers[SIM_SERVER_HEADER] == f"sim-{port}"
    assert proc.returncode == 0, proc.log_tail()  # SIGTERM shuts it down cleanly


async def test_cli_entry_point_with_model_options(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "epp.cli", "sim", "--port", str(port)]
    argv += ["--role", "prefill", "--lora", "ad-1,ad-2", "--max-loras", "2", "--seed", "3",
             "--time-scale", "0"]
    proc = ManagedProcess(argv, log_path=tmp_path / "sim.log")
    async with proc:
        await wait_port("127.0.0.1", port, timeout=15)
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            async with session.get(base + "/v1/models") as resp:
                ids = [m["id"] for m in (await resp.json())["data"]]
            assert ids == ["sim-model", "ad-1", "ad-2"]
            async with session.post(
                base + "/v1/completions", json={"prompt": "a b", "max_tokens": 9}
            ) as resp:
                assert (await resp.json())["usage"]["completion_tokens"] == 1  # prefill role
            async with session.get(base + "/debug/state") as resp:
                state = await resp.json()
            assert state["name"] == f"sim-{port}" and state["role"] == "prefill"
            assert state["config"]["seed"] == 3 and state["config"]["max_loras"] == 2
    assert proc.returncode == 0, proc.log_tail()


def test_cli_options_map_onto_the_config() -> None:
    args = build_parser().parse_args(
        ["--port", "1", "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--block-size",
         "8", "--num-gpu-blocks", "64", "--prefill-ms-per-token", "0.5", "--decode-base-ms", "7",
         "--decode-per-seq-ms", "0.5", "--kv-transfer-ms-per-token", "0.01", "--lora", "a",
         "--lora", "b,c", "--max-loras", "2", "--lora-load-ms", "3", "--role", "decode",
         "--error-rate", "0.1", "--slow-start-s", "2", "--slow-start-factor", "5", "--time-scale",
         "0.1", "--seed", "9"]
    )
    cfg = config_from_args(args)
    assert cfg == SimConfig(
        max_num_seqs=4,
        max_num_batched_tokens=128,
        block_size=8,
        num_gpu_blocks=64,
        prefill_ms_per_token=0.5,
        decode_base_ms=7,
        decode_per_seq_ms=0.5,
        kv_transfer_ms_per_token=0.01,
        loras=("a", "b", "c"),
        max_loras=2,
        lora_load_ms=3,
        role="decode",
        error_rate=0.1,
        slow_start_s=2,
        slow_start_factor=5,
        time_scale=0.1,
        seed=9,
    )
    assert config_from_args(build_parser().parse_args(["--port", "1"])) == SimConfig()


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "1", "--error-rate", "2"],
        ["--port", "1", "--delay-s", "-1"],
        ["--port", "1", "--role", "x"],
        [],
    ],
)
def test_cli_rejects_bad_options(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


async def test_models_lists_adapters_and_debug_state(client: TestClient[Any, Any]) -> None:
    state = await (await client.get("/debug/state")).json()
    assert state["name"] == "sim-a" and state["model"] == MODEL and state["role"] == "both"
    assert state["engine"]["running"] == 0 and state["config"]["time_scale"] == 0.0
    async with TestClient(
        TestServer(build_app("sim-l", MODEL, config=SimConfig(loras=("x",), time_scale=0)))
    ) as c:
        data = (await (await c.get("/v1/models")).json())["data"]
        assert [(m["id"], m["parent"]) for m in data] == [(MODEL, None), ("x", MODEL)]
        resp = await c.post("/v1/completions", json={"model": "x", "prompt": "a", "max_tokens": 2})
        assert (await resp.json())["model"] == "x"


def test_server_keeps_exporting_the_names_it_used_to_define() -> None:
    """``epp.sim.server`` was one module; callers importing from it keep working."""
    from epp.sim import app, options, state

    assert server.build_app is app.build_app and server.STATE_KEY is state.STATE_KEY
    assert server.build_parser is options.build_parser
    assert server.config_from_args is options.config_from_args
    assert server.topology_from_args is options.topology_from_args
    for name in ("DEBUG_LOG_SIZE", "DEFAULT_MAX_TOKENS", "DEFAULT_MODEL", "SIM_SERVER_HEADER",
                 "STATE_KEY", "BadRequest", "SimConfig", "SimState", "build_app",
                 "build_parser", "config_from_args", "main", "run_servers", "serving",
                 "start_servers"):
        assert name in server.__all__ and hasattr(server, name), name
