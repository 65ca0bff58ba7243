"""Multi-node gangs in Kubernetes mode: an incomplete LeaderWorkerSet group or Grove
PodGang takes no traffic (list/watch against the fake API server)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from epp import keys
from epp.discovery.gangs import lws_size, podgang_groups
from epp.discovery.reflector import ReflectorOptions
from tests.k8s_fake import FakeApiServer
from tests.polling import eventually
from tests.unit.conftest import FAST

LEADER = {"app": "vllm", "role": "leader"}
WORKER = {"app": "vllm", "role": "worker"}


def lws(group: str, worker: int) -> dict[str, str]:
    base = LEADER if worker == 0 else WORKER
    return {**base, keys.LABEL_LWS_GROUP_KEY: group, keys.LABEL_LWS_WORKER_INDEX: str(worker)}


SIZE3 = {keys.ANNOTATION_LWS_SIZE: "3"}


def test_pure_parsers() -> None:
    assert lws_size("4") == 4 and lws_size(None) is None and lws_size("four") is None
    groups = podgang_groups({
        "metadata": {"name": "g", "namespace": "ns"},
        "spec": {"podgroups": [
            {"name": "prefill", "minReplicas": 2,
             "podReferences": [{"name": "p0"}, {"namespace": "other", "name": "p1"}]},
            {"minReplicas": "bad", "podReferences": [{"namespace": "ns"}, "junk"]},
            "junk"]}})
    assert [(g.name, g.pods, g.min_replicas) for g in groups] == [
        ("prefill", ("ns/p0", "other/p1"), 2), ("#1", (), 0)]


async def test_lws_group_takes_traffic_only_when_complete(fake: FakeApiServer,
                                                          harness: Any,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    caplog.set_level(logging.INFO, logger="epp.discovery.gangs")
    fake.put_pool("pool", LEADER, [8000])
    # Group g1: leader + 2 workers, all Ready. Group g2: one worker not Ready yet.
    fake.put_pod("g1-0", "10.0.0.1", labels=lws("g1", 0), annotations=SIZE3)
    fake.put_pod("g1-0-1", "10.0.1.1", labels=lws("g1", 1), annotations=SIZE3)
    fake.put_pod("g1-0-2", "10.0.1.2", labels=lws("g1", 2), annotations=SIZE3)
    fake.put_pod("g2-0", "10.0.0.2", labels=lws("g2", 0), annotations=SIZE3)
    fake.put_pod("g2-0-1", "10.0.2.1", labels=lws("g2", 1), annotations=SIZE3)
    fake.put_pod("g2-0-2", None, labels=lws("g2", 2), annotations=SIZE3, ready=False)
    # A leader without gang labels is not affected.
    fake.put_pod("solo", "10.0.0.3", labels=LEADER)
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert h.keys() == ["10.0.0.1:8000", "10.0.0.3:8000"]
    assert h.source.gangs.excluded == {
        "default/g2-0": "LeaderWorkerSet group g2 has 2 of 3 pods Ready"}
    assert "pod default/g2-0 takes no traffic: LeaderWorkerSet group g2 has 2 of 3" \
        in caplog.text
    # The missing worker comes up: the group serves.
    fake.put_pod("g2-0-2", "10.0.2.2", labels=lws("g2", 2), annotations=SIZE3)
    await eventually(lambda: h.keys() == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"])
    assert "pod default/g2-0 takes traffic again" in caplog.text
    # A worker of g1 fails its readiness probe, another is deleted: g1 stops.
    fake.put_pod("g1-0-1", "10.0.1.1", labels=lws("g1", 1), annotations=SIZE3, ready=False)
    await eventually(lambda: h.keys() == ["10.0.0.2:8000", "10.0.0.3:8000"])
    fake.put_pod("g1-0-1", "10.0.1.1", labels=lws("g1", 1), annotations=SIZE3)
    await eventually(lambda: "10.0.0.1:8000" in list(h.keys()))
    fake.delete("pods", "g1-0-2")
    await eventually(lambda: h.keys() == ["10.0.0.2:8000", "10.0.0.3:8000"])
    # Only one extra watch: pods carrying the group-key label.
    assert fake.open_watches("pods") == 2 and fake.requests[("GET", "podgangs", "list")] == 0


async def test_pool_without_gangs_starts_no_member_watch(fake: FakeApiServer,
                                                         harness: Any) -> None:
    fake.put_pool("pool", LEADER, [8000])
    fake.put_pod("a", "10.0.0.1", labels=LEADER)
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert h.keys() == ["10.0.0.1:8000"]
    assert fake.requests[("GET", "pods", "list")] == 1
    assert fake.requests[("GET", "podgangs", "list")] == 0


def grove(gang: str, clique: str) -> dict[str, str]:
    base = LEADER if clique.endswith("leader") else WORKER
    return {**base, keys.LABEL_GROVE_PODGANG: gang, keys.LABEL_GROVE_PODCLIQUE: clique}


def put_grove_gang(fake: FakeApiServer, gang: str, ip_base: int, *, workers_ready: int,
                   workers: int = 2, min_workers: int = 2) -> None:
    fake.put_podgang(gang, {
        f"{gang}-leader": ([f"{gang}-leader-0"], 1),
        f"{gang}-worker": ([f"{gang}-worker-{i}" for i in range(workers)], min_workers)})
    fake.put_pod(f"{gang}-leader-0", f"10.0.{ip_base}.1", labels=grove(gang, f"{gang}-leader"))
    for i in range(workers):
        ready = i < workers_ready
        fake.put_pod(f"{gang}-worker-{i}", f"10.0.{ip_base}.{10 + i}" if ready else None,
                     labels=grove(gang, f"{gang}-worker"), ready=ready)


async def test_grove_podgang_below_min_replicas_takes_no_traffic(fake: FakeApiServer,
                                                                 harness: Any) -> None:
    fake.put_pool("pool", LEADER, [8000])
    put_grove_gang(fake, "pcs-0", 1, workers_ready=2)
    put_grove_gang(fake, "pcs-1", 2, workers_ready=1)
    # Best effort above minReplicas: 3 workers, 2 required, 2 Ready → complete.
    put_grove_gang(fake, "pcs-2", 3, workers_ready=2, workers=3, min_workers=2)
    # A leader naming a PodGang that does not exist.
    fake.put_pod("stray", "10.0.9.1", labels=grove("ghost", "ghost-leader"))
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert h.keys() == ["10.0.1.1:8000", "10.0.3.1:8000"]
    assert h.source.gangs.excluded == {
        "default/pcs-1-leader-0": "PodGang pcs-1: pod group pcs-1-worker has 1 of 2 "
                                  "required pods Ready",
        "default/stray": "PodGang ghost not found"}
    fake.put_pod("pcs-1-worker-1", "10.0.2.11", labels=grove("pcs-1", "pcs-1-worker"))
    await eventually(lambda: h.keys() == ["10.0.1.1:8000", "10.0.2.1:8000", "10.0.3.1:8000"])
    # Grove raises minReplicas (a PodGang update): pcs-2 now needs all three.
    put_grove_gang(fake, "pcs-2", 3, workers_ready=2, workers=3, min_workers=3)
    await eventually(lambda: h.keys() == ["10.0.1.1:8000", "10.0.2.1:8000"])
    fake.delete("podgangs", "pcs-0")
    await eventually(lambda: h.keys() == ["10.0.2.1:8000"])


@pytest.mark.parametrize("status", [403, 404])
async def test_unreadable_podgangs_skip_the_grove_check(fake: FakeApiServer, harness: Any,
                                                        caplog: pytest.LogCaptureFixture,
                                                        status: int) -> None:
    fake.put_pool("pool", LEADER, [8000])
    put_grove_gang(fake, "pcs-1", 2, workers_ready=1)
    if status == 404:
        fake.serve_podgangs = False
    else:
        fake.fail_next("/apis/scheduler.grove.io/", 403, times=1000)
    h = await harness(pool_name="pool", reflector=ReflectorOptions(backoff_initial_s=5))
    assert await h.source.wait_ready(5)
    assert h.keys() == ["10.0.2.1:8000"]
    why = "forbidden" if status == 403 else "not served"
    assert f"cannot list PodGangs: {why}" in caplog.text
    assert "Grove gang completeness is not checked" in caplog.text


async def test_readiness_waits_for_the_member_watch(fake: FakeApiServer,
                                                    harness: Any) -> None:
    fake.put_pool("pool", LEADER, [8000])
    fake.put_pod("g1-0", "10.0.0.1", labels=lws("g1", 0), annotations=SIZE3)
    # The member list fails a few times: no endpoints are published before it succeeds,
    # so the incomplete group never takes traffic, not even at start.
    fake.fail_next("/api/v1/namespaces/default/pods", 500, times=3)
    h = await harness(pool_name="pool", reflector=FAST)
    await eventually(lambda: h.source.ready, timeout=10)
    assert h.keys() == [] and h.source.gangs.excluded == {
        "default/g1-0": "LeaderWorkerSet group g1 has 1 of 3 pods Ready"}
