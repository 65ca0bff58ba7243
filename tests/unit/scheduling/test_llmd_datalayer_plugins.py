"""llm-d-router v0.10.0's topology, utilization and context-length plugins (issue 18):
``topology-extractor``, ``topology-affinity-filter``, ``utilization-filter``,
``context-length-aware``; behaviour translated from llm-d's Go tests, and llm-d's
deploy/config/pd-topology-epp-config.yaml loaded and routed against fake endpoints.

Go sources: pkg/epp/framework/plugins/datalayer/{attribute,extractor}/topology,
scheduling/filter/topologyaffinity, scheduling/util/topology, scheduling/filter/utilization,
scheduling/scorer/contextlengthaware and their *_test.go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from epp import keys
from epp.config.loader import load_and_build
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import Filter, Scorer
from epp.framework.params import decoding
from epp.kvcache.tokenization import EstimateTokenizer, TokenizedPrompt
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.llmd_filters import (
    ContextLengthAware,
    UtilizationFilter,
    parse_context_range,
    range_score,
)
from epp.scheduling.plugins.load import InFlightLoadProducer
from epp.scheduling.plugins.pd import DECODE_ENDPOINT_KEY
from epp.scheduling.plugins.token_producer import TOKENIZED_PROMPT, TokenProducer
from epp.scheduling.plugins.topology import TopologyAffinityScorer
from epp.scheduling.plugins.topology_llmd import (
    Level,
    Topology,
    TopologyAffinityFilter,
    TopologyExtractor,
    compare,
    parse_level,
)
from epp.scheduling.types import ApiType, CycleState, Endpoint, LLMRequest, Metrics
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, ServerParts, wire

FIXTURES = Path(__file__).parents[2] / "fixtures" / "llm-d-router-v0.10.0"
PD_TOPOLOGY = FIXTURES / "deploy/config/pd-topology-epp-config.yaml"
HOST = "kubernetes.io/hostname"
RACK = "topology.kubernetes.io/rack"
ZONE = "topology.kubernetes.io/zone"
REGION = "topology.kubernetes.io/region"


def make(type_name: str, params: dict[str, Any] | None = None, name: str | None = None,
         handle: PluginHandle | None = None) -> Any:
    build = default_registry().builder(type_name, "t")
    return build(name or type_name, params, "plugins[0].parameters", handle or PluginHandle())


def make_error(type_name: str, params: dict[str, Any] | None, *fragments: str) -> None:
    with pytest.raises(ConfigError) as info:
        p = make(type_name, params)
        bind = getattr(p, "bind", None)
        if bind is not None:
            bind(PluginHandle({p.name: p}))
    for f in fragments:
        assert f in str(info.value), f"{f!r} not in {str(info.value)!r}"


def ep(i: int, *, labels: dict[str, str] | None = None, node: str | None = None,
       node_labels: dict[str, str] | None = None, metrics: Metrics | None = None) -> Endpoint:
    return Endpoint(name=f"pod-{i}", address=f"10.0.0.{i}", port=8000, labels=labels or {},
                    node_name=node, node_labels=node_labels or {},
                    metrics=metrics or Metrics())


def req(tokens: int | None = None, model: str = "m") -> LLMRequest:
    r = LLMRequest(request_id="r", target_model=model, incoming_model=model,
                   api=ApiType.CHAT_COMPLETIONS, prompt="p", headers={})
    if tokens is not None:
        r.plugin_state[TOKENIZED_PROMPT] = TokenizedPrompt(tuple(range(tokens)))
    return r


def names(eps: Any) -> list[str]:
    return [e.name for e in eps]


# ==================================================================== topology levels


def test_levels_parse_and_compare() -> None:
    assert [parse_level(s) for s in ("host", "rack", "zone", "region")] == [
        Level.HOST, Level.RACK, Level.ZONE, Level.REGION]
    with pytest.raises(ValueError, match="invalid topology level 'datacenter', must be one "
                                         "of host, rack, zone, region"):
        parse_level("datacenter")
    peer = Topology("h1", "r1", "z1", "reg1")
    assert compare(peer, Topology("h1", "r9", "z9", "reg9")) is Level.HOST
    assert compare(peer, Topology("h2", "r1", "z1", "reg1")) is Level.RACK
    assert compare(peer, Topology("h2", "r2", "z1", "reg1")) is Level.ZONE
    assert compare(peer, Topology("h2", "r2", "z2", "reg1")) is Level.REGION
    assert compare(peer, Topology("h3", "r3", "z3", "reg3")) is Level.NONE
    assert compare(peer, Topology(rack="r1")) is Level.RACK  # sparse candidate
    assert compare(Topology(), Topology()) is Level.NONE  # empty never matches
    assert compare(None, peer) is Level.NONE and compare(peer, None) is Level.NONE
    assert Level.NONE.config_name == "none" and Level.RACK.config_name == "rack"


# ================================================================= topology-extractor


def test_extractor_defaults_and_custom_labels() -> None:
    x = make("topology-extractor")
    assert isinstance(x, TopologyExtractor)
    assert (x.hostname_label, x.rack_label, x.zone_label, x.region_label) == (HOST, RACK,
                                                                               ZONE, REGION)
    assert dict(x.produces) == {"Topology/topology-extractor": "Topology"}
    e = ep(1, labels={HOST: "h1", RACK: "r1", ZONE: "z1", REGION: "reg1"})
    assert x.topology(e) == Topology("h1", "r1", "z1", "reg1")
    y = make("topology-extractor", {"hostname": "my/hostname", "zone": "my/zone"}, name="t2")
    assert y.key == "Topology/t2"
    e = ep(2, labels={"my/hostname": "hx", "my/zone": "zx", RACK: "r2", ZONE: "ignored"})
    assert y.topology(e) == Topology("hx", "r2", "zx", "")


def test_extractor_reads_node_labels_and_falls_back_to_the_node_name() -> None:
    x = TopologyExtractor()
    # pod labels win over node labels; node labels fill the rest
    e = ep(1, labels={ZONE: "pod-zone"}, node="n1",
           node_labels={HOST: "node-host", ZONE: "node-zone", REGION: "reg"})
    assert x.topology(e) == Topology("node-host", "", "pod-zone", "reg")
    # no hostname label anywhere: the node name (llm-d: the Pod's spec.hostname)
    assert x.topology(ep(2, node="n2", node_labels={ZONE: "z"})) == Topology("n2", "", "z", "")
    assert x.topology(ep(3)) is None  # nothing at all: no attribute
    x.extract_endpoint("add-or-update", ep(3))  # accepted under endpoint notifications


def test_extractor_rejects_bad_parameters() -> None:
    make_error("topology-extractor", {"hostname": 3}, "hostname: expected a string")
    with decoding(strict=True):
        make_error("topology-extractor", {"zones": "x"},
                   "plugins[0].parameters.zones: unknown parameter")


# ========================================================== topology-affinity-filter


def topo_ep(i: int, host: str = "", rack: str = "", zone: str = "", region: str = "") -> Endpoint:
    labels = {k: v for k, v in ((HOST, host), (RACK, rack), (ZONE, zone), (REGION, region))
              if v}
    return ep(i, labels=labels)


def bound_filter(params: dict[str, Any] | None = None,
                 extractor: TopologyExtractor | None = None) -> TopologyAffinityFilter:
    f = make("topology-affinity-filter", params)
    assert isinstance(f, TopologyAffinityFilter) and isinstance(f, Filter)
    x = extractor or TopologyExtractor()
    f.bind(PluginHandle({x.name: x, f.name: f}))
    return f


def with_peer(peer: Endpoint | None) -> CycleState:
    s = CycleState()
    if peer is not None:
        s[DECODE_ENDPOINT_KEY] = peer
    return s


PEER = topo_ep(9, "h1", "r1", "z1", "reg1")
SAME_HOST = topo_ep(1, "h1", "r1", "z1", "reg1")
SAME_RACK = topo_ep(2, "h2", "r1", "z1", "reg1")
NO_MATCH = topo_ep(3, "h3", "r3", "z3", "reg3")


def test_filter_keeps_only_candidates_meeting_min_affinity() -> None:
    f = bound_filter()
    assert f.min_affinity is Level.HOST and f.name == "topology-affinity-filter"
    eps = [SAME_HOST, SAME_RACK, NO_MATCH]
    assert names(f.filter(with_peer(PEER), req(), eps)) == ["pod-1"]
    f = bound_filter({"minAffinity": "rack"})
    assert names(f.filter(with_peer(PEER), req(), eps)) == ["pod-1", "pod-2"]
    f = bound_filter({"minAffinity": "region"})
    assert names(f.filter(with_peer(PEER), req(), eps)) == ["pod-1", "pod-2"]


def test_filter_sparse_candidate_matches_at_its_only_level() -> None:
    rack_only = topo_ep(4, rack="r1")
    assert names(bound_filter({"minAffinity": "rack"}).filter(
        with_peer(PEER), req(), [rack_only])) == ["pod-4"]
    # host floor not met by anyone: fails open
    assert names(bound_filter().filter(with_peer(PEER), req(), [rack_only])) == ["pod-4"]


def test_filter_fails_open() -> None:
    f = bound_filter()
    eps = [topo_ep(1, "h2"), topo_ep(2, "h3")]
    assert f.filter(with_peer(topo_ep(9, "h1")), req(), eps) == eps  # no candidate matches
    assert f.filter(with_peer(None), req(), eps) == eps  # no peer (aggregated)
    assert f.filter(with_peer(ep(9)), req(), eps) == eps  # peer without topology


def test_filter_drops_candidates_without_topology() -> None:
    f = bound_filter()
    out = f.filter(with_peer(topo_ep(9, "h1")), req(), [topo_ep(1, "h1"), ep(2)])
    assert names(out) == ["pod-1"]


def test_filter_producer_name_and_missing_extractor() -> None:
    other = TopologyExtractor("rack-topo", rack_label="my/rack")
    f = bound_filter({"minAffinity": "rack", "topologyProducerName": "rack-topo"}, other)
    assert dict(f.consumes) == {"Topology/rack-topo": "Topology"}
    assert f.extractor is other
    peer = ep(9, labels={"my/rack": "A"})
    eps = [ep(1, labels={"my/rack": "A"}), ep(2, labels={"my/rack": "B"})]
    assert names(f.filter(with_peer(peer), req(), eps)) == ["pod-1"]
    # no extractor of that name: a warning and every candidate passes
    f = make("topology-affinity-filter")
    f.bind(PluginHandle({f.name: f}))
    assert f.extractor is None
    assert f.filter(with_peer(peer), req(), eps) == eps


def test_filter_rejects() -> None:
    make_error("topology-affinity-filter", {"minAffinity": "datacenter"},
               "plugins[0].parameters.minAffinity: invalid configuration for "
               "'topology-affinity-filter' filter: invalid topology level 'datacenter'")
    make_error("topology-affinity-filter", {"minAffinity": 1}, "minAffinity: expected a string")
    make_error("topology-affinity-filter", {"topologyProducerName": ["x"]},
               "topologyProducerName: expected a string")


def test_topology_types_in_a_config_strict() -> None:
    text = """
plugins:
- {type: topology-extractor, name: topo, parameters: {hostname: my/host}}
- {type: topology-affinity-filter, parameters: {minAffinity: zone, topologyProducerName: topo}}
- {type: queue-scorer}
- {type: endpoint-notification-source}
- {type: metrics-data-source}
- {type: core-metrics-extractor}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: topology-affinity-filter}, {pluginRef: queue-scorer}]
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
  - pluginRef: endpoint-notification-source
    extractors: [{pluginRef: topo}]
"""
    built = load_and_build(None, text, strict=True)
    f = built.plugins["topology-affinity-filter"]
    assert isinstance(f, TopologyAffinityFilter) and f.min_affinity is Level.ZONE
    assert f.extractor is built.plugins["topo"]


# ============================================ llm-d's deploy/config/pd-topology-epp-config


def test_pd_topology_config_loads_strictly() -> None:
    built = load_and_build(str(PD_TOPOLOGY), strict=True)
    assert isinstance(built.plugins["topology-extractor"], TopologyExtractor)
    f = built.plugins["topology-affinity-filter"]
    assert isinstance(f, TopologyAffinityFilter)
    assert f.extractor is built.plugins["topology-extractor"]
    # this project's scorer (Grove/rack levels) side by side with llm-d's filter
    assert isinstance(built.plugins["topology-affinity-scorer"], TopologyAffinityScorer)
    prefill = built.scheduler.profiles["prefill"]
    assert f in prefill.filters


def server(eps: list[Endpoint], text: str | None = None) -> ServerParts:
    timings = PluginTimings()
    built = load_and_build(None if text else str(PD_TOPOLOGY), text, timer=timings)
    parts = wire(validate(ServeOptions(static=StaticSourceOptions(
        endpoints=",".join(e.key for e in eps)))), built, timings, None)
    parts.store.set_endpoints(eps)
    for e in eps:
        parts.store.update_metrics(e.key, e.metrics)
    return parts


async def send(parts: ServerParts, rid: str) -> tuple[str, str | None]:
    body = orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": f"request {rid}: " + "tell me about topology " * 40}]})
    hdrs = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": rid}
    routing = await parts.director.route(hdrs, body, True, None)
    parts.director.on_done(routing.context, aborted=False)
    return routing.destination, routing.set_headers.get(keys.HEADER_PREFILLER)


def node_ep(i: int, role: str, node: str, queue: int = 0, rack: str = "r1") -> Endpoint:
    return Endpoint(name=f"{role}-{i}", address=f"10.0.0.{i}", port=8000,
                    labels={keys.LABEL_ROLE: role}, node_name=node,
                    node_labels={HOST: node, RACK: rack},
                    metrics=Metrics(waiting_queue_size=queue))


async def test_pd_topology_config_routes_prefill_to_the_decode_host() -> None:
    """The decode pod is chosen first (queue-scorer: the idle one); the prefill pod must
    share its host (kubernetes.io/hostname from the node) although another prefill pod
    is less loaded."""
    d1, d2 = node_ep(1, "decode", "n1", queue=0), node_ep(2, "decode", "n2", queue=5)
    p1, p2 = node_ep(3, "prefill", "n1", queue=4), node_ep(4, "prefill", "n2", queue=0)
    p3 = node_ep(5, "prefill", "n3", queue=0)
    parts = server([d1, d2, p1, p2, p3])
    for i in range(4):
        dest, prefiller = await send(parts, f"a{i}")
        assert dest == d1.key and prefiller == p1.key
    # the other decode pod becomes the idle one: prefill follows it to n2
    parts.store.update_metrics(d1.key, Metrics(waiting_queue_size=9))
    parts.store.update_metrics(d2.key, Metrics(waiting_queue_size=0))
    for i in range(4):
        dest, prefiller = await send(parts, f"b{i}")
        assert dest == d2.key and prefiller == p2.key


async def test_pd_topology_config_fails_open_without_a_colocated_prefill() -> None:
    d1 = node_ep(1, "decode", "n1")
    p2, p3 = node_ep(2, "prefill", "n2", queue=3), node_ep(3, "prefill", "n3", queue=0)
    parts = server([d1, p2, p3])
    dest, prefiller = await send(parts, "c")
    assert dest == d1.key and prefiller == p3.key  # no host match: the least loaded


# ================================================================= utilization-filter


def test_utilization_filter_conditions() -> None:
    f = make("utilization-filter", {"conditions": [
        {"metric": "running-requests", "maxValue": 40}, {"metric": "waiting-queue",
                                                         "maxValue": 0}]})
    assert isinstance(f, UtilizationFilter) and dict(f.consumes) == {}
    ok = ep(1, metrics=Metrics(running_requests=40, waiting_queue_size=0))
    busy = ep(2, metrics=Metrics(running_requests=41))
    queued = ep(3, metrics=Metrics(running_requests=1, waiting_queue_size=1))
    missing = ep(4)  # no metrics: every metric counts as 0
    assert names(f.filter(CycleState(), req(), [ok, busy, queued, missing])) == [
        "pod-1", "pod-4"]
    kv = make("utilization-filter", {"conditions": [{"metric": "kv-cache-utilization",
                                                     "maxValue": 0.8}]})
    eps = [ep(1, metrics=Metrics(kv_cache_usage=0.8)), ep(2, metrics=Metrics(kv_cache_usage=0.81))]
    assert names(kv.filter(CycleState(), req(), eps)) == ["pod-1"]


def test_utilization_filter_fallback_on_empty() -> None:
    cond = {"conditions": [{"metric": "waiting-queue", "maxValue": 0}]}
    eps = [ep(1, metrics=Metrics(waiting_queue_size=2)), ep(2, metrics=Metrics(waiting_queue_size=1))]
    assert make("utilization-filter", cond).filter(CycleState(), req(), eps) == []
    f = make("utilization-filter", {**cond, "fallbackOnEmpty": True})
    assert f.filter(CycleState(), req(), eps) == eps


def test_utilization_filter_active_requests_from_the_inflight_producer() -> None:
    f = make("utilization-filter", {"conditions": [{"metric": "active-requests",
                                                    "maxValue": 1}]})
    assert dict(f.consumes) == {"InFlightLoadKey": "InFlightLoad"}
    handle = PluginHandle({f.name: f})
    f.bind(handle)  # none declared: one is created
    assert isinstance(f.producer, InFlightLoadProducer)
    assert handle.get("utilization-filter-producer") is f.producer
    a, b = ep(1), ep(2)
    f.producer.tracker.add([a.key, b.key])
    f.producer.tracker.add([b.key])
    assert names(f.filter(CycleState(), req(), [a, b])) == ["pod-1"]
    # the declared one, by name
    mine = InFlightLoadProducer("mine")
    g = make("utilization-filter", {"inFlightLoadProducerName": "mine", "conditions": [
        {"metric": "active-requests", "maxValue": 0}]})
    g.bind(PluginHandle({"mine": mine, "other": InFlightLoadProducer("other"), g.name: g}))
    assert g.producer is mine


@pytest.mark.parametrize(("params", "fragment"), [
    (None, ("plugins[0].parameters.conditions: utilization filter requires at least one "
           "condition")),
    ({"conditions": []}, "requires at least one condition"),
    ({"conditions": [{"metric": "gpu", "maxValue": 1}]},
     ("conditions[0].metric: utilization filter condition metric must be one of "
     "active-requests, running-requests, waiting-queue, kv-cache-utilization, got 'gpu'")),
    ({"conditions": [{"metric": "waiting-queue"}]},
     ("conditions[0].maxValue: utilization filter condition for 'waiting-queue' requires "
     "maxValue")),
    ({"conditions": [{"metric": "waiting-queue", "maxValue": -1}]},
     "requires a non-negative maxValue, got -1"),
    ({"conditions": [{"metric": "kv-cache-utilization", "maxValue": 1.5}]},
     "'kv-cache-utilization' is a fraction and must be at most 1, got 1.5"),
    ({"conditions": [{"metric": "waiting-queue", "maxValue": "x"}]},
     "conditions[0].maxValue: expected a number, got 'x'"),
    ({"conditions": "waiting-queue"}, "conditions: expected a list"),
    ({"conditions": [{"metric": "waiting-queue", "maxValue": 1}],
      "inFlightLoadProducerName": "nope"}, None),
    ({"conditions": [{"metric": "active-requests", "maxValue": 1}],
      "inFlightLoadProducerName": "nope"},
     "inFlightLoadProducerName: no inflight-load-producer named 'nope'"),
])
def test_utilization_filter_rejects(params: dict[str, Any] | None, fragment: str | None) -> None:
    if fragment is None:  # the name matters only with active-requests
        make("utilization-filter", params).bind(PluginHandle())
        return
    make_error("utilization-filter", params, fragment)


def test_utilization_filter_strict_unknown_condition_key() -> None:
    text = """
plugins:
- {type: utilization-filter, parameters: {conditions: [{metric: waiting-queue, maxValue: 1, max: 2}]}}
- {type: max-score-picker}
"""
    with pytest.raises(ConfigError, match=r"conditions\[0\]\.max: unknown parameter; this "
                                          "plugin accepts: maxValue, metric"):
        load_and_build(None, text, strict=True)


# ================================================================ context-length-aware

LABEL = "llm-d.ai/context-length-range"


def cl(i: int, rng: str | None) -> Endpoint:
    return ep(i, labels={LABEL: rng} if rng is not None else {})


def test_context_range_parsing() -> None:
    assert parse_context_range("0-2048") == (0, 2048)
    assert parse_context_range(" 10 - 20 ") == (10, 20)
    assert parse_context_range("5-5") == (5, 5)
    for bad, msg in (("", "empty range string"), ("1-2-3", "invalid range format"),
                     ("a-2", "invalid min value: a"), ("1-b", "invalid max value: b"),
                     ("9-1", "min (9) cannot be greater than max (1)"), ("100", "invalid")):
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            parse_context_range(bad)


def test_range_score_tiers() -> None:
    assert range_score(100, 100, 100) == 1.0
    # in range: 0.3 + 0.7 × (0.7 × width score + 0.3 × headroom)
    assert range_score(0, 0, 10000) == pytest.approx(0.3 + 0.7 * (0.7 * 0.5 + 0.3))
    tight, wide = range_score(1000, 0, 2048), range_score(1000, 0, 32768)
    assert 1.0 >= tight > wide > 0.3
    # out of range: below every in-range score, nearer is better
    assert range_score(9000, 0, 8192) == pytest.approx(0.3 / (1 + 808 / 1000))
    assert range_score(9000, 0, 8192) > range_score(9000, 0, 2048)
    assert range_score(10, 100, 200) == pytest.approx(0.3 / 1.09)
    assert range_score(10**9, 0, 1) < 0.3 < range_score(2048, 0, 2048)


def test_context_length_scores_and_default_filter_passes() -> None:
    p = make("context-length-aware")
    assert isinstance(p, ContextLengthAware) and isinstance(p, Filter) and isinstance(p, Scorer)
    assert (p.label, p.enable_filtering) == (LABEL, False)
    eps = [cl(1, "0-2048"), cl(2, "2048-8192"), cl(3, None), cl(4, "bogus")]
    scores = p.score(CycleState(), req(1000), eps)
    assert scores[0] == pytest.approx(range_score(1000, 0, 2048))
    assert scores[1] == pytest.approx(range_score(1000, 2048, 8192)) and scores[1] < 0.3
    assert scores[2:] == [0.5, 0.0]
    assert p.filter(CycleState(), req(1000), eps) == eps  # filtering off
    # no tokens: the length is 0
    assert p.score(CycleState(), req(), [cl(1, "0-10")])[0] == pytest.approx(
        range_score(0, 0, 10))


def test_context_length_filtering() -> None:
    p = make("context-length-aware", {"enableFiltering": True, "label": "ctx"})
    eps = [ep(1, labels={"ctx": "0-2048"}), ep(2, labels={"ctx": "2049-8192"}), ep(3),
           ep(4, labels={"ctx": "x"})]
    assert names(p.filter(CycleState(), req(3000), eps)) == ["pod-2", "pod-3"]
    assert names(p.filter(CycleState(), req(2048), eps)) == ["pod-1", "pod-3"]
    assert names(p.filter(CycleState(), req(10**6), eps)) == ["pod-3"]


def test_context_length_creates_a_token_producer_when_none() -> None:
    p = make("context-length-aware", name="ctx")
    handle = PluginHandle({"ctx": p})
    p.bind(handle)
    assert isinstance(handle.get("ctx-token-producer"), TokenProducer)
    declared = TokenProducer("tp", EstimateTokenizer())
    q = make("context-length-aware", name="ctx2")
    h2 = PluginHandle({"tp": declared, "ctx2": q})
    q.bind(h2)
    assert len(h2) == 2
    assert dict(q.consumes) == {"TokenizedPrompt": "TokenizedPrompt"}


def test_context_length_rejects() -> None:
    make_error("context-length-aware", {"label": ""},
               "plugins[0].parameters.label: invalid configuration for 'context-length-aware' "
               "plugin: 'label' must be specified")
    make_error("context-length-aware", {"enableFiltering": "yes"},
               "enableFiltering: expected true or false")


CONTEXT_CONFIG = """
plugins:
- type: context-length-aware
  parameters: {enableFiltering: true}
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: context-length-aware
    weight: 3
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""


async def test_context_length_config_routes_by_prompt_length() -> None:
    """llm-d's README example (filter mode, tokens from the auto-created estimate
    token-producer): short prompts go to the short-context pod, long ones to the other."""
    short = Endpoint(name="short", address="10.0.0.1", port=8000, labels={LABEL: "0-200"})
    long = Endpoint(name="long", address="10.0.0.2", port=8000, labels={LABEL: "201-100000"})
    parts = server([short, long], CONTEXT_CONFIG)
    d = parts.director
    for i, (words, want) in enumerate(((5, short), (2000, long), (10, short))):
        body = orjson.dumps({"model": "m", "messages": [{"role": "user",
                                                         "content": "word " * words}]})
        routing = await d.route({":method": "POST", ":path": "/v1/chat/completions",
                                 "x-request-id": f"c{i}"}, body, True, None)
        d.on_done(routing.context, aborted=False)
        assert routing.destination == want.key


def test_fixture_readme_lists_the_config() -> None:
    readme = (FIXTURES / "README.md").read_text()
    assert f"`{PD_TOPOLOGY.relative_to(FIXTURES)}`" in readme


EXAMPLE = Path(__file__).parents[3] / "config" / "examples" / "llmd-pd-topology.yaml"


async def test_example_config_routes_prefill_to_the_decode_host() -> None:
    """config/examples/llmd-pd-topology.yaml: the overloaded decode pod is filtered out,
    the prefill pod follows the chosen decode pod's host."""
    load_and_build(str(EXAMPLE), strict=True)
    d1, d2 = node_ep(1, "decode", "n1", queue=9), node_ep(2, "decode", "n2", queue=0)
    p1, p2 = node_ep(3, "prefill", "n1", queue=0), node_ep(4, "prefill", "n2", queue=3)
    parts = server([d1, d2, p1, p2], EXAMPLE.read_text())
    body = orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": "a long prompt about hosts " * 200}]})
    routing = await parts.director.route({":method": "POST", ":path": "/v1/chat/completions",
                                          "x-request-id": "ex"}, body, True, None)
    parts.director.on_done(routing.context, aborted=False)
    assert routing.destination == d2.key
    assert routing.set_headers.get(keys.HEADER_PREFILLER) == p2.key
