"""``epp bench``: routing quality, side by side (docs/benchmarks.md, "Routing quality"),
and admission under overload ("Overload: flow control").

Modules, bottom up; each imports only modules above it in this list:

- :mod:`epp.bench.traces` — the open-loop traces (shared prefix, multi-turn, hot spot)
  and the pods' capacity for them.
- :mod:`epp.bench.ceiling` — the offline ceiling: a trace replayed against the
  simulator's cache model (:mod:`epp.sim.kvcache`, :mod:`epp.sim.tokens`).
- :mod:`epp.bench.quality` — the command: starts simulated pods and each router
  (:mod:`epp.stack.procs`, :mod:`epp.stack.envoy`; the pods' costs from
  :mod:`epp.sim.options`), plays the trace (:func:`epp.stack.runner.stream_chat`),
  reports against the ceiling.
- :mod:`epp.bench.overload` — ``--workload overload`` (``epp.cli`` hands it over): two
  tenants with GIE's fairness and objective headers bursting to 2x the pool's capacity,
  through the EPP with flow control (its config from :mod:`epp.config.loader`'s
  default), without it, and round robin, on :mod:`epp.bench.quality`'s stacks.
- :mod:`epp.bench.shapes` — ``--sweep``'s family of workload shapes, drawn per seed (with
  a held-out set), their traces, pool sizes and rates (above: traces).
- :mod:`epp.bench.sweep` — ``--sweep N`` / ``--held-out`` (``epp.cli`` hands it over):
  every router on every shape with fresh pods, against each shape's ceiling, with the
  issue's target checks per router ("Sweep").

How the tools layer: :mod:`epp.stack` (processes, Envoy, the load runner, ``epp demo``)
at the bottom and :mod:`epp.sim` beside it; this package uses both through public names
only; the scripts in ``bench/`` sit on top. Nothing in ``epp/`` imports this package
except ``epp.cli``.
"""
