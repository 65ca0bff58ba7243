"""A Hugging Face ``tokenizers`` tokenizer that tokenizes the bench's prompts exactly as
``epp sim``'s default tokenizer does, for ``token-producer``'s in-process backend
(``local: {path: …}``).

The simulator's tokenizer (:mod:`epp.sim.tokens`) makes a token of every
whitespace-separated word and gives it the id :func:`epp.sim.tokens.word_id`; a chat's
messages contribute their text content in order. The bench knows every word it will send
(its trace), so a word-level vocabulary of those words, each mapped to its ``word_id``, a
whitespace pre-tokenizer and a chat template that emits the messages' contents give the
same ids — the role a model's own ``tokenizer.json`` plays beside a real vLLM. Built at
bench time: no download.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

from epp.sim.tokens import word_id

__all__ = ["CHAT_TEMPLATE", "UNKNOWN", "trace_words", "write_bench_tokenizer"]

#: The messages' text contents in order, each followed by a space (roles add nothing).
CHAT_TEMPLATE: Final = "{% for m in messages %}{{ m['content'] ~ ' ' }}{% endfor %}"
#: The unknown-word token (words the bench never sends).
UNKNOWN: Final = "[UNK]"


def trace_words(messages: Iterable[Sequence[dict[str, str]]]) -> set[str]:
    """Every word of the messages' text contents (what the bench sends)."""
    out: set[str] = set()
    for msgs in messages:
        for m in msgs:
            out.update(m["content"].split())
    return out


def write_bench_tokenizer(directory: Path, words: Iterable[str]) -> Path:
    """Write ``tokenizer.json`` (``words``, each with its simulator id) and
    ``tokenizer_config.json`` (with :data:`CHAT_TEMPLATE`) under ``directory``; returns
    ``directory``."""
    vocab = {w: word_id(w) for w in words}
    if 0 in vocab.values():
        raise ValueError("a word's simulator id is 0, the unknown token's")
    vocab[UNKNOWN] = 0
    # tokenizers' own Tokenizer.save takes half a minute for ids this sparse; the file
    # format is plain JSON (a WordLevel model behind a WhitespaceSplit pre-tokenizer).
    spec: dict[str, object] = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNKNOWN}}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return directory
