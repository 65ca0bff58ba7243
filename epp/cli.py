"""Command line: ``epp serve | check-config | sim | demo | bench``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from epp import __version__
from epp.errors import ConfigError

if TYPE_CHECKING:
    from epp.observability.logging import LogSettings
    from epp.server.options import ServeOptions

log = logging.getLogger("epp")


def _setup_logging(level: str, fmt: str = "text") -> None:
    from epp.observability.logging import setup_logging

    setup_logging(level, fmt)


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from epp.server.options import DEFAULT_MAX_BODY

    p = sub.add_parser("serve", help="run the endpoint picker (ext_proc gRPC server)",
                       description="Run the endpoint picker: an Envoy ext_proc gRPC server that "
                       "picks a model-server endpoint for every request.")
    p.add_argument("--grpc-port", type=int, default=9002,
                   help="ext_proc gRPC port: the gateway's ext_proc filter connects here; "
                   "also serves gRPC health (default 9002)")
    p.add_argument("--grpc-health-port", type=int, default=9003,
                   help="gRPC health port: liveness/readiness probes (default 9003)")
    p.add_argument("--metrics-port", type=int, default=9090,
                   help="Prometheus /metrics and /debug/decisions port (default 9090)")
    p.add_argument("--bind-address", default="0.0.0.0", metavar="ADDR",
                   help="address all three ports listen on unless overridden below (default "
                   "0.0.0.0: every interface)")
    p.add_argument("--grpc-bind-address", metavar="ADDR",
                   help="address of the ext_proc port, which routes traffic and should be "
                   "reachable by the gateway only (default: --bind-address)")
    p.add_argument("--grpc-health-bind-address", metavar="ADDR",
                   help="address of the gRPC health port, for the kubelet's probes "
                   "(default: --bind-address)")
    p.add_argument("--metrics-bind-address", metavar="ADDR",
                   help="address of the metrics port (/metrics, /debug/decisions: pool "
                   "state and decisions; see --metrics-endpoint-auth) (default: --bind-address)")
    cfg = p.add_mutually_exclusive_group()
    cfg.add_argument("--config-file", help="EndpointPickerConfig YAML file")
    cfg.add_argument("--config-text", help="EndpointPickerConfig YAML given inline")
    p.add_argument("--strict-config", action="store_true",
                   help="fail on an unknown plugin parameter (default: ignored with a "
                   "warning, as GIE ignores it)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--endpoints", help="static endpoints: ip:port[,ip:port…]")
    src.add_argument("--endpoints-file",
                     help="YAML file of endpoints (and node labels); re-read when it changes")
    p.add_argument("--objectives-file", metavar="FILE",
                   help="YAML file of InferenceObjective and InferenceModelRewrite objects "
                   "(request priorities, model rewrites) for the modes without an "
                   "InferencePool; re-read when it changes. With --pool-name the EPP "
                   "watches these objects in the cluster instead (docs/configuration.md)")
    _add_kubernetes_flags(p)
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="ext_proc front processes around one scheduling core (default 1: "
                   "everything in this process; 0: one per CPU core); see docs/architecture.md")
    p.add_argument("--max-request-headers", type=int, default=100, metavar="N",
                   help="the gateway's request header limit (Envoy's max_headers_count, "
                   "default 100): a request that would exceed it once the EPP adds its "
                   "routing headers is answered 431, where Envoy would fail it with a bare "
                   "500 (0: no check)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY,
                   help=f"reject larger request bodies with 413 (default {DEFAULT_MAX_BODY})")
    p.add_argument("--log-level", default=None,
                   choices=["debug", "info", "warning", "error"],
                   help="log level (default info; per-request lines are logged at debug). "
                   "Wins over GIE's --zap-log-level and -v")
    p.add_argument("--disable-endpoint-subset-filter", type=_go_bool, nargs="?", const=True,
                   default=False, metavar="BOOL",
                   help="ignore the gateway's endpoint subset hint (metadata "
                   "x-gateway-destination-endpoint-subset): pick from the whole pool "
                   "(default false)")
    g = p.add_argument_group("shutdown (see docs/operations.md)")
    g.add_argument("--drain-timeout", type=_duration, default=30.0, metavar="DUR",
                   help="on SIGTERM/SIGINT report NOT_SERVING at once but keep serving "
                   "ext_proc, new streams included, for up to this long; streams still "
                   "running then are cut (default 30s, as llm-d's router; 0: stop at once). "
                   "A second signal stops at once")
    g.add_argument("--drain-quiet-period", type=_duration, default=None, metavar="DUR",
                   help="end the drain early once no ext_proc stream has been in flight for "
                   "this long since the signal (default: --drain-timeout, i.e. serve the "
                   "whole window as llm-d's router does; a short value suits local tools "
                   "and tests, where no gateway needs time to notice)")
    _add_metrics_flags(p)
    _add_observability_flags(p)
    _add_llmd_serving_flags(p)


def _add_llmd_serving_flags(p: argparse.ArgumentParser) -> None:
    """llm-d-router v0.10.0's serving flags (pkg/epp/server/options.go)."""
    g = p.add_argument_group("llm-d-router's serving flags (see docs/configuration.md)")
    g.add_argument("--allow-experimental-plugins", type=_go_bool, nargs="?", const=True,
                   default=False, metavar="BOOL",
                   help="allow plugins of llm-d's Alpha types (e.g. session-affinity-scorer, "
                   "the multicluster-* plugins) in an llm-d document (apiVersion "
                   "llm-d.ai/v1alpha1); without it such a config fails startup, as in "
                   "llm-d (default false)")
    g.add_argument("--emit-endpoint-scores", type=_go_bool, nargs="?", const=True,
                   default=False, metavar="BOOL",
                   help="send the scheduler's weighted score of every candidate endpoint in "
                   "the request-path dynamic metadata: namespace envoy.lb, key "
                   "x-gateway-destination-endpoint-scores (default false)")
    g.add_argument("--enable-grpc-stream-metrics", type=_go_bool, nargs="?", const=True,
                   default=False, metavar="BOOL",
                   help="export llm_d_epp_extproc_streams_inflight, "
                   "llm_d_epp_extproc_stream_duration_seconds and "
                   "llm_d_epp_extproc_streams_total{code} (default false)")
    g.add_argument("--grpc-max-recv-msg-size", metavar="SIZE",
                   help="largest gRPC message the ext_proc server accepts, a Kubernetes "
                   "quantity (10MiB, 25MB); larger ones fail the stream with "
                   "RESOURCE_EXHAUSTED (default: no limit, so that an oversized body is "
                   "answered 413 per --max-request-body-bytes)")
    g.add_argument("--grpc-max-send-msg-size", metavar="SIZE",
                   help="largest gRPC message the ext_proc server sends, a Kubernetes "
                   "quantity (default: no limit)")
    g.add_argument("--metrics-cert-dir", metavar="DIR",
                   help="serve the metrics port over TLS (1.2 or later) with DIR/tls.crt and "
                   "DIR/tls.key; needs --metrics-client-ca-file or --metrics-endpoint-auth "
                   "not false")
    g.add_argument("--metrics-client-ca-file", metavar="FILE",
                   help="with --metrics-cert-dir: require a client certificate verified "
                   "against this PEM CA (mTLS) on the metrics port")
    g.add_argument("--tls-min-version", metavar="VERSION",
                   help="with --secure-serving: the lowest TLS version of the ext_proc port, "
                   "a Go name (VersionTLS10..VersionTLS13); grpcio serves TLS 1.2-1.3 "
                   "only, so VersionTLS12 is the one it can honour (others fail startup)")
    g.add_argument("--tls-cipher-suites", metavar="SUITE[,SUITE…]", action=_Joined,
                   help="with --secure-serving: the TLS 1.2 cipher suites of the ext_proc "
                   "port, Go names (TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, …); TLS 1.3 "
                   "suites are not configurable (applied through gRPC's "
                   "GRPC_SSL_CIPHER_SUITES, which also covers the EPP's gRPC clients)")


def _add_observability_flags(p: argparse.ArgumentParser) -> None:
    from epp.server.options import DEFAULT_METRICS_ENDPOINT_AUTH, DEFAULT_TRACING

    g = p.add_argument_group("observability (see docs/observability.md)")
    g.add_argument("--log-format", default=None, choices=["text", "json"],
                   help="log line format (default text; wins over GIE's --zap-encoder)")
    g.add_argument("--metrics-endpoint-auth", metavar="BOOL|TOKEN_FILE", nargs="?",
                   const="true", default=None,
                   help="protect /metrics and /debug/*. true (GIE's meaning): the request's "
                   "bearer token must pass a Kubernetes TokenReview and its user a "
                   "SubjectAccessReview for the path (needs a Kubernetes endpoint source); "
                   "false: no auth; a file: the one bearer token it holds "
                   f"(default {str(DEFAULT_METRICS_ENDPOINT_AUTH).lower()}; GIE: true)")
    g.add_argument("--enable-explain-header", action="store_true",
                   help="answer a client's 'x-epp-explain: true' with the decision (per-profile, "
                   "per-plugin scores, dropped endpoints) as JSON in the 'x-epp-explain' "
                   "response header (default off: clients never see it)")
    g.add_argument("--tracing", type=_go_bool, nargs="?", const=True, default=None,
                   metavar="BOOL",
                   help="OpenTelemetry tracing: a span per request with scheduling and plugin "
                   "child spans, traceparent propagated upstream; exporter from OTEL_* "
                   "environment (needs pip install 'epp[tracing]'; default "
                   f"{str(DEFAULT_TRACING).lower()}; GIE: true)")
    g.add_argument("--explain-history", type=int, default=0, metavar="N",
                   help="keep the last N decisions, explained, for GET /debug/decisions on the "
                   "metrics port (default 0: off)")
    _add_gie_logging_flags(p)
    g = p.add_argument_group("GIE flags with no counterpart here: accepted, and logged at "
                             "startup as changing nothing (docs/configuration.md)")
    g.add_argument("--health-checking", type=_go_bool, nargs="?", const=True, default=None,
                   metavar="BOOL", help="GIE: gRPC health on the ext_proc port; here it is "
                   "always there (GIE's default: false)")
    g.add_argument("--enable-pprof", type=_go_bool, nargs="?", const=True, default=None,
                   metavar="BOOL", help="GIE: Go pprof handlers on the metrics port; none "
                   "here (GIE's default: true)")
    g.add_argument("--refresh-prometheus-metrics-interval", type=_duration, default=None,
                   metavar="DUR", help="GIE: how often its inference_pool_* gauges are "
                   "recomputed; here they are computed at every scrape (GIE's default: 5s)")


def _add_gie_logging_flags(p: argparse.ArgumentParser) -> None:
    """GIE's logging flags (-v and controller-runtime's --zap-*), mapped onto Python
    logging by epp.observability.logging.resolve."""
    from epp.observability import logging as eppl

    g = p.add_argument_group("GIE's logging flags (mapped onto --log-level and "
                             "--log-format: docs/configuration.md)")
    g.add_argument("-v", "--v", dest="verbosity", type=int, default=None, metavar="N",
                   help=f"GIE's log verbosity (GIE's default {eppl.GIE_DEFAULT_VERBOSITY}): "
                   f"{eppl.GIE_DEBUG_VERBOSITY} or more means --log-level debug, less means "
                   "info")
    g.add_argument("--zap-log-level", type=_parsed(eppl.parse_zap_log_level), default=None,
                   metavar="LEVEL", help="debug, info, error, or an integer N > 0 read as -v N "
                   "(wins over -v)")
    g.add_argument("--zap-encoder", type=_parsed(eppl.parse_zap_encoder), default=None,
                   metavar="ENC", help="json or console: --log-format json or text")
    g.add_argument("--zap-devel", type=_go_bool, nargs="?", const=True, default=None,
                   metavar="BOOL", help="zap's development mode; false (production) means "
                   "--log-format json unless a format is given (GIE's default: true)")
    g.add_argument("--zap-stacktrace-level", type=_parsed(eppl.parse_zap_stacktrace_level),
                   default=None, metavar="LEVEL", help="info, error or panic: records at or "
                   "above it carry the stack of the logging call (default: none)")
    g.add_argument("--zap-time-encoding", type=_parsed(eppl.parse_zap_time_encoding),
                   default=None, metavar="ENC", help="epoch, millis, nanos, iso8601, rfc3339 "
                   "or rfc3339nano: the JSON ts field and the text line's time (default: "
                   "epoch seconds in JSON, local time in text)")


def _parsed(parse: Callable[[str], str]) -> Callable[[str], str]:
    """argparse type from a parser raising ValueError with the whole message."""

    def convert(value: str) -> str:
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _add_kubernetes_flags(p: argparse.ArgumentParser) -> None:
    """Kubernetes discovery and leader election; names follow GIE's EPP flags."""
    from epp import keys
    from epp.server.options import DEFAULT_SECURE_SERVING

    g = p.add_argument_group("Kubernetes (see docs/kubernetes.md)")
    g.add_argument("--pool-name", help="InferencePool to serve: watch it and the Pods it "
                   "selects (in standalone mode: only names the leader-election Lease)")
    g.add_argument("--pool-namespace", help="namespace of the pool and its Pods (default: "
                   "$NAMESPACE, else 'default')")
    g.add_argument("--pool-group", default=keys.K8S_POOL_GROUP,
                   choices=[keys.K8S_POOL_GROUP, keys.K8S_POOL_GROUP_ALPHA],
                   help=f"API group of the InferencePool (default {keys.K8S_POOL_GROUP}: v1)")
    g.add_argument("--endpoint-selector", metavar="K=V[,K=V…]",
                   help="standalone mode, no InferencePool: select model-server Pods by "
                   "these labels (needs --endpoint-target-ports)")
    g.add_argument("--endpoint-target-ports", metavar="PORT[,PORT…]", action=_Joined,
                   help="standalone mode: the Pods' serving ports, one endpoint per port "
                   "(repeating the flag adds ports, as GIE's int slice)")
    g.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig file (default: the "
                   "in-cluster service account, else $KUBECONFIG, else ~/.kube/config)")
    g.add_argument("--no-node-labels", dest="watch_nodes", action="store_false",
                   help="do not watch Nodes for topology labels (no cluster-scoped RBAC "
                   "needed)")
    g.add_argument("--secure-serving", type=_go_bool, nargs="?", const=True, default=None,
                   metavar="BOOL", help="serve ext_proc over TLS, as GIE's EPP does and "
                   "gateways built for it expect (default "
                   f"{str(DEFAULT_SECURE_SERVING).lower()}; GIE: true; the deploy/ manifests "
                   "set it)")
    g.add_argument("--cert-path", metavar="DIR", help="with --secure-serving: directory "
                   "holding tls.crt and tls.key (default: a self-signed certificate)")
    g.add_argument("--enable-cert-reload", type=_go_bool, nargs="?", const=True,
                   default=False, metavar="BOOL", help="with --cert-path: serve a renewed "
                   "tls.crt/tls.key to new connections (default false)")
    g.add_argument("--ha-enable-leader-election", type=_go_bool, nargs="?", const=True,
                   default=False, metavar="BOOL",
                   help="active-passive replicas: only the holder of the pool's Lease "
                   "reports ready (default false)")
    g.add_argument("--ha-lease-duration", type=_duration, default=15.0, metavar="DUR",
                   help="leader election: how long a Lease lasts unrenewed (default 15s)")
    g.add_argument("--ha-renew-deadline", type=_duration, default=10.0, metavar="DUR",
                   help="leader election: the leader steps down after failing to renew "
                   "for this long (default 10s)")
    g.add_argument("--ha-retry-period", type=_duration, default=2.0, metavar="DUR",
                   help="leader election: how often to try to acquire or renew (default 2s)")


def _duration(value: str) -> float:
    """argparse type: a Go-style duration ('50ms', '2s') or a number of seconds."""
    from epp.framework.params import parse_duration

    try:
        text: object = float(value)
    except ValueError:
        text = value
    try:
        return parse_duration(text, "duration")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("duration: ")) from None


class _Given(argparse._StoreAction):
    """argparse's "store", also recording the flag in ``given_flags`` (GIE's deprecated
    flags are noted at startup when given, whatever their value)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        namespace.given_flags = (*getattr(namespace, "given_flags", ()),
                                 self.option_strings[0])


class _Joined(argparse.Action):
    """A comma-separated list flag that, given again, adds to the list (pflag's slices)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if before is None else f"{before},{values}")


def _unquoted(value: str) -> str:
    """A value with one pair of surrounding double quotes removed: GIE's Helm chart writes
    ``--total-queued-requests-metric="sglang:num_queue_reqs"`` as one container arg, so the
    quotes reach the program."""
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def _go_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "t", "true", "yes"):
        return True
    if v in ("0", "f", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _add_metrics_flags(p: argparse.ArgumentParser) -> None:
    """Model-server metrics scraping; names and syntax follow GIE's EPP flags."""
    g = p.add_argument_group("model-server metrics (see docs/configuration.md)")
    g.add_argument("--refresh-metrics-interval", type=_duration, default=0.05, metavar="DUR",
                   help="scrape each endpoint's metrics this often (default 50ms)")
    g.add_argument("--metrics-staleness-threshold", type=_duration, default=2.0, metavar="DUR",
                   help="mark an endpoint's metrics stale when its last successful scrape "
                   "is older than this (default 2s)")
    g.add_argument("--metrics-scrape-timeout", type=_duration, default=1.0, metavar="DUR",
                   help="per-poll timeout (default 1s)")
    g.add_argument("--metrics-scrape-concurrency", type=int, default=64, metavar="N",
                   help="at most N scrapes in flight at once (default 64)")
    g.add_argument("--metrics-max-loop-lag", type=_duration, default=0.003, metavar="DUR",
                   help="stretch the scrape interval while the event loop's p90 lag is "
                   "above this (default 3ms; 0 disables)")
    g.add_argument("--model-server-metrics-scheme", default="http", choices=["http", "https"],
                   action=_Given,
                   help="scheme for scraping (default http)")
    g.add_argument("--model-server-metrics-path", default="/metrics", type=_unquoted,
                   action=_Given,
                   help="path for scraping (default /metrics)")
    g.add_argument("--model-server-metrics-port", type=int, default=0, metavar="PORT",
                   action=_Given,
                   help="port for scraping (default 0: the endpoint's own port)")
    g.add_argument("--model-server-metrics-max-bytes", type=int, default=4 << 20,
                   metavar="BYTES",
                   help="a larger /metrics body fails the scrape; the read stops there "
                   "(default 4194304, 4 MiB)")
    g.add_argument("--model-server-metrics-https-insecure-skip-verify", type=_go_bool,
                   nargs="?", const=True, default=True, metavar="BOOL", action=_Given,
                   help="with https, do not verify the server certificate (default true)")
    g.add_argument("--no-metrics-scraping", dest="scrape_metrics", action="store_false",
                   help="do not scrape model servers (scorers then see no load signals)")
    for flag, what in (
        ("--total-queued-requests-metric", "waiting requests"),
        ("--total-running-requests-metric", "running requests"),
        ("--kv-cache-usage-percentage-metric", "KV-cache usage (0..1)"),
        ("--lora-info-metric", "LoRA adapters info"),
        ("--cache-info-metric", "cache config info (block size / block count labels)"),
    ):
        g.add_argument(flag, default=None, metavar="SPEC", type=_unquoted, action=_Given,
                       help=f"metric for {what} of the default engine (vllm), as "
                       "name or name{label=value,…}; '' disables it (default: built-in)")


def _add_check_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("check-config", help="validate an EndpointPickerConfig file and exit",
                       description="Parse and build an EndpointPickerConfig (every plugin and "
                       "parameter) exactly as `epp serve` would; exit 0 when valid.")
    p.add_argument("file", help="EndpointPickerConfig YAML file")
    p.add_argument("--strict", action="store_true",
                   help="fail on an unknown plugin parameter (default: ignored with a "
                   "warning, as GIE and `epp serve` ignore it)")


def _add_envoy_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from epp.stack.envoy_config import add_arguments

    p = sub.add_parser("envoy-config", help="print a ready-to-run Envoy configuration that "
                       "sends requests through an EPP",
                       description="Print an Envoy bootstrap (YAML) with one HTTP listener "
                       "whose requests go through the EPP over ext_proc and are routed to "
                       "the pod it picks — the configuration `epp demo` runs. Run it with "
                       "`envoy -c FILE`.")
    add_arguments(p)


def _add_sim(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub.add_parser("sim", add_help=False, help="run simulated OpenAI-compatible model servers "
                   "(see `epp sim --help`)")


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run the local stack: Envoy + simulated model servers + "
                       "the EPP, with a short demo load",
                       description="Start real Envoy, simulated model servers and the EPP on "
                       "free local ports, run a realistic chat workload through the EPP and "
                       "through plain round robin, and print a side-by-side summary. Ctrl-C "
                       "(or SIGTERM, SIGHUP) stops everything.")
    p.add_argument("--servers", type=int, default=4, help="simulated model servers (default 4)")
    p.add_argument("--duration", type=float, default=15.0,
                   help="seconds of load per gateway (default 15)")
    p.add_argument("--requests", type=int, default=5000,
                   help="at most this many requests per gateway (default 5000)")
    p.add_argument("--concurrency", type=int, default=16,
                   help="concurrent users (default 16)")
    p.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    p.add_argument("--config-file", help="EndpointPickerConfig for the EPP (default: built-in)")
    p.add_argument("--body-mode", default="FULL_DUPLEX_STREAMED",
                   choices=["FULL_DUPLEX_STREAMED", "BUFFERED"],
                   help="Envoy ext_proc request body mode (default FULL_DUPLEX_STREAMED)")
    p.add_argument("--response-path", default="lean", choices=["lean", "inline", "observer"],
                   help="the gateway shape (docs/architecture.md, \"Gateway shapes\"). lean "
                   "(default): the EPP gets the response headers, never a response body "
                   "chunk (no per-request token usage, no model-name rewrite-back); inline: "
                   "one ext_proc filter that also passes the response through the EPP "
                   "(GIE's shape); observer: a routing filter plus an observability-mode "
                   "filter, the EPP off the response path")
    p.add_argument("--sim-args", default="",
                   help="extra arguments for every `epp sim` process, e.g. \"--max-num-seqs 8\"")
    p.add_argument("--no-compare", dest="compare", action="store_false",
                   help="skip the round-robin baseline")
    p.add_argument("--keep-running", action="store_true",
                   help="after the load, keep the stack up until Ctrl-C")
    p.add_argument("--pd", action="store_true",
                   help="prefill/decode disaggregation: two racks of 2 prefill + 2 decode pods "
                   "with Grove labels and node topology, the EPP with config/pd-grove.yaml "
                   "(topology-aware pairing); the summary adds the share of same-rack pairs "
                   "(--servers and --no-compare do not apply)")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from epp.bench.overload import add_arguments as add_overload_arguments
    from epp.bench.quality import add_arguments
    from epp.bench.sweep import add_arguments as add_sweep_arguments

    p = sub.add_parser("bench", help="routing quality: one workload through the EPP and "
                       "other routers, side by side (see docs/benchmarks.md)",
                       description="Play one open-loop workload (Poisson arrivals) through "
                       "this EPP behind Envoy, Envoy round robin, Envoy random and "
                       "sglang-router cache_aware, each with fresh simulated pods; report "
                       "TTFT, latency, prefix-cache hit rate against the offline ceiling, "
                       "throughput, errors and per-pod share (table, JSON, PNG). "
                       "--workload overload instead bursts two tenants to 2x the pods' "
                       "capacity through the EPP with flow control, without it (legacy "
                       "admission) and round robin: the interactive tenant's TTFT, the "
                       "batch tenant's dispatched/queued/shed requests, fairness between "
                       "equal tenants, and every request accounted for.")
    add_arguments(p)
    add_overload_arguments(p)
    add_sweep_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epp", description="Endpoint picker for LLM "
                                     "inference gateways (Envoy ext_proc).")
    parser.add_argument("--version", action="version", version=f"epp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_check_config(sub)
    _add_sim(sub)
    _add_demo(sub)
    _add_envoy_config(sub)
    _add_bench(sub)
    return parser


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """``epp serve``'s parsed flags as grouped options (checked when the server starts:
    epp.server.options.validate)."""
    from epp.datalayer.engines import MappingOverrides
    from epp.datalayer.scraper import ScrapeOptions
    from epp.server import options as so
    from epp.server.llmd_flags import split_cipher_flag

    log = log_settings(args)
    return so.ServeOptions(
        listen=so.ListenOptions(
            grpc_port=args.grpc_port, grpc_health_port=args.grpc_health_port,
            metrics_port=args.metrics_port, bind_address=args.bind_address,
            grpc_bind_address=args.grpc_bind_address,
            grpc_health_bind_address=args.grpc_health_bind_address,
            metrics_bind_address=args.metrics_bind_address),
        config=so.ConfigOptions(file=args.config_file, text=args.config_text,
                                strict=args.strict_config,
                                allow_experimental_plugins=args.allow_experimental_plugins),
        static=so.StaticSourceOptions(endpoints=args.endpoints,
                                      endpoints_file=args.endpoints_file),
        objectives=so.ObjectivesOptions(file=args.objectives_file),
        kubernetes=so.KubernetesSourceOptions(
            pool_name=args.pool_name, pool_namespace=args.pool_namespace,
            pool_group=args.pool_group, endpoint_selector=args.endpoint_selector,
            endpoint_target_ports=args.endpoint_target_ports, kubeconfig=args.kubeconfig,
            watch_nodes=args.watch_nodes),
        tls=so.TlsOptions(secure_serving=args.secure_serving, cert_path=args.cert_path,
                          enable_cert_reload=args.enable_cert_reload,
                          tls_min_version=args.tls_min_version,
                          tls_cipher_suites=split_cipher_flag(args.tls_cipher_suites)),
        ha=so.HaOptions(enable_leader_election=args.ha_enable_leader_election,
                        lease_duration_s=args.ha_lease_duration,
                        renew_deadline_s=args.ha_renew_deadline,
                        retry_period_s=args.ha_retry_period),
        scraping=so.ScrapingOptions(
            enabled=args.scrape_metrics,
            scrape=ScrapeOptions(
                interval_s=args.refresh_metrics_interval,
                timeout_s=args.metrics_scrape_timeout,
                staleness_threshold_s=args.metrics_staleness_threshold,
                scheme=args.model_server_metrics_scheme,
                path=args.model_server_metrics_path,
                port=args.model_server_metrics_port or None,
                insecure_skip_verify=args.model_server_metrics_https_insecure_skip_verify,
                max_concurrency=args.metrics_scrape_concurrency,
                max_body_bytes=args.model_server_metrics_max_bytes,
                max_loop_lag_s=args.metrics_max_loop_lag or None,
            ),
            metric_overrides=MappingOverrides(
                total_queued_requests=args.total_queued_requests_metric,
                total_running_requests=args.total_running_requests_metric,
                kv_cache_usage_percentage=args.kv_cache_usage_percentage_metric,
                lora_info=args.lora_info_metric,
                cache_info=args.cache_info_metric,
            )),
        observability=so.ObservabilityOptions(
            enable_explain_header=args.enable_explain_header,
            explain_history=args.explain_history, metrics_auth=args.metrics_endpoint_auth,
            tracing=args.tracing, log_level=log.level, log_format=log.fmt,
            metrics_cert_dir=args.metrics_cert_dir,
            metrics_client_ca_file=args.metrics_client_ca_file),
        limits=so.RequestLimits(max_request_body_bytes=args.max_request_body_bytes,
                                max_request_headers=args.max_request_headers),
        workers=so.WorkerOptions(count=args.workers),
        drain=so.DrainOptions(timeout_s=args.drain_timeout, quiet_s=args.drain_quiet_period),
        routing=so.RoutingOptions(
            disable_endpoint_subset_filter=args.disable_endpoint_subset_filter,
            emit_endpoint_scores=args.emit_endpoint_scores),
        grpc=so.GrpcOptions(max_recv_msg_size=args.grpc_max_recv_msg_size,
                            max_send_msg_size=args.grpc_max_send_msg_size,
                            enable_stream_metrics=args.enable_grpc_stream_metrics),
        gie_only=so.GieOnlyOptions(
            health_checking=args.health_checking, enable_pprof=args.enable_pprof,
            refresh_prometheus_metrics_interval_s=args.refresh_prometheus_metrics_interval,
            deprecated=tuple(f for f in so.DEPRECATED_FLAGS if _given(args, f))),
    )


def log_settings(args: argparse.Namespace) -> LogSettings:
    """``epp serve``'s logging, from its own flags and GIE's (-v, --zap-*)."""
    from epp.observability.logging import resolve

    return resolve(log_level=args.log_level, log_format=args.log_format,
                   verbosity=args.verbosity, zap_log_level=args.zap_log_level,
                   zap_encoder=args.zap_encoder, zap_devel=args.zap_devel,
                   zap_stacktrace_level=args.zap_stacktrace_level,
                   zap_time_encoding=args.zap_time_encoding)


def _given(args: argparse.Namespace, flag: str) -> bool:
    """Whether ``flag`` (one recorded by :class:`_Given`) was on the command line."""
    return flag in getattr(args, "given_flags", ())


def _serve(args: argparse.Namespace) -> int:
    from epp.observability.logging import setup
    from epp.server.app import StartupError, serve_forever

    setup(log_settings(args))
    opts = serve_options(args)

    async def main() -> None:
        from epp.server.drain import install_shutdown_signals

        # First SIGTERM/SIGINT: drain (NOT_SERVING, keep serving up to --drain-timeout);
        # a second one: stop at once.
        drain, stop_now = asyncio.Event(), asyncio.Event()
        install_shutdown_signals(drain, stop_now)
        await serve_forever(opts, drain, stop_now)

    from epp.server.loop import run as run_loop

    try:
        run_loop(main())
    except (ConfigError, StartupError) as e:
        print(f"epp: error: {e}", file=sys.stderr)
        return 1
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from epp.config.loader import build, load_config_file

    logging.getLogger("epp.framework.params").addHandler(logging.NullHandler())  # printed below
    try:
        built = build(load_config_file(args.file), strict=args.strict)
    except ConfigError as e:
        print(f"epp: error: {e}", file=sys.stderr)
        return 1
    for warning in built.warnings:
        print(f"epp: warning: {warning}", file=sys.stderr)
    from epp.framework.registry import LLMD_ALPHA_TYPES

    for name, plugin in sorted(built.plugins.items()):  # llm-d's ValidatePluginStability
        if built.config.llmd_document and getattr(plugin, "type_name", "") in LLMD_ALPHA_TYPES:
            print(f"epp: note: plugin '{name}' (type: '{plugin.type_name}') has llm-d's Alpha "
                  "stability level: epp serve needs --allow-experimental-plugins",
                  file=sys.stderr)
    for name, prof in built.scheduler.profiles.items():
        parts = [f"filter {f.name}" for f in prof.filters]
        parts += [f"scorer {s.name} (weight {w:g})" for s, w in prof.scorers]
        parts.append(f"picker {prof.picker.name}")
        print(f"profile {name}: " + ", ".join(parts))
    print(f"profile handler: {built.scheduler.handler.name}")
    if built.discovery is not None:  # llm-d's dataLayer.discovery: the endpoint source
        print(f"discovery: {built.discovery.name} ({built.discovery.type_name})")
    if built.saturation_detector is not None:
        print(f"saturation detector: {built.saturation_detector.name}")
    if built.data_layer is None:
        print("data layer: legacy metrics (enableLegacyMetrics)")
    else:
        for src in built.data_layer.sources:
            exts = ", ".join(e.name for e in src.extractors) or "no extractor"
            print(f"data source {src.source.name} -> {exts}")
    if built.parser_plugin is not None:
        print(f"parser: {built.parser_plugin.name}")
    for plugin in built.plugins.values():  # e.g. the precise prefix index's memory bound
        summary = getattr(plugin, "config_summary", None)
        if callable(summary):
            print(summary())
    fc = built.flow_control
    if fc is not None:
        bands = ", ".join(
            f"{b.priority} ({b.fairness_policy.name}, {b.ordering_policy.name})"
            for b in sorted(fc.priority_bands.values(), key=lambda b: -b.priority))
        d = fc.default_priority_band
        print(f"flow control: bands {bands or '-'}; other priorities "
              f"({d.fairness_policy.name}, {d.ordering_policy.name}); usage limit "
              f"{fc.usage_limit_policy.name}; maxRequests {fc.max_requests or 'unlimited'}, "
              f"maxBytes {fc.max_bytes or 'unlimited'}, TTL "
              f"{f'{fc.default_request_ttl:g}s' if fc.default_request_ttl else 'none'}")
    print(f"{args.file}: OK")
    return 0


def _apply_cipher_suites(argv: list[str]) -> None:
    """``serve --tls-cipher-suites``: gRPC reads its cipher list (GRPC_SSL_CIPHER_SUITES)
    once, when it is imported — which building the parser does — so it is set first."""
    if not any(a.startswith("--tls-cipher-suites") for a in argv):
        return
    from epp.server.llmd_flags import apply_cipher_suites_env, split_cipher_flag

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--tls-cipher-suites", action="append")
    pre.add_argument("--secure-serving", type=_go_bool, nargs="?", const=True)
    known, _ = pre.parse_known_args(argv)
    # Not with --secure-serving=false: then they change nothing (noted at startup). The
    # default (None) is on; epp.server.options is not imported here, as it loads gRPC.
    if known.secure_serving is not False:
        apply_cipher_suites_env(split_cipher_flag(known.tls_cipher_suites))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        from epp.sim.server import main as sim_main

        return sim_main(argv[1:]) or 0
    if argv and argv[0] == "serve":
        try:
            _apply_cipher_suites(argv[1:])
        except ConfigError as e:
            print(f"epp: error: {e}", file=sys.stderr)
            return 1
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        if not (args.endpoints or args.endpoints_file or args.pool_name
                or args.endpoint_selector or args.config_file or args.config_text):
            parser.error("serve: give an endpoint source: --endpoints, --endpoints-file, "
                         "--pool-name, --endpoint-selector, or a config (--config-file) "
                         "whose dataLayer.discovery names a file-discovery plugin")
        return _serve(args)
    if args.command == "check-config":
        return _check_config(args)
    if args.command == "bench":
        _setup_logging("warning")
        if args.sweep or args.held_out or args.shape_seeds:
            from epp.bench.sweep import main as sweep_main

            return sweep_main(args)
        if args.workload == "overload":
            from epp.bench.overload import main as overload_main

            return overload_main(args)
        from epp.bench.quality import main as bench_main

        return bench_main(args)
    if args.command == "envoy-config":
        from epp.stack.envoy_config import main as envoy_config_main

        return envoy_config_main(args)
    if args.command == "demo":
        from epp.stack.demo import run_demo

        _setup_logging(args.log_level)
        return run_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
