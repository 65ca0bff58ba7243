"""The throughput benchmark's smoke mode: every load and case runs and serves without
errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk not installed (apt-get install wrk)")
def test_throughput_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    shapes = ("lean", "inline", "observer")  # the default is lean alone
    r = subprocess.run([sys.executable, "-m", "bench.throughput", "--smoke", "--workers", "1",
                        "--workers", "2", *(a for p in shapes for a in ("--response-path", p)),
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=400, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    cases = ["Envoy alone"] + [f"Envoy + EPP ({w}, {p})" for p in shapes
                               for w in ("1 worker", "2 workers")]
    assert [(row["load"], row["case"]) for row in rows] == [
        (load, case) for load in ("short", "long-prompt", "sse") for case in cases]
    for row in rows:
        assert row["rps"] > 0 and row["errors"] == 0, row
    assert all(row["epp_cpu_us"] > 0 for row in rows if row["case"] != "Envoy alone")
    assert "| ratio |" in r.stdout
