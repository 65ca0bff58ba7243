"""bench/kvcache_keys.py runs, and its reference scheme is the chained shape it claims."""

from __future__ import annotations

import json

import pytest

from bench import kvcache_keys


def test_smoke_reports_each_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvcache_keys.main(["--smoke", "--json", "--tokens", "320"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["median_us"]) == {"xxh3", "fnv-cbor", "event"}
    assert all(v > 0 for v in res["median_us"].values())


def test_reference_keys_chain() -> None:
    keys = kvcache_keys.fnv_cbor_keys(list(range(40)), 16, "m")
    assert len(keys) == 2 and keys[0] != keys[1]
    assert kvcache_keys.fnv_cbor_keys(list(range(40)), 16, "n") != keys
