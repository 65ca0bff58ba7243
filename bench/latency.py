"""EPP-added latency: Envoy → pod directly vs Envoy → EPP (ext_proc) → pod, one run.

Starts `epp sim` pods, one `epp serve`, and two Envoys from the same template: one with the
ext_proc filter, one without it (the client names the pod itself with the routing header,
round robin). Requests alternate between the two gateways in small blocks, so machine noise
hits both alike. Prints p50/p90/p99 per path and the differences.

    .venv/bin/python -m bench.latency --requests 2000 --concurrency 1 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from epp.stack.envoy import (
    DEFAULT_RESPONSE_PATH,
    RESPONSE_PATHS,
    EnvoyProcess,
    render_envoy_config,
    without_ext_proc,
)
from epp.stack.procs import LOCAL_SERVE_FLAGS, ManagedProcess, free_port, wait_port


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(url: str, session: aiohttp.ClientSession, n: int, concurrency: int,
                  body: bytes, pods: list[str] | None) -> list[float]:
    lat: list[float] = []
    rr = itertools.cycle(pods) if pods else None
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            headers = {"content-type": "application/json"}
            if rr is not None:
                headers["x-gateway-destination-endpoint"] = next(rr)
            t0 = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"status {r.status}")
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat


async def main_async(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="epp-bench-"))
    pods = [free_port() for _ in range(args.pods)]
    grpc_port = free_port()
    sim_argv = [sys.executable, "-m", "epp.cli", "sim"] + [a for p in pods for a in ("--port", str(p))]
    sims = ManagedProcess(sim_argv, log_path=work / "sim.log")
    epp = ManagedProcess([sys.executable, "-m", "epp.cli", "serve", *LOCAL_SERVE_FLAGS, "--drain-quiet-period", "0", "--bind-address", "127.0.0.1",
                          "--grpc-port", str(grpc_port), "--grpc-health-port", str(free_port()),
                          "--metrics-port", str(free_port()), "--log-level", "warning",
                          "--endpoints", ",".join(f"127.0.0.1:{p}" for p in pods)],
                         log_path=work / "epp.log")
    gw_epp, gw_direct = free_port(), free_port()
    e1, e2 = EnvoyProcess(), EnvoyProcess()
    try:
        await sims.start()
        await epp.start()
        for p in [*pods, grpc_port]:
            await wait_port("127.0.0.1", p, 20)
        cfg = render_envoy_config(listen_port=gw_epp, epp_port=grpc_port, admin_port=free_port(),
                                  body_mode=args.body_mode, response_path=args.response_path)
        await e1.start(cfg, work / "e1", concurrency=args.envoy_workers)
        cfg2 = render_envoy_config(listen_port=gw_direct, epp_port=grpc_port,
                                   admin_port=free_port(), body_mode=args.body_mode)
        await e2.start(without_ext_proc(cfg2), work / "e2", concurrency=args.envoy_workers)
        await e1.wait_ready()
        await e2.wait_ready()
        body = orjson.dumps({"model": "sim-model", "max_tokens": 1,
                             "prompt": "x" * args.body_bytes})
        pod_keys = [f"127.0.0.1:{p}" for p in pods]
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            print(f"# {args.requests} requests per path per concurrency, body {len(body)} B, "
                  f"{args.pods} pods, Envoy {args.body_mode}, response path "
                  f"{args.response_path}, blocks of {args.block}")
            print("| path | concurrency | p50 ms | p90 ms | p99 ms |")
            print("|---|---|---|---|---|")
            for conc in args.concurrency:
                # Warm-up both paths.
                await measure(f"http://127.0.0.1:{gw_epp}/v1/completions", session, 100, conc, body, None)
                await measure(f"http://127.0.0.1:{gw_direct}/v1/completions", session, 100, conc, body, pod_keys)
                via, direct = [], []
                for _ in range(max(1, args.requests // args.block)):
                    via += await measure(f"http://127.0.0.1:{gw_epp}/v1/completions", session,
                                         args.block, conc, body, None)
                    direct += await measure(f"http://127.0.0.1:{gw_direct}/v1/completions",
                                            session, args.block, conc, body, pod_keys)
                for name, xs in (("Envoy direct", direct), ("Envoy + EPP", via)):
                    print(f"| {name} | {conc} | {1000 * quantile(xs, .5):.2f} | "
                          f"{1000 * quantile(xs, .9):.2f} | {1000 * quantile(xs, .99):.2f} |")
                print(f"| added by EPP | {conc} | {1000 * (quantile(via, .5) - quantile(direct, .5)):+.2f} | "
                      f"{1000 * (quantile(via, .9) - quantile(direct, .9)):+.2f} | "
                      f"{1000 * (quantile(via, .99) - quantile(direct, .99)):+.2f} |")
    finally:
        for p in (e1, e2):
            await p.stop()
        await epp.stop()
        await sims.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, action="append")
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--block", type=int, default=50)
    ap.add_argument("--body-bytes", type=int, default=2000)
    ap.add_argument("--envoy-workers", type=int, default=1)
    ap.add_argument("--body-mode", default="FULL_DUPLEX_STREAMED",
                    choices=["FULL_DUPLEX_STREAMED", "BUFFERED"])
    ap.add_argument("--response-path", default=DEFAULT_RESPONSE_PATH, choices=list(RESPONSE_PATHS),
                    help="the gateway shape of the EPP's Envoy (default lean: response headers "
                    "only; inline: GIE's shape; observer: the split response path)")
    args = ap.parse_args()
    args.concurrency = args.concurrency or [1, 8]
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
