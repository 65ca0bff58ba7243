"""``epp sim``: a vLLM-like model-server simulator for tests, the demo, benchmarks and
users' experiments (docs/simulator.md).

- :mod:`epp.sim.server` — the OpenAI HTTP API, ``/metrics``, debug routes, the CLI.
- :mod:`epp.sim.engine` — the latency model: continuous batching, chunked prefill,
  preemption, LoRA slots, an asyncio step loop per server.
- :mod:`epp.sim.kvcache` — KV blocks, chained block hashes, the LRU prefix cache.
- :mod:`epp.sim.config` — :class:`~epp.sim.config.SimConfig`, every model parameter.
- :mod:`epp.sim.metrics` / :mod:`epp.sim.stats` — vLLM-named Prometheus metrics.
- :mod:`epp.sim.tokens` — the whitespace-word tokenizer.

Nothing is re-exported here, so that ``python -m epp.sim.server`` does not import the
module twice.
"""
