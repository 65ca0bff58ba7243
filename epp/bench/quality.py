"""``epp bench``: routing quality, side by side.

For each router — this EPP behind Envoy (ext_proc, the lean gateway shape; ``epp-inline``
for GIE's), Envoy round robin, Envoy random, and
``sglang-router --policy cache_aware`` when it can be installed — start *fresh*
simulated pods (one ``epp sim`` process per pod, cold caches), the router in front of
them, and play the same open-loop trace (:mod:`epp.bench.traces`) through it. Then
report TTFT and end-to-end latency percentiles, the prefix-cache hit rate (cached prompt
tokens / prompt tokens, from the responses' usage), throughput, errors and per-pod share,
next to the offline ceiling (:mod:`epp.bench.ceiling`) for the same trace; write
``results.json`` and ``chart.png`` and print a table.

Routers run one after another, each stack stopped before the next starts, so they do not
compete for the CPU. ``--repeat K`` plays the rounds K times (router order rotating)
and reports the median of each metric over the rounds. Everything listens on 127.0.0.1
and every run is bounded by its trace (count) and ``--duration`` plus a drain timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import shlex
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Self

import aiohttp
import yaml

from epp.bench.ceiling import Replay, ceiling
from epp.bench.tokenizer import trace_words, write_bench_tokenizer
from epp.bench.traces import (
    OVERLOAD_WORKLOAD,
    WORKLOADS,
    SimCosts,
    TraceRequest,
    capacity,
    default_shape,
    make_trace,
)
from epp.sim.config import SimConfig
from epp.sim.options import build_parser, config_from_args
from epp.stack.envoy import (
    DEFAULT_RESPONSE_PATH,
    RESPONSE_PATH_INLINE,
    RESPONSE_PATH_LEAN,
    RESPONSE_PATH_OBSERVER,
    EnvoyProcess,
    render_envoy_config,
    without_ext_proc,
)
from epp.stack.procs import (
    LOCAL_SERVE_FLAGS,
    ManagedProcess,
    free_port,
    sim_kv_events_args,
    wait_port,
)
from epp.stack.runner import Result, stream_chat

MODEL: Final = "sim-model"
ROUTERS: Final = ("epp", "round-robin", "random", "sglang")
SGLANG_REQUIREMENT: Final = "sglang-router>=0.3,<0.4"

#: Realistic step costs (docs/simulator.md): prefill dominates TTFT, so a cache hit saves
#: far more than the EPP's own per-request overhead costs.
BASE_SIM_ARGS: Final = "--prefill-ms-per-token 0.05 --decode-base-ms 10 --decode-per-seq-ms 0.1"
#: KV pool per pod (blocks of 16 tokens), per workload. shared-prefix: the 100 distinct
#: 3,000-token prefixes are 2.3× the 4 pods' combined 128k tokens.
NUM_GPU_BLOCKS: Final = {"shared-prefix": 2000, "multi-turn": 4000, "hot-spot": 2000,
                         "mix": 3000}
SMOKE_NUM_GPU_BLOCKS: Final = 64

# Targets of issue 4.
TARGET_HIT_VS_BOUND: Final = 0.95
TARGET_TTFT_P90_VS_RR_SHARED_PREFIX: Final = 0.75
# Targets of issue 15 (precise prefix routing), on the capacity-bound shared-prefix load.
TARGET_PRECISE_HIT_VS_STATIC: Final = 0.98


# ----------------------------------------------------------------- routers


#: Not in the default set: the EPP behind Envoy in GIE's gateway shape (the response
#: through the EPP too; docs/architecture.md "Gateway shapes"), for comparison with the
#: shipped lean shape the ``epp`` router uses ...
EPP_INLINE: Final = "epp-inline"
#: ... and with the split response path (a routing filter plus an observability-mode
#: filter; docs/architecture.md "Response observer").
EPP_OBSERVER: Final = "epp-observer"
#: EPP router name → the Envoy gateway shape it runs behind.
EPP_ROUTERS: Final[dict[str, str]] = {"epp": RESPONSE_PATH_LEAN, EPP_INLINE: RESPONSE_PATH_INLINE,
                                      EPP_OBSERVER: RESPONSE_PATH_OBSERVER}
#: The EPP with precise prefix-cache routing (issue 15), behind the lean shape: its pods
#: publish vLLM KV events (each on its HTTP port + N), and the EPP runs
#: :data:`PRECISE_CONFIG` (or ``epp-precise=FILE``), with ``${TOKENIZER_PATH}``,
#: ``${KV_EVENTS_PORT_OFFSET}`` (N) and, when the file uses it, ``${TOKENIZE_URL}`` filled
#: in. ``${TOKENIZER_PATH}`` is a ``tokenizer.json`` that tokenizes the bench's prompts as
#: the simulators do (:mod:`epp.bench.tokenizer`), for the in-process backend — the
#: model's own tokenizer beside a real vLLM; ``${TOKENIZE_URL}`` is ``/tokenize`` on one
#: more ``epp sim`` that serves no traffic (llm-d's render-sidecar deployment).
EPP_PRECISE: Final = "epp-precise"
#: The built-in default config with the approximate producer replaced by the precise one
#: (same scorers, same weights), speculative indexing on as llm-d's perf config, the
#: approximate producer's balance guard (``balanceAbsThreshold``, this project's) for
#: popular prefixes only (``balancePopularOnly``, as the default has it since session 15),
#: its ``avoidQueueing`` (as the default has it since session 14; on the precise producer
#: since session 17),
#: tokenization in process with the prefix store (``token-producer`` ``local``), and
#: ``pending-prefill-scorer`` (weight 1): the prefill work each pod's events show still
#: to do, so a miss goes to a pod that is not prefilling.
PRECISE_CONFIG: Final = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters:
    local:
      path: "${TOKENIZER_PATH}"
      prefixStore: {blockSize: 256, cacheSize: 500000, minPrefixOverlapRatio: 0.8}
- type: endpoint-notification-source
- type: metrics-data-source
- type: core-metrics-extractor
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig: {blockSizeTokens: 16}
    speculativeIndexing: true
    balanceAbsThreshold: 4
    balancePopularOnly: true
    avoidQueueing: true
    kvEventsConfig:
      podDiscoveryConfig: {endpointPortOffset: ${KV_EVENTS_PORT_OFFSET}}
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}
- type: active-request-scorer
- type: no-hit-lru-scorer
  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: pending-prefill-scorer
- type: max-score-picker
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
  - pluginRef: endpoint-notification-source
    extractors: [{pluginRef: precise-prefix-cache-producer}]
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: active-request-scorer, weight: 1}
  - {pluginRef: no-hit-lru-scorer, weight: 1}
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: kv-cache-utilization-scorer, weight: 1}
  - {pluginRef: pending-prefill-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""


@dataclass(frozen=True, slots=True)
class RouterSpec:
    kind: str
    label: str
    config: str | None = None
    response_path: str = DEFAULT_RESPONSE_PATH
    #: The pods publish KV events and the EPP's config is a template (``epp-precise``).
    kv_events: bool = False


def parse_routers(text: str, config: str | None) -> list[RouterSpec]:
    """``epp,round-robin,random,sglang``; ``epp=FILE`` adds an EPP with that config
    (labelled ``epp:<file stem>``), so configs can be compared in one run;
    ``epp-inline[=FILE]`` is the EPP behind GIE's gateway shape (``epp`` runs behind the
    lean one), ``epp-observer[=FILE]`` behind the split response path."""
    out: list[RouterSpec] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        kind, _, path = item.partition("=")
        if kind == EPP_PRECISE:
            out.append(RouterSpec("epp", f"{kind}:{Path(path).stem}" if path else kind,
                                  str(Path(path).resolve()) if path else None,
                                  RESPONSE_PATH_LEAN, kv_events=True))
            continue
        if kind not in ROUTERS and kind not in EPP_ROUTERS:
            raise ValueError(f"unknown router {kind!r}; expected {', '.join(ROUTERS)} "
                             f"(or epp=CONFIG_FILE, {EPP_INLINE}[=CONFIG_FILE], "
                             f"{EPP_OBSERVER}[=CONFIG_FILE], {EPP_PRECISE}[=CONFIG_FILE])")
        if path and kind not in EPP_ROUTERS:
            raise ValueError(f"only epp takes a config file, got {item!r}")
        if kind in EPP_ROUTERS:
            cfg = path or config
            label = f"{kind}:{Path(path).stem}" if path else kind
            out.append(RouterSpec("epp", label, str(Path(cfg).resolve()) if cfg else None,
                                  EPP_ROUTERS[kind]))
        else:
            out.append(RouterSpec(kind, kind))
    labels = [r.label for r in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a router is named twice: {text!r}")
    if not out:
        raise ValueError("no router given")
    return out


def ensure_sglang(install: bool, log: Callable[[str], None] = print) -> str | None:
    """None when ``sglang_router`` can be used, else why not. With ``install``, a missing
    package is installed into this interpreter's environment with pip first."""
    if importlib.util.find_spec("sglang_router") is not None:
        return None
    if not install:
        return "sglang-router is not installed (pip install 'sglang-router>=0.3,<0.4')"
    log(f"installing {SGLANG_REQUIREMENT} into {sys.prefix} ...")
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", SGLANG_REQUIREMENT],
                           capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"pip install {SGLANG_REQUIREMENT} failed: {e}"
    importlib.invalidate_caches()
    if r.returncode != 0 or importlib.util.find_spec("sglang_router") is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return f"pip install {SGLANG_REQUIREMENT} failed: {' | '.join(tail) or r.returncode}"
    return None


def envoy_random_config(listen_port: int, admin_port: int, pods: Sequence[str]) -> str:
    """Envoy without ext_proc whose pool cluster balances with the RANDOM policy."""
    base = without_ext_proc(render_envoy_config(listen_port=listen_port, epp_port=admin_port,
                                                admin_port=admin_port, pool_endpoints=pods))
    doc = yaml.safe_load(base)
    for cluster in doc["static_resources"]["clusters"]:
        if cluster["name"] == "original_destination_cluster":
            cluster.pop("load_balancing_policy", None)
            cluster["lb_policy"] = "RANDOM"
    return str(yaml.safe_dump(doc, sort_keys=False))


class Stack:
    """One router and its fresh pods; ``url`` is where clients send requests."""

    def __init__(self, spec: RouterSpec, servers: int, sim_args: list[str], workdir: Path,
                 epp_args: Sequence[str] = (), *,
                 pod_args: Sequence[Sequence[str]] | None = None,
                 share_processes: bool = False, words: Iterable[str] = ()) -> None:
        """``pod_args``: extra ``epp sim`` arguments per pod, after ``sim_args`` (e.g. a
        pod's own costs). ``share_processes``: pods with the same arguments run in one
        ``epp sim`` process (one engine and port each) instead of one process per pod,
        which saves CPU and start-up time when there are many. ``words``: every word the
        trace sends (the vocabulary of ``${TOKENIZER_PATH}`` for precise routers)."""
        if pod_args is not None and len(pod_args) != servers:
            raise ValueError(f"pod_args has {len(pod_args)} entries for {servers} pods")
        self.spec = spec
        self.servers = servers
        self.sim_args = sim_args
        self.pod_args = [list(a) for a in pod_args] if pod_args else [[] for _ in range(servers)]
        self.share_processes = share_processes
        self.words = words
        self.workdir = workdir
        self.epp_args = list(epp_args)
        self.ports = [free_port() for _ in range(servers)]
        self.pods = [f"sim-{p}" for p in self.ports]
        self.url = ""
        #: The EPP's Prometheus port (router kind ``epp`` only; None for the others).
        self.metrics_port: int | None = None
        self._stack = AsyncExitStack()
        self._procs: list[tuple[str, ManagedProcess | EnvoyProcess]] = []

    def _managed(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(argv, log_path=self.workdir / f"{name}.log")
        self._procs.append((name, proc))
        self._stack.push_async_callback(proc.stop)
        return proc

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def log_tails(self) -> str:
        return "\n".join(f"--- {name} ---\n{p.log_tail(15)}" for name, p in self._procs)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each process of the stack has used so far, by role:
        ``epp``, ``envoy``, ``pods`` (summed), the router's own name otherwise. Linux
        (/proc); empty elsewhere."""
        out: dict[str, float] = {}
        for name, proc in self._procs:
            mp = proc.process if isinstance(proc, EnvoyProcess) else proc
            secs = _cpu_seconds(mp.pid) if mp is not None and mp.pid is not None else None
            if secs is None:
                continue
            role = "pods" if name.startswith("sim-") else name
            out[role] = out.get(role, 0.0) + secs
        return out

    async def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        events: list[str] = []
        tok_port: int | None = None
        if self.spec.kv_events:
            events, offset = sim_kv_events_args(self.ports)
            text = (Path(self.spec.config).read_text() if self.spec.config
                    else PRECISE_CONFIG)
            values = {"KV_EVENTS_PORT_OFFSET": str(offset),
                      "TOKENIZER_PATH": str(write_bench_tokenizer(self.workdir / "tokenizer",
                                                                  self.words))}
            if "${TOKENIZE_URL}" in text:  # tokenizing over HTTP: one more sim serves it
                tok_port = free_port()
                tokenizer = self._managed("tokenizer", [
                    sys.executable, "-m", "epp.cli", "sim", "--model", MODEL, *self.sim_args,
                    "--port", str(tok_port)])
                await tokenizer.start()
                values["TOKENIZE_URL"] = f"http://127.0.0.1:{tok_port}"
            try:
                text = string.Template(text).substitute(values)
            except (KeyError, ValueError) as e:
                raise ValueError(f"{self.spec.config}: only ${{TOKENIZER_PATH}}, "
                                 f"${{TOKENIZE_URL}} and ${{KV_EVENTS_PORT_OFFSET}} may be "
                                 f"filled in ({e})") from None
            precise_config = self.workdir / "precise.yaml"
            precise_config.write_text(text)
        batches: dict[tuple[str, ...], list[int]] = {}
        for i, (p, extra) in enumerate(zip(self.ports, self.pod_args, strict=True)):
            key = tuple(extra) if self.share_processes else (str(i), *extra)
            batches.setdefault(key, []).append(p)
        sims = [self._managed(f"sim-{ports[0]}", [
            sys.executable, "-m", "epp.cli", "sim", "--model", MODEL, *self.sim_args,
            *self.pod_args[self.ports.index(ports[0])], *events,
            *(a for p in ports for a in ("--port", str(p)))]) for ports in batches.values()]
        await asyncio.gather(*(s.start() for s in sims))
        await asyncio.gather(*(wait_port("127.0.0.1", p, timeout=30) for p in self.ports))
        if tok_port is not None:
            await wait_port("127.0.0.1", tok_port, timeout=30)
        addrs = [f"127.0.0.1:{p}" for p in self.ports]
        kind = self.spec.kind
        gw = free_port()
        if kind == "epp":
            grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
            self.metrics_port = metrics_port
            endpoints = self.workdir / "endpoints.yaml"
            endpoints.write_text(yaml.safe_dump({"endpoints": [
                {"address": "127.0.0.1", "port": p, "name": f"sim-{p}"} for p in self.ports]}))
            argv = [sys.executable, "-m", "epp.cli", "serve", *LOCAL_SERVE_FLAGS, "--drain-quiet-period", "0", "--bind-address", "127.0.0.1",
                    "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
                    "--metrics-port", str(metrics_port), "--endpoints-file", str(endpoints),
                    "--log-level", "warning", *self.epp_args]
            if self.spec.kv_events:
                argv += ["--config-file", str(precise_config)]
            elif self.spec.config:
                argv += ["--config-file", self.spec.config]
            epp = self._managed("epp", argv)
            await epp.start()
            await wait_port("127.0.0.1", grpc_port, timeout=30)
            await self._envoy(render_envoy_config(listen_port=gw, epp_port=grpc_port,
                                                  admin_port=free_port(),
                                                  response_path=self.spec.response_path))
            # Let the scraper see every pod once (cache_config_info for autoTune).
            await asyncio.sleep(1.0)
        elif kind == "round-robin":
            await self._envoy(without_ext_proc(render_envoy_config(
                listen_port=gw, epp_port=free_port(), admin_port=free_port(),
                pool_endpoints=addrs)))
        elif kind == "random":
            await self._envoy(envoy_random_config(gw, free_port(), addrs))
        elif kind == "sglang":
            router = self._managed("sglang-router", [
                sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(gw), "--policy", "cache_aware", "--log-level", "warn",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--worker-urls", *(f"http://{a}" for a in addrs)])
            await router.start()
            await wait_port("127.0.0.1", gw, timeout=60)
        else:  # pragma: no cover - parse_routers rejects it
            raise ValueError(kind)
        self.url = f"http://127.0.0.1:{gw}"
        await self._probe()

    async def _envoy(self, config: str) -> None:
        envoy = EnvoyProcess()
        self._procs.append(("envoy", envoy))
        self._stack.push_async_callback(envoy.stop)
        await envoy.start(config, self.workdir / "envoy")
        await envoy.wait_ready(timeout=30)

    async def _probe(self, timeout: float = 60.0) -> None:
        """Wait until a one-word chat request through the router succeeds (sglang-router
        answers before it has registered its workers)."""
        body = {"model": MODEL, "messages": [{"role": "user", "content": "ready"}],
                "max_tokens": 1}
        deadline = time.monotonic() + timeout
        last = ""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            while time.monotonic() < deadline:
                try:
                    async with s.post(self.url + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        if r.status == 200:
                            return
                        last = f"HTTP {r.status}"
                except (TimeoutError, aiohttp.ClientError) as e:
                    last = type(e).__name__
                await asyncio.sleep(0.25)
        raise TimeoutError(f"{self.spec.label}: no successful request within {timeout:g}s "
                           f"({last})")


def _cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process from /proc (None when it cannot be read)."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / ticks


async def pod_ttft(ports: Sequence[int]) -> tuple[float, int]:
    """(sum of seconds, count) of ``vllm:time_to_first_token_seconds`` over the pods: the
    TTFT as the model servers see it (engine arrival to first token), without the
    gateway's and the client's share."""
    total, count = 0.0, 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        for p in ports:
            try:
                async with s.get(f"http://127.0.0.1:{p}/metrics") as r:
                    text = await r.text()
            except (TimeoutError, aiohttp.ClientError):
                continue
            for line in text.splitlines():
                if line.startswith("vllm:time_to_first_token_seconds_sum"):
                    total += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:time_to_first_token_seconds_count"):
                    count += int(float(line.rsplit(" ", 1)[1]))
    return total, count


# ----------------------------------------------------------------- open-loop run


@dataclass(frozen=True, slots=True)
class Sample:
    index: int
    kind: str
    sent_at: float
    result: Result


async def play(url: str, trace: Sequence[TraceRequest], *, duration_s: float,
               drain_s: float = 30.0, model: str = MODEL,
               progress: Callable[[int, int, float], None] | None = None
               ) -> tuple[list[Sample], float, int]:
    """Send ``trace`` open loop; (samples, elapsed seconds, requests not sent or cut).

    Each request is sent at its planned time — and not before the answer to the request
    it follows (``after``). Nothing is sent after ``duration_s``; requests still in flight
    ``drain_s`` later are cancelled.
    """
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    done: dict[int, asyncio.Event] = {}
    for r in trace:
        if r.after is not None:
            done.setdefault(r.after, asyncio.Event())
    samples: list[Sample] = []
    skipped = 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + duration_s

    async def one(session: aiohttp.ClientSession, r: TraceRequest) -> None:
        nonlocal skipped
        try:
            if r.after is not None:
                await done[r.after].wait()
            if loop.time() >= deadline:
                skipped += 1
                return
            sent = loop.time() - start
            result, _ = await stream_chat(session, endpoint, r.body(model))
            samples.append(Sample(r.index, r.kind, sent, result))
        finally:
            ev = done.get(r.index)
            if ev is not None:
                ev.set()

    async def ticker() -> None:
        while progress is not None:
            await asyncio.sleep(1.0)
            progress(len(samples), sum(1 for s in samples if s.result.status != 200
                                       or s.result.error), loop.time() - start)

    timeout = aiohttp.ClientTimeout(total=duration_s + drain_s + 10)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks: list[asyncio.Task[None]] = []
        tick = asyncio.create_task(ticker())
        try:
            for r in trace:
                at = start + r.at
                if at >= deadline:
                    skipped += 1
                    continue
                delay = at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(session, r)))
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline + drain_s
                                                                    - loop.time()))
                for t in pending:
                    t.cancel()
                skipped += len(pending)
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            tick.cancel()
            for t in tasks:
                t.cancel()
    elapsed = (max((s.sent_at + s.result.latency_s for s in samples), default=0.0)
               if samples else loop.time() - start)
    return samples, elapsed, skipped


# ----------------------------------------------------------------- statistics


def quantile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (NaN for no data)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(samples: Sequence[Sample], elapsed_s: float, skipped: int,
              pods: Sequence[str]) -> dict[str, Any]:
    ok = [s.result for s in samples if s.result.status == 200 and not s.result.error]
    errors = Counter(s.result.error or f"HTTP {s.result.status}" for s in samples
                     if s.result.status != 200 or s.result.error)
    ttft = [r.ttft_s for r in ok]
    e2e = [r.latency_s for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    by_pod = Counter(r.server for r in ok)
    share = {f"pod{i}": by_pod.get(name, 0) / len(ok) if ok else 0.0
             for i, name in enumerate(pods)}
    other = sum(c for name, c in by_pod.items() if name not in pods)
    if other:
        share["other"] = other / len(ok)
    out: dict[str, Any] = {
        "requests": len(samples), "ok": len(ok), "errors": sum(errors.values()),
        "error_kinds": dict(errors), "not_sent_or_cut": skipped,
        "elapsed_s": elapsed_s, "throughput_rps": len(ok) / elapsed_s if elapsed_s else 0.0,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_mean_ms": 1000 * statistics.fmean(ttft) if ttft else float("nan"),
        "prompt_tokens": prompt, "cached_tokens": cached, "share": share,
        "share_max": max(share.values(), default=0.0),
        "share_sorted": sorted(share.values(), reverse=True),
    }
    for name, xs in (("ttft", ttft), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = 1000 * quantile(xs, q / 100)
    kinds = sorted({s.kind for s in samples})
    if len(kinds) > 1:
        out["by_kind"] = {}
        for k in kinds:
            kok = [s.result for s in samples if s.kind == k and s.result.status == 200
                   and not s.result.error]
            kp = sum(r.prompt_tokens for r in kok)
            out["by_kind"][k] = {
                "ok": len(kok),
                "ttft_p50_ms": 1000 * quantile([r.ttft_s for r in kok], 0.5),
                "ttft_p90_ms": 1000 * quantile([r.ttft_s for r in kok], 0.9),
                "hit_rate": sum(r.cached_tokens for r in kok) / kp if kp else 0.0,
            }
    return out


_MEDIAN_KEYS: Final = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms",
                       "e2e_p90_ms", "e2e_p99_ms", "hit_rate", "throughput_rps", "share_max")


def median_of(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-metric medians over rounds (sums for counts)."""
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rounds) for k in _MEDIAN_KEYS}
    for k in ("pod_ttft_mean_ms", "gateway_ttft_overhead_ms", "index_entries",
              "index_memory_bytes"):
        if all(k in r for r in rounds):
            out[k] = statistics.median(r[k] for r in rounds)
    if all("cpu_s" in r for r in rounds):
        roles = set.intersection(*(set(r["cpu_s"]) for r in rounds))
        out["cpu_s"] = {k: statistics.median(r["cpu_s"][k] for r in rounds)
                        for k in sorted(roles)}
    for k in ("requests", "ok", "errors", "not_sent_or_cut"):
        out[k] = sum(r[k] for r in rounds)
    kinds: Counter[str] = Counter()
    for r in rounds:
        kinds.update(r["error_kinds"])
    out["error_kinds"] = dict(kinds)
    pods = sorted({p for r in rounds for p in r["share"]})
    out["share"] = {p: statistics.median(r["share"].get(p, 0.0) for r in rounds) for p in pods}
    # Pods are fresh each round: compare the busiest with the busiest, and so on.
    width = max(len(r["share_sorted"]) for r in rounds)
    out["share_sorted"] = [statistics.median((r["share_sorted"] + [0.0] * width)[i]
                                             for r in rounds) for i in range(width)]
    if all("by_kind" in r for r in rounds):
        out["by_kind"] = {
            k: {m: statistics.median(r["by_kind"][k][m] for r in rounds
                                     if k in r["by_kind"])
                for m in ("ttft_p50_ms", "ttft_p90_ms", "hit_rate")}
            for k in rounds[0]["by_kind"]}
    out["rounds"] = len(rounds)
    return out


def verdicts(workload: str, results: dict[str, dict[str, Any]], bound: float,
             static: float | None = None) -> list[dict[str, Any]]:
    """The issue's targets, checked for every EPP router that ran (``static``: the
    static-affinity ceiling's hit rate, for issue 15's precise-routing targets)."""
    out: list[dict[str, Any]] = []
    rr = results.get("round-robin")
    sg = results.get("sglang")
    approx = results.get("epp")
    for label, m in results.items():
        if not label.startswith("epp"):
            continue
        if label.startswith(EPP_PRECISE):
            out += _precise_verdicts(workload, label, m, static, sg, approx)
        ratio = m["hit_rate"] / bound if bound else float("nan")
        out.append({"router": label, "target": f"hit rate >= {TARGET_HIT_VS_BOUND:.0%} of "
                    "the ceiling", "value": ratio, "met": ratio >= TARGET_HIT_VS_BOUND})
        p90 = m["ttft_p90_ms"]
        if workload == "shared-prefix" and rr:
            r = p90 / rr["ttft_p90_ms"]
            out.append({"router": label, "target": "TTFT p90 <= 0.75 x round-robin's",
                        "value": r, "met": r <= TARGET_TTFT_P90_VS_RR_SHARED_PREFIX})
        if workload == "multi-turn" and sg:
            r = p90 / sg["ttft_p90_ms"]
            out.append({"router": label, "target": "TTFT p90 <= sglang cache_aware's",
                        "value": r, "met": r <= 1.0})
        if workload == "hot-spot" and rr:
            r = p90 / rr["ttft_p90_ms"]
            out.append({"router": label, "target": "TTFT p90 <= round-robin's",
                        "value": r, "met": r <= 1.0})
    return out


def _precise_verdicts(workload: str, label: str, m: dict[str, Any], static: float | None,
                      sg: dict[str, Any] | None, approx: dict[str, Any] | None
                      ) -> list[dict[str, Any]]:
    """Issue 15: on shared-prefix (capacity-bound) hit rate >= 98% of static affinity's
    and TTFT p90 below sglang's; everywhere no worse than the approximate ``epp``."""
    out: list[dict[str, Any]] = []
    p90 = m["ttft_p90_ms"]
    if workload == "shared-prefix" and static:
        r = m["hit_rate"] / static
        out.append({"router": label, "target": f"hit rate >= {TARGET_PRECISE_HIT_VS_STATIC:.0%}"
                    " of static affinity's", "value": r, "met": r >= TARGET_PRECISE_HIT_VS_STATIC})
    if workload == "shared-prefix" and sg:
        r = p90 / sg["ttft_p90_ms"]
        out.append({"router": label, "target": "TTFT p90 < sglang cache_aware's",
                    "value": r, "met": r < 1.0})
    if approx:
        r = p90 / approx["ttft_p90_ms"]
        out.append({"router": label, "target": "TTFT p90 <= approximate (epp)'s",
                    "value": r, "met": r <= 1.0})
        r = m["hit_rate"] / approx["hit_rate"] if approx["hit_rate"] else float("nan")
        out.append({"router": label, "target": "hit rate >= approximate (epp)'s",
                    "value": r, "met": r >= 1.0})
    return out


async def index_memory(metrics_port: int) -> dict[str, float]:
    """The precise producer's index size from the EPP's /metrics: entries and estimated
    bytes (``llm_d_router_epp_kv_cache_index_entries`` / ``_memory_bytes``)."""
    want = {"llm_d_router_epp_kv_cache_index_entries": "index_entries",
            "llm_d_router_epp_kv_cache_index_memory_bytes": "index_memory_bytes"}
    out: dict[str, float] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s, \
            s.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in want:
            out[want[name]] = out.get(want[name], 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# ----------------------------------------------------------------- output


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0f}"


def _router_cpu(m: dict[str, Any]) -> str:
    """CPU seconds the routing process (the EPP, sglang-router) used while the trace
    played; "-" where Envoy routes alone (round robin, random) or /proc is missing."""
    cpu = m.get("cpu_s") or {}
    own = [v for k, v in cpu.items() if k not in ("envoy", "pods")]
    return f"{sum(own):.1f}" if own else "-"


def table(report: dict[str, Any]) -> str:
    results: dict[str, dict[str, Any]] = report["results"]
    bound = report["ceiling"]["bound"]["hit_rate"]
    labels = list(results)
    w = max(12, *(len(lbl) + 2 for lbl in labels))
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("TTFT p50 ms", lambda m: _ms(m["ttft_p50_ms"])),
        ("TTFT p90 ms", lambda m: _ms(m["ttft_p90_ms"])),
        ("TTFT p99 ms", lambda m: _ms(m["ttft_p99_ms"])),
        ("TTFT mean ms", lambda m: _ms(m["ttft_mean_ms"])),
        ("  at the pods", lambda m: _ms(m.get("pod_ttft_mean_ms", float("nan")))),
        ("  gateway+client", lambda m: _ms(m.get("gateway_ttft_overhead_ms", float("nan")))),
        ("e2e p50 ms", lambda m: _ms(m["e2e_p50_ms"])),
        ("e2e p90 ms", lambda m: _ms(m["e2e_p90_ms"])),
        ("e2e p99 ms", lambda m: _ms(m["e2e_p99_ms"])),
        ("hit rate", lambda m: f"{100 * m['hit_rate']:.1f}%"),
        ("hit / ceiling", lambda m: f"{m['hit_rate'] / bound:.3f}" if bound else "-"),
        ("throughput req/s", lambda m: f"{m['throughput_rps']:.2f}"),
        ("requests ok", lambda m: str(m["ok"])),
        ("errors", lambda m: str(m["errors"])),
        ("router CPU s", _router_cpu),
        ("busiest pod share", lambda m: f"{100 * m['share_max']:.0f}%"),
        ("pod shares %, busiest", lambda m: "/".join(f"{100 * v:.0f}"
                                                      for v in m["share_sorted"])),
    ]
    if any("index_entries" in m for m in results.values()):
        rows += [("index entries", lambda m: f"{m['index_entries']:.0f}"
                  if "index_entries" in m else "-"),
                 ("index memory MiB", lambda m: f"{m['index_memory_bytes'] / 2**20:.2f}"
                  if "index_memory_bytes" in m else "-")]
    c = report["ceiling"]
    w = max(w, 14)
    lines = [(f"workload {report['workload']}: {report['offered_rps']:.2f} req/s offered "
              f"({report['load_vs_capacity']:.0%} of the {report['capacity_rps']:.1f} req/s "
              f"cold-cache capacity), {report['duration_s']:g}s, {report['servers']} pods, "
              f"{report['rounds']} round(s)"),
             "ceiling (offline replay, hit rate): " + ", ".join(
                 f"{k} {100 * v['hit_rate']:.1f}%" for k, v in c.items() if k != "bound")
             + f"; bound {100 * bound:.1f}%",
             "", f"{'':24}" + "".join(f"{lbl:>{w}}" for lbl in labels)]
    def kind_p90(k: str) -> Callable[[dict[str, Any]], str]:
        return lambda m: _ms(m.get("by_kind", {}).get(k, {}).get("ttft_p90_ms", float("nan")))

    def kind_hit(k: str) -> Callable[[dict[str, Any]], str]:
        return lambda m: (f"{100 * m['by_kind'][k]['hit_rate']:.1f}%"
                          if k in m.get("by_kind", {}) else "-")

    for kind in sorted({k for m in results.values() for k in m.get("by_kind", {})}):
        rows.append((f"{kind} TTFT p90", kind_p90(kind)))
        rows.append((f"{kind} hit", kind_hit(kind)))
    for name, fn in rows:
        lines.append(f"{name:24}" + "".join(f"{fn(results[lbl]):>{w}}" for lbl in labels))
    if report.get("skipped"):
        for lbl, why in report["skipped"].items():
            lines.append(f"skipped {lbl}: {why}")
    for v in report["verdicts"]:
        lines.append(f"target [{v['router']}] {v['target']}: {v['value']:.3f} -> "
                     f"{'met' if v['met'] else 'NOT met'}")
    return "\n".join(lines)


def have_matplotlib(install: bool, log: Callable[[str], None] = print) -> bool:
    if importlib.util.find_spec("matplotlib") is not None:
        return True
    if not install:
        return False
    log("installing matplotlib for the chart ...")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"],
                       capture_output=True, text=True, timeout=300, check=False)
    importlib.invalidate_caches()
    return r.returncode == 0 and importlib.util.find_spec("matplotlib") is not None


def chart(report: dict[str, Any], path: Path) -> None:
    """A PNG: TTFT percentiles, hit rate against the ceiling, and per-pod share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: dict[str, dict[str, Any]] = report["results"]
    labels = list(results)
    x = range(len(labels))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    width = 0.27
    for j, q in enumerate((50, 90, 99)):
        ax.bar([i + (j - 1) * width for i in x], [results[lbl][f"ttft_p{q}_ms"] for lbl in labels],
               width, label=f"p{q}")
    ax.set_xticks(list(x), labels, rotation=15)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("time to first token")
    ax.legend()
    ax = axes[1]
    ax.bar(list(x), [100 * results[lbl]["hit_rate"] for lbl in labels], color="tab:green")
    bound = 100 * report["ceiling"]["bound"]["hit_rate"]
    ax.axhline(bound, color="black", linestyle="--", label=f"ceiling {bound:.0f}%")
    ax.axhline(TARGET_HIT_VS_BOUND * bound, color="grey", linestyle=":",
               label="95% of ceiling")
    ax.set_xticks(list(x), labels, rotation=15)
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_title("cached prompt tokens / prompt tokens")
    ax.legend(loc="lower right")
    ax = axes[2]
    width_pods = max(len(results[lbl]["share_sorted"]) for lbl in labels)
    bottom = [0.0] * len(labels)
    for i in range(width_pods):
        vals = [100 * (results[lbl]["share_sorted"][i]
                       if i < len(results[lbl]["share_sorted"]) else 0.0) for lbl in labels]
        ax.bar(list(x), vals, bottom=bottom,
               label="busiest pod" if i == 0 else f"pod #{i + 1}")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(list(x), labels, rotation=15)
    ax.set_ylabel("share of requests (%)")
    ax.set_title("per-pod share, busiest first")
    ax.legend(fontsize="small")
    fig.suptitle(f"epp bench — {report['workload']}, {report['offered_rps']:.1f} req/s, "
                 f"{report['servers']} pods")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def text_chart(report: dict[str, Any]) -> str:
    """The chart's content as text bars (when matplotlib is not available)."""
    results: dict[str, dict[str, Any]] = report["results"]
    top = max((m["ttft_p90_ms"] for m in results.values() if m["ttft_p90_ms"] == m["ttft_p90_ms"]),
              default=1.0) or 1.0
    lines = ["TTFT p90"]
    for lbl, m in results.items():
        v = m["ttft_p90_ms"]
        lines.append(f"  {lbl:14} {'#' * (0 if math.isnan(v) else round(40 * v / top))} {_ms(v)} ms")
    lines.append("hit rate (| = ceiling)")
    bound = report["ceiling"]["bound"]["hit_rate"]
    for lbl, m in results.items():
        bar = ["#" if i < round(40 * m["hit_rate"]) else " " for i in range(41)]
        bar[min(40, round(40 * bound))] = "|"
        lines.append(f"  {lbl:14} {''.join(bar)} {100 * m['hit_rate']:.1f}%")
    return "\n".join(lines)


# ----------------------------------------------------------------- the command


def sim_config(sim_args: list[str]) -> SimConfig:
    """The configuration ``epp sim`` runs the pods with for these options."""
    return config_from_args(build_parser().parse_args(["--port", "1", *sim_args]))


def effective_sim_args(workload: str, extra: str, smoke: bool) -> list[str]:
    blocks = SMOKE_NUM_GPU_BLOCKS if smoke else NUM_GPU_BLOCKS[workload]
    return [*shlex.split(BASE_SIM_ARGS), "--num-gpu-blocks", str(blocks), *shlex.split(extra)]


def _append_samples(path: Path, router: str, round_: int, samples: Sequence[Sample]) -> None:
    """Append one round's samples to ``samples.jsonl`` (a local file: fast enough to write
    on the loop between rounds)."""
    with open(path, "a") as f:
        f.writelines(json.dumps({"router": router, "round": round_, "index": smp.index,
                                 "kind": smp.kind, "sent_at": round(smp.sent_at, 4),
                                 **asdict(smp.result)}) + "\n" for smp in samples)


def _ceiling_json(c: dict[str, Replay]) -> dict[str, Any]:
    return {k: {"policy": v.policy, "hit_rate": v.hit_rate, "share": list(v.share)}
            for k, v in c.items()}


async def run_bench(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    smoke = args.smoke
    shape = default_shape(smoke)
    sim_args = effective_sim_args(args.workload, args.sim_args or "", smoke)
    cfg = sim_config(sim_args)
    costs = SimCosts(cfg.prefill_ms_per_token * cfg.time_scale, cfg.decode_base_ms * cfg.time_scale,
                     cfg.decode_per_seq_ms * cfg.time_scale, cfg.max_num_seqs,
                     cfg.num_gpu_blocks, cfg.block_size)
    # Capacity from the request mix (a long probe trace at a nominal rate).
    probe = make_trace(args.workload, 10.0, 120.0, seed=args.seed, shape=shape)
    cap = capacity(probe, costs, args.servers)
    rate = args.rate if args.rate else args.load * cap
    trace = make_trace(args.workload, rate, args.duration, seed=args.seed, shape=shape,
                       max_requests=args.max_requests)
    offered = len(trace) / args.duration
    log(f"epp bench: workload {args.workload}, {len(trace)} requests over {args.duration:g}s "
        f"({offered:.2f} req/s offered; cold-cache capacity {cap:.1f} req/s, so "
        f"{offered / cap:.0%}), {args.servers} pods")
    log(f"  sim args: {' '.join(sim_args)}")
    c = ceiling(trace, servers=args.servers, num_gpu_blocks=cfg.num_gpu_blocks,
                block_size=cfg.block_size)
    log("  ceiling (offline replay): " + ", ".join(
        f"{k} {100 * v.hit_rate:.1f}%" for k, v in c.items() if k != "bound"))
    routers = parse_routers(args.routers, args.config)
    skipped: dict[str, str] = {}
    if any(r.kind == "sglang" for r in routers):
        why = ensure_sglang(install=not smoke and not args.no_install, log=log)
        if why:
            log(f"  skipping sglang: {why}")
            skipped["sglang"] = why
            routers = [r for r in routers if r.kind != "sglang"]
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="epp-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "samples.jsonl").unlink(missing_ok=True)
    workdir = out_dir / "logs"
    log(f"  output in {out_dir}")
    rounds: dict[str, list[dict[str, Any]]] = {r.label: [] for r in routers}
    vocabulary = trace_words(r.messages for r in trace)
    for k in range(args.repeat):
        order = routers[k % len(routers):] + routers[:k % len(routers)]
        for spec in order:
            log(f"\n[{spec.label}] round {k + 1}/{args.repeat}: starting "
                f"{args.servers} fresh pods + router")
            try:
                async with Stack(spec, args.servers, sim_args,
                                 workdir / f"{spec.label.replace(':', '-')}-{k}",
                                 words=vocabulary) as stack:

                    def progress(n: int, errors: int, t: float, label: str = spec.label) -> None:
                        if args.progress:
                            log(f"  [{label}] {t:5.1f}s  {n:5d} done  {errors} errors")

                    cpu0 = stack.cpu_seconds()
                    samples, elapsed, cut = await play(stack.url, trace,
                                                       duration_s=args.duration,
                                                       drain_s=args.drain, progress=progress)
                    cpu1 = stack.cpu_seconds()
                    m = summarize(samples, elapsed, cut, stack.pods)
                    m["cpu_s"] = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
                    psum, pcount = await pod_ttft(stack.ports)
                    # The readiness probe is one of pcount; its TTFT is ~0.
                    m["pod_ttft_mean_ms"] = 1000 * psum / max(1, pcount - 1)
                    m["gateway_ttft_overhead_ms"] = m["ttft_mean_ms"] - m["pod_ttft_mean_ms"]
                    if spec.kv_events and stack.metrics_port is not None:
                        m.update(await index_memory(stack.metrics_port))
                    if m["ok"] == 0:
                        log(stack.log_tails())
            except (OSError, RuntimeError, TimeoutError) as e:
                if spec.kind != "sglang":
                    raise
                why = f"sglang-router did not start: {e}"
                log(f"  skipping sglang: {why}")
                skipped["sglang"] = why
                rounds.pop(spec.label, None)
                routers = [r for r in routers if r.kind != "sglang"]
                continue
            rounds[spec.label].append(m)
            _append_samples(out_dir / "samples.jsonl", spec.label, k, samples)
            log(f"  [{spec.label}] {m['ok']} ok, {m['errors']} errors, TTFT p90 "
                f"{_ms(m['ttft_p90_ms'])} ms, hit rate {100 * m['hit_rate']:.1f}%")
    results = {lbl: median_of(rs) for lbl, rs in rounds.items() if rs}
    bound = c["bound"].hit_rate
    report: dict[str, Any] = {
        "workload": args.workload, "seed": args.seed, "servers": args.servers,
        "duration_s": args.duration, "rounds": args.repeat, "smoke": smoke,
        "requests_planned": len(trace), "offered_rps": offered, "capacity_rps": cap,
        "load_vs_capacity": offered / cap if cap else float("nan"),
        "sim_args": sim_args, "routers": {r.label: asdict(r) for r in routers},
        "ceiling": _ceiling_json(c), "results": results,
        "per_round": rounds, "skipped": skipped,
        "verdicts": verdicts(args.workload, results, bound,
                             static=c["static-affinity"].hit_rate),
        "machine": {"python": sys.version.split()[0], "cpus": _cpus()},
    }
    (out_dir / "results.json").write_text(json.dumps(report, indent=2, default=_nan_safe))
    txt = table(report)
    (out_dir / "table.txt").write_text(txt + "\n")
    log("\n" + txt)
    if results:
        if have_matplotlib(install=not smoke and not args.no_install, log=log):
            chart(report, out_dir / "chart.png")
            log(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'chart.png'}")
        else:
            (out_dir / "chart.txt").write_text(text_chart(report) + "\n")
            log(f"\nmatplotlib is not available: wrote {out_dir / 'chart.txt'} (text bars) "
                f"and {out_dir / 'results.json'}")
    return report


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def _nan_safe(o: object) -> object:
    return str(o)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=(*WORKLOADS, OVERLOAD_WORKLOAD),
                   default="shared-prefix",
                   help="request mix (default shared-prefix), or overload: admission and "
                   "flow control under 2x overload; see docs/benchmarks.md")
    p.add_argument("--rate", type=float, default=0.0,
                   help="arrival rate in requests/s (Poisson); default: --load × the pods' "
                   "cold-cache capacity")
    p.add_argument("--load", type=float, default=0.65,
                   help="without --rate: fraction of the estimated capacity (default 0.65)")
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds of arrivals per router (default 60)")
    p.add_argument("--drain", type=float, default=None,
                   help="seconds to wait for requests in flight after the last arrival "
                   "(default 30; smoke 10; overload: --overload-s + 10, smoke + 5)")
    p.add_argument("--max-requests", type=int, default=None,
                   help="cap on requests per router (default: the trace's length)")
    p.add_argument("--routers", default=None,
                   help="comma-separated: epp (behind the lean gateway shape), "
                   "round-robin, random, sglang, epp=CONFIG, epp-inline[=CONFIG] (the EPP "
                   "behind GIE's shape, every response chunk through it), "
                   "epp-observer[=CONFIG] (the split response path), epp-precise[=CONFIG] "
                   "(precise prefix routing: pods publishing KV events; docs/benchmarks.md) "
                   f"(default {','.join(ROUTERS)}; smoke epp,round-robin,random); "
                   "overload: epp-flow-control, epp-legacy, round-robin, random, "
                   "epp=CONFIG (default epp-flow-control,epp-legacy,round-robin)")
    p.add_argument("--config", help="EndpointPickerConfig for the `epp` router "
                   "(default: built-in)")
    p.add_argument("--servers", type=int, default=None,
                   help="simulated pods (default 4; smoke and overload 2)")
    p.add_argument("--sim-args", default="",
                   help=f"extra `epp sim` options, after the defaults ({BASE_SIM_ARGS} "
                   "--num-gpu-blocks per workload)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds per router; the report gives medians (default 1)")
    p.add_argument("--seed", type=int, default=1, help="trace seed (default 1)")
    p.add_argument("--out", help="output directory (default: a new temporary directory)")
    p.add_argument("--smoke", action="store_true",
                   help="a quick check for CI: small prompts and pool, nothing installed")
    p.add_argument("--no-install", action="store_true",
                   help="do not pip-install sglang-router or matplotlib when missing")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no per-second progress lines")


def main(args: argparse.Namespace) -> int:
    """The routing-quality workloads (``--workload overload`` is
    :func:`epp.bench.overload.main`'s)."""
    if args.workload == OVERLOAD_WORKLOAD:
        print("epp bench: --workload overload is epp.bench.overload.main's", file=sys.stderr)
        return 2
    if any(getattr(args, k, None) is not None for k in ("baseline_s", "overload_s",
                                                         "queue_ttl")):
        print("epp bench: --baseline-s, --overload-s and --queue-ttl apply to --workload "
              "overload only", file=sys.stderr)
        return 2
    if args.drain is None:
        args.drain = 10.0 if args.smoke else 30.0
    if args.servers is None:
        args.servers = 2 if args.smoke else 4
    if args.routers is None:
        args.routers = "epp,round-robin,random" if args.smoke else ",".join(ROUTERS)
    if args.smoke:
        # Seconds, not minutes; only the routers that need nothing installed.
        if args.duration == 60.0:
            args.duration = 4.0
        if not args.rate:
            args.rate = 15.0
    if args.servers < 1 or args.duration <= 0 or args.repeat < 1:
        print("epp bench: --servers, --duration and --repeat must be positive", file=sys.stderr)
        return 2
    try:
        parse_routers(args.routers, args.config)
        report = asyncio.run(run_bench(args, log=lambda s: print(s, flush=True)))
    except ValueError as e:
        print(f"epp bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nstopped; everything the bench started has been stopped")
        return 130
    ok = all(m["ok"] > 0 for m in report["results"].values()) and report["results"]
    return 0 if ok else 1
