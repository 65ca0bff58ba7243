"""The datastore: the live set of endpoints and their latest metrics.

Discovery replaces the endpoint set; the metrics layer replaces one endpoint's metrics.
Both swap frozen :class:`Endpoint` objects, so a :meth:`snapshot` taken at the start of a
scheduling cycle never changes under the scheduler. Listeners hear about additions (the
metrics scraper starts polling) and removals (the scraper stops; the prefix index forgets
the endpoint). Listeners run synchronously inside :meth:`set_endpoints`, after the new set
is in place, and must not raise (a raising listener is logged and skipped).

Routing candidates: :meth:`routable` is :meth:`snapshot` less the endpoints the metrics
scraper marked ``Metrics.unreachable`` (their metrics port refused or dropped the
connection: most likely a dead pod), computed once per snapshot and cached with it, so
the per-request cost is an identity check. Fail open: when every endpoint is
unreachable (a firewalled metrics port, a network partition between the EPP and all
pods, a wrong ``--model-server-metrics-port``), the scrape signal is no evidence about
the pods and all of them are routable, as if nothing were known; that is logged once
when it starts and once when it ends.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping

from epp.scheduling.types import Endpoint, Metrics

log = logging.getLogger(__name__)

RemovalListener = Callable[[Endpoint], None]
AdditionListener = Callable[[Endpoint], None]
Unsubscribe = Callable[[], None]


class Datastore:
    def __init__(self) -> None:
        self._endpoints: dict[str, Endpoint] = {}
        self._snapshot: tuple[Endpoint, ...] | None = ()
        # routable() is derived from one snapshot; recomputed when the snapshot changes.
        self._routable_of: tuple[Endpoint, ...] | None = None
        self._routable: tuple[Endpoint, ...] = ()
        self._failing_open = False
        self._removal_listeners: list[RemovalListener] = []
        self._addition_listeners: list[AdditionListener] = []
        self.synced = False

    def on_removed(self, listener: RemovalListener) -> Unsubscribe:
        """Call ``listener(endpoint)`` for each endpoint removed; returns an unsubscribe."""
        self._removal_listeners.append(listener)
        return lambda: _discard(self._removal_listeners, listener)

    def on_added(self, listener: AdditionListener) -> Unsubscribe:
        """Call ``listener(endpoint)`` for each endpoint key added (not for endpoints
        already present when subscribing); returns an unsubscribe."""
        self._addition_listeners.append(listener)
        return lambda: _discard(self._addition_listeners, listener)

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
            for listener in list(self._removal_listeners):
                try:
                    listener(ep)
                except Exception:  # a listener bug must not lose the update
                    log.exception("endpoint removal listener failed for %s", ep.key)
        for key in added:
            for listener in list(self._addition_listeners):
                try:
                    listener(new[key])
                except Exception:
                    log.exception("endpoint addition listener failed for %s", key)
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

    def update_metrics_many(self, updates: Mapping[str, Metrics]) -> int:
        """Swap in metrics for several endpoints with one snapshot invalidation.

        Keys no longer present are skipped. Returns how many endpoints were updated.
        """
        n = 0
        eps = self._endpoints
        for key, metrics in updates.items():
            ep = eps.get(key)
            if ep is not None:
                eps[key] = dataclasses.replace(ep, metrics=metrics)
                n += 1
        if n:
            self._snapshot = None
        return n

    def get(self, key: str) -> Endpoint | None:
        return self._endpoints.get(key)

    def snapshot(self) -> tuple[Endpoint, ...]:
        """An immutable view of every endpoint, in insertion order (cached until a change)."""
        snap = self._snapshot
        if snap is None:
            snap = self._snapshot = tuple(self._endpoints.values())
        return snap

    def routable(self) -> tuple[Endpoint, ...]:
        """The endpoints the scheduler may pick: :meth:`snapshot` without the unreachable
        ones — or all of them when every endpoint is unreachable (fail open; see the
        module doc). Same order as the snapshot; cached until the snapshot changes."""
        snap = self.snapshot()
        if snap is self._routable_of:
            return self._routable
        live = tuple(e for e in snap if not e.metrics.unreachable)
        if len(live) == len(snap):
            live = snap
        all_down = not live and bool(snap)
        if all_down:
            live = snap
        if all_down != self._failing_open:
            self._failing_open = all_down
            if all_down:
                log.warning("every endpoint (%d) is unreachable by its metrics scrape: "
                            "routing over all of them (fail open) until one answers again",
                            len(snap))
            else:
                log.info("fail open ended: routing over the %d reachable of %d endpoints",
                         len(live), len(snap))
        self._routable_of, self._routable = snap, live
        return live

    def unreachable_count(self) -> int:
        """How many endpoints are now marked unreachable by the metrics scraper."""
        return sum(1 for e in self.snapshot() if e.metrics.unreachable)

    def __len__(self) -> int:
        return len(self._endpoints)


def _discard(listeners: list[Callable[[Endpoint], None]],
             listener: Callable[[Endpoint], None]) -> None:
    try:
        listeners.remove(listener)
    except ValueError:
        pass
