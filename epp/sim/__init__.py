"""A vLLM-like model-server simulator for tests, the demo and benchmarks.

Minimal today: :mod:`epp.sim.server` has OpenAI routes with fake output, vLLM-named
metrics and a debug log of received requests. Nothing is re-exported here, so that
``python -m epp.sim.server`` does not import the module twice.
"""
