"""The event loop the EPP's serving processes run on.

uvloop (libuv) where it is installed — a dependency on Linux and macOS — else asyncio's
own loop; ``EPP_EVENT_LOOP=asyncio`` in the environment forces asyncio's (for
comparisons, or to rule uvloop out when debugging). Measured with ``bench/throughput.py`` (docs/benchmarks.md, "Gateway
throughput"): uvloop cuts the EPP's CPU per request by about a fifth, almost all of it
in the per-message wake-ups between grpc.aio and the loop.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: The collector's youngest-generation threshold once serving (Python's default: 700).
GC_GEN0_THRESHOLD = 20_000


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop when available."""
    if os.environ.get("EPP_EVENT_LOOP", "").lower() == "asyncio":
        return asyncio.run(main)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop wheels
        return asyncio.run(main)
    return uvloop.run(main)


def tune_gc() -> None:
    """Call once start-up is done. ``gc.freeze()`` moves everything built so far (modules,
    config, plugins, gRPC) out of the cyclic collector's sight, and the youngest
    generation is collected every ``GC_GEN0_THRESHOLD`` allocations instead of 700:
    the request path, the KV-event index and the scrapers allocate containers that die
    young, which Python's default thresholds traverse over and over. Measured on the
    precise prefix path (docs/benchmarks.md, "Precise prefix"): with the defaults, 500
    young and 45 middle collections and 4 full ones (up to 67 ms each) in a 50-second
    run."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)
