"""The simulator's tokenizers and vLLM's ``/tokenize`` (epp.sim.tokens,
epp.sim.openai_api.tokenize): the default word tokenizer, ``--tokenizer`` with a
tokenizer.json built at test time, chat templates, and the response shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from epp.kvcache import hashing
from epp.sim.app import build_app
from epp.sim.config import SimConfig
from epp.sim.options import build_parser, tokenizer_from_args
from epp.sim.state import STATE_KEY
from epp.sim.tokens import DEFAULT_CHAT_TEMPLATE, HFTokenizer, WordTokenizer, word_id
from tests.tokenizer_util import build_tokenizer

CFG = SimConfig(time_scale=0.0, block_size=4, num_gpu_blocks=64)
MSGS = [{"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": [{"type": "text", "text": "hello world"}]}]


@pytest.fixture
def tok_dir(tmp_path: Path) -> Path:
    return build_tokenizer(tmp_path / "tok")


async def _client(tokenizer: Any) -> TestClient[Any, Any]:
    return TestClient(TestServer(build_app("sim-t", "m", config=CFG, tokenizer=tokenizer)))


@pytest.fixture
async def words_client() -> AsyncIterator[TestClient[Any, Any]]:
    async with await _client(None) as c:
        yield c


@pytest.fixture
async def hf_client(tok_dir: Path) -> AsyncIterator[TestClient[Any, Any]]:
    async with await _client(HFTokenizer(tok_dir)) as c:
        yield c


async def test_tokenize_shape_with_the_word_tokenizer(words_client: Any) -> None:
    resp = await words_client.post("/tokenize", json={"model": "m", "prompt": "a b  c"})
    assert resp.status == 200
    body = await resp.json()
    assert body == {"count": 3, "max_model_len": 256,
                    "tokens": [word_id("a"), word_id("b"), word_id("c")], "token_strs": None}
    resp = await words_client.post("/tokenize", json={"model": "m", "messages": MSGS,
                                                      "return_token_strs": True})
    body = await resp.json()
    assert body["token_strs"] == ["you", "are", "a", "helpful", "assistant", "hello", "world"]
    assert body["count"] == 7 and len(body["tokens"]) == 7
    for bad in ({"model": "m"}, {"prompt": 3}, {"prompt": "x", "add_special_tokens": "yes"}):
        resp = await words_client.post("/tokenize", json=bad)
        assert resp.status == 400
        assert "error" in await resp.json()


async def test_tokenize_with_a_tokenizer_json(hf_client: Any, tok_dir: Path) -> None:
    tok = HFTokenizer(tok_dir)
    bos = 1
    resp = await hf_client.post("/tokenize", json={"prompt": "hello world",
                                                   "return_token_strs": True})
    body = await resp.json()
    assert body["tokens"][0] == bos and body["token_strs"] == ["<s>", "hello", "world"]
    body = await (await hf_client.post("/tokenize", json={
        "prompt": "hello world", "add_special_tokens": False})).json()
    assert body["count"] == 2 and body["tokens"] == tok.prompt("hello world",
                                                               add_special_tokens=False)[0]
    # Chat: the tokenizer's template (tokenizer_config.json), BOS from the template.
    text = tok.render([{"role": "user", "content": "hello world"}])
    assert text == "<s>[user] hello world [assistant] "
    body = await (await hf_client.post("/tokenize", json={
        "messages": [{"role": "user", "content": "hello world"}]})).json()
    assert body["tokens"] == tok.encode(text, False)[0]
    no_gen = await (await hf_client.post("/tokenize", json={
        "messages": [{"role": "user", "content": "hello world"}],
        "add_generation_prompt": False})).json()
    assert no_gen["count"] == body["count"] - 3  # "[ assistant ]"
    resp = await hf_client.post("/tokenize", json={
        "messages": MSGS, "continue_final_message": True, "add_generation_prompt": True})
    assert resp.status == 400
    # A request's own chat_template wins.
    own = await (await hf_client.post("/tokenize", json={
        "messages": [{"role": "user", "content": "hello"}],
        "chat_template": "{{ messages[0]['content'] }}"})).json()
    assert own["tokens"] == tok.encode("hello", False)[0]


async def test_generation_uses_the_same_tokens_and_block_hashes(hf_client: Any) -> None:
    state = hf_client.server.app[STATE_KEY]
    tokens = (await (await hf_client.post("/tokenize", json={"messages": MSGS})).json())["tokens"]
    resp = await hf_client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
    assert (await resp.json())["usage"]["prompt_tokens"] == len(tokens)
    cached = hashing.block_hashes(tokens, CFG.block_size, seed=CFG.hash_seed)
    assert cached and all(h in state.engine.pool for h in cached)
    resp = await hf_client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
    usage = (await resp.json())["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == (
        (len(tokens) - 1) // CFG.block_size * CFG.block_size)


def test_default_chat_template_and_loading(tmp_path: Path) -> None:
    d = build_tokenizer(tmp_path / "plain", chat_template=None)
    tok = HFTokenizer(d / "tokenizer.json")
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    assert tok.render([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"
    with pytest.raises(ValueError, match="no tokenizer.json"):
        HFTokenizer(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tokenizers tokenizer.json"):
        HFTokenizer(tmp_path / "bad.json")
    parser = build_parser()
    assert isinstance(tokenizer_from_args(parser.parse_args(["--port", "1"])), WordTokenizer)
    loaded = tokenizer_from_args(parser.parse_args(["--port", "1", "--tokenizer", str(d)]))
    assert isinstance(loaded, HFTokenizer)
