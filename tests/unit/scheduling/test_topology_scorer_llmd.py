"""topology-affinity-scorer in llm-d's mode (llm-d-router v0.10.0
scheduling/scorer/topologyaffinity): tier scores 1 / 0.2 / 0.05 / 0.02 / 0 against the
decode endpoint, read from a topology-extractor; this project's label levels otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from epp.config.loader import load_and_build
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.pd import DECODE_ENDPOINT_KEY
from epp.scheduling.plugins.topology import TopologyAffinityScorer
from epp.scheduling.plugins.topology_llmd import TopologyExtractor
from epp.scheduling.types import ApiType, CycleState, Endpoint, LLMRequest

FIXTURES = Path(__file__).parents[2] / "fixtures" / "llm-d-router-v0.10.0"
HOST, RACK = "kubernetes.io/hostname", "topology.kubernetes.io/rack"
ZONE, REGION = "topology.kubernetes.io/zone", "topology.kubernetes.io/region"


def ep(i: int, host: str = "", rack: str = "", zone: str = "", region: str = "") -> Endpoint:
    labels = {k: v for k, v in ((HOST, host), (RACK, rack), (ZONE, zone), (REGION, region))
              if v}
    return Endpoint(name=f"pod-{i}", address=f"10.0.0.{i}", port=8000, labels=labels)


PEER = ep(9, "h1", "r1", "z1", "g1")
CANDIDATES = [ep(1, "h1", "r1", "z1", "g1"), ep(2, "h2", "r1", "z1", "g1"),
              ep(3, "h3", "r3", "z1", "g1"), ep(4, "h4", "r4", "z4", "g1"),
              ep(5, "h5", "r5", "z5", "g5"), ep(6)]
REQ = LLMRequest(request_id="r", target_model="m", incoming_model="m",
                 api=ApiType.CHAT_COMPLETIONS, prompt="p", headers={})


def scorer(params: dict[str, Any] | None, *plugins: Any) -> TopologyAffinityScorer:
    s = default_registry().builder("topology-affinity-scorer", "t")(
        "topology-affinity-scorer", params, "plugins[0].parameters", PluginHandle())
    assert isinstance(s, TopologyAffinityScorer)
    s.bind(PluginHandle({p.name: p for p in (*plugins, s)}))
    return s


def state(peer: Endpoint | None = PEER) -> CycleState:
    st = CycleState()
    if peer is not None:
        st[DECODE_ENDPOINT_KEY] = peer
    return st


def test_llmd_tiers_with_a_declared_extractor() -> None:
    s = scorer(None, TopologyExtractor())
    assert list(s.score(state(), REQ, CANDIDATES)) == [1.0, 0.2, 0.05, 0.02, 0.0, 0.0]
    assert list(s.score(state(None), REQ, CANDIDATES)) == [0.0] * 6  # no decode pick


def test_named_producer() -> None:
    x = TopologyExtractor("topo", hostname_label="my/host")
    s = scorer({"topologyProducerName": "topo"}, x)
    peer = Endpoint(name="p", address="10.0.1.1", port=8000, labels={"my/host": "a"})
    same = Endpoint(name="q", address="10.0.1.2", port=8000, labels={"my/host": "a"})
    other = Endpoint(name="r", address="10.0.1.3", port=8000, labels={"my/host": "b"})
    assert list(s.score(state(peer), REQ, [same, other])) == [1.0, 0.0]
    # a named extractor that does not exist: every candidate scores 0 (a warning)
    missing = scorer({"topologyProducerName": "nope"})
    assert list(missing.score(state(), REQ, CANDIDATES)) == [0.0] * 6


def test_label_levels_without_an_extractor_or_when_configured() -> None:
    ours = scorer(None)  # no extractor declared: this project's label levels
    assert ours.extractor is None
    first, _ = ours.score(state(), REQ, CANDIDATES[:2])
    assert first > 0
    levels = scorer({"levels": [HOST]}, TopologyExtractor())  # explicit levels win
    assert levels.extractor is None
    assert list(levels.score(state(), REQ, CANDIDATES[:2])) == [1.0, 0.0]


def test_producer_name_and_levels_do_not_mix() -> None:
    with pytest.raises(ConfigError, match="cannot be combined"):
        default_registry().builder("topology-affinity-scorer", "t")(
            "s", {"topologyProducerName": "t", "levels": [HOST]}, "p", PluginHandle())


def test_pd_topology_config_scores_llmd_tiers() -> None:
    built = load_and_build(str(FIXTURES / "deploy/config/pd-topology-epp-config.yaml"),
                           strict=True)
    s = built.plugins["topology-affinity-scorer"]
    assert isinstance(s, TopologyAffinityScorer)
    assert s.extractor is built.plugins["topology-extractor"]
