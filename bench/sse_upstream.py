"""A streaming upstream for ``bench/throughput.py``: every POST is answered with an
OpenAI-style SSE completion of N events, one write (and flush) per event with a fixed gap
between events, then a usage event and ``data: [DONE]``.

    python -m bench.sse_upstream --port 8000 --events 100 --gap-ms 1

It runs on uvloop and does nothing else per request, so that the benchmark's streamed
case measures the gateway's per-chunk cost rather than a model server's.
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web

from epp.server.loop import run as run_loop

EVENT = b'data: {"id":"x","object":"text_completion","model":"m","choices":[{"index":0,"text":"tok"}]}\n\n'
USAGE = (b'data: {"id":"x","object":"text_completion","model":"m","choices":[],'
         b'"usage":{"prompt_tokens":500,"completion_tokens":%d,"total_tokens":%d}}\n\n')
DONE = b"data: [DONE]\n\n"


def build_app(events: int, gap_s: float) -> web.Application:
    usage = USAGE % (events, 500 + events)

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(events):
            await resp.write(EVENT)
            await asyncio.sleep(gap_s)
        await resp.write(usage + DONE)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/{tail:.*}", complete)
    return app


async def serve(port: int, events: int, gap_s: float) -> None:
    runner = web.AppRunner(build_app(events, gap_s), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--events", type=int, default=100)
    ap.add_argument("--gap-ms", type=float, default=1.0)
    args = ap.parse_args()
    run_loop(serve(args.port, args.events, args.gap_ms / 1000))


if __name__ == "__main__":
    main()
