"""llm-d's deprecated ``indexerConfig.tokenizersPoolConfig`` on ``precise-prefix-cache-scorer``
(epp/scheduling/plugins/precise_prefix.py ``tokenizers_pool``).

llm-d-router v0.10.0: the scorer's legacy producer (scorer/preciseprefixcache/
legacy_producer.go) builds llm-d-kv-cache's UDS pool from it (``modelName``,
``workersCount``, ``uds: {socketFile, useTCP, modelTokenizerMap}``), tokenizes requests that
arrive without tokens, drops its TokenizedPrompt dependency, and fails at startup when the
tokenizer cannot be had; ``precise-prefix-cache-producer`` refuses the key. Here the
tokenizer is loaded in process when ``uds.modelTokenizerMap[modelName]`` (or ``modelName``)
is a local tokenizer, else startup fails naming the fixes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from epp import keys
from epp.config.loader import BuiltConfig, load_and_build
from epp.errors import ConfigError
from epp.scheduling.plugins.precise_prefix import (
    PrecisePrefixCacheProducer,
    PrecisePrefixCacheScorer,
)
from epp.scheduling.plugins.token_producer import TOKENIZED_PROMPT, TokenProducer, tokenized
from epp.scheduling.types import ApiType, CycleState, Endpoint, LLMRequest

WORDS = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([WORDS], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return d


def config(scorer_params: str, extra_plugins: str = "") -> str:
    return f"""
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
{extra_plugins}- type: precise-prefix-cache-scorer
  parameters:
    tokenProcessorConfig: {{blockSize: 4}}
    kvEventsConfig: {{discoverPods: false}}
{scorer_params}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: precise-prefix-cache-scorer}}, {{pluginRef: max-score-picker}}]
"""


def pool(body: str) -> str:
    return "    indexerConfig:\n      tokenizersPoolConfig:\n" + "".join(
        f"        {line}\n" for line in body.strip().splitlines())


def load(text: str, strict: bool = False) -> BuiltConfig:
    return load_and_build(text=text, strict=strict)


def producer_of(built: BuiltConfig) -> PrecisePrefixCacheProducer:
    scorer = built.plugins["precise-prefix-cache-scorer"]
    assert isinstance(scorer, PrecisePrefixCacheScorer) and scorer.producer is not None
    return scorer.producer


def request(prompt: str) -> LLMRequest:
    r = LLMRequest("r1", "m", "m", ApiType.COMPLETIONS, prompt, {})
    r.plugin_state[keys.PLUGIN_STATE_REQUEST_BODY] = {"model": "m", "prompt": prompt}
    return r


def eps() -> list[Endpoint]:
    return [Endpoint("a", "10.0.0.1", 8000), Endpoint("b", "10.0.0.2", 8000)]


# ------------------------------------------------------------------ the tokenizer runs


async def test_model_tokenizer_map_loads_the_tokenizer_in_process(tokenizer_dir: Path) -> None:
    built = load(config(pool(f"""
modelName: org/model
workersCount: 2
uds:
  socketFile: /tmp/tokenizer/tokenizer-uds.socket
  modelTokenizerMap: {{org/model: {tokenizer_dir}}}
""")))
    prod = producer_of(built)
    assert prod.pool is not None and prod.pool.backend.name == "local"
    # The socket is named and not used: said at startup.
    assert any("uds.socketFile '/tmp/tokenizer/tokenizer-uds.socket' is not used" in w
               for w in built.warnings), built.warnings
    # As llm-d's legacy producer: no upstream token-producer is needed or created.
    assert not [p for p in built.plugins.values() if isinstance(p, TokenProducer)]
    assert dict(prod.consumes) == {}

    endpoints = eps()
    req = request(WORDS)
    await prod.prepare_request_data(req, endpoints)
    tp = tokenized(req)
    assert tp is not None and tp.source == "local" and len(tp.token_ids) == 14
    # The tokens drive the index: once endpoint b holds the prompt's blocks, the next
    # request with that prompt scores b.
    prod.index.add(endpoints[1].key, prod.block_keys(req))
    again = request(WORDS)
    await prod.prepare_request_data(again, endpoints)
    scorer = built.plugins["precise-prefix-cache-scorer"]
    assert isinstance(scorer, PrecisePrefixCacheScorer)
    assert list(scorer.score(CycleState(), again, endpoints)) == [0.0, 1.0]
    await prod.stop_background()


async def test_model_name_as_a_local_path_works_without_uds(tokenizer_dir: Path) -> None:
    """This project's addition: llm-d needs 'uds' (its sidecar loads a local path too)."""
    prod = producer_of(load(config(pool(f"modelName: {tokenizer_dir / 'tokenizer.json'}"))))
    req = request("one two three four")
    await prod.prepare_request_data(req, eps())
    assert tokenized(req) is not None


async def test_a_declared_token_producer_runs_first_the_pool_is_the_fallback(
        tokenizer_dir: Path) -> None:
    built = load(config(pool(f"modelName: {tokenizer_dir}"),
                        "- type: token-producer\n  parameters: {estimate: {}}\n"))
    prod = producer_of(built)
    assert prod.pool is not None
    # The dependency stays: the declared producer runs before this one.
    assert TOKENIZED_PROMPT in prod.consumes
    req = request("one two three four five")
    declared = built.plugins["token-producer"]
    assert isinstance(declared, TokenProducer)
    await declared.prepare_request_data(req, eps())
    await prod.prepare_request_data(req, eps())
    got = tokenized(req)
    assert got is not None and got.source == "estimate"  # not re-tokenized by the pool


# ------------------------------------------------------------------ refused, with the fix


@pytest.mark.parametrize(("body", "fragments"), [
    ("modelName: hf-repo/model-name",
     (("precise-prefix-cache-scorer.indexerConfig.tokenizersPoolConfig: cannot obtain the "
      "tokenizer of 'hf-repo/model-name'"), "'UDS tokenizer config must be enabled'",
      "does not download", "declare a token-producer", "remove tokenizersPoolConfig")),
    ("modelName: Qwen/Qwen2.5-1.5B-Instruct\nuds: {socketFile: /run/tok.sock}",
     ("cannot obtain the tokenizer of 'Qwen/Qwen2.5-1.5B-Instruct'",
      "UDS tokenizer sidecar at /run/tok.sock", "uds.modelTokenizerMap")),
    ("uds: {socketFile: /run/tok.sock}",
     ("tokenizersPoolConfig.modelName: required",
      "'config and config.ModelName cannot be nil or empty'")),
    ("modelName: m\nuds: {modelTokenizerMap: {other: /x}}",
     ("uds.modelTokenizerMap: no entry for modelName 'm'",)),
    ("modelName: m\nuds: {modelTokenizerMap: [a]}",
     ("modelTokenizerMap: expected a mapping of model name to tokenizer path",)),
])
def test_a_tokenizer_that_cannot_be_had_fails_startup(body: str,
                                                      fragments: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        load(config(pool(body)))
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))


def test_an_unreadable_tokenizer_file_names_it(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"cannot load the tokenizer of 'm' from '.*tokenizer"
                                          r"\.json'"):
        load(config(pool(f"modelName: m\nuds: {{modelTokenizerMap: {{m: {bad}}}}}")))


def test_v08_hf_and_local_keys_are_named(tokenizer_dir: Path) -> None:
    """llm-d-kv-cache v0.7's 'hf'/'local' (llm-d-inference-scheduler v0.8.0 configs):
    llm-d-router v0.10.0's strict decoder refuses them; here a warning (an error under
    --strict-config), and the rest of the pool still applies."""
    body = f"modelName: {tokenizer_dir}\nhf: {{tokenizersCacheDir: /cache}}"
    built = load(config(pool(body)))
    assert any("tokenizersPoolConfig: hf (the in-process Hugging Face tokenizer" in w
               and "not read by llm-d-router v0.10.0" in w for w in built.warnings)
    assert producer_of(built).pool is not None
    with pytest.raises(ConfigError, match=r"tokenizersPoolConfig: hf .* remove it"):
        load(config(pool(body)), strict=True)


def test_the_producer_refuses_it_as_llmd_does() -> None:
    """llm-d's precise-prefix-cache-producer: 'tokenizersPoolConfig is not supported;
    configure a token-producer plugin instead'."""
    text = """
plugins:
- type: precise-prefix-cache-producer
  parameters:
    indexerConfig: {tokenizersPoolConfig: {modelName: m}}
"""
    with pytest.raises(ConfigError, match="precise-prefix-cache-producer.indexerConfig."
                       "tokenizersPoolConfig: tokenizersPoolConfig is not supported; "
                       "configure a token-producer plugin instead"):
        load(text)


def test_a_declared_producer_makes_the_scorer_ignore_its_pool() -> None:
    """llm-d's factory defers to a declared producer before building any pool: the
    scorer's parameters (a hub model here) are ignored with a warning, not an error."""
    text: Any = config(pool("modelName: org/not-local"),
                       "- type: precise-prefix-cache-producer\n")
    built = load(text)
    prod = built.plugins["precise-prefix-cache-producer"]
    assert isinstance(prod, PrecisePrefixCacheProducer) and prod.pool is None
    assert producer_of(built) is prod
    assert any("parameters ignored" in w for w in built.warnings)
