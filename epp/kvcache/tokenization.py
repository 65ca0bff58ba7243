"""Tokenizer backends of ``token-producer``: the model server over HTTP, a local Hugging
Face ``tokenizers`` tokenizer (with its chat template), or llm-d's byte-packing estimate.

References (read, not copied): llm-d-router v0.10.0
``pkg/epp/framework/plugins/requestcontrol/dataproducer/tokenizer/`` (``vllm_http.go``:
``POST {url}/v1/completions/render`` and ``/v1/chat/completions/render`` with the
request's own body and ``model`` set to ``modelName``; ``estimate.go``), vLLM's
``/tokenize`` API (``vllm/entrypoints/openai/protocol.py``: ``TokenizeCompletionRequest``
``{model, prompt, add_special_tokens=True}``, ``TokenizeChatRequest`` ``{model, messages,
add_generation_prompt=True, continue_final_message=False, add_special_tokens=False,
chat_template, chat_template_kwargs, tools}`` → ``{count, max_model_len, tokens}``) and
Hugging Face ``transformers``' ``apply_chat_template`` (a sandboxed jinja2 environment
with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``, and the
tokenizer's special tokens as variables).

The HTTP backend asks llm-d's render endpoints first and falls back, once and for good,
to ``/tokenize`` when the server answers 404 there (a plain ``vllm serve`` before the
render API, or the simulator).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import pathlib
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Protocol

import aiohttp

from epp.kvcache.prefix_store import PrefixLookup, TokenPrefixStore

__all__ = [
    "EstimateTokenizer",
    "HttpTokenizer",
    "LocalTokenizer",
    "TokenizeError",
    "TokenizedPrompt",
    "TokenizerBackend",
    "chat_request",
]

log = logging.getLogger(__name__)

#: How many tail tokenizations the local backend checks against whole ones first.
TAIL_CHECKS = 16
#: Texts from this many characters on are encoded in the tokenizer's thread.
THREAD_MIN_CHARS = 4096
#: A probe (see :meth:`LocalTokenizer.tokenize_leading`) encodes this many leading
#: characters and keeps the tokens ending before its last ``PROBE_MARGIN_CHARS``.
PROBE_CHARS = 1024
PROBE_MARGIN_CHARS = 256

_end = itemgetter(1)

COMPLETIONS_RENDER_PATH = "/v1/completions/render"
CHAT_RENDER_PATH = "/v1/chat/completions/render"
TOKENIZE_PATH = "/tokenize"


class TokenizeError(Exception):
    """Tokenization failed (the request is then scheduled without tokens)."""


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    """llm-d's ``TokenizedPrompt``: the prompt's token ids and its cache salt."""

    token_ids: tuple[int, ...]
    cache_salt: str | None = None
    source: str = ""  # which backend produced them (for logs and tests)
    #: When ``token_ids`` is only the prompt's leading part (the prefix store's partial
    #: tokenization, :mod:`epp.kvcache.prefix_store`): the whole prompt's token count,
    #: estimated from the share of its characters those ids cover. 0: the ids are whole.
    estimated_total: int = 0
    #: When the ids are a leading part handed out early (:meth:`LocalTokenizer.
    #: tokenize_leading`): the whole prompt's ids, still being tokenized.
    whole: asyncio.Future[list[int]] | None = field(default=None, compare=False, repr=False)

    @property
    def token_count(self) -> int:
        """The prompt's token count (estimated when the ids are partial)."""
        return self.estimated_total or len(self.token_ids)


def chat_request(body: Mapping[str, Any] | None) -> bool:
    return body is not None and isinstance(body.get("messages"), list)


class TokenizerBackend(Protocol):
    name: str

    async def tokenize(self, body: Mapping[str, Any] | None, prompt: str) -> list[int]: ...

    async def close(self) -> None: ...


# ------------------------------------------------------------------------- HTTP


class HttpTokenizer:
    """The model server's (or a render sidecar's) tokenizer over HTTP."""

    name = "vllm"

    def __init__(self, url: str, model: str, timeout: float = 5.0, mm_timeout: float = 30.0
                 ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.mm_timeout = mm_timeout
        self._session: aiohttp.ClientSession | None = None
        self.use_tokenize = False  # set once the render API answered 404

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _timeout_for(self, body: Mapping[str, Any] | None) -> float:
        if chat_request(body):
            assert body is not None
            for m in body["messages"]:
                if isinstance(m, Mapping) and isinstance(m.get("content"), list) and m["content"]:
                    return self.mm_timeout
        return self.timeout

    async def _post(self, path: str, payload: Mapping[str, Any], timeout: float) -> Any:
        try:
            async with self._client().post(
                    self.url + path, json=payload,
                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status == 404:
                    return _NotFound
                text = await resp.text()
                if resp.status != 200:
                    raise TokenizeError(f"{self.url}{path}: HTTP {resp.status}: {text[:1024]}")
                return json.loads(text)
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
            raise TokenizeError(f"{self.url}{path}: {type(e).__name__}: {e}") from None

    async def tokenize(self, body: Mapping[str, Any] | None, prompt: str) -> list[int]:
        chat = chat_request(body)
        payload: dict[str, Any] = dict(body) if body is not None else {"prompt": prompt}
        payload["model"] = self.model
        timeout = self._timeout_for(body)
        if not self.use_tokenize:
            path = CHAT_RENDER_PATH if chat else COMPLETIONS_RENDER_PATH
            got = await self._post(path, payload, timeout)
            if got is not _NotFound:
                return _render_tokens(got, chat, self.url + path)
            self.use_tokenize = True
        tok: dict[str, Any] = {"model": self.model}
        if chat:
            for k in ("messages", "add_generation_prompt", "continue_final_message",
                      "add_special_tokens", "chat_template", "chat_template_kwargs", "tools",
                      "documents"):
                if k in payload:
                    tok[k] = payload[k]
        else:
            p = payload.get("prompt", prompt)
            if isinstance(p, list):  # a batch of prompts: llm-d hashes each; use the first
                p = p[0] if p else ""
            tok["prompt"] = p
        got = await self._post(TOKENIZE_PATH, tok, timeout)
        if got is _NotFound:
            raise TokenizeError(f"{self.url}: neither {CHAT_RENDER_PATH if chat else COMPLETIONS_RENDER_PATH} "
                                f"nor {TOKENIZE_PATH} exists (HTTP 404)")
        tokens = got.get("tokens") if isinstance(got, Mapping) else None
        return _ints(tokens, self.url + TOKENIZE_PATH)


class _NotFoundType:
    pass


_NotFound = _NotFoundType()


def _ints(v: Any, where: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise TokenizeError(f"{where}: the answer has no list of integer token ids")
    return v


def _render_tokens(got: Any, chat: bool, where: str) -> list[int]:
    if chat:
        return _ints(got.get("token_ids") if isinstance(got, Mapping) else None, where)
    if isinstance(got, list):  # one entry per prompt
        if not got:
            raise TokenizeError(f"{where}: empty render response")
        first = got[0]
        return _ints(first.get("token_ids") if isinstance(first, Mapping) else None, where)
    return _ints(got.get("token_ids") if isinstance(got, Mapping) else None, where)


# ------------------------------------------------------------------------- local


class LocalTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer from a local ``tokenizer.json`` (a file, or
    a directory holding it and, optionally, ``tokenizer_config.json`` with
    ``chat_template``/``bos_token``/``eos_token``)."""

    name = "local"

    def __init__(self, path: str, chat_template: str | None = None,
                 prefix_store: TokenPrefixStore | None = None,
                 min_prefix_overlap: float = 0.8) -> None:
        from tokenizers import Tokenizer

        self.prefix_store = prefix_store
        self.min_prefix_overlap = min_prefix_overlap
        #: Tail tokenizations still to check against whole ones (-1: tails are off).
        self._tail_checks = TAIL_CHECKS
        #: Probes agree with whole tokenizations so far (see ``tokenize_leading``).
        self._probe_ok = True
        self._pool: ThreadPoolExecutor | None = None  # the tokenizer's thread, made on use

        p = pathlib.Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self._tok = Tokenizer.from_file(str(file))
        config: dict[str, Any] = {}
        cfg_file = file.parent / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text())
        self.special: dict[str, str] = {}
        for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = config.get(k)
            if isinstance(v, Mapping):
                v = v.get("content")
            if isinstance(v, str):
                self.special[k] = v
        template = chat_template if chat_template is not None else config.get("chat_template")
        if isinstance(template, list):  # named templates: the "default" one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) else None
        if self.chat_template is not None:
            # compiled now: a broken template fails at startup, and the first chat request
            # does not wait for jinja (~0.1 s)
            from jinja2 import TemplateError

            try:
                _compiled_template(self.chat_template)
            except TemplateError as e:
                raise ValueError(f"the chat template does not compile: {e}") from None

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    async def _encode_off_loop(self, *texts: tuple[str, bool]) -> list[Any]:
        """Encodings of ``texts``; long ones in the tokenizer's own thread. ``encode_batch``
        releases the GIL while it runs (``encode`` does not), so the event loop goes on
        serving other requests and KV events meanwhile (same ids, ~5% more CPU). Handing
        over costs ~0.2 ms, about what encoding 1,500 characters does: shorter texts are
        encoded in place."""
        if sum(len(t) for t, _ in texts) < THREAD_MIN_CHARS:
            return [self._tok.encode(t, add_special_tokens=add) for t, add in texts]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="epp-tokenize")
        encs: list[Any] = await asyncio.get_running_loop().run_in_executor(
            self._pool, self._encode_each, texts)
        return encs

    def _encode_each(self, texts: tuple[tuple[str, bool], ...]) -> list[Any]:
        return [self._tok.encode_batch([t], add_special_tokens=add)[0] for t, add in texts]

    def render_chat(self, body: Mapping[str, Any]) -> str:
        template = body.get("chat_template") or self.chat_template
        if not isinstance(template, str):
            raise TokenizeError("chat request but the local tokenizer has no chat_template")
        return render_chat_template(
            template, body["messages"],
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            tools=body.get("tools"), documents=body.get("documents"),
            special=self.special, kwargs=body.get("chat_template_kwargs") or {})

    def _text(self, body: Mapping[str, Any] | None, prompt: str) -> tuple[str | list[int], bool]:
        """What to encode (or the ids the client gave) and whether to add special tokens."""
        if body is not None and chat_request(body):
            # vLLM's chat default: the template already carries the special tokens
            return self.render_chat(body), bool(body.get("add_special_tokens", False))
        p: Any = body.get("prompt", prompt) if body is not None else prompt
        if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            return list(p), False  # already token ids
        if isinstance(p, list):
            p = p[0] if p else ""
        if not isinstance(p, str):
            p = prompt
        return p, bool(body.get("add_special_tokens", True)) if body is not None else True

    async def tokenize(self, body: Mapping[str, Any] | None, prompt: str) -> list[int]:
        text, add = self._text(body, prompt)
        if isinstance(text, list):
            return text
        (enc,) = await self._encode_off_loop((text, add))
        ids: list[int] = enc.ids
        return ids

    async def tokenize_prefix(self, body: Mapping[str, Any] | None, prompt: str
                              ) -> tuple[list[int], int]:
        """With a prefix store: ``(ids, 0)`` for the whole prompt, or ``(leading ids,
        estimated token count)`` when the store covers at least ``min_prefix_overlap`` of
        the prompt's characters (no tokenizer call then)."""
        text, add = self._text(body, prompt)
        if isinstance(text, list):
            return text, 0
        store = self.prefix_store
        if store is None:
            (enc,) = await self._encode_off_loop((text, add))
            return enc.ids, 0
        salt = int(add)
        hit = store.lookup(text, salt)
        if hit.covered and hit.coverage >= self.min_prefix_overlap:
            return hit.token_ids, _estimate(hit.token_ids, hit.covered, len(text))
        return await self._rest(text, add, salt, hit), 0

    async def _rest(self, text: str, add: bool, salt: int, hit: PrefixLookup | None
                    ) -> list[int]:
        """The whole prompt's ids when the store (if any) did not cover enough of it."""
        store = self.prefix_store
        if hit is not None and hit.token_ids and self._tail_checks >= 0:
            return await self._tail(text, add, salt, hit)
        (enc,) = await self._encode_off_loop((text, add))
        ids: list[int] = enc.ids
        if store is not None:
            store.add(text, ids, enc.offsets, salt)
        return ids

    async def tokenize_leading(self, body: Mapping[str, Any] | None, prompt: str
                               ) -> tuple[list[int], int, asyncio.Future[list[int]] | None]:
        """``(ids, estimated total, whole)``: as :meth:`tokenize_prefix` (or
        :meth:`tokenize` without a store) — ``whole`` None — except where that would
        encode a long text (from ``THREAD_MIN_CHARS`` characters on, the ~2–10 ms that
        tokenizing a new long prompt takes): then it answers at once with the prompt's
        leading ids (the store's partial hit, else a probe: the first ``PROBE_CHARS``
        characters encoded, less the tokens ending in the last ``PROBE_MARGIN_CHARS``,
        where the rest of the text may cut a word otherwise) and starts the whole
        tokenization in the tokenizer's thread, as ``whole``. A precise prefix lookup that
        finds no pod holding all of those leading blocks has its answer without the rest
        (block keys chain: no pod can match further). The probe is exact where the prefix
        store is (its module docstring); each whole tokenization checks it, and one
        difference turns probes off for good (logged)."""
        text, add = self._text(body, prompt)
        if isinstance(text, list):
            return text, 0, None
        salt = int(add)
        store = self.prefix_store
        hit = store.lookup(text, salt) if store is not None else None
        if hit is not None and hit.covered and hit.coverage >= self.min_prefix_overlap:
            return hit.token_ids, _estimate(hit.token_ids, hit.covered, len(text)), None
        start = hit.token_end if hit is not None and hit.token_ids else 0
        if len(text) - start < THREAD_MIN_CHARS or (not start and not self._probe_ok):
            return await self._rest(text, add, salt, hit), 0, None
        if start:
            assert hit is not None
            lead, covered = hit.token_ids, hit.covered
            whole = asyncio.ensure_future(self._rest(text, add, salt, hit))
        else:
            lead, covered = self._probe(text, add)
            whole = asyncio.ensure_future(self._checked(text, add, salt, lead))
            if not lead:  # no token safely ends in the probe (one very long word)
                return await whole, 0, None
        return lead, _estimate(lead, covered, len(text)), whole

    def _probe(self, text: str, add: bool) -> tuple[list[int], int]:
        cut = PROBE_CHARS - PROBE_MARGIN_CHARS
        enc = self._tok.encode(text[:PROBE_CHARS], add_special_tokens=add)
        offsets = enc.offsets
        m = len(offsets)
        while m and offsets[m - 1][1] == 0:  # special tokens added after the text
            m -= 1
        keep = bisect_right(offsets, cut, 0, m, key=_end)
        ids: list[int] = enc.ids[:keep]
        return ids, cut

    async def _checked(self, text: str, add: bool, salt: int, lead: list[int]) -> list[int]:
        ids = await self._rest(text, add, salt, None)
        if self._probe_ok and ids[:len(lead)] != lead:
            self._probe_ok = False
            log.warning("local tokenizer: a prompt's first %d characters tokenized on their "
                        "own give other leading ids than the whole prompt's; probes are off "
                        "(new long prompts wait for their whole tokenization)", PROBE_CHARS)
        return ids

    async def _tail(self, text: str, add: bool, salt: int, hit: PrefixLookup) -> list[int]:
        """The whole prompt's ids as the stored prefix's plus the rest's, tokenized on its
        own from where the prefix's last token ends — the same ids as tokenizing it all
        for tokenizers that cut there the same way either side (byte-level BPEs,
        Metaspace and word-level pre-tokenizers; not a normalizer that prepends a marker
        to any text it is given, as Llama 2's ``Prepend("▁")``). The first
        ``TAIL_CHECKS`` are checked against a whole tokenization; one difference turns
        tails off for good (logged; that prompt gets the whole tokenization's ids)."""
        assert self.prefix_store is not None
        start = hit.token_end
        check = self._tail_checks > 0
        encs = await self._encode_off_loop((text[start:], False),
                                           *([(text, add)] if check else []))
        enc = encs[0]
        ids: list[int] = hit.token_ids + enc.ids
        if check:
            whole = encs[1]
            if whole.ids != ids:
                self._tail_checks = -1
                log.warning("local tokenizer: tokenizing a prompt's rest on its own gives "
                            "other ids than the whole prompt's; the prefix store now serves "
                            "only prompts it covers (minPrefixOverlapRatio)")
                self.prefix_store.add(text, whole.ids, whole.offsets, salt)
                right: list[int] = whole.ids
                return right
            if self._tail_checks > 0:
                self._tail_checks -= 1
        elif self._tail_checks < 0:  # another prompt's check turned tails off meanwhile
            (whole,) = await self._encode_off_loop((text, add))
            self.prefix_store.add(text, whole.ids, whole.offsets, salt)
            exact: list[int] = whole.ids
            return exact
        self.prefix_store.add(text, enc.ids, enc.offsets, salt,
                              first_block=hit.covered // self.prefix_store.block_chars,
                              shift=start)
        return ids


def _estimate(ids: Sequence[int], covered: int, length: int) -> int:
    """A prompt's token count from the ids of its first ``covered`` of ``length``
    characters."""
    if not covered:
        return len(ids)
    return max(len(ids), round(len(ids) * length / covered))


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str) -> Any:
    """A chat template compiled once, in a sandboxed environment set up as
    ``transformers``' (compile errors raise ``TemplateError`` and are not cached)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat_template(template: str, messages: Sequence[Any], *,
                         add_generation_prompt: bool = True,
                         continue_final_message: bool = False,
                         tools: Any = None, documents: Any = None,
                         special: Mapping[str, str] | None = None,
                         kwargs: Mapping[str, Any] | None = None) -> str:
    """Render a Hugging Face chat template the way ``apply_chat_template`` does."""
    from jinja2 import TemplateError

    try:
        text: str = _compiled_template(template).render(
            messages=list(messages), tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt,
            **dict(special or {}), **dict(kwargs or {}))
    except TemplateError as e:
        raise TokenizeError(f"chat template: {e}") from None
    if continue_final_message and messages:
        last = messages[-1]
        content = last.get("content") if isinstance(last, Mapping) else None
        if isinstance(content, str) and content.strip() and content.strip() in text:
            text = text[: text.rindex(content.strip()) + len(content.strip())]
    return text


# ------------------------------------------------------------------------- estimate


class EstimateTokenizer:
    """llm-d's ``estimate`` backend: no tokenizer; the prompt's UTF-8 bytes packed four
    to a pseudo-token (≈4 bytes/token). The ids do not match any engine's tokens, so
    precise prefix routing only works if the engines' events are hashed the same way —
    they are not; configure a real backend for it (llm-d warns the same)."""

    name = "estimate"

    async def close(self) -> None:
        return None

    async def tokenize(self, body: Mapping[str, Any] | None, prompt: str) -> list[int]:
        data = prompt.encode("utf-8")
        return [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]


async def with_budget(coro: Any, seconds: float) -> Any:
    """``coro`` within ``seconds`` (TokenizeError when it runs out)."""
    try:
        async with asyncio.timeout(seconds):
            return await coro
    except TimeoutError:
        raise TokenizeError(f"tokenization took longer than {seconds:g}s") from None
