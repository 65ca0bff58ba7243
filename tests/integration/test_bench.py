"""`epp bench --smoke` end to end: real Envoy, the EPP, simulated pods, three routers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.proc_scan import processes_mentioning

ROOT = Path(__file__).resolve().parents[2]




def test_bench_smoke_runs_every_router_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "epp.cli", "bench", "--smoke", "--workload", "mix",
                        "--out", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert took < 60, took
    text = r.stdout
    for needle in ("ceiling (offline replay", "TTFT p90 ms", "hit / ceiling", "pod shares %, busiest",
                   "target [epp] hit rate"):
        assert needle in text, needle
    report = json.loads((out / "results.json").read_text())
    assert set(report["results"]) == {"epp", "round-robin", "random"}
    for label, m in report["results"].items():
        assert m["ok"] > 20 and m["errors"] == 0, (label, m)
        assert 0.0 < m["hit_rate"] < 1.0
        assert abs(sum(m["share"].values()) - 1.0) < 1e-9
        assert set(m["by_kind"]) == {"shared-prefix", "multi-turn", "hot-spot"}
        assert m["ttft_p50_ms"] <= m["ttft_p90_ms"] <= m["ttft_p99_ms"]
    assert report["ceiling"]["bound"]["hit_rate"] >= report["ceiling"]["round-robin"]["hit_rate"]
    assert (out / "chart.png").exists() or (out / "chart.txt").exists()
    assert (out / "samples.jsonl").read_text().count("\n") == sum(
        m["requests"] for m in report["results"].values())
    # Every process the bench started is gone.
    assert processes_mentioning(str(out)) == []
