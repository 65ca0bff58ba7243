"""llm-d-router's multicluster plugin family (epp/scheduling/plugins/multicluster.py),
against what llm-d v0.10.0's *_test.go files expect of each: source/metrics
(multicluster_test.go, multicluster_security_test.go), extractor/metrics
(multicluster_test.go), scorer/queuedepth, scorer/kvcacheutilization, scorer/prefix,
dataproducer/approximateprefix, filter/sessionaffinity (multicluster_test.go)."""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from epp.config.loader import build, parse_config
from epp.datalayer import promparse
from epp.datalayer.polling import PollingRunner, effective_interval
from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import decode_params
from epp.scheduling.plugins import multicluster as mc
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.prefix import ApproxPrefixCacheProducer, PrefixCacheScorer
from epp.scheduling.plugins.session import SessionAffinityFilter
from epp.scheduling.types import ApiType, CycleState, Endpoint, LLMRequest, Metrics
from epp.server.tls import self_signed_key_pair
from tests.polling import eventually

KV, QUEUE = mc.KV_CACHE_UTILIZATION_KEY, mc.QUEUE_SIZE_KEY


def make(type_name: str, params: dict[str, Any] | None = None, name: str | None = None,
         handle: PluginHandle | None = None) -> Any:
    b = default_registry().builder(type_name, "t")
    return b(name or type_name, params, "plugins[0].parameters", handle or PluginHandle())


def cluster(i: int, attrs: dict[str, float] | None = None,
            labels: dict[str, str] | None = None) -> Endpoint:
    return Endpoint(f"cluster-{i}", f"10.0.0.{i}", 8080, labels=labels or {},
                    metrics=Metrics(attributes=attrs or {}))


def request(prompt: str = "hello " * 100) -> LLMRequest:
    return LLMRequest("r1", "m", "m", ApiType.COMPLETIONS, prompt, {})


def test_keys_and_defaults_are_llmds() -> None:
    assert KV == "llm-d.ai/multicluster-kv-cache-utilization"
    assert QUEUE == "llm-d.ai/multicluster-queue-size"
    assert mc.DEFAULT_KV_CACHE_UTILIZATION_METRIC == "llm_d_epp_average_kv_cache_utilization"
    assert mc.DEFAULT_QUEUE_SIZE_METRIC == "llm_d_epp_average_queue_size"


@pytest.mark.parametrize("cls", mc.MULTICLUSTER_PLUGINS)
def test_parameters_decode_from_an_empty_block(cls: Any) -> None:
    decode_params(cls.Parameters, {}, "x")


# ------------------------------------------------------------------------------ source


def test_source_defaults_https_verified() -> None:
    src = make("multicluster-metrics-data-source", name="multicluster-metrics")
    assert (src.type_name, src.name) == ("multicluster-metrics-data-source",
                                         "multicluster-metrics")
    assert (src.scheme, src.path, src.insecure_skip_verify, src.interval_s) == (
        "https", "/metrics", False, None)
    ctx = src.ssl_context()
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED
    assert src.url(cluster(1)) == "https://10.0.0.1:8080/metrics"
    labelled = cluster(1, labels={"metricsAddress": "epp.cluster-a", "metricsPort": "9090"})
    assert src.url(labelled) == "https://epp.cluster-a:9090/metrics"


def test_source_interval_parsed_and_bad_interval_rejected() -> None:
    src = make("multicluster-metrics-data-source", {"interval": "2s"})
    assert src.interval_s == 2.0 and effective_interval(src.interval_s, 0.05) == 2.0
    with pytest.raises(ConfigError, match="interval"):
        make("multicluster-metrics-data-source", {"interval": "nope"})


def test_source_http_and_ca_loaded_for_https_only(tmp_path: Path) -> None:
    src = make("multicluster-metrics-data-source", {"scheme": "http",
                                                    "caCertPath": "/nonexistent/ca.crt"})
    assert src.ssl_context() is False
    with pytest.raises(ConfigError, match=r"caCertPath: reading CA cert /nonexistent/ca.crt"):
        make("multicluster-metrics-data-source", {"caCertPath": "/nonexistent/ca.crt"})
    with pytest.raises(ConfigError, match="set clientCertPath and clientKeyPath together"):
        make("multicluster-metrics-data-source", {"clientCertPath": str(tmp_path / "c")})
    with pytest.raises(ConfigError, match="clientCertPath: loading client cert"):
        make("multicluster-metrics-data-source", {"clientCertPath": str(tmp_path / "c"),
                                                  "clientKeyPath": str(tmp_path / "k")})
    with pytest.raises(ConfigError, match="unsupported scheme"):
        make("multicluster-metrics-data-source", {"scheme": "ftp"})


def test_source_payload_is_capped() -> None:
    src = make("multicluster-metrics-data-source")
    body = "llm_d_epp_average_queue_size 4\n" + "#" * mc.MAX_RESPONSE_BYTES + "\nbad line\n"
    assert src.parse(body)["llm_d_epp_average_queue_size"][0].value == 4.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def peer(tmp_path: Path) -> AsyncIterator[tuple[int, Path, dict[str, str]]]:
    """A peer cluster's EPP metrics over https with a self-signed cert for localhost."""
    key, cert = self_signed_key_pair()
    (tmp_path / "tls.key").write_bytes(key)
    (tmp_path / "tls.crt").write_bytes(cert)
    sctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    sctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    body = {"text": "# TYPE llm_d_epp_average_queue_size gauge\n"
                    "llm_d_epp_average_queue_size 4\n"
                    "# TYPE llm_d_epp_average_kv_cache_utilization gauge\n"
                    "llm_d_epp_average_kv_cache_utilization 0.62\n"}

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=body["text"])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=sctx).start()
    try:
        yield port, tmp_path / "tls.crt", body
    finally:
        await runner.cleanup()


async def _poll_once(src: Any, port: int) -> Datastore:
    store = Datastore()
    store.set_endpoints([cluster(1, labels={"metricsAddress": "localhost",
                                            "metricsPort": str(port)})])
    ext = make("multicluster-metrics-extractor")
    runner = PollingRunner(store, [(src, [ext])], 0.05)
    runner._session = aiohttp.ClientSession()  # what start() opens, without its tasks
    try:
        (ep,) = store.snapshot()
        await runner.poll(src, [ext], ep, src.ssl_context())
    finally:
        await runner._session.close()
    return store


async def test_source_verifies_the_peer_by_default(
        peer: tuple[int, Path, dict[str, str]]) -> None:
    """multicluster_security_test.go: a self-signed peer is rejected by default, accepted
    with insecureSkipVerify, and with verification on when its CA is configured."""
    port, ca, _ = peer
    store = await _poll_once(make("multicluster-metrics-data-source"), port)
    assert KV not in store.snapshot()[0].metrics.attributes
    for params in ({"insecureSkipVerify": True}, {"caCertPath": str(ca)}):
        store = await _poll_once(make("multicluster-metrics-data-source", params), port)
        assert dict(store.snapshot()[0].metrics.attributes) == {KV: 0.62, QUEUE: 4.0}


async def test_pipeline_source_extractor_attributes(
        peer: tuple[int, Path, dict[str, str]]) -> None:
    """TestMultiClusterMetricsPipeline: a peer's pool aggregates reach the attributes
    the multicluster scorers read, through the running poller."""
    port, ca, body = peer
    store = Datastore()
    store.set_endpoints([cluster(1, labels={"metricsAddress": "localhost",
                                            "metricsPort": str(port)})])
    src = make("multicluster-metrics-data-source", {"caCertPath": str(ca)})
    runner = PollingRunner(store, [(src, [make("multicluster-metrics-extractor")])], 0.02)
    runner.start()
    try:
        await eventually(lambda: store.snapshot()[0].metrics.attributes.get(QUEUE) == 4.0)
        body["text"] = body["text"].replace("size 4", "size 9")
        await eventually(lambda: store.snapshot()[0].metrics.attributes.get(QUEUE) == 9.0)
    finally:
        await runner.stop()


# --------------------------------------------------------------------------- extractor


def payload(text: str) -> promparse.Payload:
    return promparse.parse(text)


def test_extractor_both_present() -> None:
    ext = make("multicluster-metrics-extractor", name="multicluster-metrics")
    assert ext.type_name == "multicluster-metrics-extractor"
    got = ext.extract_poll(payload("llm_d_epp_average_kv_cache_utilization 0.42\n"
                                   "llm_d_epp_average_queue_size 7\n"), cluster(1))
    assert dict(got) == {KV: 0.42, QUEUE: 7.0}


def test_extractor_missing_queue_still_writes_kv(caplog: pytest.LogCaptureFixture) -> None:
    ext = make("multicluster-metrics-extractor")
    caplog.set_level(logging.WARNING)  # whatever level an earlier test left on the root
    got = ext.extract_poll(payload("llm_d_epp_average_kv_cache_utilization 0.9\n"),
                           cluster(1))
    assert dict(got) == {KV: 0.9}
    assert "llm-d.ai/multicluster-queue-size: metric family " \
           "'llm_d_epp_average_queue_size' not found" in caplog.text


def test_extractor_empty_payload_errors() -> None:
    with pytest.raises(ValueError, match="not found"):
        make("multicluster-metrics-extractor").extract_poll({}, cluster(1))


def test_extractor_custom_names_and_labels() -> None:
    ext = make("multicluster-metrics-extractor", {
        "kvCacheUtilizationMetric": "custom_kv", "queueSizeMetric": "custom_queue{pool=a}"})
    got = ext.extract_poll(payload('custom_kv 0.3\ncustom_queue{pool="b"} 5\n'
                                   'custom_queue{pool="a"} 2\n'), cluster(1))
    assert dict(got) == {KV: 0.3, QUEUE: 2.0}


def test_extractor_invalid_metric_name() -> None:
    with pytest.raises(ConfigError, match="kvCacheUtilizationMetric"):
        make("multicluster-metrics-extractor", {"kvCacheUtilizationMetric": "1_bad"})


def test_extractor_produces_the_pool_keys() -> None:
    assert dict(make("multicluster-metrics-extractor").produces) == {
        KV: "ScalarMetricValue", QUEUE: "ScalarMetricValue"}


# ----------------------------------------------------------------------------- scorers


def scores(type_name: str, eps: list[Endpoint]) -> list[float]:
    return list(make(type_name).score(CycleState(), request(), eps))


@pytest.mark.parametrize(("queues", "want"), [
    ([2, 6, 10], [1.0, 0.5, 0.0]),  # min-max normalizes across clusters
    ([4, 4], [1.0, 1.0]),  # equal queues score neutral
    ([None], [0.0]),  # missing attribute: unscored (0 here)
    ([2, None, 10], [1.0, 0.0, 0.0]),  # the unscored one is left out of normalization
])
def test_queue_scorer(queues: list[float | None], want: list[float]) -> None:
    eps = [cluster(i, {QUEUE: q} if q is not None else {}) for i, q in enumerate(queues)]
    assert scores("multicluster-queue-scorer", eps) == pytest.approx(want)


def test_kv_cache_scorer() -> None:
    eps = [cluster(1, {KV: 0.25}), cluster(2, {KV: 0.9}), cluster(3)]
    assert scores("multicluster-kv-cache-utilization-scorer", eps) == pytest.approx(
        [0.75, 0.1, 0.0])


@pytest.mark.parametrize(("type_name", "key"), [
    ("multicluster-queue-scorer", QUEUE),
    ("multicluster-kv-cache-utilization-scorer", KV),
])
def test_metric_scorers_require_the_extractor(type_name: str, key: str) -> None:
    scorer = make(type_name, name="mc")
    assert dict(scorer.consumes) == {key: "ScalarMetricValue"}
    with pytest.raises(ConfigError, match=f"no default producer found for missing data key "
                       f"{key}, consumed by mc"):
        scorer.bind(PluginHandle())
    scorer.bind(PluginHandle({"x": make("multicluster-metrics-extractor")}))


# ------------------------------------------------------------------------ thin variants


def test_thin_variants_keep_the_stock_behaviour() -> None:
    producer = make("multicluster-approx-prefix-cache-producer", {"blockSizeTokens": 4})
    assert isinstance(producer, ApproxPrefixCacheProducer)
    assert producer.type_name == "multicluster-approx-prefix-cache-producer"
    assert producer.block_size_tokens == 4
    scorer = make("multicluster-prefix-cache-scorer", name="prefix")
    assert isinstance(scorer, PrefixCacheScorer)
    assert scorer.type_name == "multicluster-prefix-cache-scorer"
    scorer.bind(PluginHandle({producer.name: producer}))
    assert scorer.producer is producer  # binds to the multicluster producer
    flt = make("multicluster-session-affinity-filter")
    assert isinstance(flt, SessionAffinityFilter)
    assert flt.type_name == "multicluster-session-affinity-filter"


def test_prefix_routes_a_repeated_prefix_back_to_its_cluster() -> None:
    cfg = build(parse_config("""
plugins:
- {type: multicluster-approx-prefix-cache-producer}
- {type: multicluster-prefix-cache-scorer}
- {type: max-score-picker}
""", "t"))
    sched = cfg.scheduler
    eps = [cluster(1), cluster(2), cluster(3)]
    req = request("the same long system prompt " * 20)
    first = sched.schedule(req, eps)
    for p in cfg.pre_request:
        p.pre_request(req, first)
    again = sched.schedule(request("the same long system prompt " * 20), eps)
    assert again.primary.endpoints[0].key == first.primary.endpoints[0].key
