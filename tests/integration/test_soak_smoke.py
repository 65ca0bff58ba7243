"""The soak benchmark's quick mode: real Envoy → `epp serve` → 3 `epp sim` pods, ~15 s of
mixed traffic (streamed and not, long bodies, aborted streams, bad requests); no
unexpected errors, the running gauge back to 0, samples taken, nothing left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_soak_quick(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, "-m", "bench.soak", "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "soak: OK" in r.stdout
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["unexpected_errors"] == 0, s["unexpected_by_kind"]
    assert s["running_after_drain"] == 0
    assert s["ok"] is True
    # Every kind of traffic was sent, and the bad inputs were answered 4xx.
    kinds = s["by_kind"]
    assert {"chat-stream", "chat", "completion", "abort-stream"} <= set(kinds)
    for kind, statuses in kinds.items():
        if kind.startswith("bad-"):
            assert all(st.startswith("4") for st in statuses), (kind, statuses)
    assert s["status"].get("200", 0) > 100
    # Samples during the load and one after the drain, each with the fields recorded.
    samples = doc["samples"]
    load = [x for x in samples if x["phase"] == "load"]
    assert len(load) >= 4 and samples[-1]["phase"] == "drained"
    for x in samples:
        assert x["epp_rss_kb"] > 0 and x["envoy_rss_kb"] > 0
        assert x["prefix_index_size"] is not None and x["running_requests"] is not None
    assert max(x["prefix_index_size"] for x in samples) > 0
    assert any(x["latency_p50_ms"] for x in load)
    assert s["epp_rss_ratio"] is not None and s["prefix_index_max"] > 0
