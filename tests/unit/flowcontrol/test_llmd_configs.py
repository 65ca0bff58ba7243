"""llm-d-router v0.10.0's flow-control configs (tests/fixtures/llm-d-router-v0.10.0/) load
and run: each is built with :func:`epp.config.loader.load_and_build`, wired as ``epp
serve`` wires it, and requests go through the Director against fake endpoints, showing
the llm-d plugin's behaviour."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio

from epp.config.loader import load_and_build
from epp.datastore.objectives import Objective
from epp.errors import ConfigError, NoCapacity
from epp.flowcontrol import QueueOutcome
from epp.flowcontrol.llmd import ProgramAwareFairness, SoftReflectiveCeilingPolicy
from epp.handlers.protocol import Routing
from epp.scheduling.plugins.admitters import ProbabilisticAdmitter
from epp.scheduling.plugins.saturation import UtilizationDetector
from epp.scheduling.types import ApiType, LLMRequest, Metrics
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, ServerParts, wire
from tests.polling import eventually

FIXTURES = Path(__file__).parents[2] / "fixtures" / "llm-d-router-v0.10.0"
PROBABILISTIC = FIXTURES / "deploy/config/probabilistic-admitter-epp-config.yaml"
PROGRAM_AWARE = FIXTURES / "deploy/config/sim-program-aware-config.yaml"
SOFT_CEILING = FIXTURES / "deploy/config/soft-reflective-ceiling-epp-config.yaml"
LOADER_TEST = FIXTURES / "test/testdata/configloader_1_test.yaml"

ONE = "10.0.0.1:8000"
H = {":method": "POST", ":path": "/v1/chat/completions"}
BODY = orjson.dumps({"model": "llama", "messages": [{"role": "user", "content": "hi"}]})


def headers(rid: str, objective: str | None = None, fairness: str | None = None) -> dict[str, str]:
    h = {**H, "x-request-id": rid}
    if objective:
        h["x-gateway-inference-objective"] = objective
    if fairness:
        h["x-gateway-inference-fairness-id"] = fairness
    return h


def server(path: Path, endpoints: str = ONE) -> ServerParts:
    timings = PluginTimings()
    built = load_and_build(str(path), timer=timings)
    parts = wire(validate(ServeOptions(static=StaticSourceOptions(endpoints=endpoints))),
                 built, timings, None)
    parts.objectives.replace([Objective("batch", -1), Objective("critical", 10)], [])
    return parts


def scraped(parts: ServerParts, waiting: int = 0, kv: float = 0.0) -> None:
    for ep in parts.store.snapshot():
        parts.store.update_metrics(ep.key, Metrics(waiting_queue_size=waiting,
                                                   kv_cache_usage=kv,
                                                   updated_at=time.monotonic()))


def finish(parts: ServerParts, routing: Routing) -> None:
    d = parts.director
    d.on_response_headers(routing.context, 200, {"content-type": "application/json"})
    d.on_response_body(routing.context, b"{}", True)
    d.on_done(routing.context, aborted=False)


def queued(parts: ServerParts) -> int:
    assert parts.flow_control is not None
    return parts.flow_control.stats().queued


def dispatched(parts: ServerParts) -> int:
    assert parts.flow_control is not None
    return parts.flow_control.stats().outcomes.get(QueueOutcome.DISPATCHED, 0)


@pytest_asyncio.fixture
async def started() -> AsyncIterator[list[ServerParts]]:
    """Flow controllers the test starts; stopped after it."""
    running: list[ServerParts] = []
    yield running
    for parts in running:
        assert parts.flow_control is not None
        await parts.flow_control.stop()


async def start(parts: ServerParts, running: list[ServerParts]) -> ServerParts:
    assert parts.flow_control is not None
    await parts.flow_control.start()
    running.append(parts)
    return parts


# ====================================================================== loading


@pytest.mark.parametrize("path", [PROBABILISTIC, PROGRAM_AWARE, SOFT_CEILING])
def test_config_loads_strictly(path: Path) -> None:
    built = load_and_build(str(path), strict=True)
    assert built.scheduler is not None


def test_probabilistic_config_builds_its_plugins() -> None:
    built = load_and_build(str(PROBABILISTIC))
    admitter = built.plugins["probabilistic-admitter"]
    assert isinstance(admitter, ProbabilisticAdmitter)
    # flowControl.saturationDetector names the neutered utilization-detector.
    detector = built.saturation_detector
    assert isinstance(detector, UtilizationDetector)
    assert detector is built.plugins["utilization-detector"]
    assert (detector.queue_depth_threshold, detector.kv_cache_util_threshold) == (
        999999999, 1.0)
    assert built.flow_control is None  # no flowControl gate: legacy admission + admitter


def test_program_aware_and_ceiling_configs_build_flow_control() -> None:
    built = load_and_build(str(PROGRAM_AWARE))
    assert built.flow_control is not None
    band = built.flow_control.default_priority_band.for_priority(0)
    policy = band.fairness_policy
    assert isinstance(policy, ProgramAwareFairness)
    # Its request-lifecycle hooks are wired too (the usage one by the ext_proc handler).
    assert policy in built.pre_request and policy in built.response_complete
    assert policy in built.response_usage_metadata
    built = load_and_build(str(SOFT_CEILING))
    assert built.flow_control is not None
    assert isinstance(built.flow_control.usage_limit_policy, SoftReflectiveCeilingPolicy)


def test_loader_test_document_names_its_test_only_parts() -> None:
    """llm-d's configloader_1_test.yaml is loader test data that no llm-d v0.10.0 code
    reads: its feature gate and plugin types (``test-one``, …) exist in no binary, and
    ``flowControl.saturationDetector.metricsStalenessThreshold`` is no field of llm-d's
    ``SaturationDetectorConfig`` (only ``pluginRef``), so llm-d's strict decoder
    (``serializer.EnableStrict``) refuses it too. Here each problem is named."""
    with pytest.raises(ConfigError, match="unknown feature gate 'test-feature-gate'"):
        load_and_build(str(LOADER_TEST))
    text = LOADER_TEST.read_text().replace("- test-feature-gate", "- flowControl")
    with pytest.raises(ConfigError, match=r"flowControl\.saturationDetector: unknown "
                       r"key\(s\) 'metricsStalenessThreshold'; allowed: pluginRef"):
        load_and_build(None, text)
    text = text.replace("  saturationDetector:\n    metricsStalenessThreshold: 150ms\n",
                        "  saturationDetector:\n    pluginRef: test-source\n")
    with pytest.raises(ConfigError, match="unknown plugin type 'test-one'"):
        load_and_build(None, text)


# ====================================================================== running


async def test_probabilistic_admitter_sheds_a_share_of_sheddable_requests() -> None:
    parts = server(PROBABILISTIC)
    admitter = parts.built.plugins["probabilistic-admitter"]
    assert isinstance(admitter, ProbabilisticAdmitter)
    admitter.rand = random.Random(7).random
    d = parts.director

    async def shed_share(n: int, objective: str) -> float:
        refused = 0
        for i in range(n):
            try:
                finish(parts, await d.route(headers(f"{objective}{i}", objective),
                                            BODY, True, None))
            except NoCapacity as e:
                assert e.status == 429 and e.message.startswith("probabilistic-admitter")
                refused += 1
        return refused / n

    scraped(parts, kv=0.0)  # idle: nothing shed
    assert await shed_share(50, "batch") == 0.0
    scraped(parts, kv=0.16)  # saturation 0.2 → 9.6 %
    assert await shed_share(600, "batch") == pytest.approx(0.096, abs=0.04)
    assert await shed_share(50, "critical") == 0.0  # never shed
    scraped(parts, kv=0.4)  # saturation 0.5 → every sheddable request
    assert await shed_share(50, "batch") == 1.0
    assert await shed_share(20, "critical") == 0.0


async def test_program_aware_fairness_serves_the_least_served_program(
        started: list[ServerParts]) -> None:
    parts = await start(server(PROGRAM_AWARE), started)
    policy = parts.built.plugins["program-aware-fairness"]
    assert isinstance(policy, ProgramAwareFairness)
    order: list[str] = []
    pre_request = policy.pre_request

    def record(request: Any, result: Any) -> None:
        order.append(request.request_id)
        pre_request(request, result)

    policy.pre_request = record  # type: ignore[method-assign]  # spy on the dispatch order
    d = parts.director

    scraped(parts)  # idle: dispatched at once
    finish(parts, await d.route(headers("warm", fairness="alpha"), BODY, True, None))
    # alpha's response used many tokens (what the ext_proc handler reports at its end).
    policy.usage_metadata(program_request("alpha"), {"prompt_tokens": 4000,
                                                          "completion_tokens": 2000})
    assert policy.programs["alpha"].attained_service == 8000

    scraped(parts, waiting=10)  # saturated: both wait
    a = asyncio.ensure_future(d.route(headers("a1", fairness="alpha"), BODY, True, None))
    await eventually(lambda: queued(parts) == 1)
    b = asyncio.ensure_future(d.route(headers("b1", fairness="beta"), BODY, True, None))
    await eventually(lambda: queued(parts) == 2)
    scraped(parts, waiting=0)  # capacity again: beta, less served, goes first
    for r in await asyncio.wait_for(asyncio.gather(a, b), 5):
        finish(parts, r)
    assert order == ["warm", "b1", "a1"]
    assert dispatched(parts) == 3
    m = policy.programs["beta"]
    assert (m.dispatched, m.in_flight, m.wait_count) == (1, 0, 1)


def program_request(fairness: str) -> LLMRequest:
    """A request of ``fairness``'s program, as the plugin's hooks see it."""
    return LLMRequest(request_id="x", target_model="llama", incoming_model="llama",
                      api=ApiType.CHAT_COMPLETIONS, prompt="", headers={},
                      fairness_id=fairness)


async def test_soft_reflective_ceiling_holds_the_lower_band_back(
        started: list[ServerParts]) -> None:
    parts = await start(server(SOFT_CEILING), started)
    policy = parts.built.plugins["soft-reflective-ceiling-policy"]
    assert isinstance(policy, SoftReflectiveCeilingPolicy)
    d = parts.director

    scraped(parts, kv=0.76)  # saturation 0.95: band 0 open, band 1 open 1 cycle in 19
    critical = await asyncio.wait_for(d.route(headers("c1", "critical"), BODY, True, None), 5)
    assert policy.tick == 0  # one band: no alternation
    batch = asyncio.ensure_future(d.route(headers("b1", "batch"), BODY, True, None))
    await eventually(lambda: policy.tick >= 1)
    assert queued(parts) == 1 and not batch.done()  # held: over its reflective ceiling
    # Critical traffic still goes at once while batch waits.
    finish(parts, await asyncio.wait_for(d.route(headers("c2", "critical"), BODY, True,
                                                 None), 5))
    finish(parts, await asyncio.wait_for(batch, 5))  # … until its open cycle
    assert policy.tick >= 19  # period round(0.95 / 0.05): the first open cycle is 19
    finish(parts, critical)

    scraped(parts, kv=0.8)  # saturation 1: every band held, the highest included
    held = asyncio.ensure_future(d.route(headers("c3", "critical"), BODY, True, None))
    await eventually(lambda: queued(parts) == 1)
    await asyncio.sleep(0.02)
    assert not held.done()
    scraped(parts, kv=0.0)
    finish(parts, await asyncio.wait_for(held, 5))
    assert dispatched(parts) == 4


# llm-d's priority-holdback-policy ships in no v0.10.0 config; its README's example.
HOLDBACK = """\
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: max-score-picker
- type: priority-holdback-policy
  name: my-holdback-policy
  parameters: {shape: linear, domain: rank, minCeiling: 0.4, maxCeiling: 0.9}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
flowControl:
  usageLimitPolicyPluginRef: my-holdback-policy
"""


def test_priority_holdback_requires_min_ceiling() -> None:
    text = HOLDBACK.replace("minCeiling: 0.4, ", "")
    with pytest.raises(ConfigError, match=r"plugins\[2\]\.parameters\.minCeiling: is "
                       "required"):
        load_and_build(None, text)


async def test_priority_holdback_holds_the_lower_band_back(
        started: list[ServerParts], tmp_path: Path) -> None:
    path = tmp_path / "holdback.yaml"
    path.write_text(HOLDBACK)
    parts = await start(server(path), started)
    d = parts.director
    scraped(parts, kv=0.48)  # saturation 0.6: under 0.9 (critical), over 0.4 (batch)
    critical = await asyncio.wait_for(d.route(headers("c1", "critical"), BODY, True, None), 5)
    batch = asyncio.ensure_future(d.route(headers("b1", "batch"), BODY, True, None))
    await eventually(lambda: queued(parts) == 1)
    await asyncio.sleep(0.02)
    assert not batch.done()  # held while saturation >= its ceiling 0.4
    finish(parts, await asyncio.wait_for(d.route(headers("c2", "critical"), BODY, True,
                                                 None), 5))
    scraped(parts, kv=0.24)  # saturation 0.3 < 0.4
    finish(parts, await asyncio.wait_for(batch, 5))
    finish(parts, critical)
    assert dispatched(parts) == 3


def test_flow_control_saturation_detector_wins_over_the_top_level_one() -> None:
    text = """\
plugins:
- {type: utilization-detector, name: top}
- {type: concurrency-detector, name: fc}
- {type: queue-scorer}
saturationDetector: {pluginRef: top}
flowControl:
  saturationDetector: {pluginRef: fc}
"""
    built = load_and_build(None, text)
    assert built.saturation_detector is built.plugins["fc"]
    assert built.flow_control is None and not built.config.warnings
    with pytest.raises(ConfigError, match=r"flowControl\.saturationDetector: unknown "
                       r"key\(s\) 'x'"):
        load_and_build(None, text.replace("{pluginRef: fc}", "{pluginRef: fc, x: 1}"))
    with pytest.raises(ConfigError, match=r"flowControl\.saturationDetector\.pluginRef: "
                       "expected a plugin name"):
        load_and_build(None, text.replace("{pluginRef: fc}", "{pluginRef: [fc]}"))
