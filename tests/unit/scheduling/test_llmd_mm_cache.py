"""llm-d-router v0.10.0's multimodal encoder-cache affinity (issue 18):
``mm-embeddings-cache-producer`` and ``mm-embeddings-cache-scorer``, and llm-d's sample
config deploy/config/epp-mm-embeddings-cache-config.yaml (tests/fixtures/
llm-d-router-v0.10.0/) loaded and routed.

Go sources: pkg/epp/framework/plugins/requestcontrol/dataproducer/multimodal/{producer.go,
prerequest.go} and scheduling/scorer/mmcacheaffinity/scorer.go (with their tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from epp import keys
from epp.config.loader import load_and_build
from epp.errors import ConfigError
from epp.framework import interfaces as fw
from epp.scheduling.plugins.multimodal_cache import (
    MMEmbeddingsCacheProducer,
    MMEmbeddingsCacheScorer,
    lru_capacity,
    media_items,
)
from epp.scheduling.plugins.precise_prefix import PrecisePrefixCacheProducer
from epp.scheduling.plugins.token_producer import TokenProducer
from epp.scheduling.types import (
    ApiType,
    CycleState,
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    SchedulingResult,
)
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, ServerParts, wire

FIXTURE = (Path(__file__).parents[2] / "fixtures" / "llm-d-router-v0.10.0"
           / "deploy/config/epp-mm-embeddings-cache-config.yaml")
A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
PODS = [Endpoint(name=f"pod-{i}", address=f"10.0.0.{i}", port=8000) for i in (1, 2, 3)]


def image_body(*urls: str, text: str = "what is in this picture?") -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "m", "messages": [{"role": "user", "content": parts}]}


def req(body: dict[str, Any] | None) -> LLMRequest:
    r = LLMRequest(request_id="r", target_model="m", incoming_model="m",
                   api=ApiType.CHAT_COMPLETIONS, prompt="p", headers={})
    if body is not None:
        r.plugin_state[keys.PLUGIN_STATE_REQUEST_BODY] = body
    return r


def placed(*eps: Endpoint) -> SchedulingResult:
    return SchedulingResult({"default": ProfileRunResult(tuple(eps))}, "default")


def test_items_are_unique_media_parts() -> None:
    items = media_items(image_body("https://x/cat.png", "https://x/dog.png",
                                   "https://x/cat.png"))
    assert sorted(items.values()) == ["image", "image"]  # a repeated image counts once
    assert media_items(image_body("https://x/cat.png")).keys() <= items.keys()
    assert list(media_items({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
        {"type": "image", "source": {"type": "base64", "data": "iVBOR"}}]}]}
    ).values()) == ["audio", "video", "image"]
    assert media_items({"prompt": "text only"}) == {}
    assert media_items(None) == {}
    # vLLM generate requests carry vLLM's own content hashes
    assert media_items({"features": {"mm_hashes": {"image": ["h1", "h2"]}}}) == {
        "h1": "image", "h2": "image"}


def test_capacity_from_megabytes() -> None:
    assert lru_capacity(0) == lru_capacity(-5) == 2048  # 4096 MiB / 2 MiB
    assert lru_capacity(2048) == 1024 and lru_capacity(1) == 1
    built = load_and_build(None, "plugins: [{type: mm-embeddings-cache-producer, "
                           "parameters: {cacheSizeInMBPerServer: 4}}]\n")
    p = built.plugins["mm-embeddings-cache-producer"]
    assert isinstance(p, MMEmbeddingsCacheProducer) and p.capacity == 2


async def test_producer_learns_where_items_went_and_scorer_scores_the_share() -> None:
    p = MMEmbeddingsCacheProducer("mm-embeddings-cache-producer", cache_size_mb=4)
    s = MMEmbeddingsCacheScorer("mm-embeddings-cache-scorer")
    assert s.key == p.key and dict(s.consumes) == dict(p.produces)
    first = req(image_body("https://x/1.png", "https://x/2.png"))
    await p.prepare_request_data(first, PODS)
    assert s.score(CycleState(), first, PODS) == [0.0, 0.0, 0.0]
    p.pre_request(first, placed(PODS[1]))
    again = req(image_body("https://x/1.png", "https://x/3.png"))
    await p.prepare_request_data(again, PODS)
    assert s.score(CycleState(), again, PODS) == [0.0, 0.5, 0.0]
    text = req({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    await p.prepare_request_data(text, PODS)
    assert s.score(CycleState(), text, PODS) == [0.0, 0.0, 0.0]
    assert p.queries == 4 and p.hits == 1  # items looked up; one found on B
    # LRU of 2 entries per endpoint: 1.png, 3.png now; 2.png evicted
    p.pre_request(again, placed(PODS[1]))
    assert set(p.caches[B]) == set(media_items(image_body("https://x/1.png",
                                                          "https://x/3.png")))
    # endpoint-notification-source delete and the datastore's removal both forget it
    p.extract_endpoint(fw.EVENT_ADD_OR_UPDATE, PODS[1])
    assert B in p.caches
    p.extract_endpoint(fw.EVENT_DELETE, PODS[1])
    assert B not in p.caches
    p.pre_request(again, placed(PODS[2]))
    p.endpoint_removed(C)
    assert p.caches == {}


def test_scorer_binds_or_creates_its_producer() -> None:
    built = load_and_build(None, "plugins: [{type: mm-embeddings-cache-scorer}]\n")
    assert isinstance(built.plugins["mm-embeddings-cache-producer"], MMEmbeddingsCacheProducer)
    built = load_and_build(None, "plugins: [{type: mm-embeddings-cache-producer, name: mm}, "
                           "{type: mm-embeddings-cache-scorer, parameters: "
                           "{producerName: mm}}]\n")
    scorer = built.plugins["mm-embeddings-cache-scorer"]
    assert isinstance(scorer, MMEmbeddingsCacheScorer) and scorer.key.endswith("/mm")
    assert "mm-embeddings-cache-producer" not in built.plugins
    with pytest.raises(ConfigError, match="'queue-scorer' is a queue-scorer, not an "
                       "mm-embeddings-cache-producer"):
        load_and_build(None, "plugins: [{type: queue-scorer}, {type: "
                       "mm-embeddings-cache-scorer, parameters: {producerName: "
                       "queue-scorer}}]\n")


class FakeTokens:
    name = "fake"

    async def tokenize(self, body: Any, prompt: str) -> list[int]:
        return list(range(40))

    async def close(self) -> None:
        return None


def server() -> ServerParts:
    timings = PluginTimings()
    built = load_and_build(str(FIXTURE), timer=timings)
    parts = wire(validate(ServeOptions(static=StaticSourceOptions(endpoints=f"{A},{B},{C}"))),
                 built, timings, None)
    for p in built.plugins.values():
        if isinstance(p, TokenProducer):
            p.backend = FakeTokens()
        if isinstance(p, PrecisePrefixCacheProducer):
            p._started = True  # no live ZMQ here
    return parts


async def route(parts: ServerParts, rid: str, body: dict[str, Any]) -> str:
    d = parts.director
    h = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": rid}
    routing = await d.route(h, orjson.dumps(body), True, None)
    d.on_response_headers(routing.context, 200, {"content-type": "application/json"})
    d.on_response_body(routing.context, b"{}", True)
    d.on_done(routing.context, aborted=False)
    return routing.destination


def test_llmd_config_loads() -> None:
    built = load_and_build(str(FIXTURE))
    producer = built.plugins["mm-embeddings-cache-producer"]
    scorer = built.plugins["mm-embeddings-cache-scorer"]
    assert isinstance(producer, MMEmbeddingsCacheProducer)
    assert isinstance(scorer, MMEmbeddingsCacheScorer) and scorer.key == producer.key
    # llm-d's sample names the parameter cacheSizeInMB, which llm-d ignores as well
    assert producer.capacity == 2048
    assert built.data_layer is not None
    source = [s for s in built.data_layer.sources
              if s.source.type_name == "endpoint-notification-source"]
    assert producer in source[0].extractors
    with pytest.raises(ConfigError, match="cacheSizeInMB: unknown parameter"):
        load_and_build(str(FIXTURE), strict=True)


async def test_llmd_config_routes_an_image_to_the_pod_holding_its_embedding() -> None:
    parts = server()
    producer = parts.built.plugins["mm-embeddings-cache-producer"]
    assert isinstance(producer, MMEmbeddingsCacheProducer)
    cat = image_body("https://example.com/cat.png")
    # C served the cat picture before: the image request follows it
    seen = req(cat)
    await producer.prepare_request_data(seen, PODS)
    producer.pre_request(seen, placed(PODS[2]))
    for i in range(5):
        assert await route(parts, f"cat{i}", cat) == C
    # a new picture goes wherever the load says, then sticks there
    dog = image_body("https://example.com/dog.png", text="and this one?")
    first = await route(parts, "dog0", dog)
    for i in range(4):
        assert await route(parts, f"dog{i + 1}", dog) == first
    # C leaves the pool: its entries go with it
    parts.store.set_endpoints(PODS[:2])
    assert C not in producer.caches
