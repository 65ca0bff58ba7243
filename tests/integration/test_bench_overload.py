"""`epp bench --workload overload --smoke` end to end: real Envoy, the EPP with flow
control on and off (objectives file, GIE's fairness and objective headers), round robin,
simulated pods; every request accounted for, the report complete."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.proc_scan import processes_mentioning

ROOT = Path(__file__).resolve().parents[2]




def test_overload_smoke_accounts_for_every_request(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "epp.cli", "bench", "--workload", "overload",
                        "--smoke", "--out", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=180, cwd=ROOT, check=False)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert took < 90, took
    text = r.stdout
    for needle in ("A TTFT p90 ms, baseline", "A p90 overload/baseline", "B queued in the EPP",
                   "B rejected (429)", "B evicted (503)", "fair: tenant-c dispatch share",
                   "priority: sent=200+429+503", "priority: EPP disp+rej+evict",
                   "target [epp-flow-control] tenant A TTFT p90",
                   "target [epp-flow-control] zero lost"):
        assert needle in text, needle
    report = json.loads((out / "results.json").read_text())
    assert set(report["results"]) == {"epp-flow-control", "epp-legacy", "round-robin"}
    for label, res in report["results"].items():
        pr, fr = res["priority"], res["fair"]
        for variant in (pr, fr):
            c = variant["accounting"]["client"]
            # Every request got a 200, a 429 or a 503: nothing lost, nothing else.
            assert c["balanced"] and c["lost"] == 0 and c["other_status"] == 0, (label, c)
            assert c["sent"] == c["dispatched"] + c["rejected"] + c["evicted"]
        a = pr["a"]
        for phase in ("baseline", "overload"):
            assert a[phase]["ok"] == a[phase]["sent"] > 0, (label, phase, a[phase])
            assert a[phase]["ttft_p50_ms"] <= a[phase]["ttft_p90_ms"]
        assert a["ttft_p90_ratio"] > 0
        assert pr["b"]["sent"] > 0
        assert set(fr["dispatch_shares"]) == {"tenant-c", "tenant-d"}
        assert abs(sum(fr["dispatch_shares"].values()) - 1.0) < 1e-9
    fc = report["results"]["epp-flow-control"]
    # The EPP's flow-control outcome counts add up to what each tenant sent, and agree
    # with the answers the client got.
    for variant in ("priority", "fair"):
        acc = fc[variant]["accounting"]
        assert acc["epp"]["balanced"], acc
        assert (acc["epp"]["dispatched"], acc["epp"]["rejected"], acc["epp"]["evicted"]) == (
            acc["client"]["dispatched"], acc["client"]["rejected"], acc["client"]["evicted"])
    assert fc["priority"]["b"]["queued"] is not None
    assert fc["priority"]["a"]["epp_queue_baseline_mean_us"] is not None
    assert fc["fair"]["dispatch_source"] == "epp"
    assert fc["priority"]["cpu_s"]["epp"] > 0 and fc["priority"]["cpu_s"]["pods"] > 0
    # Without flow control nothing waits in the EPP and nothing is evicted; round robin
    # refuses nothing.
    assert report["results"]["epp-legacy"]["priority"]["b"]["evicted"] == 0
    rr = report["results"]["round-robin"]["priority"]["accounting"]["client"]
    assert rr["rejected"] == rr["evicted"] == 0
    verdict_routers = {v["router"] for v in report["verdicts"]}
    assert verdict_routers == set(report["results"])
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert len(lines) == sum(v["accounting"]["client"]["sent"]
                             for res in report["results"].values() for v in res.values())
    assert {json.loads(line)["tenant"] for line in lines} == {"tenant-a", "tenant-b",
                                                             "tenant-c", "tenant-d"}
    for name in ("flow-control.yaml", "legacy.yaml", "objectives.yaml"):
        assert (out / "configs" / name).exists()
    # Every process the bench started is gone.
    assert processes_mentioning(str(out)) == []
