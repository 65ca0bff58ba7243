"""The Prometheus text parser (epp.datalayer.promparse): full parse and the fast index."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.datalayer.promparse import ParseError, Sample, SampleIndex, parse

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "metrics"
ALL_FIXTURES = sorted(p.name for p in FIXTURES.glob("*.txt")
                      if not p.name.startswith("malformed"))


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def _key(name: str, labels: object, value: float, ts: object) -> tuple[object, ...]:
    # prometheus_client renames a counter sample without the _total suffix (Triton's
    # nv_inference_request_success) to name_total; compare names without it.
    v = "nan" if math.isnan(value) else value
    return (name.removesuffix("_total"), tuple(sorted(dict(labels).items())),  # type: ignore[call-overload]
            v, ts)


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_full_parse_matches_prometheus_client(name: str) -> None:
    text = fixture(name)
    ours = sorted((_key(s.name, s.labels, s.value,
                        None if s.timestamp_ms is None else s.timestamp_ms / 1000)
                   for samples in parse(text).values() for s in samples), key=repr)
    theirs = sorted((_key(s.name, s.labels, s.value, s.timestamp)
                     for fam in text_string_to_metric_families(text) for s in fam.samples),
                    key=repr)
    assert ours == theirs


def test_escapes_blanks_timestamps_and_special_values() -> None:
    got = parse(fixture("escapes.txt"))
    w = got["weird_metric"]
    assert w[0].labels == {"path": "C:\\dir\\file", "quote": 'say "hi", then {leave}',
                           "nl": "a\nb", "empty": ""}
    assert w[0].value == 1.5 and w[0].timestamp_ms is None
    assert w[1] == Sample("weird_metric", {"a": "x", "b": "y"}, -math.inf, 1712345678000)
    assert math.isnan(w[2].value)
    assert w[3].value == math.inf and w[3].timestamp_ms == -5
    assert got["other"][0].value == 0.03
    assert got["other_no_type"][0].value == 42.0


@pytest.mark.parametrize("line,fragment", [
    ('m{a="x} 1', "unterminated label value"),
    ('m{a="x"', "expected ',' or '}'"),
    ('m{', "unterminated label set"),
    ('m{a="x" b="y"} 1', "expected ',' or '}'"),
    ('m{a=x} 1', "expected '\"'"),
    ('m{a="\\q"} 1', "invalid escape"),
    ('m{a="1",a="2"} 1', "duplicate label"),
    ('m{1a="x"} 1', "invalid label name"),
    ("m{a=\"x\"}1", "expected a blank"),
    ("m", "missing value"),
    ("m{}", "missing value"),
    ("m one", "invalid value"),
    ("m 1_0", "invalid value"),
    ("m 1 2.5", "invalid timestamp"),
    ("m 1 2 3", "unexpected text after the timestamp"),
    ("1m 1", "invalid metric name"),
    ("m-x 1", "invalid metric name"),
    ("# TYPE m gauges", "invalid metric type"),
    ("# TYPE 9m gauge", "invalid metric name"),
    ("# HELP", "HELP without a metric name"),
])
def test_malformed_lines_raise_with_line_number(line: str, fragment: str) -> None:
    with pytest.raises(ParseError) as info:
        parse(f"ok 1\n\n{line}\nok 2\n")
    assert info.value.line == 3
    assert fragment in str(info.value)
    assert str(info.value).startswith("line 3: ")


def test_free_comments_and_blank_lines_are_ignored() -> None:
    assert parse("# just words\n   \n\t\n# EOF\n") == {}


def test_fixture_malformed_wanted_line_raises() -> None:
    with pytest.raises(ParseError) as info:
        SampleIndex(fixture("malformed.txt"))["vllm:num_requests_running"]
    assert info.value.line == 3
    # The other names of that body still read.
    assert SampleIndex(fixture("malformed.txt"))["vllm:num_requests_waiting"][0].value == 1.0


def test_index_ignores_broken_lines_it_does_not_read() -> None:
    text = fixture("malformed_unrelated.txt")
    with pytest.raises(ParseError):
        parse(text)
    idx = SampleIndex(text)
    assert idx["vllm:num_requests_running"][0].value == 5.0
    assert idx["vllm:kv_cache_usage_perc"][0].value == 0.5


def test_index_matches_full_parse_for_every_name() -> None:
    text = fixture("vllm.txt")
    full = parse(text)
    idx = SampleIndex(text)
    for name, samples in full.items():
        assert list(idx[name]) == samples, name
    assert parse(text, ["vllm:num_requests_running", "absent"]) == {
        "vllm:num_requests_running": full["vllm:num_requests_running"]}


def test_index_name_boundaries_and_first_line() -> None:
    text = ("m 1\n"
            "m_total 2\n"
            "m{a=\"b\"} 3\n"
            "m\t4\n"
            "mm 5\n")
    idx = SampleIndex(text)
    assert [s.value for s in idx["m"]] == [1, 3, 4]
    assert [s.value for s in idx["m_total"]] == [2]
    assert "absent" not in idx
    assert idx.get("absent") is None
    with pytest.raises(KeyError):
        idx["m_"]


def test_index_reads_a_name_within_its_family_group() -> None:
    # Samples of one name after another family's comment lines belong to a broken body;
    # the index reads the first group (the format requires one group per family).
    text = ("# TYPE a gauge\na{x=\"1\"} 1\na{x=\"2\"} 2\n# TYPE b gauge\nb 3\n")
    assert [s.value for s in SampleIndex(text)["a"]] == [1, 2]
    # Without comment lines the whole body is searched.
    text2 = 'a{x="1"} 1\nb 3\na{x="2"} 2\n'
    assert [s.value for s in SampleIndex(text2)["a"]] == [1, 2]


def test_index_does_not_find_indented_lines_but_full_parse_does() -> None:
    text = "  m 1\n"
    assert "m" not in SampleIndex(text)
    assert parse(text)["m"][0].value == 1


def test_line_cache_reuses_samples_and_is_bounded() -> None:
    cache: dict[str, Sample] = {}
    a = SampleIndex('m{a="1"} 1\n', cache)["m"][0]
    b = SampleIndex('m{a="1"} 1\n', cache)["m"][0]
    assert a is b
    assert len(cache) == 1
    for i in range(5):
        SampleIndex(f"m {i}\n", cache, line_cache_max=3)["m"]
    assert len(cache) <= 3


def test_index_mapping_protocol_is_a_full_read() -> None:
    idx = SampleIndex("a 1\nb 2\nb{x=\"y\"} 3\n")
    assert sorted(idx) == ["a", "b"]
    assert len(idx) == 2
