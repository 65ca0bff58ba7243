"""Shared fixtures of the Kubernetes unit tests: the fake API server (``fake``; a test
module may override it), a client for it (``api``) and discovery harnesses
(``harness``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest_asyncio

from epp.datastore.store import Datastore
from epp.discovery.kubeclient import KubeApi, connect
from epp.discovery.kubernetes import KubernetesOptions, KubernetesSource
from epp.discovery.reflector import ReflectorOptions
from tests.k8s_fake import FakeApiServer

FAST = ReflectorOptions(backoff_initial_s=0.02, backoff_max_s=0.1, min_healthy_watch_s=0.05)


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer(bookmark_interval_s=0.1)
    await server.start()
    yield server
    await server.stop()


@pytest_asyncio.fixture
async def api(fake: FakeApiServer, tmp_path: Path) -> AsyncIterator[KubeApi]:
    client = await connect(str(fake.write_kubeconfig(tmp_path / "kubeconfig")))
    yield client
    await client.close()


class Harness:
    def __init__(self, api: KubeApi, **kw: Any) -> None:
        self.store = Datastore()
        self.state_changes = 0
        opts = KubernetesOptions(namespace="default", debounce_s=kw.pop("debounce_s", 0.0),
                                 reflector=kw.pop("reflector", FAST), **kw)
        self.source = KubernetesSource(api, self.store, opts, on_state_change=self._changed)

    async def _changed(self) -> None:
        self.state_changes += 1

    def keys(self) -> list[str]:
        return sorted(e.key for e in self.store.snapshot())

    def names(self) -> list[str]:
        return sorted(e.name for e in self.store.snapshot())


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
