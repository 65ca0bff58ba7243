"""GIE v1.5.0 test/integration/epp/datalayer_integration_test.go
(TestFullDuplexStreamed_DataLayer): common_tests.go's cases through the data layer, with
GIE's testdata/datalayer-config.yaml, through real Envoy → ``epp serve`` → fake pods.

Go swaps its fake metrics client for a test-only ``mock-metrics-source`` data source that
hands the pods' metrics to the endpoints. Here the data layer is the real one: the config
is GIE's file with ``mock-metrics-source`` replaced by ``metrics-data-source`` feeding
``core-metrics-extractor``, and each fake pod serves its ``P(queue, kv, models…)`` state
on vLLM's /metrics (tests/integration/gie_harness.py). GIE's default-config.yaml, which
test_gie_hermetic.py runs, sets ``enableLegacyMetrics``; this file does not, so the same
decisions come out of the data-layer path.

k8s_datasource_integration_test.go and runtime_notification_test.go need an API server:
tests/unit/gie/test_datalayer_notifications.py runs them against the fake one;
runtime_polling_test.go is tests/unit/gie/test_datalayer_polling.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.gie_harness import (
    FIXTURES,
    MODEL_MY,
    MODEL_MY_TARGET,
    MODEL_SQL_LORA,
    MODEL_SQL_LORA_TARGET,
    P,
    client_session,
    expect_error,
    expect_ready_pods,
    expect_request_total,
    expect_routed,
    llm_body,
    llm_headers,
    send,
    stacks,
)

pytestmark = pytest.mark.integration

GIE_CONFIG = (FIXTURES / "test/integration/epp/testdata/datalayer-config.yaml").read_text(
    encoding="utf-8")
# GIE's file, its test-only source replaced by the real pair.
DATALAYER_CONFIG = (GIE_CONFIG
                    .replace("  - type: mock-metrics-source\n",
                             "  - type: metrics-data-source\n"
                             "  - type: core-metrics-extractor\n")
                    .replace("  - pluginRef: mock-metrics-source\n",
                             "  - pluginRef: metrics-data-source\n"
                             "    extractors:\n"
                             "    - pluginRef: core-metrics-extractor\n"))


def test_config_is_gies_with_the_real_source() -> None:
    assert "mock-metrics-source" not in DATALAYER_CONFIG
    assert "enableLegacyMetrics" not in DATALAYER_CONFIG
    assert DATALAYER_CONFIG.count("metrics-data-source") == 2


@pytest.fixture
async def datalayer(tmp_path: Path) -> AsyncIterator[Any]:
    async with stacks(tmp_path) as s:
        async def start(pods: list[Any]) -> Any:
            return await s.start(pods, config=DATALAYER_CONFIG)
        yield start


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with client_session() as s:
        yield s


async def test_select_lower_queue_and_kv_cache(datalayer: Any,
                                               session: aiohttp.ClientSession) -> None:
    h = await datalayer([P(3, 0.2), P(0, 0.1), P(10, 0.2)])
    status, _, _ = await send(session, h, llm_headers(MODEL_MY, MODEL_MY_TARGET),
                              llm_body("test1", MODEL_MY))
    assert status == 200
    expect_routed(h, 1, llm_body("test1", MODEL_MY_TARGET))
    await expect_request_total(session, h, MODEL_MY, MODEL_MY_TARGET)
    expect_ready_pods(await h.metrics(session), 3)


async def test_select_active_lora_low_queue(datalayer: Any,
                                            session: aiohttp.ClientSession) -> None:
    h = await datalayer([P(0, 0.2, "foo", "bar"), P(0, 0.1, "foo", MODEL_SQL_LORA_TARGET),
                         P(10, 0.2, "foo", "bar")])
    status, _, _ = await send(session, h, llm_headers(MODEL_SQL_LORA, MODEL_SQL_LORA_TARGET),
                              llm_body("test2", MODEL_SQL_LORA))
    assert status == 200
    expect_routed(h, 1, llm_body("test2", MODEL_SQL_LORA_TARGET))
    await expect_request_total(session, h, MODEL_SQL_LORA, MODEL_SQL_LORA_TARGET)


@pytest.mark.xfail(strict=True, reason=(
    "no backend pods: Go answers 500 'inference error: Internal - no pods available in "
    "datastore'; this EPP answers 503 (no ready endpoints), as in test_gie_hermetic.py"))
async def test_no_backend_pods_available(datalayer: Any,
                                         session: aiohttp.ClientSession) -> None:
    h = await datalayer([])
    status, headers, body = await send(session, h, {"content-type": "application/json"},
                                       method="GET", path="/")
    await expect_error(status, headers, body, 500)


async def test_request_missing_model_field(datalayer: Any,
                                           session: aiohttp.ClientSession) -> None:
    h = await datalayer([])
    status, headers, body = await send(session, h, {"content-type": "application/json"},
                                       b'{"prompt":"hello world"}')
    await expect_error(status, headers, body, 400)
