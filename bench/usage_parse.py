"""CPU per streamed SSE chunk of the response usage parser (epp/parsing/usage.py).

Feeds a 100-event chat-completion stream (one event per chunk, ``"usage": null`` in
every token event, the usage object in the last, as vLLM sends with
``stream_options.include_usage``) through :class:`UsageParser`, in memory::

    .venv/bin/python -m bench.usage_parse --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import timeit

from epp.parsing.usage import UsageParser

TOKEN_EVENT = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
               b'"model":"m","choices":[{"index":0,"delta":{"content":" token"},'
               b'"finish_reason":null}],"usage":null}\n\n')
LAST_EVENT = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
              b'"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":100}}'
              b'\n\ndata: [DONE]\n\n')
EVENTS = 100


def one_stream() -> None:
    parser = UsageParser(sse=True)
    for _ in range(EVENTS - 1):
        parser.feed(TOKEN_EVENT)
    parser.feed(LAST_EVENT)
    if parser.finish() is None:
        raise SystemExit("the usage was not found")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--streams", type=int, default=2000)
    args = ap.parse_args()
    per_chunk = [timeit.timeit(one_stream, number=args.streams) / args.streams / EVENTS * 1e6
                 for _ in range(args.repeat)]
    print(f"µs per chunk, median of {args.repeat}: {statistics.median(per_chunk):.2f} "
          f"(runs: {', '.join(f'{v:.2f}' for v in per_chunk)})")


if __name__ == "__main__":
    main()
