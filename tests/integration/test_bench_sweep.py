"""`epp bench --sweep 2 --smoke`: two tiny shapes x two routers through real Envoy."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.proc_scan import processes_mentioning

ROOT = Path(__file__).resolve().parents[2]




def test_sweep_smoke_reports_every_shape_router_and_check(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "epp.cli", "bench", "--sweep", "2", "--smoke",
                        "--routers", "epp,round-robin", "--out", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert took < 60, took
    for needle in ("ceiling:", "aggregate [training]", "pod shares % (cost)",
                   "target [training] [epp] hit >= 95% of ceiling",
                   "target [training] [epp] on no shape > 10% worse than round robin"):
        assert needle in r.stdout, needle
    report = json.loads((out / "results.json").read_text())
    assert (out / "table.txt").read_text().strip() in r.stdout
    assert report["routers"] == ["epp", "round-robin"]
    assert next(e["shape"]["name"] for e in report["shapes"]) == "capacity-bound-shared-prefix"
    assert len(report["shapes"]) == 2
    for e in report["shapes"]:
        assert e["set"] == "training"
        assert set(e["results"]) == {"epp", "round-robin"}
        plan = e["plan"]
        assert plan["requests"] > 10 and plan["capacity_rps"] > 0 and plan["num_gpu_blocks"] > 0
        c = e["ceiling"]
        bound, no_eviction = c["bound"]["hit_rate"], c["no-eviction"]["hit_rate"]
        assert c["round-robin"]["hit_rate"] <= bound <= no_eviction
        for label, m in e["results"].items():
            assert m["ok"] > 10 and m["errors"] == 0, (label, m)
            assert m["ttft_p50_ms"] <= m["ttft_p90_ms"]
            assert m["throughput_rps"] > 0
            assert abs(sum(m["share"].values()) - 1.0) < 1e-9
            assert len(m["share"]) == e["shape"]["pods"]
            # No placement beats a single pod that never evicts (a true upper bound); the
            # heuristic bound may be beaten by a little (docs/benchmarks.md, "The ceiling").
            assert m["hit_rate"] <= no_eviction + 1e-9, (label, m["hit_rate"], no_eviction)
            assert m["hit_rate"] <= bound + 0.05, (label, m["hit_rate"], bound)
            ck = e["checks"][label]
            assert ck["hit_vs_ceiling"] == m["hit_rate"] / bound
            assert isinstance(ck["hit_ok"], bool) and isinstance(ck["ttft_ok"], bool)
    for label in ("epp", "round-robin"):
        agg = report["aggregate"]["training"][label]
        assert agg["shapes"] == 2 and agg["errors"] == 0
        assert agg["ttft_p90_vs_best"] >= 1.0
        ck = report["checks"]["training"][label]
        assert ck["shapes"] == 2 and set(ck["per_shape"]) == {
            e["shape"]["name"] for e in report["shapes"]}
        assert isinstance(ck["target_shapes_met"], bool)
    assert (out / "sweep.png").exists() or "no plot" in r.stdout
    assert processes_mentioning(str(out)) == []
