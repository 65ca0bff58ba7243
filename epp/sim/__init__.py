"""``epp sim``: a vLLM-like model-server simulator for tests, the demo, benchmarks and
users' experiments (docs/simulator.md).

Modules, bottom up; each imports only modules above it in this list (and ``epp.keys``,
``epp.discovery.static``, ``epp.errors``, ``epp.kvcache.hashing``):

- :mod:`epp.sim.config` — :class:`~epp.sim.config.SimConfig`, every model parameter.
- :mod:`epp.sim.tokens` — the whitespace-word tokenizer and ``--tokenizer`` (Hugging
  Face ``tokenizers`` + a Jinja2 chat template).
- :mod:`epp.sim.topology` — pods' topology, peer distances (KV-transfer pricing).
- :mod:`epp.sim.kvevents` — vLLM's KV events: schema, msgpack encoding, the ZMQ
  publisher and replay socket, ``--kv-events-config``.
- :mod:`epp.sim.kvcache` — KV blocks, vLLM's block hashes (:mod:`epp.kvcache.hashing`),
  the LRU prefix cache and its events.
- :mod:`epp.sim.stats`, :mod:`epp.sim.engine` — the latency model: continuous batching,
  chunked prefill, preemption, LoRA slots, an asyncio step loop per server.
- :mod:`epp.sim.metrics` — vLLM-named Prometheus metrics.
- :mod:`epp.sim.state` — one pod's :class:`~epp.sim.state.SimState`; the error type and
  helpers the HTTP modules share.
- :mod:`epp.sim.sidecar` — P/D and E/P/D: the prefill role's ``kv_transfer_params``,
  the encode role's ``ec_transfer_params``, the decode role's remote encode and remote
  prefill (llm-d's decode sidecar).
- :mod:`epp.sim.openai_api` — the OpenAI routes (and Anthropic's ``/v1/messages``):
  parsing, generation, JSON and SSE.
- :mod:`epp.sim.app` — :func:`~epp.sim.app.build_app`: one pod as an aiohttp app
  (request log, delay, errors, ``/health``, ``/metrics``, ``/debug/*``).
- :mod:`epp.sim.options` — the ``epp sim`` command line (parser, config, topology).
- :mod:`epp.sim.server` — serving pods in this process, and ``main`` (``epp sim``).

How the tools layer: this package imports nothing from :mod:`epp.stack`,
:mod:`epp.bench` or ``bench/``. :mod:`epp.bench` uses its public names
(:mod:`epp.sim.kvcache`, :mod:`epp.sim.tokens`, :mod:`epp.sim.config`,
:mod:`epp.sim.options`); the local stack and the benchmarks run it as a subprocess
(``python -m epp.cli sim``).

Nothing is re-exported here, so that ``python -m epp.sim.server`` does not import the
module twice.
"""
