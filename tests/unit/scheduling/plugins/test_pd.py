"""P/D disaggregation: handlers, deciders, role filters, topology pairing."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.config.loader import build, load_and_build, parse_config
from epp.errors import ConfigError, NoCapacity
from epp.scheduling.plugins.pd import DECODE_ENDPOINT_KEY
from epp.scheduling.plugins.roles import DecodeFilter, PrefillFilter
from epp.scheduling.plugins.topology import TopologyAffinityScorer
from epp.scheduling.types import ApiType, CycleState, Endpoint, LLMRequest, Metrics

REPO = Path(__file__).resolve().parents[4]


def ep(i: int, role: str | None = None, labels: dict[str, str] | None = None,
       node: dict[str, str] | None = None, queue: int = 0) -> Endpoint:
    lab = dict(labels or {})
    if role is not None:
        lab["llm-d.ai/role"] = role
    return Endpoint(f"p{i}", f"10.0.0.{i}", 8000, labels=lab, node_labels=node or {},
                    metrics=Metrics(waiting_queue_size=queue))


def req(prompt: str = "hello " * 400) -> LLMRequest:
    return LLMRequest("r", "m", "m", ApiType.COMPLETIONS, prompt, {})


def schedule(built, request, endpoints):  # type: ignore[no-untyped-def]
    result = built.scheduler.schedule(request, endpoints)
    headers = {}
    for p in built.pre_request:
        p.pre_request(request, result)
    for h in built.request_headers:
        headers.update(h.request_headers(request, result))
    return result, headers


def pd_config(decider: str, extra: str = "") -> str:
    return f"""
plugins:
- type: disagg-profile-handler
  parameters: {{profiles: {{decode: decode, prefill: prefill}}, deciders: {{prefill: d}}}}
- {decider}
- type: decode-filter
- type: prefill-filter
- type: queue-scorer
- type: prefix-cache-scorer
  parameters: {{blockSizeTokens: 4}}
- type: max-score-picker
{extra}
schedulingProfiles:
- name: decode
  plugins: [{{pluginRef: decode-filter}}, {{pluginRef: queue-scorer}}, {{pluginRef: prefix-cache-scorer}}]
- name: prefill
  plugins: [{{pluginRef: prefill-filter}}, {{pluginRef: queue-scorer}}]
"""


PODS = [ep(1, "decode"), ep(2, "decode", queue=3), ep(3, "prefill"), ep(4, "prefill", queue=5),
        ep(5, queue=1)]


def test_role_filters() -> None:
    d = DecodeFilter("d").filter(CycleState(), req(), PODS + [ep(6, "both"), ep(7, "Prefill-Decode")])
    assert [e.name for e in d] == ["p1", "p2", "p5", "p6", "p7"]
    p = PrefillFilter("p").filter(CycleState(), req(), PODS + [ep(8, "PREFILL")])
    assert [e.name for e in p] == ["p3", "p4", "p8"]
    dyn = Endpoint("dy", "10.0.1.1", 8000, labels={"nvidia.com/dynamo-sub-component-type": "prefill"})
    assert PrefillFilter("p").filter(CycleState(), req(), [dyn]) == [dyn]
    custom = DecodeFilter("d", role_label="my/role")
    other = Endpoint("o", "10.0.2.1", 8000, labels={"my/role": "prefill", "llm-d.ai/role": "decode"})
    assert custom.filter(CycleState(), req(), [other]) == []


def test_always_disagg_sets_prefiller_header_and_primary_is_decode() -> None:
    built = build(parse_config(pd_config("{type: always-disagg-pd-decider, name: d}"), "t"))
    result, headers = schedule(built, req(), PODS)
    assert result.primary_profile == "decode"
    assert result.primary.endpoints[0].name == "p1"          # least queued decode-capable
    assert headers == {"x-prefiller-host-port": "10.0.0.3:8000"}  # least queued prefill
    assert built.scheduler.handler.decision(result) == "disaggregated"  # type: ignore[attr-defined]


def test_prefix_decider_zero_means_never() -> None:
    built = build(parse_config(pd_config(
        "{type: prefix-based-pd-decider, name: d, parameters: {nonCachedTokens: 0}}"), "t"))
    result, headers = schedule(built, req(), PODS)
    assert headers == {} and "prefill" not in result.profile_results


def test_prefix_decider_disaggregates_only_uncached_long_prompts() -> None:
    built = build(parse_config(pd_config(
        "{type: prefix-based-pd-decider, name: d, parameters: {nonCachedTokens: 100}}"), "t"))
    long_prompt = "the same long context " * 100   # ~550 tokens
    _, h1 = schedule(built, req(long_prompt), PODS)
    assert "x-prefiller-host-port" in h1                 # nothing cached yet
    _, h2 = schedule(built, req(long_prompt), PODS)
    assert h2 == {}                                      # now cached on the decode pod
    _, h3 = schedule(built, req("short question"), PODS)
    assert h3 == {}                                      # < 100 tokens


def test_legacy_pd_threshold_zero_means_always() -> None:
    cfg = pd_config("{type: always-disagg-pd-decider, name: d}").replace(
        "- type: disagg-profile-handler\n  parameters: {profiles: {decode: decode, prefill: prefill}, deciders: {prefill: d}}",
        "- type: pd-profile-handler\n  parameters: {threshold: 0, hashBlockSize: 64}")
    built = build(parse_config(cfg, "t"))
    long_prompt = "the same long context " * 100
    for _ in range(3):  # cached or not, short or long: always
        _, h = schedule(built, req(long_prompt), PODS)
        assert "x-prefiller-host-port" in h
    _, h = schedule(built, req("x"), PODS)
    assert "x-prefiller-host-port" in h


def test_legacy_pd_threshold_positive() -> None:
    cfg = pd_config("{type: always-disagg-pd-decider, name: d}").replace(
        "- type: disagg-profile-handler\n  parameters: {profiles: {decode: decode, prefill: prefill}, deciders: {prefill: d}}",
        "- type: pd-profile-handler\n  parameters: {threshold: 100}")
    built = build(parse_config(cfg, "t"))
    _, h = schedule(built, req("short"), PODS)
    assert h == {}
    _, h = schedule(built, req("uncached words " * 100), PODS)
    assert "x-prefiller-host-port" in h


def test_failed_prefill_falls_back_to_decode_only() -> None:
    built = build(parse_config(pd_config("{type: always-disagg-pd-decider, name: d}"), "t"))
    no_prefill = [e for e in PODS if e.labels.get("llm-d.ai/role") != "prefill"]
    result, headers = schedule(built, req(), no_prefill)
    assert headers == {} and result.profile_results["prefill"] is None
    assert result.primary.endpoints[0].name == "p1"
    assert built.scheduler.handler.decision(result) == "decode-only"  # type: ignore[attr-defined]


def test_failed_decode_fails_the_request() -> None:
    built = build(parse_config(pd_config("{type: always-disagg-pd-decider, name: d}"), "t"))
    with pytest.raises(NoCapacity):
        built.scheduler.schedule(req(), [ep(3, "prefill")])


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="no plugin named 'nope'"):
        build(parse_config(pd_config("{type: always-disagg-pd-decider, name: d}").replace(
            "deciders: {prefill: d}", "deciders: {prefill: nope}"), "t"))
    with pytest.raises(ConfigError, match="is not a prefill decider"):
        build(parse_config(pd_config("{type: queue-scorer, name: d}"), "t"))
    with pytest.raises(ConfigError, match="no scheduling profile named 'dec'"):
        build(parse_config(pd_config("{type: always-disagg-pd-decider, name: d}").replace(
            "decode: decode,", "decode: dec,"), "t"))
    with pytest.raises(ConfigError, match=r"primaryPort: must be <= 65535, got 70000"):
        build(parse_config("plugins: [{type: pd-profile-handler, parameters: {primaryPort: 70000}}]", "t"))
    with pytest.raises(ConfigError, match=r"primaryPort: expected an integer"):
        build(parse_config(pd_config("{type: always-disagg-pd-decider, name: d}").replace(
            "deciders: {prefill: d}", "deciders: {prefill: d}, primaryPort: '8000'"), "t"))


def test_primary_port_sends_to_the_pods_primary_port_with_the_rank_header() -> None:
    """llm-d's primaryPort: the destination is each chosen decode endpoint's address at
    the primary port (its sidecar), and x-data-parallel-host-port names the rank picked."""
    text = pd_config("{type: always-disagg-pd-decider, name: d}").replace(
        "deciders: {prefill: d}", "deciders: {prefill: d}, primaryPort: 9000")
    built = build(parse_config(text, "t"))
    ranks = [Endpoint("p1-rank-0", "10.0.0.1", 8000, labels={"llm-d.ai/role": "decode"},
                      metrics=Metrics(waiting_queue_size=2)),
             Endpoint("p1-rank-1", "10.0.0.1", 8001, labels={"llm-d.ai/role": "decode"}),
             ep(3, "prefill")]
    result, headers = schedule(built, req(), ranks)
    assert result.primary.endpoints[0].key == "10.0.0.1:8001"   # the emptier rank
    assert result.destination() == "10.0.0.1:9000"
    assert headers == {"x-data-parallel-host-port": "10.0.0.1:8001",
                       "x-prefiller-host-port": "10.0.0.3:8000"}
    # Legacy handler, decode-only (threshold too high to disaggregate); IPv6 address.
    legacy = build(parse_config("""
plugins:
- {type: pd-profile-handler, parameters: {threshold: 100000, primaryPort: 9000}}
- type: decode-filter
- type: max-score-picker
schedulingProfiles:
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}]
- name: prefill
  plugins: [{pluginRef: max-score-picker}]
""", "t"))
    v6 = Endpoint("v6", "fd00::1", 8002, labels={"llm-d.ai/role": "decode"})
    result, headers = schedule(legacy, req(), [v6])
    assert result.destination() == "[fd00::1]:9000"
    assert headers == {"x-data-parallel-host-port": "[fd00::1]:8002"}
    # Without primaryPort: the endpoint itself, no data-parallel header.
    plain = build(parse_config(pd_config("{type: always-disagg-pd-decider, name: d}"), "t"))
    result, headers = schedule(plain, req(), ranks)
    assert result.destination() == "10.0.0.1:8001" and "x-data-parallel-host-port" not in headers


def test_topology_levels_score_strongest_shared_level() -> None:
    grove = {"grove.io/podcliquescalinggroup": "sg", "grove.io/podgang": "pg0",
             "app.kubernetes.io/part-of": "pcs", "grove.io/podcliqueset-replica-index": "0"}
    decode = ep(1, "decode", {**grove, "grove.io/podcliquescalinggroup-replica-index": "0"},
                {"topology.kubernetes.io/rack": "r1", "topology.kubernetes.io/zone": "z"})
    same_sg = ep(2, "prefill", {**grove, "grove.io/podcliquescalinggroup-replica-index": "0"})
    same_gang = ep(3, "prefill", {**grove, "grove.io/podcliquescalinggroup-replica-index": "1"})
    same_rack = ep(4, "prefill", {}, {"topology.kubernetes.io/rack": "r1"})
    same_zone = ep(5, "prefill", {}, {"topology.kubernetes.io/rack": "r2",
                                      "topology.kubernetes.io/zone": "z"})
    far = ep(6, "prefill", {}, {"topology.kubernetes.io/rack": "r9"})
    state = CycleState({DECODE_ENDPOINT_KEY: decode})
    s = TopologyAffinityScorer("t")
    scores = s.score(state, req(), [same_sg, same_gang, same_rack, same_zone, far])
    assert scores == [1.0, pytest.approx(5 / 6), pytest.approx(3 / 6), pytest.approx(1 / 6), 0.0]
    # No decode endpoint in the cycle: neutral.
    assert s.score(CycleState(), req(), [far]) == [0.0]
    # required: a filter too.
    r = TopologyAffinityScorer("t", ["topology.kubernetes.io/rack"], required=True)
    assert r.filter(state, req(), [same_rack, same_zone, far]) == [same_rack]
    assert TopologyAffinityScorer("t").filter(state, req(), [far]) == [far]


def test_topology_pairing_spills_over_a_hot_rack() -> None:
    built = load_and_build(str(REPO / "config" / "pd-grove.yaml"))
    rack = lambda r: {"topology.kubernetes.io/rack": r}
    decode = ep(1, "decode", node=rack("r1"))
    near, far = ep(2, "prefill", node=rack("r1")), ep(3, "prefill", node=rack("r2"))
    _, h = schedule(built, req(), [decode, near, far])
    assert h["x-prefiller-host-port"] == near.key
    hot_near = ep(2, "prefill", node=rack("r1"), queue=50)
    _, h = schedule(built, req(), [decode, hot_near, far])
    assert h["x-prefiller-host-port"] == far.key


def test_topology_param_errors() -> None:
    for params, msg in (("{levels: []}", "non-empty list"), ("{levels: [1]}", "non-empty list"),
                        ("{mode: sometimes}", "preferred")):
        with pytest.raises(ConfigError, match=msg):
            build(parse_config(f"plugins: [{{type: topology-affinity-scorer, parameters: {params}}}]", "t"))


def test_example_pd_configs_build() -> None:
    for name in ("pd.yaml", "pd-grove.yaml"):
        built = load_and_build(str(REPO / "config" / name))
        assert set(built.scheduler.profiles) == {"decode", "prefill"}
        assert built.request_headers
