"""Gang completeness: a multi-node group takes traffic only when all of it runs.

One model replica served by several pods (a leader and its workers) cannot serve while a
worker is missing, yet its leader may still be Ready. In Kubernetes mode the EPP
therefore drops the pool pods of an incomplete gang. Two ways such groups are described:

- **LeaderWorkerSet**: every pod of a group carries the label
  ``leaderworkerset.sigs.k8s.io/group-key`` and the annotation
  ``leaderworkerset.sigs.k8s.io/size`` (pods in the group, leader included). Complete:
  at least ``size`` Ready pods with that group key.
- **Grove**: pods carry ``grove.io/podgang: NAME``; that PodGang
  (``scheduler.grove.io/v1alpha1``) lists its pod groups, each with ``podReferences``
  and ``minReplicas``. Complete: every pod group has at least ``minReplicas`` Ready pods
  among its references — Grove's own rule (below it, Grove starts gang termination).

The pool's selector usually selects only leaders, so the members are watched apart from
the pool's pods: the namespace's pods carrying the group label (one watch per scheme,
started the first time a pool pod carries that label — pools without gangs pay
nothing) and, for Grove, the PodGangs. Pods without gang labels are never affected.

When PodGangs cannot be read (403: no RBAC; 404: Grove's CRDs not installed) Grove gangs
are not checked, and a warning says so once. A pod naming a PodGang that does not exist
counts as incomplete: Grove creates the PodGang before its pods.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from epp import keys
from epp.discovery.kubeclient import KubeApi
from epp.discovery.reflector import Reflector, ReflectorOptions

log = logging.getLogger(__name__)

JsonObj = Mapping[str, Any]


def pod_ready(pod: JsonObj) -> bool:
    """Condition ``Ready=True`` and not being deleted (terminating pods take no traffic)."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


class GangPod(Protocol):
    """What the tracker needs of a pool pod (discovery's PodInfo)."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    lws_size: str | None


P = TypeVar("P", bound=GangPod)


@dataclass(frozen=True)
class _Member:
    ready: bool
    lws_group: str | None


@dataclass(frozen=True)
class _PodGroup:
    name: str
    pods: tuple[str, ...]  # "namespace/name"
    min_replicas: int


def _member(pod: JsonObj) -> _Member:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    group = labels.get(keys.LABEL_LWS_GROUP_KEY)
    return _Member(pod_ready(pod), str(group) if group is not None else None)


def podgang_groups(obj: JsonObj) -> tuple[_PodGroup, ...]:
    """A PodGang → its pod groups (the PodGang cache transform). Malformed parts are
    read as Grove's API defaults them: no references, ``minReplicas`` 0."""
    ns = str((obj.get("metadata") or {}).get("namespace") or "")
    out: list[_PodGroup] = []
    for i, g in enumerate((obj.get("spec") or {}).get("podgroups") or []):
        if not isinstance(g, Mapping):
            continue
        refs = []
        for r in g.get("podReferences") or []:
            if isinstance(r, Mapping) and r.get("name"):
                refs.append(f"{r.get('namespace') or ns}/{r['name']}")
        try:
            minimum = int(g.get("minReplicas") or 0)
        except (TypeError, ValueError):
            minimum = 0
        out.append(_PodGroup(str(g.get("name") or f"#{i}"), tuple(refs), minimum))
    return tuple(out)


def lws_size(value: str | None) -> int | None:
    """The LWS size annotation as an int (None: absent or unusable → not checked)."""
    if value is None or not value.strip().isdigit():
        return None
    return int(value)


class GangTracker:
    """Decides which pool pods belong to an incomplete gang (see the module docstring).

    :meth:`observe` starts the member watches the pool's pods need; :attr:`synced` says
    whether every started watch has listed once; :meth:`admit` filters pods.
    """

    def __init__(self, api: KubeApi, namespace: str, on_change: Callable[[], None],
                 options: ReflectorOptions | None = None) -> None:
        self.api = api
        self.namespace = namespace
        self._on_change = on_change
        self._options = options or ReflectorOptions()
        self._lws: Reflector | None = None
        self._grove_pods: Reflector | None = None
        self._podgangs: Reflector | None = None
        self._warned_podgangs = False
        self.excluded: dict[str, str] = {}  # "namespace/pod" → why (the latest admit)

    # -- lifecycle --------------------------------------------------------------------
    def _members(self, name: str, label: str) -> Reflector:
        r = Reflector(self.api, f"/api/v1/namespaces/{self.namespace}/pods", name=name,
                      label_selector=label, transform=_member, on_change=self._on_change,
                      options=self._options)
        r.start()
        log.info("multi-node gangs: watching pods with label %s in %s", label, self.namespace)
        return r

    def observe(self, pods: Iterable[GangPod]) -> None:
        """Start the watches that ``pods`` (the pool's) need, once each."""
        for p in pods:
            if self._lws is None and keys.LABEL_LWS_GROUP_KEY in p.labels \
                    and lws_size(p.lws_size) is not None:
                self._lws = self._members("lws-members", keys.LABEL_LWS_GROUP_KEY)
            if self._grove_pods is None and keys.LABEL_GROVE_PODGANG in p.labels:
                self._grove_pods = self._members("podgang-members", keys.LABEL_GROVE_PODGANG)
                self._podgangs = Reflector(
                    self.api, f"/apis/{keys.K8S_PODGANG_GROUP_VERSION}/namespaces/"
                    f"{self.namespace}/{keys.K8S_PODGANG_PLURAL}", name="podgangs",
                    transform=podgang_groups, on_change=self._on_change,
                    options=self._options)
                self._podgangs.start()

    async def stop(self) -> None:
        for r in (self._lws, self._grove_pods, self._podgangs):
            if r is not None:
                await r.stop()
        self._lws = self._grove_pods = self._podgangs = None

    @property
    def synced(self) -> bool:
        """Every started watch has listed (PodGangs: or cannot be read)."""
        for r in (self._lws, self._grove_pods):
            if r is not None and not r.synced:
                return False
        pg = self._podgangs
        return pg is None or pg.synced or pg.forbidden or pg.not_found

    # -- decisions --------------------------------------------------------------------
    def _podgangs_readable(self) -> bool:
        pg = self._podgangs
        if pg is None:
            return False
        if pg.synced:
            return True
        if not self._warned_podgangs:
            self._warned_podgangs = True
            why = "forbidden (grant get/list/watch on podgangs.scheduler.grove.io)" \
                if pg.forbidden else "not served (Grove's CRDs are not installed)"
            log.warning("cannot list PodGangs: %s; Grove gang completeness is not checked",
                        why)
        return False

    def admit(self, pods: Iterable[P]) -> list[P]:
        """``pods`` without those whose gang is incomplete; logs every change."""
        lws_ready: Counter[str] = Counter()
        if self._lws is not None:
            for m in self._lws.objects.values():
                if m.ready and m.lws_group is not None:
                    lws_ready[m.lws_group] += 1
        grove_ready: set[str] | None = None
        gangs: Mapping[str, tuple[_PodGroup, ...]] = {}
        if self._grove_pods is not None and self._podgangs_readable():
            assert self._podgangs is not None
            grove_ready = {k for k, m in self._grove_pods.objects.items() if m.ready}
            gangs = self._podgangs.objects
        out: list[P] = []
        excluded: dict[str, str] = {}
        for p in pods:
            why = self._lws_incomplete(p, lws_ready)
            if why is None and grove_ready is not None:
                why = self._grove_incomplete(p, gangs, grove_ready)
            key = f"{p.namespace}/{p.name}"
            if why is None:
                out.append(p)
                if key in self.excluded:
                    log.info("pod %s takes traffic again: its gang is complete", key)
            else:
                excluded[key] = why
                if self.excluded.get(key) != why:
                    log.warning("pod %s takes no traffic: %s", key, why)
        self.excluded = excluded
        return out

    @staticmethod
    def _lws_incomplete(p: GangPod, ready: Counter[str]) -> str | None:
        group = p.labels.get(keys.LABEL_LWS_GROUP_KEY)
        size = lws_size(p.lws_size)
        if group is None or size is None:
            return None
        if ready[group] >= size:
            return None
        return f"LeaderWorkerSet group {group} has {ready[group]} of {size} pods Ready"

    @staticmethod
    def _grove_incomplete(p: GangPod, gangs: Mapping[str, tuple[_PodGroup, ...]],
                          ready: set[str]) -> str | None:
        gang = p.labels.get(keys.LABEL_GROVE_PODGANG)
        if gang is None:
            return None
        groups = gangs.get(f"{p.namespace}/{gang}")
        if groups is None:
            return f"PodGang {gang} not found"
        for g in groups:
            n = sum(1 for ref in g.pods if ref in ready)
            if n < g.min_replicas:
                return (f"PodGang {gang}: pod group {g.name} has {n} of {g.min_replicas} "
                        "required pods Ready")
        return None
