"""The plugin types GIE v1.5.0's EPP registers that this EPP added for issue 14, by their
behaviour: the conformance filter and verifier, prefix-cache-affinity-filter,
concurrency-detector, request-attribute-reporter (and its CEL subset), and the data layer
(metrics-data-source, core-metrics-extractor, the notification sources) driving the
scraper. Cases follow the Go plugins and their *_test.go files."""

from __future__ import annotations

import random
import re
import textwrap
from typing import Any

import pytest

from epp.config.loader import BuiltConfig, build, parse_config
from epp.datalayer.config import attach_sources, scraper_settings
from epp.datalayer.engines import MappingOverrides
from epp.datalayer.promparse import parse as parse_prometheus
from epp.datalayer.scraper import ScrapeOptions
from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters
from epp.framework.registry import Registry
from epp.scheduling.plugins.affinity import PrefixCacheAffinityFilter
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.cel import CelError, compile_expression, struct_value
from epp.scheduling.plugins.concurrency import ConcurrencyDetector
from epp.scheduling.plugins.conformance import (
    DestinationEndpointServedVerifier,
    HeaderBasedTestingFilter,
)
from epp.scheduling.plugins.datalayer import CoreMetricsExtractor
from epp.scheduling.plugins.load import InFlightLoadProducer
from epp.scheduling.plugins.prefix import ApproxPrefixCacheProducer
from epp.scheduling.types import (
    ApiType,
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    SchedulingResult,
)

SRC = "t.yaml"


def built(text: str, registry: Registry | None = None) -> BuiltConfig:
    return build(parse_config(textwrap.dedent(text), SRC), registry)


def req(headers: dict[str, str] | None = None, prompt: str = "hi") -> LLMRequest:
    return LLMRequest(request_id="r", target_model="m", incoming_model="m",
                      api=ApiType.CHAT_COMPLETIONS, prompt=prompt, headers=headers or {})


def ep(address: str, port: int = 8000, **labels: str) -> Endpoint:
    return Endpoint(name=f"{address}-{port}", address=address, port=port, labels=labels)


def make(type_name: str, params: dict[str, Any] | None = None) -> Any:
    return default_registry().builder(type_name, "t")("x", params, "p", PluginHandle())


def param_error(type_name: str, params: dict[str, Any], *fragments: str) -> None:
    with pytest.raises(ConfigError) as info:
        make(type_name, params)
    for f in fragments:
        assert f in str(info.value), str(info.value)


# ================================================================ conformance plugins


E1, E2, E3 = ep("10.0.0.1", 3000), ep("10.0.0.2", 3000), ep("10.0.0.2", 3002)
V6 = ep("fd00::1", 3000)


@pytest.mark.parametrize(("header", "expected"), [
    (None, []),
    ("   ", []),
    ("10.0.0.1", [E1]),
    ("10.0.0.2:3000", [E2]),
    ("10.0.0.2:3002,10.0.0.1", [E3, E1]),  # the header's order
    ("10.0.0.2", [E3]),  # an IP alone: the last endpoint with it (GIE's lookup by IP)
    ("10.0.0.2:3000,10.0.0.2:3002", [E2]),  # an IP is kept once
    ("10.0.0.9, ,10.0.0.1:9999", []),
    ("fd00::1", [V6]),
    ("[fd00::1]:3000", [V6]),
    ("[fd00::1]", [V6]),
])
def test_header_based_testing_filter(header: str | None, expected: list[Endpoint]) -> None:
    f = HeaderBasedTestingFilter("f")
    headers = {} if header is None else {"test-epp-endpoint-selection": header}
    assert list(f.filter({}, req(headers), [E1, E2, E3, V6])) == expected


def test_destination_endpoint_served_verifier() -> None:
    v = DestinationEndpointServedVerifier("v")
    assert v.response_headers(req(), "10.0.0.2:3000", 200, {}) == {
        "x-conformance-test-served-endpoint": "10.0.0.2:3000"}
    assert v.response_headers(req(), "", 200, {}) == {
        "x-conformance-test-served-endpoint": "fail: missing destination endpoint served "
                                              "metadata"}


# ================================================================ prefix-cache-affinity-filter

PROMPT = "x" * 64 * 8  # 8 blocks of 16 tokens (64 characters)


def _affinity(threshold: float, exploration: float = 0.0,
              rng: random.Random | None = None) -> tuple[PrefixCacheAffinityFilter,
                                                         ApproxPrefixCacheProducer]:
    producer = ApproxPrefixCacheProducer("producer")
    f = PrefixCacheAffinityFilter("f", threshold, exploration, rng=rng)
    f.bind(PluginHandle({"producer": producer}))
    return f, producer


def _route(producer: ApproxPrefixCacheProducer, request: LLMRequest, e: Endpoint) -> None:
    producer.pre_request(request, SchedulingResult(
        {"default": ProfileRunResult((e,))}, "default"))


def test_prefix_cache_affinity_filter_keeps_sticky_endpoints() -> None:
    f, producer = _affinity(0.8)
    a, b, c = ep("10.0.0.1"), ep("10.0.0.2"), ep("10.0.0.3")
    assert list(f.filter({}, req(prompt=PROMPT), [a, b, c])) == [a, b, c]  # nothing cached
    _route(producer, req(prompt=PROMPT), b)
    assert list(f.filter({}, req(prompt=PROMPT), [a, b, c])) == [b]
    # Half the prompt cached on c: below 0.8, not sticky; at 0.5 it is.
    _route(producer, req(prompt=PROMPT[:256]), c)
    assert list(f.filter({}, req(prompt=PROMPT), [a, b, c])) == [b]
    f5, p5 = _affinity(0.5)
    p5.index = producer.index
    assert list(f5.filter({}, req(prompt=PROMPT), [a, b, c])) == [b, c]
    # One candidate, or a threshold <= 0: the gate is off.
    assert list(f.filter({}, req(prompt=PROMPT), [a])) == [a]
    f0, p0 = _affinity(0.0)
    p0.index = producer.index
    assert list(f0.filter({}, req(prompt=PROMPT), [a, b])) == [a, b]


def test_prefix_cache_affinity_filter_ttft_load_gate() -> None:
    """GIE's TTFT load gate: stickiness breaks when the best sticky endpoint's predicted
    TTFT exceeds the best other one's by more than maxTTFTPenaltyMs (default 5000)."""
    from epp.latency.types import LatencyPredictionInfo, set_prediction_infos

    def info(ttft: float) -> LatencyPredictionInfo:
        return LatencyPredictionInfo(True, True, 0.0, 0.0, ttft, 0.0)

    f, producer = _affinity(0.8)
    a, b, c = ep("10.0.0.1"), ep("10.0.0.2"), ep("10.0.0.3")
    _route(producer, req(prompt=PROMPT), b)  # b is the sticky one

    def run(infos: dict[str, LatencyPredictionInfo], penalty: float = 5000.0) -> list[Endpoint]:
        f.max_ttft_penalty_ms = penalty
        r = req(prompt=PROMPT)
        set_prediction_infos(r, infos)
        return list(f.filter({}, r, [a, b, c]))

    assert run({}) == [b]  # no predictions: the gate holds
    # Gap = best sticky (6000) - best other (900) = 5100 > 5000: broken, all stay.
    assert run({b.key: info(6000), a.key: info(1200), c.key: info(900)}) == [a, b, c]
    # Gap 4900: within the penalty, sticky only.
    assert run({b.key: info(6000), a.key: info(1100), c.key: info(1300)}) == [b]
    # A penalty of 0 turns the gate off.
    assert run({b.key: info(60000), a.key: info(1)}, penalty=0) == [b]
    # The sticky endpoint has no prediction, another has: GIE's max-float gap breaks it.
    assert run({a.key: info(100)}) == [a, b, c]
    # Only the sticky one has a prediction: the others count as infinitely slow.
    assert run({b.key: info(60000)}) == [b]


def test_prefix_cache_affinity_filter_explores() -> None:
    f, producer = _affinity(0.8, exploration=0.5, rng=random.Random(7))
    a, b = ep("10.0.0.1"), ep("10.0.0.2")
    _route(producer, req(prompt=PROMPT), b)
    kept = [len(f.filter({}, req(prompt=PROMPT), [a, b])) for _ in range(400)]
    assert 150 < kept.count(2) < 250 and kept.count(2) + kept.count(1) == 400


def test_prefix_cache_affinity_filter_in_a_config_reads_the_scorers_producer() -> None:
    b = built("""
        plugins:
        - {type: prefix-cache-affinity-filter, name: strict, parameters: {affinityThreshold: 0.99,
           explorationProbability: 0}}
        - type: prefix-cache-scorer
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: strict}, {pluginRef: prefix-cache-scorer}]
    """)
    a, c = ep("10.0.0.1"), ep("10.0.0.2")
    first = b.scheduler.schedule(req(prompt=PROMPT), [a, c]).primary.endpoints[0]
    for p in b.pre_request:
        p.pre_request(req(prompt=PROMPT), SchedulingResult(
            {"default": ProfileRunResult((first,))}, "default"))
    for _ in range(5):
        assert b.scheduler.schedule(req(prompt=PROMPT), [a, c]).primary.endpoints == (first,)


def test_prefix_cache_affinity_filter_parameters() -> None:
    f = make("prefix-cache-affinity-filter")
    assert (f.affinity_threshold, f.exploration_probability, f.max_ttft_penalty_ms) == (
        0.8, 0.01, 5000.0)
    param_error("prefix-cache-affinity-filter", {"affinityThreshold": 1.5},
                "affinityThreshold: must be <= 1.0")
    param_error("prefix-cache-affinity-filter", {"explorationProbability": -0.1},
                "explorationProbability: must be in [0, 1]")
    param_error("prefix-cache-affinity-filter", {"maxTTFTPenaltyMs": -1},
                "maxTTFTPenaltyMs: must be >= 0")


# ================================================================ concurrency-detector


def _detector(**params: Any) -> tuple[ConcurrencyDetector, InFlightLoadProducer]:
    d = make("concurrency-detector", params)
    handle = PluginHandle()
    d.bind(handle)
    (producer,) = handle.of_type(InFlightLoadProducer)
    return d, producer


def test_concurrency_detector_requests() -> None:
    d, producer = _detector(maxConcurrency=2, headroom=0.5)
    a, b = ep("10.0.0.1"), ep("10.0.0.2")
    assert d.saturation([a, b]) == 0.0 and not d.is_saturated([a, b])
    assert d.saturation([]) == 1.0 and d.is_saturated([])
    for _ in range(3):
        producer.tracker.add([a.key])
    # 3 in flight of 2 × 2: 0.75; the filter's limit is int(2 × 1.5) = 3.
    assert d.saturation([a, b]) == 0.75
    assert list(d.filter({}, req(), [a, b])) == [b]
    producer.tracker.add([b.key])
    assert d.is_saturated([a, b])  # 4 / 4
    assert list(d.filter({}, req(), [a])) == []  # no fail-open


def test_concurrency_detector_tokens_and_parameters() -> None:
    d, producer = _detector(concurrencyMode="tokens", maxTokenConcurrency=100)
    a = ep("10.0.0.1")
    producer.tracker.add([a.key], tokens=100)
    assert d.saturation([a]) == 1.0 and list(d.filter({}, req(), [a])) == []
    param_error("concurrency-detector", {"concurrencyMode": "bytes"},
                "unsupported concurrencyMode 'bytes'")
    param_error("concurrency-detector", {"maxConcurrency": 0}, "maxConcurrency: must be >= 1")
    param_error("concurrency-detector", {"headroom": -0.1}, "headroom: must be >= 0")


def test_concurrency_detector_reads_the_declared_producer() -> None:
    b = built("""
        plugins:
        - type: inflight-load-producer
        - type: concurrency-detector
        - type: queue-scorer
        saturationDetector: {pluginRef: concurrency-detector}
    """)
    assert b.saturation_detector.producer is b.plugins["inflight-load-producer"]  # type: ignore[union-attr]


# ================================================================ request-attribute-reporter


def _reporter(expression: str, condition: str | None = None,
              namespace: str | None = None) -> Any:
    attr: dict[str, Any] = {"key": {"name": "cost"}, "expression": expression}
    if condition is not None:
        attr["condition"] = condition
    if namespace is not None:
        attr["key"]["namespace"] = namespace
    return make("request-attribute-reporter", {"attributes": [attr]})


def test_request_attribute_reporter() -> None:
    r = _reporter("usage.prompt_tokens + usage.completion_tokens")
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert r.usage_metadata(req(), usage) == {"envoy.lb": {"cost": 15.0}}
    assert r.usage_metadata(req(), {"prompt_tokens": 10}) is None  # no such key: nothing
    r = _reporter("usage.completion_tokens", condition="has(usage.completion_tokens)",
                  namespace="my.ns")
    assert r.usage_metadata(req(), {"completion_tokens": 7}) == {"my.ns": {"cost": 7.0}}
    assert r.usage_metadata(req(), {"prompt_tokens": 7}) is None  # condition false
    assert r.usage_metadata(req(), {"completion_tokens": 0}) is None  # zero: not written
    r = _reporter("usage.total_tokens / 2.0")
    assert r.value({"total_tokens": 5}) == 2  # truncated to an integer
    r = _reporter("'x'")
    assert r.value({}) is None  # not a number
    assert r.response_needs == frozenset({"body"})


def test_request_attribute_reporter_parameters() -> None:
    param_error("request-attribute-reporter", {}, "p.attributes: attributes must contain "
                "exactly one entry")
    param_error("request-attribute-reporter", {"attributes": []}, "exactly one entry")
    param_error("request-attribute-reporter",
                {"attributes": [{"key": {"name": "a"}, "expression": "1"}] * 2},
                "exactly one entry")
    param_error("request-attribute-reporter", {"attributes": [{"expression": "1"}]},
                "p.attributes[0].key.name: attributeKey.name cannot be empty")
    param_error("request-attribute-reporter", {"attributes": [{"key": {"name": "a"}}]},
                "p.attributes[0].expression: attributes[0].expression cannot be empty")
    param_error("request-attribute-reporter",
                {"attributes": [{"key": {"name": "a"}, "expression": "usage.x +"}]},
                "p.attributes[0].expression: failed to compile")
    param_error("request-attribute-reporter",
                {"attributes": [{"key": {"name": "a"}, "expression": "tokens.x"}]},
                "undeclared reference to 'tokens'")
    param_error("request-attribute-reporter",
                {"attributes": [{"key": {"name": "a"}, "expression": "1",
                                 "condition": "len(usage)"}]},
                "p.attributes[0].condition: failed to compile: undeclared reference to "
                "function 'len'")


@pytest.mark.parametrize(("expr", "value"), [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("7 / 2", 3), ("-7 / 2", -3), ("7 % 3", 1),
    ("0x10", 16), ("1.5 + 1.0", 2.5), ("'a' + 'b'", "ab"), ("true && !false", True),
    ("1 < 2.5", True), ("1 == 1.0", True), ("'a' == 1", False), ("2 > 1 ? 'y' : 'n'", "y"),
    ("has(usage.a)", True), ("has(usage.b)", False), ("usage.a", 3.0),
    ("usage['a'] + 1.0", 4.0), ("int(usage.a) + 1", 4), ("double(2) / 4.0", 0.5),
    ("size('abc')", 3), ("'a' in usage", True), ("usage.n.m", 1.0),
    ("false && usage.missing > 1", False), ("usage.missing > 1 || true", True),
    ("has(usage.a) ? usage.a : 0.0", 3.0), ("string(12)", "12"),
])
def test_cel_subset(expr: str, value: Any) -> None:
    usage = struct_value({"a": 3, "n": {"m": 1}})
    assert compile_expression(expr, ("usage",)).eval({"usage": usage}) == value


@pytest.mark.parametrize(("expr", "message"), [
    ("usage.a + 1", "no such overload: double + int"),  # Struct numbers are doubles
    ("1 / 0", "division by zero"), ("usage.missing", "no such key"),
    ("usage.missing > 1 && true", "no such key"), ("1 ? 2 : 3", "no such overload"),
    ("9223372036854775807 + 1", "int overflow"), ("!1", "no such overload"),
])
def test_cel_evaluation_errors(expr: str, message: str) -> None:
    program = compile_expression(expr, ("usage",))
    with pytest.raises(CelError, match=re.escape(message)):
        program.eval({"usage": struct_value({"a": 3})})


@pytest.mark.parametrize("expr", ["", "usage.", "1 +", "(1", "foo", "usage @ 1", "has(1)",
                                  "size(1, 2)"])
def test_cel_compile_errors(expr: str) -> None:
    with pytest.raises(CelError):
        compile_expression(expr, ("usage",))


# ================================================================ data layer


VLLM_BODY = """\
vllm:num_requests_waiting 3
vllm:num_requests_running 2
vllm:kv_cache_usage_perc 0.5
vllm:gpu_cache_usage_perc 0.9
sglang:num_queue_reqs 7
sglang:num_running_reqs 1
sglang:token_usage 0.25
custom_waiting{kind="w"} 11
"""


def samples() -> Any:
    return parse_prometheus(VLLM_BODY)


def test_metrics_data_source_overrides_the_flags() -> None:
    flags = ScrapeOptions(scheme="https", path="/flag", insecure_skip_verify=False)
    b = built("plugins: [{type: queue-scorer}]\n")
    options, _ = scraper_settings(b.data_layer, True, flags, MappingOverrides())  # type: ignore[misc]
    assert (options.scheme, options.path, options.insecure_skip_verify) == (
        "https", "/flag", False)  # no parameter set: the flags
    b = built("""
        plugins:
        - type: queue-scorer
        - {type: metrics-data-source, parameters: {scheme: http, path: /m, insecureSkipVerify: true}}
    """)
    options, _ = scraper_settings(b.data_layer, True, flags, MappingOverrides())  # type: ignore[misc]
    assert (options.scheme, options.path, options.insecure_skip_verify) == ("http", "/m", True)
    assert scraper_settings(b.data_layer, False, flags, MappingOverrides()) is None
    param_error("metrics-data-source", {"scheme": "ftp"}, "scheme: unsupported scheme 'ftp'")


def test_legacy_metrics_uses_the_flags_alone() -> None:
    b = built("featureGates: [enableLegacyMetrics]\nplugins: [{type: queue-scorer}]\n")
    flags = ScrapeOptions(path="/flag")
    options, mappings = scraper_settings(  # type: ignore[misc]
        b.data_layer, True, flags, MappingOverrides(total_queued_requests="custom_waiting"))
    assert options is flags
    assert mappings.default.extract(samples()).waiting == 11


def test_data_layer_without_metrics_source_scrapes_nothing() -> None:
    b = built("""
        plugins: [{type: queue-scorer}, {type: endpoint-notification-source}]
        dataLayer: {sources: [{pluginRef: endpoint-notification-source}]}
    """)
    assert scraper_settings(b.data_layer, True, ScrapeOptions(), MappingOverrides()) is None
    b = built("""
        plugins: [{type: queue-scorer}, {type: metrics-data-source}]
        dataLayer: {sources: [{pluginRef: metrics-data-source}]}
    """)
    assert scraper_settings(b.data_layer, True, ScrapeOptions(), MappingOverrides()) is None


def test_core_metrics_extractor_engines() -> None:
    x = make("core-metrics-extractor", {
        "engineLabelKey": "engine",
        "defaultEngine": "mine",
        "engineConfigs": [
            {"name": "mine", "queuedRequestsSpec": "custom_waiting{kind=w}",
             "kvUsageSpec": "sglang:token_usage"},
            {"name": "vllm", "queuedRequestsSpec": "vllm:num_requests_waiting",
             "kvUsageSpec": "vllm:gpu_cache_usage_perc"},
        ]})
    assert isinstance(x, CoreMetricsExtractor)
    m = x.engine_mappings()
    unlabelled = m.for_endpoint(ep("10.0.0.1"))
    assert unlabelled.engine == "mine"
    got = unlabelled.extract(samples())
    assert (got.waiting, got.running, got.kv_usage) == (11, None, 0.25)
    vllm = m.for_endpoint(ep("10.0.0.2", engine="vllm"))
    got = vllm.extract(samples())
    assert (got.waiting, got.running, got.kv_usage) == (3, None, 0.9)  # replaced whole
    assert vllm.lora_info is None
    sglang = m.for_endpoint(ep("10.0.0.3", engine="sglang"))  # a built-in kept
    assert sglang.extract(samples()).waiting == 7
    # Only engineLabelKey is read when it is set.
    other = m.for_endpoint(ep("10.0.0.4", **{"inference.networking.k8s.io/engine-type": "sglang"}))
    assert other.engine == "mine"


def test_core_metrics_extractor_default_label_and_flags() -> None:
    x = make("core-metrics-extractor")
    m = x.engine_mappings(MappingOverrides(total_running_requests="custom_waiting"))
    gie_label = ep("10.0.0.1", **{"inference.networking.k8s.io/engine-type": "sglang"})
    assert m.for_endpoint(gie_label).engine == "sglang"
    assert m.for_endpoint(ep("10.0.0.2")).extract(samples()).running == 11  # flag applied


@pytest.mark.parametrize(("params", "fragment"), [
    ({"defaultEngine": "tgi"}, "defaultEngine: 'tgi' not found in engineConfigs"),
    ({"engineConfigs": [{"queuedRequestsSpec": "a"}]},
     "engineConfigs[0].name: engine config name cannot be empty"),
    ({"engineConfigs": [{"name": "default"}]}, "cannot be 'default' (reserved)"),
    ({"engineConfigs": [{"name": "a"}, {"name": "a"}]},
     "engineConfigs[1].name: mapping for engine type 'a' already exists"),
    ({"engineConfigs": [{"name": "a", "kvUsageSpec": "x{y"}]},
     "engineConfigs[0].kvUsageSpec: invalid metric spec"),
    ({"engineConfigs": {"name": "a"}}, "engineConfigs: expected a list"),
])
def test_core_metrics_extractor_parameter_errors(params: dict[str, Any], fragment: str) -> None:
    param_error("core-metrics-extractor", params, fragment)


def test_k8s_notification_source() -> None:
    s = make("k8s-notification-source", {"group": "", "version": "v1", "kind": "Pod"})
    assert s.gvk == "/v1, Kind=Pod"
    param_error("k8s-notification-source", {}, "p.version: version and kind are required")
    param_error("k8s-notification-source", {"version": "v1"}, "p.kind:")


class EventLog:
    type_name = "event-log"
    Parameters = NoParameters
    data_input = "endpoint-events"

    def __init__(self, name: str) -> None:
        self.name = name
        self.events: list[tuple[str, str]] = []

    @classmethod
    def from_params(cls, name: str, params: NoParameters, handle: PluginHandle) -> EventLog:
        return cls(name)

    def extract_endpoint(self, event: str, endpoint: Endpoint) -> None:
        self.events.append((event, endpoint.key))


def test_endpoint_notification_source_tells_its_extractors() -> None:
    registry = default_registry()
    registry.register_class(EventLog)
    b = built("""
        plugins:
        - type: queue-scorer
        - type: endpoint-notification-source
        - type: event-log
        dataLayer:
          sources:
          - pluginRef: endpoint-notification-source
            extractors: [{pluginRef: event-log}]
    """, registry)
    log: EventLog = b.plugins["event-log"]  # type: ignore[assignment]
    store = Datastore()
    a, c = ep("10.0.0.1"), ep("10.0.0.2")
    store.set_endpoints([a])
    detach = attach_sources(b.data_layer, store)
    store.set_endpoints([a, c])
    store.set_endpoints([c])
    assert log.events == [("add-or-update", a.key), ("add-or-update", c.key),
                          ("delete", a.key)]
    detach()
    store.set_endpoints([])
    assert len(log.events) == 3

