"""The gRPC health service the EPP answers, on the health port and the ext_proc port.

The service names and their meaning follow GIE v1.5.0's EPP (cmd/epp/runner/health.go),
with this EPP's drain added (epp/server/drain.py):

- *ready* means: the endpoint source has synced (for Kubernetes: the first complete sync,
  while the pool exists), this replica holds the leader Lease when leader election is
  on, and no drain has begun;
- ``liveness`` is SERVING while the process runs, through the drain too (GIE's, with
  leader election on; with it off GIE ties every name to the pool sync, where this EPP
  keeps liveness up so that a pool that never syncs shows as not ready rather than as a
  restart loop);
- without leader election every other name, the empty one and names nobody registered
  (``inference-extension``, what GIE's Helm chart probes with one replica) included, is
  SERVING while ready — as GIE, which answers any name then;
- with leader election ``readiness``, the ext_proc service
  (``envoy.service.ext_proc.v3.ExternalProcessor``) and the empty name are SERVING while
  ready (only the leader), and any other name is SERVICE_UNKNOWN (a status, not an
  error, as GIE's; its chart probes ``liveness`` and ``readiness`` then);
- ``List`` reports the ext_proc service, plus ``liveness`` and ``readiness`` with leader
  election, as GIE's does; ``Watch`` (GIE: unimplemented) streams a name's status on
  every change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp import keys

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

# grpc.health.v1's List (newer than the type stubs).
_HealthListResponse: Any = getattr(health_pb2, "HealthListResponse")  # noqa: B009 - untyped

# With leader election on, the names that report readiness (GIE's set).
_READINESS_NAMES = frozenset({keys.HEALTH_READINESS, keys.HEALTH_EXT_PROC, ""})


class HealthReporter:
    """The readiness conditions and the health servicer that reports them.

    Conditions are added as the parts they watch are made (:meth:`require`); whatever
    may change one calls :meth:`update` (the Kubernetes source, the leader elector), which
    wakes ``Watch`` streams. ``Check`` evaluates the conditions when asked.
    """

    def __init__(self, leader_election: bool = False) -> None:
        self.leader_election = leader_election
        self.draining = False
        self._conditions: list[Callable[[], bool]] = []
        self._changed = asyncio.Condition()
        self._version = 0  # counts update() calls: no change is missed between two waits
        self.servicer = HealthServicer(self)

    def require(self, condition: Callable[[], bool]) -> None:
        """Report ready only while ``condition()`` holds (and not draining)."""
        self._conditions.append(condition)

    @property
    def ready(self) -> bool:
        return not self.draining and all(c() for c in self._conditions)

    def status(self, service: str) -> int:
        """The status reported for ``service`` now."""
        if service == keys.HEALTH_LIVENESS:
            return SERVING
        if self.leader_election and service not in _READINESS_NAMES:
            return SERVICE_UNKNOWN
        return SERVING if self.ready else NOT_SERVING

    def listed(self) -> tuple[str, ...]:
        """The names ``List`` reports (GIE's)."""
        if self.leader_election:
            return keys.HEALTH_EXT_PROC, keys.HEALTH_LIVENESS, keys.HEALTH_READINESS
        return (keys.HEALTH_EXT_PROC,)

    async def update(self) -> None:
        """A condition may have changed: wake the ``Watch`` streams."""
        async with self._changed:
            self._version += 1
            self._changed.notify_all()

    async def changes(self) -> AsyncIterator[None]:
        """Yields now, and again after each :meth:`update` since the last yield."""
        seen = -1
        while True:
            if self._version != seen:
                seen = self._version
                yield None
                continue
            async with self._changed:
                while self._version == seen:
                    await self._changed.wait()

    async def start_draining(self) -> None:
        """NOT_SERVING on every name but liveness from now on."""
        self.draining = True
        await self.update()


class HealthServicer(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` over a :class:`HealthReporter`."""

    def __init__(self, reporter: HealthReporter) -> None:
        self._reporter = reporter

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: Any) -> health_pb2.HealthCheckResponse:
        status = self._reporter.status(request.service)
        if status == SERVICE_UNKNOWN:
            log.debug("gRPC health check for an unknown service %r (known: %s)",
                      request.service, ", ".join(self._reporter.listed()))
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request: Any, context: Any) -> Any:
        r = self._reporter
        return _HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=r.status(name)) for name in r.listed()})

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        last: int | None = None
        async for _ in self._reporter.changes():
            status = self._reporter.status(request.service)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
