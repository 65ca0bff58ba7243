"""Flow control in ``epp serve``: started and stopped with the server (and by GIE's
deprecated environment switch); with ``--workers N`` (epp/server/workers.py) the
controller lives in the core, a queued decision does not hold up its front's other
frames, a front whose client went away cancels the decision ("X"), and a front that
disconnects cancels all of its queued ones — either way the request leaves its queue at
once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import pytest_asyncio

from epp.config.loader import load_and_build
from epp.flowcontrol import FlowController, QueueOutcome
from epp.requestcontrol.director import SchedulingCore
from epp.scheduling.types import ApiType, LLMRequest
from epp.server import workers
from epp.server.app import EppServer
from epp.server.options import (
    ConfigOptions,
    ListenOptions,
    ObservabilityOptions,
    ScrapingOptions,
    ServeOptions,
    StaticSourceOptions,
    validate,
)
from epp.server.wiring import PluginTimings, ServerParts, wire
from epp.stack.procs import free_port
from tests.polling import eventually

# One endpoint, one request at a time: the second waits in flow control.
CONFIG = """\
featureGates: [flowControl]
plugins:
- {type: concurrency-detector, parameters: {maxConcurrency: 1}}
- type: queue-scorer
- type: max-score-picker
saturationDetector: {pluginRef: concurrency-detector}
"""


class _Writer:
    """Collects the frames the core writes to a front."""

    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.transport = self

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.frames.append(orjson.loads(data[4:]))

    def close(self) -> None:
        pass

    def answers(self) -> list[Any]:
        return [f for f in self.frames if f[0] in ("D", "E")]


def _request(rid: str) -> list[Any]:
    return workers._request_to_wire(LLMRequest(rid, "m", "m", ApiType.CHAT_COMPLETIONS, "hi",
                                               {}, request_size_bytes=10))


@pytest_asyncio.fixture
async def parts() -> AsyncIterator[ServerParts]:
    timings = PluginTimings()
    p = wire(validate(ServeOptions(static=StaticSourceOptions(endpoints="10.0.0.1:8000"))),
             load_and_build(None, CONFIG, timer=timings), timings, None)
    assert p.flow_control is not None
    await p.flow_control.start()
    try:
        yield p
    finally:
        await p.flow_control.stop()


def _fc(core: SchedulingCore) -> FlowController:
    assert core.flow_control is not None
    return core.flow_control


async def test_a_queued_decision_does_not_block_its_front(parts: ServerParts) -> None:
    server = workers.CoreServer(parts.core, lambda outcome: None)
    reader, writer = asyncio.StreamReader(), _Writer()
    task = asyncio.ensure_future(server._serve(reader, writer))  # type: ignore[arg-type]
    reader.feed_data(workers._frame(["R", 1, _request("r1"), None]))
    await eventually(lambda: writer.answers())
    first = writer.answers()[0]
    assert first[:3] == ["D", 1, "10.0.0.1:8000"]
    reader.feed_data(workers._frame(["R", 2, _request("r2"), None]))
    await eventually(lambda: _fc(parts.core).stats().queued == 1)
    # The front's next frame (r1's completion) is read while r2 waits: r2 is dispatched.
    reader.feed_data(workers._frame(["C", first[5], 200, False, None, None]))
    await eventually(lambda: len(writer.answers()) == 2)
    assert writer.answers()[1][:3] == ["D", 2, "10.0.0.1:8000"]
    reader.feed_eof()
    await task


async def test_cancel_frame_removes_the_queued_request(parts: ServerParts) -> None:
    server = workers.CoreServer(parts.core, lambda outcome: None)
    reader, writer = asyncio.StreamReader(), _Writer()
    task = asyncio.ensure_future(server._serve(reader, writer))  # type: ignore[arg-type]
    reader.feed_data(workers._frame(["R", 1, _request("r1"), None]))
    reader.feed_data(workers._frame(["R", 2, _request("r2"), None]))
    fc = _fc(parts.core)
    await eventually(lambda: fc.stats().queued == 1)
    reader.feed_data(workers._frame(["X", 2]))
    await eventually(lambda: fc.stats().queued == 0)
    assert fc.stats().outcomes[QueueOutcome.EVICTED_CONTEXT_CANCELLED] == 1
    assert [a[1] for a in writer.answers()] == [1]  # nothing sent for the cancelled one
    reader.feed_data(workers._frame(["X", 7]))  # unknown or answered already: ignored
    reader.feed_eof()
    await task


async def test_a_front_that_goes_away_cancels_its_queued_requests(parts: ServerParts) -> None:
    server = workers.CoreServer(parts.core, lambda outcome: None)
    reader, writer = asyncio.StreamReader(), _Writer()
    task = asyncio.ensure_future(server._serve(reader, writer))  # type: ignore[arg-type]
    reader.feed_data(workers._frame(["R", 1, _request("r1"), None]))
    for i in range(2, 5):
        reader.feed_data(workers._frame(["R", i, _request(f"r{i}"), None]))
    fc = _fc(parts.core)
    await eventually(lambda: fc.stats().queued == 3)
    reader.feed_eof()  # the front's connection dropped
    await task
    await eventually(lambda: fc.stats().queued == 0)
    stats = fc.stats()
    assert stats.outcomes[QueueOutcome.EVICTED_CONTEXT_CANCELLED] == 3
    # r1 was completed as aborted: its in-flight slot is free again.
    assert parts.core.saturation is not None and parts.core.saturation(None) == 0.0


async def test_the_front_sends_a_cancel_frame_when_its_client_goes() -> None:
    reader = asyncio.StreamReader()
    writer: Any = _Writer()
    core = workers.RemoteCore(reader, writer)
    decide = asyncio.ensure_future(core.decide(LLMRequest(
        "r1", "m", "m", ApiType.CHAT_COMPLETIONS, "hi", {}), None))
    await eventually(lambda: writer.frames)
    assert writer.frames[0][:2] == ["R", 1]
    decide.cancel()
    with pytest.raises(asyncio.CancelledError):
        await decide
    assert writer.frames[-1] == ["X", 1]
    # A decision that crosses the cancellation is handed back as aborted.
    reader.feed_data(workers._frame(["D", 1, "10.0.0.1:8000", {}, {}, 5]))
    await eventually(lambda: writer.frames[-1][0] == "C")
    assert writer.frames[-1][:4] == ["C", 5, 0, True]
    reader.feed_eof()
    await core.closed.wait()


# ------------------------------------------------------------------------- the server

def _options(config: str | None) -> ServeOptions:
    return ServeOptions(
        listen=ListenOptions(grpc_port=free_port(), grpc_health_port=free_port(),
                             metrics_port=free_port(), bind_address="127.0.0.1"),
        config=ConfigOptions(text=config),
        static=StaticSourceOptions(endpoints="10.0.0.1:8000"),
        observability=ObservabilityOptions(tracing=False, metrics_auth="false"),
        scraping=ScrapingOptions(enabled=False))


async def test_the_server_starts_and_stops_flow_control() -> None:
    server = EppServer(_options(CONFIG))
    await server.start()
    fc = server.parts.flow_control
    try:
        assert fc is not None and fc.running
        assert server.parts.core.flow_control is fc
    finally:
        await server.stop(0)
    assert not fc.running


async def test_the_deprecated_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER", "true")
    server = EppServer(_options(None))
    await server.start()
    try:
        assert server.parts.flow_control is not None and server.parts.flow_control.running
        assert any("ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER" in w and "deprecated" in w
                   for w in server.parts.built.warnings)
    finally:
        await server.stop(0)
    monkeypatch.setenv("ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER", "false")
    server = EppServer(_options(None))
    await server.start()
    try:
        assert server.parts.flow_control is None
    finally:
        await server.stop(0)
