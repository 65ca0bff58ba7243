"""Precise prefix-cache routing through real Envoy (issue 15).

Three ``epp sim`` pods on 127.0.0.1 publish vLLM KV events over ZMQ (each on its HTTP
port + N: ``--kv-events-port-offset``), the EPP runs ``token-producer`` (each test twice:
the pods' ``/tokenize``, whitespace words; and in process, a ``tokenizer.json`` giving the
simulator's ids with the prefix store on, so repeated system prompts take their ids from
the store) → ``precise-prefix-cache-producer`` (dialling each
endpoint on port + N: ``podDiscoveryConfig.endpointPortOffset``) → ``prefix-cache-scorer``.
Pods are warmed *directly* (not through the EPP), so only the events can tell the EPP
where a prefix lives: requests follow the pod that really holds the blocks, stop going
there once it evicted them (``POST /reset_prefix_cache``), and the same holds after the
pods restart (sequence back to 0, the SUB sockets reconnect).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
import pytest_asyncio

from epp.bench.tokenizer import write_bench_tokenizer
from epp.stack.procs import ManagedProcess, free_port, sim_kv_events_args
from tests import polling
from tests.integration.conftest import (
    Stack,
    Upstreams,
    start_sims,
    start_stack,
    stop_stack,
)

eventually = functools.partial(polling.eventually, timeout=15.0, interval=0.05)
MODEL = "sim-model"
SUB = "llm_d_router_epp_kv_cache"


BACKENDS = ["vllm", "local"]


def _tokenizer(backend: str, tokenize_port: int, workdir: Path) -> str:
    if backend == "vllm":
        return f'modelName: {MODEL}\n    vllm: {{url: "http://127.0.0.1:{tokenize_port}", timeout: 2s}}'
    # every word the tests send through the EPP (warm-ups go to the pods directly)
    words = {w for tag in ROUTED_TAGS for w in _system(f"{backend}-{tag}").split()}
    words |= {w for i in range(3) for w in f"question {i} about it".split()}
    path = write_bench_tokenizer(workdir / "tokenizer", words)
    return f"local: {{path: {str(path)!r}, prefixStore: {{blockSize: 256}}}}"


def _config(tokenizer: str, offset: int) -> str:
    return f"""\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters:
    {tokenizer}
- type: endpoint-notification-source
- type: metrics-data-source
- type: core-metrics-extractor
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig: {{blockSizeTokens: 16}}
    kvEventsConfig:
      podDiscoveryConfig: {{endpointPortOffset: {offset}}}
- type: prefix-cache-scorer
  parameters: {{prefixMatchInfoProducerName: precise-prefix-cache-producer}}
- type: queue-scorer
- type: max-score-picker
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{{pluginRef: core-metrics-extractor}}]
  - pluginRef: endpoint-notification-source
    extractors: [{{pluginRef: precise-prefix-cache-producer}}]
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: prefix-cache-scorer, weight: 3}}
  - {{pluginRef: queue-scorer, weight: 1}}
  - {{pluginRef: max-score-picker}}
"""


class Pool:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.ports = [free_port() for _ in range(3)]
        self.args, self.offset = sim_kv_events_args(self.ports)
        self.proc: ManagedProcess | None = None
        self.starts = 0

    async def start(self) -> ManagedProcess:
        self.starts += 1
        self.proc = await start_sims(self.ports, self.workdir / f"sims-{self.starts}.log",
                                     *self.args)
        return self.proc

    async def stop(self) -> None:
        if self.proc is not None:
            await self.proc.stop()


@pytest_asyncio.fixture(scope="module")
async def pool(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pool]:
    p = Pool(tmp_path_factory.mktemp("precise-sims"))
    await p.start()
    yield p
    await p.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest_asyncio.fixture(scope="module")
async def stack(pool: Pool, backend: str,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    assert pool.proc is not None
    workdir = tmp_path_factory.mktemp(f"precise-stack-{backend}")
    s = await start_stack("FULL_DUPLEX_STREAMED", Upstreams(pool.ports, pool.proc), workdir,
                          endpoint_ports=pool.ports,
                          config=_config(_tokenizer(backend, pool.ports[0], workdir),
                                         pool.offset))
    yield s
    await stop_stack(s)


@pytest_asyncio.fixture(scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


def _body(system: str, question: str) -> bytes:
    return orjson.dumps({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]})


#: System prompts sent through the EPP (each test's tags, prefixed with the backend so the
#: second backend's run finds the pods without them).
ROUTED_TAGS = ["follow0", "follow1", "follow2", "evict", "restart-new"]


def _system(tag: str) -> str:
    # ~200 words: a dozen full blocks of 16 tokens.
    return f"{tag} " + " ".join(f"{tag}-word-{i}" for i in range(200))


async def _post(http: aiohttp.ClientSession, url: str, body: bytes) -> str:
    async with http.post(url + "/v1/chat/completions", data=body,
                         headers={"content-type": "application/json"}) as r:
        await r.read()
        assert r.status == 200, r.status
        return r.headers["x-sim-server"]


async def _warm(http: aiohttp.ClientSession, port: int, system: str) -> None:
    """Cache ``system`` on the pod at ``port`` behind the EPP's back."""
    assert await _post(http, f"http://127.0.0.1:{port}", _body(system, "warm up")) == \
        f"sim-{port}"


async def _blocks(stack: Stack, http: aiohttp.ClientSession, port: int) -> float:
    async with http.get(f"http://127.0.0.1:{stack.epp.metrics_port}/metrics") as r:
        text = await r.text()
    want = f'{SUB}_index_blocks{{pod="127.0.0.1:{port}"}}'
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _subscribed(stack: Stack, http: aiohttp.ClientSession) -> bool:
    return await stack.epp.metric(http, f"{SUB}_events_active_subscribers") >= 3


async def _routes_to(stack: Stack, http: aiohttp.ClientSession, system: str, port: int,
                     n: int = 3) -> None:
    """``n`` requests sharing ``system`` (different questions) all land on ``port``."""
    for i in range(n):
        got = await _post(http, stack.url, _body(system, f"question {i} about it"))
        assert got == f"sim-{port}", (got, port)


async def test_requests_follow_the_pod_that_holds_the_blocks(
        stack: Stack, pool: Pool, backend: str, http: aiohttp.ClientSession) -> None:
    await eventually(lambda: _subscribed(stack, http), what="3 KV-event subscribers")
    for k, port in enumerate([pool.ports[1], pool.ports[2], pool.ports[0]]):
        system = _system(f"{backend}-follow{k}")
        before = await _blocks(stack, http, port)
        await _warm(http, port, system)
        await eventually(lambda p=port, b=before: _grew(stack, http, p, b),
                         what=f"the EPP to index sim-{port}'s new blocks")
        await _routes_to(stack, http, system, port)


async def _grew(stack: Stack, http: aiohttp.ClientSession, port: int, before: float) -> bool:
    return await _blocks(stack, http, port) >= before + 10


async def test_after_eviction_requests_follow_the_blocks_elsewhere(
        stack: Stack, pool: Pool, backend: str, http: aiohttp.ClientSession) -> None:
    await eventually(lambda: _subscribed(stack, http), what="3 KV-event subscribers")
    _, b, c = pool.ports
    system = _system(f"{backend}-evict")
    await _warm(http, b, system)
    await eventually(lambda: _grew(stack, http, b, 0), what=f"sim-{b} indexed")
    await _routes_to(stack, http, system, b)
    # B forgets its whole prefix cache (AllBlocksCleared or BlockRemoved events) ...
    async with http.post(f"http://127.0.0.1:{b}/reset_prefix_cache") as r:
        assert r.status == 200
    await eventually(lambda: _empty(stack, http, b), what=f"sim-{b}'s entries dropped")
    # ... and C now holds the prefix: requests go to C, not to B.
    await _warm(http, c, system)
    await eventually(lambda: _grew(stack, http, c, 0), what=f"sim-{c} indexed")
    await _routes_to(stack, http, system, c)


async def _empty(stack: Stack, http: aiohttp.ClientSession, port: int) -> bool:
    return await _blocks(stack, http, port) == 0


async def test_pods_restart_and_subscribers_reconnect(
        stack: Stack, pool: Pool, backend: str, http: aiohttp.ClientSession) -> None:
    await eventually(lambda: _subscribed(stack, http), what="3 KV-event subscribers")
    a, _, c = pool.ports
    # Several batches first: restarts are recognised by the sequence number going back,
    # so each pod's must be well above the few batches it publishes after the restart.
    old = {}
    for port in (a, c):
        for k in range(6):
            before = await _blocks(stack, http, port)
            await _warm(http, port, _system(f"{backend}-restart-old{k}"))
            await eventually(lambda p=port, b=before: _grew(stack, http, p, b),
                             what=lambda p=port: f"sim-{p} indexed")
        old[port] = await _blocks(stack, http, port)
    await pool.stop()
    await pool.start()  # same ports, empty caches; each publisher starts again at seq 0
    # A pod's first batch seen after the restart (a sequence number below the last one)
    # drops what the EPP knew of it before: only the new blocks remain. The SUB socket
    # reconnects by itself within ~100 ms; batches published before that are lost (PUB/SUB),
    # so each pod is warmed again (a new prefix each time) until one arrives.
    tries = iter(range(1000))

    async def restarted(port: int) -> bool:
        await _warm(http, port, _system(f"{backend}-restart-{port}-{next(tries)}"))
        await asyncio.sleep(0.2)
        return 10 <= await _blocks(stack, http, port) < old[port]

    for port in (a, c):
        await eventually(lambda p=port: restarted(p), interval=0.3,
                         what=lambda p=port: f"sim-{p}'s pre-restart entries dropped "
                         f"(had {old[p]})")
    # C's subscriber is connected again: a prefix C caches now is indexed and followed.
    system = _system(f"{backend}-restart-new")
    before = await _blocks(stack, http, c)
    await _warm(http, c, system)
    await eventually(lambda: _grew(stack, http, c, before), what=f"sim-{c} indexed")
    await _routes_to(stack, http, system, c)
