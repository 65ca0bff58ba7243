"""llm-d-router v0.10.0's flow-control policy plugins, for its configs to load and run
(pkg/epp/framework/plugins/flowcontrol/{fairness/program-aware,
usagelimits/softreflectiveceiling, usagelimits/priorityholdback}).

==================================  ==========================  ===========================
type                                parameters                  behaviour
==================================  ==========================  ===========================
``soft-reflective-ceiling-policy``  none                        band *i* of *N* (highest
                                                                first) opens while
                                                                ``sat < 1 - i*sat/(N-1)``;
                                                                past that, gated bands open
                                                                together once every
                                                                ``round(sat/(1-sat))``
                                                                cycles; at ``sat >= 1`` shut
``priority-holdback-policy``        ``minCeiling`` (required),  ceilings from ``maxCeiling``
                                    ``maxCeiling`` (1.0),       (highest band) down to
                                    ``domain`` (rank),          ``minCeiling`` (lowest), by
                                    ``shape`` (linear)          rank or by priority value
``program-aware-fairness``          ``strategy`` (las), …       the flow (program) with the
                                                                least attained service
                                                                (decayed weighted tokens),
                                                                head wait as tiebreaker
==================================  ==========================  ===========================

The usage-limit policies plug into ``flowControl.usageLimitPolicyPluginRef``; the
fairness policy into a band's ``fairnessPolicyRef``. docs/flow-control.md, "llm-d's
flow-control plugins".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from epp.flowcontrol.eviction import EVICTION_PLUGINS
from epp.flowcontrol.interfaces import FlowQueueView, PriorityBandView
from epp.flowcontrol.types import DEFAULT_FAIRNESS_ID
from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters, ParameterError, param
from epp.scheduling.types import LLMRequest, SchedulingResult

Clock = Callable[[], float]

# ------------------------------------------------------------- soft reflective ceiling


class SoftReflectiveCeilingPolicy:
    """``soft-reflective-ceiling-policy`` (llm-d usagelimits/softreflectiveceiling): the
    highest band's ceiling is 1.0; band ``i`` of ``N`` is open (1.0) while saturation is
    under its reflective ceiling ``1 - i*sat/(N-1)``, shut (0.0) at ``sat >= 1``, and in
    between alternates: every gated band opens on one cycle in
    ``period = round(sat/(1-sat))``, counted by one policy-wide tick (so on any cycle
    either every gated band is open or none is: the dispatch loop stops at the first
    gated band). The tick advances only on cycles where some band alternates."""

    type_name = "soft-reflective-ceiling-policy"
    Parameters = NoParameters

    def __init__(self, name: str = type_name) -> None:
        self.name = name
        self.tick = 0

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> SoftReflectiveCeilingPolicy:
        return cls(name)

    def compute_limit(self, saturation: float, priorities: Sequence[int]) -> Sequence[float]:
        n = len(priorities)
        if n == 0:
            return []
        if n == 1:
            return [1.0]
        # The lowest band's reflective ceiling is 1 - sat: some band alternates iff it
        # is reached (and the pool is not saturated).
        opened = False
        if 1.0 - saturation <= saturation < 1.0:
            # 1e-9: round-off guard near saturation 1.0 (llm-d's).
            period = int(max(1.0, _round_half_away(saturation / (1.0 - saturation + 1e-9))))
            self.tick += 1
            opened = self.tick % period == 0
        ceilings = [1.0]
        for i in range(1, n):
            reflective = 1.0 - i * saturation / (n - 1)
            if saturation < reflective:
                ceilings.append(1.0)
            elif saturation >= 1.0:
                ceilings.append(0.0)
            else:
                ceilings.append(1.0 if opened else 0.0)
        return ceilings


def _round_half_away(x: float) -> float:
    """Go's ``math.Round``: half away from zero (Python's ``round`` is half to even)."""
    return math.floor(x + 0.5) if x >= 0 else -math.floor(-x + 0.5)


# ----------------------------------------------------------------- priority holdback

SHAPE_LINEAR: Final = "linear"
DOMAIN_RANK: Final = "rank"
DOMAIN_VALUE: Final = "value"


@dataclass(frozen=True)
class PriorityHoldbackParameters:
    shape: str = param("shape", SHAPE_LINEAR)
    domain: str = param("domain", DOMAIN_RANK)
    min_ceiling: float | None = param("minCeiling", None)
    max_ceiling: float = param("maxCeiling", 1.0)

    def __post_init__(self) -> None:
        # minCeiling's presence is checked by from_params (every built-in's parameters
        # decode from an empty block).
        if self.shape != SHAPE_LINEAR:
            raise ParameterError("shape", f"unsupported shape {self.shape!r}, "
                                 f"must be {SHAPE_LINEAR!r}")
        if self.domain not in (DOMAIN_RANK, DOMAIN_VALUE):
            raise ParameterError("domain", f"unsupported domain {self.domain!r}, must be "
                                 f"one of: {DOMAIN_RANK!r}, {DOMAIN_VALUE!r}")
        if self.min_ceiling is None:
            return
        if not 0.0 <= self.min_ceiling < 1.0:
            raise ParameterError("minCeiling",
                                 f"must be in [0.0, 1.0), got {self.min_ceiling:g}")
        if not 0.0 < self.max_ceiling <= 1.0:
            raise ParameterError("maxCeiling",
                                 f"must be in (0.0, 1.0], got {self.max_ceiling:g}")
        if self.min_ceiling >= self.max_ceiling:
            raise ParameterError("minCeiling", f"({self.min_ceiling:g}) must be strictly "
                                 f"less than maxCeiling ({self.max_ceiling:g})")


class PriorityHoldbackPolicy:
    """``priority-holdback-policy`` (llm-d usagelimits/priorityholdback): ceilings from
    ``maxCeiling`` for the highest band to ``minCeiling`` for the lowest, linear by rank
    (``domain: rank``: ``c_i = max - i*(max-min)/(N-1)``) or by priority value
    (``domain: value``: ``c_i = min + (p_i-pMin)/(pMax-pMin)*(max-min)``; all equal:
    ``max``). One band: ``maxCeiling``."""

    type_name = "priority-holdback-policy"
    Parameters = PriorityHoldbackParameters

    def __init__(self, name: str = type_name, min_ceiling: float = 0.0,
                 max_ceiling: float = 1.0, domain: str = DOMAIN_RANK) -> None:
        self.name = name
        self.min_ceiling = min_ceiling
        self.max_ceiling = max_ceiling
        self.domain = domain

    @classmethod
    def from_params(cls, name: str, params: PriorityHoldbackParameters,
                    handle: PluginHandle) -> PriorityHoldbackPolicy:
        if params.min_ceiling is None:
            raise ParameterError("minCeiling", "is required (the ceiling of the lowest "
                                 "priority, in [0.0, 1.0)); there is no default")
        return cls(name, params.min_ceiling, params.max_ceiling, params.domain)

    def compute_limit(self, saturation: float, priorities: Sequence[int]) -> Sequence[float]:
        n = len(priorities)
        if n == 0:
            return []
        c_min, c_max = self.min_ceiling, self.max_ceiling
        if n == 1:
            return [c_max]
        spread = c_max - c_min
        if self.domain == DOMAIN_RANK:
            return [c_max - i * spread / (n - 1) for i in range(n)]
        p_max, p_min = float(priorities[0]), float(priorities[-1])
        if p_max == p_min:
            return [c_max] * n
        return [c_min + (p - p_min) / (p_max - p_min) * spread for p in priorities]


# ------------------------------------------------------------ program-aware fairness

#: Output tokens cost twice input tokens (llm-d's weightInputToken / weightOutputToken).
WEIGHT_INPUT_TOKEN: Final = 1
WEIGHT_OUTPUT_TOKEN: Final = 2
STRATEGY_LAS: Final = "las"
#: At most this many dispatched-but-not-yet-scheduled enqueue times are kept (a request
#: flow control dispatched but that never reached PreRequest leaves one behind).
_MAX_PENDING_ENQUEUE_TIMES: Final = 65536


@dataclass(frozen=True)
class ProgramAwareParameters:
    strategy: str = param("strategy", STRATEGY_LAS)
    eviction_ttl_seconds: float = param("evictionTtlSeconds", 3600.0, minimum=0.0)
    eviction_sweep_seconds: float = param("evictionSweepSeconds", 300.0)
    las_weight_service: float = param("lasWeightService", 0.8, minimum=0.0)
    las_weight_head_wait: float = param("lasWeightHeadWait", 0.2, minimum=0.0)
    las_decay_factor: float = param("lasDecayFactor", 0.99997)
    las_half_life_seconds: float = param("lasHalfLifeSeconds", 0.0, minimum=0.0)

    def __post_init__(self) -> None:
        if self.eviction_sweep_seconds <= 0:
            raise ParameterError("evictionSweepSeconds",
                                 f"must be > 0, got {self.eviction_sweep_seconds:g}")
        if not 0.0 < self.las_decay_factor <= 1.0:
            raise ParameterError("lasDecayFactor",
                                 f"must be in (0, 1], got {self.las_decay_factor:g}")
        if self.strategy not in ("", STRATEGY_LAS):
            raise ParameterError("strategy", f"unknown scoring strategy {self.strategy!r}: "
                                 f"only {STRATEGY_LAS!r} is supported")


class ProgramMetrics:
    """One program's lifecycle counters (llm-d's ProgramMetrics); times in seconds of the
    policy's clock, waits in milliseconds."""

    __slots__ = ("attained_service", "average_wait_ms", "decay_anchor", "dispatched",
                 "in_flight", "last_completion", "reported_service", "wait_count")

    def __init__(self, now: float) -> None:
        self.average_wait_ms = 0.0
        self.wait_count = 0
        # Seeded so that a program seen but never completing still becomes evictable.
        self.last_completion = now
        self.dispatched = 0
        self.in_flight = 0
        # LAS: weighted tokens served, decayed while the program is idle.
        self.attained_service = 0.0
        self.decay_anchor: float | None = None
        # llm_d_epp_program_aware_attained_service_tokens: the service as of the last
        # completed response (llm-d sets its gauge there; None: none yet).
        self.reported_service: float | None = None

    def record_dispatched(self, wait_ms: float | None) -> None:
        self.in_flight += 1
        self.dispatched += 1
        if wait_ms is None:
            return
        self.wait_count += 1
        self.average_wait_ms += (wait_ms - self.average_wait_ms) / self.wait_count

    def record_completion(self, now: float) -> None:
        self.in_flight -= 1
        self.last_completion = now

    def decay(self, now: float, half_life: float, factor: float) -> None:
        if half_life > 0:
            if self.decay_anchor is None:
                self.decay_anchor = now
                return
            elapsed = now - self.decay_anchor
            if elapsed <= 0:
                return
            self.attained_service *= 0.5 ** (elapsed / half_life)
            self.decay_anchor = now
            return
        self.attained_service *= factor


def jain_fairness_index(values: Sequence[float]) -> float:
    """Jain's index ``(Σx)² / (n·Σx²)``; 1.0 with fewer than two values or all zero."""
    n = len(values)
    sum_sq = sum(x * x for x in values)
    if n <= 1 or sum_sq == 0:
        return 1.0
    return sum(values) ** 2 / (n * sum_sq)


def _range_normalize(v: float, lo: float, hi: float) -> float:
    return 0.5 if hi == lo else (v - lo) / (hi - lo)


class ProgramAwareFairness:
    """``program-aware-fairness`` (llm-d fairness/program-aware, strategy ``las``): a
    program is a fairness ID (a flow); each pick scores every non-empty flow of the band
    by ``lasWeightService · (1 − norm(attained service)) + lasWeightHeadWait ·
    norm(head wait ms)`` (min–max normalised over the non-empty flows, 0.5 when all are
    equal) and serves the best (ties: the first flow ID). Attained service is
    ``prompt tokens + 2 · completion tokens`` of each completed response; an empty flow
    with nothing in flight decays it (per pick by ``lasDecayFactor``, or by wall-clock
    half-life ``lasHalfLifeSeconds`` when > 0). Programs with nothing in flight and no
    completion for ``evictionTtlSeconds`` are forgotten (swept every
    ``evictionSweepSeconds``; 0 TTL: never).

    Also a PreRequest plugin (records the dispatched request's queue wait), a
    ResponseComplete plugin (in-flight count, last completion) and a
    ResponseUsageMetadata plugin (attained service from the response's ``usage``,
    returning no metadata); the usage needs the response body (``response_needs``)."""

    type_name = "program-aware-fairness"
    Parameters = ProgramAwareParameters
    response_needs = frozenset({"body"})

    def __init__(self, name: str = type_name,
                 params: ProgramAwareParameters | None = None,
                 clock: Clock = time.monotonic) -> None:
        p = params or ProgramAwareParameters()
        self.name = name
        self.weight_service = p.las_weight_service
        self.weight_head_wait = p.las_weight_head_wait
        self.decay_factor = p.las_decay_factor
        self.half_life = p.las_half_life_seconds
        self.eviction_ttl = p.eviction_ttl_seconds
        self.eviction_sweep = p.eviction_sweep_seconds
        self.clock = clock
        self.programs: dict[str, ProgramMetrics] = {}
        # request ID → enqueue time of the head a pick chose (llm-d stashes it on the
        # request as an attribute); read back by pre_request.
        self._enqueued: dict[str, float] = {}
        self._last_sweep = clock()
        self.fairness_index = 1.0

    @classmethod
    def from_params(cls, name: str, params: ProgramAwareParameters,
                    handle: PluginHandle) -> ProgramAwareFairness:
        return cls(name, params)

    def metrics(self, program_id: str) -> ProgramMetrics:
        m = self.programs.get(program_id)
        if m is None:
            m = self.programs[program_id] = ProgramMetrics(self.clock())
        return m

    # ---------------------------------------------------------------- fairness policy

    def new_state(self) -> None:
        return None

    def pick(self, band: PriorityBandView) -> FlowQueueView | None:
        now = self.clock()
        self._maybe_sweep(now)
        scored: list[tuple[FlowQueueView, float, float]] = []
        for flow_id in band.flow_ids():
            queue = band.queue(flow_id)
            if queue is None:
                continue
            m = self.metrics(flow_id)
            if not len(queue):
                if m.in_flight == 0:  # keep the service a completion is about to add
                    m.decay(now, self.half_life, self.decay_factor)
                continue
            head = queue.peek_head()
            wait_ms = 0.0 if head is None else float(int((now - head.enqueue_time) * 1000))
            scored.append((queue, m.attained_service, wait_ms))
        if not scored:
            return None
        s_lo = min(s for _, s, _ in scored)
        s_hi = max(s for _, s, _ in scored)
        w_lo = min(w for _, _, w in scored)
        w_hi = max(w for _, _, w in scored)
        best: FlowQueueView | None = None
        best_score = -math.inf
        for queue, service, wait_ms in scored:
            score = (self.weight_service * (1.0 - _range_normalize(service, s_lo, s_hi))
                     + self.weight_head_wait * _range_normalize(wait_ms, w_lo, w_hi))
            if score > best_score:
                best, best_score = queue, score
        if best is not None:
            head = best.peek_head()
            if head is not None and head.request.request_id:
                if len(self._enqueued) >= _MAX_PENDING_ENQUEUE_TIMES:
                    self._enqueued.pop(next(iter(self._enqueued)))
                self._enqueued[head.request.request_id] = head.enqueue_time
        self.fairness_index = self._fairness_index()
        return best

    # ------------------------------------------------------------- request lifecycle

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        m = self.metrics(request.fairness_id or DEFAULT_FAIRNESS_ID)
        enqueued = self._enqueued.pop(request.request_id, None)
        wait_ms = None if enqueued is None else float(int((self.clock() - enqueued) * 1000))
        m.record_dispatched(wait_ms)

    def response_complete(self, request: LLMRequest, endpoint_key: str,
                          aborted: bool) -> None:
        m = self.programs.get(request.fairness_id or DEFAULT_FAIRNESS_ID)
        if m is not None and m.in_flight > 0:
            m.record_completion(self.clock())

    def usage_metadata(self, request: LLMRequest,
                       usage: Mapping[str, Any]) -> Mapping[str, Mapping[str, float]] | None:
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        cost = (WEIGHT_INPUT_TOKEN * (prompt if isinstance(prompt, int) else 0)
                + WEIGHT_OUTPUT_TOKEN * (completion if isinstance(completion, int) else 0))
        m = self.metrics(request.fairness_id or DEFAULT_FAIRNESS_ID)
        m.attained_service += cost
        m.decay_anchor = self.clock()
        m.reported_service = m.attained_service
        return None

    # -------------------------------------------------------------------- upkeep

    def _fairness_index(self) -> float:
        return jain_fairness_index(
            [m.average_wait_ms for m in self.programs.values() if m.wait_count > 0])

    def _maybe_sweep(self, now: float) -> None:
        if self.eviction_ttl <= 0 or now - self._last_sweep < self.eviction_sweep:
            return
        self._last_sweep = now
        self.evict_idle(now)

    def evict_idle(self, now: float) -> None:
        """Forget the programs with nothing in flight and no completion for the TTL."""
        for pid in [pid for pid, m in self.programs.items()
                    if m.in_flight == 0 and now - m.last_completion > self.eviction_ttl]:
            del self.programs[pid]


#: llm-d's flow-control plugin classes, for the built-in catalog.
LLMD_FLOW_CONTROL_PLUGINS: tuple[type, ...] = (
    SoftReflectiveCeilingPolicy,
    PriorityHoldbackPolicy,
    ProgramAwareFairness,
    *EVICTION_PLUGINS,  # sheddable-eviction-filter, priority-then-time-… (eviction.py)
)
