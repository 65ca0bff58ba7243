"""The gRPC health services the EPP reports, on the health port and the ext_proc port.

``liveness`` is SERVING while the process runs (through the drain too, so the kubelet
does not restart a draining pod). ``readiness``, the ext_proc service and the empty
service name are SERVING once every readiness condition holds — the endpoint source has
synced, the Kubernetes pool exists, this replica holds the leader Lease — and never
again once the drain has begun.
"""

from __future__ import annotations

from collections.abc import Callable

from grpc_health.v1 import health, health_pb2

from epp import keys

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthReporter:
    """Owns the health servicer; :meth:`update` recomputes and publishes the statuses.

    Conditions are added as the parts they watch are made (:meth:`require`); whatever
    may change one calls :meth:`update` (the Kubernetes source, the leader elector).
    """

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self.draining = False
        self._conditions: list[Callable[[], bool]] = []

    def require(self, condition: Callable[[], bool]) -> None:
        """Report ready only while ``condition()`` holds (and not draining)."""
        self._conditions.append(condition)

    @property
    def ready(self) -> bool:
        return not self.draining and all(c() for c in self._conditions)

    async def update(self) -> None:
        ready = SERVING if self.ready else NOT_SERVING
        await self.servicer.set(keys.HEALTH_LIVENESS, SERVING)
        await self.servicer.set(keys.HEALTH_READINESS, ready)
        await self.servicer.set(keys.HEALTH_EXT_PROC, ready)
        await self.servicer.set("", ready)

    async def start_draining(self) -> None:
        """NOT_SERVING on readiness and ext_proc from now on (liveness stays SERVING)."""
        self.draining = True
        await self.update()
