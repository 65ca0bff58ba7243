"""The event loop the EPP's serving processes run on.

uvloop (libuv) where it is installed — a dependency on Linux and macOS — else asyncio's
own loop; ``EPP_EVENT_LOOP=asyncio`` in the environment forces asyncio's (for
comparisons, or to rule uvloop out when debugging). Measured with ``bench/throughput.py`` (docs/benchmarks.md, "Gateway
throughput"): uvloop cuts the EPP's CPU per request by about a fifth, almost all of it
in the per-message wake-ups between grpc.aio and the loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop when available."""
    if os.environ.get("EPP_EVENT_LOOP", "").lower() == "asyncio":
        return asyncio.run(main)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop wheels
        return asyncio.run(main)
    return uvloop.run(main)
