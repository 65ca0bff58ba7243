"""Kubernetes endpoint discovery: an InferencePool (or a fixed selector), its Pods, Nodes.

Two modes, as GIE's EPP has them:

- **pool** (``--pool-name``/``--pool-namespace``/``--pool-group``): watch the
  InferencePool (``inference.networking.k8s.io/v1``: ``spec.selector.matchLabels``,
  ``spec.targetPorts[].number``; the older ``inference.networking.x-k8s.io/v1alpha2``
  shape ``spec.selector``/``spec.targetPortNumber`` is read too) and the Pods its selector
  matches. A selector change re-lists the Pods; a target-port change recomputes the
  endpoints; a deleted pool leaves no endpoints (and the server reports not ready,
  like GIE, until it comes back).
- **standalone** (``--endpoint-selector k=v,… --endpoint-target-ports 8000,…``): the same
  without the CRD.

Endpoints (GIE's rules): only Pods that are Ready (condition ``Ready=True``), not being
deleted, and have a ``status.podIP``; one endpoint per target port — a data-parallel
rank — named ``<pod>-rank-<index of the port in targetPorts>``; the pod annotation
``inference.networking.k8s.io/active-ports: "8000,8002"`` narrows the ports that take
traffic. Each endpoint carries the pod's namespace, labels and ``spec.nodeName``; a Node
watch supplies that node's labels (topology: rack, block, zone…). Without RBAC for Nodes
(403) discovery goes on without node labels and says so once. Pods of a multi-node gang
(LeaderWorkerSet group, Grove PodGang) that is not complete take no traffic
(:mod:`epp.discovery.gangs`).

In pool mode the source also watches the InferenceObjectives and InferenceModelRewrites
of the pool's namespace (``inference.networking.x-k8s.io/v1alpha2``) that reference the
pool — ``spec.poolRef.name`` is the pool's name and ``spec.poolRef.group`` (default
``inference.networking.k8s.io``) is ``--pool-group``, GIE's reconciler predicate; an
object being deleted (``metadata.deletionTimestamp``) counts as gone — into an
:class:`~epp.datastore.objectives.ObjectiveStore`. Without the CRD (404) or without RBAC
for it (403) there is nothing to watch: the store stays empty (every request has priority
0, no rewrite), the source says so once and keeps retrying with backoff, so a CRD
installed later is picked up. Standalone mode watches neither, as GIE.

Writes go to the :class:`~epp.datastore.store.Datastore` through ``set_endpoints`` from
one task, after a short debounce (``debounce_s``) so a burst of watch events costs one
recomputation; an unchanged result is not written again. ``synced`` turns True after
the first complete picture (pool, pods, nodes and, in pool mode, the objectives and
model rewrites all listed, or found absent) has been written.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from epp import keys
from epp.datastore.objectives import (
    InvalidObject,
    ModelRewrite,
    Objective,
    ObjectiveStore,
    parse_object,
    selects_pool,
)
from epp.datastore.store import Datastore
from epp.discovery.gangs import GangTracker, pod_ready
from epp.discovery.kubeclient import ACCEPT_METADATA, ACCEPT_METADATA_LIST, JsonObj, KubeApi
from epp.discovery.reflector import Reflector, ReflectorOptions
from epp.errors import ConfigError
from epp.scheduling.types import Endpoint

log = logging.getLogger(__name__)

StateCallback = Callable[[], Awaitable[None]]

_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


# ---------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolSpec:
    """What selects the pool's endpoints: equality label selector and target ports."""

    selector: Mapping[str, str]
    target_ports: tuple[int, ...]

    def selector_string(self) -> str:
        """The selector as a ``labelSelector`` query value (``k=v,k2=v2``, sorted)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.selector.items())


@dataclass(frozen=True)
class PodInfo:
    """The part of a Pod discovery needs (the cache keeps only this, not whole Pods)."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    ip: str
    ready: bool
    node_name: str | None
    active_ports: str | None  # the raw annotation value, None when absent
    lws_size: str | None = None  # LeaderWorkerSet's group-size annotation, raw
    host_ip: str = ""  # status.hostIP: the node's address (dcgm-data-source useNodeAddress)


def parse_selector(text: str, where: str = "--endpoint-selector") -> dict[str, str]:
    """Parse ``k=v[,k2=v2…]`` (``==`` accepted), as GIE's ``--endpoint-selector``."""
    out: dict[str, str] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("==") if "==" in item else item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError(f"{where}: {item!r} is not key=value (only equality "
                              "selectors are supported, e.g. app=vllm,env=prod)")
        if not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
            raise ConfigError(f"{where}: {item!r} is not a valid label key=value")
        if key in out and out[key] != value:
            raise ConfigError(f"{where}: {key!r} given twice with different values")
        out[key] = value
    if not out:
        raise ConfigError(f"{where}: empty selector (expected key=value[,key=value…])")
    return out


def parse_target_ports(text: str, where: str = "--endpoint-target-ports") -> tuple[int, ...]:
    """Parse ``8000[,8001…]``: distinct ports 1..65535, order kept (it sets rank indexes)."""
    ports: list[int] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if not item.isdigit() or not 0 < int(item) < 65536:
            raise ConfigError(f"{where}: {item!r} is not a port number 1..65535")
        if int(item) in ports:
            raise ConfigError(f"{where}: port {item} given twice")
        ports.append(int(item))
    if not ports:
        raise ConfigError(f"{where}: no ports given (expected e.g. 8000 or 8000,8001)")
    return tuple(ports)


def resolve_namespace(flag: str | None) -> str:
    """``--pool-namespace``, else ``$NAMESPACE``, else ``default`` (GIE's order)."""
    return flag or os.environ.get(keys.ENV_NAMESPACE) or "default"


def pool_api_path(group: str, namespace: str) -> str:
    """The InferencePool collection path for ``group`` (v1 or the older v1alpha2 group)."""
    if group == keys.K8S_POOL_GROUP:
        version = keys.K8S_POOL_VERSION
    elif group == keys.K8S_POOL_GROUP_ALPHA:
        version = keys.K8S_POOL_VERSION_ALPHA
    else:
        raise ConfigError(f"--pool-group {group!r}: expected {keys.K8S_POOL_GROUP} or "
                          f"{keys.K8S_POOL_GROUP_ALPHA}")
    return f"/apis/{group}/{version}/namespaces/{namespace}/{keys.K8S_POOL_PLURAL}"


def objectives_api_path(plural: str, namespace: str) -> str:
    """The collection path of InferenceObjectives or InferenceModelRewrites (``plural``)."""
    return f"/apis/{keys.K8S_OBJECTIVE_API_VERSION}/namespaces/{namespace}/{plural}"


class InvalidPool(ValueError):
    """An InferencePool object this EPP cannot use (the message says why)."""


def parse_pool(obj: Mapping[str, Any]) -> PoolSpec:
    """An InferencePool object → :class:`PoolSpec`; :class:`InvalidPool` when malformed.

    v1: ``spec.selector.matchLabels`` and ``spec.targetPorts: [{number}]``;
    v1alpha2: ``spec.selector`` (a map) and ``spec.targetPortNumber``.
    """
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise InvalidPool("spec missing")
    sel = spec.get("selector") or {}
    if not isinstance(sel, Mapping):
        raise InvalidPool("spec.selector is not a mapping")
    if "matchLabels" in sel or "matchExpressions" in sel:
        if sel.get("matchExpressions"):
            raise InvalidPool("spec.selector.matchExpressions is not supported")
        sel = sel.get("matchLabels") or {}
        if not isinstance(sel, Mapping):
            raise InvalidPool("spec.selector.matchLabels is not a mapping")
    selector = {str(k): str(v) for k, v in sel.items()}
    ports: list[int] = []
    raw_ports = spec.get("targetPorts")
    if isinstance(raw_ports, list):
        for p in raw_ports:
            num = p.get("number") if isinstance(p, Mapping) else p
            if isinstance(num, bool) or not isinstance(num, int) or not 0 < num < 65536:
                raise InvalidPool(f"spec.targetPorts: bad port {p!r}")
            if num not in ports:
                ports.append(num)
    elif isinstance(spec.get("targetPortNumber"), int):
        ports.append(int(spec["targetPortNumber"]))
    if not ports:
        raise InvalidPool("no target ports (spec.targetPorts)")
    return PoolSpec(MappingProxyType(selector), tuple(ports))


def pod_info(pod: JsonObj) -> PodInfo:
    """Reduce a Pod object to :class:`PodInfo` (the reflector's cache transform)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    annotations = meta.get("annotations") or {}
    return PodInfo(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        labels=MappingProxyType({str(k): str(v) for k, v in (meta.get("labels") or {}).items()}),
        ip=str(status.get("podIP") or ""),
        ready=pod_ready(pod),
        node_name=spec.get("nodeName") or None,
        active_ports=annotations.get(keys.ANNOTATION_ACTIVE_PORTS),
        lws_size=annotations.get(keys.ANNOTATION_LWS_SIZE),
        host_ip=str(status.get("hostIP") or ""),
    )


def node_labels(node: JsonObj) -> Mapping[str, str]:
    """A Node (or its PartialObjectMetadata) → its labels (the node cache transform)."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    return MappingProxyType({str(k): str(v) for k, v in labels.items()})


def active_ports(annotation: str | None, target_ports: Iterable[int]) -> set[int]:
    """GIE's rule: no annotation → every target port; else the listed ports that are
    target ports (unparseable items ignored)."""
    ports = set(target_ports)
    if annotation is None:
        return ports
    out: set[int] = set()
    for item in annotation.split(","):
        item = item.strip()
        if item.isdigit() and int(item) in ports:
            out.add(int(item))
    return out


def build_endpoints(pods: Iterable[PodInfo], pool: PoolSpec,
                    nodes: Mapping[str, Mapping[str, str]]) -> list[Endpoint]:
    """The endpoints of ``pods`` under ``pool``, ordered by pod name then rank.

    ``nodes`` maps node name → labels. Two pods claiming one ``ip:port`` (impossible in
    a real cluster, possible with host networking) → the first by name wins.
    """
    out: list[Endpoint] = []
    seen: set[str] = set()
    for pod in sorted(pods, key=lambda p: (p.namespace, p.name)):
        if not pod.ready or not pod.ip or not pool.matches(pod.labels):
            continue
        active = active_ports(pod.active_ports, pool.target_ports)
        topo = nodes.get(pod.node_name, MappingProxyType({})) if pod.node_name else \
            MappingProxyType({})
        for idx, port in enumerate(pool.target_ports):
            if port not in active:
                continue
            ep = Endpoint(name=f"{pod.name}-rank-{idx}", namespace=pod.namespace,
                          address=pod.ip, port=port, labels=pod.labels,
                          node_name=pod.node_name, node_labels=topo,
                          node_address=pod.host_ip or None)
            if ep.key in seen:
                log.warning("pod %s/%s: endpoint %s already taken by another pod; skipped",
                            pod.namespace, pod.name, ep.key)
                continue
            seen.add(ep.key)
            out.append(ep)
    return out


def _signature(eps: Iterable[Endpoint]) -> tuple[Any, ...]:
    return tuple((e.key, e.name, e.namespace, tuple(sorted(e.labels.items())), e.node_name,
                  tuple(sorted(e.node_labels.items())), e.node_address) for e in eps)


# ---------------------------------------------------------------------------------------
# The source
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KubernetesOptions:
    """Where to look. Exactly one of ``pool_name`` (pool mode) or ``standalone``."""

    namespace: str
    pool_name: str | None = None
    pool_group: str = keys.K8S_POOL_GROUP
    standalone: PoolSpec | None = None
    watch_nodes: bool = True
    debounce_s: float = 0.05
    reflector: ReflectorOptions = field(default_factory=ReflectorOptions)

    def __post_init__(self) -> None:
        if (self.pool_name is None) == (self.standalone is None):
            raise ConfigError("Kubernetes discovery needs exactly one of --pool-name or "
                              "--endpoint-selector/--endpoint-target-ports")
        if self.pool_name is not None:
            pool_api_path(self.pool_group, self.namespace)  # validates the group


class KubernetesSource:
    """Keeps the datastore equal to the ready endpoints of the pool.

    Lifecycle: :meth:`start` (returns at once; listing happens in tasks), :meth:`stop`.
    ``on_state_change`` is awaited (from this source's task) whenever ``ready`` may have
    changed; the server uses it to update its health status.
    """

    def __init__(self, api: KubeApi, store: Datastore, options: KubernetesOptions,
                 on_state_change: StateCallback | None = None,
                 objectives: ObjectiveStore | None = None) -> None:
        """``objectives``: where the pool's InferenceObjectives and InferenceModelRewrites
        go (pool mode only; None: they are not watched)."""
        self.api = api
        self.store = store
        self.options = options
        self.objectives = objectives
        self._on_state_change = on_state_change
        self.pool: PoolSpec | None = options.standalone
        self.synced = False
        self.pool_error: str | None = None
        self._pool_reflector: Reflector | None = None
        self._pods: Reflector | None = None
        self._nodes: Reflector | None = None
        self._objective_reflectors: list[Reflector] = []  # objectives, then rewrites
        self._objectives_dirty = False
        self._absent: set[str] = set()  # reflector names already reported 404/403
        self._dirty = asyncio.Event()
        self.gangs = GangTracker(api, options.namespace, self._dirty.set, options.reflector)
        self._task: asyncio.Task[None] | None = None
        self._last_sig: tuple[Any, ...] | None = None
        self._last_ready: bool | None = None
        self._warned_nodes = False
        self.applied = 0  # datastore writes (observability, tests)

    # -- state ------------------------------------------------------------------------
    @property
    def pool_present(self) -> bool:
        """True when the pool exists and is usable (always, in standalone mode)."""
        return self.pool is not None

    @property
    def ready(self) -> bool:
        """Synced and the pool exists: what readiness reports (with leadership)."""
        return self.synced and self.pool_present

    def describe(self) -> str:
        o = self.options
        if o.pool_name:
            return f"InferencePool {o.namespace}/{o.pool_name} ({o.pool_group})"
        assert o.standalone is not None
        return (f"pods in {o.namespace} with {o.standalone.selector_string()} on ports "
                f"{','.join(map(str, o.standalone.target_ports))}")

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        o = self.options
        if o.pool_name is not None:
            self._pool_reflector = Reflector(
                self.api, pool_api_path(o.pool_group, o.namespace), name="inferencepool",
                field_selector=f"metadata.name={o.pool_name}", on_change=self._dirty.set,
                options=o.reflector)
            self._pool_reflector.start()
            if self.objectives is not None:
                self._start_objectives()
        if o.watch_nodes:
            self._nodes = Reflector(self.api, "/api/v1/nodes", name="nodes",
                                    transform=node_labels, accept_list=ACCEPT_METADATA_LIST,
                                    accept_watch=ACCEPT_METADATA, on_change=self._dirty.set,
                                    options=o.reflector)
            self._nodes.start()
        if self.pool is not None:
            self._start_pods(self.pool)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="k8s-discovery")
        log.info("discovering endpoints from %s via %s", self.describe(), self.api.describe)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for r in (self._pool_reflector, self._pods, self._nodes, *self._objective_reflectors):
            if r is not None:
                await r.stop()
        self._pool_reflector = self._pods = self._nodes = None
        self._objective_reflectors = []
        await self.gangs.stop()

    async def wait_ready(self, timeout: float) -> bool:
        """Wait until ``ready`` (tests, tools); False on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.ready:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    # -- internals --------------------------------------------------------------------
    def _start_pods(self, pool: PoolSpec) -> None:
        self._pods = Reflector(
            self.api, f"/api/v1/namespaces/{self.options.namespace}/pods", name="pods",
            label_selector=pool.selector_string() or None, transform=pod_info,
            on_change=self._dirty.set, options=self.options.reflector)
        self._pods.start()

    def _start_objectives(self) -> None:
        ns = self.options.namespace
        for plural in (keys.K8S_OBJECTIVE_PLURAL, keys.K8S_MODEL_REWRITE_PLURAL):
            r = Reflector(self.api, objectives_api_path(plural, ns), name=plural,
                          transform=self._parse_objective_object,
                          on_change=self._objectives_changed, options=self.options.reflector)
            self._objective_reflectors.append(r)
            r.start()

    def _parse_objective_object(self, obj: JsonObj) -> Objective | ModelRewrite | None:
        """The objective reflectors' cache transform, run once per object version: the
        parsed object, or None when it does not count — being deleted (GIE: a
        DeletionTimestamp is a delete), another pool's (GIE's reconciler predicate:
        poolRef name and group), or unusable (logged)."""
        meta = obj.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return None
        o = self.options
        assert o.pool_name is not None
        try:
            parsed = parse_object(obj, f"{meta.get('namespace', '')}/{meta.get('name', '')}",
                                  strict=False)
        except InvalidObject as e:
            log.warning("ignored: %s", e)
            return None
        return parsed if selects_pool(parsed.pool_ref, o.pool_name, o.pool_group) else None

    def _objectives_changed(self) -> None:
        self._objectives_dirty = True
        self._dirty.set()

    def _sync_objectives(self) -> None:
        """Copy the objective reflectors' caches to the store (after the debounce, so a
        burst of events costs one copy)."""
        if not self._objectives_dirty or self.objectives is None:
            return
        self._objectives_dirty = False
        objectives, rewrites = self._objective_reflectors
        self.objectives.replace_objectives(
            x for x in objectives.objects.values() if isinstance(x, Objective))
        self.objectives.replace_rewrites(
            x for x in rewrites.objects.values() if isinstance(x, ModelRewrite))
        for r in self._objective_reflectors:
            self._report_absent(r)

    def _report_absent(self, r: Reflector) -> None:
        """Say once that a kind cannot be watched (CRD not installed, or no RBAC)."""
        if not (r.not_found or r.forbidden):
            self._absent.discard(r.name)
            return
        if r.name in self._absent:
            return
        self._absent.add(r.name)
        if r.not_found:
            log.warning("%s: the CRD (%s) is not installed: none are used (every request "
                        "has priority 0, no model rewrite); retrying with backoff",
                        r.name, keys.K8S_OBJECTIVE_API_VERSION)
        else:
            log.warning("cannot list %s (403 Forbidden): none are used; grant get/list/"
                        "watch on %s (group %s) to the EPP's service account", r.name,
                        r.name, keys.K8S_OBJECTIVE_API_VERSION.split("/")[0])

    def _current_pool(self) -> PoolSpec | None:
        """The pool as the pool reflector sees it now (None: absent or unusable)."""
        r = self._pool_reflector
        assert r is not None
        objs = list(r.objects.values())
        if not objs:
            self._set_pool_error("not found")
            return None
        try:
            pool = parse_pool(objs[0])
        except ValueError as e:
            self._set_pool_error(f"unusable: {e}")
            return None
        self._set_pool_error(None)
        return pool

    def _set_pool_error(self, error: str | None) -> None:
        if error != self.pool_error:
            if error is not None:
                log.error("InferencePool %s/%s %s: no endpoints until it is fixed",
                          self.options.namespace, self.options.pool_name, error)
            self.pool_error = error

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            if self.options.debounce_s > 0:
                await asyncio.sleep(self.options.debounce_s)
            self._dirty.clear()
            await self._reconcile()

    async def _reconcile(self) -> None:
        self._sync_objectives()
        if self._pool_reflector is not None:
            if not self._pool_reflector.synced:
                return
            pool = self._current_pool()
            if pool != self.pool:
                old = self.pool
                self.pool = pool
                if old is None or pool is None or old.selector != pool.selector:
                    if self._pods is not None:
                        await self._pods.stop()
                        self._pods = None
                    if pool is not None:
                        log.info("InferencePool selector %s, target ports %s: (re)listing "
                                 "pods", pool.selector_string(), list(pool.target_ports))
                        self._start_pods(pool)
                else:
                    log.info("InferencePool target ports now %s", list(pool.target_ports))
        nodes = self._nodes
        if nodes is not None and nodes.forbidden and not self._warned_nodes:
            self._warned_nodes = True
            log.warning("cannot list Nodes (403 Forbidden): endpoints carry no node "
                        "topology labels; grant get/list/watch on nodes to enable them")
        if nodes is not None and not (nodes.synced or nodes.forbidden):
            return
        if not self.synced and not all(r.synced or r.not_found or r.forbidden
                                       for r in self._objective_reflectors):
            return
        if self.pool is not None and (self._pods is None or not self._pods.synced):
            return
        eps: list[Endpoint] = []
        if self.pool is not None and self._pods is not None:
            pods = [p for p in self._pods.objects.values() if p.ready and p.ip]
            self.gangs.observe(pods)
            if not self.gangs.synced:
                return
            node_map = {k.lstrip("/"): v for k, v in nodes.objects.items()} if nodes else {}
            eps = build_endpoints(self.gangs.admit(pods), self.pool, node_map)
        sig = _signature(eps)
        if sig != self._last_sig:
            self._last_sig = sig
            self.store.set_endpoints(eps)
            self.applied += 1
        self.synced = True
        if self.ready != self._last_ready:
            self._last_ready = self.ready
            if self._on_state_change is not None:
                await self._on_state_change()
