"""Latency prediction for GIE's predicted-latency plugins (docs/plugins.md, "Latency
predictor").

- :mod:`epp.latency.types`: the predictor's data (GIE's sidecars/latencypredictorasync
  types.go), the per-endpoint prediction plugins share (GIE's
  ``LatencyPredictionInfo``), and the SLO request headers.
- :mod:`epp.latency.predictor`: the :class:`~epp.latency.predictor.LatencyPredictor`
  interface and the choice between its two implementations —
  :mod:`epp.latency.sidecar` (GIE's latency-predictor sidecar over HTTP) and
  :mod:`epp.latency.online` (an in-process model learned from this EPP's own responses).
- :mod:`epp.latency.tracking`: the request bookkeeping both the ``predicted-latency-producer``
  and the ``predicted-latency-scorer`` do (predictions before scheduling, per-endpoint
  running requests, training on each finished response).

This package imports the framework and scheduling types, never the server or the
observability modules (the metrics observer reads what the plugins leave in
``LLMRequest.plugin_state``).
"""
