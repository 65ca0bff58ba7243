"""``precise-prefix-cache-producer`` and ``precise-prefix-cache-scorer`` (llm-d-router):
prefix-cache affinity from the model servers' own KV events.

llm-d-router v0.10.0 ``pkg/epp/framework/plugins/requestcontrol/dataproducer/
preciseprefixcache/`` (``producer.go``, ``extractor.go``, ``prerequest.go``,
``blockkeys.go``, README) and ``pkg/epp/framework/plugins/scheduling/scorer/
preciseprefixcache/`` (the deprecated composite scorer). The index, events and
subscribers are :mod:`epp.kvcache`.

Per request the producer hashes the ``TokenizedPrompt`` (from ``token-producer``) into
block keys (``tokenProcessorConfig.blockSize``/``hashSeed``, the target model, the cache
salt folded into block 0), looks them up, and gives each candidate the longest run of
leading blocks it holds (a CPU block counts 0.8, as llm-d's default
``kvCacheBackendConfigs``) out of the prompt's blocks — llm-d's ``PrefixCacheMatchInfo``,
read by ``prefix-cache-scorer`` with ``prefixMatchInfoProducerName`` naming this producer.
A prompt without tokens, or shorter than one block, scores 0 everywhere.

Events reach the index two ways (``kvEventsConfig``): ``zmqEndpoint`` binds one SUB socket
the engines connect to (pods named by the topic ``kv@<pod>@<model>``); with
``discoverPods`` (default) and the producer wired as an extractor of
``endpoint-notification-source`` (``dataLayer``), each endpoint gets a subscriber
connected to ``tcp://<address>:<podDiscoveryConfig.socketPort>`` (5557), its blocks kept
under the endpoint's ``address:port``. A pod that leaves the pool is dropped. For pods
sharing one address (this project's addition, ``podDiscoveryConfig.endpointPortOffset``
N): ``tcp://<address>:<port + N>``, as ``epp sim --kv-events-port-offset N`` publishes.

``speculativeIndexing``: after a decision the chosen endpoint is credited with the
prompt's blocks for ``speculativeTTL`` (2s), so a burst of same-prefix requests follows
the first before its events arrive.

``balanceAbsThreshold`` / ``balanceRelThreshold`` (this project's addition, off by
default as llm-d has none): the approximate producer's balance guard — a candidate
loaded far above the least-loaded one gets prefix score 0, so one hot prefix does not
pile every request onto the pod that holds it. ``balancePopularOnly`` (off by default)
narrows it as it does the approximate producer's: the guard acts only while the
request's prefix group (the block key where its longest match ends) has a share of the
recent requests that calls for more holders than it has.

``indexerConfig.tokenizersPoolConfig`` (deprecated): the producer refuses it, as llm-d's
does; ``precise-prefix-cache-scorer`` runs its tokenizer itself for requests without
tokens (llm-d-router v0.10.0 ``scorer/preciseprefixcache/legacy_producer.go``) when it is
local — :func:`tokenizers_pool`.

Memory: ``indexerConfig.kvBlockIndexConfig.inMemoryConfig.maxBlocksPerPod`` (this
project's addition, default 262144) bounds each pod's entries per medium (oldest dropped
first); ``size`` bounds the entries over all pods; llm-d's ``podCacheSize`` (pods per key)
is accepted and has no effect — the index is kept per pod (:mod:`epp.kvcache.index`).
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from epp.errors import ConfigError
from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.params import (
    ParameterError,
    config_warning,
    current_policy,
    decode_params,
    param,
    parse_duration,
)
from epp.kvcache.index import DEFAULT_MEDIUM_WEIGHTS, BlockIndex
from epp.kvcache.subscriber import (
    DEFAULT_SOCKET_PORT,
    DEFAULT_TOPIC_FILTER,
    SubscriberManager,
    zmq_addresses,
)
from epp.kvcache.tokenization import LocalTokenizer, TokenizedPrompt
from epp.scheduling.plugins.prefix import PrefixPopularity, QueueAvoidance
from epp.scheduling.plugins.token_producer import (
    TOKENIZED_PROMPT,
    TokenProducer,
    tokenized,
    whole_tokenization,
)
from epp.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult

log = logging.getLogger(__name__)

SPECULATIVE: Final = "speculative"
_STATE = "precise-prefix"

# ----------------------------------------------------------------------- parameters


def _nested(cls: type[Any]) -> Any:
    def parse(v: Any, path: str) -> Any:
        return decode_params(cls, v, path)
    return parse


def _go_duration(v: Any, path: str) -> float:
    """A Go ``time.Duration`` as JSON: nanoseconds (an integer) or a duration string."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v / 1e9
    return parse_duration(v, path)


@dataclass(frozen=True)
class TokenProcessorParameters:
    block_size: int = param("blockSize", 0)  # deprecated spelling of blockSizeTokens
    block_size_tokens: int = param("blockSizeTokens", 0)
    hash_seed: str = param("hashSeed", "")

    def __post_init__(self) -> None:
        from epp.framework.params import ParameterError

        bad = self.block_size_tokens if self.block_size_tokens else self.block_size
        if bad < 0:
            raise ParameterError("blockSizeTokens",
                                 f"blockSizeTokens must be greater than 0, got {bad}")

    @property
    def effective_block_size(self) -> int:
        """llm-d's rule: blockSizeTokens, else the deprecated blockSize, else 16."""
        return self.block_size_tokens or self.block_size or 16


@dataclass(frozen=True)
class InMemoryParameters:
    size: int = param("size", 100_000_000, minimum=1)
    pod_cache_size: int = param("podCacheSize", 10, minimum=1)
    max_blocks_per_pod: int = param("maxBlocksPerPod", 262_144, minimum=1)


def _unsupported_backend(v: Any, path: str) -> Any:
    raise ConfigError(f"{path}: only the in-memory KV-block index is supported here; "
                      "remove it (use inMemoryConfig)")


@dataclass(frozen=True)
class KVBlockIndexParameters:
    in_memory: InMemoryParameters = param("inMemoryConfig", InMemoryParameters(),  # noqa: RUF009 -- param() is the framework's field(); frozen default
                                          parse=_nested(InMemoryParameters))
    redis: Any = param("redisConfig", None, parse=_unsupported_backend)  # noqa: RUF009 -- param() is the framework's field(); frozen default
    cost_aware: Any = param("costAwareMemoryConfig", None, parse=_unsupported_backend)  # noqa: RUF009 -- param() is the framework's field(); frozen default
    enable_metrics: bool = param("enableMetrics", False)
    metrics_logging_interval: float = param("metricsLoggingInterval", 0.0, parse=_go_duration)


def _backends(v: Any, path: str) -> Mapping[str, float]:
    if not isinstance(v, list):
        raise ConfigError(f"{path}: expected a list of {{name, weight}}, got {type(v).__name__}")
    out: dict[str, float] = {}
    for i, item in enumerate(v):
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise ConfigError(f"{path}[{i}]: expected {{name: <medium>, weight: <number>}}")
        w = item.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, int | float):
            raise ConfigError(f"{path}[{i}].weight: expected a number, got {w!r}")
        out[item["name"].lower()] = float(w)
    return out


def _tokenizer_map(v: Any, path: str) -> Mapping[str, str]:
    if not isinstance(v, Mapping) or not all(isinstance(k, str) and isinstance(x, str)
                                              for k, x in v.items()):
        raise ConfigError(f"{path}: expected a mapping of model name to tokenizer path "
                          "(a directory holding tokenizer.json, or the file)")
    return MappingProxyType(dict(v))


@dataclass(frozen=True)
class UdsTokenizerParameters:
    """llm-d-kv-cache's ``UdsTokenizerConfig`` (``tokenizersPoolConfig.uds``)."""

    socket_file: str = param("socketFile", "")
    use_tcp: bool = param("useTCP", False)
    model_tokenizer_map: Mapping[str, str] | None = param("modelTokenizerMap", None,
                                                          parse=_tokenizer_map)


#: Keys of llm-d-kv-cache v0.7's pool (llm-d-inference-scheduler v0.8.0's configs) that
#: llm-d-router v0.10.0 (llm-d-kv-cache v0.9) no longer has: its strict decoder refuses
#: them ("json: unknown field").
_OLD_POOL_KEYS = {"local": "the in-process local tokenizer", "hf": "the in-process Hugging "
                  "Face tokenizer (downloaded from the hub)"}


def _pool(v: Any, path: str) -> TokenizersPoolParameters:
    if isinstance(v, Mapping):
        old = sorted(set(v) & set(_OLD_POOL_KEYS))
        if old:
            what = ", ".join(f"{k} ({_OLD_POOL_KEYS[k]})" for k in old)
            head = (f"{what}: not read by llm-d-router v0.10.0, whose pool has only "
                    "modelName, workersCount and uds (its strict decoder fails on it)")
            fix = ("point uds.modelTokenizerMap (or modelName) at a local copy of the "
                   "tokenizer, or declare a token-producer")
            if current_policy().strict:
                raise ConfigError(f"{path}: {head}; remove it and {fix}")
            config_warning(path, f"{head}; ignored: {fix}")
            v = {k: x for k, x in v.items() if k not in _OLD_POOL_KEYS}
    return decode_params(TokenizersPoolParameters, v, path)


@dataclass(frozen=True)
class TokenizersPoolParameters:
    """llm-d's deprecated ``indexerConfig.tokenizersPoolConfig`` (llm-d-kv-cache's
    tokenization ``Config``): the tokenizer ``precise-prefix-cache-scorer`` runs itself."""

    model_name: str = param("modelName", "")
    workers_count: int = param("workersCount", 5, minimum=0)  # llm-d's pool workers: unused
    uds: UdsTokenizerParameters | None = param("uds", None,  # noqa: RUF009 -- param() is the framework's field(); frozen default
                                               parse=_nested(UdsTokenizerParameters))


@dataclass(frozen=True)
class IndexerParameters:
    kv_block_index: KVBlockIndexParameters = param(  # noqa: RUF009 -- param() is the framework's field(); frozen default
        "kvBlockIndexConfig", KVBlockIndexParameters(), parse=_nested(KVBlockIndexParameters))
    backends: Mapping[str, float] | None = param("kvCacheBackendConfigs", None, parse=_backends)
    # Only precise-prefix-cache-scorer (llm-d's legacy producer) reads it; the producer
    # refuses it as llm-d's does.
    tokenizers_pool: TokenizersPoolParameters | None = param(  # noqa: RUF009 -- param() is the framework's field(); frozen default
        "tokenizersPoolConfig", None, parse=_pool)


@dataclass(frozen=True)
class PodDiscoveryParameters:
    pod_label_selector: str = param("podLabelSelector", "llm-d.ai/inference-serving=true")
    pod_namespace: str = param("podNamespace", "")
    socket_port: int = param("socketPort", DEFAULT_SOCKET_PORT, minimum=1, maximum=65535)
    replay_socket_port: int = param("replaySocketPort", 0, minimum=0, maximum=65535)
    # This project's addition, for pools whose pods share one address (a single-host
    # pool: distinct HTTP ports on 127.0.0.1): the endpoint on port P publishes on
    # P + endpointPortOffset (`epp sim --kv-events-port-offset N`), its replay socket on
    # that + (replaySocketPort - socketPort). 0 (default): llm-d's rule, socketPort.
    endpoint_port_offset: int = param("endpointPortOffset", 0, minimum=-65535, maximum=65535)

    def addresses(self, address: str, port: int) -> tuple[str, str | None]:
        """(PUB, replay or None) ZMQ addresses of the endpoint ``address:port``."""
        if not self.endpoint_port_offset:
            return zmq_addresses(address, self.socket_port, self.replay_socket_port or None)
        pub = port + self.endpoint_port_offset
        replay = (pub + self.replay_socket_port - self.socket_port
                  if self.replay_socket_port else None)
        for what, n in (("event", pub), ("replay", replay)):
            if n is not None and not 0 < n < 65536:
                raise ValueError(f"endpointPortOffset {self.endpoint_port_offset} puts "
                                 f"{address}:{port}'s {what} port at {n}, outside 1-65535")
        return zmq_addresses(address, pub, replay)


def _engine(v: Any, path: str) -> str:
    if v not in ("vllm", ""):
        raise ConfigError(f"{path}: only vLLM KV events are supported here, got {v!r}; "
                          "set engineType: vllm or leave it out")
    return "vllm"


@dataclass(frozen=True)
class KVEventsParameters:
    zmq_endpoint: str = param("zmqEndpoint", "")
    topic_filter: str = param("topicFilter", DEFAULT_TOPIC_FILTER)
    concurrency: int = param("concurrency", 4, minimum=1)  # llm-d's worker count: unused
    engine_type: str = param("engineType", "vllm", parse=_engine)
    discover_pods: bool = param("discoverPods", True)
    pod_discovery: PodDiscoveryParameters = param(  # noqa: RUF009 -- param() is the framework's field(); frozen default
        "podDiscoveryConfig", PodDiscoveryParameters(), parse=_nested(PodDiscoveryParameters))


@dataclass(frozen=True)
class PrecisePrefixParameters:
    token_processor: TokenProcessorParameters = param(  # noqa: RUF009 -- param() is the framework's field(); frozen default
        "tokenProcessorConfig", TokenProcessorParameters(),
        parse=_nested(TokenProcessorParameters))
    indexer: IndexerParameters = param("indexerConfig", IndexerParameters(),  # noqa: RUF009 -- param() is the framework's field(); frozen default
                                       parse=_nested(IndexerParameters))
    kv_events: KVEventsParameters = param("kvEventsConfig", KVEventsParameters(),  # noqa: RUF009 -- param() is the framework's field(); frozen default
                                          parse=_nested(KVEventsParameters))
    speculative_indexing: bool = param("speculativeIndexing", False)
    speculative_ttl: float = param("speculativeTTL", 2.0, parse=parse_duration)
    # This project's addition (llm-d's producer has no balance guard): the approximate
    # producer's guard — an endpoint whose load (in-flight requests routed here, or its
    # scraped waiting + running) exceeds the least-loaded candidate's by more than
    # balanceAbsThreshold and balanceRelThreshold x that gets prefix score 0. 0: off.
    balance_abs_threshold: int = param("balanceAbsThreshold", 0, minimum=0)
    balance_rel_threshold: float = param("balanceRelThreshold", 1.5, minimum=1.0)
    # The approximate producer's balancePopularOnly: the guard acts only while the
    # request's prefix group calls for more holders than it has.
    balance_popular_only: bool = param("balancePopularOnly", False)
    # The approximate producer's avoidQueueing: a candidate whose KV cache has no room
    # for the request, by its last scrape less what this EPP routed there since, and
    # whose predicted wait plus prefill exceeds another's, gets prefix score 0.
    avoid_queueing: bool = param("avoidQueueing", False)
    prefill_ms_per_token: float = param("prefillMsPerToken", 0.05, minimum=0.0)


# ----------------------------------------------------------------------- producer


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """llm-d's ``PrefixCacheMatchInfo`` for one request over its candidates."""

    total_blocks: int
    match_blocks: Mapping[str, int]  # endpoint key -> weighted consecutive blocks (int)
    cached_blocks: Mapping[str, int]  # unweighted
    by_tier: Mapping[str, Mapping[str, int]]
    block_size_tokens: int


class PrecisePrefixCacheProducer:
    type_name = "precise-prefix-cache-producer"
    produces = MappingProxyType({fw.DATA_KEY_PREFIX_CACHE_MATCH_INFO: "PrefixCacheMatchInfo"})
    consumes = MappingProxyType({TOKENIZED_PROMPT: "TokenizedPrompt"})
    data_input = fw.DATA_ENDPOINT_EVENTS
    Parameters = PrecisePrefixParameters

    def __init__(self, name: str, params: PrecisePrefixParameters | None = None,
                 index: BlockIndex | None = None) -> None:
        p = params or PrecisePrefixParameters()
        self.name = name
        self.params = p
        mem = p.indexer.kv_block_index.in_memory
        self.block_size = p.token_processor.effective_block_size
        self.index = index or BlockIndex(
            block_size=self.block_size, hash_seed=p.token_processor.hash_seed,
            max_blocks_per_pod=mem.max_blocks_per_pod, max_keys=mem.size)
        self.weights: Mapping[str, float] = dict(p.indexer.backends or DEFAULT_MEDIUM_WEIGHTS)
        ev = p.kv_events
        self.manager = SubscriberManager(self.index, topic_filter=ev.topic_filter)
        self._wanted: dict[str, tuple[str, str | None]] = {}
        self._started = False
        self._log_task: asyncio.Task[None] | None = None
        self.lookups = 0
        self.lookup_hits = 0
        self.inflight: dict[str, int] = {}
        self.popularity = PrefixPopularity() if p.balance_popular_only else None
        self._group_key = f"{name}/group"  # plugin_state: the request's prefix group
        self.queues = QueueAvoidance(p.prefill_ms_per_token) if p.avoid_queueing else None
        self._ticket_key = f"{name}/queue-ticket"  # plugin_state: the QueueAvoidance ticket
        # set by pending-prefill-scorer: record each decision's uncomputed blocks
        self.track_pending = False
        # llm-d's legacy producer: the tokenizer of tokenizersPoolConfig, run when a
        # request reaches the producer without tokens (set by precise-prefix-cache-scorer).
        self.pool: TokenProducer | None = None

    @classmethod
    def from_params(cls, name: str, params: PrecisePrefixParameters,
                    handle: PluginHandle) -> PrecisePrefixCacheProducer:
        if params.indexer.tokenizers_pool is not None:  # llm-d's producer refuses it too
            raise ConfigError(f"{name}.indexerConfig.tokenizersPoolConfig: "
                              "tokenizersPoolConfig is not supported; configure a "
                              "token-producer plugin instead (only the deprecated "
                              "precise-prefix-cache-scorer still reads it)")
        if params.token_processor.block_size and params.token_processor.block_size_tokens:
            config_warning(f"{name}.tokenProcessorConfig", "blockSize is deprecated; "
                           "blockSizeTokens wins")
        return cls(name, params)

    def bind(self, handle: PluginHandle) -> None:
        """llm-d auto-creates an ``estimate`` token-producer when none is declared. With a
        tokenizers pool (llm-d's legacy producer) none is needed: the producer then
        consumes nothing (llm-d drops the dependency), unless a token-producer is declared,
        which then runs first and the pool only tokenizes what it left untokenized."""
        for producer in handle.of_type(TokenProducer):
            producer.early = True  # long new prompts: leading ids first (prepare_request_data)
        if self.pool is not None:
            if not handle.of_type(TokenProducer):
                self.consumes = MappingProxyType({})
            return
        if not handle.of_type(TokenProducer):
            from epp.kvcache.tokenization import EstimateTokenizer

            config_warning(self.name, "no token-producer declared: using the byte-packing "
                           "estimate, whose token ids match no engine's; declare a "
                           "token-producer with vllm.url (or local.path) for precise routing")
            handle.add(TokenProducer(f"{self.name}-token-producer", EstimateTokenizer()))

    def config_summary(self) -> str:
        ev = self.params.kv_events
        mem = self.params.indexer.kv_block_index.in_memory
        modes = []
        if ev.zmq_endpoint:
            modes.append(f"bind {ev.zmq_endpoint}")
        if ev.discover_pods:
            off = ev.pod_discovery.endpoint_port_offset
            modes.append("per endpoint tcp://<address>:" + (
                f"<port{off:+d}>" if off else str(ev.pod_discovery.socket_port)))
        pool = (f"; tokenizers pool {self.pool.backend.name}" if self.pool is not None
                else "")
        return (f"{self.name}: block size {self.block_size} tokens{pool}, KV events "
                f"{' + '.join(modes) or 'none'} (topic {ev.topic_filter!r}); index at most "
                f"{mem.max_blocks_per_pod} blocks per pod (~"
                f"{BlockIndex.estimate_bytes(mem.max_blocks_per_pod, 1) / 2**20:.0f} MiB per pod)")

    # ------------------------------------------------------------------ subscribers

    def _ensure_started(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        if not self._started:
            self._started = True
            ev = self.params.kv_events
            if ev.zmq_endpoint:
                self.manager.ensure("local-subscriber", ev.zmq_endpoint, bind=True)
            interval = self.params.indexer.kv_block_index.metrics_logging_interval
            if interval > 0:
                self._log_task = asyncio.get_running_loop().create_task(self._log_stats(interval))
        for pod, (pub, replay) in list(self._wanted.items()):
            self.manager.ensure(pod, pub, replay)

    async def _log_stats(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            s = self.index.stats()
            log.info("%s: index %d keys, %d entries over %d pods (~%.1f MiB); %d admissions, "
                     "%d evictions; subscribers %d", self.name, s.keys, s.entries, s.pods,
                     s.approx_bytes / 2**20, s.admissions, s.evictions,
                     len(self.manager.active()))

    async def start_background(self) -> None:
        self._ensure_started()
        log.info(self.config_summary())

    async def stop_background(self) -> None:
        if self._log_task is not None:
            self._log_task.cancel()
            self._log_task = None
        await self.manager.shutdown()
        self._started = False
        if self.pool is not None:
            await self.pool.stop_background()

    def extract_endpoint(self, event: str, endpoint: Endpoint) -> None:
        ev = self.params.kv_events
        if not ev.discover_pods:
            return
        if event == fw.EVENT_DELETE:
            self._wanted.pop(endpoint.key, None)
            self.manager.remove(endpoint.key)
            return
        try:
            self._wanted[endpoint.key] = ev.pod_discovery.addresses(endpoint.address,
                                                                    endpoint.port)
        except ValueError as e:
            log.warning("%s: no KV events from %s: %s", self.name, endpoint.key, e)
            return
        if self._started:
            self._ensure_started()

    def endpoint_removed(self, key: str) -> None:
        self._wanted.pop(key, None)
        self.inflight.pop(key, None)
        if self.queues is not None:
            self.queues.remove(key)
        self.manager.remove(key)

    def prefix_index_size(self) -> int:
        return self.index.size()

    # ------------------------------------------------------------------ per request

    def block_keys(self, request: LLMRequest) -> list[int]:
        tp = tokenized(request)
        if tp is None:
            return []
        cached: tuple[TokenizedPrompt, list[int]] | None = request.plugin_state.get(self.name)
        if cached is not None and cached[0] is tp:
            return cached[1]
        try:
            keys = self.index.request_keys(tp.token_ids, request.target_model, tp.cache_salt)
        except ValueError as e:  # ids a client sent itself (a completions prompt of ids)
            log.warning("%s: request %s: no precise prefix match: %s", self.name,
                        request.request_id, e)
            keys = []
        request.plugin_state[self.name] = (tp, keys)
        return keys

    def compute(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> PrefixMatch:
        keys = self.block_keys(request)
        if not keys:
            return PrefixMatch(0, {}, {}, {}, self.block_size)
        scores, counts, tiers = self.index.longest_prefix(keys, (e.key for e in endpoints),
                                                          self.weights)
        self.lookups += 1
        if scores:
            self.lookup_hits += 1
        # Partial ids (token-producer's prefix store) cover the prompt's leading blocks; the
        # total is the whole prompt's, estimated.
        tp = tokenized(request)
        total = len(keys) if tp is None else max(len(keys), tp.token_count // self.block_size)
        return PrefixMatch(total, {k: int(v) for k, v in scores.items()}, counts, tiers,
                           self.block_size)

    async def prepare_request_data(self, request: LLMRequest,
                                   endpoints: Sequence[Endpoint]) -> None:
        self._ensure_started()
        if self.pool is not None and tokenized(request) is None:
            await self.pool.prepare_request_data(request, endpoints)
        tp = tokenized(request)
        if tp is None:
            return
        info = self.compute(request, endpoints)
        if tp.whole is not None and not self._settled(request, info):
            # some pod holds every leading block: how far it goes needs the rest
            await whole_tokenization(request)
            info = self.compute(request, endpoints)
        request.plugin_state[f"{_STATE}/{self.name}"] = (tuple(e.key for e in endpoints), info)

    def _settled(self, request: LLMRequest, info: PrefixMatch) -> bool:
        """Whether a match on the prompt's leading ids is the whole prompt's: no candidate
        holds all of those blocks, so none can match further (keys chain)."""
        keys = self.block_keys(request)
        return bool(keys) and max(info.cached_blocks.values(), default=0) < len(keys)

    def match_info(self, state: CycleState, request: LLMRequest,
                   endpoints: Sequence[Endpoint]) -> PrefixMatch:
        key = f"{_STATE}/{self.name}"
        cached = state.get(key)
        if cached is not None and cached[0] is endpoints:
            info: PrefixMatch = cached[1]
            return info
        pre = request.plugin_state.get(key)
        want = tuple(e.key for e in endpoints)
        if pre is not None and set(want) <= set(pre[0]):
            info = pre[1]
        else:
            info = self.compute(request, endpoints)
        state[key] = (endpoints, info)
        return info

    def match(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> tuple[int, dict[str, int]]:
        """(total blocks, matched blocks per endpoint key): what prefix-cache-scorer reads."""
        info = self.match_info(state, request, endpoints)
        return info.total_blocks, dict(info.match_blocks)

    def hot(self, endpoints: Sequence[Endpoint]) -> set[str]:
        """Candidates loaded far above the least-loaded one (``balanceAbsThreshold``;
        none by default: llm-d's scorer has no balance guard)."""
        p = self.params
        if p.balance_abs_threshold <= 0 or len(endpoints) < 2:
            return set()
        loads = [max(self.inflight.get(e.key, 0),
                     e.metrics.waiting_queue_size + e.metrics.running_requests)
                 for e in endpoints]
        low = min(loads)
        limit = max(low + p.balance_abs_threshold, low * p.balance_rel_threshold)
        return {e.key for e, load in zip(endpoints, loads, strict=True) if load > limit}

    def excluded(self, request: LLMRequest, endpoints: Sequence[Endpoint],
                 matched: dict[str, int]) -> set[str]:
        """The candidates whose prefix score is 0 for ``request``: the balance guard's hot
        ones — with ``balancePopularOnly``, only while the request's prefix group (the
        block where the longest match ends) calls for more holders than it has, as the
        approximate producer counts it — and, with ``avoidQueueing``, those where it
        would wait for KV room longer than the prefill their cached prefix saves."""
        out = self.hot(endpoints) if self.popularity is None else self._popular_hot(
            request, endpoints, matched)
        if self.queues is None or len(endpoints) < 2:
            return out
        tp = tokenized(request)
        keys = self.block_keys(request)
        if tp is not None and keys:
            out |= self.queues.full(endpoints, matched, keys, tp.token_count,
                                    self.block_size, request.max_tokens)
        return out

    def _popular_hot(self, request: LLMRequest, endpoints: Sequence[Endpoint],
                     matched: dict[str, int]) -> set[str]:
        pop = self.popularity
        assert pop is not None
        # the group is where the longest match ends in blocks, not in medium-weighted
        # blocks (a prompt held on CPU is the same group as on GPU)
        pre = request.plugin_state.get(f"{_STATE}/{self.name}")
        held: Mapping[str, int] = matched if pre is None else pre[1].cached_blocks
        best = max((held.get(k, 0) for k in matched), default=0)
        keys = self.block_keys(request)
        if best <= 0 or max(matched.values(), default=0) <= 0 or len(endpoints) < 2 \
                or not keys:
            return set()
        group = keys[min(best, len(keys)) - 1]
        request.plugin_state[self._group_key] = group
        return self.hot(endpoints) if pop.under_replicated(group, matched,
                                                           len(endpoints)) else set()

    def response_complete(self, request: LLMRequest, endpoint_key: str, aborted: bool) -> None:
        if self.queues is not None:
            ticket = request.plugin_state.pop(self._ticket_key, None)
            if ticket is not None:
                self.queues.done(ticket, endpoint_key, aborted)
        n = self.inflight.get(endpoint_key, 0) - 1
        if n > 0:
            self.inflight[endpoint_key] = n
        else:
            self.inflight.pop(endpoint_key, None)

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        if self.params.balance_abs_threshold > 0 and result.primary.endpoints:
            key = result.primary.endpoints[0].key
            self.inflight[key] = self.inflight.get(key, 0) + 1
        if self.popularity is not None:
            self.popularity.count(request.plugin_state.get(self._group_key))
        q, tp = self.queues, tokenized(request)
        if q is not None and result.primary.endpoints and tp is not None:
            target = result.primary.endpoints[0]
            blocks = self.block_keys(request)
            request.plugin_state[self._ticket_key] = q.routed(target, blocks, q.need(
                target.key, blocks, tp.token_count, self.block_size, request.max_tokens))
        if not (self.params.speculative_indexing or self.track_pending):
            return
        keys = self.block_keys(request)
        chosen = list(dict.fromkeys(e.key for prof in result.profile_results.values()
                                    if prof is not None for e in prof.endpoints[:1]))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            if keys:
                self._speculate(None, chosen, keys)
            return
        # Off the decision's path: the next turn of the loop, after the answer is handed
        # to gRPC (a few hundred blocks cost ~0.1 ms per pod to index).
        if keys:
            loop.call_soon(self._speculate, loop, chosen, keys)
        tp = tokenized(request)
        if tp is not None and tp.whole is not None:  # the rest once it is tokenized
            tp.whole.add_done_callback(
                lambda _f: self._speculate_rest(loop, request, chosen, len(keys)))

    def _speculate_rest(self, loop: asyncio.AbstractEventLoop, request: LLMRequest,
                        pods: list[str], done: int) -> None:
        rest = self.block_keys(request)[done:]
        if rest:
            self._speculate(loop, pods, rest)

    def _speculate(self, loop: asyncio.AbstractEventLoop | None, pods: list[str],
                   keys: list[int]) -> None:
        for pod in pods:
            if self.track_pending:
                self.index.add_pending(pod, keys)
            if self.params.speculative_indexing:
                self.index.add(pod, keys, SPECULATIVE)
        if loop is not None:
            loop.call_later(self.params.speculative_ttl, self._expire, pods, keys)

    def _expire(self, pods: list[str], keys: list[int]) -> None:
        for pod in pods:
            if self.track_pending:
                self.index.remove_pending(pod, keys)
            if self.params.speculative_indexing:
                self.index.remove_keys(pod, keys, SPECULATIVE)

    # ------------------------------------------------------------------ metrics

    def metrics_collector(self) -> Any:
        from epp.kvcache.metrics import KVCacheCollector

        return KVCacheCollector(self)


class PrecisePrefixCacheScorer:
    """llm-d's deprecated composite: a ``precise-prefix-cache-producer`` from its own
    parameters (or the one declared, its own parameters then ignored with a warning)
    scored as ``prefix-cache-scorer`` does (matched / total blocks)."""

    type_name = "precise-prefix-cache-scorer"
    consumes = MappingProxyType({fw.DATA_KEY_PREFIX_CACHE_MATCH_INFO: "PrefixCacheMatchInfo"})
    Parameters = PrecisePrefixParameters

    def __init__(self, name: str, params: PrecisePrefixParameters | None,
                 given: bool = False) -> None:
        self.name = name
        self._params = params
        self._given = given
        self.producer: PrecisePrefixCacheProducer | None = None

    @classmethod
    def from_params(cls, name: str, params: PrecisePrefixParameters,
                    handle: PluginHandle) -> PrecisePrefixCacheScorer:
        config_warning(name, "precise-prefix-cache-scorer is deprecated: declare "
                       "precise-prefix-cache-producer and prefix-cache-scorer with "
                       "prefixMatchInfoProducerName")
        return cls(name, params, params != PrecisePrefixParameters())

    def bind(self, handle: PluginHandle) -> None:
        found = handle.of_type(PrecisePrefixCacheProducer)
        if len(found) > 1:
            raise ConfigError(f"{self.name}: several precise-prefix-cache-producer plugins; "
                              "precise-prefix-cache-scorer cannot choose — configure "
                              "prefix-cache-scorer with prefixMatchInfoProducerName")
        if found:
            if self._given:
                config_warning(self.name, f"parameters ignored: {found[0].name!r} "
                               "(precise-prefix-cache-producer) is declared")
            self.producer = found[0]
            return
        self.producer = PrecisePrefixCacheProducer(f"{self.name}-producer", self._params)
        pool = self._params.indexer.tokenizers_pool if self._params is not None else None
        if pool is not None:
            self.producer.pool = tokenizers_pool(self.name, pool)
        handle.add(self.producer)
        self.producer.bind(handle)

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        assert self.producer is not None, "bind() not called"
        total, matched = self.producer.match(state, request, endpoints)
        if not total:
            return [0.0] * len(endpoints)
        return [matched.get(e.key, 0) / total for e in endpoints]



@dataclass(frozen=True)
class PendingPrefillParameters:
    producer_name: str | None = param("prefixMatchInfoProducerName", None)

    def __post_init__(self) -> None:
        if self.producer_name is not None and not self.producer_name:
            raise ParameterError("prefixMatchInfoProducerName", "must not be empty")


class PendingPrefillScorer:
    """``pending-prefill-scorer`` (this project's): fewer blocks still to be computed on a
    candidate scores higher.

    The ``precise-prefix-cache-producer`` it reads records, after each decision, the
    prompt blocks the chosen pod did not hold; the pod's KV events take them off as its
    engine stores them (``BlockStored``), and ``speculativeTTL`` drops any left. So each
    pod's count is the prefill work queued or in progress there, learnt from the engine
    itself rather than from a scrape or an estimate. A cold request (no candidate holds
    any of its blocks) scores ``(max − p) / max`` over the candidates (1 for all when none
    has any): it goes to a pod that is not prefilling, where a request count cannot tell
    a prefill from a decode. A warm request scores 1 everywhere: where part of the prompt
    is cached, affinity and the other load signals decide (scoring those too pulled
    conversations off their pods)."""

    type_name = "pending-prefill-scorer"
    Parameters = PendingPrefillParameters

    def __init__(self, name: str, producer_name: str | None = None) -> None:
        self.name = name
        self.producer_name = producer_name
        self.producer: PrecisePrefixCacheProducer | None = None

    @classmethod
    def from_params(cls, name: str, params: PendingPrefillParameters,
                    handle: PluginHandle) -> PendingPrefillScorer:
        return cls(name, params.producer_name)

    def bind(self, handle: PluginHandle) -> None:
        if self.producer_name is not None:
            found = handle.get(self.producer_name)
            if not isinstance(found, PrecisePrefixCacheProducer):
                what = "no such plugin" if found is None else f"a {found.type_name}"
                raise ConfigError(f"{self.name}: prefixMatchInfoProducerName "
                                  f"{self.producer_name!r}: {what}, not a "
                                  "precise-prefix-cache-producer")
            self.producer = found
        else:
            producers = handle.of_type(PrecisePrefixCacheProducer)
            if len(producers) != 1:
                raise ConfigError(f"{self.name}: needs exactly one "
                                  "precise-prefix-cache-producer (found "
                                  f"{len(producers)}); name it with "
                                  "prefixMatchInfoProducerName")
            self.producer = producers[0]
        self.producer.track_pending = True

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        assert self.producer is not None, "bind() not called"
        n = len(endpoints)
        _, matched = self.producer.match(state, request, endpoints)
        if any(v > 0 for v in matched.values()):
            return [1.0] * n  # a candidate holds part of the prompt: affinity decides
        pending = self.producer.index.pending_blocks
        counts = [pending(e.key) for e in endpoints]
        hi = max(counts, default=0)
        if hi <= 0:
            return [1.0] * n
        return [(hi - c) / hi for c in counts]



# ----------------------------------------------------------------------- tokenizers pool


def tokenizers_pool(name: str, pool: TokenizersPoolParameters) -> TokenProducer:
    """The tokenizer of llm-d's deprecated ``tokenizersPoolConfig``, as a private
    :class:`TokenProducer`.

    llm-d-router v0.10.0 (``legacy_producer.go``, llm-d-kv-cache's UDS pool) asks its UDS
    tokenizer sidecar for the tokenizer of ``modelName`` — or of
    ``uds.modelTokenizerMap[modelName]``, a local directory or ``tokenizer.json`` — and
    fails at startup when it cannot get it. This EPP has no client for that sidecar: it
    loads the tokenizer in process when that name is a local tokenizer, and otherwise fails
    at startup (it does not download from the Hugging Face hub), naming the fixes."""
    where = f"{name}.indexerConfig.tokenizersPoolConfig"
    model = pool.model_name
    if not model:
        raise ConfigError(f"{where}.modelName: required: the model whose tokenizer the "
                          "scorer runs (llm-d: 'config and config.ModelName cannot be nil or "
                          "empty')")
    uds = pool.uds
    target = model
    if uds is not None and uds.model_tokenizer_map is not None:
        if model not in uds.model_tokenizer_map:
            raise ConfigError(f"{where}.uds.modelTokenizerMap: no entry for modelName "
                              f"{model!r} (llm-d: 'tokenizer for model {model!r} not "
                              "found'); add one")
        target = uds.model_tokenizer_map[model]
    path = pathlib.Path(target)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        sidecar = (f" at {uds.socket_file}" if uds is not None and uds.socket_file else "")
        raise ConfigError(
            f"{where}: cannot obtain the tokenizer of {model!r}: {target!r} is not a local "
            "tokenizer (a directory holding tokenizer.json, or the file). llm-d-router "
            f"v0.10.0 gets it from its UDS tokenizer sidecar{sidecar}, which downloads hub "
            "models, and fails at startup when it cannot (without 'uds': 'UDS tokenizer "
            "config must be enabled'); this EPP has no client for that sidecar and does not "
            "download. Fix: declare a token-producer (vllm: {url: http://<model server>:8000}"
            ", or local: {path: <tokenizer dir>}) and remove tokenizersPoolConfig, or point "
            "uds.modelTokenizerMap {<model>: <dir>} (or modelName) at a local copy of the "
            "tokenizer")
    try:
        backend = LocalTokenizer(str(path))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises bare Exception
        raise ConfigError(f"{where}: cannot load the tokenizer of {model!r} from "
                          f"{str(file)!r}: {e}") from None
    if uds is not None and uds.socket_file:
        config_warning(where, f"uds.socketFile {uds.socket_file!r} is not used: the "
                       f"tokenizer {str(file)!r} runs in process (this EPP has no client for "
                       "llm-d's UDS tokenizer sidecar)")
    return TokenProducer(f"{name}-tokenizers-pool", backend)
