"""Leader election on a Lease, against the fake API server (short timings)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

from epp.discovery.kubeclient import KubeApi
from epp.errors import ConfigError
from epp.server.leader import LeaderElectionOptions, LeaderElector, default_identity, lease_name
from tests.k8s_fake import FakeApiServer
from tests.polling import eventually

LEASE = lease_name("default", "pool")


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer(bookmark_interval_s=0)
    await server.start()
    yield server
    await server.stop()


@pytest_asyncio.fixture
async def electors(api: KubeApi) -> AsyncIterator[Callable[..., LeaderElector]]:
    made: list[LeaderElector] = []

    def make(identity: str, *, release: bool = True, lease_s: float = 1.0,
             renew_s: float = 0.6, retry_s: float = 0.1) -> LeaderElector:
        e = LeaderElector(api, LeaderElectionOptions(
            namespace="default", name=LEASE, identity=identity, lease_duration_s=lease_s,
            renew_deadline_s=renew_s, retry_period_s=retry_s, release_on_stop=release))
        made.append(e)
        e.start()
        return e

    yield make
    for e in made:
        await e.stop()


def holder(fake: FakeApiServer) -> str | None:
    lease = fake.get("leases", LEASE)
    return None if lease is None else lease["spec"].get("holderIdentity")


def test_names_and_options() -> None:
    assert LEASE == "epp-default-pool.gateway-api-inference-extension.sigs.k8s.io"
    a, b = default_identity(), default_identity()
    assert a != b and "_" in a
    with pytest.raises(ConfigError):
        LeaderElectionOptions("ns", "l", "me", lease_duration_s=5, renew_deadline_s=5)
    with pytest.raises(ConfigError):
        LeaderElectionOptions("ns", "l", "me", retry_period_s=10)


async def test_one_leader_among_contenders_and_release_on_stop(
        fake: FakeApiServer, electors: Callable[..., LeaderElector]) -> None:
    es = [electors(f"epp-{i}") for i in range(3)]
    await eventually(lambda: sum(e.is_leader for e in es) == 1)
    # Not a wait: several renew rounds pass, and there is still exactly one leader, the same.
    await asyncio.sleep(0.5)
    leaders = [e for e in es if e.is_leader]
    assert len(leaders) == 1 and holder(fake) == leaders[0].options.identity
    lease = fake.get("leases", LEASE)
    assert lease is not None and lease["spec"]["leaseDurationSeconds"] == 1
    assert lease["spec"]["leaseTransitions"] == 0
    old = leaders[0]
    t0 = asyncio.get_running_loop().time()
    await old.stop()  # graceful: releases the Lease
    assert not old.is_leader
    await eventually(lambda: sum(e.is_leader for e in es) == 1)
    # Released: taken at the next retry, well before the 1 s lease would lapse.
    assert asyncio.get_running_loop().time() - t0 < 0.9
    new = next(e for e in es if e.is_leader)
    assert new is not old and holder(fake) == new.options.identity
    assert fake.get("leases", LEASE)["spec"]["leaseTransitions"] == 1  # type: ignore[index]


async def test_failover_when_the_leader_vanishes_without_release(
        fake: FakeApiServer, electors: Callable[..., LeaderElector]) -> None:
    a = electors("a", release=False)
    await eventually(lambda: a.is_leader)
    b = electors("b")
    await asyncio.sleep(0.3)  # not a wait: b keeps retrying, and must not take a held Lease
    assert not b.is_leader
    t0 = asyncio.get_running_loop().time()
    await a.stop()  # crash-like: no release, the Lease must lapse first
    await eventually(lambda: b.is_leader, timeout=5)
    waited = asyncio.get_running_loop().time() - t0
    assert 0.7 < waited < 2.5, waited  # ~ the 1 s lease duration (+ retry jitter)
    assert holder(fake) == "b"


async def test_leader_steps_down_when_it_cannot_renew(
        fake: FakeApiServer, electors: Callable[..., LeaderElector]) -> None:
    a = electors("a")
    await eventually(lambda: a.is_leader)
    prefix = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
    fake.fail_next(prefix, 503, times=10_000)  # API server unhealthy for leases
    t0 = asyncio.get_running_loop().time()
    await eventually(lambda: not a.is_leader, timeout=3)
    # Within the renew deadline (0.6 s) plus one retry, before the 1 s lease lapses.
    assert asyncio.get_running_loop().time() - t0 < 1.0
    fake.clear_failures()
    await eventually(lambda: a.is_leader, timeout=3)  # recovers and re-acquires


async def test_leader_steps_down_when_the_lease_is_taken(
        fake: FakeApiServer, electors: Callable[..., LeaderElector]) -> None:
    a = electors("a", lease_s=5.0, renew_s=3.0, retry_s=0.1)
    await eventually(lambda: a.is_leader)
    lease = fake.get("leases", LEASE)
    assert lease is not None
    lease["spec"]["holderIdentity"] = "intruder"  # e.g. an operator forcing a failover
    fake.put("leases", lease)
    await eventually(lambda: not a.is_leader, timeout=2)


async def test_conflicting_updates_leave_one_winner(fake: FakeApiServer,
                                                    electors: Callable[..., LeaderElector]
                                                    ) -> None:
    # An expired lease held by a dead replica; many candidates race to take it with PUTs
    # carrying the same resourceVersion: the fake answers 409 to all but the first.
    fake.put("leases", {"metadata": {"name": LEASE, "namespace": "default"},
                        "spec": {"holderIdentity": "dead", "leaseDurationSeconds": 1,
                                 "renewTime": "2020-01-01T00:00:00.000000Z",
                                 "leaseTransitions": 4}})
    es = [electors(f"c{i}", retry_s=0.05) for i in range(5)]
    await eventually(lambda: sum(e.is_leader for e in es) == 1, timeout=5)
    await asyncio.sleep(0.3)  # not a wait: the losers keep retrying, and none may win later
    assert sum(e.is_leader for e in es) == 1
    assert fake.requests[("PUT", "leases", "put")] >= 1
    assert fake.get("leases", LEASE)["spec"]["leaseTransitions"] == 5  # type: ignore[index]


async def test_release_after_a_renewal_it_did_not_see_still_releases(
        fake: FakeApiServer, electors: Callable[..., LeaderElector]) -> None:
    """A renewal cut short by the stop may land on the API server anyway, leaving the
    elector a stale copy of its Lease: the release conflicts (409), re-reads the Lease
    and releases it, so a standby need not wait out the lease."""
    a = electors("a", lease_s=3.0, renew_s=2.0, retry_s=1.0)
    await eventually(lambda: a.is_leader)
    lease = fake.get("leases", LEASE)
    assert lease is not None
    fake.put("leases", lease)  # same holder, new resourceVersion: a's copy is stale now
    await a.stop()
    assert holder(fake) == ""
