"""Parsing a realistic vLLM /metrics body: epp.datalayer.promparse vs prometheus_client.

The body is tests/fixtures/metrics/vllm.txt (vLLM v0.10-style names, labels and histogram
buckets, generated with prometheus_client as vLLM exports it). Reported per operation,
best of ``--repeat`` runs:

- ``prometheus_client``: ``list(text_string_to_metric_families(text))``, every family;
- ``promparse.parse``: our strict full parse, every line;
- ``SampleIndex + extract``: what the scraper does per poll — the vLLM mapping reads its
  signals through a fresh index, a cold line cache (every line tokenized);
- the same with a warm line cache (lines unchanged since the last poll; the running,
  waiting and KV lines change per iteration here so they are always tokenized).

    .venv/bin/python -m bench.promparse
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from epp.datalayer import promparse
from epp.datalayer.engines import EngineMappings

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "metrics" / "vllm.txt"


def _best_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.promparse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--body", type=Path, default=FIXTURE)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    text = args.body.read_text(encoding="utf-8")
    mapping = EngineMappings().default

    # Bodies whose load lines differ, so the warm-cache case still tokenizes them.
    variants = [text.replace('Instruct"} 7.0', f'Instruct"}} {i}.0') for i in range(64)]
    counter = iter(range(1 << 62))

    def varied() -> str:
        body: str = variants[next(counter) % len(variants)]
        return body

    cache: dict[str, promparse.Sample] = {}
    ours = mapping.extract(promparse.SampleIndex(text))
    rows = [
        ("prometheus_client text_string_to_metric_families (all families)",
         _best_us(lambda: list(text_string_to_metric_families(text)), 20, args.repeat)),
        ("promparse.parse (all lines, strict)",
         _best_us(lambda: promparse.parse(text), 50, args.repeat)),
        ("SampleIndex + vLLM extract, cold line cache",
         _best_us(lambda: mapping.extract(promparse.SampleIndex(varied())), 500, args.repeat)),
        ("SampleIndex + vLLM extract, warm line cache",
         _best_us(lambda: mapping.extract(promparse.SampleIndex(varied(), cache)), 2000,
                  args.repeat)),
    ]
    lines = text.count("\n")
    print(f"body: {args.body.name}, {len(text.encode()) / 1024:.1f} KiB, {lines} lines, "
          f"Python {sys.version.split()[0]}")
    print(f"extracted: waiting={ours.waiting} running={ours.running} kv={ours.kv_usage} "
          f"loras={sorted(ours.active_loras or ())} block_size={ours.block_size} "
          f"num_blocks={ours.num_blocks}")
    base = rows[0][1]
    print("| parser | µs per body | vs prometheus_client |")
    print("|---|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:,.1f} | {base / us:,.0f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
