"""A deterministic replay of requests through each shipped config, for the golden test.

The same request sequence (shared prefixes, LoRA models, session tokens, model rewrites,
explain requests, completions in between, metrics that change) goes through the Director
and the scheduling core built from each config under config/ and the built-in default;
every decision (destination, headers set upstream and on the response) is recorded.
``tests/golden/decisions.json`` holds the record made before the framework refactor
(issue 13); ``test_golden_decisions.py`` replays and compares. Regenerate it only for an
intended change of behaviour::

    .venv/bin/python -m tests.golden.decisions > tests/golden/decisions.json
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
from pathlib import Path
from typing import Any

import orjson

from epp.config.loader import load_and_build
from epp.datastore.store import Datastore
from epp.errors import EppError
from epp.observability.metrics import EppMetrics
from epp.requestcontrol.director import Director, SchedulingCore
from epp.scheduling.types import Endpoint, Metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["<default>"] + sorted(p.name for p in (ROOT / "config").glob("*.yaml"))
REQUESTS = 160

_ROLES = ["decode", "decode", "decode", "prefill", "prefill", "both"]


def _endpoints() -> list[Endpoint]:
    out = []
    for i, role in enumerate(_ROLES):
        labels = {"llm-d.ai/role": role, "app": "vllm",
                  "grove.io/podgang": f"gang-{i % 2}",
                  "app.kubernetes.io/part-of": "llm",
                  "grove.io/podcliqueset-replica-index": str(i % 2),
                  "leaderworkerset.sigs.k8s.io/worker-index": "0" if i < 4 else "1"}
        node = {"topology.kubernetes.io/rack": f"rack-{i % 3}",
                "topology.kubernetes.io/zone": "zone-a"}
        out.append(Endpoint(f"pod-{i}", f"10.0.0.{i + 1}", 8000, "default", labels,
                            f"node-{i}", node))
    return out


def _metrics(step: int, i: int) -> Metrics:
    r = random.Random(step * 31 + i)
    return Metrics(waiting_queue_size=r.randrange(0, 12), running_requests=r.randrange(0, 20),
                   kv_cache_usage=round(r.random(), 3),
                   active_loras=frozenset({"lora-a"} if i % 3 == 0 else {"lora-b"} if i % 3 == 1
                                          else set()),
                   waiting_loras=frozenset(), max_loras=2, block_size=16, num_blocks=4096,
                   updated_at=1.0)


def _request(i: int) -> tuple[dict[str, str], bytes]:
    r = random.Random(1000 + i)
    group = r.randrange(0, 5)
    system = f"You are assistant number {group}. " + "Follow the rules carefully. " * (20 + group * 7)
    question = f"Question {i}: " + "tell me more " * r.randrange(1, 30)
    model = r.choice(["llama", "llama", "lora-a", "lora-b"])
    headers = {":path": "/v1/chat/completions", ":method": "POST",
               "content-type": "application/json", "x-request-id": f"req-{i}"}
    if i % 7 == 0:
        headers["x-session-token"] = f"sess-{i % 3}"
    if i % 11 == 0:
        headers["x-gateway-model-name-rewrite"] = "llama-rewritten"
    if i % 13 == 0:
        headers["x-epp-explain"] = "true"
    if i % 4 == 0:
        headers[":path"] = "/v1/completions"
        body = {"model": model, "prompt": system + question, "max_tokens": 16}
    else:
        body = {"model": model, "max_tokens": 16, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": question}]}
    return headers, orjson.dumps(body)


async def replay(config: str) -> list[dict[str, Any]]:
    path = None if config == "<default>" else str(ROOT / "config" / config)
    built = load_and_build(path)
    seeded = 0
    for plugin in built.plugins.values():
        if hasattr(plugin, "_rng"):
            plugin._rng = random.Random(seeded)
            seeded += 1
        queues = getattr(plugin, "queues", None)
        if queues is not None:  # avoidQueueing's durations
            queues.clock = itertools.count(0.0, 0.01).__next__
        if getattr(plugin, "prefer_fast_endpoints", False):  # no-hit-lru's durations
            plugin.clock = itertools.count(0.0, 0.01).__next__
    store = Datastore()
    store.set_endpoints(_endpoints())
    for plugin in built.endpoint_removed:
        store.on_removed(lambda ep, p=plugin: p.endpoint_removed(ep.key))
    core = SchedulingCore(store, built.scheduler, EppMetrics(store), built.pre_request,
                          built.response_complete, built.request_headers,
                          built.response_headers, explain_header=True)
    director = Director(core)
    open_contexts: list[Any] = []
    out: list[dict[str, Any]] = []
    for i in range(REQUESTS):
        if i % 10 == 0:
            store.update_metrics_many({e.key: _metrics(i, n)
                                       for n, e in enumerate(store.snapshot())})
        headers, body = _request(i)
        try:
            routing = await director.route(headers, body, True, None)
        except EppError as e:
            out.append({"i": i, "error": f"{type(e).__name__}: {e}"})
            continue
        ctx = routing.context
        resp = dict(ctx.response_headers)
        explain = resp.pop("x-epp-explain", None)
        record_ = None if explain is None else orjson.loads(explain)
        if record_ is not None:
            record_.pop("time")
        out.append({"i": i, "destination": routing.destination,
                    "set_headers": {k: v for k, v in sorted(routing.set_headers.items())
                                    if k != "traceparent"},
                    "response_headers": dict(sorted(resp.items())),
                    "explain": record_})
        open_contexts.append(ctx)
        # Complete the oldest requests now and then, so in-flight counts rise and fall.
        while len(open_contexts) > 3 + i % 5:
            done = open_contexts.pop(0)
            director.on_response_headers(done, 200, {"content-type": "application/json"})
            director.on_done(done, aborted=(i % 17 == 0))
    return out


def record() -> dict[str, list[dict[str, Any]]]:
    return {config: asyncio.run(replay(config)) for config in CONFIGS}


if __name__ == "__main__":
    sys.stdout.buffer.write(orjson.dumps(record(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    sys.stdout.write("\n")
