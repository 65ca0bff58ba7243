"""The simulator's tokenizer: deterministic, cheap, no download.

Contract: a token is a whitespace-separated word of the prompt text (``str.split()``);
a token id given by the client (an ``int`` in a completions ``prompt``) is one token.
Text is never normalised, so ``"Hello"`` and ``"hello"`` are different tokens. A
request's prompt is one token sequence: a list of prompts (or of token-id lists) is
concatenated in order; a chat's messages contribute their text content in order (roles
and non-text parts contribute nothing). The same rule gives ``usage.prompt_tokens`` and
the prefix-cache block hashes, so equal leading text means equal leading blocks.

Token ids: the engine, the block hashes and the KV events work on integer ids. A word's
id is :func:`word_id` (a stable 31-bit hash of its text); an id given by the client is
itself. :class:`WordTokenizer` is this default; :class:`HFTokenizer` (``epp sim
--tokenizer PATH``) is a real Hugging Face ``tokenizers`` tokenizer with a chat template
(the tokenizer's own from ``tokenizer_config.json``, else :data:`DEFAULT_CHAT_TEMPLATE`).
Both give ``(ids, token strings)`` for a completions prompt, chat messages and a
Responses ``input`` (:class:`SimTokenizer`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Final

import xxhash

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "BadRequest",
    "Encoded",
    "HFTokenizer",
    "SimTokenizer",
    "Token",
    "WordTokenizer",
    "content_text",
    "load_tokenizer",
    "messages_tokens",
    "prompt_tokens",
    "responses_input_tokens",
    "word_id",
]

Token = str | int


class BadRequest(Exception):
    """A client error that becomes a 400 OpenAI error response."""


def prompt_tokens(prompt: Any) -> list[Token]:
    """Tokens of a completions ``prompt`` / embeddings ``input``: a string, a list of
    strings, a list of token ids, or a list of token-id lists (each id is one token).

    Raises :class:`BadRequest` for any other shape.
    """
    out: list[Token] = []
    _collect(prompt, out)
    return out


def _collect(prompt: Any, out: list[Token]) -> None:
    if isinstance(prompt, str):
        out.extend(prompt.split())
    elif isinstance(prompt, int) and not isinstance(prompt, bool):
        out.append(prompt)
    elif isinstance(prompt, list):
        for p in prompt:
            _collect(p, out)
    else:
        raise BadRequest("prompt/input must be a string, a list of strings or token ids")


def content_text(content: Any) -> str:
    """Text of a chat/Responses message ``content``: a string or a list of parts; parts
    without text (images, audio) contribute nothing. Raises :class:`BadRequest` for any
    other type."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, str):
                texts.append(part)
        return " ".join(texts)
    raise BadRequest("message content must be a string or a list of content parts")


def messages_tokens(messages: Any) -> list[Token]:
    """Tokens of a chat ``messages`` list: the words of every message's content, in order.

    Raises :class:`BadRequest` unless ``messages`` is a list of objects.
    """
    if not isinstance(messages, list):
        raise BadRequest("'messages' must be a list")
    out: list[Token] = []
    for msg in messages:
        if not isinstance(msg, dict):
            raise BadRequest("each message must be an object")
        out.extend(content_text(msg.get("content")).split())
    return out


def responses_input_tokens(inp: Any) -> list[Token]:
    """Tokens of a Responses API ``input``: a string or a list of input items (objects
    with ``content`` or ``text``, or strings). Raises :class:`BadRequest` otherwise."""
    if isinstance(inp, str):
        return list(inp.split())
    if isinstance(inp, list):
        out: list[Token] = []
        for item in inp:
            if isinstance(item, dict):
                out.extend(content_text(item.get("content", item.get("text"))).split())
            elif isinstance(item, str):
                out.extend(item.split())
        return out
    raise BadRequest("'input' must be a string or a list of input items")


# ---------------------------------------------------------------- token ids


@functools.lru_cache(maxsize=1 << 17)
def word_id(word: str) -> int:
    """The id of a word token: the low 31 bits of its XXH3-64 (stable across processes,
    non-negative, fits the ``uint32`` token ids of vLLM's events). Memoized: a pod sees
    the same words again and again, and ``/tokenize`` is on the EPP's request path."""
    return xxhash.xxh3_64_intdigest(word.encode()) & 0x7FFFFFFF


def _ids(tokens: list[Token]) -> Encoded:
    wid = word_id
    ids = [wid(t) if isinstance(t, str) else t for t in tokens]
    return ids, [t if isinstance(t, str) else str(t) for t in tokens]


Encoded = tuple[list[int], list[str]]
"""Token ids and the token strings they stand for (``/tokenize``'s ``token_strs``)."""

DEFAULT_CHAT_TEMPLATE: Final = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The chat template of a ``--tokenizer`` whose ``tokenizer_config.json`` has none:
each message as ``<|role|>\\n`` + its text + ``\\n``, then ``<|assistant|>\\n`` when a
generation prompt is asked for."""


class SimTokenizer:
    """What the simulator's routes need from a tokenizer (``/tokenize``, usage, hashes)."""

    name = "words"

    def prompt(self, prompt: Any, *, add_special_tokens: bool = True) -> Encoded:
        """A completions ``prompt`` / embeddings ``input`` (strings and token ids)."""
        raise NotImplementedError

    def chat(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Encoded:
        """A chat ``messages`` list, through the chat template."""
        raise NotImplementedError

    def responses_input(self, inp: Any) -> Encoded:
        """A Responses API ``input``."""
        raise NotImplementedError


class WordTokenizer(SimTokenizer):
    """The default: whitespace words (module doc); chat messages contribute their text
    only (no template, no generation prompt), so token counts are the word counts."""

    name = "words"

    def prompt(self, prompt: Any, *, add_special_tokens: bool = True) -> Encoded:
        return _ids(prompt_tokens(prompt))

    def chat(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Encoded:
        return _ids(messages_tokens(messages))

    def responses_input(self, inp: Any) -> Encoded:
        return _ids(responses_input_tokens(inp))


def _special(config: dict[str, Any], key: str) -> str:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class HFTokenizer(SimTokenizer):
    """A Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``) and a Jinja2 chat
    template, rendered in a sandbox as ``transformers`` renders it (``trim_blocks``,
    ``lstrip_blocks``; ``messages``, ``add_generation_prompt``, ``bos_token``,
    ``eos_token``, ``raise_exception`` and the request's ``chat_template_kwargs``)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise ValueError(f"--tokenizer {path}: no tokenizer.json there (give the file "
                             "or the directory that holds it)")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 -- tokenizers raises a bare Exception
            raise ValueError(f"--tokenizer {file}: not a tokenizers tokenizer.json: {exc}") \
                from None
        self.name = str(file)
        config: dict[str, Any] = {}
        cfg_file = file.parent / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                loaded = json.loads(cfg_file.read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(f"{cfg_file}: not valid JSON: {exc}") from None
            if isinstance(loaded, dict):
                config = loaded
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template: str = template if isinstance(template, str) else DEFAULT_CHAT_TEMPLATE
        self._bos = _special(config, "bos_token")
        self._eos = _special(config, "eos_token")
        self._templates: dict[str, Any] = {}

    def _template(self, source: str) -> Any:
        compiled = self._templates.get(source)
        if compiled is None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            try:
                compiled = env.from_string(source)
            except TemplateError as exc:
                raise BadRequest(f"chat template does not compile: {exc}") from None
            if len(self._templates) < 16:
                self._templates[source] = compiled
        return compiled

    def encode(self, text: str, add_special_tokens: bool) -> Encoded:
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return list(enc.ids), list(enc.tokens)

    def _piece(self, piece: Any, add_special_tokens: bool, out: Encoded) -> None:
        if isinstance(piece, str):
            ids, strs = self.encode(piece, add_special_tokens)
            out[0].extend(ids)
            out[1].extend(strs)
        elif isinstance(piece, int) and not isinstance(piece, bool):
            out[0].append(piece)
            out[1].append(self._tok.id_to_token(piece) or "")
        elif isinstance(piece, list):
            for p in piece:
                self._piece(p, add_special_tokens, out)
        else:
            raise BadRequest("prompt/input must be a string, a list of strings or token ids")

    def prompt(self, prompt: Any, *, add_special_tokens: bool = True) -> Encoded:
        out: Encoded = ([], [])
        self._piece(prompt, add_special_tokens, out)
        return out

    def render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat prompt text (the template applied to ``messages``)."""
        from jinja2 import TemplateError

        if not isinstance(messages, list):
            raise BadRequest("'messages' must be a list")
        if add_generation_prompt and continue_final_message:
            raise BadRequest("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")
        msgs = []
        for m in messages:
            if not isinstance(m, dict):
                raise BadRequest("each message must be an object")
            msgs.append({**m, "content": content_text(m.get("content"))})
        kwargs = dict(chat_template_kwargs or {})
        kwargs.update(messages=msgs, add_generation_prompt=add_generation_prompt,
                      bos_token=self._bos, eos_token=self._eos)
        try:
            text: str = self._template(chat_template or self.chat_template).render(**kwargs)
        except TemplateError as exc:
            raise BadRequest(f"chat template failed: {exc}") from None
        if continue_final_message and msgs:
            last = msgs[-1]["content"]
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[: cut + len(last)]
        return text

    def chat(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Encoded:
        text = self.render(
            messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.encode(text, add_special_tokens)

    def responses_input(self, inp: Any) -> Encoded:
        if isinstance(inp, str):
            return self.chat([{"role": "user", "content": inp}])
        if isinstance(inp, list):
            msgs = []
            for item in inp:
                if isinstance(item, dict):
                    msgs.append({"role": item.get("role", "user"),
                                 "content": content_text(item.get("content", item.get("text")))})
                elif isinstance(item, str):
                    msgs.append({"role": "user", "content": item})
            return self.chat(msgs)
        raise BadRequest("'input' must be a string or a list of input items")


def load_tokenizer(path: str | Path | None) -> SimTokenizer:
    """``--tokenizer``: :class:`HFTokenizer` of ``path``, or :class:`WordTokenizer` when
    ``path`` is None. ValueError naming the problem when it cannot be loaded."""
    return WordTokenizer() if path is None else HFTokenizer(path)
