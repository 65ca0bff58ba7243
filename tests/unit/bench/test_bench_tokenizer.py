"""The bench's tokenizer.json gives the simulator's token ids for every bench prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.bench.tokenizer import trace_words, write_bench_tokenizer
from epp.bench.traces import make_trace
from epp.kvcache.tokenization import LocalTokenizer
from epp.sim.tokens import WordTokenizer


@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn", "hot-spot", "mix"])
async def test_same_ids_as_the_simulator(tmp_path: Path, workload: str) -> None:
    trace = make_trace(workload, 10.0, 10.0)
    local = LocalTokenizer(str(write_bench_tokenizer(tmp_path,
                                                     trace_words(r.messages for r in trace))))
    sim = WordTokenizer()
    for r in trace[:40]:
        body = r.body("sim-model")
        assert await local.tokenize(body, "") == sim.chat(body["messages"])[0]
    # a word outside the trace is the one place they part
    assert await local.tokenize(None, "Hello") != sim.prompt("Hello")[0]


def test_a_word_whose_id_is_the_unknown_tokens_is_refused(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("epp.bench.tokenizer.word_id", lambda w: 0)
    with pytest.raises(ValueError, match="unknown token"):
        write_bench_tokenizer(tmp_path, ["abc"])
