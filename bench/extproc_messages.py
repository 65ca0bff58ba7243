"""EPP CPU per ext_proc stream and per response-chunk message pair, without Envoy.

A client process plays Envoy's part over gRPC (GIE's shape: FULL_DUPLEX_STREAMED both
ways): per stream it sends the request headers, the body, the response headers of an SSE
answer, then ``--chunks`` response-body messages, each sent after the answer to the
previous one (as a model server's tokens arrive, milliseconds apart), then ends the
stream. ``--concurrency`` streams run at once. The EPP's CPU time (user + system, from
/proc) is read around two runs, one with ``--chunks`` chunks and one with none; the
difference divided by the chunks sent is the cost of one message pair, and the run with
none gives the cost of a stream. ``--repeat`` interleaves the EPP builds given with
``--epp`` (a directory holding an ``epp`` package, default this checkout), so two builds
are compared side by side on a noisy machine: medians are reported.

    .venv/bin/python -m bench.extproc_messages --streams 400 --chunks 100
    .venv/bin/python -m bench.extproc_messages --epp . --epp /tmp/other-checkout --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.stack.procs import ManagedProcess, free_port, wait_port

ROOT = Path(__file__).resolve().parents[1]
EVENT = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
         b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n')


def _headers(pairs: dict[str, str], eos: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]), end_of_stream=eos)


def _first() -> pb.ProcessingRequest:
    m = pb.ProcessingRequest(request_headers=_headers(
        {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}))
    m.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED  # type: ignore[assignment]
    m.protocol_config.response_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED  # type: ignore[assignment]
    return m


BODY = pb.ProcessingRequest(request_body=pb.HttpBody(
    body=orjson.dumps({"model": "m", "prompt": "hello", "stream": True}), end_of_stream=True))
RESP_HEADERS = pb.ProcessingRequest(response_headers=_headers(
    {":status": "200", "content-type": "text/event-stream"}))


async def _stream(stub: grpc.aio.StreamStreamMultiCallable, chunks: int) -> None:
    call = stub()
    await call.write(_first())
    await call.write(BODY)
    # Headers answer + the body echo (one chunk for a small body).
    await call.read()
    await call.read()
    await call.write(RESP_HEADERS)
    await call.read()
    for i in range(chunks):
        last = i == chunks - 1
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(
            body=EVENT + (b"data: [DONE]\n\n" if last else b""), end_of_stream=last)))
        await call.read()
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass


async def _load(port: int, streams: int, chunks: int, concurrency: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = ch.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                                request_serializer=pb.ProcessingRequest.SerializeToString,
                                response_deserializer=pb.ProcessingResponse.FromString)
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                await _stream(stub, chunks)

        await asyncio.gather(*(one() for _ in range(streams)))


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(epp_dir: Path, streams: int, chunks: int, concurrency: int,
                  work: Path) -> tuple[float, float]:
    """(µs of EPP CPU per stream, µs per response-chunk message pair) for one build."""
    port = free_port()
    proc = ManagedProcess(
        # Plaintext whatever the build's default; not LOCAL_SERVE_FLAGS: older builds
        # given with --epp refuse --tracing=false (there --tracing took no value).
        [sys.executable, "-m", "epp.cli", "serve", "--secure-serving=false",
         "--drain-quiet-period", "0", "--bind-address", "127.0.0.1", "--grpc-port", str(port), "--grpc-health-port",
         str(free_port()), "--metrics-port", str(free_port()), "--endpoints", "127.0.0.1:9",
         "--no-metrics-scraping", "--log-level", "warning"],
        log_path=work / f"epp-{port}.log", cwd=epp_dir,
        env={"PYTHONPATH": str(epp_dir)})
    await proc.start()
    try:
        await wait_port("127.0.0.1", port, timeout=20)
        assert proc.pid is not None
        await _load(port, 50, 5, concurrency)  # warm-up
        c0 = _cpu(proc.pid)
        await _load(port, streams, 0, concurrency)
        c1 = _cpu(proc.pid)
        await _load(port, streams, chunks, concurrency)
        c2 = _cpu(proc.pid)
    finally:
        await proc.stop()
    per_stream = (c1 - c0) / streams
    per_chunk = ((c2 - c1) - (c1 - c0)) / (streams * chunks) if chunks else 0.0
    return per_stream * 1e6, per_chunk * 1e6


async def main_async(args: argparse.Namespace) -> None:
    dirs = [Path(d).resolve() for d in (args.epp or [str(ROOT)])]
    results: dict[Path, list[tuple[float, float]]] = {d: [] for d in dirs}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for d in dirs:
                results[d].append(await measure(d, args.streams, args.chunks,
                                                 args.concurrency, Path(tmp)))
    print(f"| EPP build | CPU µs per stream (median of {args.repeat}) | CPU µs per chunk "
          "message pair |")
    print("|---|---|---|")
    for d, rs in results.items():
        print(f"| {d} | {statistics.median(r[0] for r in rs):.0f} | "
              f"{statistics.median(r[1] for r in rs):.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=400)
    p.add_argument("--chunks", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--epp", action="append", help="checkout directory (repeatable)")
    args = p.parse_args()
    t0 = time.monotonic()
    asyncio.run(main_async(args))
    print(f"({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
