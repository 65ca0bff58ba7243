"""`epp serve` flags of the metrics data layer (names and syntax as GIE's)."""

from __future__ import annotations

import argparse

import pytest

from epp.cli import build_parser


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--endpoints", "10.0.0.1:8000", *argv])


def test_defaults() -> None:
    a = parse()
    assert a.refresh_metrics_interval == 0.05
    assert a.metrics_staleness_threshold == 2.0
    assert a.model_server_metrics_scheme == "http"
    assert a.model_server_metrics_path == "/metrics"
    assert a.model_server_metrics_port == 0
    assert a.model_server_metrics_https_insecure_skip_verify is True
    assert a.scrape_metrics is True
    assert a.total_queued_requests_metric is None


def test_go_style_values() -> None:
    a = parse("--refresh-metrics-interval", "100ms", "--metrics-staleness-threshold", "1.5s",
              "--metrics-scrape-timeout", "0.25",
              "--model-server-metrics-https-insecure-skip-verify=false",
              "--model-server-metrics-scheme", "https", "--model-server-metrics-port", "9400",
              "--total-queued-requests-metric", "nv_trt_llm_request_metrics{request_type=waiting}",
              "--kv-cache-usage-percentage-metric", "", "--metrics-max-loop-lag", "0",
              "--no-metrics-scraping")
    assert a.refresh_metrics_interval == pytest.approx(0.1)
    assert a.metrics_staleness_threshold == 1.5
    assert a.metrics_scrape_timeout == 0.25
    assert a.model_server_metrics_https_insecure_skip_verify is False
    assert a.model_server_metrics_port == 9400
    assert a.total_queued_requests_metric == \
        "nv_trt_llm_request_metrics{request_type=waiting}"
    assert a.kv_cache_usage_percentage_metric == ""
    assert a.metrics_max_loop_lag == 0
    assert a.scrape_metrics is False
    assert parse("--model-server-metrics-https-insecure-skip-verify") \
        .model_server_metrics_https_insecure_skip_verify is True


@pytest.mark.parametrize("argv", [
    ["--refresh-metrics-interval", "fast"],
    ["--model-server-metrics-https-insecure-skip-verify=maybe"],
    ["--model-server-metrics-scheme", "ftp"],
])
def test_bad_values_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err
