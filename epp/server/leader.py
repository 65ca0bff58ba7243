"""Active-passive replicas: leader election on a ``coordination.k8s.io/v1`` Lease.

The algorithm is client-go's ``leaderelection`` (what GIE's EPP runs through
controller-runtime), so Go and Python replicas can even share one Lease:

- A candidate GETs the Lease every ``retry_period_s`` (with up to 20 % jitter). It takes
  the Lease when it does not exist (POST), has no holder, or its holder has not renewed it
  for ``leaseDurationSeconds`` — measured on the candidate's own monotonic clock from the
  moment it last saw the Lease record change, so clock skew between nodes does not
  matter. Taking it is a PUT carrying the observed ``resourceVersion``: of two racing
  candidates one gets 409 Conflict and stays a candidate.
- The leader renews every ``retry_period_s``. If it has not renewed successfully for
  ``renew_deadline_s`` (API server unreachable), or it sees another holder, it steps
  down and becomes a candidate again — before its Lease can lapse for the others,
  because ``renew_deadline_s`` < ``lease_duration_s``.
- On :meth:`stop` a leader releases the Lease (holder cleared, duration 1 s), as GIE
  configures (``LeaderElectionReleaseOnCancel``), so a standby takes over at its next
  retry instead of waiting out the lease.

The Lease is named ``epp-<namespace>-<pool>.gateway-api-inference-extension.sigs.k8s.io``
in the pool's namespace (GIE's name). Defaults are client-go's: 15 s / 10 s / 2 s.
``on_change(is_leader)`` is awaited from the elector's task on every transition.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp

from epp import keys
from epp.discovery.kubeclient import KubeApi, status_reason
from epp.errors import ConfigError

log = logging.getLogger(__name__)


def lease_name(namespace: str, pool_name: str) -> str:
    """GIE's Lease name for the EPP of ``namespace/pool_name``."""
    return f"epp-{namespace}-{pool_name}.{keys.K8S_LEASE_SUFFIX}"


def default_identity() -> str:
    """``<hostname>_<uuid>``, as controller-runtime builds it (unique per process)."""
    return f"{socket.gethostname()}_{uuid.uuid4()}"


def _micro_time(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaderElectionOptions:
    namespace: str
    name: str
    identity: str
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    release_on_stop: bool = True

    def __post_init__(self) -> None:
        if not self.lease_duration_s > self.renew_deadline_s > 0:
            raise ConfigError("leader election: the lease duration must exceed the renew "
                              f"deadline (got {self.lease_duration_s}s and "
                              f"{self.renew_deadline_s}s)")
        if not 0 < self.retry_period_s < self.renew_deadline_s:
            raise ConfigError("leader election: the retry period must be positive and below "
                              f"the renew deadline (got {self.retry_period_s}s)")


class LeaderElector:
    """Runs the election in one task. ``is_leader`` is this replica's current view.

    Lifecycle: :meth:`start` (returns at once), :meth:`stop` (releases the Lease when
    leader and ``release_on_stop``; idempotent).
    """

    def __init__(self, api: KubeApi, options: LeaderElectionOptions,
                 on_change: Callable[[bool], Awaitable[None]] | None = None) -> None:
        self.api = api
        self.options = options
        self._on_change = on_change
        self.is_leader = False
        self.transitions = 0  # times this replica became leader (observability, tests)
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._lease: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_error: str | None = None

    @property
    def _item_path(self) -> str:
        o = self.options
        return f"/apis/coordination.k8s.io/v1/namespaces/{o.namespace}/leases/{o.name}"

    @property
    def _collection_path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.options.namespace}/leases"

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            log.info("leader election: candidate %s for Lease %s/%s", self.options.identity,
                     self.options.namespace, self.options.name)
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="leader-election")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self.is_leader:
            if self.options.release_on_stop:
                await self._release()
            await self._set_leader(False)

    # -- the loop ---------------------------------------------------------------------
    async def _run(self) -> None:
        o = self.options
        while True:
            while not await self._try_acquire_or_renew():
                await asyncio.sleep(o.retry_period_s * random.uniform(1.0, 1.2))
            await self._set_leader(True)
            last_renew = time.monotonic()
            while True:
                await asyncio.sleep(o.retry_period_s)
                if await self._try_acquire_or_renew():
                    last_renew = time.monotonic()
                    continue
                if self._held_by_other():
                    log.warning("leader election: Lease taken by %s; stepping down",
                                self._holder())
                    break
                if time.monotonic() - last_renew >= o.renew_deadline_s:
                    log.warning("leader election: could not renew the Lease for %.1fs; "
                                "stepping down", o.renew_deadline_s)
                    break
            await self._set_leader(False)

    async def _set_leader(self, leader: bool) -> None:
        if leader == self.is_leader:
            return
        self.is_leader = leader
        if leader:
            self.transitions += 1
            log.info("leader election: %s is now the leader", self.options.identity)
        else:
            log.info("leader election: %s is no longer the leader", self.options.identity)
        if self._on_change is not None:
            await self._on_change(leader)

    # -- one attempt ------------------------------------------------------------------
    def _holder(self) -> str:
        spec = (self._lease or {}).get("spec") or {}
        return str(spec.get("holderIdentity") or "")

    def _held_by_other(self) -> bool:
        holder = self._holder()
        return bool(holder) and holder != self.options.identity and self._lease_valid()

    def _lease_valid(self) -> bool:
        spec = (self._lease or {}).get("spec") or {}
        duration = spec.get("leaseDurationSeconds") or self.options.lease_duration_s
        return self._observed_at + float(duration) > time.monotonic()

    def _observe(self, lease: dict[str, Any]) -> None:
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("leaseDurationSeconds"),
                  spec.get("acquireTime"), spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed = record
            self._observed_at = time.monotonic()
        self._lease = lease

    def _note_error(self, error: str | None) -> None:
        if error != self._last_error:
            if error:
                log.warning("leader election: %s", error)
            self._last_error = error

    async def _try_acquire_or_renew(self) -> bool:
        """One client-go ``tryAcquireOrRenew``: True when this replica holds the Lease."""
        o = self.options
        timeout = max(0.5, min(o.retry_period_s * 2, o.renew_deadline_s))
        now = _micro_time(datetime.now(UTC))
        try:
            status, lease = await self.api.request("GET", self._item_path, timeout_s=timeout)
            if status == 404:
                body = {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": o.name, "namespace": o.namespace},
                    "spec": {"holderIdentity": o.identity,
                             "leaseDurationSeconds": math.ceil(o.lease_duration_s),
                             "acquireTime": now, "renewTime": now, "leaseTransitions": 0},
                }
                status, created = await self.api.request("POST", self._collection_path,
                                                         body=body, timeout_s=timeout)
                if 200 <= status < 300 and isinstance(created, dict):
                    self._observe(created)
                    self._note_error(None)
                    return True
                if status != 409:
                    self._note_error(f"cannot create Lease: HTTP {status}: "
                                     f"{status_reason(created)}")
                return False
            if not 200 <= status < 300 or not isinstance(lease, dict):
                self._note_error(f"cannot read Lease: HTTP {status}: {status_reason(lease)}")
                return False
            self._observe(lease)
            if self._held_by_other():
                self._note_error(None)
                return False
            spec = dict(lease.get("spec") or {})
            holder = str(spec.get("holderIdentity") or "")
            transitions = int(spec.get("leaseTransitions") or 0)
            if holder != o.identity:
                transitions += 1
                spec["acquireTime"] = now
            spec.update(holderIdentity=o.identity,
                        leaseDurationSeconds=math.ceil(o.lease_duration_s),
                        renewTime=now, leaseTransitions=transitions)
            if not spec.get("acquireTime"):
                spec["acquireTime"] = now
            updated = dict(lease)
            updated["spec"] = spec
            status, result = await self.api.request("PUT", self._item_path, body=updated,
                                                    timeout_s=timeout)
            if 200 <= status < 300 and isinstance(result, dict):
                self._observe(result)
                self._note_error(None)
                return True
            if status != 409:  # 409: another replica updated it first; not an error
                self._note_error(f"cannot update Lease: HTTP {status}: {status_reason(result)}")
            return False
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            self._note_error(f"Kubernetes API unreachable: {type(e).__name__}: {e}")
            return False

    async def _release(self) -> None:
        """Clear the holder so a standby takes over at once (client-go's release).

        A renewal cut short by the stop may have reached the API server after all, which
        leaves this replica a stale copy of the Lease: the release then conflicts (409);
        it re-reads the Lease and, if this replica still holds it, tries once more."""
        lease = self._lease
        if lease is None or self._holder() != self.options.identity:
            return
        for attempt in range(2):
            now = _micro_time(datetime.now(UTC))
            spec = dict(lease.get("spec") or {})
            spec.update(holderIdentity="", leaseDurationSeconds=1, renewTime=now,
                        acquireTime=now)
            body = dict(lease)
            body["spec"] = spec
            try:
                status, result = await self.api.request("PUT", self._item_path, body=body,
                                                        timeout_s=2.0)
                if status == 409 and attempt == 0:
                    status, fresh = await self.api.request("GET", self._item_path,
                                                           timeout_s=2.0)
                    if not (200 <= status < 300 and isinstance(fresh, dict)):
                        log.warning("leader election: could not release the Lease: HTTP %d "
                                    "re-reading it: %s", status, status_reason(fresh))
                        return
                    if str((fresh.get("spec") or {}).get("holderIdentity") or "") \
                            != self.options.identity:
                        return  # another replica holds it now: nothing to release
                    lease = fresh
                    continue
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                log.warning("leader election: could not release the Lease: %s", e)
                return
            break
        if 200 <= status < 300:
            log.info("leader election: released Lease %s/%s", self.options.namespace,
                     self.options.name)
        else:
            log.warning("leader election: could not release the Lease: HTTP %d: %s", status,
                        status_reason(result))
