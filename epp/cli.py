"""Command line: ``epp serve | check-config | sim | demo``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Sequence

from epp import __version__
from epp.errors import ConfigError

log = logging.getLogger("epp")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from epp.server.app import DEFAULT_MAX_BODY

    p = sub.add_parser("serve", help="run the endpoint picker (ext_proc gRPC server)",
                       description="Run the endpoint picker: an Envoy ext_proc gRPC server that "
                       "picks a model-server endpoint for every request.")
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port (default 9002)")
    p.add_argument("--grpc-health-port", type=int, default=9003,
                   help="gRPC health port (default 9003)")
    p.add_argument("--metrics-port", type=int, default=9090,
                   help="Prometheus /metrics port (default 9090)")
    p.add_argument("--bind-address", default="0.0.0.0",
                   help="address to listen on (default 0.0.0.0)")
    cfg = p.add_mutually_exclusive_group()
    cfg.add_argument("--config-file", help="EndpointPickerConfig YAML file")
    cfg.add_argument("--config-text", help="EndpointPickerConfig YAML given inline")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--endpoints", help="static endpoints: ip:port[,ip:port…]")
    src.add_argument("--endpoints-file",
                     help="YAML file of endpoints (and node labels); re-read when it changes")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY,
                   help=f"reject larger request bodies with 413 (default {DEFAULT_MAX_BODY})")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="log level (default info)")


def _add_check_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("check-config", help="validate an EndpointPickerConfig file and exit",
                       description="Parse and build an EndpointPickerConfig (every plugin and "
                       "parameter) exactly as `epp serve` would; exit 0 when valid.")
    p.add_argument("file", help="EndpointPickerConfig YAML file")


def _add_sim(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub.add_parser("sim", add_help=False, help="run simulated OpenAI-compatible model servers "
                   "(see `epp sim --help`)")


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run the local stack: Envoy + simulated model servers + "
                       "the EPP, with a short demo load",
                       description="Start real Envoy, simulated model servers and the EPP on "
                       "free local ports, run a realistic chat workload through the EPP and "
                       "through plain round robin, and print a side-by-side summary. Ctrl-C "
                       "stops everything.")
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
    p.add_argument("--sim-args", default="",
                   help="extra arguments for every `epp sim` process, e.g. \"--max-num-seqs 8\"")
    p.add_argument("--no-compare", dest="compare", action="store_false",
                   help="skip the round-robin baseline")
    p.add_argument("--keep-running", action="store_true",
                   help="after the load, keep the stack up until Ctrl-C")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epp", description="Endpoint picker for LLM "
                                     "inference gateways (Envoy ext_proc).")
    parser.add_argument("--version", action="version", version=f"epp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_check_config(sub)
    _add_sim(sub)
    _add_demo(sub)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from epp.server.app import ServeOptions, StartupError, serve_forever

    _setup_logging(args.log_level)
    opts = ServeOptions(
        grpc_port=args.grpc_port, grpc_health_port=args.grpc_health_port,
        metrics_port=args.metrics_port, bind_address=args.bind_address,
        config_file=args.config_file, config_text=args.config_text,
        endpoints=args.endpoints, endpoints_file=args.endpoints_file,
        max_request_body_bytes=args.max_request_body_bytes,
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_forever(opts, stop)

    try:
        asyncio.run(main())
    except (ConfigError, StartupError) as e:
        print(f"epp: error: {e}", file=sys.stderr)
        return 1
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from epp.config.loader import build, load_config_file

    try:
        built = build(load_config_file(args.file))
    except ConfigError as e:
        print(f"epp: error: {e}", file=sys.stderr)
        return 1
    for name, prof in built.scheduler.profiles.items():
        parts = [f"filter {f.name}" for f in prof.filters]
        parts += [f"scorer {s.name} (weight {w:g})" for s, w in prof.scorers]
        parts.append(f"picker {prof.picker.name}")
        print(f"profile {name}: " + ", ".join(parts))
    print(f"profile handler: {built.scheduler.handler.name}")
    print(f"{args.file}: OK")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        from epp.sim.server import main as sim_main

        return sim_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "check-config":
        return _check_config(args)
    if args.command == "demo":
        from epp.stack.demo import run_demo

        _setup_logging(args.log_level)
        return run_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
