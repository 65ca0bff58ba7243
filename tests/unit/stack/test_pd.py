"""epp.stack.pd: the Grove-labelled layout the demo, the P/D tests and the benchmark use,
read back by the EPP's endpoints-file parser, the topology scorer and the simulator."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from epp.discovery.static import read_endpoints_file
from epp.scheduling.plugins.topology import DEFAULT_LEVELS, TopologyAffinityScorer, shared_level
from epp.sim.topology import PeerTopology, distance
from epp.stack.pd import PairStats, grove_layout


def test_layout_labels_nodes_and_ports(tmp_path: Path) -> None:
    lay = grove_layout(sim_args={"decode": ("--x",)},
                       pod_args=lambda role, rack, i: ["--y"] if i == 1 else [])
    assert len(lay.pods) == 8 and len({p.port for p in lay.pods}) == 8
    assert Counter((p.rack, p.role) for p in lay.pods) == {
        ("rack-1", "prefill"): 2, ("rack-1", "decode"): 2,
        ("rack-2", "prefill"): 2, ("rack-2", "decode"): 2}
    d = lay.by_role("decode")[1]
    assert d.sim_args == ("--x", "--y") and d.labels["llm-d.ai/role"] == "decode"
    assert d.labels["grove.io/podclique"] == "llm-0-decode"
    assert d.labels["grove.io/podgang"] == "llm-0"
    assert d.labels["grove.io/podcliqueset-replica-index"] == "0"
    f = tmp_path / "e.yaml"
    lay.write(f)
    eps = {e.key: e for e in read_endpoints_file(f)}
    assert set(eps) == {p.key for p in lay.pods}
    e = eps[d.key]
    assert e.node_name == d.node and e.node_labels["topology.kubernetes.io/rack"] == "rack-1"
    # The EPP's pairing levels: same PodGang (one PodCliqueSet replica, one rack) within a
    # rack, same block across racks.
    levels = TopologyAffinityScorer("t", DEFAULT_LEVELS).levels
    same = eps[lay.by_role("prefill")[0].key]
    other = eps[lay.by_role("prefill")[-1].key]
    assert shared_level(e, same, levels) == 1 and shared_level(e, other, levels) == 4
    # The simulator's distances from the same file.
    peers = PeerTopology(f)
    assert distance(peers.lookup(d.key), peers.lookup(same.key)) == "rack"
    assert distance(peers.lookup(d.key), peers.lookup(other.key)) == "block"
    lay.write(f, include=lambda p: p.role == "decode")
    assert {x.key for x in read_endpoints_file(f)} == {p.key for p in lay.by_role("decode")}


def test_aggregated_layout_has_no_role_label() -> None:
    lay = grove_layout(prefill_per_rack=0, decode_per_rack=0, both_per_rack=3)
    assert len(lay.pods) == 6 and all("llm-d.ai/role" not in p.labels for p in lay.pods)


def test_pair_stats() -> None:
    a = PairStats(10, 1, 1, Counter({"rack": 6, "node": 1, "block": 3}), Counter({"x": 10}))
    assert a.same_rack == 7 and a.same_rack_share == 0.7
    b = a.minus(PairStats(4, 0, 0, Counter({"rack": 4}), Counter({"x": 4})))
    assert b.remote_prefills == 6 and b.by_distance == {"rack": 2, "node": 1, "block": 3}
    assert math.isnan(PairStats().same_rack_share)


def test_benchmark_configs_build() -> None:
    from bench.pd import AGGREGATED_CONFIG, active_config, aware_config, blind_config
    from epp.config.loader import build, parse_config

    blind = build(parse_config(blind_config(), "blind.yaml"))
    prefill = blind.scheduler.profiles["prefill"]
    assert [s.type_name for s, _ in prefill.scorers] == ["queue-scorer",
                                                         "kv-cache-utilization-scorer"]
    active = build(parse_config(active_config(), "active.yaml"))
    scorers = {s.type_name: w for s, w in active.scheduler.profiles["prefill"].scorers}
    assert scorers["active-request-scorer"] == 2 and scorers["topology-affinity-scorer"] == 3
    aware = build(parse_config(aware_config(), "aware.yaml"))
    scorers = {s.type_name: w for s, w in aware.scheduler.profiles["prefill"].scorers}
    assert "active-request-scorer" not in scorers and scorers["topology-affinity-scorer"] == 3
    agg = build(parse_config(AGGREGATED_CONFIG, "agg.yaml"))
    assert {s.type_name: w for s, w in agg.scheduler.profiles["default"].scorers} == {
        "queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3}
