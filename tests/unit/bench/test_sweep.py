"""``epp bench --sweep``: the shape family (epp.bench.shapes) and the report math
(epp.bench.sweep), without starting anything."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import shlex
from pathlib import Path
from typing import Any

import pytest

from epp.bench import shapes as sh
from epp.bench import sweep as sw
from epp.bench.quality import BASE_SIM_ARGS, sim_config
from epp.bench.traces import TraceRequest
from epp.cli import build_parser

BASE_ARGS = shlex.split(BASE_SIM_ARGS)


# ----------------------------------------------------------------- the family


def test_draw_shape_is_deterministic_per_seed() -> None:
    assert sh.draw_shape(7) == sh.draw_shape(7)
    assert sh.draw_shape(7, smoke=True) == sh.draw_shape(7, smoke=True)
    assert len({dataclasses.astuple(sh.draw_shape(s))[3:] for s in range(40)}) == 40
    assert sh.sweep_shapes(5, 3, held_out=True) == sh.sweep_shapes(5, 3, held_out=True)


def test_draws_cover_the_family_ranges() -> None:
    drawn = [sh.draw_shape(s, max_pods=16) for s in range(400)]
    for s in drawn:
        assert sh.POD_RANGE[0] <= s.pods <= sh.POD_RANGE[1]
        assert len(s.pod_cost) == s.pods and set(s.pod_cost) <= set(sh.POD_COST_CHOICES)
        assert sh.GROUP_RANGE[0] <= s.groups <= sh.GROUP_RANGE[1]
        assert sh.PREFIX_RANGE[0] <= s.prefix_tokens <= sh.PREFIX_RANGE[1]
        assert sh.QUESTION_RANGE[0] <= s.question_tokens <= sh.QUESTION_RANGE[1]
        assert s.max_tokens in sh.MAX_TOKENS_CHOICES
        assert s.arrival in sh.ARRIVALS and sh.BURST_RANGE[0] <= s.burst <= sh.BURST_RANGE[1]
        assert s.chat_share == 0 or 0.2 <= s.chat_share <= 1.0
        assert sh.TURN_RANGE[0] <= s.turns <= sh.TURN_RANGE[1]
        assert sh.THINK_RANGE[0] <= s.think_s <= sh.THINK_RANGE[1]
        assert sh.CACHE_RATIO_RANGE[0] <= s.cache_ratio <= sh.CACHE_RATIO_RANGE[1]
        assert sh.LOAD_RANGE[0] <= s.load <= sh.LOAD_RANGE[1]
    # ... and reach both ends of each.
    pods = {s.pods for s in drawn}
    assert {2, 16} <= pods
    assert min(s.groups for s in drawn) == 1 and max(s.groups for s in drawn) >= 50
    assert min(s.prefix_tokens for s in drawn) < 300 and max(s.prefix_tokens for s in drawn) > 3000
    assert min(s.cache_ratio for s in drawn) < 0.3 and max(s.cache_ratio for s in drawn) > 3.5
    assert min(s.load for s in drawn) < 0.35 and max(s.load for s in drawn) > 0.85
    assert {s.arrival for s in drawn} == set(sh.ARRIVALS)
    assert any(s.chat_share == 0 for s in drawn) and any(s.chat_share > 0.8 for s in drawn)
    hetero = [s for s in drawn if len(set(s.pod_cost)) > 1]
    assert 0.25 < len(hetero) / len(drawn) < 0.55
    assert all(len(set(s.pod_cost)) > 1 or set(s.pod_cost) == {1.0} for s in drawn)
    assert {s.group_skew for s in drawn} == set(sh.SKEW_CHOICES)


def test_max_pods_bounds_the_draw_and_is_checked() -> None:
    assert max(sh.draw_shape(s, max_pods=4).pods for s in range(100)) == 4
    assert max(sh.draw_shape(s).pods for s in range(200)) == sh.DEFAULT_MAX_PODS
    assert max(sh.draw_shape(s, smoke=True).pods for s in range(100)) <= 3
    with pytest.raises(ValueError, match="max pods"):
        sh.draw_shape(1, max_pods=17)


def test_held_out_seeds_are_disjoint_from_every_training_seed() -> None:
    top = min(sh.HELD_OUT_SEEDS) // sh.MAX_SWEEP
    allowed = set()
    for seed in (0, 1, 2, top - 1):
        allowed |= set(sh.training_seeds(sh.MAX_SWEEP, seed))
    assert not allowed & set(sh.HELD_OUT_SEEDS)
    assert max(sh.training_seeds(sh.MAX_SWEEP, top - 1)) < min(sh.HELD_OUT_SEEDS)
    for bad in (top, top + 5):
        with pytest.raises(ValueError, match="held-out"):
            sh.training_seeds(1, bad)
    with pytest.raises(ValueError, match="--sweep"):
        sh.training_seeds(sh.MAX_SWEEP + 1, 1)
    # Different seeds draw different shapes; a sweep's shapes are the pinned one, then
    # its training draws, then the held-out set.
    shapes = sh.sweep_shapes(4, 1, held_out=True)
    assert shapes[0] == sh.pinned_shape()
    assert [s.held_out for s in shapes] == [False] * 4 + [True] * len(sh.HELD_OUT_SEEDS)
    assert [s.seed for s in shapes[4:]] == list(sh.HELD_OUT_SEEDS)
    assert len({s.name for s in shapes}) == len(shapes)
    assert sh.sweep_shapes(0, 1, held_out=True) == shapes[4:]
    assert not set(sh.training_seeds(3, 1)) & {s.seed for s in shapes[4:]}
    # --shape-seeds: exactly those training shapes (no pinned one), the same draws a
    # --sweep reaching them makes; held-out seeds and their neighbourhood are refused
    picked = sh.sweep_shapes(0, 1, held_out=False, shape_seeds=(102, 101))
    assert picked == [shapes[3], shapes[2]]
    assert sh.sweep_shapes(9, 1, held_out=True, shape_seeds=(101,)) == [shapes[2], *shapes[4:]]
    for bad in (-1, top * sh.MAX_SWEEP, min(sh.HELD_OUT_SEEDS)):
        with pytest.raises(ValueError, match="--shape-seeds"):
            sh.sweep_shapes(0, 1, held_out=False, shape_seeds=(bad,))


def test_pinned_shape_is_the_issues_capacity_bound_shared_prefix() -> None:
    p = sh.pinned_shape()
    assert p.name == sh.PINNED_NAME and p.arrival == "random" and p.chat_share == 0
    assert p.cache_ratio < 1 and 0.4 <= p.load <= 0.7 and p.groups > 2 * p.pods
    assert set(p.pod_cost) == {1.0}


# ----------------------------------------------------------------- traces and plans


def _shape(**kw: Any) -> sh.Shape:
    base = sh.Shape("t", 5, False, 3, (1.0, 1.0, 1.0), 4, 64, 8, 4, 0.0, "random", 4, 0.0, 3,
                    0.2, 1.0, 0.5)
    return dataclasses.replace(base, **kw)


def test_trace_is_deterministic_sorted_and_turns_follow_their_conversation() -> None:
    s = _shape(chat_share=0.5)
    t1 = sh.make_shape_trace(s, 20.0, 5.0)
    assert t1 == sh.make_shape_trace(s, 20.0, 5.0)
    assert [r.index for r in t1] == list(range(len(t1)))
    assert all(a.at <= b.at for a, b in itertools.pairwise(t1))
    assert {r.kind for r in t1} == {"single", "chat"}
    assert all(r.at < 5.0 for r in t1)
    for r in t1:
        if r.after is not None:
            prev = t1[r.after]
            assert prev.index < r.index and prev.key == r.key and prev.kind == "chat"
            assert r.messages[:len(prev.messages)] == prev.messages
    # Roughly the asked rate (Poisson).
    assert 50 < len(t1) < 150


def test_bursty_arrivals_group_requests_back_to_back() -> None:
    t = sh.make_shape_trace(_shape(arrival="bursty", burst=5, groups=20), 20.0, 10.0)
    same_as_next = sum(1 for a, b in itertools.pairwise(t) if a.key == b.key)
    assert same_as_next / len(t) > 0.5
    rand = sh.make_shape_trace(_shape(groups=20), 20.0, 10.0)
    assert sum(1 for a, b in itertools.pairwise(rand) if a.key == b.key) / len(rand) < 0.2


def test_working_set_counts_blocks_shared_by_two_requests() -> None:
    def req(i: int, text: str) -> TraceRequest:
        return TraceRequest(i, 0.0, ({"role": "user", "content": text},), 4, "single", str(i))

    a = " ".join(f"w{i}" for i in range(32))  # two blocks of 16
    b = " ".join(f"x{i}" for i in range(48))  # three
    trace = [req(0, a + " q1"), req(1, a + " q2"), req(2, b), req(3, a)]
    assert sh.working_set_blocks(trace, 16) == 2
    assert sh.working_set_blocks(trace[2:3], 16) == 0
    assert sh.max_request_blocks(trace, 16) == math.ceil((48 + 4) / 16)


def test_plan_realises_load_pool_and_per_pod_costs() -> None:
    base = sw.base_costs(BASE_ARGS)
    s = _shape(pod_cost=(1.0, 2.0, 0.5), cache_ratio=0.5, load=0.6, groups=6, prefix_tokens=200)
    p = sh.plan(s, base, duration_s=4.0, min_rate=10.0, max_rate=15.0, base_args=BASE_ARGS)
    assert p.trace and 10.0 <= p.rate <= 15.0
    assert p.load == pytest.approx(0.6, rel=0.3)
    assert p.num_gpu_blocks >= sh.max_request_blocks(p.trace, 16) + 2
    assert p.common_args[:len(BASE_ARGS)] == BASE_ARGS
    assert p.common_args[-4:-2] == ["--num-gpu-blocks", str(p.num_gpu_blocks)]
    assert len(p.pod_args) == 3 and p.pod_args[0] == []
    cfgs = [sim_config([*p.common_args, *a]) for a in p.pod_args]
    assert cfgs[1].prefill_ms_per_token == pytest.approx(2 * cfgs[0].prefill_ms_per_token)
    assert cfgs[2].decode_base_ms == pytest.approx(0.5 * cfgs[0].decode_base_ms)
    assert all(c.time_scale == pytest.approx(p.time_scale, rel=1e-5) for c in cfgs)
    # Capacity is the per-pod sum: the slow pod adds half, the fast one twice a base pod.
    one = sh.pool_capacity(p.trace, base, (1.0,), p.time_scale, p.num_gpu_blocks)
    assert p.capacity_rps == pytest.approx(sh.pool_capacity(
        p.trace, base, (1.0, 2.0, 0.5), p.time_scale, p.num_gpu_blocks))
    assert one * 3 < p.capacity_rps < one * 4
    # A fast pool is slowed down (time scale > 1) rather than offered more than max_rate.
    fast = sh.plan(_shape(load=0.9, prefix_tokens=64), base, duration_s=2.0, min_rate=5.0,
                   max_rate=8.0, base_args=BASE_ARGS)
    assert fast.rate == 8.0 and fast.time_scale > 1


# ----------------------------------------------------------------- report math


def _m(hit: float, p50: float, p90: float, tput: float = 10.0, ok: int = 50,
       errors: int = 0, shares: tuple[float, ...] = (0.5, 0.5)) -> dict[str, Any]:
    return {"hit_rate": hit, "ttft_p50_ms": p50, "ttft_p90_ms": p90, "throughput_rps": tput,
            "ok": ok, "errors": errors, "requests": ok + errors,
            "share": {f"pod{i}": v for i, v in enumerate(shares)}, "share_max": max(shares),
            "share_sorted": sorted(shares, reverse=True)}


def test_shape_check_applies_the_issue_targets() -> None:
    res = {"epp": _m(0.38, 20, 50), "round-robin": _m(0.10, 18, 60), "sglang": _m(0.40, 25, 45)}
    c = sw.shape_check(res, 0.40, "epp")
    assert c is not None
    assert c["hit_vs_ceiling"] == pytest.approx(0.95) and c["hit_ok"]
    assert c["best_other"] == "sglang" and c["ttft_p90_vs_best_other"] == pytest.approx(50 / 45)
    assert not c["ttft_ok"]
    assert c["ttft_p90_vs_rr"] == pytest.approx(50 / 60) and not c["worse_than_rr"]
    assert sw.shape_check(res, 0.40, "absent") is None
    # Just over 10 % worse than round robin on TTFT p90, or on throughput.
    def worse(x: dict[str, Any]) -> bool:
        c = sw.shape_check({"x": x, "round-robin": _m(0.1, 1, 60)}, 0.3, "x")
        assert c is not None
        return bool(c["worse_than_rr"])

    assert worse(_m(0.3, 1, 66.1))
    assert not worse(_m(0.3, 1, 66))
    assert worse(_m(0.3, 1, 50, tput=8.9))
    # Round robin is not compared with itself; a zero ceiling means nothing to win.
    rr = sw.shape_check(res, 0.0, "round-robin")
    assert rr is not None and not rr["worse_than_rr"] and rr["hit_ok"]
    assert math.isnan(rr["ttft_p90_vs_rr"])
    # A router that answered nothing fails everything.
    dead = sw.shape_check({"x": _m(0.0, math.nan, math.nan, ok=0),
                           "round-robin": _m(0.1, 1, 60)}, 0.3, "x")
    assert dead is not None and not dead["hit_ok"] and not dead["ttft_ok"]
    assert dead["worse_than_rr"]


def test_check_summary_counts_shapes_and_decides_the_targets() -> None:
    def c(hit: bool, ttft: bool, vs_rr: float) -> dict[str, Any]:
        return {"hit_ok": hit, "ttft_ok": ttft, "worse_than_rr": vs_rr > 1.1,
                "ttft_p90_vs_rr": vs_rr, "throughput_vs_rr": 1.0}

    per = {f"s{i}": c(True, True, 0.9) for i in range(9)} | {"s9": c(True, False, 1.05)}
    s = sw.check_summary(per)
    assert (s["shapes"], s["hit_ok"], s["ttft_ok"], s["both_ok"]) == (10, 10, 9, 9)
    assert s["share_both_ok"] == 0.9 and s["target_shapes_met"] and s["target_rr_met"]
    assert s["worst_ttft_p90_vs_rr_shape"] == "s9"
    per["s8"] = c(False, True, 1.2)
    s = sw.check_summary(per)
    assert not s["target_shapes_met"] and not s["target_rr_met"]
    assert s["worse_than_rr"] == ["s8"] and s["worst_ttft_p90_vs_rr"] == 1.2
    empty = sw.check_summary({})
    assert not empty["target_shapes_met"] and not empty["target_rr_met"]


def _entry(name: str, held_out: bool, results: dict[str, dict[str, Any]], bound: float,
           pods: int = 2) -> dict[str, Any]:
    s = dataclasses.replace(_shape(), name=name, held_out=held_out, pods=pods,
                            pod_cost=(1.0,) * pods)
    plan = {"requests": 40, "duration_s": 4.0, "rate": 10.0, "offered_rps": 10.0,
            "capacity_rps": 20.0, "load": 0.5, "time_scale": 1.0, "num_gpu_blocks": 50,
            "working_set_blocks": 100, "cache_ratio": 1.0}
    ceiling = {k: {"policy": k, "hit_rate": v, "share": []} for k, v in (
        ("static-affinity", bound), ("greedy-prefix", bound), ("round-robin", 0.1),
        ("no-eviction", 0.9), ("bound", bound))}
    return {"set": sw.HELD_OUT if held_out else sw.TRAINING,
            "shape": dataclasses.asdict(s), "description": s.describe(), "plan": plan,
            "ceiling": ceiling, "results": results,
            "checks": {r: sw.shape_check(results, bound, r) for r in results}}


def _report() -> dict[str, Any]:
    entries = [
        _entry("a", False, {"epp": _m(0.4, 10, 20, shares=(0.7, 0.3)),
                            "round-robin": _m(0.1, 12, 40)}, 0.4),
        _entry("b", False, {"epp": _m(0.2, 30, 60), "round-robin": _m(0.1, 10, 30)}, 0.5),
        _entry("h", True, {"epp": _m(0.5, 10, 20), "round-robin": _m(0.2, 10, 25)}, 0.5),
    ]
    agg, checks = sw.evaluate(entries, ["epp", "round-robin"])
    return {"command": "epp bench --sweep 2 --seed 1 --held-out", "routers": ["epp", "round-robin"],
            "shapes": entries, "aggregate": agg, "checks": checks, "skipped": {}}


def test_aggregate_takes_medians_of_per_shape_ratios() -> None:
    rep = _report()
    train = rep["aggregate"][sw.TRAINING]["epp"]
    assert train["shapes"] == 2
    assert train["hit_vs_ceiling"] == pytest.approx((1.0 + 0.4) / 2)
    assert train["ttft_p90_vs_best"] == pytest.approx((1.0 + 2.0) / 2)
    assert train["ttft_p50_vs_best"] == pytest.approx((1.0 + 3.0) / 2)
    assert train["throughput_vs_offered"] == pytest.approx(1.0)
    assert train["busiest_vs_even"] == pytest.approx((1.4 + 1.0) / 2)
    held = rep["checks"][sw.HELD_OUT]["epp"]
    assert held["shapes"] == 1 and held["both_ok"] == 1 and held["target_shapes_met"]
    tr = rep["checks"][sw.TRAINING]["epp"]
    assert tr["both_ok"] == 1 and not tr["target_shapes_met"]
    assert tr["worse_than_rr"] == ["b"] and not tr["target_rr_met"]


def test_table_and_plot(tmp_path: Path) -> None:
    rep = _report()
    text = sw.table(rep)
    for needle in ("[training] a:", "[held-out] h:", "aggregate [training]",
                   "aggregate [held-out]", "target [held-out] [epp] hit >= 95% of ceiling",
                   "-> met", "-> NOT met", "worse on b", "70/30"):
        assert needle in text, needle
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is optional")
    sw.plot(rep, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 1000


# ----------------------------------------------------------------- command line


def _args(*argv: str) -> Any:
    return build_parser().parse_args(["bench", *argv])


@pytest.mark.parametrize(("argv", "msg"), [
    (("--sweep", "2", "--servers", "4"), "--servers does not apply"),
    (("--sweep", "2", "--rate", "5"), "--rate does not apply"),
    (("--sweep", "2", "--repeat", "2"), "--repeat does not apply"),
    (("--sweep", "2", "--workload", "overload"), "overload"),
    (("--sweep", "2", "--max-pods", "20"), "--max-pods"),
    (("--sweep", "2", "--seed", "9000"), "held-out"),
    (("--sweep", "2", "--routers", "epp,nginx"), "unknown router"),
    (("--sweep", "2", "--max-rate", "1", "--min-rate", "5"), "--max-rate"),
    (("--sweep", "2", "--shape-seeds", "189"), "--shape-seeds replaces --sweep"),
    (("--shape-seeds", "189,900001"), "not a training shape seed"),
])
def test_cli_rejects_what_a_sweep_cannot_do(argv: tuple[str, ...], msg: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert sw.main(_args(*argv)) == 2
    assert msg in capsys.readouterr().err


def test_shape_seeds_parse_as_a_comma_list() -> None:
    assert _args("--shape-seeds", "189, 352,388").shape_seeds == (189, 352, 388)
    assert _args().shape_seeds == ()
    with pytest.raises(SystemExit):
        _args("--shape-seeds", "189,x")


def test_default_routers_include_gies_default_config() -> None:
    text = sw.default_routers()
    assert text.split(",")[0] == "epp" and "round-robin" in text and "sglang" in text
    specs = sw.parse_routers(text, None)
    assert [s.label for s in specs] == ["epp", "epp:gie-default", "round-robin", "random",
                                        "sglang"]
    assert specs[1].config == str(sw.GIE_DEFAULT_CONFIG)
