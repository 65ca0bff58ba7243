"""bench/sched_micro.py: the scheduling micro-benchmark runs and reports sane numbers."""

from __future__ import annotations

import pytest

from bench import sched_micro


def test_measure_small_cell() -> None:
    r = sched_micro.measure(endpoints=10, tokens=1024, cycles=40, warmup=5)
    assert r["endpoints"] == 10 and r["tokens"] == 1024 and r["cycles"] == 40
    assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
    assert r["p99_ms"] < 50  # generous: a 2-core CI machine shared with other jobs


def test_cli_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    assert sched_micro.main(["--smoke", "--endpoints", "100", "--tokens", "8192"]) == 0
    out = capsys.readouterr().out
    assert "p99 ms" in out and "target: p99 <= 1.0 ms at 100 endpoints" in out


def test_prefix_index_match_is_the_longest_leading_run_per_endpoint() -> None:
    """The optimised PrefixIndex.match (per-endpoint C-level scans) against the
    definition, on random indexes with evictions and removals."""
    import random

    from epp.scheduling.prefix.indexer import PrefixIndex

    rng = random.Random(11)
    for _ in range(200):
        idx = PrefixIndex(rng.choice([5, 20, 1000]))
        eps = [f"e{i}" for i in range(rng.choice([1, 4, 30]))]
        chains = [[rng.getrandbits(64) for _ in range(rng.randint(1, 30))] for _ in range(6)]
        for _ in range(rng.randint(0, 50)):
            ch = rng.choice(chains)
            idx.add(rng.choice(eps), ch[:rng.randint(1, len(ch))])
            if rng.random() < 0.05:
                idx.remove_endpoint(rng.choice(eps))
        for _ in range(5):
            ch = rng.choice(chains)
            q = ch[:rng.randint(0, len(ch))] + [rng.getrandbits(64)]
            cands = rng.sample(eps, rng.randint(0, len(eps)))
            want = {}
            for e in cands:
                lru = idx._lru.get(e, {})
                n = 0
                while n < len(q) and q[n] in lru:
                    n += 1
                want[e] = n
            assert idx.match(q, iter(cands)) == want
