"""``epp serve``'s options, grouped, and their validation — the one place that checks them.

:class:`ServeOptions` holds what the caller asked for, one frozen group per concern (the
command line builds it from argparse, epp/cli.py; tests build it directly). Nothing
checks a group when it is made: :func:`validate` checks them all, in a fixed order, and
turns them into a :class:`ServePlan` — the resolved values the server runs with (the one
endpoint source, parsed; the leader election; the bearer token; the worker count). Every
error is a :class:`~epp.errors.ConfigError` whose message names the flag, and
``epp serve`` prints it as ``epp: error: <message>`` (exit status 1).

What validation does not cover, because it needs more than the options: the
EndpointPickerConfig (epp.config.loader, built next), the kubeconfig and the endpoints
file (read at startup, before any port is bound), the TLS key pair (read when the
ext_proc port is bound), and the ports themselves (epp/server/listeners.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

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

DEFAULT_MAX_BODY = 64 << 20

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


@dataclass(frozen=True)
class StaticSourceOptions:
    """Static endpoint sources: ``--endpoints`` or ``--endpoints-file`` (polled)."""

    endpoints: str | None = None  # ip:port[,ip:port…]
    endpoints_file: str | None = None
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
    """TLS on the ext_proc port (GIE serves it by default; here it is opt-in)."""

    secure_serving: bool = False
    cert_path: str | None = None  # tls.crt and tls.key; None: self-signed


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
    # --metrics-endpoint-auth: a file holding the bearer token required on /metrics and
    # /debug/*; "false" (GIE's boolean form) or None: no auth.
    metrics_auth: str | None = None
    tracing: bool = False
    log_level: str = "info"  # the --workers fronts log at this level too


@dataclass(frozen=True)
class RequestLimits:
    max_request_body_bytes: int = DEFAULT_MAX_BODY
    # The gateway's request header limit (Envoy's max_headers_count); 0 = no check.
    max_request_headers: int = DEFAULT_MAX_HEADERS


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
    tls: TlsOptions = field(default_factory=TlsOptions)
    ha: HaOptions = field(default_factory=HaOptions)
    scraping: ScrapingOptions = field(default_factory=ScrapingOptions)
    observability: ObservabilityOptions = field(default_factory=ObservabilityOptions)
    limits: RequestLimits = field(default_factory=RequestLimits)
    workers: WorkerOptions = field(default_factory=WorkerOptions)
    drain: DrainOptions = field(default_factory=DrainOptions)


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


EndpointSource = StaticEndpoints | EndpointsFile | KubernetesDiscovery


@dataclass(frozen=True)
class ServePlan:
    """Validated options: the groups as given plus what validation resolved from them."""

    options: ServeOptions
    source: EndpointSource  # exactly one
    workers: int  # front processes; 1: none (everything in this process)
    metrics_auth_token: str | None  # bearer token required on /metrics and /debug/*


def validate(options: ServeOptions) -> ServePlan:
    """Check every option and resolve them into a :class:`ServePlan`.

    Raises :class:`~epp.errors.ConfigError` on the first problem. Reads the
    ``--metrics-endpoint-auth`` token file and ``$NAMESPACE``; connects nowhere.
    """
    o = options
    token = _metrics_auth_token(o.observability.metrics_auth)
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
    source = _endpoint_source(o)
    if o.scraping.enabled:
        o.scraping.scrape.validate()
        # Checks the metric specs; the scraper gets its own (stateful) instance from wire().
        EngineMappings(overrides=o.scraping.metric_overrides)
    return ServePlan(options=o, source=source, workers=o.workers.count or os.cpu_count() or 1,
                     metrics_auth_token=token)


def _metrics_auth_token(flag: str | None) -> str | None:
    """``--metrics-endpoint-auth``: the token from the file it names; None when off."""
    if flag is None:
        return None
    value = flag.strip().lower()
    if value in ("false", "0", "no", "f"):
        return None  # GIE's boolean form, turned off
    if value in ("true", "1", "yes", "t"):
        raise ConfigError("--metrics-endpoint-auth takes a file holding the bearer token "
                          "(GIE's Kubernetes TokenReview auth is not implemented)")
    try:
        with open(flag, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ConfigError(f"--metrics-endpoint-auth: cannot read {flag}: "
                          f"{e.strerror or e}") from e
    if not token:
        raise ConfigError(f"--metrics-endpoint-auth: {flag} is empty")
    return token


def _endpoint_source(o: ServeOptions) -> EndpointSource:
    kube = _kubernetes_options(o.kubernetes)
    static = o.static
    if sum(x is not None for x in (static.endpoints, static.endpoints_file, kube)) != 1:
        raise ConfigError("give exactly one endpoint source: --endpoints ip:port[,…], "
                          "--endpoints-file FILE, --pool-name NAME (an InferencePool), or "
                          "--endpoint-selector k=v[,…] with --endpoint-target-ports "
                          "PORT[,…] (pods without the CRD)")
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
