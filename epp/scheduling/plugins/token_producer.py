"""``token-producer`` (llm-d-router): tokenize the request before scheduling.

llm-d-router v0.10.0 ``pkg/epp/framework/plugins/requestcontrol/dataproducer/tokenizer/``
(``tokenizer.go``, ``vllm_http.go``, its README): a PrepareData producer that puts the
prompt's token ids (``TokenizedPrompt``) on the request for ``precise-prefix-cache-
producer``; skipped when the request already carries them; a failure is logged and the
request is scheduled without tokens.

Parameters (llm-d's): ``modelName``; ``vllm: {url (http://localhost:8000), timeout (5s),
mmTimeout (30s)}`` — the model server's ``/v1/completions/render`` and
``/v1/chat/completions/render``, falling back to vLLM's ``/tokenize``; ``estimate: {…}``
(the byte-packing estimate, llm-d's default when no backend is set; its image/video
tunables have no effect here: text only). Backend selection as llm-d: ``vllm`` or
``modelName`` → HTTP; otherwise ``estimate``. ``udsTokenizerConfig`` (llm-d's deprecated
gRPC sidecar) is refused with the fix. This project adds ``local: {path, chatTemplate,
prefixStore}``: a Hugging Face ``tokenizers`` ``tokenizer.json`` (file or directory, with
its ``tokenizer_config.json``) run in process, chat templates rendered with jinja2 as
``transformers`` does; with ``prefixStore: {blockSize (256 characters), cacheSize
(500,000 blocks), minPrefixOverlapRatio (0.8)}`` a prompt whose leading text was tokenized
before takes its leading ids from an LRU store instead of the tokenizer
(:mod:`epp.kvcache.prefix_store`; the ids are then partial and the token count an
estimate), and one it covers in part is tokenized only from where the stored prefix ends.
The legacy type name ``tokenizer`` is accepted with a warning.

The tokens live in ``request.plugin_state["TokenizedPrompt"]``
(:class:`~epp.kvcache.tokenization.TokenizedPrompt`). The chat body comes from the
Director (``plugin_state["request.body"]``); without it (a non-JSON body, the
multi-worker front) the prompt text is tokenized as a completion.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from epp import keys
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import PREPARE_DATA_TIMEOUT_S
from epp.framework.params import (
    config_warning,
    decode_params,
    param,
    positive_duration,
    report_unknown,
)
from epp.kvcache.prefix_store import TokenPrefixStore
from epp.kvcache.tokenization import (
    EstimateTokenizer,
    HttpTokenizer,
    LocalTokenizer,
    TokenizedPrompt,
    TokenizeError,
    TokenizerBackend,
    with_budget,
)
from epp.scheduling.types import Endpoint, LLMRequest

log = logging.getLogger(__name__)

#: ``request.plugin_state`` key of the :class:`TokenizedPrompt` (llm-d's data key name).
TOKENIZED_PROMPT: Final = "TokenizedPrompt"
DEFAULT_VLLM_URL: Final = "http://localhost:8000"


@dataclass(frozen=True)
class VLLMParameters:
    url: str = param("url", DEFAULT_VLLM_URL)
    timeout: float = param("timeout", 5.0, parse=positive_duration)
    mm_timeout: float = param("mmTimeout", 30.0, parse=positive_duration)


@dataclass(frozen=True)
class PrefixStoreParameters:
    """The local backend's prefix store (llm-d-kv-cache-manager's ``prefixstore`` names)."""

    block_size: int = param("blockSize", 256, minimum=1)
    cache_size: int = param("cacheSize", 500_000, minimum=1)
    min_prefix_overlap_ratio: float = param("minPrefixOverlapRatio", 0.8, minimum=0.0,
                                            maximum=1.0)


def _prefix_store(v: Any, path: str) -> PrefixStoreParameters:
    return decode_params(PrefixStoreParameters, v, path)


@dataclass(frozen=True)
class LocalParameters:
    path: str = param("path", "")
    chat_template: str | None = param("chatTemplate", None)
    prefix_store: PrefixStoreParameters | None = param("prefixStore", None, parse=_prefix_store)  # noqa: RUF009 -- param() is the framework's field(); frozen default


def _vllm(v: Any, path: str) -> VLLMParameters:
    return decode_params(VLLMParameters, v, path)


def _local(v: Any, path: str) -> LocalParameters:
    p = decode_params(LocalParameters, v, path)
    if not p.path:
        raise ConfigError(f"{path}.path: required: the tokenizer.json file or its directory")
    return p


def _estimate(v: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(v).__name__}")
    report_unknown(path, set(v) - {"image", "video"}, ["image", "video"])
    return v


def _uds(v: Any, path: str) -> Any:
    raise ConfigError(f"{path}: llm-d's deprecated gRPC-over-UDS tokenizer is not supported; "
                      "set 'vllm: {url: http://<model server>:8000}' (or 'local: {path: …}') "
                      "instead")


@dataclass(frozen=True)
class TokenProducerParameters:
    model_name: str = param("modelName", "")
    vllm: VLLMParameters | None = param("vllm", None, parse=_vllm)  # noqa: RUF009 -- param() is the framework's field(); frozen default
    estimate: Mapping[str, Any] | None = param("estimate", None, parse=_estimate)
    uds: Any = param("udsTokenizerConfig", None, parse=_uds)  # noqa: RUF009 -- param() is the framework's field(); frozen default
    local: LocalParameters | None = param("local", None, parse=_local)  # noqa: RUF009 -- param() is the framework's field(); frozen default


class TokenProducer:
    type_name = "token-producer"
    produces = MappingProxyType({TOKENIZED_PROMPT: "TokenizedPrompt"})
    Parameters = TokenProducerParameters

    def __init__(self, name: str, backend: TokenizerBackend) -> None:
        self.name = name
        self.backend = backend
        self.failures = 0
        #: Hand out a long new prompt's leading ids at once and the whole later
        #: (``TokenizedPrompt.whole``): set by a consumer that can use them
        #: (``precise-prefix-cache-producer``), for the local backend only.
        self.early = False

    @classmethod
    def from_params(cls, name: str, params: TokenProducerParameters,
                    handle: PluginHandle) -> TokenProducer:
        backend: TokenizerBackend
        if params.local is not None:
            if params.vllm is not None or params.estimate is not None:
                raise ConfigError(f"{name}: set one tokenizer backend: 'local', 'vllm' or "
                                  "'estimate'")
            ps = params.local.prefix_store
            try:
                backend = LocalTokenizer(
                    params.local.path, params.local.chat_template,
                    None if ps is None else TokenPrefixStore(ps.block_size, ps.cache_size),
                    1.0 if ps is None else ps.min_prefix_overlap_ratio)
            except Exception as e:  # noqa: BLE001 -- tokenizers raises bare Exception
                raise ConfigError(f"{name}.local.path: cannot load the tokenizer from "
                                  f"{params.local.path!r}: {e}") from None
        elif params.vllm is not None or params.model_name:
            if params.estimate is not None:
                raise ConfigError(f"{name}: 'estimate' and 'vllm'/'modelName' exclude each "
                                  "other; set one backend")
            v = params.vllm or VLLMParameters()
            backend = HttpTokenizer(v.url, params.model_name, v.timeout, v.mm_timeout)
        else:
            backend = EstimateTokenizer()
        return cls(name, backend)

    async def prepare_request_data(self, request: LLMRequest,
                                   endpoints: Sequence[Endpoint]) -> None:
        if TOKENIZED_PROMPT in request.plugin_state:
            return
        body = request.plugin_state.get(keys.PLUGIN_STATE_REQUEST_BODY)
        backend = self.backend
        estimated_total = 0
        whole: asyncio.Future[list[int]] | None = None
        try:
            if isinstance(backend, LocalTokenizer) and self.early:
                ids, estimated_total, whole = await with_budget(
                    backend.tokenize_leading(body, request.prompt), PREPARE_DATA_TIMEOUT_S)
            elif isinstance(backend, LocalTokenizer) and backend.prefix_store is not None:
                ids, estimated_total = await with_budget(
                    backend.tokenize_prefix(body, request.prompt), PREPARE_DATA_TIMEOUT_S)
            else:
                ids = await with_budget(backend.tokenize(body, request.prompt),
                                        PREPARE_DATA_TIMEOUT_S)
        except TokenizeError as e:
            self.failures += 1
            log.warning("%s: request %s not tokenized: %s", self.name, request.request_id, e)
            return
        if whole is not None:
            whole.add_done_callback(functools.partial(self._whole_done, request.request_id))
        if ids:
            request.plugin_state[TOKENIZED_PROMPT] = TokenizedPrompt(
                tuple(ids), request.cache_salt, backend.name, estimated_total, whole)

    def _whole_done(self, request_id: str, whole: asyncio.Future[list[int]]) -> None:
        if whole.cancelled():
            return
        e = whole.exception()
        if e is not None:
            self.failures += 1
            log.warning("%s: request %s: whole tokenization failed (routed on its leading "
                        "ids): %s", self.name, request_id, e)

    async def start_background(self) -> None:
        return None

    async def stop_background(self) -> None:
        await self.backend.close()


class LegacyTokenizer(TokenProducer):
    """llm-d's deprecated type name ``tokenizer``."""

    type_name = "tokenizer"

    @classmethod
    def from_params(cls, name: str, params: TokenProducerParameters,
                    handle: PluginHandle) -> TokenProducer:
        config_warning(name, "plugin type 'tokenizer' is deprecated; use 'token-producer'")
        return super().from_params(name, params, handle)


def tokenized(request: LLMRequest) -> TokenizedPrompt | None:
    """The request's tokens: the whole prompt's once its whole tokenization is done (see
    ``TokenizedPrompt.whole``), its leading ids until then."""
    got = request.plugin_state.get(TOKENIZED_PROMPT)
    if not isinstance(got, TokenizedPrompt):
        return None
    whole = got.whole
    if whole is None or not whole.done():
        return got
    if whole.cancelled() or whole.exception() is not None:
        done = TokenizedPrompt(got.token_ids, got.cache_salt, got.source, got.estimated_total)
    else:
        done = TokenizedPrompt(tuple(whole.result()), got.cache_salt, got.source)
    request.plugin_state[TOKENIZED_PROMPT] = done
    return done


async def whole_tokenization(request: LLMRequest) -> TokenizedPrompt | None:
    """:func:`tokenized`, after waiting for the whole tokenization if it is under way
    (within the PrepareData budget; its leading ids when it fails)."""
    tp = tokenized(request)
    if tp is not None and tp.whole is not None:
        try:
            await with_budget(asyncio.shield(tp.whole), PREPARE_DATA_TIMEOUT_S)
        except TokenizeError as e:
            log.warning("request %s: %s; routed on the prompt's leading ids",
                        request.request_id, e)
        except Exception as e:  # noqa: BLE001 -- token-producer logs the tokenizer's error
            log.debug("request %s: whole tokenization failed: %s", request.request_id, e)
        tp = tokenized(request)
    return tp
