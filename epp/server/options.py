"""``epp serve``'s options, grouped, and their validation — the one place that checks them.

:class:`ServeOptions` holds what the caller asked for, one frozen group per concern (the
command line builds it from argparse, epp/cli.py; tests build it directly). Nothing
checks a group when it is made: :func:`validate` checks them all, in a fixed order, and
turns them into a :class:`ServePlan` — the resolved values the server runs with (the one
endpoint source, parsed; the leader election; the metrics auth; TLS and tracing with the
defaults applied; the worker count; the notes to log at startup). Every
error is a :class:`~epp.errors.ConfigError` whose message names the flag, and
``epp serve`` prints it as ``epp: error: <message>`` (exit status 1).

What validation does not cover, because it needs more than the options: the
EndpointPickerConfig (epp.config.loader, built next), the kubeconfig, the endpoints file
and the objectives file (read at startup, before any port is bound), the TLS key pair
(read when the ext_proc port is bound), and the ports themselves (epp/server/listeners.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from epp import keys
from epp.datalayer.engines import EngineMappings, MappingOverrides
from epp.datalayer.scraper import ScrapeOptions
from epp.discovery.kubernetes import (
    KubernetesOptions,
    PoolSpec,
    parse_selector,
    parse_target_ports,
    resolve_namespace,
)
from epp.discovery.reflector import ReflectorOptions
from epp.discovery.static import parse_endpoints_arg
from epp.errors import ConfigError
from epp.handlers.extproc import DEFAULT_MAX_HEADERS
from epp.scheduling.types import Endpoint
from epp.server.drain import DEFAULT_DRAIN_TIMEOUT_S
from epp.server.leader import LeaderElectionOptions, default_identity, lease_name
from epp.server.llmd_flags import (
    MetricsTls,
    check_tls_min_version,
    cipher_suite_list,
    metrics_tls,
    parse_message_size,
)

DEFAULT_MAX_BODY = 64 << 20

# GIE v1.5.0's EPP defaults --secure-serving, --tracing and --metrics-endpoint-auth to
# true. Each is this EPP's default through one constant here. --secure-serving is on, as
# in GIE (TLS on ext_proc, self-signed without --cert-path): whatever starts `epp serve`
# for a plaintext gateway passes --secure-serving=false (epp/stack, bench/ and the tests
# do: epp.stack.procs.LOCAL_SERVE_FLAGS, which also turns the other two off). --tracing
# on exports as GIE does (epp/observability/tracing.py); when OpenTelemetry is not
# installed the default is skipped with a warning. --metrics-endpoint-auth on reviews
# bearer tokens with the Kubernetes API; without a Kubernetes endpoint source there is
# none, and /metrics stays open (a startup note says so). The flags have GIE's meaning.
DEFAULT_SECURE_SERVING: Final = True  # GIE: true (self-signed without --cert-path)
DEFAULT_TRACING: Final = True  # GIE: true
DEFAULT_METRICS_ENDPOINT_AUTH: Final = True  # GIE: true (TokenReview/SubjectAccessReview)

_FALSE = ("false", "0", "f", "no")
_TRUE = ("true", "1", "t", "yes")

# ----------------------------------------------------------------------------- the groups


@dataclass(frozen=True)
class ListenOptions:
    """The three ports and the addresses they listen on (docs/operations.md, "Binding")."""

    grpc_port: int = 9002  # ext_proc (and gRPC health)
    grpc_health_port: int = 9003  # gRPC health, for the probes
    metrics_port: int = 9090  # Prometheus /metrics and /debug/*
    bind_address: str = "0.0.0.0"  # the default for the three below
    grpc_bind_address: str | None = None
    grpc_health_bind_address: str | None = None
    metrics_bind_address: str | None = None

    @property
    def grpc_address(self) -> str:
        return self.grpc_bind_address or self.bind_address

    @property
    def health_address(self) -> str:
        return self.grpc_health_bind_address or self.bind_address

    @property
    def metrics_address(self) -> str:
        return self.metrics_bind_address or self.bind_address


@dataclass(frozen=True)
class ConfigOptions:
    """The EndpointPickerConfig: a file, inline text, or (neither) the built-in default."""

    file: str | None = None
    text: str | None = None
    strict: bool = False  # --strict-config: an unknown plugin parameter fails startup
    # llm-d's --allow-experimental-plugins: without it a plugin of an Alpha type (llm-d's
    # StabilityAlpha, epp.framework.registry.LLMD_ALPHA_TYPES) fails startup.
    allow_experimental_plugins: bool = False


@dataclass(frozen=True)
class StaticSourceOptions:
    """Static endpoint sources: ``--endpoints`` or ``--endpoints-file`` (polled)."""

    endpoints: str | None = None  # ip:port[,ip:port…]
    endpoints_file: str | None = None
    poll_interval_s: float = 0.5


@dataclass(frozen=True)
class ObjectivesOptions:
    """``--objectives-file``: InferenceObjectives and InferenceModelRewrites for the modes
    that watch no CRDs (epp/discovery/objectives_file.py); polled like the endpoints file."""

    file: str | None = None
    poll_interval_s: float = 0.5


@dataclass(frozen=True)
class KubernetesSourceOptions:
    """Kubernetes discovery (docs/kubernetes.md): an InferencePool, or standalone Pods
    selected by labels."""

    pool_name: str | None = None
    pool_namespace: str | None = None
    pool_group: str = keys.K8S_POOL_GROUP
    endpoint_selector: str | None = None  # k=v[,k=v…]: standalone mode
    endpoint_target_ports: str | None = None  # PORT[,PORT…]: standalone mode
    kubeconfig: str | None = None
    watch_nodes: bool = True
    debounce_s: float = 0.05
    reflector: ReflectorOptions = field(default_factory=ReflectorOptions)


@dataclass(frozen=True)
class TlsOptions:
    """TLS on the ext_proc port (epp/server/tls.py)."""

    secure_serving: bool | None = None  # None: DEFAULT_SECURE_SERVING
    cert_path: str | None = None  # tls.crt and tls.key; None: self-signed
    enable_cert_reload: bool = False  # re-read cert_path's pair when it changes
    # llm-d's --tls-min-version (Go names; grpcio serves VersionTLS12 only, see
    # epp/server/llmd_flags.py) and --tls-cipher-suites (Go names, TLS 1.2 suites).
    tls_min_version: str | None = None
    tls_cipher_suites: tuple[str, ...] = ()


@dataclass(frozen=True)
class HaOptions:
    """Active-passive replicas: leader election on the pool's Lease; client-go's timings."""

    enable_leader_election: bool = False
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0


@dataclass(frozen=True)
class ScrapingOptions:
    """Model-server metrics scraping (docs/configuration.md)."""

    enabled: bool = True
    scrape: ScrapeOptions = field(default_factory=ScrapeOptions)
    metric_overrides: MappingOverrides = field(default_factory=MappingOverrides)


@dataclass(frozen=True)
class ObservabilityOptions:
    """docs/observability.md."""

    enable_explain_header: bool = False
    explain_history: int = 0  # decisions kept for /debug/decisions (0: off)
    # --metrics-endpoint-auth: GIE's boolean ("true": Kubernetes TokenReview and
    # SubjectAccessReview; "false": none), or this EPP's form, a file holding the one
    # bearer token required on /metrics and /debug/*. None: DEFAULT_METRICS_ENDPOINT_AUTH.
    metrics_auth: str | None = None
    tracing: bool | None = None  # None: DEFAULT_TRACING (off if OpenTelemetry is missing)
    log_level: str = "info"  # the --workers fronts log at this level too
    log_format: str = "text"  # and in this format
    # llm-d's --metrics-cert-dir (TLS on the metrics port: tls.crt, tls.key) and
    # --metrics-client-ca-file (with it, a verified client certificate is required).
    metrics_cert_dir: str | None = None
    metrics_client_ca_file: str | None = None


@dataclass(frozen=True)
class RequestLimits:
    max_request_body_bytes: int = DEFAULT_MAX_BODY
    # The gateway's request header limit (Envoy's max_headers_count); 0 = no check.
    max_request_headers: int = DEFAULT_MAX_HEADERS


@dataclass(frozen=True)
class RoutingOptions:
    """How candidates are chosen before scheduling."""

    # GIE's --disable-endpoint-subset-filter: ignore Envoy's subset hint
    # (envoy.lb.subset_hint / x-gateway-destination-endpoint-subset), pick from the pool.
    disable_endpoint_subset_filter: bool = False
    # llm-d's --emit-endpoint-scores: the primary profile's weighted score of every
    # candidate in the request-path metadata (envoy.lb, x-gateway-destination-endpoint-scores).
    emit_endpoint_scores: bool = False


@dataclass(frozen=True)
class GrpcOptions:
    """llm-d's ext_proc gRPC server flags (pkg/epp/server/options.go, runserver.go)."""

    max_recv_msg_size: str | None = None  # a Kubernetes quantity (10MiB, 25MB); None: unset
    max_send_msg_size: str | None = None
    enable_stream_metrics: bool = False  # --enable-grpc-stream-metrics


@dataclass(frozen=True)
class GieOnlyOptions:
    """GIE flags for what this EPP has no counterpart of: accepted, so that GIE's command
    lines run unchanged, and each one given is logged at startup with the reason it
    changes nothing here (docs/configuration.md, "GIE's flags"). None: not given."""

    health_checking: bool | None = None
    enable_pprof: bool | None = None
    refresh_prometheus_metrics_interval_s: float | None = None
    deprecated: tuple[str, ...] = ()  # flags GIE v1.5.0 deprecates that were given


@dataclass(frozen=True)
class WorkerOptions:
    """Protocol-front processes around this scheduling core (epp/server/workers.py)."""

    count: int = 1  # 1: everything in this process; 0: one per CPU core


@dataclass(frozen=True)
class DrainOptions:
    """Shutdown (epp/server/drain.py): serve ext_proc for up to ``timeout_s`` after the
    first SIGTERM, less once no stream has been in flight for the quiet period."""

    timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    quiet_s: float | None = None  # None: the whole window (``timeout_s``)

    @property
    def quiet_period_s(self) -> float:
        return self.timeout_s if self.quiet_s is None else self.quiet_s


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``epp serve`` takes, by concern. Checked by :func:`validate`."""

    listen: ListenOptions = field(default_factory=ListenOptions)
    config: ConfigOptions = field(default_factory=ConfigOptions)
    static: StaticSourceOptions = field(default_factory=StaticSourceOptions)
    kubernetes: KubernetesSourceOptions = field(default_factory=KubernetesSourceOptions)
    objectives: ObjectivesOptions = field(default_factory=ObjectivesOptions)
    tls: TlsOptions = field(default_factory=TlsOptions)
    ha: HaOptions = field(default_factory=HaOptions)
    scraping: ScrapingOptions = field(default_factory=ScrapingOptions)
    observability: ObservabilityOptions = field(default_factory=ObservabilityOptions)
    limits: RequestLimits = field(default_factory=RequestLimits)
    workers: WorkerOptions = field(default_factory=WorkerOptions)
    drain: DrainOptions = field(default_factory=DrainOptions)
    routing: RoutingOptions = field(default_factory=RoutingOptions)
    grpc: GrpcOptions = field(default_factory=GrpcOptions)
    gie_only: GieOnlyOptions = field(default_factory=GieOnlyOptions)


# ------------------------------------------------------------------- the validated plan


@dataclass(frozen=True)
class StaticEndpoints:
    """``--endpoints``: a fixed set."""

    endpoints: tuple[Endpoint, ...]


@dataclass(frozen=True)
class EndpointsFile:
    """``--endpoints-file``: read at startup (a bad file fails it), then polled."""

    path: Path
    poll_interval_s: float


@dataclass(frozen=True)
class KubernetesDiscovery:
    """An InferencePool or standalone Pods; with leader election when ``election``."""

    options: KubernetesOptions
    kubeconfig: str | None
    election: LeaderElectionOptions | None


@dataclass(frozen=True)
class ConfigDiscovery:
    """llm-d-router's ``dataLayer.discovery.pluginRef``: the config's discovery plugin
    (``file-discovery``, ``multicluster-file-discovery``) is the endpoint source; no
    Kubernetes. ``--pool-name``/``--pool-namespace`` only name the pool (metrics labels),
    default ``epp`` and ``$NAMESPACE`` or ``default``, as llm-d's file-discovery mode."""

    plugin_ref: str
    pool_name: str
    pool_namespace: str
    poll_interval_s: float


EndpointSource = StaticEndpoints | EndpointsFile | KubernetesDiscovery | ConfigDiscovery


@dataclass(frozen=True)
class ObjectivesFile:
    """``--objectives-file``: read at startup (a bad file fails it), then polled."""

    path: Path
    poll_interval_s: float


TracingMode = Literal["off", "on", "if-installed"]


@dataclass(frozen=True)
class ServePlan:
    """Validated options: the groups as given plus what validation resolved from them."""

    options: ServeOptions
    source: EndpointSource  # exactly one
    workers: int  # front processes; 1: none (everything in this process)
    metrics_auth_token: str | None  # bearer token required on /metrics and /debug/*
    # --metrics-endpoint-auth=true: TokenReview/SubjectAccessReview (epp/server/metrics_auth.py)
    metrics_auth_kubernetes: bool = False
    secure_serving: bool = False  # TLS on the ext_proc port
    # "if-installed": the default is on but OpenTelemetry may be missing (then off, logged)
    tracing: TracingMode = "off"
    notes: tuple[str, ...] = ()  # logged at startup: flags accepted that change nothing
    objectives_file: ObjectivesFile | None = None  # --objectives-file
    # llm-d's ext_proc gRPC limits in bytes (0: not set; then no limit, see
    # docs/configuration.md), the TLS 1.2 cipher list for gRPC (--tls-cipher-suites) and
    # TLS on the metrics port.
    grpc_max_recv_msg_size: int = 0
    grpc_max_send_msg_size: int = 0
    tls_cipher_list: str | None = None
    metrics_tls: MetricsTls | None = None


def validate(options: ServeOptions, discovery: str | None = None) -> ServePlan:
    """Check every option and resolve them into a :class:`ServePlan`.

    ``discovery``: the name of the config's ``dataLayer.discovery`` plugin, when it has
    one (then that plugin is the endpoint source; the built config knows it).
    Raises :class:`~epp.errors.ConfigError` on the first problem. Reads the
    ``--metrics-endpoint-auth`` token file and ``$NAMESPACE``; connects nowhere.
    """
    o = options
    if o.workers.count < 0:
        raise ConfigError("--workers must be >= 0")
    if o.observability.explain_history < 0:
        raise ConfigError("--explain-history must be >= 0")
    if o.limits.max_request_headers < 0:
        raise ConfigError("--max-request-headers must be >= 0")
    for flag, value in (("--drain-timeout", o.drain.timeout_s),
                        ("--drain-quiet-period", o.drain.quiet_period_s)):
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0")
    source = _endpoint_source(o, discovery)
    kube = isinstance(source, KubernetesDiscovery)
    notes: list[str] = []
    if (isinstance(source, ConfigDiscovery) and o.kubernetes.pool_namespace is None
            and not os.environ.get(keys.ENV_NAMESPACE)):
        notes.append("file-discovery mode: pool namespace defaulted to default; pass "
                     "--pool-namespace to label metrics and logs for your environment")
    token, kube_auth = _metrics_auth(o.observability.metrics_auth, kube, notes)
    if o.scraping.enabled:
        o.scraping.scrape.validate()
        # Checks the metric specs; the scraper gets its own (stateful) instance from wire().
        EngineMappings(overrides=o.scraping.metric_overrides)
    secure = DEFAULT_SECURE_SERVING if o.tls.secure_serving is None else o.tls.secure_serving
    if o.tls.enable_cert_reload and not (secure and o.tls.cert_path):
        notes.append("--enable-cert-reload: accepted, no effect: it reloads the pair in "
                     "--cert-path, and needs --secure-serving with --cert-path (as GIE's)")
    tracing: TracingMode
    if o.observability.tracing is None:
        tracing = "if-installed" if DEFAULT_TRACING else "off"
    else:
        tracing = "on" if o.observability.tracing else "off"
    notes += _gie_only_notes(o.gie_only)
    workers = o.workers.count or os.cpu_count() or 1
    llmd = _llmd_serving(o, secure, workers, notes)
    return ServePlan(options=o, source=source, workers=workers,
                     metrics_auth_token=token, metrics_auth_kubernetes=kube_auth,
                     secure_serving=secure, tracing=tracing, notes=tuple(notes),
                     objectives_file=_objectives_file(o.objectives, source), **llmd)


def _llmd_serving(o: ServeOptions, secure: bool, workers: int,
                  notes: list[str]) -> dict[str, Any]:
    """llm-d-router v0.10.0's serving flags, checked in the order of its Complete and
    Validate (epp/server/llmd_flags.py); the ServePlan fields they resolve to."""
    recv = parse_message_size("grpc-max-recv-msg-size", o.grpc.max_recv_msg_size)
    send = parse_message_size("grpc-max-send-msg-size", o.grpc.max_send_msg_size)
    obs = o.observability
    auth_off = obs.metrics_auth is not None and obs.metrics_auth.strip().lower() in _FALSE
    mtls = metrics_tls(obs.metrics_cert_dir, obs.metrics_client_ca_file, auth_off)
    check_tls_min_version(o.tls.tls_min_version, honour=secure)
    ciphers = cipher_suite_list(o.tls.tls_cipher_suites, honour=secure)
    if not secure and (o.tls.tls_min_version or o.tls.tls_cipher_suites):
        notes.append("--tls-min-version/--tls-cipher-suites: accepted, no effect: they "
                     "apply to --secure-serving's TLS, which is off")
    if workers > 1:  # the front processes serve ext_proc (epp/server/workers.py)
        for flag, given in (("--grpc-max-recv-msg-size", recv),
                            ("--grpc-max-send-msg-size", send),
                            ("--emit-endpoint-scores", o.routing.emit_endpoint_scores),
                            ("--enable-grpc-stream-metrics", o.grpc.enable_stream_metrics)):
            if given:
                raise ConfigError(f"{flag} is not supported with --workers {workers}: the "
                                  "ext_proc front processes do not apply it yet; run "
                                  "--workers 1 (everything in one process)")
    return {"grpc_max_recv_msg_size": recv, "grpc_max_send_msg_size": send,
            "tls_cipher_list": ciphers if secure else None, "metrics_tls": mtls}


def _objectives_file(o: ObjectivesOptions, source: EndpointSource) -> ObjectivesFile | None:
    """``--objectives-file``: not in pool mode, which watches the objects themselves."""
    if o.file is None:
        return None
    if not o.file:
        raise ConfigError("--objectives-file: empty path")
    if isinstance(source, KubernetesDiscovery) and source.options.pool_name is not None:
        raise ConfigError("--objectives-file cannot be used with --pool-name: in pool mode "
                          "the EPP watches the InferenceObjective and InferenceModelRewrite "
                          "objects that reference the pool (docs/kubernetes.md); the file "
                          "is for the modes without an InferencePool")
    if o.poll_interval_s <= 0:
        raise ConfigError("--objectives-file: the poll interval must be > 0")
    return ObjectivesFile(Path(o.file), o.poll_interval_s)


def _gie_only_notes(g: GieOnlyOptions) -> list[str]:
    notes = []
    if g.health_checking is not None:
        notes.append("--health-checking: accepted, no effect: gRPC health is always served "
                     "on the ext_proc port too (GIE serves it there only with this flag)")
    if g.enable_pprof is not None:
        notes.append("--enable-pprof: accepted and ignored: Go's pprof handlers have no "
                     "Python counterpart (profile with py-spy: docs/operations.md)")
    if g.refresh_prometheus_metrics_interval_s is not None:
        notes.append("--refresh-prometheus-metrics-interval: accepted and ignored: the "
                     "inference_pool_* gauges are computed at every scrape of /metrics, "
                     "so there is nothing to refresh")
    for flag in g.deprecated:
        notes.append(f"{flag}: deprecated in GIE v1.5.0 ({DEPRECATED_FLAGS[flag]})")
    return notes


# GIE v1.5.0's deprecated flags (pkg/epp/server/options.go): still applied here.
DEPRECATED_FLAGS: Final = {
    "--model-server-metrics-scheme": "configure the metrics-data-source plugin instead",
    "--model-server-metrics-path": "configure the metrics-data-source plugin instead",
    "--model-server-metrics-https-insecure-skip-verify":
        "configure the metrics-data-source plugin instead",
    "--model-server-metrics-port": "to be removed",
    # GIE v1.5.0 refuses to start when these are given; GIE's own Helm chart passes them
    # for sglang, triton-tensorrt-llm and trtllm-serve pools. Applied here, as before v1.5.
    "--total-queued-requests-metric": "GIE now refuses it; applied here, prefer engineConfigs",
    "--total-running-requests-metric": "GIE now refuses it; applied here, prefer "
                                       "engineConfigs",
    "--kv-cache-usage-percentage-metric": "GIE now refuses it; applied here, prefer "
                                          "engineConfigs",
    "--lora-info-metric": "GIE now refuses it; applied here, prefer engineConfigs",
    "--cache-info-metric": "GIE now refuses it; applied here, prefer engineConfigs",
}


def _metrics_auth(flag: str | None, kube: bool, notes: list[str]) -> tuple[str | None, bool]:
    """``--metrics-endpoint-auth``: (static bearer token, Kubernetes review auth)."""
    if flag is None:
        if not DEFAULT_METRICS_ENDPOINT_AUTH:
            return None, False
        if kube:
            return None, True
        notes.append("--metrics-endpoint-auth defaults to true (GIE's), which reviews "
                     "bearer tokens with the Kubernetes API; without a Kubernetes endpoint "
                     "source there is none, so /metrics is open (give "
                     "--metrics-endpoint-auth=FILE for a static token, or =false)")
        return None, False
    value = flag.strip().lower()
    if value in _FALSE:
        return None, False
    if value in _TRUE:
        if kube:
            return None, True
        raise ConfigError("--metrics-endpoint-auth=true reviews bearer tokens with the "
                          "Kubernetes API (TokenReview, SubjectAccessReview), which needs a "
                          "Kubernetes endpoint source (--pool-name or --endpoint-selector); "
                          "without one it takes a file holding the bearer token, or false")
    return _metrics_auth_token(flag), False


def _metrics_auth_token(flag: str) -> str:
    """``--metrics-endpoint-auth FILE``: the token in the file."""
    try:
        with open(flag, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ConfigError(f"--metrics-endpoint-auth: cannot read {flag}: "
                          f"{e.strerror or e}") from e
    if not token:
        raise ConfigError(f"--metrics-endpoint-auth: {flag} is empty")
    return token


def _endpoint_source(o: ServeOptions, discovery: str | None = None) -> EndpointSource:
    if discovery is not None:
        return _config_discovery(o, discovery)
    kube = _kubernetes_options(o.kubernetes)
    static = o.static
    if sum(x is not None for x in (static.endpoints, static.endpoints_file, kube)) != 1:
        raise ConfigError("give exactly one endpoint source: --endpoints ip:port[,…], "
                          "--endpoints-file FILE, --pool-name NAME (an InferencePool), "
                          "--endpoint-selector k=v[,…] with --endpoint-target-ports "
                          "PORT[,…] (pods without the CRD), or a discovery plugin in the "
                          "config (dataLayer.discovery.pluginRef: file-discovery)")
    if o.ha.enable_leader_election and kube is None:
        raise ConfigError("--ha-enable-leader-election needs a Kubernetes endpoint "
                          "source (--pool-name or --endpoint-selector)")
    if static.endpoints is not None:
        return StaticEndpoints(tuple(parse_endpoints_arg(static.endpoints)))
    if static.endpoints_file is not None:
        return EndpointsFile(Path(static.endpoints_file), static.poll_interval_s)
    assert kube is not None  # exactly one source, checked above
    return KubernetesDiscovery(kube, o.kubernetes.kubeconfig,
                               _election(o.ha, kube, o.kubernetes.pool_name))


def _config_discovery(o: ServeOptions, plugin_ref: str) -> ConfigDiscovery:
    """The config's discovery plugin is the source: the other sources' flags conflict."""
    k, static = o.kubernetes, o.static
    for flag, value in (("--endpoints", static.endpoints),
                        ("--endpoints-file", static.endpoints_file),
                        ("--endpoint-selector", k.endpoint_selector),
                        ("--endpoint-target-ports", k.endpoint_target_ports),
                        ("--kubeconfig", k.kubeconfig)):
        if value is not None:
            raise ConfigError(f"{flag} cannot be used with the config's discovery plugin "
                              f"(dataLayer.discovery.pluginRef: {plugin_ref}), which is the "
                              "endpoint source: remove one of the two")
    if o.ha.enable_leader_election:
        raise ConfigError("--ha-enable-leader-election needs a Kubernetes endpoint source; "
                          f"the config's discovery plugin ({plugin_ref}) runs without one")
    if k.pool_name == "":
        raise ConfigError("--pool-name: empty name")
    return ConfigDiscovery(plugin_ref, k.pool_name or "epp", resolve_namespace(k.pool_namespace),
                           static.poll_interval_s)


def _kubernetes_options(k: KubernetesSourceOptions) -> KubernetesOptions | None:
    """Kubernetes discovery options from the flags; None when none were given."""
    if k.endpoint_target_ports is not None and k.endpoint_selector is None:
        raise ConfigError("--endpoint-target-ports needs --endpoint-selector")
    if k.endpoint_selector is not None:
        if k.endpoint_target_ports is None:
            raise ConfigError("--endpoint-selector needs --endpoint-target-ports "
                              "PORT[,PORT…]")
        standalone = PoolSpec(parse_selector(k.endpoint_selector),
                              parse_target_ports(k.endpoint_target_ports))
        return KubernetesOptions(namespace=resolve_namespace(k.pool_namespace),
                                 standalone=standalone, watch_nodes=k.watch_nodes,
                                 debounce_s=k.debounce_s, reflector=k.reflector)
    if k.pool_name is not None:
        if not k.pool_name:
            raise ConfigError("--pool-name: empty name")
        return KubernetesOptions(namespace=resolve_namespace(k.pool_namespace),
                                 pool_name=k.pool_name, pool_group=k.pool_group,
                                 watch_nodes=k.watch_nodes, debounce_s=k.debounce_s,
                                 reflector=k.reflector)
    if k.pool_namespace is not None or k.kubeconfig is not None:
        raise ConfigError("--pool-namespace/--kubeconfig need --pool-name or "
                          "--endpoint-selector")
    return None


def _election(ha: HaOptions, kube: KubernetesOptions,
              pool_name: str | None) -> LeaderElectionOptions | None:
    """The leader election on the pool's Lease (in standalone mode ``--pool-name`` only
    names the Lease); None when off."""
    if not ha.enable_leader_election:
        return None
    name = kube.pool_name or pool_name
    if not name:
        raise ConfigError("--ha-enable-leader-election in standalone mode needs "
                          "--pool-name NAME to name the Lease")
    return LeaderElectionOptions(
        namespace=kube.namespace, name=lease_name(kube.namespace, name),
        identity=default_identity(), lease_duration_s=ha.lease_duration_s,
        renew_deadline_s=ha.renew_deadline_s, retry_period_s=ha.retry_period_s)
