"""llm-d-router v0.10.0's ``triton`` engine (Triton Inference Server's standard metrics) and
its ``triton-tensorrt-llm`` one, in ``core-metrics-extractor``'s built-in table
(epp/datalayer/engines.py; llm-d: pkg/epp/framework/plugins/datalayer/extractor/metrics/
factories.go ``defaultEngineConfigs``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from epp import keys
from epp.datalayer.engines import ENGINE_TRITON, EngineMappings, builtin_mappings
from epp.datalayer.promparse import SampleIndex
from epp.datalayer.scraper import MetricsScraper
from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import decode_params
from epp.scheduling.plugins.datalayer import CoreMetricsExtractor
from tests.polling import eventually
from tests.unit.datalayer.test_scraper import Pods, fixture, metrics, opts

# A Triton server's /metrics (standard metrics, two models loaded), as Triton writes it.
TRITON = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="resnet50",version="1"} 120
# HELP nv_inference_count Number of inferences performed (does not include cached requests)
# TYPE nv_inference_count counter
nv_inference_count{model="resnet50",version="1"} 480
# HELP nv_inference_exec_count Number of model executions performed (does not include cached requests)
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="resnet50",version="1"} 57
nv_inference_exec_count{model="densenet",version="1"} 9
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="resnet50",version="1"} 4
nv_inference_pending_request_count{model="densenet",version="1"} 0
# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{gpu_uuid="GPU-0"} 0.5
"""


def test_triton_is_a_builtin_engine_with_llmds_metric_names() -> None:
    m = builtin_mappings()[ENGINE_TRITON]
    assert ENGINE_TRITON == "triton"
    assert [str(s) for s in m.waiting] == ["nv_inference_pending_request_count"]
    assert [str(s) for s in m.running] == ["nv_inference_exec_count"]
    # llm-d reads no KV usage, LoRA or cache geometry for it.
    assert (m.kv_usage, m.lora_info, m.block_size, m.num_blocks) == ((), None, (), ())


def test_triton_page_parses_into_queue_and_running() -> None:
    ex = EngineMappings().get("Triton")  # engine labels match case-insensitively
    assert ex is not None
    got = ex.extract(SampleIndex(TRITON))
    # Several series (one per model): the first wins, as llm-d's getLatestMetric (no
    # timestamps) picks it.
    assert (got.waiting, got.running) == (4, 57)
    # KV usage is not configured: not read, and not reported missing.
    assert got.kv_usage is None and got.missing == ()


def test_triton_tensorrt_llm_page_parses_into_queue_running_and_kv() -> None:
    m = EngineMappings().get(keys.ENGINE_TRITON_TRTLLM)
    assert m is not None
    got = m.extract(SampleIndex(fixture("triton_trtllm.txt")))
    assert (got.waiting, got.running, got.kv_usage) == (3, 11, 0.25)
    assert (got.block_size, got.num_blocks) == (64, 6239)


def extractor(params: dict[str, object]) -> CoreMetricsExtractor:
    p = decode_params(CoreMetricsExtractor.Parameters, params, "core-metrics-extractor")
    return CoreMetricsExtractor.from_params("core-metrics-extractor", p, PluginHandle())


def test_core_metrics_extractor_knows_triton() -> None:
    """llm-d's extractor_test 'defaultEngine triton with triton defined' and the
    routerlib chart's triton values (defaultEngine: triton)."""
    assert extractor({"defaultEngine": "triton"}).engine_mappings().default.engine == "triton"
    assert {"vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm", "triton"} <= set(
        extractor({}).engine_mappings().engines)
    # An engineConfigs entry of that name replaces the built-in one whole.
    ex = extractor({"engineConfigs": [{"name": "triton", "queuedRequestsSpec": "q",
                                       "runningRequestsSpec": "r"}],
                    "defaultEngine": "triton"})
    assert [str(s) for s in ex.engine_mappings().default.waiting] == ["q"]
    with pytest.raises(ConfigError, match="'tritonx' not found in engineConfigs"):
        extractor({"defaultEngine": "tritonx"})


@pytest.fixture
async def pods() -> AsyncIterator[Pods]:
    p = Pods()
    try:
        yield p
    finally:
        await p.close()


async def test_a_triton_labelled_endpoint_is_scraped_with_the_triton_mapping(
        pods: Pods) -> None:
    pod = await pods.add(TRITON)
    store = Datastore()
    store.set_endpoints([pod.endpoint(**{keys.LABEL_ENGINE: "triton"})])
    scraper = MetricsScraper(store, opts(), seed=7)
    scraper.start()
    try:
        await eventually(lambda: metrics(store, pod).updated_at is not None,
                         what="first scrape")
        m = metrics(store, pod)
        assert (m.waiting_queue_size, m.running_requests) == (4, 57)
        assert not m.stale
    finally:
        await scraper.stop()
