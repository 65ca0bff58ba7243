"""``predicted-ttft-scorer``: score each candidate by the time to first token the client
would see there (issue 17: a default that reasons instead of weighing).

The model, per candidate pod ``p`` (milliseconds)::

    TTFT_p = c_p × (Q_p + U_p) + d_p + e_p × R_p

- ``U_p``: this request's uncached prompt tokens on ``p``: its prompt tokens (characters
  / 4) minus the blocks the ``approx-prefix-cache-producer``'s index says ``p`` holds.
- ``Q_p``: prefill tokens queued ahead of it on ``p``: the larger of (a) the uncached
  tokens of the requests this EPP routed to ``p`` whose prefill is not known to be done,
  and (b) ``p``'s scraped waiting queue × the mean uncached tokens per routed request
  (work other EPP replicas or clients put there). A routed request's tokens leave (a)
  when its response ends, when a request routed to ``p`` after it ends (engines prefill
  first come, first served), or when a scrape of ``p`` taken after it was routed shows
  it admitted (a scrape with ``W`` waiting keeps only the ``W`` newest entries routed
  before it).
- ``R_p``: requests running on ``p`` (the larger of this EPP's in-flight count and the
  scraped running requests): the decode steps a prefill shares the GPU with.
- ``c_p`` (ms per prefill token), ``d_p`` (ms, fixed cost per request) and ``e_p`` (ms
  per running request) are learned per pod, online, from the TTFTs the EPP observes
  (``ResponseMeasured``: the front measures the first streamed body chunk; a gateway shape
  that shows the EPP response bodies — GIE's or the split one — is needed, see
  docs/plugins.md): an exponentially weighted least-squares fit over the last
  ``observationWindow`` observations, ridge-regularised toward the prior (which weighs
  as much as two observations of a request with 1,000 tokens ahead and 10 running), so
  a pod with few observations stays near the prior and one with many follows its data. Estimates
  are clamped to ``c ≥ 1% of the prior``, ``d ≥ 0``, ``e ≥ 0``.

Cold start (no observation of ``p``): the prior ``prefillMsPerToken`` (0.05),
``overheadMs`` (10), ``decodeMsPerRunning`` (0.1) — roughly a mid-size model (8B) on a
current data-center GPU (about 20k prefill tokens/s, 10 ms decode steps). Only the
ratios between them matter for ranking pods that share them: the model still prefers
less queued work and more cached tokens.

Score: ``min_q TTFT_q / TTFT_p``, in (0, 1], 1 for the best candidate. Candidates whose
predictions tie (relative difference under 1e-9) are ordered by load — this EPP's
in-flight count, then the scraped waiting + running requests, then KV-cache utilization —
each step down costing 1e-6, so a tie is never broken by candidate order (exact ties
in load too are left to the picker, which breaks them at random).

State: per pod, the model (bounded by ``maxEndpoints``, least recently used dropped) and
the requests in flight (each dropped after ``requestTimeout`` at the latest); a pod that
leaves the pool is forgotten (EndpointRemoved).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from epp.errors import ConfigError
from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.params import ParameterError, param, positive_duration
from epp.scheduling.plugins.prefix import (
    CHARS_PER_TOKEN,
    ApproxPrefixCacheProducer,
    PrefixIndexParameters,
)
from epp.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult

_TIE = 1e-9  # relative difference under which two predictions tie
_TIE_STEP = 1e-6  # score cost of each step down the load order among tied candidates
_MEAN_ALPHA = 0.05  # EMA weight of the mean uncached tokens per routed request
_MIN_PRED_MS = 1e-6
PRIOR_OBSERVATIONS = 2.0
TYPICAL_TOKENS = 1000.0
TYPICAL_RUNNING = 10.0


@dataclass(frozen=True)
class PredictedTTFTParameters:
    prefill_ms_per_token: float = param("prefillMsPerToken", 0.05, minimum=0.0)
    overhead_ms: float = param("overheadMs", 10.0, minimum=0.0)
    decode_ms_per_running: float = param("decodeMsPerRunning", 0.1, minimum=0.0)
    learn: bool = param("learn", True)
    observation_window: int = param("observationWindow", 200, minimum=1)
    max_endpoints: int = param("maxEndpoints", 1024, minimum=1)
    request_timeout: float = param("requestTimeout", 120.0, parse=positive_duration)
    prefix_plugin_name: str | None = param("prefixPluginName", None)

    def __post_init__(self) -> None:
        if not self.prefill_ms_per_token > 0:
            raise ParameterError("prefillMsPerToken", "must be > 0, got "
                                 f"{self.prefill_ms_per_token}")
        if self.prefix_plugin_name is not None and not self.prefix_plugin_name:
            raise ParameterError("prefixPluginName", "must not be empty")


class PodModel:
    """``TTFT = c·tokens + d + e·running`` for one pod: exponentially weighted least
    squares with a ridge prior toward ``prior`` (the prior never decays, so the fit
    cannot wind up on features that never vary)."""

    __slots__ = (
        "_floor",
        "_theta",
        "decay",
        "observations",
        "penalty",
        "prior",
        "sxx",
        "sxy",
    )

    def __init__(self, prior: tuple[float, float, float], window: int) -> None:
        self.prior = prior
        c0 = prior[0]
        # The prior weighs as much as PRIOR_OBSERVATIONS observations of a typical
        # request (TYPICAL_TOKENS tokens ahead, TYPICAL_RUNNING running).
        self.penalty = tuple(PRIOR_OBSERVATIONS * x * x
                             for x in (TYPICAL_TOKENS, 1.0, TYPICAL_RUNNING))
        self.decay = 1.0 - 1.0 / window
        self.sxx = [[0.0] * 3 for _ in range(3)]
        self.sxy = [0.0] * 3
        self.observations = 0
        self._theta: tuple[float, float, float] | None = prior
        self._floor = 0.01 * c0

    def observe(self, tokens: float, running: float, ttft_ms: float) -> None:
        x = (tokens, 1.0, running)
        k = self.decay
        for i in range(3):
            self.sxy[i] = k * self.sxy[i] + x[i] * ttft_ms
            row = self.sxx[i]
            for j in range(3):
                row[j] = k * row[j] + x[i] * x[j]
        self.observations += 1
        self._theta = None

    @property
    def theta(self) -> tuple[float, float, float]:
        """(c ms/token, d ms, e ms/running request), clamped."""
        if self._theta is None:
            a = [[self.sxx[i][j] + (self.penalty[i] if i == j else 0.0) for j in range(3)]
                 for i in range(3)]
            b = [self.sxy[i] + self.penalty[i] * self.prior[i] for i in range(3)]
            c, d, e = _solve3(a, b)
            self._theta = (max(c, self._floor), max(d, 0.0), max(e, 0.0))
        return self._theta

    def predict(self, tokens: float, running: float) -> float:
        c, d, e = self.theta
        return c * tokens + d + e * running


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float]:
    """Solve the 3×3 system ``a·x = b`` (symmetric positive definite) by elimination."""
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        p = m[col][col]
        if p == 0.0:
            continue
        for r in range(col + 1, 3):
            f = m[r][col] / p
            if f:
                for j in range(col, 4):
                    m[r][j] -= f * m[col][j]
    x = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        s = m[i][3] - sum(m[i][j] * x[j] for j in range(i + 1, 3))
        x[i] = s / m[i][i] if m[i][i] else 0.0
    return x[0], x[1], x[2]


@dataclass(slots=True)
class _Entry:
    pod: str
    tokens: int
    routed_at: float
    queued: bool = True  # prefill not known to be done


@dataclass(slots=True)
class _Pod:
    inflight: int = 0
    queued_tokens: int = 0
    queue: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)  # routing order
    anchor: float | None = None  # updated_at of the last scrape applied


class PredictedTTFTScorer:
    type_name = "predicted-ttft-scorer"
    consumes = MappingProxyType({fw.DATA_KEY_PREFIX_CACHE_MATCH_INFO: "PrefixCacheMatchInfo"})
    Parameters = PredictedTTFTParameters

    def __init__(self, name: str, params: PredictedTTFTParameters | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self._scored = f"{name}/scored"
        self.params = params or PredictedTTFTParameters()
        p = self.params
        self.prior = (p.prefill_ms_per_token, p.overhead_ms, p.decode_ms_per_running)
        self._clock = clock
        self.producer: ApproxPrefixCacheProducer | None = None
        self.models: OrderedDict[str, PodModel] = OrderedDict()  # least recently used first
        self.pods: dict[str, _Pod] = {}
        self._entries: dict[int, _Entry] = {}  # insertion order = routing order
        self._last_id = 0
        self.mean_tokens: float | None = None

    @classmethod
    def from_params(cls, name: str, params: PredictedTTFTParameters,
                    handle: PluginHandle) -> PredictedTTFTScorer:
        return cls(name, params)

    def bind(self, handle: PluginHandle) -> None:
        """Find the prefix producer (by ``prefixPluginName``, or the only one), or create
        one with its defaults."""
        wanted = self.params.prefix_plugin_name
        if wanted is not None:
            found = handle.named(wanted, ApproxPrefixCacheProducer)
            if found is None:
                raise ConfigError(f"{self.name}: prefixPluginName {wanted!r}: no "
                                  "approx-prefix-cache-producer of that name; declare it")
            self.producer = found
            return
        producers = handle.of_type(ApproxPrefixCacheProducer)
        if len(producers) > 1:
            raise ConfigError(f"{self.name}: several approx-prefix-cache-producer plugins; "
                              "name the one to read with prefixPluginName")
        if producers:
            self.producer = producers[0]
            return
        d = PrefixIndexParameters()
        self.producer = ApproxPrefixCacheProducer(
            f"{self.name}-producer", d.block_size_tokens, d.max_blocks,
            d.lru_capacity_per_server, d.auto_tune, d.hash_block_size,
            d.balance_abs_threshold, d.balance_rel_threshold)
        handle.add(self.producer)

    # ------------------------------------------------------------ the model

    def model(self, key: str) -> PodModel | None:
        return self.models.get(key)

    def _model_for_update(self, key: str) -> PodModel:
        m = self.models.get(key)
        if m is None:
            m = PodModel(self.prior, self.params.observation_window)
            self.models[key] = m
            while len(self.models) > self.params.max_endpoints:
                self.models.popitem(last=False)
        else:
            self.models.move_to_end(key)
        return m

    def _predict(self, key: str, tokens: float, running: float) -> float:
        m = self.models.get(key)
        if m is None:
            c, d, e = self.prior
            return c * tokens + d + e * running
        return m.predict(tokens, running)

    def uncached_tokens(self, state: CycleState, request: LLMRequest,
                        endpoints: Sequence[Endpoint]) -> list[int]:
        """This request's prompt tokens not in each candidate's cache (by the index)."""
        assert self.producer is not None, "bind() not called"
        prompt = max(1, round(len(request.prompt) / CHARS_PER_TOKEN))
        _, matched = self.producer.match(state, request, endpoints)
        per_block = self.producer.block_chars / CHARS_PER_TOKEN
        return [max(0, prompt - round(matched.get(e.key, 0) * per_block)) for e in endpoints]

    def queued_tokens(self, endpoint: Endpoint, fallback_mean: float) -> int:
        """Prefill tokens queued ahead on ``endpoint`` (the module doc's ``Q``)."""
        pod = self.pods.get(endpoint.key)
        own = 0
        if pod is not None:
            self._apply_scrape(pod, endpoint)
            own = pod.queued_tokens
        mean = self.mean_tokens if self.mean_tokens is not None else fallback_mean
        return max(own, round(endpoint.metrics.waiting_queue_size * mean))

    def running(self, endpoint: Endpoint) -> int:
        pod = self.pods.get(endpoint.key)
        return max(pod.inflight if pod is not None else 0, endpoint.metrics.running_requests)

    def features(self, state: CycleState, request: LLMRequest,
                 endpoints: Sequence[Endpoint]) -> list[tuple[int, int, int]]:
        """(tokens queued ahead, this request's uncached tokens, running) per candidate."""
        uncached = self.uncached_tokens(state, request, endpoints)
        fallback = float(max(uncached, default=1))
        return [(self.queued_tokens(e, fallback), u, self.running(e))
                for e, u in zip(endpoints, uncached)]

    def predictions(self, state: CycleState, request: LLMRequest,
                    endpoints: Sequence[Endpoint]) -> list[float]:
        """Predicted TTFT in ms per candidate."""
        return [max(_MIN_PRED_MS, self._predict(e.key, q + u, r))
                for e, (q, u, r) in zip(endpoints, self.features(state, request, endpoints))]

    # ------------------------------------------------------------ Scorer

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        if not endpoints:
            return []
        feats = self.features(state, request, endpoints)
        preds = [max(_MIN_PRED_MS, self._predict(e.key, q + u, r))
                 for e, (q, u, r) in zip(endpoints, feats)]
        # For pre_request: the chosen pod's features (learning pairs them with its TTFT).
        request.plugin_state[self._scored] = {e.key: f for e, f in zip(endpoints, feats)}
        best = min(preds)
        scores = [best / p for p in preds]
        # Ties: order by load, never by candidate order.
        groups: dict[int, list[int]] = {}
        order = sorted(range(len(preds)), key=lambda i: preds[i])
        lead = order[0]
        for i in order:
            if abs(preds[i] - preds[lead]) > _TIE * max(1.0, preds[lead]):
                lead = i
            groups.setdefault(lead, []).append(i)
        for members in groups.values():
            if len(members) < 2:
                continue
            keyed = sorted(members, key=lambda i: self._load_key(endpoints[i]))
            rank = 0
            prev = self._load_key(endpoints[keyed[0]])
            for i in keyed:
                k = self._load_key(endpoints[i])
                if k != prev:
                    rank += 1
                    prev = k
                scores[i] = max(0.0, scores[i] - rank * _TIE_STEP)
        return scores

    def _load_key(self, e: Endpoint) -> tuple[int, int, float]:
        pod = self.pods.get(e.key)
        return (pod.inflight if pod is not None else 0,
                e.metrics.waiting_queue_size + e.metrics.running_requests,
                e.metrics.kv_cache_usage)

    # ------------------------------------------------------------ request tracking

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        endpoints = result.primary.endpoints
        if not endpoints:
            return
        target = endpoints[0]
        self._expire()
        scored: dict[str, tuple[int, int, int]] = request.plugin_state.pop(self._scored, {})
        feats = scored.get(target.key)
        if feats is None:  # not scored by this plugin (another profile): compute now
            feats = self.features(CycleState(), request, [target])[0]
        ahead, own, running = feats
        pod = self.pods.setdefault(target.key, _Pod())
        self.mean_tokens = (float(own) if self.mean_tokens is None
                            else (1 - _MEAN_ALPHA) * self.mean_tokens + _MEAN_ALPHA * own)
        self._last_id += 1
        entry = _Entry(target.key, own, self._clock())
        self._entries[self._last_id] = entry
        pod.inflight += 1
        pod.queued_tokens += own
        pod.queue[self._last_id] = entry
        request.plugin_state[self.name] = (self._last_id, target.key, ahead + own, running)

    def response_measured(self, request: LLMRequest, endpoint_key: str,
                          timings: fw.ResponseTimings) -> None:
        """Learn from an observed TTFT (a 2xx streamed response the front measured)."""
        info = request.plugin_state.get(self.name)
        if (not self.params.learn or timings.ttft is None or info is None
                or not 200 <= timings.status < 300):
            return
        _, key, tokens, running = info
        if key != endpoint_key:
            return
        self._model_for_update(key).observe(tokens, running, 1000.0 * timings.ttft)

    def response_complete(self, request: LLMRequest, endpoint_key: str, aborted: bool) -> None:
        info = request.plugin_state.pop(self.name, None)
        if info is None:
            return
        entry_id = info[0]
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return
        pod = self.pods.get(entry.pod)
        if pod is None:
            return
        pod.inflight = max(0, pod.inflight - 1)
        # FCFS prefill: this one and every request routed to the pod before it are done.
        for eid in list(pod.queue):
            self._dequeue(pod, eid)
            if eid == entry_id:
                break
        self._expire()

    def endpoint_removed(self, key: str) -> None:
        self.models.pop(key, None)
        pod = self.pods.pop(key, None)
        if pod is not None:
            for eid in [i for i, e in self._entries.items() if e.pod == key]:
                del self._entries[eid]

    # ------------------------------------------------------------ internals

    def _dequeue(self, pod: _Pod, entry_id: int) -> None:
        entry = pod.queue.pop(entry_id, None)
        if entry is not None and entry.queued:
            entry.queued = False
            pod.queued_tokens = max(0, pod.queued_tokens - entry.tokens)

    def _apply_scrape(self, pod: _Pod, endpoint: Endpoint) -> None:
        """A scrape taken after requests were routed shows how many still wait: keep the
        newest ``waiting`` of those routed before it, the older ones were admitted."""
        at = endpoint.metrics.updated_at
        if at is None or (pod.anchor is not None and at <= pod.anchor):
            return
        pod.anchor = at
        before = [eid for eid, e in pod.queue.items() if e.routed_at < at]
        keep = max(0, endpoint.metrics.waiting_queue_size)
        for eid in before[:max(0, len(before) - keep)]:
            self._dequeue(pod, eid)

    def _expire(self) -> None:
        limit = self._clock() - self.params.request_timeout
        while self._entries:
            eid, entry = next(iter(self._entries.items()))
            if entry.routed_at > limit:
                break
            del self._entries[eid]
            pod = self.pods.get(entry.pod)
            if pod is not None:
                pod.inflight = max(0, pod.inflight - 1)
                self._dequeue(pod, eid)

    def state_size(self) -> tuple[int, int, int]:
        """(pod models, pods tracked, requests in flight): for tests and debugging."""
        return len(self.models), len(self.pods), len(self._entries)

