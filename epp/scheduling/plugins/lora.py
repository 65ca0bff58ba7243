"""``lora-affinity-scorer``: prefer endpoints where the request's LoRA adapter is loaded.

GIE's rule, checked in this order for each endpoint (``metrics`` from vLLM's
``vllm:lora_requests_info``):

1. the request's target model is an active adapter there → 1.0
2. the endpoint has a free adapter slot
   (``len(active_loras) + len(waiting_loras) < max_loras``) → 0.8
3. the adapter is already waiting to be loaded there → 0.6
4. otherwise (all slots taken by other adapters) → 0.0

A free slot ranks above "waiting": loading into a free slot starts at once, while a
waiting adapter on a full server waits for a slot. A base-model request (not an adapter)
scores 0.8 wherever a slot is free and 0 elsewhere, so it only steers away from servers
full of adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

SCORE_ACTIVE = 1.0
SCORE_FREE_SLOT = 0.8
SCORE_WAITING = 0.6


class LoraAffinityScorer:
    """Scores endpoints by the LoRA adapter state of the request's target model."""

    type_name = "lora-affinity-scorer"
    consumes = MappingProxyType({fw.DATA_KEY_ACTIVE_MODELS: "map[string]int",
                                 fw.DATA_KEY_WAITING_MODELS: "map[string]int"})
    Parameters = NoParameters

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> LoraAffinityScorer:
        return cls(name)

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        model = request.target_model
        out: list[float] = []
        for e in endpoints:
            m = e.metrics
            if model in m.active_loras:
                out.append(SCORE_ACTIVE)
            elif len(m.active_loras) + len(m.waiting_loras) < m.max_loras:
                out.append(SCORE_FREE_SLOT)
            elif model in m.waiting_loras:
                out.append(SCORE_WAITING)
            else:
                out.append(0.0)
        return out
