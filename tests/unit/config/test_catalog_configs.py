"""The example configs shipped for the catalog (config/lora.yaml, session.yaml,
prefix-heavy.yaml) build, and route as their comments say."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp import keys
from epp.config.loader import BuiltConfig, load_and_build
from epp.scheduling.plugins.nohit import NoHitLRUScorer
from epp.scheduling.plugins.saturation import UtilizationDetector
from epp.scheduling.plugins.session import session_token
from epp.scheduling.types import ApiType, Endpoint, LLMRequest, Metrics

CONFIG = Path(__file__).resolve().parents[3] / "config"


def load(name: str) -> BuiltConfig:
    return load_and_build(path=str(CONFIG / name))


def req(model: str = "m", prompt: str = "hello", session: str | None = None) -> LLMRequest:
    return LLMRequest("r", model, model, ApiType.CHAT_COMPLETIONS, prompt, {},
                      session_token=session)


@pytest.mark.parametrize("name", ["lora.yaml", "session.yaml", "prefix-heavy.yaml"])
def test_example_configs_build(name: str) -> None:
    built = load(name)
    assert "default" in built.scheduler.profiles


def test_lora_config_prefers_the_loaded_adapter() -> None:
    built = load("lora.yaml")
    eps = [Endpoint(f"p{i}", f"10.0.0.{i}", 8000, metrics=Metrics(
        active_loras=frozenset({"a1", "a2"} if i == 2 else {"x", "y"}), max_loras=2))
        for i in range(1, 4)]
    assert built.scheduler.schedule(req("a2"), eps).primary.endpoints[0] is eps[1]


def test_session_config_sticks_and_sets_the_token() -> None:
    built = load("session.yaml")
    eps = [Endpoint(f"p{i}", f"10.0.0.{i}", 8000, namespace="llm",
                    metrics=Metrics(waiting_queue_size=4 if i == 3 else 0)) for i in range(1, 4)]
    # The session's pod is the busiest by queue but still under the detector's limit.
    r = req(session=session_token(eps[2]))
    res = built.scheduler.schedule(r, eps)
    assert res.primary.endpoints[0] is eps[2]
    for hook in built.pre_request:
        hook.pre_request(r, res)
    headers: dict[str, str] = {}
    for plugin in built.response_headers:
        headers.update(plugin.response_headers(r, eps[2].key, 200, {}) or {})
    assert headers == {keys.HEADER_SESSION_TOKEN: session_token(eps[2])}


def test_prefix_heavy_config_wiring() -> None:
    built = load("prefix-heavy.yaml")
    assert isinstance(built.saturation_detector, UtilizationDetector)
    assert built.scheduler.profiles["default"].filters == (built.saturation_detector,)
    nohit = built.plugins["no-hit-lru-scorer"]
    assert isinstance(nohit, NoHitLRUScorer) and nohit._producer() is not None
