"""llm-d-router's request data producers: ``session-id-producer``,
``burst-prefix-cache-producer`` and ``p2p-source-producer``.

All three follow llm-d-router v0.10.0 ``pkg/epp/framework/plugins/requestcontrol/
dataproducer/`` (``sessionid``, ``burstprefix``, ``p2psource``, each with its README and
tests) and run as PrepareData plugins (llm-d's DataProducers), before scheduling.

``session-id-producer``: the session id of a request — the request header ``headerName``
(lower-cased, trimmed), or the cookie ``cookieName`` of the ``cookie`` header (RFC 6265
``name=value`` pairs split on ``;``) — trimmed, in ``request.plugin_state
["SessionIDDataKey/<plugin name>"]`` (llm-d's data key string: ``SessionIDDataKey/
session-id-producer`` under the default name). Exactly one of the two parameters is
required. Absent or blank: nothing is stored (no session preference). The session
affinity plugins read it as llm-d's do, through an attribute source:
``sessionIdConfig.sources: [{attribute: SessionIDDataKey/session-id-producer}]``.

``burst-prefix-cache-producer``: requests arriving within ``windowDurationMs`` are placed
together so the ones sharing a prompt prefix land on the same replica(s) (see
:func:`assign`, a port of llm-d's ``assign.go``), and each gets a full prefix match on its
replica and none elsewhere, which ``prefix-cache-scorer`` (``prefixMatchInfoProducerName``
naming this plugin) turns into 1 / 0. The prompt's blocks are the token-producer's tokens
in ``blockSizeTokens`` blocks (the last one partial), chained hashes seeded with the model
and the cache salt, at most ``maxPrefixTokensToMatch / blockSizeTokens`` blocks (2048 when
0). Every request waits for its window to close (the producer's PrepareData budget is
the window + 300 ms, llm-d's ``ProduceTimeout``); a window already holding
``maxBatchSize`` requests refuses more (logged; those get no affinity).

``p2p-source-producer``: picks, among the candidates whose cached prompt prefix (per the
prefix producer ``prefixMatchInfoProducerName``; only CPU-tier blocks count when the
producer reports tiers) is within one block of the best, one sampled with weight
1 / (1 + waiting queue) at the request id's FNV-1a fraction, and after scheduling sets
``x-kv-cache-source-host-port`` to it when it caches at least ``minCachedTokenDelta``
tokens more than the pod computing the prefix (the ``prefillProfileName`` profile's
endpoint when it ran, else the primary's), so the sidecar pulls those blocks over P2P.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from epp import keys
from epp.errors import ConfigError
from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, param
from epp.scheduling.plugins.token_producer import (
    TOKENIZED_PROMPT,
    tokenized,
    whole_tokenization,
)
from epp.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ session-id-producer

SESSION_ID_PRODUCER: Final = "session-id-producer"
SESSION_ID_DATA_TYPE: Final = "SessionIDDataKey"


def session_id_key(producer_name: str = "") -> str:
    """llm-d's ``SessionIDDataKey.WithNonEmptyProducerName(name).String()``."""
    return f"{SESSION_ID_DATA_TYPE}/{producer_name or SESSION_ID_PRODUCER}"


def cookie_value(header: str, name: str) -> str:
    """The value of cookie ``name`` in a ``Cookie`` header ("" when absent)."""
    if not header or not name:
        return ""
    for pair in header.split(";"):
        k, sep, v = pair.strip().partition("=")
        if sep and k == name:
            return v
    return ""


@dataclass(frozen=True)
class SessionIdProducerParameters:
    header_name: str = param("headerName", "")
    cookie_name: str = param("cookieName", "")


class SessionIdProducer:
    type_name = SESSION_ID_PRODUCER
    Parameters = SessionIdProducerParameters

    def __init__(self, name: str, header_name: str = "", cookie_name: str = "") -> None:
        header = header_name.strip().lower()
        cookie = cookie_name.strip()
        if not header and not cookie:
            raise ConfigError(f"{name}: '{SESSION_ID_PRODUCER}' requires exactly one of "
                              "headerName or cookieName to be set")
        if header and cookie:
            raise ConfigError(f"{name}: '{SESSION_ID_PRODUCER}' requires exactly one of "
                              "headerName or cookieName to be set, not both")
        self.name = name
        self.header_name = header
        self.cookie_name = cookie
        self.key = session_id_key(name)
        self.produces = MappingProxyType({self.key: "SessionID"})

    @classmethod
    def from_params(cls, name: str, params: SessionIdProducerParameters,
                    handle: PluginHandle) -> SessionIdProducer:
        return cls(name, params.header_name, params.cookie_name)

    def extract(self, request: LLMRequest) -> str:
        if self.header_name:
            return (request.headers.get(self.header_name) or "").strip()
        return cookie_value(request.headers.get("cookie") or "", self.cookie_name).strip()

    async def prepare_request_data(self, request: LLMRequest,
                                   endpoints: Sequence[Endpoint]) -> None:
        sid = self.extract(request)
        if sid:
            request.plugin_state[self.key] = sid


# ---------------------------------------------------------- burst-prefix-cache-producer

BURST_PRODUCER: Final = "burst-prefix-cache-producer"
UNLIMITED: Final = -1
DEFAULT_MAX_PREFIX_BLOCKS: Final = 2048
MAX_WINDOW_MS: Final = 10_000
PRODUCE_TIMEOUT_MARGIN_S: Final = 0.3
BALANCE_REQUESTS: Final = "requests"
BALANCE_TOKENS: Final = "tokens"


def block_hashes(tokens: Sequence[int], model: str, cache_salt: str | None,
                 block_size: int, max_blocks: int) -> list[int]:
    """llm-d's ``prefixhash.GetBlockHashes`` for one prompt: ``block_size``-token blocks
    (the last one partial), each hash chaining the previous one, the first seeded with the
    model and the cache salt; at most ``max_blocks``. (Own hash function: the values are
    compared within one window of this process only.)"""
    if not tokens or block_size <= 0:
        return []
    seed = hashlib.blake2b(model.encode() + (cache_salt or "").encode(), digest_size=8)
    prev = seed.digest()
    out: list[int] = []
    for i in range(0, len(tokens), block_size):
        if len(out) >= max_blocks:
            break
        h = hashlib.blake2b(digest_size=8)
        h.update(b"".join((t & 0xFFFFFFFF).to_bytes(4, "little")
                          for t in tokens[i:i + block_size]))
        h.update(prev)
        prev = h.digest()
        out.append(int.from_bytes(prev, "little"))
    return out


@dataclass(eq=False)
class BurstEntry:
    """One request of a window: its prefix blocks, its candidates, where it was put."""

    hashes: tuple[int, ...]
    endpoints: Sequence[Endpoint]
    assigned: Endpoint | None = None


@dataclass(eq=False)
class _Batch:
    entries: list[BurstEntry] = field(default_factory=list)
    sealed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False


def _prefer(a: Endpoint, b: Endpoint | None, load: Mapping[str, int]) -> bool:
    """llm-d's ``less``: lower window load, then fewer running requests, then key."""
    if b is None:
        return True
    la, lb = load.get(a.key, 0), load.get(b.key, 0)
    if la != lb:
        return la < lb
    ra, rb = a.metrics.running_requests, b.metrics.running_requests
    if ra != rb:
        return ra < rb
    return a.key < b.key


def _least_loaded(replicas: Sequence[Endpoint], per_replica: Mapping[str, int], k: int,
                  load: Mapping[str, int]) -> Endpoint:
    best: Endpoint | None = None
    for r in replicas:
        if k != UNLIMITED and per_replica.get(r.key, 0) >= k:
            continue
        if _prefer(r, best, load):
            best = r
    if best is not None:
        return best
    for r in replicas:
        if _prefer(r, best, load):
            best = r
    assert best is not None
    return best


def _pick_replica(replicas: Sequence[Endpoint], per_replica: Mapping[str, int], k: int,
                  load: Mapping[str, int], matches: Mapping[str, int], min_colocate: int,
                  max_share: int, prefer_match: bool) -> Endpoint:
    if prefer_match:
        best: Endpoint | None = None
        best_match = 0
        for r in replicas:
            if k != UNLIMITED and per_replica.get(r.key, 0) >= k:
                continue
            if load.get(r.key, 0) >= max_share:
                continue  # at its fair share of the window
            m = matches.get(r.key, 0)
            if m < min_colocate:
                continue
            if best is None or m > best_match or (m == best_match and _prefer(r, best, load)):
                best, best_match = r, m
        if best is not None:
            return best
    return _least_loaded(replicas, per_replica, k, load)


def _longest_prefix(holders: Mapping[int, set[str]], hashes: Sequence[int]) -> dict[str, int]:
    res: dict[str, int] = {}
    for h in hashes:
        held = holders.get(h)
        if not held:
            break
        for key in held:
            res[key] = res.get(key, 0) + 1
    return res


def _place(members: list[BurstEntry], replicas: Sequence[Endpoint], k: int,
           min_colocate: int, max_share: int, cost: int, holders: dict[int, set[str]],
           load: dict[str, int], by_tokens: bool) -> None:
    hashes = members[0].hashes
    prefer_match = min_colocate > 0
    matches = _longest_prefix(holders, hashes) if prefer_match or by_tokens else {}
    per_replica: dict[str, int] = {}
    i = 0
    while i < len(members):
        target = _pick_replica(replicas, per_replica, k, load, matches, min_colocate,
                               max_share, prefer_match)
        run = len(members) - i
        if k != UNLIMITED:
            run = min(run, max(k - per_replica.get(target.key, 0), 1))
        for m in members[i:i + run]:
            m.assigned = target
        first_touch = per_replica.get(target.key, 0) == 0
        per_replica[target.key] = per_replica.get(target.key, 0) + run
        if not by_tokens:
            load[target.key] = load.get(target.key, 0) + run
        elif first_touch:
            load[target.key] = load.get(target.key, 0) + max(
                cost - matches.get(target.key, 0), 0)
        i += run
        prefer_match = False  # only the unit's first replica gets the prefix preference
    for m in members:
        if m.assigned is not None:
            for h in hashes:
                holders.setdefault(h, set()).add(m.assigned.key)


def assign(entries: Sequence[BurstEntry], k: int = UNLIMITED, min_colocate: int = 0,
           by_tokens: bool = False) -> None:
    """llm-d's ``assign``: group the window's requests by identical prefix; identical
    groups (≥ 2) are units, and so is a single request sharing ``min_colocate`` leading
    blocks with another one (when > 0); place the units longest prefix first, groups
    before singles, each on the replica holding most of its prefix (≥ ``min_colocate``
    blocks, under its fair share of the window) or else the least loaded one, at most
    ``k`` members of a unit per replica. Sets ``assigned``; None: no affinity."""
    groups: dict[tuple[int, ...], list[BurstEntry]] = {}
    replicas: Sequence[Endpoint] = ()
    for e in entries:
        if not e.hashes:
            continue
        groups.setdefault(e.hashes, []).append(e)
        if not replicas:
            replicas = e.endpoints
    if not replicas:
        return
    shared: set[tuple[int, ...]] = set()
    if min_colocate > 0:
        count: dict[tuple[int, ...], int] = {}
        for key, members in groups.items():
            if len(key) >= min_colocate:
                count[key[:min_colocate]] = count.get(key[:min_colocate], 0) + len(members)
        shared = {key for key in groups
                  if len(key) >= min_colocate and count[key[:min_colocate]] >= 2}
    group_units = [key for key, m in groups.items() if len(m) >= 2]
    single_units = [key for key, m in groups.items() if len(m) < 2 and key in shared]
    if not group_units and not single_units:
        return
    group_units.sort(key=len, reverse=True)  # stable: arrival order among equals
    single_units.sort(key=len, reverse=True)
    units = group_units + single_units
    total = sum(len(key) if by_tokens else len(groups[key]) for key in units)
    max_share = -(-total // len(replicas))
    holders: dict[int, set[str]] = {}
    load: dict[str, int] = {}
    for key in units:
        _place(groups[key], replicas, k, min_colocate, max_share, len(key), holders, load,
               by_tokens)


def _check_burst(p: BurstPrefixParameters) -> None:
    def bad(key: str, why: str) -> ParameterError:
        return ParameterError(key, f"invalid configuration: {why}")
    if p.window_duration_ms <= 0:
        raise bad("windowDurationMs", f"must be > 0 (current value: {p.window_duration_ms})")
    if p.window_duration_ms > MAX_WINDOW_MS:
        raise bad("windowDurationMs", f"must be <= {MAX_WINDOW_MS} (current value: "
                  f"{p.window_duration_ms})")
    if p.max_per_replica != UNLIMITED and p.max_per_replica < 1:
        raise bad("maxPerReplica", "must be -1 (unlimited) or >= 1 (current value: "
                  f"{p.max_per_replica})")
    if p.block_size_tokens <= 0:
        raise bad("blockSizeTokens", f"must be > 0 (current value: {p.block_size_tokens})")
    if p.max_prefix_tokens_to_match < 0:
        raise bad("maxPrefixTokensToMatch", "must be >= 0 (current value: "
                  f"{p.max_prefix_tokens_to_match})")
    if 0 < p.max_prefix_tokens_to_match < p.block_size_tokens:
        raise bad("maxPrefixTokensToMatch", f"({p.max_prefix_tokens_to_match}) must be 0 or "
                  f">= blockSizeTokens ({p.block_size_tokens}); a smaller positive value "
                  "yields zero prefix blocks")
    if p.min_colocate_blocks < 0:
        raise bad("minColocateBlocks", "must be >= 0 (current value: "
                  f"{p.min_colocate_blocks})")
    if p.max_batch_size != UNLIMITED and p.max_batch_size < 1:
        raise bad("maxBatchSize", "must be -1 (unlimited) or >= 1 (current value: "
                  f"{p.max_batch_size})")
    if p.balance_by not in ("", BALANCE_REQUESTS, BALANCE_TOKENS):
        raise bad("balanceBy", f"must be {BALANCE_REQUESTS!r} or {BALANCE_TOKENS!r} "
                  f"(current value: {p.balance_by!r})")


@dataclass(frozen=True)
class BurstPrefixParameters:
    window_duration_ms: int = param("windowDurationMs", 100)
    max_per_replica: int = param("maxPerReplica", UNLIMITED)
    block_size_tokens: int = param("blockSizeTokens", 64)
    max_prefix_tokens_to_match: int = param("maxPrefixTokensToMatch", 0)
    min_colocate_blocks: int = param("minColocateBlocks", 0)
    max_batch_size: int = param("maxBatchSize", 1000)
    balance_by: str = param("balanceBy", BALANCE_REQUESTS)

    def __post_init__(self) -> None:
        _check_burst(self)


class BurstPrefixCacheProducer:
    """Co-locates the prompt-sharing requests of each window (see the module doc)."""

    type_name = BURST_PRODUCER
    produces = MappingProxyType({fw.DATA_KEY_PREFIX_CACHE_MATCH_INFO: "PrefixCacheMatchInfo"})
    consumes = MappingProxyType({TOKENIZED_PROMPT: "TokenizedPrompt"})
    Parameters = BurstPrefixParameters

    def __init__(self, name: str, params: BurstPrefixParameters | None = None) -> None:
        p = params or BurstPrefixParameters()
        self.name = name
        self.params = p
        self.window_s = p.window_duration_ms / 1000
        self.max_blocks = (p.max_prefix_tokens_to_match // p.block_size_tokens
                           if p.max_prefix_tokens_to_match > 0 else DEFAULT_MAX_PREFIX_BLOCKS)
        self.by_tokens = p.balance_by == BALANCE_TOKENS
        self._batch: _Batch | None = None
        self.batches_full = 0
        self._state_key = f"{BURST_PRODUCER}/{name}"

    @classmethod
    def from_params(cls, name: str, params: BurstPrefixParameters,
                    handle: PluginHandle) -> BurstPrefixCacheProducer:
        return cls(name, params)

    def produce_timeout(self) -> float:
        return self.window_s + PRODUCE_TIMEOUT_MARGIN_S

    def hashes(self, request: LLMRequest) -> tuple[int, ...]:
        tp = tokenized(request)
        if tp is None:
            return ()
        return tuple(block_hashes(tp.token_ids, request.target_model, tp.cache_salt,
                                  self.params.block_size_tokens, self.max_blocks))

    def _seal(self, batch: _Batch) -> None:
        if batch.closed:
            return
        batch.closed = True
        if self._batch is batch:
            self._batch = None
        assign(batch.entries, self.params.max_per_replica, self.params.min_colocate_blocks,
               self.by_tokens)
        batch.sealed.set()

    async def prepare_request_data(self, request: LLMRequest,
                                   endpoints: Sequence[Endpoint]) -> None:
        await whole_tokenization(request)  # all of the prompt's blocks, not a leading part
        entry = BurstEntry(self.hashes(request), endpoints)
        batch = self._batch
        if batch is None:
            batch = self._batch = _Batch()
            asyncio.get_running_loop().call_later(self.window_s, self._seal, batch)
        limit = self.params.max_batch_size
        if limit != UNLIMITED and len(batch.entries) >= limit:
            self.batches_full += 1
            log.warning("%s: burst prefix batch full: maxBatchSize %d reached; request %s "
                        "gets no affinity", self.name, limit, request.request_id)
            return
        batch.entries.append(entry)
        started = time.monotonic()
        await batch.sealed.wait()
        log.debug("%s: burst batch sealed after %.0f ms", self.name,
                  (time.monotonic() - started) * 1000)
        total = len(entry.hashes)
        assigned = entry.assigned
        if assigned is not None and all(e.key != assigned.key for e in endpoints):
            log.debug("%s: assigned replica %s is no longer a candidate of request %s",
                      self.name, assigned.key, request.request_id)
            assigned = None
        request.plugin_state[self._state_key] = (
            total, {assigned.key: total} if assigned is not None else {})

    # --- what prefix-cache-scorer reads (prefixMatchInfoProducerName) ---

    def match(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> tuple[int, dict[str, int]]:
        """(total blocks, matched blocks per endpoint key): a full match on the request's
        replica, none elsewhere; (0, {}) when it got none."""
        got = request.plugin_state.get(self._state_key)
        if got is None:
            return 0, {}
        total, matched = got
        return total, dict(matched)

    def hot(self, endpoints: Sequence[Endpoint]) -> set[str]:
        return set()


# ------------------------------------------------------------------ p2p-source-producer

P2P_PRODUCER: Final = "p2p-source-producer"
HEADER_KV_CACHE_SOURCE: Final = keys.HEADER_KV_CACHE_SOURCE  # a routing header (removed
# from the request unless set here, as llm-d's PreRequest deletes an inbound value)
CPU_TIER: Final = "cpu"


def spread_fraction(request_id: str) -> float:
    """FNV-1a (32 bit) of the request id, mapped onto [0, 1)."""
    h = 0x811C9DC5
    for b in request_id.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h / 2**32


@dataclass(frozen=True)
class P2PSourceParameters:
    prefix_match_info_producer_name: str = param("prefixMatchInfoProducerName", "")
    min_cached_token_delta: int = param("minCachedTokenDelta", 1)
    prefill_profile_name: str = param("prefillProfileName", "")

    def __post_init__(self) -> None:
        if self.min_cached_token_delta < 1:
            raise ParameterError("minCachedTokenDelta", f"{P2P_PRODUCER}: must be >= 1, got "
                                 f"{self.min_cached_token_delta}")


class P2PSourceProducer:
    """Names a peer to pull cached KV blocks from (see the module doc)."""

    type_name = P2P_PRODUCER
    Parameters = P2PSourceParameters
    consumes = MappingProxyType({fw.DATA_KEY_PREFIX_CACHE_MATCH_INFO: "PrefixCacheMatchInfo"})

    def __init__(self, name: str, producer_name: str = "", min_cached_token_delta: int = 1,
                 prefill_profile: str = "") -> None:
        self.name = name
        self.producer_name = producer_name
        self.min_delta = min_cached_token_delta
        self.prefill_profile = prefill_profile or "prefill"
        self.producer: Any = None
        self._state_key = f"{P2P_PRODUCER}/{name}/best-match"

    @classmethod
    def from_params(cls, name: str, params: P2PSourceParameters,
                    handle: PluginHandle) -> P2PSourceProducer:
        return cls(name, params.prefix_match_info_producer_name,
                   params.min_cached_token_delta, params.prefill_profile_name)

    def bind(self, handle: PluginHandle) -> None:
        """The prefix producer read: the one named, else the config's single
        approx-prefix-cache-producer or precise-prefix-cache-producer."""
        if self.producer_name:
            named = handle.get(self.producer_name)
            if named is None or not callable(getattr(named, "match", None)):
                what = "no such plugin" if named is None else f"a {named.type_name}"
                raise ConfigError(f"{self.name}.prefixMatchInfoProducerName: "
                                  f"{self.producer_name!r} is {what}, not a prefix match "
                                  "producer (precise-prefix-cache-producer, "
                                  "approx-prefix-cache-producer)")
            self.producer = named
            return
        found = [p for p in handle if p.type_name in (
            "approx-prefix-cache-producer", "precise-prefix-cache-producer")]
        if len(found) != 1:
            raise ConfigError(f"{self.name}: set prefixMatchInfoProducerName to the prefix "
                              "producer to read (the config declares "
                              f"{len(found)} approx-/precise-prefix-cache-producers)")
        self.producer = found[0]

    def _cached(self, request: LLMRequest, endpoints: Sequence[Endpoint]
                ) -> tuple[dict[str, int], dict[str, int], int]:
        """(pull-servable tokens, all cached tokens) per endpoint key, and the block size."""
        state = CycleState()
        info_of = getattr(self.producer, "match_info", None)
        if callable(info_of):  # precise: unweighted counts and tiers
            info = info_of(state, request, endpoints)
            bs = int(info.block_size_tokens)
            all_tokens = {k: int(n) * bs for k, n in info.cached_blocks.items()}
            source = {}
            for k, n in info.cached_blocks.items():
                tiers = info.by_tier.get(k)
                source[k] = (int(tiers.get(CPU_TIER, 0)) if tiers else int(n)) * bs
            return source, all_tokens, bs
        _, matched = self.producer.match(state, request, endpoints)
        bs = int(getattr(self.producer, "block_size_tokens", 1))
        tokens = {k: int(n) * bs for k, n in matched.items()}
        return tokens, tokens, bs

    async def prepare_request_data(self, request: LLMRequest,
                                   endpoints: Sequence[Endpoint]) -> None:
        source, all_tokens, bs = self._cached(request, endpoints)
        matches = [(e, source.get(e.key, 0)) for e in endpoints if source.get(e.key, 0) > 0]
        if not matches:
            return
        best = max(n for _, n in matches)
        band = [(e, n) for e, n in matches if n + bs >= best]
        weights = [1.0 / (1.0 + e.metrics.waiting_queue_size) for e, _ in band]
        target = spread_fraction(request.request_id) * sum(weights)
        chosen = len(band) - 1
        for i, w in enumerate(weights):
            if target < w:
                chosen = i
                break
            target -= w
        peer, tokens = band[chosen]
        request.plugin_state[self._state_key] = (peer.key, tokens, all_tokens)

    def request_headers(self, request: LLMRequest, result: SchedulingResult
                        ) -> Mapping[str, str]:
        got = request.plugin_state.get(self._state_key)
        if got is None:
            return {}
        peer, tokens, all_tokens = got
        computing = result.profile_results.get(self.prefill_profile)
        if computing is None or not computing.endpoints:
            computing = result.profile_results.get(result.primary_profile)
        if computing is None or not computing.endpoints:
            return {}
        here = computing.endpoints[0].key
        if peer == here or tokens - all_tokens.get(here, 0) < self.min_delta:
            return {}
        return {HEADER_KV_CACHE_SOURCE: peer}
