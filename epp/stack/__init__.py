"""The local stack: real Envoy, ``epp serve`` and ``epp sim`` processes on 127.0.0.1, the
chat load generator, and ``epp demo`` (docs/local-stack.md).

Modules, bottom up; each imports only modules above it in this list (and ``epp.keys``):

- :mod:`epp.stack.procs` — :class:`ManagedProcess`, :func:`free_port`, :func:`wait_port`,
  :func:`sim_kv_events_args` (sims publishing KV events on HTTP port + N).
- :mod:`epp.stack.envoy` — the gateway shapes, :func:`render_envoy_config` (from
  ``envoy.yaml.tmpl``), :func:`without_ext_proc`, :class:`EnvoyProcess`.
- :mod:`epp.stack.pd` — the P/D stack: :func:`grove_layout`, :class:`PdStack`,
  :class:`PairStats`, ``PD_SIM_ARGS``.
- :mod:`epp.stack.workload` — the chat workload: shared system prompts, multi-turn
  conversations.
- :mod:`epp.stack.runner` — the closed-loop load runner (:func:`run`,
  :func:`stream_chat`, :class:`Report`).
- :mod:`epp.stack.demo` — ``epp demo`` and ``epp demo --pd`` (:func:`run_demo`).

How the tools layer: this package is the bottom one. It imports nothing from
:mod:`epp.sim`, :mod:`epp.bench` or ``bench/``; the EPP and the simulators run as
subprocesses (``python -m epp.cli serve | sim``). :mod:`epp.sim` stands beside it,
independent. :mod:`epp.bench` (``epp bench``) uses both, and the scripts in ``bench/``
sit on top; all of them only through public names. ``epp.server.app`` uses
:func:`epp.stack.procs.wait_port`.

Nothing is re-exported here: import from the modules.
"""
