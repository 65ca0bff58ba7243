"""llm-d-router v0.10.0's precise-prefix configs (tests/fixtures/llm-d-router-v0.10.0/)
load and run: built as ``epp serve`` builds them, with fake endpoints, a fake tokenizer
and the index filled directly (no live ZMQ here: tests/unit/kvcache/test_subscriber.py
and tests/integration/test_precise_prefix.py cover the event path)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from epp.config.loader import load_and_build
from epp.errors import ConfigError
from epp.scheduling.plugins.nohit import NoHitLRUScorer
from epp.scheduling.plugins.precise_prefix import PrecisePrefixCacheProducer
from epp.scheduling.plugins.prefix import PrefixCacheScorer
from epp.scheduling.plugins.token_producer import TokenProducer
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, ServerParts, wire

FIXTURES = Path(__file__).parents[2] / "fixtures" / "llm-d-router-v0.10.0"
PRECISE = FIXTURES / "deploy/config/epp-precise-prefix-cache-config.yaml"
SIM_KVCACHE = FIXTURES / "deploy/config/sim-epp-kvcache-config.yaml"
SIM_TOKENIZER = FIXTURES / "deploy/config/sim-epp-tokenizer-vllm-http-config.yaml"
BURST = FIXTURES / "deploy/config/epp-burst-prefix-cache-config.yaml"
PERF = FIXTURES / "test/perf/config/router-configs/precise-prefix.yaml"

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def perf_config() -> str:
    """The EndpointPickerConfig embedded in the perf Helm values."""
    values = yaml.safe_load(PERF.read_text())
    text: str = values["router"]["epp"]["pluginsCustomConfig"]["precise-baseline-plugins.yaml"]
    return text


class FakeTokenizer:
    """One token per word: the word's length × 1000 + its position in a tiny vocabulary."""

    name = "fake"

    async def tokenize(self, body: Mapping[str, Any] | None, prompt: str) -> list[int]:
        msgs = (body or {}).get("messages") or [{"content": prompt}]
        return [hash(w) % 50_000 for m in msgs for w in str(m["content"]).split()]

    async def close(self) -> None:
        return None


def server(path: Path | None, text: str | None = None) -> ServerParts:
    timings = PluginTimings()
    built = load_and_build(str(path) if path else None, text, timer=timings, strict=True)
    parts = wire(validate(ServeOptions(static=StaticSourceOptions(endpoints=f"{A},{B},{C}"))),
                 built, timings, None)
    for p in built.plugins.values():
        if isinstance(p, TokenProducer):
            p.backend = FakeTokenizer()
        if isinstance(p, PrecisePrefixCacheProducer):
            p._started = True  # no live ZMQ in these tests
    return parts


def producer(parts: ServerParts) -> PrecisePrefixCacheProducer:
    found = [p for p in parts.built.plugins.values() if isinstance(p, PrecisePrefixCacheProducer)]
    assert len(found) == 1
    return found[0]


PROMPT = " ".join(f"w{i}" for i in range(400))  # 400 tokens: 6 blocks of 64, 25 of 16


def body(prompt: str = PROMPT) -> bytes:
    return orjson.dumps({"model": "llama", "messages": [{"role": "user", "content": prompt}]})


async def route(parts: ServerParts, rid: str, data: bytes) -> str:
    h = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": rid}
    routing = await parts.director.route(h, data, True, None)
    d = parts.director
    d.on_response_headers(routing.context, 200, {"content-type": "application/json"})
    d.on_response_body(routing.context, b"{}", True)
    d.on_done(routing.context, aborted=False)
    return routing.destination


async def hold(parts: ServerParts, pod: str, prompt: str = PROMPT, blocks: int | None = None
               ) -> None:
    """Put the prompt's first ``blocks`` blocks on ``pod`` as its KV events would."""
    prod = producer(parts)
    ids = await FakeTokenizer().tokenize({"messages": [{"content": prompt}]}, "")
    keys = prod.index.request_keys(ids, "llama")
    prod.index.add(pod, keys[:blocks] if blocks is not None else keys)


@pytest.mark.parametrize("path", [PRECISE, SIM_KVCACHE, SIM_TOKENIZER])
def test_configs_load_strictly(path: Path) -> None:
    built = load_and_build(str(path), strict=True)
    prod = [p for p in built.plugins.values() if isinstance(p, PrecisePrefixCacheProducer)]
    scorer = built.plugins["prefix-cache-scorer"]
    assert isinstance(scorer, PrefixCacheScorer) and scorer.producer is prod[0]
    assert isinstance(built.plugins["token-producer"], TokenProducer)


def test_perf_config_loads_strictly() -> None:
    built = load_and_build(None, perf_config(), strict=True)
    prod = built.plugins["precise-prefix-cache-producer"]
    assert isinstance(prod, PrecisePrefixCacheProducer)
    assert prod.params.speculative_indexing and prod.block_size == 16
    assert prod.params.kv_events.pod_discovery.socket_port == 5557
    nohit = built.plugins["no-hit-lru-scorer"]
    assert isinstance(nohit, NoHitLRUScorer) and nohit._prefix is prod


def test_parameters_are_read() -> None:
    built = load_and_build(str(SIM_TOKENIZER))
    prod = built.plugins["precise-prefix-cache-producer"]
    assert isinstance(prod, PrecisePrefixCacheProducer)
    assert prod.block_size == 16 and prod.index.hash_seed == "42"
    assert prod.params.kv_events.zmq_endpoint == "tcp://0.0.0.0:5557"
    assert load_and_build(str(PRECISE)).plugins["precise-prefix-cache-producer"].block_size == 64  # type: ignore[attr-defined]  # the producer


async def test_burst_config_colocates_a_burst_of_one_prompt() -> None:
    """token-producer -> burst-prefix-cache-producer -> prefix-cache-scorer: the requests
    of one window sharing a prompt go to one pod; another prompt's group to another."""
    parts = server(BURST)
    scorer = parts.built.plugins["prefix-cache-scorer"]
    assert isinstance(scorer, PrefixCacheScorer)
    assert scorer.producer is parts.built.plugins["burst-prefix-cache-producer"]
    other = "another prompt entirely " * 40
    got = await asyncio.gather(*(route(parts, f"r{i}", body(PROMPT if i % 2 else other))
                                 for i in range(6)))
    first, second = set(got[1::2]), set(got[0::2])
    assert len(first) == 1 and len(second) == 1 and first != second


@pytest.mark.parametrize("path", [PRECISE, SIM_KVCACHE, SIM_TOKENIZER, None])
async def test_requests_follow_the_pod_holding_the_blocks(path: Path | None) -> None:
    parts = server(path, None if path else perf_config())
    await hold(parts, B)
    await hold(parts, C, blocks=1)
    assert await route(parts, "r1", body()) == B
    # B loses its blocks (evicted): C, holding the first block, wins
    producer(parts).index.clear_pod(B)
    assert await route(parts, "r2", body()) == C


async def test_unrelated_prompt_scores_no_one() -> None:
    parts = server(SIM_KVCACHE)
    await hold(parts, B)
    prod = producer(parts)
    before = prod.lookup_hits
    await route(parts, "r1", body("something else entirely " * 10))
    assert prod.lookup_hits == before


def test_bad_parameters_are_named() -> None:
    base = SIM_KVCACHE.read_text()
    for old, new, message in [
        ("blockSize: 16", "blockSize: -1", "blockSizeTokens must be greater than 0"),
        ("zmqEndpoint: tcp://0.0.0.0:5557", "engineType: sglang",
         "only vLLM KV events are supported"),
        ("enableMetrics: false", "redisConfig: {address: x}", "only the in-memory"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_and_build(None, base.replace(old, new))
