"""Engine metric mappings (epp.datalayer.engines) over fixture /metrics bodies."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from epp import keys
from epp.datalayer.engines import (
    EngineMappings,
    Extracted,
    MappingOverrides,
    MetricSpec,
    builtin_mappings,
)
from epp.datalayer.promparse import SampleIndex
from epp.errors import ConfigError
from epp.scheduling.types import Endpoint

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "metrics"


def extract(fixture: str, engine: str = keys.ENGINE_VLLM,
            mappings: EngineMappings | None = None) -> Extracted:
    m = (mappings or EngineMappings()).get(engine)
    assert m is not None
    return m.extract(SampleIndex((FIXTURES / fixture).read_text(encoding="utf-8")))


def test_vllm_current() -> None:
    assert extract("vllm.txt") == Extracted(
        waiting=3, running=7, kv_usage=0.4375,
        active_loras=frozenset({"sql-lora", "chat-lora"}),
        waiting_loras=frozenset({"tweet-lora"}), max_loras=4,
        block_size=16, num_blocks=27264)


def test_vllm_older_kv_name_and_unset_block_count() -> None:
    ex = extract("vllm_old.txt")
    assert (ex.waiting, ex.running, ex.kv_usage) == (12, 4, 0.8125)
    assert ex.block_size == 32
    assert ex.num_blocks is None  # num_gpu_blocks="None" before the engine profiled memory
    assert ex.active_loras == frozenset() and ex.max_loras == 0  # no LoRA series: none
    assert ex.missing == ()


def test_vllm_lora_newest_series_wins() -> None:
    ex = extract("vllm_lora.txt")
    # The 1.754000005e9 series; adapters trimmed, empty items dropped.
    assert ex.active_loras == frozenset({"a2", "a4"})
    assert ex.waiting_loras == frozenset()
    assert ex.max_loras == 2


def test_vllm_lora_newest_empty_series_means_no_adapters() -> None:
    ex = extract("vllm_lora_idle.txt")
    assert ex.active_loras == frozenset() and ex.waiting_loras == frozenset()
    assert ex.max_loras == 4


def test_sglang() -> None:
    assert extract("sglang.txt", keys.ENGINE_SGLANG) == Extracted(
        waiting=5, running=9, kv_usage=0.27, block_size=1, num_blocks=189756)


def test_trtllm_serve() -> None:
    assert extract("trtllm_serve.txt", keys.ENGINE_TRTLLM_SERVE) == Extracted(
        waiting=2, running=6, kv_usage=0.55, block_size=32, num_blocks=4096)


def test_triton_tensorrt_llm_label_selected_series() -> None:
    assert extract("triton_trtllm.txt", keys.ENGINE_TRITON_TRTLLM) == Extracted(
        waiting=3, running=11, kv_usage=0.25, block_size=64, num_blocks=6239)


def test_missing_metrics_are_reported_not_invented() -> None:
    ex = extract("missing.txt")
    assert (ex.waiting, ex.running, ex.kv_usage) == (1, 5, None)
    assert len(ex.missing) == 1
    assert "kv-cache usage" in ex.missing[0]
    assert keys.VLLM_KV_USAGE in ex.missing[0] and keys.VLLM_KV_USAGE_OLD in ex.missing[0]


def test_wrong_engine_reports_everything_missing() -> None:
    ex = extract("sglang.txt", keys.ENGINE_VLLM)
    assert (ex.waiting, ex.running, ex.kv_usage) == (None, None, None)
    assert len(ex.missing) == 3


def test_nan_values_count_as_missing() -> None:
    m = builtin_mappings()[keys.ENGINE_VLLM]
    ex = m.extract(SampleIndex("vllm:num_requests_running NaN\nvllm:num_requests_waiting 1\n"
                               "vllm:kv_cache_usage_perc +Inf\nvllm:gpu_cache_usage_perc 0.5\n"))
    assert ex.running is None and ex.waiting == 1
    assert ex.kv_usage == 0.5  # the current name is not finite: fall back to the older one


# ---------------------------------------------------------------- metric specs


@pytest.mark.parametrize("spec,name,labels", [
    ("vllm:num_requests_waiting", "vllm:num_requests_waiting", {}),
    ("  m{a=b}  ", "m", {"a": "b"}),
    ("m{ a = b , c=d }", "m", {"a": "b", "c": "d"}),
    ('m{a="b"}', "m", {"a": "b"}),
])
def test_metric_spec_parse(spec: str, name: str, labels: dict[str, str]) -> None:
    got = MetricSpec.parse(spec)
    assert got is not None
    assert got.name == name and dict(got.labels) == labels


@pytest.mark.parametrize("spec,fragment", [
    ("m{a=b", "malformed label block"),
    ("m}", "malformed label block"),
    ("m{}", "malformed label block"),
    ("m{a=b}x", "text after"),
    ("m{a}", "invalid label pair"),
    ("m{a=b=c}", "invalid label pair"),
    ("m{=b}", "invalid label pair"),
    ("{a=b}", "invalid metric name"),
    ("my metric", "invalid metric name"),
])
def test_metric_spec_parse_errors(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        MetricSpec.parse(spec, "--some-flag")
    assert str(info.value).startswith("--some-flag: ")
    assert fragment in str(info.value)


def test_metric_spec_empty_means_none_and_str_round_trips() -> None:
    assert MetricSpec.parse("") is None and MetricSpec.parse("  ") is None
    spec = MetricSpec.parse("m{a=b,c=d}")
    assert str(spec) == "m{a=b,c=d}"
    assert MetricSpec.parse(str(spec)) == spec


def test_metric_spec_select_newest_timestamp_then_first() -> None:
    idx = SampleIndex('m{a="1"} 10\nm{a="2"} 20 5000\nm{a="1"} 30 9000\nm{a="3"} 40 9000\n')
    spec = MetricSpec.parse("m")
    assert spec is not None
    sel = spec.select(idx)
    assert sel is not None and sel.value == 30  # newest; the first of the two at 9000
    only = MetricSpec.parse("m{a=2}")
    assert only is not None
    sel2 = only.select(idx)
    assert sel2 is not None and sel2.value == 20
    none = MetricSpec.parse("m{a=9}")
    assert none is not None and none.select(idx) is None


# ---------------------------------------------------------------- overrides (GIE flags)


def test_overrides_replace_default_engine_signals() -> None:
    ov = MappingOverrides(total_queued_requests="custom_queue{kind=waiting}",
                          kv_cache_usage_percentage="vllm:gpu_cache_usage_perc",
                          lora_info="")
    mappings = EngineMappings(overrides=ov)
    text = ('custom_queue{kind="waiting"} 8\ncustom_queue{kind="done"} 99\n'
            "vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.9\n"
            "vllm:gpu_cache_usage_perc 0.2\n"
            'vllm:lora_requests_info{running_lora_adapters="x",max_lora="1"} 5\n')
    ex = mappings.default.extract(SampleIndex(text))
    assert ex.waiting == 8
    assert ex.kv_usage == 0.2  # only the named metric, no fallback
    assert ex.active_loras is None  # LoRA not read
    # Other engines keep their built-in mappings.
    assert mappings.get(keys.ENGINE_SGLANG) == builtin_mappings()[keys.ENGINE_SGLANG]


def test_override_empty_disables_a_signal() -> None:
    m = EngineMappings(overrides=MappingOverrides(total_running_requests="")).default
    assert m.running == ()
    ex = m.extract(SampleIndex("vllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 0.1\n"))
    assert ex.missing == () and ex.running is None


def test_override_cache_info_keeps_label_names() -> None:
    m = EngineMappings(overrides=MappingOverrides(cache_info="my_cache_info{engine=0}")).default
    ex = m.extract(SampleIndex('my_cache_info{engine="0",block_size="64",num_gpu_blocks="10"} 1\n'
                               'my_cache_info{engine="1",block_size="8",num_gpu_blocks="3"} 1\n'))
    assert (ex.block_size, ex.num_blocks) == (64, 10)
    off = EngineMappings(overrides=MappingOverrides(cache_info="")).default
    assert off.block_size == () and off.num_blocks == ()


def test_bad_override_fails_with_the_flag_name() -> None:
    with pytest.raises(ConfigError, match="--total-running-requests-metric"):
        EngineMappings(overrides=MappingOverrides(total_running_requests="m{a"))


def test_mapping_names_are_what_the_index_reads() -> None:
    m = builtin_mappings()[keys.ENGINE_VLLM]
    assert m.names == {keys.VLLM_WAITING, keys.VLLM_RUNNING, keys.VLLM_KV_USAGE,
                       keys.VLLM_KV_USAGE_OLD, keys.VLLM_LORA_INFO, keys.VLLM_CACHE_CONFIG}


# ---------------------------------------------------------------- engine per endpoint


def ep(labels: dict[str, str]) -> Endpoint:
    return Endpoint("p", "10.0.0.1", 8000, labels=labels)


def test_engine_from_labels_default_vllm() -> None:
    em = EngineMappings()
    assert em.for_endpoint(ep({})).engine == keys.ENGINE_VLLM
    assert em.for_endpoint(ep({keys.LABEL_ENGINE: "sglang"})).engine == keys.ENGINE_SGLANG
    assert em.for_endpoint(ep({keys.LABEL_ENGINE_GIE: "TRTLLM-Serve"})).engine == \
        keys.ENGINE_TRTLLM_SERVE
    # llm-d's label wins over GIE's when both are set.
    assert em.for_endpoint(ep({keys.LABEL_ENGINE: "triton-tensorrt-llm",
                               keys.LABEL_ENGINE_GIE: "sglang"})).engine == \
        keys.ENGINE_TRITON_TRTLLM


def test_unknown_engine_falls_back_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    em = EngineMappings()
    with caplog.at_level(logging.WARNING, logger="epp.datalayer.engines"):
        for _ in range(3):
            assert em.for_endpoint(ep({keys.LABEL_ENGINE: "ollama"})).engine == keys.ENGINE_VLLM
    warnings = [r for r in caplog.records if "unknown engine type" in r.getMessage()]
    assert len(warnings) == 1
    assert "'ollama'" in warnings[0].getMessage()


def test_unknown_default_engine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown default engine"):
        EngineMappings(default="nope")
