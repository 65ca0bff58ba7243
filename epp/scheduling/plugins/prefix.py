"""Prefix-cache affinity: ``approx-prefix-cache-producer`` and ``prefix-cache-scorer``.

The producer owns the :class:`PrefixIndex`. For each request it hashes the prompt once
(cached on the request) and matches it against the candidates; the scorer turns the match
into matched / total blocks. After the Director's decision the producer records the
blocks for the endpoint the request actually goes to (the primary; fallbacks not taken
are not recorded), and it forgets endpoints that leave the pool.

Balance guard (against the hot-spot failure mode: one shared system prompt pulling all
traffic onto the pod that cached it first). The producer counts the requests this EPP has
in flight per endpoint (+1 when routed, −1 when the response ends or aborts). An endpoint
is *hot* when its load — the larger of that count and its scraped waiting + running
requests — exceeds the least-loaded candidate's by more than ``balanceAbsThreshold`` and
is above ``balanceRelThreshold`` × that minimum; a hot endpoint's prefix score is 0, so
the load scorers decide. ``balanceAbsThreshold: 0`` turns the guard off. (The same idea
as sglang-router's cache-aware balance thresholds, applied per endpoint.)
``balancePopularOnly`` (off by default) narrows the guard to the prefixes that need it:
it applies only while the request's prefix group is popular enough to call for more
holders than it has (its share of the recent requests × the candidates, rounded up, as
``replicateHotPrefixes`` counts it below). A prefix one pod can serve — one of many
groups, a conversation — stays on its pod through the load's ups and downs, where the
guard would send the request to a pod that must prefill it again and evict another
group for it; one prompt that most traffic shares is still spread.

Hot-prefix replication (``replicateHotPrefixes``, off by default). The producer keeps
each prefix group's share of its recent requests (:class:`PrefixPopularity`); a group
with share *s* calls for ⌈*s* × candidates⌉ holders, and while fewer candidates hold its
longest cached prefix those holders' prefix score is 0, so the load scorers may send the
request to a pod that does not hold it yet. A prompt most traffic shares ends up on every
pod instead of the few that cached it first; conversations and rare groups keep theirs.

Avoiding queues (``avoidQueueing``, off by default). A pod whose KV cache has no room
for a request makes it wait until a running request finishes (or preempts one); sending
it there to reuse a prefix trades a short prefill for a wait as long as a response. Per
candidate, the request needs room for its ``max_tokens`` and its prompt less the blocks
it shares with a request this EPP has in flight there; the pod's room is its free KV cache
at its last scrape (``num_blocks × (1 − kv usage) × block size`` tokens, from
``cache_config_info``) less what this EPP routed there since. Without room, its predicted
wait is (requests waiting + routed since the scrape + 1) × its mean time per request
(routing to response end, measured by this EPP) ÷ (the requests it runs + 1). A
candidate whose wait plus prefill (``prefillMsPerToken`` × the prompt tokens its cache
lacks, by the index) exceeds another candidate's scores 0 for prefix, so the load scorers
place the request. Pods without ``cache_config_info``, or before their first response
ends, never wait.

A config may declare the producer explicitly (its parameters tune the index) or only the
scorer: the scorer then creates its own producer from the same parameters (GIE's loader
hands the scorer's parameters to the producer it creates; ``hashBlockSize`` is an older
name for the block size in characters). With a producer declared, parameters on the
scorer are ignored with a warning, as GIE ignores them. ``maxPrefixTokensToMatch`` (> 0)
caps the match in tokens instead of blocks (blocks = tokens / ``blockSizeTokens``).
``blockSize`` is GIE's deprecated character block size: ignored (with a warning) while
``blockSizeTokens`` is > 0 — GIE rejects it only beside ``blockSizeTokens: 0``, which
this EPP rejects anyway.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from epp import keys
from epp.errors import ConfigError
from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.params import config_warning, param
from epp.scheduling.prefix.indexer import PrefixIndex, prompt_block_hashes
from epp.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult

CHARS_PER_TOKEN = 4
_STATE_KEY = "prefix-cache"
DURATION_ALPHA = 0.1  # EMA weight of a response's duration (avoidQueueing)


class PrefixPopularity:
    """Each prefix group's share of the recent requests (``replicateHotPrefixes``),
    weighted exponentially over the last ~``window`` requests counted (by request, not by
    time: the same sequence of requests always gives the same shares). A request's group
    is the block where its longest cached prefix ends (requests sharing a system prompt
    but not their questions share it); requests with no cached prefix count toward the
    total only."""

    WINDOW = 256
    MAX_GROUPS = 4096

    def __init__(self, window: int = WINDOW) -> None:
        self.keep = 1.0 - 1.0 / window
        self.counted = 0
        self._groups: dict[int, tuple[float, int]] = {}  # group -> (weight, at count)

    def _weight(self, entry: tuple[float, int]) -> float:
        weight, at = entry
        return weight * self.keep ** (self.counted - at)

    def count(self, group: int | None) -> None:
        self.counted += 1
        if group is None:
            return
        g = self._groups
        old = g.get(group)
        g[group] = ((self._weight(old) if old else 0.0) + 1.0, self.counted)
        if len(g) > self.MAX_GROUPS:  # forget the groups that went quiet
            for k in [k for k, e in g.items() if self._weight(e) < 0.5]:
                del g[k]
            while len(g) > self.MAX_GROUPS:
                del g[next(iter(g))]

    def replicas(self, group: int, endpoints: int) -> int:
        """Holders the group calls for: its share of the recent requests × the
        candidates, rounded up (1 for a group seen seldom)."""
        entry = self._groups.get(group)
        if entry is None or not self.counted:
            return 1
        total = (1.0 - self.keep ** self.counted) / (1.0 - self.keep)
        share = min(1.0, self._weight(entry) / total)
        return max(1, math.ceil(share * endpoints - 1e-9))

    def under_replicated(self, group: int, matched: dict[str, int], endpoints: int
                         ) -> set[str]:
        """The candidates holding the longest match (``matched``: blocks per endpoint
        key, the group's last block being where that match ends) when the group calls
        for more holders than that; empty otherwise."""
        best = max(matched.values())
        holders = {k for k, m in matched.items() if m == best}
        return holders if len(holders) < self.replicas(group, endpoints) else set()


class QueueAvoidance:
    """``avoidQueueing`` (see module doc) for a prefix producer, in its own block keys:
    what this EPP routed to each endpoint since its last scrape, the blocks of each
    request it has in flight there, and each endpoint's mean time per request. Both the
    approximate and the precise producer keep one."""

    def __init__(self, prefill_ms_per_token: float) -> None:
        self.prefill_ms_per_token = prefill_ms_per_token
        # per endpoint: what this EPP routed there since its last scrape (that scrape's
        # updated_at, the KV tokens those requests need, their number)
        self.pending: dict[str, tuple[float | None, float, int]] = {}
        self.duration: dict[str, float] = {}  # ms, mean from routing to response end
        # per endpoint: the block keys of each request this EPP has in flight there
        self.flight: dict[str, dict[int, Sequence[int]]] = {}
        self._ticket = 0
        self.clock = time.monotonic

    def full(self, endpoints: Sequence[Endpoint], matched: dict[str, int],
             blocks: Sequence[int], prompt_tokens: float, tokens_per_block: float,
             max_tokens: int | None) -> set[str]:
        """The candidates where a request (its prompt's ``blocks``, ``prompt_tokens`` in
        all; ``matched``: blocks cached per endpoint key) would wait for room in the KV
        cache for longer than the prefill their cached prefix saves over another
        candidate."""
        ms = self.prefill_ms_per_token
        most = prompt_tokens + (max_tokens or 0)  # the need with nothing shared
        costs: list[float] = []
        waiting: set[str] = set()
        for e in endpoints:
            key = e.key
            uncached = max(0.0, prompt_tokens - matched.get(key, 0) * tokens_per_block)
            # room for the most it could need: no wait, and no need to compare in-flight
            # requests' blocks with its own
            wait = (0.0 if self.free(e) >= most else self.wait(
                e, self.need(key, blocks, prompt_tokens, tokens_per_block, max_tokens)))
            if wait > 0.0:
                waiting.add(key)
            costs.append(wait + uncached * ms)
        if not waiting:
            return set()
        best = min(costs)
        return {e.key for e, c in zip(endpoints, costs) if c > best and e.key in waiting}

    def need(self, key: str, blocks: Sequence[int], prompt_tokens: float,
             tokens_per_block: float, max_tokens: int | None) -> float:
        """KV tokens a request would take on endpoint ``key``: its output and its prompt
        less the blocks a request in flight there (routed by this EPP) already holds —
        blocks cached but not in use are free room the request takes like any other."""
        shared = 0
        for other in self.flight.get(key, {}).values():
            n = min(len(other), len(blocks))
            if n <= shared or other[shared] != blocks[shared]:
                continue
            # chained keys: equal at k means equal up to k — the longest shared run
            lo, hi = shared + 1, n
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if other[mid - 1] == blocks[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            shared = lo
        return max(0.0, prompt_tokens - shared * tokens_per_block) + (max_tokens or 0)

    def free(self, e: Endpoint) -> float:
        """Free KV tokens on ``e``: at its last scrape, less what this EPP routed there
        since (infinite without ``cache_config_info``)."""
        m = e.metrics
        if not m.num_blocks:
            return math.inf
        pending = self.pending.get(e.key)
        routed = pending[1] if pending and pending[0] == m.updated_at else 0.0
        return m.num_blocks * (1.0 - m.kv_cache_usage) * (m.block_size or 16) - routed

    def wait(self, e: Endpoint, need: float) -> float:
        """Predicted ms until ``e`` has room in its KV cache for ``need`` more tokens: 0
        while its free KV cache (at its last scrape, less what this EPP routed there
        since) holds them; else (requests ahead + 1) × its mean time per request ÷ (the
        requests it runs + 1)."""
        m = e.metrics
        duration = self.duration.get(e.key)
        if not m.num_blocks or duration is None:
            return 0.0
        pending = self.pending.get(e.key)
        count = pending[2] if pending and pending[0] == m.updated_at else 0
        if self.free(e) >= need or m.running_requests + m.waiting_queue_size + count == 0:
            return 0.0
        # the running requests are at random points of their ~duration: the first ends
        # after duration / (running + 1) on average, the k-th after k times that
        return (m.waiting_queue_size + count + 1) * duration / (m.running_requests + 1)

    def routed(self, e: Endpoint, blocks: Sequence[int], need: float
               ) -> tuple[str, float, int]:
        """Record a request routed to ``e`` (needing ``need`` KV tokens there); the
        returned ticket goes to :meth:`done` when its response ends."""
        key, at = e.key, e.metrics.updated_at
        self._ticket += 1
        self.flight.setdefault(key, {})[self._ticket] = blocks
        old = self.pending.get(key)
        if old is not None and old[0] == at:
            self.pending[key] = (at, old[1] + need, old[2] + 1)
        else:
            self.pending[key] = (at, need, 1)
        return key, self.clock(), self._ticket

    def done(self, ticket: tuple[str, float, int], endpoint_key: str, aborted: bool) -> None:
        """A response ended: its blocks are no longer in use, and (unless it was
        aborted) its duration updates the endpoint's mean."""
        key, started, n = ticket
        flight = self.flight.get(key)
        if flight is not None:
            flight.pop(n, None)
            if not flight:
                del self.flight[key]
        if key == endpoint_key and not aborted:
            ms = 1000.0 * (self.clock() - started)
            old = self.duration.get(key)
            self.duration[key] = ms if old is None else old + DURATION_ALPHA * (ms - old)

    def remove(self, key: str) -> None:
        self.pending.pop(key, None)
        self.duration.pop(key, None)
        self.flight.pop(key, None)


@dataclass(frozen=True)
class PrefixIndexParameters:
    """The producer's parameters (also accepted by ``prefix-cache-scorer``)."""

    hash_block_size: int | None = param("hashBlockSize", None, minimum=1)
    block_size_tokens: int = param("blockSizeTokens", 16, minimum=1)
    max_prefix_blocks_to_match: int = param("maxPrefixBlocksToMatch", 256, minimum=1)
    max_prefix_tokens_to_match: int = param("maxPrefixTokensToMatch", 0, minimum=0)
    lru_capacity_per_server: int = param("lruCapacityPerServer", 31_250, minimum=1)
    auto_tune: bool = param("autoTune", True)
    balance_abs_threshold: int = param("balanceAbsThreshold", 4, minimum=0)
    balance_rel_threshold: float = param("balanceRelThreshold", 1.5, minimum=1.0)
    balance_popular_only: bool = param("balancePopularOnly", False)
    replicate_hot_prefixes: bool = param("replicateHotPrefixes", False)
    avoid_queueing: bool = param("avoidQueueing", False)
    prefill_ms_per_token: float = param("prefillMsPerToken", 0.05, minimum=0.0)
    block_size: int | None = param("blockSize", None)  # GIE's deprecated character size

    @property
    def max_blocks(self) -> int:
        """Blocks to match: ``maxPrefixTokensToMatch / blockSizeTokens`` when set (GIE)."""
        if self.max_prefix_tokens_to_match > 0:
            return self.max_prefix_tokens_to_match // self.block_size_tokens
        return self.max_prefix_blocks_to_match


@dataclass(frozen=True)
class PrefixScorerParameters:
    """The same keys, unset by default: a scorer given any of them builds its own
    producer from them (GIE's ``prefix-cache-scorer`` takes them directly)."""

    hash_block_size: int | None = param("hashBlockSize", None, minimum=1)
    block_size_tokens: int | None = param("blockSizeTokens", None, minimum=1)
    max_prefix_blocks_to_match: int | None = param("maxPrefixBlocksToMatch", None, minimum=1)
    max_prefix_tokens_to_match: int | None = param("maxPrefixTokensToMatch", None, minimum=0)
    lru_capacity_per_server: int | None = param("lruCapacityPerServer", None, minimum=1)
    auto_tune: bool | None = param("autoTune", None)
    balance_abs_threshold: int | None = param("balanceAbsThreshold", None, minimum=0)
    balance_rel_threshold: float | None = param("balanceRelThreshold", None, minimum=1.0)
    balance_popular_only: bool | None = param("balancePopularOnly", None)
    replicate_hot_prefixes: bool | None = param("replicateHotPrefixes", None)
    avoid_queueing: bool | None = param("avoidQueueing", None)
    prefill_ms_per_token: float | None = param("prefillMsPerToken", None, minimum=0.0)
    block_size: int | None = param("blockSize", None)
    # llm-d: the plugin whose PrefixCacheMatchInfo to read (e.g. a
    # precise-prefix-cache-producer); unset: the approx producer, as before.
    prefix_match_info_producer_name: str | None = param("prefixMatchInfoProducerName", None)

    def index_parameters(self) -> PrefixIndexParameters | None:
        """The producer's parameters with these set, or None when none is set."""
        given = {k: v for k, v in vars(self).items()
                 if v is not None and k != "prefix_match_info_producer_name"}
        return PrefixIndexParameters(**given) if given else None


def _producer_kwargs(p: PrefixIndexParameters) -> dict[str, Any]:
    return {"block_size_tokens": p.block_size_tokens,
            "max_blocks": p.max_blocks,
            "lru_capacity_per_server": p.lru_capacity_per_server,
            "auto_tune": p.auto_tune, "block_chars": p.hash_block_size,
            "balance_abs_threshold": p.balance_abs_threshold,
            "balance_rel_threshold": p.balance_rel_threshold,
            "balance_popular_only": p.balance_popular_only,
            "replicate_hot_prefixes": p.replicate_hot_prefixes,
            "avoid_queueing": p.avoid_queueing,
            "prefill_ms_per_token": p.prefill_ms_per_token}


def _warn_block_size(block_size: int | None, name: str) -> None:
    if block_size is not None:
        config_warning(name, f"blockSize ({block_size}) is deprecated and ignored; the block "
                       "size is blockSizeTokens (in tokens)")


class ApproxPrefixCacheProducer:
    type_name = "approx-prefix-cache-producer"
    produces = MappingProxyType({fw.DATA_KEY_PREFIX_CACHE_MATCH_INFO: "PrefixCacheMatchInfo"})
    Parameters = PrefixIndexParameters

    def __init__(self, name: str, block_size_tokens: int = 16, max_blocks: int = 256,
                 lru_capacity_per_server: int = 31_250, auto_tune: bool = True,
                 block_chars: int | None = None, balance_abs_threshold: int = 4,
                 balance_rel_threshold: float = 1.5, balance_popular_only: bool = False,
                 replicate_hot_prefixes: bool = False, avoid_queueing: bool = False,
                 prefill_ms_per_token: float = 0.05) -> None:
        self.name = name
        self.block_size_tokens = block_size_tokens
        self.block_chars = block_chars or block_size_tokens * CHARS_PER_TOKEN
        self.max_blocks = max_blocks
        self.auto_tune = auto_tune
        self.index = PrefixIndex(lru_capacity_per_server)
        self._tuned: dict[str, tuple[int, int]] = {}
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.inflight: dict[str, int] = {}
        self.replicate_hot_prefixes = replicate_hot_prefixes
        self.balance_popular_only = balance_popular_only
        self.popularity = (PrefixPopularity() if replicate_hot_prefixes or balance_popular_only
                           else None)
        self.queues = QueueAvoidance(prefill_ms_per_token) if avoid_queueing else None
        self._started = f"{name}/started"  # plugin_state: the QueueAvoidance ticket
        self._group_key = f"{name}/group"  # plugin_state: the request's prefix group

    @classmethod
    def from_params(cls, name: str, params: PrefixIndexParameters,
                    handle: PluginHandle) -> ApproxPrefixCacheProducer:
        _warn_block_size(params.block_size, name)
        return cls(name, **_producer_kwargs(params))

    def prefix_index_size(self) -> int:
        return self.index.size()

    # --- per request ---

    def hashes(self, request: LLMRequest) -> list[int]:
        """The request's block hashes, computed once per request."""
        cached: list[int] | None = request.plugin_state.get(self.name)
        if cached is None:
            cached = prompt_block_hashes(request.prompt, request.target_model,
                                         request.cache_salt, self.block_chars, self.max_blocks)
            request.plugin_state[self.name] = cached
        return cached

    def _tune(self, endpoints: Sequence[Endpoint]) -> None:
        """autoTune: capacity from the pod's cache_config_info (blocks × block size)."""
        for e in endpoints:
            m = e.metrics
            if m.num_blocks and m.block_size:
                sig = (m.num_blocks, m.block_size)
                if self._tuned.get(e.key) != sig:
                    self._tuned[e.key] = sig
                    self.index.set_capacity(
                        e.key, m.num_blocks * m.block_size // self.block_size_tokens)

    def match(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> tuple[int, dict[str, int]]:
        """(total blocks, matched blocks per endpoint key), cached in the cycle state."""
        key = f"{_STATE_KEY}/{self.name}"
        cached = state.get(key)
        if cached is not None and cached[0] is endpoints:
            return cached[1], cached[2]
        if self.auto_tune:
            self._tune(endpoints)
        hashes = self.hashes(request)
        matched = self.index.match(hashes, (e.key for e in endpoints)) if hashes else {}
        state[key] = (endpoints, len(hashes), matched)
        return len(hashes), matched

    def hot(self, endpoints: Sequence[Endpoint]) -> set[str]:
        """Keys of candidates loaded far above the least-loaded one (see module doc)."""
        if self.balance_abs_threshold <= 0 or len(endpoints) < 2:
            return set()
        inflight = self.inflight
        loads = [max(inflight.get(e.key, 0),
                     e.metrics.waiting_queue_size + e.metrics.running_requests)
                 for e in endpoints]
        low = min(loads)
        limit = max(low + self.balance_abs_threshold, low * self.balance_rel_threshold)
        return {e.key for e, load in zip(endpoints, loads) if load > limit}

    def full(self, request: LLMRequest, endpoints: Sequence[Endpoint],
             matched: dict[str, int]) -> set[str]:
        """``avoidQueueing`` (see module doc): the candidates where this request would
        wait for room in the KV cache for longer than the prefill their cached prefix
        saves over another candidate."""
        if self.queues is None:
            return set()
        return self.queues.full(endpoints, matched, self.hashes(request),
                                len(request.prompt) / CHARS_PER_TOKEN,
                                self.block_chars / CHARS_PER_TOKEN, request.max_tokens)

    def excluded(self, request: LLMRequest, endpoints: Sequence[Endpoint],
                 matched: dict[str, int]) -> set[str]:
        """The candidates whose prefix score is 0 for ``request``: the balance guard's hot
        ones (with ``balancePopularOnly``, only while the request's prefix is popular
        enough to call for more holders than it has), ``avoidQueueing``'s and
        ``replicateHotPrefixes``'. The popularity, when kept, counts every request."""
        holders = (self.under_replicated(request, endpoints, matched)
                   if self.popularity is not None else set())
        hot = (set() if self.balance_popular_only and not holders
               else self.hot(endpoints))
        if self.queues is not None:
            hot |= self.full(request, endpoints, matched)
        if self.replicate_hot_prefixes:
            hot |= holders
        return hot

    def under_replicated(self, request: LLMRequest, endpoints: Sequence[Endpoint],
                         matched: dict[str, int]) -> set[str]:
        """The candidates holding the request's longest cached prefix when that prefix is
        *hot* — its recent share of this EPP's requests calls for more holders than it
        has (see module doc); empty otherwise. ``replicateHotPrefixes`` zeroes their
        prefix score, so the load scorers may place the request on a pod that does not
        hold it yet; ``balancePopularOnly`` lets the balance guard act only then."""
        pop = self.popularity
        if pop is None or len(endpoints) < 2 or not matched:
            return set()
        best = max(matched.values())
        if best <= 0:
            return set()
        group = self.hashes(request)[best - 1]
        request.plugin_state[self._group_key] = group
        return pop.under_replicated(group, matched, len(endpoints))

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        key = result.primary.endpoints[0].key
        self.inflight[key] = self.inflight.get(key, 0) + 1
        if self.popularity is not None:
            self.popularity.count(request.plugin_state.get(self._group_key))
        hashes = self.hashes(request)
        matched = 0
        if hashes:
            # For the exported hit ratio: how much of the prompt the chosen endpoint held.
            matched = self.index.match(hashes, (key,)).get(key, 0)
            request.plugin_state[keys.PLUGIN_STATE_PREFIX_HIT_RATIO] = matched / len(hashes)
            request.plugin_state[keys.PLUGIN_STATE_PREFIX_HIT_BYTES] = matched * self.block_chars
            self.index.add(key, hashes)
        q = self.queues
        if q is not None:
            need = q.need(key, hashes, len(request.prompt) / CHARS_PER_TOKEN,
                          self.block_chars / CHARS_PER_TOKEN, request.max_tokens)
            request.plugin_state[self._started] = q.routed(
                result.primary.endpoints[0], hashes, need)

    def response_complete(self, request: LLMRequest, endpoint_key: str, aborted: bool) -> None:
        ticket = request.plugin_state.pop(self._started, None)
        if ticket is not None and self.queues is not None:
            self.queues.done(ticket, endpoint_key, aborted)
        n = self.inflight.get(endpoint_key, 0) - 1
        if n > 0:
            self.inflight[endpoint_key] = n
        else:
            self.inflight.pop(endpoint_key, None)

    def endpoint_removed(self, key: str) -> None:
        self.index.remove_endpoint(key)
        self._tuned.pop(key, None)
        self.inflight.pop(key, None)
        if self.queues is not None:
            self.queues.remove(key)


class PrefixCacheScorer:
    """matched / total prompt blocks per endpoint (0 for prompts shorter than a block)."""

    type_name = "prefix-cache-scorer"
    consumes = MappingProxyType({fw.DATA_KEY_PREFIX_CACHE_MATCH_INFO: "PrefixCacheMatchInfo"})
    Parameters = PrefixScorerParameters

    def __init__(self, name: str, own_params: PrefixIndexParameters | None = None,
                 producer_name: str | None = None) -> None:
        self.name = name
        self._own_params = own_params
        self._producer_name = producer_name
        self.producer: ApproxPrefixCacheProducer | Any = None

    @classmethod
    def from_params(cls, name: str, params: PrefixScorerParameters,
                    handle: PluginHandle) -> PrefixCacheScorer:
        _warn_block_size(params.block_size, name)
        return cls(name, params.index_parameters(), params.prefix_match_info_producer_name)

    def bind(self, handle: PluginHandle) -> None:
        """After every plugin is built: find the producer, or create one."""
        if self._producer_name:  # llm-d's prefixMatchInfoProducerName
            named = handle.get(self._producer_name)
            if named is None or not callable(getattr(named, "match", None)):
                what = "no such plugin" if named is None else f"a {named.type_name}"
                raise ConfigError(f"{self.name}.prefixMatchInfoProducerName: "
                                  f"{self._producer_name!r} is {what}, not a prefix match "
                                  "producer (precise-prefix-cache-producer, "
                                  "approx-prefix-cache-producer)")
            self.producer = named
            return
        producers = handle.of_type(ApproxPrefixCacheProducer)
        if len(producers) > 1:
            raise ConfigError(f"{self.name}: more than one approx-prefix-cache-producer; "
                              "keep one")
        if producers:
            if self._own_params is not None:
                config_warning(self.name, "parameters on prefix-cache-scorer are ignored: "
                               f"{producers[0].name!r} (approx-prefix-cache-producer) is "
                               "declared; set them there")
            self.producer = producers[0]
            return
        self.producer = ApproxPrefixCacheProducer(
            f"{self.name}-producer", **_producer_kwargs(self._own_params or PrefixIndexParameters()))
        handle.add(self.producer)

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        assert self.producer is not None, "bind() not called"
        total, matched = self.producer.match(state, request, endpoints)
        if not total:
            return [0.0] * len(endpoints)
        # both built-in producers have excluded(); a Python plugin's may offer hot() only
        excluded = getattr(self.producer, "excluded", None)
        if excluded is not None:
            hot = excluded(request, endpoints, matched)
        else:
            only_hot = getattr(self.producer, "hot", None)
            hot = only_hot(endpoints) if only_hot is not None else set()
        return [0.0 if e.key in hot else matched.get(e.key, 0) / total for e in endpoints]
