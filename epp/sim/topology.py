"""Where a simulated pod sits, and how far its P/D peers are (for KV-transfer pricing).

A pod's *topology* is a small mapping of level → value over :data:`LEVELS`
(``node``, ``rack``, ``block``, ``zone``). A decode pod knows its own topology (from
``--topology rack=r1,block=b1`` or from its entry in the endpoints file) and its peers'
(from the endpoints file, the same YAML file ``epp serve --endpoints-file`` reads:
``endpoints`` with ``address``, ``port``, ``labels``, ``nodeName``, and ``nodes`` with
each node's labels). The file is re-read when it changes.

In the file, a level's value is looked up on the pod's labels first, then on its node's
labels, under these keys (:data:`DEFAULT_LEVEL_KEYS`, overridable):

- ``node``: ``kubernetes.io/hostname``, else the endpoint's ``nodeName``;
- ``rack``: ``topology.kubernetes.io/rack``;
- ``block``: ``topology.kubernetes.io/block``;
- ``zone``: ``topology.kubernetes.io/zone``.

:func:`distance` names the closest level two topologies share (``node`` … ``zone``),
``other`` when both are known but share none, and None when either is unknown.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final

__all__ = [
    "DEFAULT_LEVEL_KEYS",
    "DISTANCES",
    "LEVELS",
    "PeerTopology",
    "Topology",
    "distance",
    "parse_level_costs",
    "parse_topology",
]

log = logging.getLogger(__name__)

Topology = Mapping[str, str]

LEVELS: Final[tuple[str, ...]] = ("node", "rack", "block", "zone")
"""Topology levels, closest first."""
DISTANCES: Final[tuple[str, ...]] = (*LEVELS, "other")
"""What :func:`distance` can answer (besides None), closest first."""

DEFAULT_LEVEL_KEYS: Final[Mapping[str, str]] = {
    "node": "kubernetes.io/hostname",
    "rack": "topology.kubernetes.io/rack",
    "block": "topology.kubernetes.io/block",
    "zone": "topology.kubernetes.io/zone",
}


def parse_topology(text: str) -> dict[str, str]:
    """``rack=r1,block=b1,zone=z1`` → ``{"rack": "r1", …}``; ValueError on a bad item.

    Keys are the level names of :data:`LEVELS`."""
    out: dict[str, str] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"topology item {item!r}: expected LEVEL=VALUE")
        if key not in LEVELS:
            raise ValueError(f"topology item {item!r}: level must be one of {', '.join(LEVELS)}")
        out[key] = value
    return out


def parse_level_costs(text: str) -> dict[str, float]:
    """``node=0.0002,rack=0.0005,…`` → ``{"node": 0.0002, …}`` over :data:`DISTANCES`."""
    out: dict[str, float] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in DISTANCES:
            raise ValueError(f"KV-transfer cost item {item!r}: expected LEVEL=MS with LEVEL one "
                             f"of {', '.join(DISTANCES)}")
        try:
            cost = float(value)
        except ValueError:
            raise ValueError(f"KV-transfer cost item {item!r}: {value!r} is not a number") from None
        if cost < 0:
            raise ValueError(f"KV-transfer cost item {item!r}: must be >= 0")
        out[key] = cost
    return out


def distance(a: Topology | None, b: Topology | None) -> str | None:
    """The closest level ``a`` and ``b`` share; ``other`` if none; None if either is
    unknown (empty or None)."""
    if not a or not b:
        return None
    for level in LEVELS:
        va = a.get(level)
        if va is not None and va == b.get(level):
            return level
    return "other"


class PeerTopology:
    """Topologies of the pods in an endpoints file, by ``address:port``, re-read when the
    file changes (checked at most every ``min_check_s`` seconds, on lookup).

    A file that cannot be read or parsed keeps the last good contents (logged once).
    """

    def __init__(self, path: Path, level_keys: Mapping[str, str] | None = None,
                 min_check_s: float = 0.5) -> None:
        self.path = path
        self.level_keys = dict(DEFAULT_LEVEL_KEYS)
        if level_keys:
            unknown = set(level_keys) - set(LEVELS)
            if unknown:
                raise ValueError(f"topology label keys: unknown level(s) {sorted(unknown)}")
            self.level_keys.update(level_keys)
        self.min_check_s = min_check_s
        self._stamp: tuple[int, int, int] | None = None
        self._checked = float("-inf")
        self._by_key: dict[str, dict[str, str]] = {}
        self._by_port: dict[int, list[str]] = {}
        self._last_error: str | None = None
        self._load(force=True)

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load(self, force: bool = False) -> None:
        """Re-read the file if it changed. ``force``: read it now and raise ValueError if
        it cannot be read or parsed (startup); otherwise errors keep the last good set."""
        now = time.monotonic()
        if not force and now - self._checked < self.min_check_s:
            return
        self._checked = now
        stamp = self._file_stamp()
        if stamp == self._stamp and not force:
            return
        from epp.discovery.static import read_endpoints_file
        from epp.errors import ConfigError

        try:
            endpoints = read_endpoints_file(self.path)
        except ConfigError as exc:
            if force:
                raise ValueError(str(exc)) from None
            if str(exc) != self._last_error:
                log.error("peer topology file change ignored, keeping the last good one: %s",
                          exc)
                self._last_error = str(exc)
            self._stamp = stamp
            return
        self._last_error = None
        self._stamp = stamp
        by_key: dict[str, dict[str, str]] = {}
        by_port: dict[int, list[str]] = {}
        for e in endpoints:
            topo: dict[str, str] = {}
            for level, key in self.level_keys.items():
                value = e.labels.get(key)
                if value is None:
                    value = e.node_labels.get(key)
                if value is None and level == "node" and e.node_name:
                    value = e.node_name
                if value is not None:
                    topo[level] = str(value)
            by_key[e.key] = topo
            by_port.setdefault(e.port, []).append(e.key)
        self._by_key, self._by_port = by_key, by_port

    def lookup(self, host_port: str) -> dict[str, str] | None:
        """The topology of the endpoint ``address:port``; None when it is not listed."""
        self._load()
        return self._by_key.get(host_port)

    def own(self, address: str, port: int) -> dict[str, str] | None:
        """This pod's entry: ``address:port``, else the only entry with this port."""
        topo = self.lookup(f"{address}:{port}")
        if topo is not None:
            return topo
        keys = self._by_port.get(port, [])
        return self._by_key[keys[0]] if len(keys) == 1 else None
