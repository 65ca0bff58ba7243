"""The worked user-plugin example of docs/plugins.md: examples/plugins/gpu_temp.py, loaded
by import path from examples/plugins/gpu-temp.yaml through the same registry."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from epp.config.loader import build, load_and_build, parse_config
from epp.errors import ConfigError
from epp.framework.interfaces import Scorer
from epp.scheduling.types import ApiType, CycleState, Endpoint, LLMRequest

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples"
CONFIG = EXAMPLES / "plugins" / "gpu-temp.yaml"
LABEL = "example.com/gpu-temp-celsius"


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    for mod in ("plugins.gpu_temp", "plugins"):
        sys.modules.pop(mod, None)


def ep(i: int, temp: str | None = None, node_temp: str | None = None, queue: int = 0) -> Endpoint:
    from epp.scheduling.types import Metrics

    return Endpoint(name=f"gpu-{i}", address=f"10.0.1.{i}", port=8000,
                    labels={LABEL: temp} if temp is not None else {},
                    node_name="n", node_labels={LABEL: node_temp} if node_temp is not None else {},
                    metrics=Metrics(waiting_queue_size=queue))


def req() -> LLMRequest:
    return LLMRequest("r", "m", "m", ApiType.COMPLETIONS, "hello", {})


def test_example_config_loads_the_plugin_by_import_path() -> None:
    built = load_and_build(path=str(CONFIG))
    plugin = built.plugins["gpu-temp"]
    assert type(plugin).__module__ == "plugins.gpu_temp"
    assert type(plugin).__name__ == "GpuTempScorer"
    assert isinstance(plugin, Scorer)
    assert (plugin.cool, plugin.hot) == (65.0, 85.0)  # type: ignore[attr-defined]
    profile = built.scheduler.profiles["default"]
    assert [(s.name, w) for s, w in profile.scorers] == [
        ("gpu-temp", 1.0), ("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0)]


def test_example_plugin_scoring_rule() -> None:
    built = load_and_build(path=str(CONFIG))
    plugin = built.plugins["gpu-temp"]
    eps = [ep(1, "60"), ep(2, "75"), ep(3, "90"), ep(4), ep(5, node_temp="80"), ep(6, "hot")]
    scores = plugin.score(CycleState(), req(), eps)  # type: ignore[attr-defined]
    # cool 65, hot 85: ≤65 → 1, 75 → 0.5, ≥85 → 0; no label / unreadable → 0.5 (unknownScore)
    assert list(scores) == pytest.approx([1.0, 0.5, 0.0, 0.5, 0.25, 0.5])


def test_example_plugin_steers_the_scheduler() -> None:
    built = load_and_build(path=str(CONFIG))
    cool, hot = ep(1, "50"), ep(2, "95")
    for _ in range(10):
        assert built.scheduler.schedule(req(), [hot, cool]).primary.endpoints[0] is cool


def test_example_plugin_parameters_are_strict() -> None:
    text = textwrap.dedent("""\
        plugins:
        - type: plugins.gpu_temp:GpuTempScorer
          parameters: {coolCelsius: 90, hotCelsius: 80}
        """)
    with pytest.raises(ConfigError, match=r"t\.yaml: plugins\[0\]\.parameters\.hotCelsius: "
                                          r"must be above coolCelsius \(90\), got 80"):
        build(parse_config(text, "t.yaml"))
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.coolCelcius: unknown "
                                          r"parameter"):
        build(parse_config("plugins: [{type: 'plugins.gpu_temp:GpuTempScorer', "
                           "parameters: {coolCelcius: 50}}]\n", "t.yaml"), strict=True)


def test_example_plugin_defaults() -> None:
    built = build(parse_config("plugins: [{type: 'plugins.gpu_temp:GpuTempScorer'}]\n", "t.yaml"))
    p = built.plugins["plugins.gpu_temp:GpuTempScorer"]  # name defaults to type
    assert (p.label, p.cool, p.hot, p.unknown) == (LABEL, 60.0, 85.0, 0.5)  # type: ignore[attr-defined]
