"""``epp demo``: the local stack — real Envoy + simulated model servers + the EPP.

Every process listens on 127.0.0.1 on a free port; all are stopped on exit, on Ctrl-C
and on error. The demo load is bounded by a request count and a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import yaml

from epp.stack.envoy import EnvoyProcess, render_envoy_config
from epp.stack.load import LoadReport, run_load
from epp.stack.procs import ManagedProcess, free_port, wait_port


def _print_report(report: LoadReport, servers: list[str]) -> None:
    n = len(report.results)
    ok = len(report.ok)
    print(f"\n{n} requests in {report.elapsed_s:.1f}s, {ok} OK, {n - ok} errors")
    share = report.share()
    print("\nwhere requests went:")
    for name in servers:
        c = share.get(name, 0)
        bar = "#" * round(40 * c / ok) if ok else ""
        print(f"  {name:<12} {c:>5}  {100 * c / ok if ok else 0:5.1f}%  {bar}")
    if ok:
        print(f"\nlatency p50 {1000 * report.latency_quantile(0.5):.1f} ms, "
              f"p90 {1000 * report.latency_quantile(0.9):.1f} ms")
    for err, c in report.errors().items():
        print(f"  error {err}: {c}")


async def _demo(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="epp-demo-"))
    sim_ports = [free_port() for _ in range(args.servers)]
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    gw_port, admin_port = free_port(), free_port()
    endpoints = workdir / "endpoints.yaml"
    endpoints.write_text(yaml.safe_dump({"endpoints": [
        {"address": "127.0.0.1", "port": p, "name": f"sim-{p}"} for p in sim_ports]}))

    sim_argv = [sys.executable, "-m", "epp.cli", "sim"]
    for p in sim_ports:
        sim_argv += ["--port", str(p)]
    epp_argv = [sys.executable, "-m", "epp.cli", "serve", "--bind-address", "127.0.0.1",
                "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
                "--metrics-port", str(metrics_port), "--endpoints-file", str(endpoints)]
    if args.config_file:
        epp_argv += ["--config-file", str(Path(args.config_file).resolve())]
    sims = ManagedProcess(sim_argv, log_path=workdir / "sim.log")
    epp = ManagedProcess(epp_argv, log_path=workdir / "epp.log")
    envoy = EnvoyProcess()
    print(f"epp demo: logs in {workdir}")
    try:
        await sims.start()
        await epp.start()
        for p in sim_ports:
            await wait_port("127.0.0.1", p, timeout=20)
        try:
            await wait_port("127.0.0.1", grpc_port, timeout=20)
        except TimeoutError:
            print(f"the EPP did not start:\n{epp.log_tail()}", file=sys.stderr)
            return 1
        await envoy.start(render_envoy_config(listen_port=gw_port, epp_port=grpc_port,
                                              admin_port=admin_port, body_mode=args.body_mode),
                          workdir)
        await envoy.wait_ready()
        url = f"http://127.0.0.1:{gw_port}"
        print(f"gateway  {url}  (Envoy, ext_proc {args.body_mode})")
        print(f"epp      ext_proc 127.0.0.1:{grpc_port}, metrics "
              f"http://127.0.0.1:{metrics_port}/metrics")
        print(f"servers  {', '.join(f'sim-{p}' for p in sim_ports)}")
        print(f"\nsending {args.requests} chat requests, concurrency {args.concurrency} …")
        report = await run_load(url, requests=args.requests, concurrency=args.concurrency)
        _print_report(report, [f"sim-{p}" for p in sim_ports])
        if args.keep_running:
            print(f"\nthe stack keeps running; try:\n  curl {url}/v1/chat/completions "
                  "-H 'content-type: application/json' -d '{\"model\":\"sim-model\","
                  "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'\nCtrl-C to stop.")
            await asyncio.Event().wait()
        return 0 if report.ok and len(report.ok) == len(report.results) else 1
    finally:
        await envoy.stop()
        await epp.stop()
        await sims.stop()


def run_demo(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_demo(args))
    except KeyboardInterrupt:
        print("\nstopped")
        return 130
