"""The simulated inference engine: continuous batching over a stepped clock.

One :class:`Engine` per simulated server; one asyncio task runs its step loop (no
threads). docs/simulator.md gives the model in prose; the contract is:

Scheduling (each step, vLLM v1 style, FCFS)
- The step's token budget is ``max_num_batched_tokens``. Running sequences are visited
  in admission order: a decoding one takes 1 token, a prefilling one a chunk of
  ``min(remaining uncached prompt, budget left)``. Then waiting requests are admitted in
  arrival order while the batch has fewer than ``max_num_seqs`` sequences, budget is
  left and the KV pool can hold their prompt; the first that does not fit stops
  admission (head-of-line). A LoRA request whose adapter cannot get a slot is skipped
  (it keeps its place) and admission continues with the next.
- KV events (when a publisher is attached, :attr:`Engine.events`): the blocks a step
  evicts (``BlockRemoved``) and the full prompt blocks it caches (one ``BlockStored``
  per request, with their token ids and parent hash) go out as one batch at the end of
  the step, as vLLM publishes one ``KVEventBatch`` per scheduler step — on the loop's
  next turn, once the step's tokens are written (vLLM's publisher sends from its own
  thread, so its events never delay a token; a removal the next step's admission makes
  meanwhile rides in the same batch); :meth:`Engine.reset_prefix_cache` publishes at
  once.
- Admission looks up the prompt's chained block hashes in the prefix cache; the longest
  cached prefix, at most ``(len - 1) // block_size`` blocks, is not computed again.
  ``cached_tokens = hit_blocks * block_size``.
- A decoding sequence that needs a new block when none is free preempts the most
  recently admitted running sequence (possibly itself): its blocks are released (its
  prompt blocks stay cached, evictable) and it goes back to the head of the queue to
  recompute prompt + generated tokens.

Step time (seconds), with ``p_i`` the prefill tokens of sequence ``i`` in the step,
``d`` the decoding sequences and ``l`` the adapters loaded in the step::

    t = time_scale * slow * ( sum_i p_i * c_i
                              + [d > 0] * (decode_base_ms + decode_per_seq_ms * d)
                              + l * lora_load_ms + sum_j e_j ) / 1000

``c_i`` is ``prefill_ms_per_token`` (the KV-transfer cost for a request whose prompt
KV is pulled from a prefill pod: ``kv_transfer_ms_per_token``, or the per-distance cost
the server passes); ``e_j`` is the encode cost (multimodal items times
``encode_ms_per_image``, as the server passes it) of each request admitted for the first
time in the step: the vision encoder runs inside the step and holds up the whole batch,
as in vLLM; ``slow`` is ``slow_start_factor`` during slow start, else 1. Steps are back
to back while there is work (a step starts when the previous one was due to end, so
sleep overshoot does not accumulate). At the end of a
step, a sequence whose prefill completed emits its first token and every decoding one
emits one token; a request ends after ``max_tokens`` tokens (``max_tokens == 0``: after
its prefill). Hence, for a lone request with ``u`` uncached tokens and ``n`` output
tokens: ``TTFT = u * c + e``, ``ITL = decode_base_ms + decode_per_seq_ms``,
``E2E = TTFT + (n - 1) * ITL`` (times ``time_scale``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from epp.kvcache import hashing
from epp.sim.config import SimConfig
from epp.sim.kvcache import Block, BlockPool, token_ids
from epp.sim.kvevents import BlockStored, EventPublisher
from epp.sim.stats import EngineStats
from epp.sim.tokens import Token, word_id

__all__ = ["Engine", "EngineError", "EngineStopped", "PromptTooLong", "SimRequest"]

log = logging.getLogger(__name__)

LORA_INFO_HISTORY: Final = 16
"""How many distinct ``lora_requests_info`` label sets are kept (newest wins)."""
_RESYNC_S: Final = 0.1
"""When the loop falls this far behind the model clock, restart the clock at now."""


class EngineError(Exception):
    """The engine could not finish a request."""


class EngineStopped(EngineError):
    """The engine was stopped while the request was pending."""


class PromptTooLong(ValueError):
    """Prompt plus ``max_tokens`` need more KV blocks than the whole pool."""


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request in the engine, and the caller's handle on it.

    Read :meth:`tokens` (streaming) or :meth:`result` (not), exactly once. Times are
    event-loop times (``loop.time()``); ``cached_tokens`` is known once the request is
    first scheduled.
    """

    id: int
    prompt_len: int
    """Tokens the engine computes for the prompt (at least 1)."""
    max_tokens: int
    lora: str | None
    cost_ms_per_token: float
    hashes: list[int]
    arrival: float
    token_ids: list[int] = field(default_factory=list)
    """The prompt's token ids (what ``BlockStored.token_ids`` carries)."""
    encode_ms: float = 0.0
    """Encode cost of its multimodal items, added to the step that first admits it."""
    target: int = 0
    computed: int = 0
    generated: int = 0
    blocks: list[Block] = field(default_factory=list)
    private: int = 0
    registered: int = 0
    cached_tokens: int = 0
    prefill_chunks: list[int] = field(default_factory=list)
    """Prompt tokens computed in each step that prefilled this request, in order."""
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    _events: asyncio.Queue[int | BaseException | None] = field(default_factory=asyncio.Queue)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target

    @property
    def held_blocks(self) -> int:
        return len(self.blocks) + self.private

    async def tokens(self) -> AsyncIterator[int]:
        """Yield the index of each output token as its step ends; return when the
        request is finished. Raises :class:`EngineError` if the engine failed or
        stopped first."""
        while True:
            item = await self._events.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def result(self) -> None:
        """Wait until the request is finished (see :meth:`tokens`)."""
        async for _ in self.tokens():
            pass


@dataclass(slots=True)
class _Plan:
    prefill: list[tuple[SimRequest, int]] = field(default_factory=list)
    decode: list[SimRequest] = field(default_factory=list)
    lora_loads: int = 0
    encode_ms: float = 0.0

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Engine:
    """A continuous-batching engine over a :class:`BlockPool` (see the module doc).

    Call :meth:`start` inside a running event loop (``submit`` starts it lazily too) and
    :meth:`stop` to end it; stopping fails every pending request with
    :class:`EngineStopped`. All methods must be called from the engine's loop.
    """

    def __init__(self, config: SimConfig, events: EventPublisher | None = None) -> None:
        self.config = config
        self.events = events
        """Where KV events go (None: none are recorded)."""
        self.pool = BlockPool(config.num_gpu_blocks, record_events=events is not None)
        self.stats = EngineStats()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.lora_slots: OrderedDict[str, None] = OrderedDict()
        """Loaded adapters, least recently used first."""
        self.lora_info: OrderedDict[tuple[str, str], float] = OrderedDict()
        """``(running, waiting)`` adapter lists -> wall-clock time they were last seen."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._started_at: float | None = None
        self._closed = False
        self._next_id = 0
        self._note_lora_state()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the step loop (idempotent). Slow start is timed from the first call.

        Raises :class:`EngineStopped` once :meth:`stop` was called: an engine does not
        restart."""
        if self._closed:
            raise EngineStopped("engine stopped")
        if self._task is not None and not self._task.done():
            return
        loop = asyncio.get_running_loop()
        if self._started_at is None:
            self._started_at = loop.time()
        self._task = loop.create_task(self._run(), name="epp-sim-engine")

    async def stop(self) -> None:
        """Stop the step loop for good and fail pending requests with
        :class:`EngineStopped` (idempotent)."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(EngineStopped("engine stopped"))

    def in_slow_start(self) -> bool:
        """True until ``slow_start_s * time_scale`` seconds after :meth:`start`."""
        if self.config.slow_start_s <= 0:
            return False
        if self._started_at is None:
            return True
        elapsed = asyncio.get_running_loop().time() - self._started_at
        return elapsed < self.config.slow_start_s * self.config.time_scale

    # ------------------------------------------------------------ requests

    def submit(
        self,
        tokens: Sequence[Token],
        max_tokens: int,
        *,
        lora: str | None = None,
        remote_prefill: bool = False,
        transfer_ms_per_token: float | None = None,
        encode_ms: float = 0.0,
    ) -> SimRequest:
        """Queue a request. ``tokens`` is its prompt (an empty prompt computes one
        token); ``lora`` must be one of ``config.loras`` or None; ``remote_prefill``
        prices its uncached prompt at ``transfer_ms_per_token`` (default
        ``kv_transfer_ms_per_token``): its KV is pulled from a prefill pod, except the
        prefix already in this engine's cache. ``encode_ms`` (>= 0) is the model time its
        multimodal items take to encode, added to the step that first admits it.

        Raises :class:`PromptTooLong` if prompt + ``max_tokens`` could never fit in the
        pool, ValueError for a bad ``max_tokens`` or unknown adapter,
        :class:`EngineStopped` after :meth:`stop`.
        """
        cfg = self.config
        self.validate(len(tokens), max_tokens, lora)
        if encode_ms < 0:
            raise ValueError(f"encode_ms must be >= 0, got {encode_ms}")
        prompt = token_ids(tokens) if tokens else [word_id("<bos>")]
        self.start()
        loop = asyncio.get_running_loop()
        self._next_id += 1
        req = SimRequest(
            id=self._next_id,
            prompt_len=len(prompt),
            max_tokens=max_tokens,
            lora=lora,
            cost_ms_per_token=(
                (
                    cfg.kv_transfer_ms_per_token
                    if transfer_ms_per_token is None
                    else transfer_ms_per_token
                )
                if remote_prefill
                else cfg.prefill_ms_per_token
            ),
            hashes=hashing.block_hashes(
                prompt, cfg.block_size, algo=cfg.prefix_caching_hash_algo,
                seed=cfg.hash_seed, lora_name=lora,
            ),
            arrival=loop.time(),
            token_ids=prompt,
            encode_ms=encode_ms,
        )
        req.target = req.prompt_len
        self.waiting.append(req)
        self._note_lora_state()
        self._wake.set()
        return req

    def validate(self, prompt_len: int, max_tokens: int, lora: str | None = None) -> None:
        """Raise as :meth:`submit` would for these arguments; change nothing."""
        cfg = self.config
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if lora is not None and lora not in cfg.loras:
            raise ValueError(f"unknown LoRA adapter {lora!r}")
        need = math.ceil((max(1, prompt_len) + max_tokens) / cfg.block_size)
        if need > cfg.num_gpu_blocks:
            raise PromptTooLong(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) need {need} "
                f"KV blocks; the cache holds {cfg.num_gpu_blocks} blocks of {cfg.block_size}"
            )

    def abort(self, req: SimRequest) -> None:
        """Drop ``req`` (client gone): free its blocks; no-op once finished."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
            self.pool.release(req.blocks, req.private)
            req.blocks, req.private = [], 0
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        req.finish_reason = "abort"
        req._events.put_nowait(None)
        self._note_lora_state()
        self._wake.set()

    # ------------------------------------------------------------ snapshot

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        """Blocks referenced by running sequences / pool capacity."""
        return self.pool.usage

    def snapshot(self) -> dict[str, object]:
        """A JSON-able view of the engine state (for ``GET /debug/state``)."""
        s = self.stats
        return {
            "running": self.num_running,
            "waiting": self.num_waiting,
            "kv_cache_usage": self.kv_usage,
            "kv_blocks_used": self.pool.used,
            "kv_blocks_total": self.pool.capacity,
            "prefix_cache_blocks": self.pool.num_cached,
            "prefix_cache_evictions": self.pool.evictions,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "lora_loaded": list(self.lora_slots),
            "lora_running": sorted({r.lora for r in self.running if r.lora}),
            "lora_waiting": sorted({r.lora for r in self.waiting if r.lora}),
            "preemptions": s.preemptions,
            "steps": s.steps,
            "slow_start": self.in_slow_start(),
            "kv_events": None if self.events is None else self.events.snapshot(),
        }

    # ------------------------------------------------------------ KV events

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached block (vLLM's ``reset_prefix_cache``) and
        publish what that removed."""
        self.pool.clear()
        self._publish_events()

    def _publish_events(self) -> None:
        if self.events is not None:
            self.events.publish(self.pool.take_events())

    def _stored(self, req: SimRequest, first: int, end: int) -> None:
        """Record ``BlockStored`` for ``req``'s newly full blocks ``first..end-1``."""
        if not self.pool.record_events or end <= first:
            return
        bs = self.config.block_size
        lora = req.lora
        self.pool.events.append(BlockStored(
            block_hashes=req.hashes[first:end],
            parent_block_hash=req.hashes[first - 1] if first > 0 else None,
            token_ids=req.token_ids[first * bs : end * bs],
            block_size=bs,
            lora_id=None if lora is None else self.config.loras.index(lora) + 1,
            lora_name=lora,
            extra_keys=[None if lora is None else (lora,)] * (end - first),
        ))

    # ------------------------------------------------------------ step loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        step_end = loop.time()
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                step_end = loop.time()
                continue
            now = loop.time()
            start = step_end if now - step_end < _RESYNC_S else now
            try:
                plan = self._schedule()
            except Exception as exc:  # a bug: fail what is pending, keep serving
                log.exception("sim engine: scheduling failed")
                self._fail_all(EngineError(f"engine failure: {exc}"))
                continue
            if plan.empty:  # nothing can run until something changes
                self._wake.clear()
                await self._wake.wait()
                step_end = loop.time()
                continue
            end = start + self._step_seconds(plan)
            await asyncio.sleep(max(0.0, end - loop.time()))
            self._complete(plan, loop.time())
            if self.events is not None:
                # After the step's tokens are written: vLLM's publisher hands a batch to
                # its own thread, so publishing never delays the step's output there.
                loop.call_soon(self._publish_events)
            self.stats.steps += 1
            step_end = end

    def _step_seconds(self, plan: _Plan) -> float:
        cfg = self.config
        ms = sum(chunk * req.cost_ms_per_token for req, chunk in plan.prefill)
        if plan.decode:
            ms += cfg.decode_base_ms + cfg.decode_per_seq_ms * len(plan.decode)
        ms += plan.lora_loads * cfg.lora_load_ms + plan.encode_ms
        if self.in_slow_start():
            ms *= cfg.slow_start_factor
        return ms * cfg.time_scale / 1000.0

    def _schedule(self) -> _Plan:
        cfg = self.config
        plan = _Plan()
        budget = cfg.max_num_batched_tokens
        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:  # preempted for an earlier sequence's block
                continue
            if req.prefilling:
                chunk = min(req.target - req.computed, budget)
                plan.prefill.append((req, chunk))
                budget -= chunk
            elif self._grow(req):
                plan.decode.append(req)
                budget -= 1
        skipped: list[SimRequest] = []
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            slot = self._lora_slot(req.lora)
            if slot is None:
                skipped.append(self.waiting.popleft())
                continue
            first = req.scheduled_at is None
            if not self._admit(req):
                break
            if first:
                plan.encode_ms += req.encode_ms
            self.waiting.popleft()
            if req.lora is not None:
                if req.lora not in self.lora_slots:
                    plan.lora_loads += 1
                    if slot:
                        del self.lora_slots[slot]
                self.lora_slots[req.lora] = None
                self.lora_slots.move_to_end(req.lora)
            chunk = min(req.target - req.computed, budget)
            plan.prefill.append((req, chunk))
            budget -= chunk
        self.waiting.extendleft(reversed(skipped))
        self._note_lora_state()
        return plan

    def _lora_slot(self, lora: str | None) -> str | None:
        """Where ``lora`` would run, without changing anything: ``""`` if no load is
        needed (base model, or already loaded) or a free slot takes it, the least
        recently used idle adapter to evict for it, or None if every slot holds an
        adapter with running sequences (the request must wait)."""
        if lora is None or lora in self.lora_slots:
            return ""
        if len(self.lora_slots) < self.config.max_loras:
            return ""
        active = {r.lora for r in self.running}
        return next((name for name in self.lora_slots if name not in active), None)

    def _admit(self, req: SimRequest) -> bool:
        """Move ``req`` into the batch if the pool can hold its prompt (and the tokens
        generated before a preemption); account prefix-cache hits on first admission."""
        bs = self.config.block_size
        total = req.prompt_len + req.generated
        hits = self.pool.lookup(req.hashes, (total - 1) // bs)
        new = math.ceil(total / bs) - len(hits)
        if not self.pool.can_allocate(new, hits):
            return False
        self.pool.acquire(hits)
        allocated = self.pool.allocate(new)
        assert allocated
        req.blocks, req.private, req.registered = list(hits), new, len(hits)
        req.target, req.computed = total, len(hits) * bs
        if req.scheduled_at is None:
            req.scheduled_at = asyncio.get_running_loop().time()
            req.cached_tokens = req.computed
            self.stats.prefix_cache_queries += req.prompt_len
            self.stats.prefix_cache_hits += req.cached_tokens
            self.stats.queue_time.observe(req.scheduled_at - req.arrival)
        self.running.append(req)
        return True

    def _grow(self, req: SimRequest) -> bool:
        """Give a decoding ``req`` the blocks its next token needs, preempting the most
        recently admitted sequences as needed. False if ``req`` itself was preempted."""
        need = math.ceil((req.prompt_len + req.generated) / self.config.block_size)
        while req.held_blocks < need:
            if self.pool.allocate(1):
                req.private += 1
                continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.pool.release(req.blocks, req.private)
        req.blocks, req.private, req.registered, req.computed = [], 0, 0, 0
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _complete(self, plan: _Plan, now: float) -> None:
        bs = self.config.block_size
        for req, chunk in plan.prefill:
            if req.finished or req not in self.running:
                continue
            req.computed += chunk
            req.prefill_chunks.append(chunk)
            full = min(req.computed // bs, len(req.hashes))
            self._stored(req, req.registered, full)
            while req.registered < full:
                block = self.pool.register(req.hashes[req.registered])
                if block is not None:
                    req.blocks.append(block)
                    req.private -= 1
                req.registered += 1
            if not req.prefilling:
                if req.first_token_at is None:
                    self.stats.prompt_tokens += req.prompt_len
                self._emit(req, now)
        for req in plan.decode:
            if not req.finished and req in self.running:
                self._emit(req, now)
        self._note_lora_state()

    def _emit(self, req: SimRequest, now: float) -> None:
        if req.generated >= req.max_tokens:  # max_tokens == 0: prefill only
            self._finish(req, now)
            return
        if req.first_token_at is None:
            req.first_token_at = now
            self.stats.ttft.observe(now - req.arrival)
        elif req.last_token_at is not None:
            self.stats.tpot.observe(now - req.last_token_at)
        req.last_token_at = now
        req._events.put_nowait(req.generated)
        req.generated += 1
        self.stats.generation_tokens += 1
        if req.generated >= req.max_tokens:
            self._finish(req, now)

    def _finish(self, req: SimRequest, now: float) -> None:
        self.running.remove(req)
        self.pool.release(req.blocks, req.private)
        req.blocks, req.private = [], 0
        req.finished_at = now
        req.finish_reason = "length"
        self.stats.success["length"] += 1
        self.stats.e2e.observe(now - req.arrival)
        req._events.put_nowait(None)

    def _fail_all(self, exc: EngineError) -> None:
        for req in [*self.running, *self.waiting]:
            self.pool.release(req.blocks, req.private)
            req.blocks, req.private = [], 0
            req.finish_reason = "error"
            req._events.put_nowait(exc)
        self.running.clear()
        self.waiting.clear()
        self._note_lora_state()

    def _note_lora_state(self) -> None:
        """Stamp the current ``(running, waiting)`` adapter lists with the wall clock
        (the value of vLLM's ``lora_requests_info``); keep the newest few label sets."""
        if not self.config.loras:
            return
        key = (
            ",".join(sorted({r.lora for r in self.running if r.lora})),
            ",".join(sorted({r.lora for r in self.waiting if r.lora})),
        )
        self.lora_info[key] = time.time()
        self.lora_info.move_to_end(key)
        while len(self.lora_info) > LORA_INFO_HISTORY:
            self.lora_info.popitem(last=False)
