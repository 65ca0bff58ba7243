"""The EPP's CPU per request with and without metrics recording (issue 7).

Each request is the EPP's whole in-process work for one Envoy ext_proc stream in
FULL_DUPLEX_STREAMED mode, as `epp serve` wires it: an ``ExtProcStream`` over a real
``Director`` handles the request headers, the request body (JSON parse, scheduling with
the built-in default config — queue 2, kv-cache 2, prefix-cache 3, max-score picker — over
``--endpoints`` endpoints, routing headers), the response headers and the response body
(usage parsing), then the stream's end (the outcome counter). Only the gRPC transport is
left out; it is the same in both cases.

The same loop runs with

- ``metrics``: the real ``EppMetrics`` and its per-plugin timer, recording exactly what the
  server records per request (request total, running gauge inc/dec, duration, input /
  output / cached token histograms, scheduler end-to-end and one plugin-duration
  observation per plugin call, ext_proc stream outcome);
- ``no-plugin-timer``: the real ``EppMetrics`` without the per-plugin timer (what the
  ``inference_extension_plugin_duration_seconds`` observations cost);
- ``no-op``: a stand-in with the same attributes whose ``labels()``/``inc()``/``dec()``/
  ``observe()`` do nothing, and the scheduler's no-op timer. (Each recording point still
  costs a Python call to the stand-in, so the difference slightly under-states the cost.)

Blocks of requests rotate between the cases (so drift and noise hit both alike); CPU is
``time.process_time()`` of this process. Prints the median CPU per request of each, the
difference and its share, and what one ``/metrics`` exposition costs.

    .venv/bin/python -m bench.metrics_cost                    # ~30 s
    .venv/bin/python -m bench.metrics_cost --blocks 4 --requests 300   # smoke, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any

import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import generate_latest

from epp.config.loader import load_and_build
from epp.datastore.store import Datastore
from epp.handlers.extproc import ExtProcStream
from epp.observability.metrics import EppMetrics
from epp.requestcontrol import director as director_mod
from epp.scheduling.types import Endpoint, Metrics

FD = ProcessingMode.FULL_DUPLEX_STREAMED
MAX_BODY = 64 << 20


class _Noop:
    """A counter/gauge/histogram (and its children) that records nothing."""

    __slots__ = ()

    def labels(self, *args: Any, **kwargs: Any) -> _Noop:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> None:  # any record_* method
        return None

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


_NOOP = _Noop()


class NoopMetrics:
    """Quacks like ``EppMetrics`` for the Director and the scheduler; records nothing."""

    def __getattr__(self, name: str) -> _Noop:  # any metric added later
        return _NOOP

    request_total = request_error_total = request_duration = _NOOP
    input_tokens = output_tokens = cached_tokens = running_requests = _NOOP
    scheduler_e2e = plugin_duration = pd_decisions = extproc_streams = _NOOP

    def observe_plugin(self, extension_point: str, plugin: Any, seconds: float) -> None:
        pass


def _director(store: Datastore, built: Any, metrics: Any) -> Any:
    """The Director as `epp serve` builds it (over a SchedulingCore where there is one)."""
    args = (store, built.scheduler, metrics, built.pre_request, built.response_complete,
            built.request_headers, built.response_headers)
    director_cls: Any = director_mod.Director
    core: Any = getattr(director_mod, "SchedulingCore", None)
    return director_cls(core(*args)) if core is not None else director_cls(*args)


def _headers(hs: dict[str, str]) -> HeaderMap:
    return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])


def _messages(prompt: str, completion_tokens: int, cached: int) -> list[pb.ProcessingRequest]:
    """Envoy's messages for one request and its non-streamed response."""
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers({
        ":method": "POST", ":path": "/v1/chat/completions", ":authority": "gw",
        "content-type": "application/json"})))
    first.protocol_config.request_body_mode = FD
    first.protocol_config.response_body_mode = FD
    body = orjson.dumps({"model": "m", "max_tokens": completion_tokens,
                         "messages": [{"role": "user", "content": prompt}]})
    words = len(prompt.split())
    resp = orjson.dumps({"id": "x", "object": "chat.completion", "model": "m",
                         "choices": [{"index": 0, "finish_reason": "length",
                                      "message": {"role": "assistant", "content": "ok " * 8}}],
                         "usage": {"prompt_tokens": words, "completion_tokens": completion_tokens,
                                   "total_tokens": words + completion_tokens,
                                   "prompt_tokens_details": {"cached_tokens": cached}}})
    return [
        first,
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers({
            ":status": "200", "content-type": "application/json"}))),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=resp, end_of_stream=True)),
    ]


class Case:
    """One EPP (store, config, director) with real or no-op metrics."""

    def __init__(self, real: bool, endpoints: int, seed: int, plugin_timer: bool = True) -> None:
        rng = random.Random(seed)
        self.store = Datastore()
        self.store.set_endpoints([Endpoint(f"pod-{i}", "10.0.0.1", 8000 + i)
                                  for i in range(endpoints)])
        for e in self.store.snapshot():
            self.store.update_metrics(e.key, Metrics(
                waiting_queue_size=rng.randrange(0, 4), running_requests=rng.randrange(0, 16),
                kv_cache_usage=rng.random() * 0.8, block_size=16, num_blocks=65536,
                updated_at=time.monotonic()))
        self.metrics: Any = EppMetrics(self.store) if real else NoopMetrics()
        built = (load_and_build(None, None, timer=self.metrics.observe_plugin)
                 if real and plugin_timer else load_and_build(None, None))
        self.director = _director(self.store, built, self.metrics)
        self.outcomes: dict[str, Any] = {}

    def stream_ended(self, outcome: str) -> None:  # as EppServer._stream_ended
        child = self.outcomes.get(outcome)
        if child is None:
            child = self.outcomes[outcome] = self.metrics.extproc_streams.labels(outcome)
        child.inc()

    async def run(self, requests: list[list[pb.ProcessingRequest]]) -> None:
        for msgs in requests:
            stream = ExtProcStream(self.director, MAX_BODY)
            for m in msgs:
                await stream.handle(m)
            self.stream_ended(stream.finish())


def workload(n: int, seed: int, prompt_words: int) -> list[list[pb.ProcessingRequest]]:
    """Chat requests sharing one of 16 prefixes (so the prefix index matches)."""
    rng = random.Random(seed)
    prefixes = [" ".join(f"p{k}w{i}" for i in range(prompt_words)) for k in range(16)]
    return [_messages(f"{rng.choice(prefixes)} question {i}", rng.choice((16, 64, 256)),
                      rng.randrange(0, prompt_words)) for i in range(n)]


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    cases = {"metrics": Case(True, args.endpoints, args.seed),
             "no-plugin-timer": Case(True, args.endpoints, args.seed, plugin_timer=False),
             "no-op": Case(False, args.endpoints, args.seed)}
    reqs = workload(args.requests, args.seed, args.prompt_words)
    for c in cases.values():  # warm up: caches, prefix index, metric children
        await c.run(reqs[: max(50, args.requests // 5)])
    per_req: dict[str, list[float]] = {k: [] for k in cases}
    order = list(cases)
    for b in range(args.blocks):
        for name in order[b % 3:] + order[:b % 3]:
            t0 = time.process_time()
            await cases[name].run(reqs)
            per_req[name].append((time.process_time() - t0) / len(reqs))
    real: EppMetrics = cases["metrics"].metrics
    t0 = time.process_time()
    for _ in range(50):
        text = generate_latest(real.registry)
    expose_ms = (time.process_time() - t0) / 50 * 1e3
    with_us = statistics.median(per_req["metrics"]) * 1e6
    without_us = statistics.median(per_req["no-op"]) * 1e6
    no_timer_us = statistics.median(per_req["no-plugin-timer"]) * 1e6
    return {"endpoints": args.endpoints, "prompt_words": args.prompt_words,
            "requests_per_block": args.requests, "blocks": args.blocks,
            "cpu_us_per_request_with_metrics": round(with_us, 1),
            "cpu_us_per_request_without_metrics": round(without_us, 1),
            "metrics_cost_us_per_request": round(with_us - without_us, 1),
            "metrics_cost_share": round((with_us - without_us) / with_us, 4),
            "cpu_us_per_request_without_plugin_timer": round(no_timer_us, 1),
            "plugin_timer_cost_us_per_request": round(with_us - no_timer_us, 1),
            "spread_with_us": [round(min(per_req["metrics"]) * 1e6, 1),
                               round(max(per_req["metrics"]) * 1e6, 1)],
            "spread_without_us": [round(min(per_req["no-op"]) * 1e6, 1),
                                  round(max(per_req["no-op"]) * 1e6, 1)],
            "exposition_ms": round(expose_ms, 3), "exposition_bytes": len(text)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoints", type=int, default=16, help="endpoints in the pool")
    ap.add_argument("--prompt-words", type=int, default=200, help="shared prefix length")
    ap.add_argument("--requests", type=int, default=2000, help="requests per block")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per case (rotating)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the result to this file")
    args = ap.parse_args(argv)
    r = asyncio.run(measure(args))
    print(f"EPP CPU per request, {r['endpoints']} endpoints, default config, in-process "
          f"ext_proc handling ({r['blocks']} rotating blocks of {r['requests_per_block']}):")
    print(f"  with metrics    {r['cpu_us_per_request_with_metrics']:8.1f} µs  "
          f"(blocks {r['spread_with_us'][0]}..{r['spread_with_us'][1]})")
    print(f"  without (no-op) {r['cpu_us_per_request_without_metrics']:8.1f} µs  "
          f"(blocks {r['spread_without_us'][0]}..{r['spread_without_us'][1]})")
    print(f"  metrics cost    {r['metrics_cost_us_per_request']:8.1f} µs per request "
          f"({100 * r['metrics_cost_share']:.1f} %)")
    print(f"    of which the per-plugin timer "
          f"{r['plugin_timer_cost_us_per_request']:.1f} µs (metrics without it: "
          f"{r['cpu_us_per_request_without_plugin_timer']:.1f} µs)")
    print(f"  one /metrics exposition: {r['exposition_ms']:.2f} ms CPU, "
          f"{r['exposition_bytes']} bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
