"""The local stack: Envoy config rendering and process supervision."""

from epp.stack.envoy import EnvoyProcess, envoy_binary, render_envoy_config
from epp.stack.procs import ManagedProcess, free_port, wait_port

__all__ = [
    "EnvoyProcess",
    "ManagedProcess",
    "envoy_binary",
    "free_port",
    "render_envoy_config",
    "wait_port",
]
