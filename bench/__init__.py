"""Benchmark scripts, each run as ``python -m bench.<name>`` (docs/benchmarks.md).

The top layer of the tools: the scripts use :mod:`epp.stack` (processes, Envoy, the P/D
stack, the load runner) and the EPP's own modules through public names only; nothing in
``epp/`` imports them. Between scripts: ``bench.soak`` uses ``bench.throughput``'s
:func:`cpu_seconds`.
"""
