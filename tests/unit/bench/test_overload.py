"""`epp bench --workload overload` building blocks: scenario and capacity, the trace,
the configs it writes, the open-loop player, the EPP metrics it reads, the report math."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import generate_latest

from epp import keys
from epp.bench import overload as ov
from epp.bench.traces import SimCosts
from epp.config.loader import load_and_build
from epp.discovery.objectives_file import parse_objectives_file
from epp.flowcontrol import FlowControlMetrics
from epp.stack.runner import Result

COSTS = SimCosts(prefill_ms_per_token=0.1, decode_base_ms=20.0, decode_per_seq_ms=0.2,
                 max_num_seqs=16, num_gpu_blocks=8192, block_size=16)


# ----------------------------------------------------------------- capacity and trace


def test_pod_ms_is_the_simulators_full_batch_cost() -> None:
    # 256 prompt tokens at 0.1 ms + 16 tokens × (0.2 + 20 / 16) ms.
    assert ov.pod_ms(256, 16, COSTS) == pytest.approx(25.6 + 16 * 1.45)
    # A KV pool that holds fewer sequences than max-num-seqs shrinks the batch.
    small = SimCosts(0.1, 20.0, 0.2, 16, 8 * 17, 16)  # 8 sequences of 17 blocks
    assert ov.pod_ms(256, 16, small) == pytest.approx(25.6 + 16 * (0.2 + 20 / 8))


def test_rates_offer_the_phase_loads_of_the_pools_capacity() -> None:
    sc = ov.scenarios(baseline_s=8, overload_s=10)
    pr = sc["priority"]
    rates = ov.rates(pr, COSTS, servers=2)
    assert list(rates) == ["baseline", "overload"]
    assert list(rates["baseline"]) == ["tenant-a"]

    def load(phase: str) -> float:
        return sum(rate * ov.pod_ms(pr.tenant(t).prompt_tokens, pr.tenant(t).max_tokens, COSTS)
                   for t, rate in rates[phase].items()) / (2 * 1000.0)

    assert load("baseline") == pytest.approx(0.5)
    assert load("overload") == pytest.approx(2.0)
    fair = ov.rates(sc["fair"], COSTS, servers=2)["overload"]
    assert fair["tenant-c"] == pytest.approx(fair["tenant-d"])
    a, b = pr.tenants
    assert a.priority > 0 > b.priority  # interactive high, batch sheddable
    assert a.prompt_tokens < b.prompt_tokens
    c, d = sc["fair"].tenants
    assert (c.priority, c.prompt_tokens, c.max_tokens) == (d.priority, d.prompt_tokens,
                                                           d.max_tokens)
    assert c.name != d.name


def test_scenarios_reject_bad_phases() -> None:
    with pytest.raises(ValueError, match="> 0 s"):
        ov.scenarios(baseline_s=0, overload_s=1)
    with pytest.raises(ValueError, match="baseline load"):
        ov.scenarios(baseline_s=1, overload_s=1, baseline_load=2.0, factor=2.0)


def test_trace_is_open_loop_poisson_deterministic_and_phased() -> None:
    sc = ov.scenarios(baseline_s=20, overload_s=30)["priority"]
    tr = ov.make_overload_trace(sc, COSTS, 2, seed=3)
    assert tr == ov.make_overload_trace(sc, COSTS, 2, seed=3)
    assert tr != ov.make_overload_trace(sc, COSTS, 2, seed=4)
    assert [r.index for r in tr] == list(range(len(tr)))
    assert [r.at for r in tr] == sorted(r.at for r in tr)
    assert all(0 <= r.at < 50 for r in tr)
    base = [r for r in tr if r.phase == "baseline"]
    over = [r for r in tr if r.phase == "overload"]
    assert all(r.at < 20 for r in base) and all(r.at >= 20 for r in over)
    assert {r.tenant for r in base} == {"tenant-a"}
    assert {r.tenant for r in over} == {"tenant-a", "tenant-b"}
    rates = ov.rates(sc, COSTS, 2)
    for phase, reqs, secs in (("baseline", base, 20), ("overload", over, 30)):
        for tenant, rate in rates[phase].items():
            n = sum(1 for r in reqs if r.tenant == tenant)
            expect = rate * secs
            assert abs(n - expect) < 4 * math.sqrt(expect), (phase, tenant, n, expect)
    for r in tr[:20]:
        t = sc.tenant(r.tenant)
        assert len(r.prompt.split()) == t.prompt_tokens and r.max_tokens == t.max_tokens
        body = r.body("m")
        assert body["stream"] is True and body["max_tokens"] == t.max_tokens
    # Every prompt is new: nothing is served from a prefix cache.
    assert len({r.prompt.split()[0:8].__repr__() for r in tr}) == len(tr)


def test_tenant_headers_are_gies() -> None:
    h = ov.TENANT_A.headers()
    assert h == {keys.HEADER_FAIRNESS_ID: "tenant-a", keys.HEADER_OBJECTIVE: "interactive"}
    assert keys.HEADER_FAIRNESS_ID == "x-gateway-inference-fairness-id"
    assert keys.HEADER_OBJECTIVE == "x-gateway-inference-objective"


# ----------------------------------------------------------------- configs


def test_objectives_file_gives_each_tenant_its_priority() -> None:
    sc = ov.scenarios(baseline_s=1, overload_s=1)
    tenants = [t for s in sc.values() for t in s.tenants]
    objectives, rewrites = parse_objectives_file(ov.objectives_yaml(tenants), "<bench>")
    assert not rewrites
    prio = {o.name: o.effective_priority for o in objectives}
    assert prio == {"interactive": 10, "batch": -1, "standard": 0}
    with pytest.raises(ValueError, match="two priorities"):
        ov.objectives_yaml([ov.TENANT_A, ov.Tenant("x", "interactive", 3, 1, 1)])


def test_router_configs_load_and_differ_only_in_flow_control(tmp_path: Path) -> None:
    limits = ov.queue_limits(COSTS, 2, ttl_s=5.0)
    assert (limits.sheddable_requests, limits.standard_requests) == (32, 64)
    fc_text = ov.router_config(COSTS, flow_control=True, limits=limits)
    legacy_text = ov.router_config(COSTS, flow_control=False, limits=limits)
    fc, legacy = yaml.safe_load(fc_text), yaml.safe_load(legacy_text)
    assert fc["featureGates"] == ["flowControl"] and "featureGates" not in legacy
    assert "flowControl" not in legacy
    for doc in (fc, legacy):
        assert doc["saturationDetector"] == {"pluginRef": "concurrency-detector"}
        det = next(p for p in doc["plugins"] if p["type"] == "concurrency-detector")
        assert det["parameters"] == {"maxConcurrency": COSTS.max_num_seqs}
    assert fc["schedulingProfiles"] == legacy["schedulingProfiles"]
    section = fc["flowControl"]
    assert section["defaultRequestTTL"] == "5000ms"
    bands = {b["priority"]: b for b in section["priorityBands"]}
    assert bands[-1]["maxRequests"] == 32 and bands[0]["maxRequests"] == 64
    assert "maxRequests" not in bands[10]
    # Both load with the EPP's own loader (the flow-control one under the feature gate).
    built_legacy = load_and_build(text=legacy_text)
    assert built_legacy.flow_control is None
    assert type(built_legacy.saturation_detector).__name__ == "ConcurrencyDetector"
    built_fc = load_and_build(text=fc_text)
    assert built_fc.flow_control is not None
    assert built_fc.flow_control.default_request_ttl == pytest.approx(5.0)
    assert set(built_fc.flow_control.priority_bands) == {10, 0, -1}


def test_parse_routers(tmp_path: Path) -> None:
    routers = ov.parse_routers(ov.DEFAULT_ROUTERS, tmp_path)
    assert [(r.kind, r.label, r.flow_control) for r in routers] == [
        ("epp", "epp-flow-control", True), ("epp", "epp-legacy", False),
        ("round-robin", "round-robin", False)]
    assert routers[0].config == str(tmp_path / "flow-control.yaml")
    assert routers[1].config == str(tmp_path / "legacy.yaml")
    mine = tmp_path / "mine.yaml"
    mine.write_text("featureGates: [flowControl]\n")
    (r,) = ov.parse_routers(f"epp={mine}")
    assert (r.label, r.flow_control, r.config) == ("epp:mine", True, str(mine))
    assert ov.parse_routers("random")[0].kind == "random"
    for bad, why in (("sglang", "unknown router"), ("epp", "unknown router"),
                     ("round-robin=x", "unknown router"), ("random,random", "twice"),
                     (",", "no router")):
        with pytest.raises(ValueError, match=why):
            ov.parse_routers(bad)


# ----------------------------------------------------------------- EPP metrics


def _metrics_text(observations: list[tuple[str, int, str, float]]) -> str:
    m = FlowControlMetrics(pool_name="pool")
    for fid, prio, outcome, secs in observations:
        m.request_queue_duration.labels(fid, str(prio), outcome, "pool", "sim-model",
                                        "sim-model").observe(secs)
    m.request_queue_duration.labels("tenant-a", "10", "Dispatched", "pool", "other",
                                    "other").observe(0.00002)
    return generate_latest(m.registry).decode()


def test_parse_flow_metrics_reads_gies_histogram() -> None:
    text = _metrics_text([("tenant-a", 10, "Dispatched", 0.00001),
                          ("tenant-a", 10, "Dispatched", 0.2),
                          ("tenant-b", -1, "Dispatched", 0.0004),
                          ("tenant-b", -1, "Dispatched", 3.0),
                          ("tenant-b", -1, "RejectedCapacity", 0.00001),
                          ("tenant-b", -1, "EvictedTTL", 5.0),
                          ("tenant-b", -1, "EvictedContextCancelled", 1.0)])
    m = ov.parse_flow_metrics(text)
    a = m["tenant-a"]["Dispatched"]
    assert a.count == 3 and a.waited == 1  # the label sets of both models are summed
    assert a.sum_s == pytest.approx(0.20003)
    b = ov.epp_counts(m, "tenant-b")
    assert (b["dispatched"], b["rejected"], b["evicted"], b["total"]) == (2, 1, 2, 5)
    assert b["queued"] == 3  # waited >= 1 ms: one dispatched, both evicted
    assert b["outcome:EvictedTTL"] == 1
    assert ov.epp_counts(m, "nobody")["total"] == 0
    assert ov.parse_flow_metrics("# nothing\n") == {}


def test_metrics_delta_subtracts_a_scrape() -> None:
    before = ov.parse_flow_metrics(_metrics_text([("tenant-a", 10, "Dispatched", 0.0)]))
    after = ov.parse_flow_metrics(_metrics_text([("tenant-a", 10, "Dispatched", 0.0),
                                                 ("tenant-a", 10, "Dispatched", 0.5),
                                                 ("tenant-b", -1, "EvictedTTL", 5.0)]))
    d = ov.metrics_delta(after, before)
    assert d["tenant-a"]["Dispatched"].count == 1 and d["tenant-a"]["Dispatched"].waited == 1
    assert d["tenant-b"]["EvictedTTL"].count == 1


# ----------------------------------------------------------------- report math


def _s(i: int, tenant: str, phase: str, status: int = 200, ttft: float = 0.01,
       error: str = "") -> ov.OverloadSample:
    return ov.OverloadSample(i, tenant, phase, 0.0, 0.0,
                             Result(status, "sim-1", ttft if status == 200 else 0.0,
                                    ttft * 2, error=error))


def _priority_samples(a_base: list[float], a_over: list[float],
                      b: list[int]) -> list[ov.OverloadSample]:
    out = [_s(i, "tenant-a", "baseline", ttft=t) for i, t in enumerate(a_base)]
    out += [_s(100 + i, "tenant-a", "overload", ttft=t) for i, t in enumerate(a_over)]
    out += [_s(200 + i, "tenant-b", "overload", status=st) for i, st in enumerate(b)]
    return out


def test_tenant_summary_counts_every_kind_of_answer() -> None:
    samples = [_s(0, "t", "p"), _s(1, "t", "p", 429), _s(2, "t", "p", 503),
               _s(3, "t", "p", 500), _s(4, "t", "p", 0, error="ClientOSError"),
               _s(5, "t", "p", 0, error=ov.CUT), _s(6, "t", "p", 200, error="payload")]
    s = ov.tenant_summary(samples)
    assert (s["sent"], s["ok"], s["rejected_429"], s["evicted_503"]) == (7, 1, 1, 1)
    assert (s["other_status"], s["lost"], s["cut"], s["broken_streams"]) == (2, 2, 1, 1)
    assert s["ttft_p50_ms"] == pytest.approx(10.0)
    acc = ov.accounting(samples, None, ["t"])
    assert acc["client"]["balanced"] is False and "epp" not in acc
    assert ov.accounting(samples[:3], None, ["t"])["client"]["balanced"] is True


def test_summarize_priority_ratio_and_b_counts() -> None:
    base = [0.010 * (i + 1) for i in range(10)]  # p50 50 ms, p90 90 ms
    over = [0.015 * (i + 1) for i in range(10)]  # p50 75 ms, p90 135 ms
    samples = _priority_samples(base, over, [200, 200, 429, 503, 429])
    sc = ov.scenarios(baseline_s=1, overload_s=1)["priority"]
    r = ov.summarize_priority(sc, samples, None, None)
    assert r["a"]["baseline"]["ttft_p90_ms"] == pytest.approx(90.0)
    assert r["a"]["overload"]["ttft_p90_ms"] == pytest.approx(135.0)
    assert r["a"]["ttft_p90_ratio"] == pytest.approx(1.5)
    assert r["a"]["ttft_p50_ratio"] == pytest.approx(1.5)
    assert r["a"]["overload_ok_fraction"] == 1.0
    b = r["b"]
    assert (b["sent"], b["dispatched"], b["rejected"], b["evicted"], b["queued"]) == (
        5, 2, 2, 1, None)
    assert r["accounting"]["client"] == {"sent": 25, "dispatched": 22, "rejected": 2,
                                         "evicted": 1, "other_status": 0, "lost": 0,
                                         "balanced": True}
    # With the EPP's counts: balanced only when they add up to what each tenant sent.
    epp = ov.parse_flow_metrics(_metrics_text(
        [("tenant-a", 10, "Dispatched", 0.0)] * 19
        + [("tenant-b", -1, "Dispatched", 0.2)] * 2 + [("tenant-b", -1, "RejectedCapacity", 0.0)] * 2
        + [("tenant-b", -1, "EvictedTTL", 5.0)]))  # _metrics_text adds one A dispatch
    base_epp = ov.parse_flow_metrics(_metrics_text([("tenant-a", 10, "Dispatched", 0.00001)]))
    r = ov.summarize_priority(sc, samples, epp, base_epp)
    assert r["accounting"]["epp"]["balanced"] is True
    assert r["b"]["queued"] == 3
    assert r["a"]["epp_queue_baseline_mean_us"] == pytest.approx(15.0)
    short = ov.parse_flow_metrics(_metrics_text([("tenant-b", -1, "Dispatched", 0.2)]))
    assert ov.summarize_priority(sc, samples, short, None)["accounting"]["epp"][
        "balanced"] is False


def _fair(i: int, tenant: str, at: float, status: int = 200,
          error: str = "") -> ov.OverloadSample:
    s = _s(i, tenant, "overload", status, error=error)
    return ov.OverloadSample(s.index, s.tenant, s.phase, at, 0.0, s.result)


def test_fair_window_skips_the_start_of_the_overload() -> None:
    sc = ov.scenarios(baseline_s=1, overload_s=10)
    assert ov.fair_window(sc["fair"]) == (pytest.approx(2.0), pytest.approx(10.0))
    assert ov.fair_window(sc["priority"]) == (pytest.approx(3.0), pytest.approx(11.0))


def test_summarize_fair_shares_and_verdicts() -> None:
    sc = ov.scenarios(baseline_s=1, overload_s=10)["fair"]
    # Sent before the window (0.5 s) or refused: not counted in the client shares.
    samples = ([_fair(i, "tenant-c", 3.0) for i in range(11)]
               + [_fair(20 + i, "tenant-d", 3.0) for i in range(9)]
               + [_fair(40, "tenant-d", 3.0, 429), _fair(41, "tenant-d", 0.5)])
    r = ov.summarize_fair(sc, samples, None)
    assert r["client_shares"] == {"tenant-c": pytest.approx(0.55),
                                  "tenant-d": pytest.approx(0.45)}
    assert r["dispatch_shares"] == r["client_shares"] and r["dispatch_source"] == "client"
    assert r["tenants"]["tenant-d"]["sent"] == 11
    pr = ov.summarize_priority(ov.scenarios(baseline_s=1, overload_s=1)["priority"],
                               _priority_samples([0.01] * 10, [0.02] * 10, [429]), None, None)
    v = ov.verdicts({"x": {"priority": pr, "fair": r}})
    # A's p90 doubled; A all answered; 55/45 is at the edge (met); nothing lost.
    assert [d["met"] for d in v] == [False, True, True, True]
    assert v[0]["value"] == pytest.approx(2.0)
    # The EPP's dispatches in the window decide when there are some.
    window = ov.parse_flow_metrics(_metrics_text(
        [("tenant-c", 0, "Dispatched", 0.1)] * 6 + [("tenant-d", 0, "Dispatched", 0.1)] * 7))
    r = ov.summarize_fair(sc, samples, None, window)
    assert r["dispatch_source"] == "epp" and r["epp_window_dispatched"] == {"tenant-c": 6,
                                                                          "tenant-d": 7}
    assert r["dispatch_shares"]["tenant-d"] == pytest.approx(7 / 13)
    samples[0] = _fair(0, "tenant-c", 3.0, 0, error=ov.CUT)
    r2 = ov.summarize_fair(sc, samples, None)
    v2 = ov.verdicts({"x": {"fair": r2}})
    assert [d["met"] for d in v2] == [True, False]  # 10/19 = 52.6 %, but one lost
    assert v2[1]["value"] == 1
    skewed = ov.summarize_fair(sc, samples[:11] + samples[20:22], None)
    assert ov.verdicts({"x": {"fair": skewed}})[0]["met"] is False


def test_table_shows_every_router_and_field() -> None:
    sc = ov.scenarios(baseline_s=1, overload_s=1)
    pr = ov.summarize_priority(sc["priority"], _priority_samples([0.01] * 10, [0.012] * 10,
                                                                 [200, 429]), None, None)
    fr = ov.summarize_fair(sc["fair"], [_fair(0, "tenant-c", 0.5),
                                        _fair(1, "tenant-d", 0.5)], None)
    results = {"epp-flow-control": {"priority": pr, "fair": fr}, "round-robin": {"priority": pr}}
    report: dict[str, Any] = {
        "servers": 2, "sim_args": "--x", "results": results, "verdicts": ov.verdicts(results),
        "scenarios": {v: {"phases": [{"name": p.name, "duration_s": p.duration_s,
                                      "loads": list(p.loads)} for p in s.phases],
                          "rates": ov.rates(s, COSTS, 2)} for v, s in sc.items()}}
    text = ov.table(report)
    for needle in ("epp-flow-control", "round-robin", "A TTFT p90 ms, overload",
                   "A p90 overload/baseline", "B queued in the EPP", "B rejected (429)",
                   "fair: tenant-c dispatch share", "50.0%", "priority: sent=200+429+503",
                   "22=21+1+0", "fair: 200 shares, sent in window",
                   "target [epp-flow-control] tenant A TTFT p90", "-> met",
                   "priority / overload (1s): tenant-a 50%"):
        assert needle in text, needle


# ----------------------------------------------------------------- the player


async def test_play_is_open_loop_sends_headers_and_cuts_at_the_drain() -> None:
    seen: list[tuple[float, dict[str, str]]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append((time.monotonic(), dict(request.headers)))
        tenant = request.headers.get(keys.HEADER_FAIRNESS_ID)
        if tenant == "shed":
            return web.json_response({"error": {"message": "no"}}, status=429)
        if tenant == "slow":
            await asyncio.sleep(30)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.3)  # answers take longer than the arrivals' spacing
        await resp.write(b'data: {"choices":[{"delta":{"content":" tok0"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    trace = [ov.OverloadRequest(i, 0.02 * i, t, "p", "a b c", 1)
             for i, t in enumerate(["fast"] * 10 + ["shed", "slow"])]
    headers = {t: {keys.HEADER_FAIRNESS_ID: t, keys.HEADER_OBJECTIVE: "obj"}
               for t in ("fast", "shed", "slow")}
    marked: list[float] = []

    async def mark() -> None:
        marked.append(time.monotonic())

    async with TestServer(app) as server:
        t0 = time.monotonic()
        samples = await ov.play(str(server.make_url("/")), trace, headers, drain_s=0.8,
                                marks=[(0.1, mark)])
        took = time.monotonic() - t0
    assert [s.index for s in samples] == list(range(12))
    # Open loop: all ten "fast" requests were sent before the first answer came back.
    assert seen[9][0] - seen[0][0] < 0.3
    assert all(h[keys.HEADER_OBJECTIVE] == "obj" for _, h in seen)
    assert [h[keys.HEADER_FAIRNESS_ID] for _, h in seen[:10]] == ["fast"] * 10
    assert all(s.result.status == 200 and s.result.ttft_s > 0.25 for s in samples[:10])
    assert samples[10].result.status == 429
    assert samples[11].result.status == 0 and samples[11].result.error == ov.CUT
    assert took < 3.0
    assert len(marked) == 1 and marked[0] - t0 >= 0.09


def test_overload_options_through_the_cli() -> None:
    from epp.cli import build_parser

    a = build_parser().parse_args(["bench", "--workload", "overload", "--variants", "fair",
                                   "--overload-s", "4", "--queue-ttl", "3"])
    assert isinstance(a, argparse.Namespace)
    assert (a.workload, a.variants, a.overload_s, a.queue_ttl, a.baseline_s) == (
        "overload", "fair", 4.0, 3.0, None)


@pytest.mark.parametrize("argv, why", [
    (["--rate", "3"], "--rate"), (["--repeat", "2"], "--repeat"),
    (["--config", "x.yaml"], "--config"),
    (["--variants", "nope"], "unknown variant"), (["--variants", ","], "unknown variant"),
    (["--routers", "sglang"], "unknown router"), (["--overload-s", "0"], "must be positive")])
def test_overload_rejects_what_does_not_apply(argv: list[str], why: str,
                                             capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from epp.cli import build_parser

    async def must_not_run(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
        raise AssertionError("the bench started despite bad options")

    monkeypatch.setattr(ov, "run_overload", must_not_run)
    a = build_parser().parse_args(["bench", "--workload", "overload", *argv])
    assert ov.main(a) == 2
    assert why in capsys.readouterr().err


def test_overload_options_are_refused_for_the_other_workloads(
        capsys: pytest.CaptureFixture[str]) -> None:
    from epp.bench import quality
    from epp.cli import build_parser

    a = build_parser().parse_args(["bench", "--workload", "hot-spot", "--overload-s", "3"])
    assert quality.main(a) == 2
    assert "apply to --workload overload only" in capsys.readouterr().err
    a = build_parser().parse_args(["bench", "--workload", "overload"])
    assert quality.main(a) == 2  # the CLI hands overload to epp.bench.overload.main


def test_cli_hands_overload_to_its_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from epp import cli

    seen: list[str] = []
    monkeypatch.setattr(ov, "main", lambda args: seen.append(args.workload) or 0)
    assert cli.main(["bench", "--workload", "overload", "--smoke"]) == 0
    assert seen == ["overload"]


def test_cpu_seconds_of_a_process() -> None:
    import os

    from epp.bench.quality import _cpu_seconds

    sum(i * i for i in range(200_000))  # some CPU time of our own
    secs = _cpu_seconds(os.getpid())
    assert secs is not None and secs > 0
    assert _cpu_seconds(2 ** 22 + 12345) is None  # no such process
