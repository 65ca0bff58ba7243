"""bench/precise_path.py runs and reports every case."""

from __future__ import annotations

import json

import pytest

from bench import precise_path


def test_smoke_reports_each_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert precise_path.main(["--smoke", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["median_us"]) == {"tokenize-whole", "tokenize-covered", "tokenize-tail",
                                     "store-add", "chat-template", "store-lookup", "events",
                                     "lookup", "tokenize-leading"}
    assert res["tokens"] == 500 and res["blocks"] == 31
    assert all(v >= 0 for v in res["median_us"].values())
    assert res["median_us"]["events"] > 0
