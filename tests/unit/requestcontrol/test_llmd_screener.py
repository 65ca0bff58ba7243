"""llm-d-router v0.10.0's Screener extension point and ``disaggregatedset-rollout-screener``
(issue 18).

Go sources: pkg/epp/framework/interface/requestcontrol/plugins.go (``Screener``),
pkg/epp/requestcontrol/director.go (``runScreeners``: every screener sees the same
candidates, the survivors are their intersection, none left → 503 "screeners eliminated
all endpoint candidates"), pkg/epp/framework/plugins/requestcontrol/screener/
disaggregatedsetrollout/{config.go,plugin.go,screener.go,*_test.go,README.md}."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import pytest
import yaml

from epp.config.loader import load_and_build
from epp.errors import ConfigError, ServiceUnavailable
from epp.framework import interfaces as fw
from epp.requestcontrol.director import build_request
from epp.requestcontrol.rollout_screener import (
    DisaggregatedSetRolloutScreener,
    RevisionGating,
    RolloutPodExtractor,
    parse_selector_string,
    pick_weighted_revision,
    revision_shares,
)
from epp.scheduling.types import ApiType, Endpoint, LLMRequest
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, ServerParts, wire

REV = "disaggregatedset.x-k8s.io/revision"
ROLE = "disaggregatedset.x-k8s.io/role"
SLICE = "disaggregatedset.x-k8s.io/slice"
SCOPE = {"labelSelector": "disaggregatedset.x-k8s.io/name=my-set"}


def params(**over: Any) -> dict[str, Any]:
    p: dict[str, Any] = {
        "scope": SCOPE,
        "headerSelectors": [
            {"name": "revision", "headerName": "X-Disagg-Revision", "labelKey": REV,
             "mode": "strict"},
            {"name": "slice", "headerName": "x-disagg-slice", "labelKey": SLICE,
             "mode": "prefer"}],
        "revisionGating": {"mode": "max-role", "requireRoles": {"values": ["prefill",
                                                                          "decode"]}},
    }
    p.update(over)
    return p


def build(p: dict[str, Any], rng: float = 0.0) -> DisaggregatedSetRolloutScreener:
    text = orjson.dumps({"plugins": [{"type": "disaggregatedset-rollout-screener",
                                      "name": "rollout-screener", "parameters": p}]}).decode()
    s = load_and_build(None, text).plugins["rollout-screener"]
    assert isinstance(s, DisaggregatedSetRolloutScreener)
    s.rng = lambda: rng
    return s


def ep(i: int, rev: str, role: str, slice_: str = "s1") -> Endpoint:
    return Endpoint(name=f"pod-{i}", address=f"10.0.0.{i}", port=8000, namespace="ns",
                    labels={REV: rev, ROLE: role, SLICE: slice_,
                            "disaggregatedset.x-k8s.io/name": "my-set"})


def pod(name: str, rev: str, role: str, ready: bool = True,
        scope: str = "my-set", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": {
        REV: rev, ROLE: role, "disaggregatedset.x-k8s.io/name": scope}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def seed(s: DisaggregatedSetRolloutScreener, counts: dict[str, dict[str, int]]) -> None:
    for rev, per in counts.items():
        for role, n in per.items():
            for i in range(n):
                s.pod_extractor.extract_notification(fw.EVENT_ADD_OR_UPDATE,
                                                     pod(f"{rev}-{role}-{i}", rev, role))


def req(**headers: str) -> LLMRequest:
    return LLMRequest(request_id="r", target_model="m", incoming_model="m",
                      api=ApiType.CHAT_COMPLETIONS, prompt="hi", headers=headers)


# ------------------------------------------------------------------------- config


@pytest.mark.parametrize(("over", "error"), [
    ({"scope": {}}, "scope.labelSelector is required"),
    ({"scope": {"labelSelector": "a in (b"}},
     "scope.labelSelector is not a valid label selector"),
    ({"headerSelectors": [{"headerName": "h", "labelKey": "k", "mode": "strict"}]},
     "headerSelectors[0].name is required"),
    ({"headerSelectors": [{"name": "n", "labelKey": "k", "mode": "strict"}]},
     "headerSelectors[0].headerName is required"),
    ({"headerSelectors": [{"name": "n", "headerName": "h", "mode": "strict"}]},
     "headerSelectors[0].labelKey is required"),
    ({"headerSelectors": [{"name": "n", "headerName": "h", "labelKey": "k", "mode": "x"}]},
     "headerSelectors[0].mode 'x' must be one of strict|prefer"),
    ({"headerSelectors": [{"name": "n", "headerName": "h", "labelKey": "k", "mode": "strict"},
                          {"name": "n", "headerName": "g", "labelKey": "k", "mode": "strict"}]},
     "headerSelectors: duplicate name 'n'"),
    ({"headerSelectors": [{"name": "n", "headerName": "H", "labelKey": "k", "mode": "strict"},
                          {"name": "m", "headerName": "h", "labelKey": "k", "mode": "strict"}]},
     "headerSelectors: duplicate headerName 'h'"),
    ({"revisionGating": None}, "revisionGating is required"),
    ({"revisionGating": {"mode": "sum"}},
     "revisionGating.requireRoles is required when revisionGating.mode=sum"),
    ({"revisionGating": {"mode": "sum", "requireRoles": {"values": []}}},
     "revisionGating.requireRoles.values must contain at least one role"),
    ({"revisionGating": {"mode": "sum", "requireRoles": {"values": ["a", ""]}}},
     "revisionGating.requireRoles.values[1] must not be empty"),
    ({"revisionGating": {"mode": "sum", "requireRoles": {"values": ["a", "a"]}}},
     "revisionGating.requireRoles.values contains duplicate role 'a'"),
    ({"revisionGating": {"mode": "weighted"}},
     "revisionGating.mode 'weighted' must be one of sum|max-role|disabled"),
    ({"headerSelectors": [{"name": "n", "headerName": "h", "labelKey": "k", "mode": "strict",
                           "other": 1}]}, "unknown key(s) other"),
])
def test_config_is_validated(over: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(params(**over))
    msg = str(info.value)
    assert error in msg and ("rollout-screener: " in msg or "plugins[0]" in msg), msg


def test_config_defaults() -> None:
    s = build(params())
    assert s.gating == RevisionGating("max-role", ("prefill", "decode"), REV, ROLE)
    assert s.selectors[0].header_name == "x-disagg-revision"  # lower-cased
    assert build(params(revisionGating={"mode": "disabled"})).gating.active is False


def test_selector_strings() -> None:
    sel = parse_selector_string("app=vllm, tier!=test,env in (prod, staging),gpu,!old,"
                                "zone notin (a)")
    ok = {"app": "vllm", "env": "prod", "gpu": "h100"}
    assert sel.matches(ok)
    assert not sel.matches({**ok, "tier": "test"})
    assert not sel.matches({**ok, "env": "dev"})
    assert not sel.matches({**ok, "old": "1"})
    assert not sel.matches({**ok, "zone": "a"})
    assert not sel.matches({"app": "vllm", "env": "prod"})
    assert parse_selector_string("a==b").matches({"a": "b"})
    for bad in ("a in (b", "a,,b", "=b", "a in ()"):
        with pytest.raises(ValueError):
            parse_selector_string(bad)


# ------------------------------------------------------------------- distribution


@pytest.mark.parametrize(("mode", "counts", "want_v2"), [
    ("sum", {"v1": {"prefill": 2, "decode": 8}, "v2": {"prefill": 1, "decode": 2}}, 3 / 13),
    ("max-role", {"v1": {"prefill": 2, "decode": 8}, "v2": {"prefill": 1, "decode": 2}},
     2 / 10),
    ("sum", {"v1": {"prefill": 8, "decode": 8}, "v2": {"prefill": 2, "decode": 2}}, 2 / 10),
    ("max-role", {"v1": {"prefill": 8, "decode": 2}, "v2": {"prefill": 2, "decode": 1}},
     2 / 10),
    ("max-role", {"v1": {"prefill": 8, "decode": 1}, "v2": {"prefill": 2, "decode": 4}},
     2 / 10),  # the role is shared across revisions
    ("max-role", {"v1": {"prefill": 2, "decode": 8}, "v2": {"prefill": 1, "decode": 2},
                  "v3": {"prefill": 100}}, 2 / 10),  # incomplete revisions ignored
])
def test_shares(mode: str, counts: dict[str, dict[str, int]], want_v2: float) -> None:
    s = build(params(revisionGating={"mode": mode,
                                     "requireRoles": {"values": ["prefill", "decode"]}}))
    seed(s, counts)
    assert s.shares["v2"] == pytest.approx(want_v2)
    assert s.shares["v1"] == pytest.approx(1 - want_v2)
    assert revision_shares(counts, ["prefill", "decode"], mode) == s.shares


def test_pick_weighted_revision() -> None:
    shares = {"v2": 0.25, "v1": 0.75}
    assert pick_weighted_revision(shares, 0) == "v1"
    assert pick_weighted_revision(shares, 0.9) == "v2"
    assert pick_weighted_revision({"v1": 1.0}, 0.99) == "v1"
    assert pick_weighted_revision({}, 0.5) == ""


def test_pods_tracked_only_ready_and_in_scope() -> None:
    s = build(params())
    x = s.pod_extractor
    assert isinstance(x, RolloutPodExtractor) and x.name == "rollout-screener/pod"
    assert x.gvk == "/v1, Kind=Pod" and x.type_name == "disaggregatedset-rollout-pod-extractor"
    x.extract_notification(fw.EVENT_ADD_OR_UPDATE, pod("a", "v1", "prefill"))
    x.extract_notification(fw.EVENT_ADD_OR_UPDATE, pod("b", "v1", "decode", ready=False))
    x.extract_notification(fw.EVENT_ADD_OR_UPDATE, pod("c", "v1", "decode", scope="other"))
    x.extract_notification(fw.EVENT_ADD_OR_UPDATE, pod("d", "v1", "decode", deleting=True))
    x.extract_notification(fw.EVENT_ADD_OR_UPDATE, pod("e", "", "decode"))
    assert s.role_counts == {"v1": {"prefill": 1}} and s.shares == {}
    x.extract_notification(fw.EVENT_ADD_OR_UPDATE, pod("b", "v1", "decode"))
    assert s.shares == {"v1": 1.0}
    x.extract_notification(fw.EVENT_ADD_OR_UPDATE, pod("b", "v1", "decode", ready=False))
    assert s.shares == {}  # no longer ready: dropped
    x.extract_notification(fw.EVENT_ADD_OR_UPDATE, pod("b", "v1", "decode"))
    x.extract_notification(fw.EVENT_DELETE, pod("a", "v1", "prefill"))
    assert s.role_counts == {"v1": {"decode": 1}}


# ------------------------------------------------------------------------- screening

V1 = [ep(1, "v1", "prefill"), ep(2, "v1", "decode"), ep(3, "v1", "decode", "s2")]
V2 = [ep(4, "v2", "prefill"), ep(5, "v2", "decode")]


def test_fails_closed_until_pods_arrive() -> None:
    assert build(params()).screen(req(), V1 + V2) == []


def test_one_revision_is_drawn_by_weight() -> None:
    low, high = build(params(), rng=0.0), build(params(), rng=0.95)
    for s in (low, high):
        seed(s, {"v1": {"prefill": 2, "decode": 9}, "v2": {"prefill": 1, "decode": 1}})
    assert low.screen(req(), V1 + V2) == V1  # v1: 90 % (max-role: decode)
    assert high.screen(req(), V1 + V2) == V2


def test_uncovered_revision_never_serves() -> None:
    s = build(params(), rng=0.99)
    seed(s, {"v1": {"prefill": 3}, "v2": {"prefill": 1, "decode": 1}})
    assert s.screen(req(), V1 + V2) == V2
    # pinned to the uncovered revision: nothing (503), never v2 instead
    assert s.screen(req(**{"x-disagg-revision": "v1"}), V1 + V2) == []


def test_strict_selector_pins_without_a_draw() -> None:
    s = build(params(), rng=0.0)  # the draw would choose v1
    seed(s, {"v1": {"prefill": 2, "decode": 9}, "v2": {"prefill": 1, "decode": 1}})
    assert s.screen(req(**{"x-disagg-revision": "v2"}), V1 + V2) == V2
    assert s.screen(req(**{"x-disagg-revision": "v9"}), V1 + V2) == []
    assert s.strict_no_match == {"revision": 1}
    # prefer selectors never screen
    assert s.screen(req(**{"x-disagg-slice": "s2"}), V1 + V2) == V1
    off = build(params(revisionGating={"mode": "disabled"}))
    assert off.screen(req(), V1 + V2) == V1 + V2  # no pods needed
    assert off.screen(req(**{"x-disagg-revision": "v2"}), V1 + V2) == V2


# --------------------------------------------------------- the core: the extension point


CONFIG = """
plugins:
- type: disaggregatedset-rollout-screener
  name: rollout-screener
  parameters: %s
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
"""


def server(p: dict[str, Any]) -> ServerParts:
    timings = PluginTimings()
    built = load_and_build(None, CONFIG % orjson.dumps(p).decode(), timer=timings,
                           strict=True)
    eps = V1 + V2
    parts = wire(validate(ServeOptions(static=StaticSourceOptions(
        endpoints=",".join(e.key for e in eps)))), built, timings, None)
    parts.store.set_endpoints(eps)
    return parts


async def decide(parts: ServerParts, **headers: str) -> tuple[str, dict[str, str]]:
    request, _ = build_request({":path": "/v1/chat/completions", **headers}, orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}), True)
    d = await parts.core.decide_request(request, None)
    parts.core.complete(d.ticket, 200, False, None)
    return d.destination, d.response_headers


async def test_core_screens_and_stamps_response_headers() -> None:
    parts = server(params())
    s = parts.built.plugins["rollout-screener"]
    assert isinstance(s, DisaggregatedSetRolloutScreener)
    assert [p.name for p in parts.core.screeners] == ["rollout-screener"]
    # no pods seen yet: fail closed
    with pytest.raises(ServiceUnavailable, match="screeners eliminated all endpoint "
                       "candidates"):
        await decide(parts)
    seed(s, {"v2": {"prefill": 1, "decode": 1}})
    for _ in range(5):
        dest, headers = await decide(parts)
        assert dest in {e.key for e in V2}
        assert headers["x-disagg-revision"] == "v2" and headers["x-disagg-slice"] == "s1"


class Keep:
    """A screener keeping the endpoints whose key is in ``keys``; counts its calls."""

    type_name = "test-screener"

    def __init__(self, name: str, keys: set[str]) -> None:
        self.name = name
        self.keys = keys
        self.calls = 0
        self.seen: list[int] = []

    def screen(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        self.calls += 1
        self.seen.append(len(endpoints))
        return [e for e in endpoints if e.key in self.keys]


class Prepare:
    type_name = "test-producer"
    name = "prepare"

    def __init__(self) -> None:
        self.got: list[str] = []

    async def prepare_request_data(self, request: LLMRequest,
                                   endpoints: Sequence[Endpoint]) -> None:
        self.got = [e.key for e in endpoints]


async def test_screeners_intersect_once_per_request_before_prepare_data() -> None:
    parts = server(params(revisionGating={"mode": "disabled"}, headerSelectors=[]))
    a = Keep("a", {V1[0].key, V1[1].key, V2[0].key})
    b = Keep("b", {V1[1].key, V2[0].key, V2[1].key})
    prep = Prepare()
    assert isinstance(a, fw.Screener) and isinstance(prep, fw.PrepareDataPlugin)
    parts.core.screeners = (a, b)
    parts.core.prepare_data = (prep,)
    dest, _ = await decide(parts)
    assert dest in {V1[1].key, V2[0].key}
    assert prep.got == [V1[1].key, V2[0].key]  # the intersection, candidates' order
    assert (a.calls, b.calls) == (1, 1) and a.seen == b.seen == [5]  # each sees all
    parts.core.screeners = (a, Keep("c", {V1[2].key}))
    with pytest.raises(ServiceUnavailable):
        await decide(parts)
    assert a.calls == 2  # screened once for PrepareData and scheduling together


def test_pod_extractor_attaches_to_a_pod_source() -> None:
    doc = yaml.safe_load(CONFIG % orjson.dumps(params()).decode())
    doc["plugins"].append({"type": "k8s-notification-source", "name": "pods",
                           "parameters": {"version": "v1", "kind": "Pod"}})
    doc["dataLayer"] = {"sources": [
        {"pluginRef": "pods", "extractors": [{"pluginRef": "rollout-screener/pod"}]}]}
    built = load_and_build(None, yaml.safe_dump(doc), strict=True)
    s = built.plugins["rollout-screener"]
    assert isinstance(s, DisaggregatedSetRolloutScreener)
    assert built.data_layer is not None
    pods = [c for c in built.data_layer.sources if c.source.name == "pods"]
    assert pods[0].extractors == (s.pod_extractor,)
    # gating off: no extractor
    off = load_and_build(None, CONFIG % orjson.dumps(
        params(revisionGating={"mode": "disabled"})).decode())
    assert "rollout-screener/pod" not in off.plugins
