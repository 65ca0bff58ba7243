"""`epp bench` building blocks: traces, the offline ceiling, statistics, report, routers."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestServer

from epp.bench import quality
from epp.bench.ceiling import POLICIES, ceiling, replay
from epp.bench.traces import (
    WORKLOADS,
    HotSpotSpec,
    MultiTurnSpec,
    SharedPrefixSpec,
    SimCosts,
    TraceRequest,
    WorkloadShape,
    answer_text,
    capacity,
    default_shape,
    make_trace,
)
from epp.sim.app import build_app
from epp.sim.config import SimConfig
from epp.stack.runner import Result, stream_chat

SMALL = default_shape(smoke=True)


# ----------------------------------------------------------------- traces


@pytest.mark.parametrize("workload", WORKLOADS)
def test_trace_is_deterministic_sorted_and_bounded(workload: str) -> None:
    a = make_trace(workload, 20.0, 5.0, seed=3, shape=SMALL)
    b = make_trace(workload, 20.0, 5.0, seed=3, shape=SMALL)
    assert a == b and a
    assert [r.index for r in a] == list(range(len(a)))
    assert all(0 <= r.at < 5.0 for r in a)
    assert [r.at for r in a] == sorted(r.at for r in a)
    for r in a:
        assert r.after is None or r.after < r.index
    assert make_trace(workload, 20.0, 5.0, seed=4, shape=SMALL) != a
    assert len(make_trace(workload, 20.0, 5.0, seed=3, shape=SMALL, max_requests=7)) == 7


def test_trace_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make_trace("nope", 1, 1)
    with pytest.raises(ValueError):
        make_trace("hot-spot", 0, 1)


def test_poisson_rate_is_close_to_the_requested_rate() -> None:
    tr = make_trace("hot-spot", 50.0, 40.0, shape=SMALL)
    assert abs(len(tr) / 40.0 - 50.0) < 5.0


def test_words_are_one_token_and_four_characters() -> None:
    tr = make_trace("hot-spot", 5.0, 2.0, shape=SMALL)
    user = tr[0].messages[1]["content"]
    assert len(user.split()) == SMALL.hot_spot.question_tokens
    assert len(user) + 1 == 4 * len(user.split())


def test_shared_prefix_groups_share_their_prefix() -> None:
    shape = WorkloadShape(shared_prefix=SharedPrefixSpec(groups=3, prefix_tokens=50,
                                                         question_tokens=5, max_tokens=2))
    tr = make_trace("shared-prefix", 30.0, 3.0, shape=shape)
    by_key: dict[str, set[str]] = {}
    for r in tr:
        assert r.kind == "shared-prefix" and r.after is None
        by_key.setdefault(r.key, set()).add(r.messages[0]["content"])
        assert r.prompt_words == 55
    assert len(by_key) == 3 and all(len(v) == 1 for v in by_key.values())
    assert len({next(iter(v)) for v in by_key.values()}) == 3


def test_zipf_popularity_is_skewed() -> None:
    shape = WorkloadShape(shared_prefix=SharedPrefixSpec(groups=10, prefix_tokens=20,
                                                         question_tokens=2, zipf=1.2))
    tr = make_trace("shared-prefix", 200.0, 5.0, shape=shape)
    counts = sorted((sum(1 for r in tr if r.key == k) for k in {r.key for r in tr}),
                    reverse=True)
    assert counts[0] > 3 * counts[-1]


def test_multi_turn_resends_history_with_the_simulators_answers() -> None:
    shape = WorkloadShape(multi_turn=MultiTurnSpec(system_prompts=1, system_tokens=10,
                                                   turns=3, question_tokens=4, max_tokens=3,
                                                   think_s=0.01))
    tr = make_trace("multi-turn", 30.0, 5.0, shape=shape)
    by_index = {r.index: r for r in tr}
    follow = [r for r in tr if r.after is not None]
    assert follow
    for r in follow:
        prev = by_index[r.after]  # type: ignore[index]
        assert r.key == prev.key
        n = len(prev.messages)
        assert r.messages[:n] == prev.messages
        assert r.messages[n] == {"role": "assistant", "content": answer_text(3)}
        assert r.messages[n + 1]["role"] == "user"
    assert answer_text(3) == " tok0 tok1 tok2"


def test_hot_spot_shares_one_system_prompt() -> None:
    tr = make_trace("hot-spot", 20.0, 2.0, shape=SMALL)
    assert len({r.messages[0]["content"] for r in tr}) == 1
    assert len({r.key for r in tr}) == len(tr)


def test_mix_has_every_kind_and_consistent_turn_links() -> None:
    tr = make_trace("mix", 40.0, 5.0, shape=SMALL)
    assert {r.kind for r in tr} == {"shared-prefix", "multi-turn", "hot-spot"}
    for r in tr:
        if r.after is not None:
            assert tr[r.after].key == r.key and r.kind == "multi-turn"


def test_capacity_follows_the_latency_model() -> None:
    tr = [TraceRequest(0, 0.0, ({"role": "user", "content": " ".join(["w"] * 1000)},), 10,
                       "hot-spot", "k")]
    costs = SimCosts(prefill_ms_per_token=0.1, decode_base_ms=10, decode_per_seq_ms=1,
                     max_num_seqs=1000, num_gpu_blocks=1000 * 70, block_size=16)
    # 1000 tokens × 0.1 ms + 10 tokens × (1 + 10 / batch); batch = 70000 // 63 > 1000
    ms = 100 + 10 * (1 + 10 / 1000)
    assert capacity(tr, costs, 2) == pytest.approx(2 * 1000 / ms)
    # A small pool bounds the batch: 2 requests of 63 blocks fit.
    small = SimCosts(0.1, 10, 1, 1000, 130, 16)
    assert capacity(tr, small, 1) == pytest.approx(1000 / (100 + 10 * (1 + 10 / 2)))
    assert capacity([], costs, 2) == 0.0


# ----------------------------------------------------------------- ceiling


def _req(i: int, text: str, key: str) -> TraceRequest:
    return TraceRequest(i, float(i), ({"role": "user", "content": text},), 1, "x", key)


def test_ceiling_policies_on_a_hand_made_trace() -> None:
    a = " ".join(f"a{i}" for i in range(64))  # 4 blocks of 16
    b = " ".join(f"b{i}" for i in range(64))
    tr = [_req(0, a + " q0", "A"), _req(1, b + " q1", "B"), _req(2, a + " q2", "A"),
          _req(3, b + " q3", "B")]
    total = 4 * 65
    # Static affinity: A -> pod 0, B -> pod 1; the second of each hits 4 blocks.
    r = replay(tr, "static-affinity", servers=2, num_gpu_blocks=100)
    assert r.cached_tokens == 2 * 64 and r.prompt_tokens == total and r.share == (2, 2)
    # Round robin: A lands on pods 0, 0 (i = 0, 2) too — same here.
    assert replay(tr, "round-robin", servers=2, num_gpu_blocks=100).cached_tokens == 128
    # One pod of 5 blocks holds one prefix (4 blocks + the partial block): A, B, A, B
    # evict each other under LRU; without eviction both hit.
    assert replay(tr, "round-robin", servers=1, num_gpu_blocks=5).cached_tokens == 0
    assert replay(tr, "no-eviction", servers=1, num_gpu_blocks=5).cached_tokens == 128
    c = ceiling(tr, servers=2, num_gpu_blocks=100)
    assert set(c) == set(POLICIES) | {"bound"}
    assert c["bound"].hit_rate == pytest.approx(128 / total)


def test_the_last_token_is_always_recomputed() -> None:
    text = " ".join(f"w{i}" for i in range(32))  # exactly 2 blocks
    tr = [_req(0, text, "k"), _req(1, text, "k")]
    assert replay(tr, "round-robin", servers=1, num_gpu_blocks=10).cached_tokens == 16


def test_greedy_prefix_beats_round_robin_when_affinity_matters() -> None:
    shape = WorkloadShape(shared_prefix=SharedPrefixSpec(groups=6, prefix_tokens=64,
                                                         question_tokens=4, max_tokens=1))
    tr = make_trace("shared-prefix", 50.0, 4.0, shape=shape)
    c = ceiling(tr, servers=3, num_gpu_blocks=12)  # each pod holds ~2 prefixes
    assert c["greedy-prefix"].hit_rate > c["round-robin"].hit_rate
    assert c["static-affinity"].hit_rate > c["round-robin"].hit_rate
    assert c["no-eviction"].hit_rate >= c["bound"].hit_rate


async def test_replay_matches_the_simulator_exactly() -> None:
    """Requests sent one at a time to real simulator pods, round robin, get exactly the
    cached tokens the offline replay predicts (same hashes, same LRU)."""
    shape = WorkloadShape(shared_prefix=SharedPrefixSpec(groups=5, prefix_tokens=48,
                                                         question_tokens=5, max_tokens=2))
    tr = make_trace("shared-prefix", 20.0, 3.0, shape=shape)
    cfg = SimConfig(time_scale=0.0, num_gpu_blocks=12)
    servers = [TestServer(build_app(f"sim-{i}", "m", config=cfg)) for i in range(2)]
    for s in servers:
        await s.start_server()
    try:
        cached = prompt = 0
        async with aiohttp.ClientSession() as session:
            for i, r in enumerate(tr):
                res, _ = await stream_chat(session, str(servers[i % 2].make_url(
                    "/v1/chat/completions")), r.body("m"))
                assert res.status == 200
                cached += res.cached_tokens
                prompt += res.prompt_tokens
    finally:
        for s in servers:
            await s.close()
    rr = replay(tr, "round-robin", servers=2, num_gpu_blocks=12)
    assert (cached, prompt) == (rr.cached_tokens, rr.prompt_tokens)
    assert cached > 0


# ----------------------------------------------------------------- statistics and report


def _sample(i: int, ttft: float, server: str = "sim-1", status: int = 200, prompt: int = 100,
            cached: int = 50, kind: str = "hot-spot") -> quality.Sample:
    return quality.Sample(i, kind, float(i), Result(status, server, ttft, ttft * 2, prompt,
                                                    cached, ""))


def test_quantile_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert quality.quantile(xs, 0.5) == 50.0
    assert quality.quantile(xs, 0.9) == 90.0
    assert quality.quantile(xs, 0.99) == 99.0
    assert math.isnan(quality.quantile([], 0.5))


def test_summarize_and_median_of() -> None:
    samples = [_sample(i, 0.01 * (i + 1), "sim-1" if i % 4 else "sim-2") for i in range(20)]
    samples.append(_sample(99, 0.0, status=503))
    m = quality.summarize(samples, 10.0, 2, ["sim-1", "sim-2"])
    assert m["requests"] == 21 and m["ok"] == 20 and m["errors"] == 1
    assert m["error_kinds"] == {"HTTP 503": 1} and m["not_sent_or_cut"] == 2
    assert m["hit_rate"] == 0.5 and m["throughput_rps"] == 2.0
    assert m["share"] == {"pod0": 0.75, "pod1": 0.25} and m["share_max"] == 0.75
    assert m["share_sorted"] == [0.75, 0.25]
    assert m["ttft_p50_ms"] == pytest.approx(100) and m["ttft_p90_ms"] == pytest.approx(180)
    med = quality.median_of([m, {**m, "ttft_p90_ms": 300.0}, {**m, "ttft_p90_ms": 100.0}])
    assert med["ttft_p90_ms"] == pytest.approx(180) and med["requests"] == 63
    assert med["rounds"] == 3 and med["error_kinds"] == {"HTTP 503": 3}
    flipped = {**m, "share": {"pod0": 0.25, "pod1": 0.75}}
    assert quality.median_of([m, flipped, m])["share_sorted"] == [0.75, 0.25]
    # CPU seconds by role: medians over rounds of the roles every round has
    cpu = [{**m, "cpu_s": {"epp": e, "envoy": 1.0, "pods": 3.0}} for e in (2.0, 9.0, 4.0)]
    cpu[0]["cpu_s"]["tokenizer"] = 1.0
    assert quality.median_of(cpu)["cpu_s"] == {"envoy": 1.0, "epp": 4.0, "pods": 3.0}
    assert "cpu_s" not in quality.median_of([m, *cpu])


def test_summarize_by_kind_for_mixes() -> None:
    samples = [_sample(0, 0.1, kind="hot-spot"), _sample(1, 0.2, kind="multi-turn",
                                                         cached=0)]
    m = quality.summarize(samples, 1.0, 0, ["sim-1"])
    assert set(m["by_kind"]) == {"hot-spot", "multi-turn"}
    assert m["by_kind"]["multi-turn"]["hit_rate"] == 0.0
    assert quality.median_of([m])["by_kind"]["hot-spot"]["hit_rate"] == 0.5


def _metrics(p90: float, hit: float) -> dict[str, Any]:
    return {"ttft_p90_ms": p90, "hit_rate": hit}


def test_verdicts_name_each_target() -> None:
    res = {"epp": _metrics(70, 0.34), "round-robin": _metrics(100, 0.1)}
    v = quality.verdicts("shared-prefix", res, 0.35)
    assert [(x["target"].split()[0], x["met"]) for x in v] == [("hit", True), ("TTFT", True)]
    v = quality.verdicts("shared-prefix", {**res, "epp": _metrics(80, 0.3)}, 0.35)
    assert [x["met"] for x in v] == [False, False]
    v = quality.verdicts("multi-turn", {"epp": _metrics(90, 0.8), "sglang": _metrics(100, .8)},
                         0.8)
    assert v[1]["target"].startswith("TTFT p90 <= sglang") and v[1]["met"]
    v = quality.verdicts("hot-spot", {"epp": _metrics(101, 0.8), "round-robin":
                                      _metrics(100, 0.8)}, 0.8)
    assert not v[1]["met"]
    assert len(quality.verdicts("multi-turn", {"epp": _metrics(1, 1)}, 1.0)) == 1


def _report() -> dict[str, Any]:
    m = quality.summarize([_sample(i, 0.05) for i in range(10)], 5.0, 0, ["sim-1", "sim-2"])
    rr = quality.summarize([_sample(i, 0.08, cached=10) for i in range(10)], 5.0, 0,
                           ["sim-1", "sim-2"])
    return {"workload": "hot-spot", "offered_rps": 2.0, "load_vs_capacity": 0.65,
            "capacity_rps": 3.1, "duration_s": 5.0, "servers": 2, "rounds": 1,
            "ceiling": {"round-robin": {"hit_rate": 0.4}, "bound": {"hit_rate": 0.5}},
            "results": {"epp": m, "round-robin": rr}, "skipped": {"sglang": "not installed"},
            "verdicts": quality.verdicts("hot-spot", {"epp": m, "round-robin": rr}, 0.5)}


def test_table_and_text_chart() -> None:
    rep = _report()
    t = quality.table(rep)
    for needle in ("TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "e2e p50 ms", "hit rate",
                   "hit / ceiling", "throughput req/s", "errors", "pod shares %, busiest",
                   "skipped sglang: not installed", "target [epp]", "bound 50.0%"):
        assert needle in t, needle
    assert "1.00" in t  # epp's hit rate is the bound
    assert "router CPU s" in t
    assert quality._router_cpu({"cpu_s": {"epp": 2.25, "envoy": 1.0, "pods": 5.0}}) == "2.2"
    assert quality._router_cpu({"cpu_s": {"envoy": 1.0, "pods": 5.0}}) == "-"
    assert quality._router_cpu({}) == "-"
    txt = quality.text_chart(rep)
    assert "TTFT p90" in txt and "|" in txt


def test_png_chart(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    quality.chart(_report(), tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------- routers and CLI


def test_parse_routers(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    rs = quality.parse_routers(f"epp,round-robin,random,sglang,epp={cfg}", None)
    assert [r.label for r in rs] == ["epp", "round-robin", "random", "sglang", "epp:c"]
    assert rs[0].config is None and rs[-1].config == str(cfg.resolve())
    assert quality.parse_routers("epp", str(cfg))[0].config == str(cfg.resolve())
    # The plain EPP router runs behind the shipped (lean) gateway shape; the others are
    # there to compare shapes.
    shapes = quality.parse_routers(f"epp,epp-inline,epp-observer={cfg}", None)
    assert [(r.kind, r.label, r.response_path) for r in shapes] == [
        ("epp", "epp", "lean"), ("epp", "epp-inline", "inline"),
        ("epp", "epp-observer:c", "observer")]
    for bad in ("nginx", "round-robin=x.yaml", "epp,epp", ""):
        with pytest.raises(ValueError):
            quality.parse_routers(bad, None)


def test_envoy_random_config_uses_the_random_policy() -> None:
    doc = yaml.safe_load(quality.envoy_random_config(10001, 10002, ["127.0.0.1:10003",
                                                                    "127.0.0.1:10004"]))
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    names = [f["name"] for f in hcm["typed_config"]["http_filters"]]
    assert "envoy.filters.http.ext_proc" not in names
    pool = next(c for c in doc["static_resources"]["clusters"]
                if c["name"] == "original_destination_cluster")
    assert pool["lb_policy"] == "RANDOM" and "load_balancing_policy" not in pool
    assert len(pool["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2


def test_sglang_missing_without_install_is_a_clear_skip(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(quality.importlib.util, "find_spec", lambda name: None)
    why = quality.ensure_sglang(install=False)
    assert why is not None and "sglang-router" in why and "pip install" in why


def test_sglang_failed_install_is_a_clear_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quality.importlib.util, "find_spec", lambda name: None)

    class Done:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found"

    monkeypatch.setattr(quality.subprocess, "run", lambda *a, **k: Done())
    why = quality.ensure_sglang(install=True, log=lambda s: None)
    assert why is not None and "No matching distribution" in why


def test_effective_sim_args_and_sim_config() -> None:
    args = quality.effective_sim_args("shared-prefix", "--num-gpu-blocks 77 --max-num-seqs 9",
                                      smoke=False)
    cfg = quality.sim_config(args)
    assert cfg.num_gpu_blocks == 77 and cfg.max_num_seqs == 9
    assert cfg.prefill_ms_per_token == 0.05 and cfg.decode_base_ms == 10
    assert quality.sim_config(quality.effective_sim_args("hot-spot", "", smoke=True)
                              ).num_gpu_blocks == quality.SMOKE_NUM_GPU_BLOCKS


def test_cli_has_bench() -> None:
    from epp.cli import build_parser

    a = build_parser().parse_args(["bench", "--workload", "hot-spot", "--rate", "3",
                                   "--routers", "epp,random", "--smoke"])
    assert isinstance(a, argparse.Namespace)
    assert (a.workload, a.rate, a.routers, a.smoke) == ("hot-spot", 3.0, "epp,random", True)


def test_default_shape_sizes_match_the_docs() -> None:
    s = default_shape()
    # shared-prefix: the distinct prefixes exceed the 4 pods' combined cache 2-3 times.
    combined = 4 * quality.NUM_GPU_BLOCKS["shared-prefix"] * 16
    ratio = s.shared_prefix.groups * s.shared_prefix.prefix_tokens / combined
    assert 2.0 <= ratio <= 3.0
    assert isinstance(s.hot_spot, HotSpotSpec)
    json.dumps(quality._ceiling_json(ceiling(make_trace("hot-spot", 5, 1, shape=SMALL),
                                             servers=2, num_gpu_blocks=64)))
