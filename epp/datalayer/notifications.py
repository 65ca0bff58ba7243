"""``k8s-notification-source``'s watch: GIE v1.5.0's ``Runtime.Start`` and
``BindNotificationSource`` (pkg/epp/datalayer/runtime.go, k8s_bind.go).

Each ``k8s-notification-source`` in the config's ``dataLayer.sources`` gets one list+watch
of its kind (:class:`~epp.discovery.reflector.Reflector`); every object created, changed
or deleted becomes a call of ``extract_notification(event, obj)`` on each of the source's
extractors (:class:`~epp.framework.interfaces.NotificationExtractor`), in event order,
from the event loop. As in GIE:

- the first list reports every existing object (``add-or-update``); a change that keeps
  the resourceVersion is not reported (GIE's ``ResourceVersionChangedPredicate``), nor is
  a relist's unchanged object; a deletion is ``delete``;
- the object is a copy of the API server's JSON, shared by the source's extractors;
- an extractor that raises is logged and the next one still runs;
- a source without extractors is watched all the same (GIE binds every source);
- where the kind is watched is where GIE's manager cache looks
  (pkg/epp/server/controller_manager.go): Pods in the pool's namespace; in pool mode
  (``--pool-name``) the InferencePool of that name and InferenceObjectives and
  InferenceModelRewrites in that namespace; every other kind in every namespace (the
  EPP's service account then needs cluster-wide ``list``/``watch`` on it);
- startup fails when the kind is not served (a CRD not installed), when RBAC forbids the
  list, or when the first list does not complete within two minutes (controller-runtime's
  cache sync timeout, after which GIE's EPP exits) — here at once for the first two.

Differences: GIE folds a burst of changes to one object into one reconcile that reads the
latest state (and a deletion carries only name and namespace); here each watch event is
delivered, a deletion with the object's final state. GIE's controllers run on the leader
only when leader election is on; here, like the endpoint discovery, on every replica.

Without Kubernetes discovery (``--endpoints``, ``--endpoints-file``) there is no API
server to watch; GIE's EPP cannot run without one, and a config with a
``k8s-notification-source`` in its data layer fails at startup here.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
from typing import Any, Protocol

import aiohttp

from epp import keys
from epp.datalayer.config import DataLayerConfig, SourceConfig
from epp.discovery.kubeclient import (
    ApiResource,
    KindNotServed,
    KubeApi,
    KubeApiError,
    find_resource,
)
from epp.discovery.reflector import Reflector, ReflectorOptions
from epp.errors import ConfigError
from epp.framework.interfaces import EVENT_ADD_OR_UPDATE, EVENT_DELETE, NotificationExtractor
from epp.scheduling.plugins.datalayer import K8sNotificationSource

log = logging.getLogger(__name__)

_DEFAULT_OPTIONS = ReflectorOptions()

#: controller-runtime's default ``CacheSyncTimeout``: how long GIE's EPP waits for a
#: notification source's first list before it exits.
SYNC_TIMEOUT_S = 120.0

_TRANSIENT = (aiohttp.ClientError, OSError, TimeoutError)

# Kinds GIE's manager cache keeps in the pool's namespace (controller_manager.go).
_POD = ("", "v1", "Pod")
_POOL = (keys.K8S_POOL_GROUP, keys.K8S_POOL_VERSION, keys.K8S_POOL_KIND)
_POOL_MODE_NAMESPACED = {(keys.K8S_POOL_GROUP_ALPHA, "v1alpha2", "InferenceObjective"),
                         (keys.K8S_POOL_GROUP_ALPHA, "v1alpha2", "InferenceModelRewrite")}


class WatchScope(Protocol):
    """Where the endpoint discovery looks, and its list/watch timing
    (epp/discovery/kubernetes.py's ``KubernetesOptions``)."""

    @property
    def namespace(self) -> str: ...

    @property
    def pool_name(self) -> str | None: ...

    @property
    def reflector(self) -> ReflectorOptions: ...


class KubernetesLink(Protocol):
    """What the notification watches need of the Kubernetes endpoint discovery
    (:class:`~epp.discovery.kubernetes.KubernetesSource`): its API connection and scope."""

    @property
    def api(self) -> KubeApi: ...

    @property
    def options(self) -> WatchScope: ...


def watch_restriction(group: str, version: str, kind: str,
                      scope: WatchScope) -> tuple[str | None, str | None]:
    """(namespace, field selector) GIE's manager cache applies to the kind: Pods in the
    pool's namespace; in pool mode the InferencePool by name and InferenceObjectives and
    InferenceModelRewrites in that namespace; anything else everywhere (None, None)."""
    gvk = (group, version, kind)
    if gvk == _POD:
        return scope.namespace, None
    if scope.pool_name is not None:
        if gvk == _POOL:
            return scope.namespace, f"metadata.name={scope.pool_name}"
        if gvk in _POOL_MODE_NAMESPACED:
            return scope.namespace, None
    return None, None


class NotificationWatch:
    """The watch of one ``k8s-notification-source``: lifecycle :meth:`resolve` (API
    discovery), :meth:`start`, :meth:`stop`."""

    def __init__(self, api: KubeApi, entry: SourceConfig, scope: WatchScope,
                 options: ReflectorOptions = _DEFAULT_OPTIONS) -> None:
        source = entry.source
        assert isinstance(source, K8sNotificationSource)
        self.api = api
        self.source = source
        self.where = entry.where
        self.extractors: tuple[NotificationExtractor, ...] = tuple(
            e for e in entry.extractors if isinstance(e, NotificationExtractor))
        self.namespace, self.field_selector = watch_restriction(
            source.group, source.version, source.kind, scope)
        self.options = options
        self.resource: ApiResource | None = None
        self.reflector: Reflector | None = None
        self.delivered = 0  # events handed to the extractors (tests, observability)
        self.changed = asyncio.Event()  # set at each list, event or state change

    def describe(self) -> str:
        where = f"namespace {self.namespace}" if self.namespace else "all namespaces"
        if self.field_selector:
            where += f", {self.field_selector}"
        return f"{self.source.name!r} (k8s-notification-source, {self.source.gvk}, {where})"

    async def resolve(self) -> ApiResource:
        """Map the kind to its resource; :class:`KindNotServed` or the API's errors."""
        if self.resource is None:
            s = self.source
            self.resource = await find_resource(self.api, s.group, s.version, s.kind)
        return self.resource

    def start(self) -> None:
        assert self.resource is not None, "resolve() first"
        if self.reflector is not None:
            return
        self.reflector = Reflector(
            self.api, self.resource.collection_path(self.namespace),
            name=f"notify_{self.source.kind.lower()}_{self.source.name}",
            field_selector=self.field_selector, on_change=self.changed.set,
            on_event=self._on_event, options=self.options)
        self.reflector.start()
        log.info("data layer: watching %s for %d extractor(s)", self.describe(),
                 len(self.extractors))

    async def stop(self) -> None:
        r, self.reflector = self.reflector, None
        if r is not None:
            await r.stop()

    def _on_event(self, etype: str, key: str, obj: Any) -> None:
        if not self.extractors:
            return
        event = EVENT_DELETE if etype == "DELETED" else EVENT_ADD_OR_UPDATE
        shared = copy.deepcopy(obj)  # the cache's own object stays untouched
        self.delivered += 1
        for ext in self.extractors:
            try:
                ext.extract_notification(event, shared)
            except Exception:  # GIE logs an extractor's error and goes on
                log.exception("data layer: extractor %s failed on %s %s (%s)", ext.name,
                              event, key, self.source.gvk)


class NotificationWatches:
    """Every ``k8s-notification-source`` of the data layer, watched through ``k8s``.

    Made before the ports are bound: without Kubernetes discovery (``k8s`` None) a
    config with such a source is a :class:`~epp.errors.ConfigError`. :meth:`start` runs
    after the discovery started and returns once every watch has listed its kind;
    :meth:`stop` ends them (idempotent).
    """

    def __init__(self, data_layer: DataLayerConfig | None, k8s: KubernetesLink | None, *,
                 options: ReflectorOptions | None = None,
                 sync_timeout_s: float = SYNC_TIMEOUT_S) -> None:
        entries = [e for e in (data_layer.sources if data_layer is not None else ())
                   if isinstance(e.source, K8sNotificationSource)]
        if entries and k8s is None:
            e = entries[0]
            assert isinstance(e.source, K8sNotificationSource)
            raise ConfigError(
                f"{_at(e)}{e.source.name!r} (k8s-notification-source) watches "
                f"{e.source.gvk} through the Kubernetes API, and this EPP has none: "
                "--endpoints and --endpoints-file do not connect to an API server (GIE's "
                "EPP cannot run without one); discover the endpoints with --pool-name or "
                "--endpoint-selector, or remove the source from dataLayer.sources")
        if options is None:  # the discovery's timing
            options = k8s.options.reflector if k8s is not None else _DEFAULT_OPTIONS
        self.watches: list[NotificationWatch] = (
            [] if k8s is None else
            [NotificationWatch(k8s.api, e, k8s.options, options) for e in entries])
        self.sync_timeout_s = sync_timeout_s
        self._backoff_s = options.backoff_initial_s, options.backoff_max_s

    def __len__(self) -> int:
        return len(self.watches)

    async def start(self) -> None:
        """Resolve every kind, start every watch and wait for every first list.
        Raises :class:`~epp.errors.ConfigError` as GIE fails (module doc)."""
        if not self.watches:
            return
        deadline = asyncio.get_running_loop().time() + self.sync_timeout_s
        for w in self.watches:
            await self._resolve(w, deadline)
        for w in self.watches:
            w.start()
        for w in self.watches:
            await self._wait_synced(w, deadline)

    async def stop(self) -> None:
        for w in self.watches:
            await w.stop()

    async def _resolve(self, w: NotificationWatch, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        delay, cap = self._backoff_s
        while True:
            try:
                await w.resolve()
                return
            except KindNotServed as e:
                raise ConfigError(f"{_at(w)}{w.describe()}: {e}; install the kind (its "
                                  "CRD), or fix the source's group, version and kind") from e
            except KubeApiError as e:
                if e.status < 500 and e.status != 429:  # 403 and the like: no retry
                    raise ConfigError(f"{_at(w)}{w.describe()}: API discovery failed: {e}; "
                                      "the EPP's service account must be allowed to read "
                                      "the API's discovery endpoints") from e
                failure = str(e)
            except _TRANSIENT as e:
                failure = f"{type(e).__name__}: {e}"
            if loop.time() + delay > deadline:
                raise ConfigError(f"{_at(w)}{w.describe()}: cannot reach the Kubernetes API "
                                  f"({failure}) within {self.sync_timeout_s:g}s")
            log.warning("data layer: %s: API discovery failed (%s); retrying", w.describe(),
                        failure)
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, cap)

    async def _wait_synced(self, w: NotificationWatch, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        r = w.reflector
        assert r is not None and w.resource is not None
        while not r.synced:
            if r.forbidden:
                raise ConfigError(
                    f"{_at(w)}{w.describe()}: the API server forbids listing "
                    f"{w.resource.name} (403: {r.last_error or 'Forbidden'}); grant the EPP's "
                    f"service account get, list and watch on {w.resource.name}"
                    f"{'' if not w.resource.group else '.' + w.resource.group}"
                    + ("" if w.namespace else " in every namespace (a ClusterRole)"))
            left = deadline - loop.time()
            if left <= 0:
                raise ConfigError(
                    f"{_at(w)}{w.describe()}: the first list of {w.resource.name} did not "
                    f"complete within {self.sync_timeout_s:g}s ({r.last_error or 'no answer'}"
                    "); GIE's EPP exits when a notification source's cache does not sync")
            w.changed.clear()
            try:
                await asyncio.wait_for(w.changed.wait(), min(left, 0.5))
            except TimeoutError:
                pass


def _at(where: NotificationWatch | SourceConfig) -> str:
    return f"{where.where}: " if where.where else ""
