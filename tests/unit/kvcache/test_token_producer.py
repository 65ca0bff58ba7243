"""token-producer: the HTTP backend against a local aiohttp /tokenize fake, and the local
backend with a tokenizer trained in the test (no download)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from epp import keys
from epp.config.loader import load_and_build
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import decode_params
from epp.kvcache.tokenization import HttpTokenizer, LocalTokenizer, render_chat_template
from epp.scheduling.plugins.token_producer import (
    TOKENIZED_PROMPT,
    TokenProducer,
    TokenProducerParameters,
    tokenized,
)
from epp.scheduling.types import ApiType, LLMRequest

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def request(body: dict[str, Any] | None, prompt: str = "hello world",
            salt: str | None = None) -> LLMRequest:
    r = LLMRequest("r1", "llama", "llama", ApiType.CHAT_COMPLETIONS, prompt, {},
                   cache_salt=salt)
    if body is not None:
        r.plugin_state[keys.PLUGIN_STATE_REQUEST_BODY] = body
    return r


@pytest.fixture
def local_tokenizer(tmp_path: Path) -> Path:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["hello world", "the quick brown fox", "<|user|> <|assistant|> <|system|>"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<s>"}))
    return tmp_path


class FakeServer:
    def __init__(self, render: bool) -> None:
        self.render = render
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenize)
        if self.render:
            app.router.add_post("/v1/completions/render", self.completions_render)
            app.router.add_post("/v1/chat/completions/render", self.chat_render)
        return app

    @staticmethod
    def ids(text: str) -> list[int]:
        return [len(w) for w in text.split()]

    async def tokenize(self, req: web.Request) -> web.Response:
        body = await req.json()
        self.calls.append(("/tokenize", body))
        if "messages" in body:
            text = " ".join(m["content"] for m in body["messages"])
        else:
            text = body["prompt"]
        ids = self.ids(text)
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids,
                                  "token_strs": None})

    async def completions_render(self, req: web.Request) -> web.Response:
        body = await req.json()
        self.calls.append(("/v1/completions/render", body))
        return web.json_response([{"token_ids": self.ids(body["prompt"])}])

    async def chat_render(self, req: web.Request) -> web.Response:
        body = await req.json()
        self.calls.append(("/v1/chat/completions/render", body))
        return web.json_response({"token_ids": [7] + self.ids(body["messages"][-1]["content"])})


@pytest_asyncio.fixture
async def servers() -> AsyncIterator[dict[bool, tuple[str, FakeServer]]]:
    out: dict[bool, tuple[str, FakeServer]] = {}
    runners = []
    for render in (False, True):
        fake = FakeServer(render)
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # started
        out[render] = (f"http://127.0.0.1:{port}", fake)
        runners.append(runner)
    yield out
    for r in runners:
        await r.cleanup()


async def test_tokenize_endpoint_shapes(servers: dict[bool, tuple[str, FakeServer]]) -> None:
    url, fake = servers[False]
    tok = HttpTokenizer(url, "base-model")
    try:
        assert await tok.tokenize({"model": "x", "prompt": "aa bbb"}, "") == [2, 3]
        assert tok.use_tokenize  # the render API answered 404: /tokenize from now on
        chat = {"model": "x", "messages": [{"role": "user", "content": "c dd"}],
                "add_generation_prompt": True, "max_tokens": 5}
        assert await tok.tokenize(chat, "") == [1, 2]
        assert fake.calls[-2] == ("/tokenize", {"model": "base-model", "prompt": "aa bbb"})
        assert fake.calls[-1] == ("/tokenize", {
            "model": "base-model", "messages": [{"role": "user", "content": "c dd"}],
            "add_generation_prompt": True})
    finally:
        await tok.close()


async def test_render_endpoints_are_preferred(servers: dict[bool, tuple[str, FakeServer]]) -> None:
    url, fake = servers[True]
    producer = TokenProducer.from_params(
        "tp", decode_params(TokenProducerParameters, {"modelName": "base", "vllm": {"url": url}},
                            "tp"), PluginHandle())
    r = request({"model": "alias", "messages": [{"role": "user", "content": "aa b"}]},
                salt="s")
    await producer.prepare_request_data(r, [])
    tp = tokenized(r)
    assert tp is not None and tp.token_ids == (7, 2, 1) and tp.cache_salt == "s"
    assert fake.calls[-1][0] == "/v1/chat/completions/render"
    assert fake.calls[-1][1]["model"] == "base"  # modelName replaces the request's model
    await producer.prepare_request_data(r, [])  # already tokenized: skipped
    assert len(fake.calls) == 1
    await producer.stop_background()


async def test_failures_leave_the_request_untokenized() -> None:
    producer = TokenProducer("tp", HttpTokenizer("http://127.0.0.1:1", "m", timeout=0.2))
    r = request(None)
    await producer.prepare_request_data(r, [])
    assert TOKENIZED_PROMPT not in r.plugin_state and producer.failures == 1
    await producer.stop_background()


async def test_local_tokenizer_with_chat_template(local_tokenizer: Path) -> None:
    tok = LocalTokenizer(str(local_tokenizer))
    vocab = Tokenizer.from_file(str(local_tokenizer / "tokenizer.json")).get_vocab()
    assert await tok.tokenize({"prompt": "hello world"}, "") == [vocab["hello"], vocab["world"]]
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    text = tok.render_chat(chat)
    assert text == "<|user|> hello <|assistant|>"
    ids = await tok.tokenize(chat, "")
    assert ids == tok.encode(text, False) and vocab["hello"] in ids
    # without a body the prompt text is tokenized as a completion
    assert await tok.tokenize(None, "the fox") == [vocab["the"], vocab["fox"]]


def test_chat_template_helpers() -> None:
    out = render_chat_template("{{ bos_token }}{{ messages | tojson }}{{ flag }}",
                               [{"role": "user", "content": "x"}], special={"bos_token": "<s>"},
                               kwargs={"flag": 1})
    assert out == '<s>[{"role": "user", "content": "x"}]1'
    with pytest.raises(Exception, match="chat template: no"):
        render_chat_template("{{ raise_exception('no') }}", [])


def test_backend_selection_and_errors(local_tokenizer: Path) -> None:
    def build(params: dict[str, Any]) -> TokenProducer:
        return TokenProducer.from_params(
            "tp", decode_params(TokenProducerParameters, params, "tp"), PluginHandle())

    assert build({}).backend.name == "estimate"
    assert build({"modelName": "m"}).backend.name == "vllm"
    http = build({"vllm": {"timeout": "2s"}}).backend
    assert isinstance(http, HttpTokenizer) and http.url == "http://localhost:8000"
    assert http.timeout == 2.0 and http.mm_timeout == 30.0
    assert build({"local": {"path": str(local_tokenizer)}}).backend.name == "local"
    with pytest.raises(ConfigError, match="udsTokenizerConfig: llm-d's deprecated"):
        build({"udsTokenizerConfig": {"socketFile": "/tmp/x"}})
    with pytest.raises(ConfigError, match="cannot load the tokenizer"):
        build({"local": {"path": "/nonexistent"}})
    with pytest.raises(ConfigError, match="set one backend"):
        build({"modelName": "m", "estimate": {}})
    with pytest.raises(ConfigError, match="chat template does not compile"):  # at startup
        build({"local": {"path": str(local_tokenizer), "chatTemplate": "{% for m in x %}"}})


def test_legacy_type_name_loads_with_a_warning() -> None:
    built = load_and_build(None, """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: tokenizer
  parameters: {modelName: m}
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins: [{pluginRef: max-score-picker}]
""")
    assert isinstance(built.plugins["tokenizer"], TokenProducer)
    assert any("deprecated" in w for w in built.warnings)
