"""A small Hugging Face tokenizer, built at test time (no download).

``build_tokenizer(dir)`` trains a WordLevel model with ``tokenizers`` on a tiny corpus
and writes ``dir/tokenizer.json`` and ``dir/tokenizer_config.json`` (``bos_token``
``<s>``, a post-processor that puts ``<s>`` first when special tokens are added, and a
chat template unless ``chat_template=None``). Returns ``dir``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "CORPUS", "WORDS", "build_tokenizer", "byte_level_bpe", "text"]

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "you are a helpful assistant answer briefly",
    "hello world what is the capital of france",
    "system user assistant tell me a story about a cat",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def build_tokenizer(directory: Path, *, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS + ["[ ]"], trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
         "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau"]


def text(rng: random.Random, n: int) -> str:
    """``n`` of ``WORDS`` drawn with ``rng``, space-separated."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def byte_level_bpe() -> Any:
    """A byte-level BPE (GPT-2 style pre-tokenizer) trained on ``WORDS`` prose."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = [text(rng, 40) for _ in range(200)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok
