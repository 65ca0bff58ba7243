"""GIE v1.5.0's `epp` flags on `epp serve`: every one accepted with Go's syntax, its
meaning and default; GIE's logging flags mapped onto Python logging; flags with no
counterpart here noted at startup (docs/configuration.md, "GIE's flags")."""

from __future__ import annotations

import argparse
import logging
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from epp.cli import build_parser, log_settings, serve_options
from epp.errors import ConfigError
from epp.observability import logging as eppl
from epp.server import options as so

ROOT = Path(__file__).resolve().parents[3]
GIE = ROOT / "tests/fixtures/gie-v1.5.0"
# controller-runtime's zap.Options.BindFlags (v0.23), bound by GIE's LoggingOptions.AddFlags.
ZAP_FLAGS = {"zap-devel", "zap-encoder", "zap-log-level", "zap-stacktrace-level",
             "zap-time-encoding"}


def gie_flags() -> set[str]:
    """The flag names GIE's options.go files define (fs.XxxVar / fs.XxxVarP calls)."""
    names: set[str] = set()
    for path in ("pkg/epp/server/options.go", "pkg/common/observability/logging/options.go"):
        names |= set(re.findall(r'fs\.\w+VarP?\(&opts\.[\w.]+,\s*"([a-z-]+)"',
                                (GIE / path).read_text()))
    return names | ZAP_FLAGS


# One Go-syntax use of each flag (pflag: --name=value, --name value, bare booleans, -v N).
GO_USES: dict[str, list[str]] = {
    "grpc-port": ["--grpc-port=9002"],
    "ha-enable-leader-election": ["--ha-enable-leader-election"],
    "pool-group": ["--pool-group", "inference.networking.k8s.io"],
    "pool-namespace": ["--pool-namespace=ns1"],
    "pool-name": ["--pool-name", "vllm-pool"],
    "endpoint-selector": ["--endpoint-selector=app=vllm,env=prod"],
    "endpoint-target-ports": ["--endpoint-target-ports=3000,3001"],
    "disable-endpoint-subset-filter": ["--disable-endpoint-subset-filter=true"],
    "model-server-metrics-scheme": ["--model-server-metrics-scheme=https"],
    "model-server-metrics-path": ["--model-server-metrics-path", "/prometheus/metrics"],
    "model-server-metrics-port": ["--model-server-metrics-port=9400"],
    "model-server-metrics-https-insecure-skip-verify": [
        "--model-server-metrics-https-insecure-skip-verify=false"],
    "refresh-metrics-interval": ["--refresh-metrics-interval=100ms"],
    "refresh-prometheus-metrics-interval": ["--refresh-prometheus-metrics-interval=5s"],
    "metrics-staleness-threshold": ["--metrics-staleness-threshold", "2s"],
    "total-queued-requests-metric": ['--total-queued-requests-metric="sglang:num_queue_reqs"'],
    "total-running-requests-metric": ["--total-running-requests-metric",
                                      "nv_trt_llm_request_metrics{request_type=scheduled}"],
    "kv-cache-usage-percentage-metric": ["--kv-cache-usage-percentage-metric=sglang:token_usage"],
    "lora-info-metric": ["--lora-info-metric", ""],
    "cache-info-metric": ["--cache-info-metric=vllm:cache_config_info"],
    "v": ["--v", "1"],
    "zap-devel": ["--zap-devel"],
    "zap-encoder": ["--zap-encoder", "json"],
    "zap-log-level": ["--zap-log-level=info"],
    "zap-stacktrace-level": ["--zap-stacktrace-level=error"],
    "zap-time-encoding": ["--zap-time-encoding=rfc3339"],
    "tracing": ["--tracing=false"],
    "health-checking": ["--health-checking"],
    "metrics-port": ["--metrics-port=9090"],
    "grpc-health-port": ["--grpc-health-port", "9003"],
    "enable-pprof": ["--enable-pprof=true"],
    "cert-path": ["--cert-path=/certs"],
    "enable-cert-reload": ["--enable-cert-reload"],
    "secure-serving": ["--secure-serving=true"],
    "metrics-endpoint-auth": ["--metrics-endpoint-auth=false"],
    "config-file": ["--config-file=/config/default-plugins.yaml"],
    "config-text": ["--config-text", "plugins: []"],
}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_the_fixture_lists_gies_37_flags() -> None:
    assert len(gie_flags()) == 37
    assert set(GO_USES) == gie_flags()


def test_help_lists_every_gie_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "epp.cli", "serve", "--help"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    listed = set(re.findall(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)", out.stdout))
    listed |= {"v"} if re.search(r"(?<![\w-])-v N", out.stdout) else set()
    assert gie_flags() <= listed, gie_flags() - listed


@pytest.mark.parametrize("flag", sorted(GO_USES))
def test_each_flag_parses_in_go_syntax(flag: str) -> None:
    source = [] if flag in ("pool-name", "endpoint-selector") else ["--endpoints", "1.2.3.4:5"]
    parse(*source, *GO_USES[flag])


def test_gie_chart_args_parse_and_map() -> None:
    """The args GIE v1.5.0's chart renders (one replica, vllm; see test_gie_chart.py)."""
    a = parse("--pool-name", "vllm-pool", "--pool-namespace", "ns1", "--pool-group",
              "inference.networking.k8s.io", "--zap-encoder", "json", "--config-file",
              "/config/default-plugins.yaml", "--v", "1", "--tracing=false")
    o = serve_options(a)
    assert o.kubernetes.pool_name == "vllm-pool" and o.kubernetes.pool_namespace == "ns1"
    assert o.observability.tracing is False
    assert (o.observability.log_level, o.observability.log_format) == ("info", "json")


@pytest.mark.parametrize("argv, value", [
    ([], None), (["--tracing"], True), (["--tracing=true"], True), (["--tracing=false"], False),
    (["--tracing=0"], False), (["--tracing", "false"], False), (["--tracing=T"], True),
])
def test_bool_flags_take_gos_forms(argv: list[str], value: bool | None) -> None:
    assert parse("--endpoints", "1.2.3.4:5", *argv).tracing is value


@pytest.mark.parametrize("argv, verbosity", [
    (["-v", "3"], 3), (["-v3"], 3), (["-v=3"], 3), (["--v", "3"], 3), (["--v=3"], 3)])
def test_v_takes_pflags_forms(argv: list[str], verbosity: int) -> None:
    assert parse("--endpoints", "1.2.3.4:5", *argv).verbosity == verbosity


@pytest.mark.parametrize("argv, message", [
    (["--tracing=maybe"], "expected true or false"),
    (["--zap-encoder", "yaml"], 'invalid encoder value "yaml"'),
    (["--zap-log-level", "0"], 'invalid log level "0"'),
    (["--zap-log-level", "warn"], 'invalid log level "warn"'),
    (["--zap-stacktrace-level", "warn"], 'invalid stacktrace level "warn"'),
    (["--zap-time-encoding", "unix"], 'invalid time-encoding value "unix"'),
    (["--refresh-prometheus-metrics-interval", "soon"], "--refresh-prometheus-metrics-interval"),
])
def test_bad_values_are_usage_errors(argv: list[str], message: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse("--endpoints", "1.2.3.4:5", *argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_are_gies() -> None:
    """GIE's NewOptions() defaults, where this EPP has the same thing."""
    a = parse("--pool-name", "p")
    o = serve_options(a)
    assert (o.listen.grpc_port, o.listen.grpc_health_port, o.listen.metrics_port) == (
        9002, 9003, 9090)
    assert o.kubernetes.pool_group == "inference.networking.k8s.io"
    assert o.kubernetes.pool_namespace is None  # then $NAMESPACE, else "default", as GIE
    assert o.ha.enable_leader_election is False
    assert o.routing.disable_endpoint_subset_filter is False
    s = o.scraping.scrape
    assert (s.interval_s, s.staleness_threshold_s, s.scheme, s.path) == (
        0.05, 2.0, "http", "/metrics")
    assert s.insecure_skip_verify is True and s.port is None
    assert o.tls.enable_cert_reload is False and o.tls.cert_path is None
    assert o.observability.log_level == "info"  # GIE's -v 2
    plan = so.validate(o)
    # The three GIE defaults behind constants (epp/server/options.py).
    assert plan.secure_serving is so.DEFAULT_SECURE_SERVING
    assert plan.tracing == ("if-installed" if so.DEFAULT_TRACING else "off")
    assert plan.metrics_auth_kubernetes is so.DEFAULT_METRICS_ENDPOINT_AUTH
    assert plan.notes == ()


def test_explicit_go_values_override_the_constants() -> None:
    plan = so.validate(serve_options(parse(
        "--pool-name", "p", "--secure-serving=true", "--tracing=true",
        "--metrics-endpoint-auth=true")))
    assert plan.secure_serving is True and plan.tracing == "on"
    assert plan.metrics_auth_kubernetes is True and plan.metrics_auth_token is None
    plan = so.validate(serve_options(parse(
        "--pool-name", "p", "--secure-serving=false", "--tracing=false",
        "--metrics-endpoint-auth=false")))
    assert plan.secure_serving is False and plan.tracing == "off"
    assert plan.metrics_auth_kubernetes is False


def test_metrics_endpoint_auth_forms(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    plan = so.validate(serve_options(parse("--endpoints", "1.2.3.4:5",
                                           "--metrics-endpoint-auth", str(token))))
    assert plan.metrics_auth_token == "s3cret" and not plan.metrics_auth_kubernetes
    # A bare flag is GIE's true: Kubernetes reviews, which need a Kubernetes source.
    assert so.validate(serve_options(parse("--pool-name", "p", "--metrics-endpoint-auth"))
                       ).metrics_auth_kubernetes
    with pytest.raises(ConfigError, match="needs a Kubernetes endpoint source"):
        so.validate(serve_options(parse("--endpoints", "1.2.3.4:5",
                                        "--metrics-endpoint-auth")))


def test_flags_with_no_counterpart_are_noted() -> None:
    plan = so.validate(serve_options(parse(
        "--endpoints", "1.2.3.4:5", "--health-checking", "--enable-pprof=false",
        "--refresh-prometheus-metrics-interval=5s", "--model-server-metrics-path=/m",
        "--lora-info-metric", "", "--enable-cert-reload", "--metrics-endpoint-auth=false")))
    text = "\n".join(plan.notes)
    for flag in ("--health-checking", "--enable-pprof", "--refresh-prometheus-metrics-interval",
                 "--model-server-metrics-path", "--lora-info-metric", "--enable-cert-reload"):
        assert flag in text, flag
    assert len(plan.notes) == 6


def test_noted_at_startup(tmp_path: Path) -> None:
    """`epp serve` logs each note before it binds anything (here it then fails to bind
    its gRPC port, held by the test, which ends the run)."""
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "epp.cli", "serve", "--endpoints",
                            "1.2.3.4:5", "--enable-pprof", "--grpc-port", str(port),
                            "--metrics-port", "0", "--grpc-health-port", "0",
                            "--tracing=false", "--metrics-endpoint-auth=false"],
                           capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    assert r.returncode != 0
    assert "--enable-pprof: accepted and ignored" in r.stderr
    assert r.stderr.index("--enable-pprof: accepted and ignored") < r.stderr.index(str(port))


def test_chart_quotes_are_unwrapped() -> None:
    a = parse("--endpoints", "1.2.3.4:5", '--total-queued-requests-metric="sglang:num_queue_reqs"',
              '--model-server-metrics-path="/prometheus/metrics"')
    assert a.total_queued_requests_metric == "sglang:num_queue_reqs"
    assert a.model_server_metrics_path == "/prometheus/metrics"


# ------------------------------------------------------------------------------ logging


@pytest.mark.parametrize("argv, level, fmt", [
    ([], "info", "text"),
    (["-v", "1"], "info", "text"), (["-v", "3"], "info", "text"), (["-v", "4"], "debug", "text"),
    (["--zap-log-level", "debug"], "debug", "text"), (["--zap-log-level", "error"], "error", "text"),
    (["--zap-log-level", "5"], "debug", "text"), (["--zap-log-level", "2", "-v", "5"], "info", "text"),
    (["--log-level", "warning", "--zap-log-level", "debug"], "warning", "text"),
    (["--zap-encoder", "json"], "info", "json"), (["--zap-encoder=console"], "info", "text"),
    (["--zap-devel=false"], "info", "json"), (["--zap-devel"], "info", "text"),
    (["--zap-encoder", "json", "--log-format", "text"], "info", "text"),
])
def test_logging_flags_map_onto_python_logging(argv: list[str], level: str, fmt: str) -> None:
    s = log_settings(parse("--endpoints", "1.2.3.4:5", *argv))
    assert (s.level, s.fmt) == (level, fmt)


def test_time_encodings() -> None:
    t = 1700000000.25
    assert eppl.encode_time(t, None) == eppl.encode_time(t, "epoch") == 1700000000.25
    assert eppl.encode_time(t, "millis") == 1700000000250.0
    assert eppl.encode_time(t, "nanos") == 1700000000250000000
    assert re.fullmatch(r"2023-11-\d\dT\d\d:\d\d:20(Z|[+-]\d\d:\d\d)",
                        str(eppl.encode_time(t, "rfc3339")))
    assert re.fullmatch(r"2023-11-\d\dT\d\d:\d\d:20\.25(Z|[+-]\d\d:\d\d)",
                        str(eppl.encode_time(t, "rfc3339nano")))
    assert re.fullmatch(r"2023-11-\d\dT\d\d:\d\d:20\.250(Z|[+-]\d{4})",
                        str(eppl.encode_time(t, "iso8601")))


def test_stacktrace_level_attaches_the_callers_stack() -> None:
    record = logging.LogRecord("x", logging.ERROR, __file__, 0, "boom", None, None)

    def log_it() -> logging.LogRecord:
        record.lineno = sys._getframe().f_lineno + 1
        eppl.StackTraceFilter(logging.ERROR).filter(record)
        return record

    out = eppl.JsonFormatter("epoch").format(log_it())
    assert '"stacktrace":' in out and "log_it" in out
    low = logging.LogRecord("x", logging.INFO, __file__, 1, "fine", None, None)
    eppl.StackTraceFilter(logging.ERROR).filter(low)
    assert low.stack_info is None


def test_endpoint_target_ports_adds_up_like_an_int_slice() -> None:
    a = parse("--endpoint-selector", "app=vllm", "--endpoint-target-ports", "3000",
              "--endpoint-target-ports=3001,3002")
    assert a.endpoint_target_ports == "3000,3001,3002"
    plan = so.validate(serve_options(a))
    assert isinstance(plan.source, so.KubernetesDiscovery)
    assert plan.source.options.standalone is not None
    assert plan.source.options.standalone.target_ports == (3000, 3001, 3002)
