"""``epp bench``'s ``epp-precise`` router and issue 15's verdicts."""

from __future__ import annotations

import string
from pathlib import Path

import pytest

from epp.bench.quality import PRECISE_CONFIG, parse_routers, verdicts
from epp.bench.tokenizer import write_bench_tokenizer
from epp.config.loader import load_and_build
from epp.kvcache.tokenization import LocalTokenizer

PRECISE_APPROX = Path(__file__).parents[3] / "config/examples/precise-approx-bench.yaml"


def test_parse() -> None:
    (r,) = parse_routers("epp-precise", None)
    assert r.kind == "epp" and r.label == "epp-precise" and r.kv_events and r.config is None
    (r,) = parse_routers("epp-precise=x/mine.yaml", None)
    assert r.label == "epp-precise:mine" and r.kv_events and r.config.endswith("mine.yaml")
    with pytest.raises(ValueError, match="epp-precise"):
        parse_routers("nope", None)


@pytest.mark.parametrize("config", [PRECISE_CONFIG, PRECISE_APPROX.read_text()])
def test_bench_configs_load(config: str, tmp_path: Path) -> None:
    text = string.Template(config).substitute(
        TOKENIZER_PATH=str(write_bench_tokenizer(tmp_path, ['abc'])), KV_EVENTS_PORT_OFFSET="-1234")
    built = load_and_build(text=text, strict=True)
    prod = built.plugins["precise-prefix-cache-producer"]
    assert prod.params.kv_events.pod_discovery.endpoint_port_offset == -1234  # type: ignore[attr-defined]  # the producer
    tok = built.plugins["token-producer"].backend  # type: ignore[attr-defined]  # the producer
    assert isinstance(tok, LocalTokenizer) and tok.prefix_store is not None


def _m(p90: float, hit: float) -> dict[str, float]:
    return {"ttft_p90_ms": p90, "hit_rate": hit}


def test_precise_verdicts() -> None:
    res = {"epp": _m(200, 0.34), "epp-precise": _m(150, 0.36), "sglang": _m(300, 0.35)}
    v = {(x["router"], x["target"]): x["met"] for x in verdicts("shared-prefix", res, 0.37,
                                                                static=0.36)}
    assert v[("epp-precise", "hit rate >= 98% of static affinity's")]
    assert v[("epp-precise", "TTFT p90 < sglang cache_aware's")]
    assert v[("epp-precise", "TTFT p90 <= approximate (epp)'s")]
    assert v[("epp-precise", "hit rate >= approximate (epp)'s")]
    assert not any(r == "epp" and "static" in t for r, t in v)
