"""``epp sim``: OpenAI-compatible, vLLM-like model servers backed by a latency model.

This module starts them: :func:`start_servers` / :func:`serving` / :func:`run_servers`
serve one app (:func:`epp.sim.app.build_app`) per port in this process, and
:func:`main` is the command (``epp sim``, also ``python -m epp.sim.server``; options in
:mod:`epp.sim.options`). The HTTP contracts are in :mod:`epp.sim.app` and
:mod:`epp.sim.openai_api`, the P/D decode sidecar in :mod:`epp.sim.sidecar`.

For existing callers this module also re-exports, unchanged, the names it used to
define: :func:`~epp.sim.app.build_app`, :class:`~epp.sim.state.SimState`,
:data:`~epp.sim.state.STATE_KEY`, the constants of :mod:`epp.sim.state`,
:data:`~epp.sim.config.DEFAULT_MODEL` and the option helpers of :mod:`epp.sim.options`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Sequence

from aiohttp import web

from epp.sim.app import build_app
from epp.sim.config import DEFAULT_MODEL, SimConfig
from epp.sim.kvevents import KVEventsConfig, pod_publisher
from epp.sim.options import (
    build_parser,
    config_from_args,
    kv_events_from_args,
    tokenizer_from_args,
    topology_from_args,
)
from epp.sim.state import (
    DEBUG_LOG_SIZE,
    DEFAULT_MAX_TOKENS,
    SIM_SERVER_HEADER,
    STATE_KEY,
    SimState,
)
from epp.sim.tokens import BadRequest, SimTokenizer
from epp.sim.topology import PeerTopology

__all__ = [
    "DEBUG_LOG_SIZE",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MODEL",
    "SIM_SERVER_HEADER",
    "STATE_KEY",
    "BadRequest",
    "SimConfig",
    "SimState",
    "build_app",
    "build_parser",
    "config_from_args",
    "main",
    "run_servers",
    "serving",
    "start_servers",
    "topology_from_args",
]


async def start_servers(
    host: str,
    ports: Sequence[int],
    model: str = DEFAULT_MODEL,
    *,
    delay_s: float = 0.0,
    config: SimConfig | None = None,
    topology: dict[str, str] | None = None,
    peers: PeerTopology | None = None,
    tokenizer: SimTokenizer | None = None,
    kv_events: KVEventsConfig | None = None,
    kv_events_port_offset: int | None = None,
) -> list[web.AppRunner]:
    """Start one app per port (named ``sim-<port>``) on ``host``; return their runners.

    Each app has its own engine with the same ``config`` and the same ``tokenizer``;
    with ``kv_events`` enabled, the ``i``-th port's pod publishes its KV events as
    :func:`epp.sim.kvevents.pod_publisher` says. The caller owns the runners
    and must ``await runner.cleanup()`` each. If one port cannot be bound, the ones
    already started are cleaned up and the OSError propagates.
    """
    runners: list[web.AppRunner] = []
    try:
        for index, port in enumerate(ports):
            events = None if kv_events is None else pod_publisher(
                kv_events, index=index, host=host, port=port, model=model,
                port_offset=kv_events_port_offset,
            )
            app = build_app(
                f"sim-{port}", model, delay_s=delay_s, config=config, address=host,
                topology=topology, peers=peers, tokenizer=tokenizer, events=events,
            )
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, host, port).start()
    except BaseException:
        for r in runners:
            await r.cleanup()
        raise
    return runners


@contextlib.asynccontextmanager
async def serving(
    host: str,
    ports: Sequence[int],
    model: str = DEFAULT_MODEL,
    *,
    delay_s: float = 0.0,
    config: SimConfig | None = None,
    topology: dict[str, str] | None = None,
    peers: PeerTopology | None = None,
    tokenizer: SimTokenizer | None = None,
    kv_events: KVEventsConfig | None = None,
    kv_events_port_offset: int | None = None,
) -> AsyncIterator[list[web.AppRunner]]:
    """``async with serving(...)``: :func:`start_servers`, cleaned up on exit."""
    runners = await start_servers(
        host, ports, model, delay_s=delay_s, config=config, topology=topology, peers=peers,
        tokenizer=tokenizer, kv_events=kv_events, kv_events_port_offset=kv_events_port_offset,
    )
    try:
        yield runners
    finally:
        for r in runners:
            await r.cleanup()


async def run_servers(
    host: str,
    ports: list[int],
    model: str = DEFAULT_MODEL,
    *,
    delay_s: float = 0.0,
    config: SimConfig | None = None,
    topology: dict[str, str] | None = None,
    peers: PeerTopology | None = None,
    tokenizer: SimTokenizer | None = None,
    kv_events: KVEventsConfig | None = None,
    kv_events_port_offset: int | None = None,
) -> None:
    """Serve one simulated pod per port in this process until cancelled."""
    cfg = config if config is not None else SimConfig()
    async with serving(
        host, ports, model, delay_s=delay_s, config=cfg, topology=topology, peers=peers,
        tokenizer=tokenizer, kv_events=kv_events, kv_events_port_offset=kv_events_port_offset,
    ) as runners:
        print(
            f"sim: serving model {model!r} (role {cfg.role}) on "
            + ", ".join(f"{host}:{p}" for p in ports),
            flush=True,
        )
        for runner in runners:
            events = runner.app[STATE_KEY].engine.events
            if events is not None:
                print(f"sim: {runner.app[STATE_KEY].name} publishes KV events on "
                      f"{events.endpoint} topic {events.topic!r}"
                      + (f", replay on {events.replay_endpoint}" if events.replay_endpoint
                         else ""), flush=True)
        await asyncio.Event().wait()


def main(argv: Sequence[str] | None = None) -> int:
    """``epp sim --port 8001 --port 8002 [--model M] [--host H] [model options]``
    (also ``python -m epp.sim.server``).

    Runs until SIGINT or SIGTERM, then shuts the servers down cleanly; returns 0.
    Invalid options exit with status 2 and a message, like any argparse error.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.delay_s < 0:
        parser.error("--delay-s must be >= 0")
    try:
        config = config_from_args(args)
        topology, peers = topology_from_args(args)
        kv_events = kv_events_from_args(args)
        tokenizer = tokenizer_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))

    async def _run() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await run_servers(
                args.host, args.port, args.model, delay_s=args.delay_s, config=config,
                topology=topology, peers=peers, tokenizer=tokenizer, kv_events=kv_events,
                kv_events_port_offset=args.kv_events_port_offset,
            )

    asyncio.run(_run())
    return 0



if __name__ == "__main__":
    sys.exit(main())
