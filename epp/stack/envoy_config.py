"""``epp envoy-config``: print a ready-to-run Envoy bootstrap for an EPP.

The same configuration the local stack and the tests run (:func:`render_envoy_config`):
one HTTP listener whose requests go through the EPP over ext_proc and are routed to the
pod it picks. Pass the EPP's address, the listener's port and the gateway shape; run the
output with ``envoy -c FILE`` (docs/local-stack.md, "Running Envoy yourself").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from epp.errors import ConfigError
from epp.stack.envoy import (
    BODY_MODE_FULL_DUPLEX,
    BODY_MODES,
    DEFAULT_RESPONSE_PATH,
    RESPONSE_PATHS,
    render_envoy_config,
)


def _host_port(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag}: expected HOST:PORT (e.g. 127.0.0.1:9002), got {value!r}")
    return host, int(port)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epp", default="127.0.0.1:9002", metavar="HOST:PORT",
                   help="the EPP's ext_proc address (default 127.0.0.1:9002, epp serve's "
                   "--grpc-port)")
    p.add_argument("--listen", default="0.0.0.0:8081", metavar="ADDR:PORT",
                   help="the gateway listener clients send requests to (default "
                   "0.0.0.0:8081)")
    p.add_argument("--admin-port", type=int, default=9901,
                   help="Envoy's admin port, on 127.0.0.1 (default 9901)")
    p.add_argument("--body-mode", choices=BODY_MODES, default=BODY_MODE_FULL_DUPLEX,
                   help="how Envoy sends request bodies to the EPP (default "
                   f"{BODY_MODE_FULL_DUPLEX}; docs/architecture.md, 'Gateway shapes')")
    p.add_argument("--response-path", choices=RESPONSE_PATHS, default=DEFAULT_RESPONSE_PATH,
                   help=f"the gateway shape for responses (default {DEFAULT_RESPONSE_PATH}: "
                   "the EPP never sees a response body; inline: GIE's shape, every chunk "
                   "through the EPP)")
    p.add_argument("--pool-endpoints", default=None, metavar="IP:PORT[,…]",
                   help="route through a STATIC cluster of these endpoints with Envoy's "
                   "override_host policy, which also tries the EPP's fallbacks (needed for "
                   "maxNumOfEndpoints > 1); default: an ORIGINAL_DST cluster that connects "
                   "to whatever endpoint the EPP names")
    p.add_argument("--route-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="upstream request timeout (default 300)")
    p.add_argument("--message-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long Envoy waits for each EPP answer (default 30)")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20,
                   help="largest request body the gateway buffers (default 64 MiB; match "
                   "epp serve's --max-request-body-bytes)")
    p.add_argument("--epp-tls", choices=("true", "false"), default="true",
                   help="connect to the EPP with TLS, unverified (default true: epp serve "
                   "serves TLS unless --secure-serving=false, as GIE's EPP does)")
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="write the configuration to FILE instead of stdout")


def render_from_args(args: argparse.Namespace) -> str:
    """The bootstrap YAML for the parsed arguments; ConfigError on a bad value."""
    epp_host, epp_port = _host_port(args.epp, "--epp")
    listen_host, listen_port = _host_port(args.listen, "--listen")
    endpoints = None
    if args.pool_endpoints is not None:
        endpoints = [e.strip() for e in args.pool_endpoints.split(",") if e.strip()]
        for e in endpoints:
            _host_port(e, "--pool-endpoints")
        if not endpoints:
            raise ConfigError("--pool-endpoints: give at least one IP:PORT")
    try:
        return render_envoy_config(
            listen_port=listen_port, listen_address=listen_host, epp_port=epp_port,
            epp_address=epp_host, admin_port=args.admin_port, body_mode=args.body_mode,
            response_path=args.response_path, route_timeout_s=args.route_timeout,
            message_timeout_s=args.message_timeout, max_body_bytes=args.max_body_bytes,
            pool_endpoints=endpoints, epp_tls=args.epp_tls == "true")
    except ValueError as e:
        raise ConfigError(str(e)) from e


def main(args: argparse.Namespace) -> int:
    try:
        text = render_from_args(args)
    except ConfigError as e:
        print(f"epp envoy-config: {e}", file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0
