"""The datastore: the live set of endpoints and their latest metrics.

Discovery replaces the endpoint set; the metrics layer replaces one endpoint's metrics.
Both swap frozen :class:`Endpoint` objects, so a :meth:`snapshot` taken at the start of a
scheduling cycle never changes under the scheduler. Listeners hear about removals (e.g.
the prefix index forgets a removed endpoint).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable

from epp.scheduling.types import Endpoint, Metrics

log = logging.getLogger(__name__)

RemovalListener = Callable[[Endpoint], None]


class Datastore:
    def __init__(self) -> None:
        self._endpoints: dict[str, Endpoint] = {}
        self._snapshot: tuple[Endpoint, ...] | None = ()
        self._removal_listeners: list[RemovalListener] = []
        self.synced = False

    def on_removed(self, listener: RemovalListener) -> None:
        self._removal_listeners.append(listener)

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> tuple[list[str], list[str]]:
        """Replace the whole set. Unchanged endpoints keep their metrics.

        Returns (added keys, removed keys). Marks the store synced.
        """
        new: dict[str, Endpoint] = {}
        for ep in endpoints:
            old = self._endpoints.get(ep.key)
            if old is not None:
                ep = dataclasses.replace(ep, metrics=old.metrics)
            new[ep.key] = ep
        added = [k for k in new if k not in self._endpoints]
        removed = [self._endpoints[k] for k in self._endpoints if k not in new]
        self._endpoints = new
        self._snapshot = None
        self.synced = True
        for ep in removed:
            for listener in self._removal_listeners:
                try:
                    listener(ep)
                except Exception:  # a listener bug must not lose the update
                    log.exception("endpoint removal listener failed for %s", ep.key)
        if added or removed:
            log.info("endpoints: +%s -%s (now %d)", added, [e.key for e in removed], len(new))
        return added, [e.key for e in removed]

    def update_metrics(self, key: str, metrics: Metrics) -> bool:
        """Swap in new metrics for ``key``; False if the endpoint is gone."""
        ep = self._endpoints.get(key)
        if ep is None:
            return False
        self._endpoints[key] = dataclasses.replace(ep, metrics=metrics)
        self._snapshot = None
        return True

    def get(self, key: str) -> Endpoint | None:
        return self._endpoints.get(key)

    def snapshot(self) -> tuple[Endpoint, ...]:
        """An immutable view of every endpoint, in insertion order (cached until a change)."""
        snap = self._snapshot
        if snap is None:
            snap = self._snapshot = tuple(self._endpoints.values())
        return snap

    def __len__(self) -> int:
        return len(self._endpoints)
