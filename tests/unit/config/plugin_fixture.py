"""Helper plugins referenced by import path from test configs
(tests/unit/config/test_loader.py).

``type: tests.unit.config.plugin_fixture:ConstantScorer`` builds :class:`ConstantScorer`
through the registry's import-path mechanism; the other classes exercise its error paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epp.framework.handle import PluginHandle
from epp.framework.params import Params
from epp.scheduling.types import CycleState, Endpoint, LLMRequest, SchedulingResult


class ConstantScorer:
    """Gives every endpoint the same score, read from the ``value`` parameter (0..1)."""

    type_name = "constant-scorer"

    def __init__(self, name: str, value: float) -> None:
        self.name = name
        self.value = value
        self.calls = 0

    @classmethod
    def from_params(cls, name: str, params: Params, handle: PluginHandle) -> ConstantScorer:
        value = params.float("value", 0.5, minimum=0.0, maximum=1.0)
        params.done()
        return cls(name, value)

    def score(self, state: CycleState, request: LLMRequest,
              endpoints: Sequence[Endpoint]) -> Sequence[float]:
        self.calls += 1
        return [self.value] * len(endpoints)


class NoFromParams:
    """A would-be plugin without the ``from_params`` classmethod."""

    type_name = "no-from-params"

    def __init__(self, name: str) -> None:
        self.name = name


class NotAPlugin:
    """``from_params`` returns an object without ``type_name``/``name``."""

    @classmethod
    def from_params(cls, name: str, params: Params, handle: PluginHandle) -> Any:
        params.done()
        return object()


class PreRequestOnly:
    """A valid plugin that is neither filter, scorer nor picker (only a PreRequest hook)."""

    type_name = "pre-request-only"

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[str] = []

    @classmethod
    def from_params(cls, name: str, params: Params, handle: PluginHandle) -> PreRequestOnly:
        params.done()
        return cls(name)

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        self.seen.append(request.request_id)
