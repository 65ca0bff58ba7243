"""Pool mode watches the InferenceObjectives and InferenceModelRewrites that reference the
pool (GIE v1.5.0's inferenceobjective_reconciler.go / inferencemodelrewrite_reconciler.go),
against the fake API server's list/watch."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from epp import keys
from epp.datastore.objectives import ObjectiveStore
from epp.datastore.store import Datastore
from epp.discovery.kubeclient import KubeApi
from epp.discovery.kubernetes import (
    KubernetesOptions,
    KubernetesSource,
    PoolSpec,
    objectives_api_path,
)
from epp.discovery.reflector import ReflectorOptions
from tests.k8s_fake import FakeApiServer
from tests.polling import eventually
from tests.unit.conftest import FAST

APP = {"app": "vllm"}
HERMETIC = (Path(__file__).resolve().parents[2]
            / "fixtures/gie-v1.5.0/test/testdata/inferencepool-with-model-hermetic.yaml")
OBJECTIVES = objectives_api_path(keys.K8S_OBJECTIVE_PLURAL, "default")
REWRITES = objectives_api_path(keys.K8S_MODEL_REWRITE_PLURAL, "default")


class Harness:
    def __init__(self, api: KubeApi, **kw: Any) -> None:
        self.store = Datastore()
        self.objectives = ObjectiveStore()
        opts = KubernetesOptions(namespace=kw.pop("namespace", "default"),
                                 debounce_s=kw.pop("debounce_s", 0.0),
                                 reflector=kw.pop("reflector", FAST), **kw)
        self.source = KubernetesSource(api, self.store, opts, objectives=self.objectives)

    def priorities(self) -> dict[str, int | None]:
        return {o.name: o.priority for o in self.objectives.objectives()}


@pytest_asyncio.fixture
async def harness(api: KubeApi) -> AsyncIterator[Callable[..., Any]]:
    made: list[Harness] = []

    async def make(**kw: Any) -> Harness:
        h = Harness(api, **kw)
        made.append(h)
        await h.source.start()
        return h

    yield make
    for h in made:
        await h.source.stop()


def objective(name: str, priority: int | None = None, pool: str | None = "pool",
              **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if priority is not None:
        spec["priority"] = priority
    if pool is not None:
        spec["poolRef"] = {"name": pool, **extra.pop("ref", {})}
    return {"metadata": {"name": name, "namespace": extra.pop("namespace", "default"),
                         **extra}, "spec": spec}


def rewrite(name: str, model: str, target: str, pool: str = "pool",
            **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default", **meta},
            "spec": {"poolRef": {"name": pool},
                     "rules": [{"matches": [{"model": {"value": model}}],
                                "targets": [{"modelRewrite": target}]}]}}


async def test_gies_hermetic_test_objects(fake: FakeApiServer, harness: Any) -> None:
    """The InferencePool, InferenceObjectives and InferenceModelRewrite GIE's hermetic
    test applies (test/testdata/inferencepool-with-model-hermetic.yaml), as its envtest
    API server serves them. Its objectives still carry ``targetModels``, a field the
    current CRD dropped: ignored, as the API server prunes it."""
    for doc in yaml.safe_load_all(HERMETIC.read_text()):
        kind = {"InferencePool": "inferencepools", "InferenceObjective": "inferenceobjectives",
                "InferenceModelRewrite": "inferencemodelrewrites"}[doc["kind"]]
        fake.put(kind, doc)
    fake.put_pod("a", "10.0.0.1", labels={"app": "vllm-qwen3-32b-pool"})
    h = await harness(pool_name="vllm-qwen3-32b-pool")
    assert await h.source.wait_ready(5)
    # Ready implies listed: the objects are there at once.
    assert h.priorities() == {"sql-lora": 2, "sql-lora-sheddable": None, "my-model": 2,
                              "direct-model": 2, "inference-objective-with-priority-4": 4}
    assert h.objectives.priority("sql-lora-sheddable") == 0
    assert h.objectives.rewrite("model-to-be-rewritten") == ("rewritten-model", "rewrite-test")
    assert h.objectives.rewrite("my-model") is None


async def test_watch_adds_updates_and_deletes(fake: FakeApiServer, harness: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put("inferenceobjectives", objective("critical", 10))
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert h.priorities() == {"critical": 10}
    fake.put("inferenceobjectives", objective("critical", 20))
    fake.put("inferenceobjectives", objective("sheddable", -1))
    await eventually(lambda: h.priorities() == {"critical": 20, "sheddable": -1})
    fake.delete("inferenceobjectives", "critical")
    await eventually(lambda: h.priorities() == {"sheddable": -1})
    # Being deleted (finalizers pending) counts as gone (GIE: DeletionTimestamp set).
    fake.put("inferenceobjectives", objective("sheddable", -1,
                                              deletionTimestamp="2025-01-01T00:00:00Z"))
    await eventually(lambda: h.priorities() == {})
    # Rewrites, and a rewrite moved to another pool.
    fake.put("inferencemodelrewrites", rewrite("rw", "llama", "llama-v2"))
    await eventually(lambda: h.objectives.rewrite("llama") == ("llama-v2", "rw"))
    fake.put("inferencemodelrewrites", rewrite("rw", "llama", "llama-v3"))
    await eventually(lambda: h.objectives.rewrite("llama") == ("llama-v3", "rw"))
    fake.put("inferencemodelrewrites", rewrite("rw", "llama", "llama-v3", pool="other"))
    await eventually(lambda: h.objectives.rewrite("llama") is None)
    fake.put("inferencemodelrewrites", rewrite("rw", "llama", "llama-v4"))
    await eventually(lambda: h.objectives.rewrite("llama") == ("llama-v4", "rw"))
    fake.delete("inferencemodelrewrites", "rw")
    await eventually(lambda: len(h.objectives) == 0)


async def test_only_objects_of_this_pool_group_and_namespace(fake: FakeApiServer,
                                                            harness: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put("inferenceobjectives", objective("mine", 1))
    fake.put("inferenceobjectives", objective("explicit-group", 2,
                                              ref={"group": keys.K8S_POOL_GROUP,
                                                   "kind": "InferencePool"}))
    fake.put("inferenceobjectives", objective("other-pool", 3, pool="other"))
    fake.put("inferenceobjectives", objective("alpha-group", 4,
                                              ref={"group": keys.K8S_POOL_GROUP_ALPHA}))
    fake.put("inferenceobjectives", objective("no-pool-ref", 5, pool=None))
    fake.put("inferenceobjectives", objective("elsewhere", 6, namespace="elsewhere"))
    # Older, same model, but another pool: not a candidate at all.
    fake.put("inferencemodelrewrites", rewrite("other-rw", "m", "wrong", pool="other",
                                               creationTimestamp="2020-01-01T00:00:00Z"))
    fake.put("inferencemodelrewrites", rewrite("rw", "m", "right"))
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert h.priorities() == {"mine": 1, "explicit-group": 2}
    assert h.objectives.rewrite("m") == ("right", "rw")


async def test_v1alpha2_pool_group_matches_its_own_group(fake: FakeApiServer,
                                                         harness: Any) -> None:
    fake.put("inferencepools", {"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                                "metadata": {"name": "pool"},
                                "spec": {"selector": APP, "targetPortNumber": 8000}})
    fake.put("inferenceobjectives", objective("default-group", 1))
    fake.put("inferenceobjectives", objective("alpha", 2,
                                              ref={"group": keys.K8S_POOL_GROUP_ALPHA}))
    h = await harness(pool_name="pool", pool_group=keys.K8S_POOL_GROUP_ALPHA)
    assert await h.source.wait_ready(5)
    assert h.priorities() == {"alpha": 2}


async def test_unusable_objects_are_skipped_and_logged_once(
        fake: FakeApiServer, harness: Any, caplog: pytest.LogCaptureFixture) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put("inferenceobjectives", objective("good", 1))
    bad = objective("bad")
    bad["spec"]["priority"] = "high"
    fake.put("inferenceobjectives", bad)
    with caplog.at_level(logging.WARNING, logger="epp.discovery.kubernetes"):
        h = await harness(pool_name="pool")
        assert await h.source.wait_ready(5)
        assert h.priorities() == {"good": 1}
        fake.put("inferenceobjectives", objective("good", 2))  # another event
        await eventually(lambda: h.priorities() == {"good": 2})
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "default/bad" in warnings[0] and "spec.priority" in warnings[0]
    fake.put("inferenceobjectives", objective("bad", 3))  # fixed
    await eventually(lambda: h.priorities() == {"good": 2, "bad": 3})


async def test_crd_not_installed_is_no_obstacle(fake: FakeApiServer, harness: Any,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """GIE checks API discovery and does not watch a kind whose CRD is missing; here the
    404 leaves the store empty, readiness does not wait for it, and a CRD installed later
    is picked up (the reflector retries with backoff)."""
    fake.put_pool("pool", APP, [8000])
    fake.put_pod("a", "10.0.0.1", labels=APP)
    fake.put("inferenceobjectives", objective("critical", 10))
    fake.fail_next(OBJECTIVES, 404, times=10**6)
    fake.fail_next(REWRITES, 404, times=10**6)
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert len(h.objectives) == 0
    assert "inferenceobjectives: the CRD (inference.networking.x-k8s.io/v1alpha2) is not " \
           "installed" in caplog.text
    fake.clear_failures()  # "kubectl apply" of the CRD
    await eventually(lambda: h.priorities() == {"critical": 10})


async def test_forbidden_is_reported_and_not_fatal(fake: FakeApiServer, harness: Any,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.fail_next(REWRITES, 403, times=10**6)
    h = await harness(pool_name="pool", reflector=ReflectorOptions(backoff_initial_s=5))
    assert await h.source.wait_ready(5)
    assert "cannot list inferencemodelrewrites (403 Forbidden)" in caplog.text
    assert "grant get/list/watch" in caplog.text


async def test_readiness_waits_for_the_first_list(fake: FakeApiServer, harness: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put("inferencemodelrewrites", rewrite("rw", "m", "t"))
    fake.fail_next(REWRITES, 500, times=3)
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    assert h.objectives.rewrite("m") == ("t", "rw")  # no request routes before the list
    assert fake.requests[("GET", "inferencemodelrewrites", "list")] == 4


async def test_standalone_mode_watches_no_objectives(fake: FakeApiServer,
                                                     harness: Any) -> None:
    """GIE starts its CRD reconcilers only without --endpoint-selector."""
    fake.put_pod("a", "10.0.0.1", labels=APP)
    fake.put("inferenceobjectives", objective("critical", 10))
    h = await harness(standalone=PoolSpec(APP, (8000,)))
    assert await h.source.wait_ready(5)
    assert fake.requests[("GET", "inferenceobjectives", "list")] == 0
    assert fake.requests[("GET", "inferencemodelrewrites", "list")] == 0
    assert len(h.objectives) == 0


async def test_without_a_store_nothing_is_watched(fake: FakeApiServer, api: KubeApi) -> None:
    fake.put_pool("pool", APP, [8000])
    source = KubernetesSource(api, Datastore(), KubernetesOptions(
        namespace="default", pool_name="pool", debounce_s=0.0, reflector=FAST))
    await source.start()
    try:
        assert await source.wait_ready(5)
        assert fake.requests[("GET", "inferenceobjectives", "list")] == 0
    finally:
        await source.stop()


async def test_watches_stop_with_the_source(fake: FakeApiServer, harness: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    h = await harness(pool_name="pool")
    assert await h.source.wait_ready(5)
    await eventually(lambda: fake.open_watches("inferenceobjectives") == 1
                     and fake.open_watches("inferencemodelrewrites") == 1)
    await h.source.stop()
    await eventually(lambda: fake.open_watches("inferenceobjectives") == 0
                     and fake.open_watches("inferencemodelrewrites") == 0)


async def test_a_burst_is_copied_to_the_store_once(fake: FakeApiServer, harness: Any) -> None:
    """Each object is parsed once, when it arrives; the store is rewritten after the
    discovery debounce, not per event."""
    fake.put_pool("pool", APP, [8000])
    h = await harness(pool_name="pool", debounce_s=0.05)
    assert await h.source.wait_ready(5)
    before = h.objectives.version
    for i in range(100):
        fake.put("inferenceobjectives", objective(f"o{i}", i))
    await eventually(lambda: len(h.priorities()) == 100)
    assert h.objectives.priority("o42") == 42
    assert h.objectives.version - before <= 5
