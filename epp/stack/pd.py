"""The local P/D stack: prefill and decode `epp sim` pods in racks, the EPP, real Envoy.

Used by ``epp demo --pd`` (:mod:`epp.stack.demo`), the P/D integration tests,
``bench/pd.py`` and ``deploy/grafana/render.py``.

:func:`grove_layout` describes pods the way a Grove PodCliqueSet places them: one
PodCliqueSet replica per rack (the gang scheduler packs a replica into a rack), each with
a ``prefill`` and a ``decode`` PodClique, every pod on its own node. The endpoints file
it writes carries the pods' Grove labels (``app.kubernetes.io/part-of``,
``grove.io/podcliqueset-replica-index``, ``grove.io/podclique``, ``grove.io/podgang``,
``grove.io/podclique-pod-index``), their role (``llm-d.ai/role``), ``nodeName`` and the
nodes' topology labels (hostname, rack, block, zone) — what ``epp serve`` reads in
Kubernetes from Pods and Nodes. The simulated pods read the same file
(``--peer-topology-file``) to price each KV transfer by the pair's distance.

:class:`PdStack` starts one ``epp sim`` process per group of pods sharing a role and
options, ``epp serve`` over the endpoints file, and Envoy in front; everything on
127.0.0.1, stopped by :meth:`PdStack.stop`.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp
import yaml

from epp import keys
from epp.stack.envoy import DEFAULT_RESPONSE_PATH, EnvoyProcess, render_envoy_config
from epp.stack.procs import LOCAL_SERVE_FLAGS, ManagedProcess, free_port, wait_port

__all__ = [
    "MODEL",
    "PD_SIM_ARGS",
    "PairStats",
    "PdLayout",
    "PdPod",
    "PdStack",
    "grove_layout",
    "repo_config",
]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-model"

PD_SIM_ARGS: Mapping[str, tuple[str, ...]] = {
    # Loosely an 8B model: ~20k prompt tokens/s, a 5 ms decode step, KV of ~128 KB per
    # token moved at ~60 GB/s within a rack, ~12 GB/s across racks of one block.
    "prefill": ("--prefill-ms-per-token", "0.05", "--decode-base-ms", "5"),
    "decode": ("--prefill-ms-per-token", "0.05", "--decode-base-ms", "5",
               "--kv-transfer-cost", "node=0.001,rack=0.002,block=0.01,zone=0.05,other=0.1"),
    "both": ("--prefill-ms-per-token", "0.05", "--decode-base-ms", "5"),
}
"""Default `epp sim` options per role for the demo and the benchmark."""


def repo_config(name: str) -> Path:
    """A file of the repository's config/ directory (e.g. ``pd-grove.yaml``)."""
    return ROOT / "config" / name


@dataclass
class PdPod:
    role: str
    """``prefill``, ``decode`` or ``both``."""
    rack: str
    port: int
    name: str
    node: str
    labels: dict[str, str]
    sim_args: tuple[str, ...] = ()
    """Extra `epp sim` options for this pod (pods with equal options share a process)."""

    @property
    def key(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class PdLayout:
    pods: list[PdPod]
    nodes: dict[str, dict[str, str]]

    def by_role(self, role: str) -> list[PdPod]:
        return [p for p in self.pods if p.role == role]

    def rack_of(self, key: str) -> str | None:
        for p in self.pods:
            if p.key == key:
                return p.rack
        return None

    def endpoints_doc(self, include: Callable[[PdPod], bool] = lambda p: True) -> dict[str, Any]:
        pods = [p for p in self.pods if include(p)]
        return {
            "endpoints": [{"address": "127.0.0.1", "port": p.port, "name": p.name,
                           "labels": dict(p.labels), "nodeName": p.node} for p in pods],
            "nodes": [{"name": p.node, "labels": dict(self.nodes[p.node])} for p in pods],
        }

    def write(self, path: Path, include: Callable[[PdPod], bool] = lambda p: True) -> None:
        """Write the endpoints file atomically (readers never see half a file)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(self.endpoints_doc(include), sort_keys=False))
        tmp.replace(path)


def grove_layout(*, racks: Sequence[str] = ("rack-1", "rack-2"), prefill_per_rack: int = 2,
                 decode_per_rack: int = 2, both_per_rack: int = 0, block: str = "block-1",
                 zone: str = "zone-1", pcs: str = "llm",
                 sim_args: Mapping[str, Sequence[str]] | None = None,
                 pod_args: Callable[[str, str, int], Sequence[str]] | None = None) -> PdLayout:
    """Pods per rack by role, on free ports, labelled as Grove labels them (module doc).

    ``sim_args``: extra `epp sim` options per role; ``pod_args(role, rack, index)``: extra
    options for one pod.
    """
    pods: list[PdPod] = []
    nodes: dict[str, dict[str, str]] = {}
    used: set[int] = set()

    def port() -> int:  # free_port draws at random: never hand out one twice
        while True:
            p = free_port()
            if p not in used:
                used.add(p)
                return p

    for r, rack in enumerate(racks):
        for role, count in (("prefill", prefill_per_rack), ("decode", decode_per_rack),
                            ("both", both_per_rack)):
            for i in range(count):
                pod_port = port()
                node = f"node-{rack}-{role}-{i}"
                nodes[node] = {keys.LABEL_HOSTNAME: node, keys.LABEL_RACK: rack,
                               keys.LABEL_BLOCK: block, keys.LABEL_ZONE: zone}
                labels = {
                    keys.LABEL_PART_OF: pcs,
                    keys.LABEL_GROVE_PCS_REPLICA: str(r),
                    keys.LABEL_GROVE_PODCLIQUE: f"{pcs}-{r}-{role}",
                    keys.LABEL_GROVE_PODGANG: f"{pcs}-{r}",
                    keys.LABEL_GROVE_POD_INDEX: str(i),
                }
                if role != "both":
                    labels[keys.LABEL_ROLE] = role
                args = tuple((sim_args or {}).get(role, ()))
                if pod_args is not None:
                    args += tuple(pod_args(role, rack, i))
                pods.append(PdPod(role, rack, pod_port, f"{pcs}-{r}-{role}-{i}", node, labels,
                                  args))
    return PdLayout(pods, nodes)


@dataclass
class PairStats:
    """What the decode pods did, summed (from their ``/debug/state``)."""

    remote_prefills: int = 0
    prefill_failures: int = 0
    fallbacks: int = 0
    by_distance: Counter[str] = field(default_factory=Counter)
    by_prefiller: Counter[str] = field(default_factory=Counter)

    @property
    def same_rack(self) -> int:
        """Pairs within one rack (same node or same rack)."""
        return self.by_distance["node"] + self.by_distance["rack"]

    @property
    def same_rack_share(self) -> float:
        return self.same_rack / self.remote_prefills if self.remote_prefills else float("nan")

    def minus(self, earlier: PairStats) -> PairStats:
        return PairStats(self.remote_prefills - earlier.remote_prefills,
                         self.prefill_failures - earlier.prefill_failures,
                         self.fallbacks - earlier.fallbacks,
                         self.by_distance - earlier.by_distance,
                         self.by_prefiller - earlier.by_prefiller)


class PdStack:
    """Sims for ``layout`` + ``epp serve`` + Envoy; :meth:`start`, then :meth:`stop`.

    The EPP and the sims read separate copies of the endpoints file: :meth:`set_pool`
    changes what the EPP sees (e.g. without the prefill pods) while the sims keep
    pricing transfers with the full topology. ``response_path`` is the Envoy gateway
    shape (``epp.stack.envoy.render_envoy_config``; default lean).
    """

    def __init__(self, workdir: Path, layout: PdLayout, *, config_file: Path | None = None,
                 config_text: str | None = None, body_mode: str = "FULL_DUPLEX_STREAMED",
                 epp_args: Sequence[str] = (), log_level: str = "warning",
                 env: Mapping[str, str] | None = None,
                 epp_include: Callable[[PdPod], bool] = lambda p: True,
                 response_path: str = DEFAULT_RESPONSE_PATH) -> None:
        self.workdir = workdir
        self.response_path = response_path
        self.layout = layout
        self.config_file = config_file
        self.config_text = config_text
        self.body_mode = body_mode
        self.epp_args = tuple(epp_args)
        self.log_level = log_level
        self.env = dict(env) if env is not None else None
        self.epp_include = epp_include
        self.sims_file = workdir / "sims-endpoints.yaml"
        self.epp_file = workdir / "epp-endpoints.yaml"
        self.grpc_port = free_port()
        self.health_port = free_port()
        self.metrics_port = free_port()
        self.port = free_port()
        self.sims: list[ManagedProcess] = []
        self.epp: ManagedProcess | None = None
        self.envoy = EnvoyProcess()
        self._stack = AsyncExitStack()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def set_pool(self, include: Callable[[PdPod], bool] | None = None) -> None:
        """Rewrite the EPP's endpoints file with the pods ``include`` accepts (default: the
        constructor's ``epp_include``); the EPP re-reads it within about a second."""
        self.layout.write(self.epp_file, include if include is not None else self.epp_include)

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.layout.write(self.sims_file)
        self.set_pool()
        groups: dict[tuple[str, tuple[str, ...]], list[PdPod]] = {}
        for p in self.layout.pods:
            groups.setdefault((p.role, p.sim_args), []).append(p)
        for n, ((role, args), pods) in enumerate(groups.items()):
            argv = [sys.executable, "-m", "epp.cli", "sim", "--model", MODEL, "--role", role,
                    "--peer-topology-file", str(self.sims_file), *args]
            for p in pods:
                argv += ["--port", str(p.port)]
            proc = ManagedProcess(argv, log_path=self.workdir / f"sim-{n}-{role}.log",
                                  env=self.env, cwd=ROOT)
            self._stack.push_async_callback(proc.stop)
            await proc.start()
            self.sims.append(proc)
        epp_argv = [sys.executable, "-m", "epp.cli", "serve", *LOCAL_SERVE_FLAGS, "--drain-quiet-period", "0", "--bind-address", "127.0.0.1",
                    "--grpc-port", str(self.grpc_port),
                    "--grpc-health-port", str(self.health_port),
                    "--metrics-port", str(self.metrics_port),
                    "--endpoints-file", str(self.epp_file), "--log-level", self.log_level,
                    *self.epp_args]
        if self.config_file is not None:
            epp_argv += ["--config-file", str(self.config_file)]
        elif self.config_text is not None:
            epp_argv += ["--config-text", self.config_text]
        self.epp = ManagedProcess(epp_argv, log_path=self.workdir / "epp.log", env=self.env,
                                  cwd=ROOT)
        self._stack.push_async_callback(self.epp.stop)
        await self.epp.start()
        try:
            for p in self.layout.pods:
                await wait_port("127.0.0.1", p.port, timeout=30)
            await wait_port("127.0.0.1", self.grpc_port, timeout=30)
        except TimeoutError as e:
            tails = "\n".join(f"--- {s.log_path.name} ---\n{s.log_tail()}"
                              for s in [*self.sims, self.epp])
            raise RuntimeError(f"the P/D stack did not start ({e}):\n{tails}") from None
        self._stack.push_async_callback(self.envoy.stop)
        await self.envoy.start(render_envoy_config(
            listen_port=self.port, epp_port=self.grpc_port, admin_port=free_port(),
            body_mode=self.body_mode, response_path=self.response_path),
            self.workdir / "envoy")
        await self.envoy.wait_ready()

    async def stop(self) -> None:
        await self._stack.aclose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------ observations

    async def pair_stats(self, session: aiohttp.ClientSession) -> PairStats:
        """The decode pods' P/D counters, summed."""
        total = PairStats()
        for p in self.layout.by_role("decode"):
            async with session.get(f"http://{p.key}/debug/state") as r:
                pd = (await r.json())["pd"]
            total.remote_prefills += pd["remote_prefills"]
            total.prefill_failures += pd["prefill_failures"]
            total.fallbacks += pd["fallbacks"]
            total.by_distance.update(pd["by_distance"])
            total.by_prefiller.update(pd["by_prefiller"])
        return total

    async def decisions(self, session: aiohttp.ClientSession) -> dict[str, float]:
        """``epp_pd_decisions_total`` by decision type, from the EPP's /metrics."""
        async with session.get(self.metrics_url) as r:
            text = await r.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("epp_pd_decisions_total{"):
                kind = line.split('decision_type="', 1)[1].split('"', 1)[0]
                out[kind] = out.get(kind, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    async def clear_debug(self, session: aiohttp.ClientSession) -> None:
        for p in self.layout.pods:
            async with session.delete(f"http://{p.key}/debug/requests") as r:
                assert r.status in (200, 204)
