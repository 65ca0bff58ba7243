"""`epp demo`'s summary: the verdict is computed from the measurements, never fixed."""

from __future__ import annotations

import asyncio
import signal

import pytest

from epp.stack.demo import placement, sim_block_size, summary, verdict
from epp.stack.procs import cancel_on_signals
from epp.stack.runner import Report, Result
from epp.stack.workload import Workload, WorkloadSpec

FRESH = 60  # tokens a turn adds to its conversation's cached prefix
BLOCK = 16


def report(label: str, ttfts_ms: list[float], computed: list[int], *, prompt: int = 1000,
           elapsed_s: float = 10.0, servers: tuple[str, ...] = ("a", "b")) -> Report:
    rep = Report(label, elapsed_s=elapsed_s)
    for i, (t, c) in enumerate(zip(ttfts_ms, computed, strict=True)):
        rep.results.append(Result(200, servers[i % len(servers)], t / 1000, 1.0, prompt,
                                  prompt - c))
    return rep


def test_verdict_names_the_winner_of_each_measurement_and_why() -> None:
    epp = report("EPP", [10, 20, 30, 40, 50] * 4, [40, 50, 60, 70, 300] * 4)
    rr = report("round-robin", [20, 30, 40, 60, 90] * 4, [300, 400, 500, 600, 700] * 4)
    line = verdict(epp, rr, fresh_tokens=FRESH, block_size=BLOCK, servers=2)
    assert line.startswith("Verdict: the EPP won on TTFT p50 (30 vs 40 ms), "
                           "TTFT p90 (50 vs 90 ms), hit rate (90% vs 50%); "
                           "even on throughput (EPP 2.0 req/s, round robin 2.0 req/s)."), line
    # 4 of 5 EPP requests computed <= 60 + 2 blocks; none of round robin's did.
    assert "the EPP sent 80% of requests to a pod holding their prefix (round robin 0%)" in line
    assert "its pods computed 79% fewer prompt tokens per request (104 vs 500 of 1000)" in line


def test_verdict_says_when_round_robin_wins_and_how_the_ttft_splits() -> None:
    epp = report("EPP", [60, 70, 80, 90, 200] * 2, [40] * 10, elapsed_s=10)
    rr = report("round-robin", [20, 30, 40, 50, 60] * 2, [500] * 10, elapsed_s=5)
    line = verdict(epp, rr, fresh_tokens=FRESH, block_size=BLOCK, servers=2,
                   in_pods={"EPP": 0.030, "round-robin": 0.035})
    assert "the EPP won on hit rate (96% vs 50%)" in line, line
    assert "round robin won on TTFT p50 (40 vs 80 ms), TTFT p90 (60 vs 200 ms), " \
           "throughput (2.0 vs 1.0 req/s)" in line, line
    assert "the pods took 30 ms with the EPP and 35 ms with round robin, the way to and " \
           "from them (gateway, HTTP, client) 70 ms and 5 ms" in line, line


def test_verdict_reports_an_unbalanced_pool() -> None:
    servers = ("a", "a", "a", "b")
    epp = report("EPP", [10] * 8, [40] * 8, servers=servers)
    rr = report("round-robin", [10] * 8, [40] * 8)
    line = verdict(epp, rr, fresh_tokens=FRESH, block_size=BLOCK, servers=2)
    assert "its busiest pod took 75% of requests (even: 50%)" in line, line
    assert "even on TTFT p50" in line


def test_placement_counts_requests_that_found_their_prefix() -> None:
    rep = report("EPP", [10] * 4, [FRESH + 2 * BLOCK, FRESH + 2 * BLOCK + 1, 0, 900])
    p = placement(rep, FRESH, BLOCK)
    assert p.prefix_found == 0.5 and p.computed_per_request == pytest.approx(
        (92 + 93 + 0 + 900) / 4) and p.busiest_share == 0.5


def test_summary_ends_with_the_verdict_and_the_doc_only_for_the_comparison() -> None:
    epp = report("EPP", [10] * 4, [40] * 4)
    rr = report("round-robin", [20] * 4, [400] * 4)
    pods = {"EPP": ["a", "b"], "round-robin": ["a", "b"]}
    text = summary([epp, rr], pods, fresh_tokens=FRESH)
    lines = text.splitlines()
    assert lines[-2].startswith("Verdict: the EPP won on TTFT p50 (10 vs 20 ms)")
    assert lines[-1] == ("How to read these numbers: docs/local-stack.md, "
                         "\"Reading the demo's summary\".")
    alone = summary([epp], {"EPP": ["a", "b"]}, fresh_tokens=FRESH)
    assert "Verdict" not in alone and alone.endswith("\"Reading the demo's summary\".")
    assert "Verdict" not in summary([epp, rr], pods)  # `epp demo --pd`: no comparison


def test_sim_block_size_follows_the_sim_args() -> None:
    assert sim_block_size([]) == 16
    assert sim_block_size(["--block-size", "32", "--time-scale", "0.5"]) == 32
    assert sim_block_size(["--block-size=8", "--block-size", "64"]) == 64


def test_workload_turn_sizes() -> None:
    spec = WorkloadSpec()
    w = Workload(spec, "m")
    conv = w.new_conversation()
    assert abs(len(w.system_prompts[0].split()) - spec.system_prompt_words) <= 12
    body = w.next_turn(conv)
    question = body["messages"][-1]["content"]  # type: ignore[index]
    assert len(question.split()) == spec.question_tokens
    assert spec.fresh_tokens_per_turn == spec.question_tokens + spec.max_tokens


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
async def test_cancel_on_signals_cancels_the_task_once(sig: signal.Signals) -> None:
    cleaned = asyncio.Event()

    async def body() -> list[signal.Signals]:
        with cancel_on_signals() as received:
            try:
                signal.raise_signal(sig)
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                signal.raise_signal(sig)  # a second signal does not cut the cleanup short
                await asyncio.sleep(0.01)
                cleaned.set()
            return received

    got = await asyncio.wait_for(asyncio.create_task(body()), 5)
    assert got == [sig, sig] and cleaned.is_set()
    # The handlers are gone: the signal's disposition is back to what it was.
    assert signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler)
