"""Flow-control overhead per request: ``FlowController.enqueue_and_wait`` when the pool is
not saturated (issue 16).

Each request is one ``await fc.enqueue_and_wait(request)`` on the EPP's event loop
(uvloop; ``EPP_EVENT_LOOP=asyncio`` for asyncio's), timed alone with
``time.perf_counter_ns``: the capacity check, the queue insert, the dispatch cycle that
dispatches it (saturation callback, usage-limit ceilings, fairness pick, queue remove) and
the outcome bookkeeping. The saturation callback returns a constant, so what is measured
is flow control itself; the EPP's callback (a detector over the endpoints) comes on top.
Requests spread over ``--flows`` fairness IDs and ``--bands`` priorities (bands
provisioned from the default template, GIE's defaults: global-strict fairness, FCFS).

Cases, interleaved block by block so drift and noise hit each alike:

- ``metrics``: with :class:`FlowControlMetrics` recording GIE's six series (as the EPP
  will run it);
- ``no-metrics``: the controller alone;
- ``baseline``: awaiting a coroutine that returns at once (the cost of the await itself,
  not subtracted from the others).

A second measurement, ``queued``: ``--queued`` requests wait while the pool is saturated,
then saturation drops and one :meth:`FlowController.notify` per request releases them
(enqueue → wait → dispatch → wake-up), reported as CPU per request.

    .venv/bin/python -m bench.flowcontrol_overhead            # a few seconds
    .venv/bin/python -m bench.flowcontrol_overhead --smoke    # a second, for CI

Prints the median and p99 µs per request of each case; ``--json`` prints them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from epp.flowcontrol import (
    FlowController,
    FlowControlMetrics,
    FlowControlRequest,
    default_config,
)
from epp.server.loop import run


def _requests(n: int, flows: int, bands: int) -> list[FlowControlRequest]:
    return [FlowControlRequest(fairness_id=f"tenant-{i % flows}", priority=i % bands,
                               byte_size=2048, request_id=f"r{i}", model_name="m",
                               target_model_name="m")
            for i in range(n)]


async def _noop(_: FlowControlRequest) -> None:
    return None


async def _block(call: Any, requests: list[FlowControlRequest]) -> list[int]:
    clock = time.perf_counter_ns
    out = []
    for r in requests:
        t0 = clock()
        await call(r)
        out.append(clock() - t0)
    return out


def _quantile(xs: list[int], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0


async def _measure(blocks: int, per_block: int, flows: int, bands: int,
                   queued: int) -> dict[str, Any]:
    zero = lambda subset: 0.0
    with_metrics = FlowController(default_config(), zero, metrics=FlowControlMetrics())
    without = FlowController(default_config(), zero)
    await with_metrics.start()
    await without.start()
    requests = _requests(per_block, flows, bands)
    cases = {"metrics": with_metrics.enqueue_and_wait, "no-metrics": without.enqueue_and_wait,
             "baseline": _noop}
    samples: dict[str, list[int]] = {name: [] for name in cases}
    for name, call in cases.items():  # warm-up: every flow and band exists
        await _block(call, requests)
    for _ in range(blocks):
        for name, call in cases.items():
            samples[name] += await _block(call, requests)
    for fc in (with_metrics, without):
        s = fc.stats()
        assert s.dispatched == s.enqueued and s.queued == 0, s
        await fc.stop()
    out: dict[str, Any] = {
        name: {"median_us": round(_quantile(xs, 0.5), 2), "p99_us": round(_quantile(xs, 0.99), 2),
               "mean_us": round(statistics.fmean(xs) / 1000.0, 2), "requests": len(xs)}
        for name, xs in samples.items()}
    out["queued"] = await _queued(queued, flows, bands)
    out["settings"] = {"flows": flows, "bands": bands, "loop": type(asyncio.get_running_loop()).__module__}
    return out


async def _queued(n: int, flows: int, bands: int) -> dict[str, Any]:
    """CPU per request for the waiting path: queue n while saturated, then release."""
    saturation = [1.0]
    fc = FlowController(default_config(), lambda subset: saturation[0],
                        metrics=FlowControlMetrics(), dispatch_interval=3600.0)
    await fc.start()
    requests = _requests(n, flows, bands)
    cpu0 = time.process_time()
    tasks = [asyncio.ensure_future(fc.enqueue_and_wait(r)) for r in requests]
    await asyncio.sleep(0)  # every task enqueues and waits
    assert fc.stats().queued == n
    saturation[0] = 0.0
    while fc.stats().queued:
        fc.notify()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    cpu = time.process_time() - cpu0
    s = fc.stats()
    assert s.dispatched == s.enqueued == n, s
    await fc.stop()
    return {"cpu_us_per_request": round(cpu / n * 1e6, 2), "requests": n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--requests", type=int, default=2000, help="requests per block and case")
    p.add_argument("--flows", type=int, default=16)
    p.add_argument("--bands", type=int, default=3)
    p.add_argument("--queued", type=int, default=20000)
    p.add_argument("--smoke", action="store_true", help="a few blocks: checks it runs")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.smoke:
        a.blocks, a.requests, a.queued = 3, 300, 500
    r = run(_measure(a.blocks, a.requests, a.flows, a.bands, a.queued))
    if a.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"flow control, pool not saturated ({r['settings']['flows']} flows, "
          f"{r['settings']['bands']} bands, {r['settings']['loop']} loop)")
    print(f"{'case':<12} {'median µs':>10} {'p99 µs':>8} {'mean µs':>8} {'requests':>9}")
    for name in ("metrics", "no-metrics", "baseline"):
        c = r[name]
        print(f"{name:<12} {c['median_us']:>10.2f} {c['p99_us']:>8.2f} {c['mean_us']:>8.2f} "
              f"{c['requests']:>9}")
    q = r["queued"]
    print(f"queued then released: {q['cpu_us_per_request']:.2f} µs CPU per request "
          f"({q['requests']} requests, metrics on, one task each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
