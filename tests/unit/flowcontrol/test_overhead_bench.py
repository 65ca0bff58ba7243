"""bench/flowcontrol_overhead.py runs and reports sane numbers (its smoke mode)."""

from __future__ import annotations

import json

import pytest

from bench import flowcontrol_overhead


def test_smoke_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert flowcontrol_overhead.main(["--smoke", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for case in ("metrics", "no-metrics", "baseline"):
        assert 0 < r[case]["median_us"] <= r[case]["p99_us"], case
    assert r["no-metrics"]["median_us"] < 1000  # generous: a shared 2-core CI machine
    assert r["queued"]["requests"] == 500 and r["queued"]["cpu_us_per_request"] > 0


def test_smoke_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert flowcontrol_overhead.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "median µs" in out and "queued then released" in out
