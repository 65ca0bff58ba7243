"""gRPC health with GIE v1.5.0's service names and leader-election semantics
(cmd/epp/runner/health.go), plus this EPP's drain; over a real gRPC server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp import keys
from epp.server.health import HealthReporter
from epp.server.listeners import grpc_server
from epp.stack.procs import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
NAMES = (keys.HEALTH_LIVENESS, keys.HEALTH_READINESS, keys.HEALTH_EXT_PROC, "",
         keys.HEALTH_INFERENCE_EXTENSION, "anything-else")


class Harness:
    def __init__(self, leader_election: bool) -> None:
        self.reporter = HealthReporter(leader_election=leader_election)
        self.synced = False
        self.leader = False
        self.reporter.require(lambda: self.synced)
        if leader_election:
            self.reporter.require(lambda: self.leader)
        self.port = free_port()
        self.server = grpc_server(4 << 20)
        health_pb2_grpc.add_HealthServicer_to_server(self.reporter.servicer, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.channel: grpc.aio.Channel | None = None

    @property
    def stub(self) -> Any:
        assert self.channel is not None
        return health_pb2_grpc.HealthStub(self.channel)

    async def check(self, service: str) -> int:
        r = await self.stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return int(r.status)

    async def statuses(self) -> dict[str, int]:
        return {name: await self.check(name) for name in NAMES}


@pytest_asyncio.fixture
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    h = Harness(leader_election=request.param)
    await h.server.start()
    h.channel = grpc.aio.insecure_channel(f"127.0.0.1:{h.port}")
    yield h
    await h.channel.close()
    await h.server.stop(0)


@pytest.mark.parametrize("harness", [False], indirect=True, ids=["no-leader-election"])
async def test_without_leader_election_every_name_follows_readiness(harness: Harness) -> None:
    """GIE answers any service name then, by the pool's sync — so the chart's probe
    service `inference-extension` works; liveness stays SERVING here (a pool that never
    syncs is not ready, rather than restarted)."""
    h = harness
    not_ready = dict.fromkeys(NAMES, NOT_SERVING) | {keys.HEALTH_LIVENESS: SERVING}
    assert await h.statuses() == not_ready
    h.synced = True
    assert await h.statuses() == dict.fromkeys(NAMES, SERVING)
    await h.reporter.start_draining()
    assert await h.statuses() == not_ready


@pytest.mark.parametrize("harness", [True], indirect=True, ids=["leader-election"])
async def test_with_leader_election_only_the_leader_is_ready(harness: Harness) -> None:
    """GIE: readiness, the ext_proc service and "" need sync and the Lease; liveness is
    always SERVING (a standby must not be restarted); other names are SERVICE_UNKNOWN."""
    h = harness
    unknown = {keys.HEALTH_INFERENCE_EXTENSION: UNKNOWN, "anything-else": UNKNOWN}
    standby = {keys.HEALTH_LIVENESS: SERVING, keys.HEALTH_READINESS: NOT_SERVING,
               keys.HEALTH_EXT_PROC: NOT_SERVING, "": NOT_SERVING} | unknown
    h.synced = True
    assert await h.statuses() == standby
    h.leader = True
    leader = dict.fromkeys((keys.HEALTH_LIVENESS, keys.HEALTH_READINESS,
                            keys.HEALTH_EXT_PROC, ""), SERVING) | unknown
    assert await h.statuses() == leader
    await h.reporter.start_draining()
    assert await h.statuses() == standby


@pytest.mark.parametrize("harness, listed", [
    (False, {keys.HEALTH_EXT_PROC}),
    (True, {keys.HEALTH_EXT_PROC, keys.HEALTH_LIVENESS, keys.HEALTH_READINESS}),
], indirect=["harness"], ids=["no-leader-election", "leader-election"])
async def test_list_reports_gies_names(harness: Harness, listed: set[str]) -> None:
    harness.synced = harness.leader = True
    list_request = getattr(health_pb2, "HealthListRequest")  # noqa: B009 - not in the stubs
    r = await harness.stub.List(list_request(), timeout=2)
    assert {name: s.status for name, s in r.statuses.items()} == dict.fromkeys(listed, SERVING)


@pytest.mark.parametrize("harness", [False], indirect=True, ids=["no-leader-election"])
async def test_watch_streams_changes(harness: Harness) -> None:
    h = harness
    call = h.stub.Watch(health_pb2.HealthCheckRequest(service=keys.HEALTH_READINESS))
    assert (await asyncio.wait_for(call.read(), 2)).status == NOT_SERVING
    h.synced = True
    await h.reporter.update()
    assert (await asyncio.wait_for(call.read(), 2)).status == SERVING
    await h.reporter.start_draining()
    assert (await asyncio.wait_for(call.read(), 2)).status == NOT_SERVING
    call.cancel()
