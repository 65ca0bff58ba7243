"""``topology-affinity-scorer``: pair prefill pods close to the decode pod already chosen.

Levels, strongest first; a level is one label key or several joined with ``+`` that must
all be present and equal on both endpoints. Keys are looked up in the pod's labels, then
in its node's labels. Default levels (Grove, then node topology):

1. ``grove.io/podcliquescalinggroup+grove.io/podcliquescalinggroup-replica-index``
2. ``grove.io/podgang``
3. ``app.kubernetes.io/part-of+grove.io/podcliqueset-replica-index``
4. ``topology.kubernetes.io/rack``
5. ``topology.kubernetes.io/block``
6. ``topology.kubernetes.io/zone``

Score of a candidate = (L − i) / L for the strongest level *i* (0-based) it shares with the
decode endpoint, 0 when it shares none (L = number of levels). Weighted against load
scorers, a hot rack spills over. ``mode: required`` also makes it a filter: candidates
sharing no level are dropped (the profile fails if none is left, and the handler falls
back to decode-only). Without a decode endpoint in the cycle (aggregated serving) every
candidate scores 0 and nothing is filtered.

**llm-d's scoring** (llm-d-router v0.10.0 ``scheduling/scorer/topologyaffinity``): with
``topologyProducerName`` set, or with neither ``levels`` nor ``mode`` set while the config
declares a ``topology-extractor`` (llm-d's shipped configs), the scorer reads the
extractor's topology instead of label levels and scores llm-d's tiers against the decode
endpoint: same host 1.0, rack 0.2, zone 0.05, region 0.02, none 0 (a candidate or peer
without topology scores 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epp import keys
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import config_warning, param
from epp.scheduling.plugins.pd import DECODE_ENDPOINT_KEY
from epp.scheduling.plugins.topology_llmd import (
    TOPOLOGY_EXTRACTOR,
    Level,
    TopologyExtractor,
    compare,
)
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

DEFAULT_LEVELS: tuple[str, ...] = (
    f"{keys.LABEL_GROVE_PCSG}+{keys.LABEL_GROVE_PCSG_REPLICA}",
    keys.LABEL_GROVE_PODGANG,
    f"{keys.LABEL_PART_OF}+{keys.LABEL_GROVE_PCS_REPLICA}",
    keys.LABEL_RACK,
    keys.LABEL_BLOCK,
    keys.LABEL_ZONE,
)


def _value(e: Endpoint, key: str) -> str | None:
    v = e.labels.get(key)
    return v if v is not None else e.node_labels.get(key)


def shared_level(a: Endpoint, b: Endpoint, levels: Sequence[tuple[str, ...]]) -> int | None:
    """Index of the strongest level ``a`` and ``b`` share, or None."""
    for i, level in enumerate(levels):
        ok = True
        for k in level:
            va = _value(a, k)
            if va is None or va != _value(b, k):
                ok = False
                break
        if ok:
            return i
    return None


def _levels(raw: Any, path: str) -> tuple[str, ...]:
    if (not isinstance(raw, list) or not raw
            or not all(isinstance(x, str) and x.strip() for x in raw)):
        raise ConfigError(f"{path}: expected a non-empty list of label keys (strongest first; "
                          "join keys that must all match with '+')")
    return tuple(raw)


def _mode(raw: Any, path: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(f"{path}: expected a string, got {raw!r}")
    if raw not in ("preferred", "required"):
        raise ConfigError(f"{path}: expected 'preferred' or 'required', got {raw!r}")
    return str(raw)


#: llm-d's ``levelScores``.
LLMD_LEVEL_SCORES: dict[Level, float] = {
    Level.HOST: 1.0, Level.RACK: 0.2, Level.ZONE: 0.05, Level.REGION: 0.02, Level.NONE: 0.0}


@dataclass(frozen=True)
class TopologyAffinityParameters:
    levels: tuple[str, ...] | None = param("levels", None, parse=_levels)
    mode: str | None = param("mode", None, parse=_mode)
    topology_producer_name: str = param("topologyProducerName", "")


class TopologyAffinityScorer:
    type_name = "topology-affinity-scorer"
    Parameters = TopologyAffinityParameters

    def __init__(self, name: str, levels: Sequence[str] = DEFAULT_LEVELS,
                 required: bool = False, producer_name: str = "",
                 label_levels_set: bool = True) -> None:
        self.name = name
        self.levels = tuple(tuple(k.strip() for k in lvl.split("+")) for lvl in levels)
        self.required = required
        self.producer_name = producer_name
        self._label_levels_set = label_levels_set
        self.extractor: TopologyExtractor | None = None

    @classmethod
    def from_params(cls, name: str, params: TopologyAffinityParameters,
                    handle: PluginHandle) -> TopologyAffinityScorer:
        if params.topology_producer_name and (params.levels or params.mode):
            raise ConfigError(f"{name}: topologyProducerName (llm-d's scoring) cannot be "
                              "combined with levels or mode (this project's label levels)")
        return cls(name, params.levels or DEFAULT_LEVELS, params.mode == "required",
                   params.topology_producer_name,
                   label_levels_set=params.levels is not None or params.mode is not None)

    def bind(self, handle: PluginHandle) -> None:
        """llm-d's scoring when a topology-extractor is named, or declared and no label
        levels are configured (module doc)."""
        if self.producer_name:
            self.extractor = handle.named(self.producer_name, TopologyExtractor)
            if self.extractor is None:
                config_warning(self.name, f"no {TOPOLOGY_EXTRACTOR} named "
                               f"{self.producer_name!r}: every candidate scores 0")
        elif not self._label_levels_set:
            self.extractor = handle.named(TOPOLOGY_EXTRACTOR, TopologyExtractor)

    def _levels_of(self, state: CycleState, endpoints: Sequence[Endpoint]) -> list[int | None] | None:
        decode = state.get(DECODE_ENDPOINT_KEY)
        if not isinstance(decode, Endpoint):
            return None
        return [shared_level(decode, e, self.levels) for e in endpoints]

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        if self.extractor is not None or self.producer_name:
            return self._llmd_scores(state, endpoints)
        lv = self._levels_of(state, endpoints)
        if lv is None:
            return [0.0] * len(endpoints)
        n = len(self.levels)
        return [0.0 if i is None else (n - i) / n for i in lv]

    def _llmd_scores(self, state: CycleState,
                     endpoints: Sequence[Endpoint]) -> Sequence[float]:
        ext = self.extractor
        peer_ep = state.get(DECODE_ENDPOINT_KEY)
        peer = (ext.topology(peer_ep)
                if ext is not None and isinstance(peer_ep, Endpoint) else None)
        if ext is None or peer is None:
            return [0.0] * len(endpoints)
        return [LLMD_LEVEL_SCORES[compare(peer, ext.topology(e))] for e in endpoints]

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        if not self.required:
            return endpoints
        lv = self._levels_of(state, endpoints)
        if lv is None:
            return endpoints
        return [e for e, i in zip(endpoints, lv) if i is not None]
