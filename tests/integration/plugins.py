"""Python plugins (loaded by import path) that make the EPP's choice observable in tests.

``PinScorer`` scores 1 for the endpoint whose port equals the request header
``x-test-pin`` (0 otherwise, all 1 without the header), so a test knows which endpoint
the EPP chose and can check that this upstream, and only it, saw the request.
``DropAllFilter`` removes every endpoint when ``x-test-drop-all`` is set (→ 429);
``RaiseScorer`` raises when ``x-test-raise`` is set (→ 500).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epp.scheduling.types import CycleState, Endpoint, LLMRequest


class _Base:
    type_name = "test"

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: Any, handle: Any) -> _Base:
        params.done()
        return cls(name)


class PinScorer(_Base):
    """``x-test-pin: P1[,P2…]``: port P1 scores 1, P2 0.5, P3 0.25 …; others 0."""

    type_name = "tests.integration.plugins:PinScorer"

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        pin = request.headers.get("x-test-pin")
        if pin is None:
            return [1.0] * len(endpoints)
        rank = {p.strip(): 0.5 ** i for i, p in enumerate(pin.split(","))}
        return [rank.get(str(e.port), 0.0) for e in endpoints]


class DropAllFilter(_Base):
    type_name = "tests.integration.plugins:DropAllFilter"

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        return [] if "x-test-drop-all" in request.headers else endpoints


class RaiseScorer(_Base):
    type_name = "tests.integration.plugins:RaiseScorer"

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        if "x-test-raise" in request.headers:
            raise RuntimeError("test plugin failure")
        return [0.0] * len(endpoints)


CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: tests.integration.plugins:DropAllFilter
  name: drop-all
- type: tests.integration.plugins:PinScorer
  name: pin
- type: tests.integration.plugins:RaiseScorer
  name: raise
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: drop-all
  - {pluginRef: pin, weight: 10}
  - pluginRef: raise
  - {pluginRef: queue-scorer, weight: 1}
  - pluginRef: max-score-picker
"""

FALLBACK_CONFIG = CONFIG.replace(
    "- type: max-score-picker\n",
    "- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 2}\n")
