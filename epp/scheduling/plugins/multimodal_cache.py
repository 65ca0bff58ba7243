"""Multimodal encoder-cache affinity (llm-d-router): ``mm-embeddings-cache-producer`` and
``mm-embeddings-cache-scorer``.

llm-d-router v0.10.0 ``pkg/epp/framework/plugins/requestcontrol/dataproducer/multimodal``
(``producer.go``, ``prerequest.go``, README) and ``scheduling/scorer/mmcacheaffinity``.

The producer remembers, per endpoint, which media items (images, videos, audio) requests
it served carried — an LRU of ``cacheSizeInMBPerServer`` / 2 entries per endpoint (llm-d
assumes 2 MiB per item; default 4096 MiB → 2048 entries; ≤ 0 takes the default) —
because the model server keeps their encoder outputs (embeddings) cached. Per request,
before scheduling, it lists the request's unique items and, per candidate, which of them
that endpoint holds; after the decision it adds the items to every endpoint of the
primary profile's result. An endpoint leaving the pool (``endpoint-notification-source``
delete event, or the datastore's removal) loses its entries. The scorer gives each
endpoint matched items / request items (0 without media).

Items: llm-d takes the hashes of the token-producer's multimodal features (vLLM's
render). This EPP takes them from the request body: the ``features.mm_hashes`` of a vLLM
generate request (vLLM's own content hashes), else each media part of a chat body
(``image_url``, ``video_url``, ``input_audio``, ``audio_url``; Anthropic ``image``
blocks), identified by a SHA-256 of its URL or inline data — the same image sent again
is the same item (the fallback llm-d's README describes for typed media blocks).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

import orjson

from epp import keys
from epp.errors import ConfigError
from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.params import param
from epp.parsing.request import MULTIMODAL_PART_TYPES
from epp.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult

if TYPE_CHECKING:
    from epp.observability.metrics import EppMetrics

PRODUCER_TYPE: Final = "mm-embeddings-cache-producer"
SCORER_TYPE: Final = "mm-embeddings-cache-scorer"
DATA_TYPE: Final = "MultiModalEncoderCacheMatchInfoKey"
DEFAULT_CACHE_SIZE_MB: Final = 4096
MB_PER_ITEM: Final = 2


def match_info_key(producer_name: str = "") -> str:
    """llm-d's ``EncoderCacheMatchInfoKey.WithNonEmptyProducerName(name).String()``."""
    return f"{DATA_TYPE}/{producer_name or PRODUCER_TYPE}"


def lru_capacity(cache_size_mb: int) -> int:
    """Entries per endpoint for a MiB budget (2 MiB an item; ≤ 0: 4096 MiB)."""
    mb = cache_size_mb if cache_size_mb > 0 else DEFAULT_CACHE_SIZE_MB
    return max(mb // MB_PER_ITEM, 1)


def _media_ref(part: Mapping[str, Any], ptype: str) -> bytes:
    v = part.get(ptype) if ptype != "image" else part.get("source")
    if isinstance(v, Mapping):
        for k in ("url", "data"):
            if isinstance(v.get(k), str):
                return str(v[k]).encode()
    if isinstance(v, str):
        return v.encode()
    return orjson.dumps(part, option=orjson.OPT_SORT_KEYS)


def media_items(body: Mapping[str, Any] | None) -> dict[str, str]:
    """The request's unique media items: content hash → modality (see the module doc)."""
    if not isinstance(body, Mapping):
        return {}
    items: dict[str, str] = {}
    features = body.get("features")
    if isinstance(features, Mapping) and isinstance(features.get("mm_hashes"), Mapping):
        for modality, hashes in features["mm_hashes"].items():
            if isinstance(hashes, list):
                for h in hashes:
                    if isinstance(h, str) and h:
                        items[h] = str(modality)
    messages = body.get("messages")
    if not isinstance(messages, list):
        return items
    for msg in messages:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                continue
            ptype = part["type"]
            modality = MULTIMODAL_PART_TYPES.get(ptype)
            if modality is None and ptype == "image" and isinstance(part.get("source"), dict):
                modality = "image"
            if modality is not None:
                items[hashlib.sha256(_media_ref(part, ptype)).hexdigest()] = modality
    return items


@dataclass(frozen=True)
class EncoderCacheMatch:
    """llm-d's ``EncoderCacheMatchInfo`` for one request: its items (hash → modality)
    and, per candidate endpoint key, the hashes that endpoint holds."""

    request_items: Mapping[str, str]
    matched: Mapping[str, frozenset[str]]


@dataclass(frozen=True)
class MMProducerParameters:
    cache_size_in_mb_per_server: int = param("cacheSizeInMBPerServer", 0)


class MMEmbeddingsCacheProducer:
    type_name = PRODUCER_TYPE
    data_input = fw.DATA_ENDPOINT_EVENTS
    Parameters = MMProducerParameters

    def __init__(self, name: str, cache_size_mb: int = 0) -> None:
        self.name = name
        self.capacity = lru_capacity(cache_size_mb)
        self.key = match_info_key(name)
        self.produces = MappingProxyType({self.key: "EncoderCacheMatchInfo"})
        self.caches: dict[str, OrderedDict[str, None]] = {}  # endpoint key -> LRU of hashes
        # Each cached endpoint's ``namespace/name`` (llm-d's endpoint ID, the ``pod``
        # label of llm_d_epp_encoder_cache_hits_total).
        self.pod_ids: dict[str, str] = {}
        # Items looked up and candidate matches (a running total; llm-d's series are
        # recorded when bound to metrics: bind_metrics).
        self.queries = 0
        self.hits = 0
        self._metrics: EppMetrics | None = None

    @classmethod
    def from_params(cls, name: str, params: MMProducerParameters,
                    handle: PluginHandle) -> MMEmbeddingsCacheProducer:
        return cls(name, params.cache_size_in_mb_per_server)

    def bind_metrics(self, metrics: EppMetrics) -> None:
        """Record llm-d's ``llm_d_epp_encoder_cache_*`` series (multimodal metrics.go)."""
        self._metrics = metrics

    def match(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> EncoderCacheMatch:
        items = media_items(request.plugin_state.get(keys.PLUGIN_STATE_REQUEST_BODY))
        matched: dict[str, frozenset[str]] = {}
        for e in endpoints:
            cache = self.caches.get(e.key)
            matched[e.key] = frozenset(h for h in items if cache is not None and h in cache)
        return EncoderCacheMatch(MappingProxyType(items), MappingProxyType(matched))

    async def prepare_request_data(self, request: LLMRequest,
                                   endpoints: Sequence[Endpoint]) -> None:
        info = self.match(request, endpoints)
        if not info.request_items:
            return
        self.queries += len(info.request_items)
        self.hits += sum(len(m) for m in info.matched.values())
        request.plugin_state[self.key] = info
        if self._metrics is not None:
            self._record(self._metrics, info, endpoints)

    def _record(self, m: EppMetrics, info: EncoderCacheMatch,
                endpoints: Sequence[Endpoint]) -> None:
        """llm-d's Produce: recordItemLookups (a query per item, a hit per endpoint whose
        LRU holds it — every endpoint cached, not only the candidates) and recordHitRatio
        per candidate."""
        caches = self.caches
        for h, modality in info.request_items.items():
            m.record_encoder_cache_item(self, modality, [
                self.pod_ids.get(k, k) for k, cache in caches.items() if h in cache])
        total = len(info.request_items)
        for e in endpoints:
            m.record_encoder_cache_hit_ratio(self, len(info.matched.get(e.key, ())), total)

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        info = request.plugin_state.get(self.key)
        if not isinstance(info, EncoderCacheMatch) or not info.request_items:
            return
        primary = result.profile_results.get(result.primary_profile)
        if primary is None:
            return
        for e in primary.endpoints:
            cache = self.caches.get(e.key)
            if cache is None:
                cache = self.caches[e.key] = OrderedDict()
                self.pod_ids[e.key] = f"{e.namespace}/{e.name}"
            for h in info.request_items:
                cache[h] = None
                cache.move_to_end(h)
            while len(cache) > self.capacity:
                cache.popitem(last=False)

    def extract_endpoint(self, event: str, endpoint: Endpoint) -> None:
        if event == fw.EVENT_DELETE:
            self.endpoint_removed(endpoint.key)

    def endpoint_removed(self, key: str) -> None:
        self.caches.pop(key, None)
        self.pod_ids.pop(key, None)


@dataclass(frozen=True)
class MMScorerParameters:
    producer_name: str = param("producerName", "")


class MMEmbeddingsCacheScorer:
    """Matched media items / request media items per endpoint."""

    type_name = SCORER_TYPE
    Parameters = MMScorerParameters

    def __init__(self, name: str, producer_name: str = "") -> None:
        self.name = name
        self.producer_name = producer_name or PRODUCER_TYPE
        self.key = match_info_key(producer_name)
        self.consumes = MappingProxyType({self.key: "EncoderCacheMatchInfo"})

    @classmethod
    def from_params(cls, name: str, params: MMScorerParameters,
                    handle: PluginHandle) -> MMEmbeddingsCacheScorer:
        return cls(name, params.producer_name)

    def bind(self, handle: PluginHandle) -> None:
        """The producer of its key; created (llm-d's default producer, default
        parameters) when the config declares none."""
        found = handle.get(self.producer_name)
        if found is None:
            handle.add(MMEmbeddingsCacheProducer(self.producer_name))
        elif not isinstance(found, MMEmbeddingsCacheProducer):
            raise ConfigError(f"{self.name}.producerName: {self.producer_name!r} is a "
                              f"{found.type_name}, not an {PRODUCER_TYPE}")

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        info = request.plugin_state.get(self.key)
        if not isinstance(info, EncoderCacheMatch) or not info.request_items:
            return [0.0] * len(endpoints)
        total = len(info.request_items)
        return [len(info.matched.get(e.key, ())) / total for e in endpoints]
