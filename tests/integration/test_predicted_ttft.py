"""predicted-ttft-scorer through real Envoy → `epp serve` → fake pods (issue 17), and the
project default's cold start (GIE's hermetic "least queue" case under the built-in
default; the no-hit-lru fix).

The pods are the GIE hermetic harness's (tests/integration/gie_harness.py): each reports a
fixed waiting queue in its /metrics. A first request is pinned to pod 0 with the
harness's subset header, so pod 0 holds its prefix; the second request, unpinned, shares
that 2,000-token prefix.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from epp.config.loader import DEFAULT_CONFIG_TEXT
from tests.integration.gie_harness import (
    MODEL_MY,
    MODEL_MY_TARGET,
    SUBSET_HEADER,
    P,
    client_session,
    llm_body,
    llm_headers,
    send,
    stacks,
)

pytestmark = pytest.mark.integration

CONFIG = (Path(__file__).resolve().parents[2] / "config" / "predicted-ttft.yaml").read_text()
PREFIX = "s" * 8000  # 2,000 tokens


@pytest.fixture
async def hermetic(tmp_path: Path) -> AsyncIterator[Any]:
    async with stacks(tmp_path) as s:
        yield s.start


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with client_session() as s:
        yield s


async def _prefix_then_follow_up(h: Any, session: aiohttp.ClientSession) -> int:
    """Pin a request with PREFIX to pod 0, then send one sharing it; where it went."""
    headers = llm_headers(MODEL_MY, MODEL_MY_TARGET)
    status, _, _ = await send(session, h, {**headers, SUBSET_HEADER: h.key(0)},
                              llm_body(PREFIX + " first", MODEL_MY))
    assert status == 200
    assert [s.idx for s in h.seen] == [0]
    status, _, _ = await send(session, h, headers, llm_body(PREFIX + " second", MODEL_MY))
    assert status == 200
    idx: int = h.seen[-1].idx
    return idx


async def test_goes_to_the_prefix_when_queues_are_equal(
        hermetic: Any, session: aiohttp.ClientSession) -> None:
    h = await hermetic([P(0, 0.1), P(0, 0.1)], config=CONFIG)
    assert await _prefix_then_follow_up(h, session) == 0


async def test_goes_away_when_the_queue_outweighs_the_saved_prefill(
        hermetic: Any, session: aiohttp.ClientSession) -> None:
    # Pod 0 has 3 requests waiting (≈ 3 × 2,000 tokens ahead) against the 2,000 tokens
    # its cache saves: pod 1 is predicted to answer first.
    h = await hermetic([P(3, 0.1), P(0, 0.1)], config=CONFIG)
    assert await _prefix_then_follow_up(h, session) == 1


async def test_project_default_least_queue(hermetic: Any,
                                           session: aiohttp.ClientSession) -> None:
    # GIE's test_select_lower_queue_and_kv_cache, under the built-in default.
    h = await hermetic([P(3, 0.2), P(0, 0.1), P(10, 0.2)], config=DEFAULT_CONFIG_TEXT)
    status, _, _ = await send(session, h, llm_headers(MODEL_MY, MODEL_MY_TARGET),
                              llm_body("test1", MODEL_MY))
    assert status == 200
    assert [s.idx for s in h.seen] == [1]
