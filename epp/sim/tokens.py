"""The simulator's tokenizer: deterministic, cheap, no download.

Contract: a token is a whitespace-separated word of the prompt text (``str.split()``);
a token id given by the client (an ``int`` in a completions ``prompt``) is one token.
Text is never normalised, so ``"Hello"`` and ``"hello"`` are different tokens. A
request's prompt is one token sequence: a list of prompts (or of token-id lists) is
concatenated in order; a chat's messages contribute their text content in order (roles
and non-text parts contribute nothing). The same rule gives ``usage.prompt_tokens`` and
the prefix-cache block hashes, so equal leading text means equal leading blocks.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BadRequest",
    "Token",
    "content_text",
    "messages_tokens",
    "prompt_tokens",
    "responses_input_tokens",
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
