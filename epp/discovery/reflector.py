"""List+watch one Kubernetes collection into a local cache (client-go's reflector, small).

Protocol, as the API server defines it:

1. LIST the collection (paged with ``limit``/``continue``); the list's
   ``metadata.resourceVersion`` (RV) is the point in history the cache reflects.
2. WATCH from that RV (``watch=1&resourceVersion=RV&allowWatchBookmarks=true``): a stream
   of JSON lines ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": …}``. Each
   event advances the RV; BOOKMARK only advances it.
3. When the stream ends (server ``timeoutSeconds``, connection dropped), watch again from
   the last RV — no relist, nothing missed.
4. ``410 Gone`` (the RV was compacted away; as an ERROR event or as the HTTP status)
   → relist from scratch. Any other failure → retry after an exponential backoff with
   jitter (``backoff_initial_s`` doubling up to ``backoff_max_s``; reset after a healthy
   watch), relisting when the failure was an ERROR event.

The cache maps ``namespace/name`` to ``transform(object)``; ``on_change()`` is called
(synchronously, must not raise) after every list and every event that changed the cache.
``on_event(type, key, value)``, when given, hears each object change (synchronously, must
not raise, before ``on_change``): ``ADDED``/``MODIFIED`` with the new cached value,
``DELETED`` with the object's final state (after a relist: its last cached value). A
list reports what changed since the cache it replaced: every object at the first list;
after a relist the objects that are new, differ or are gone (what a controller-runtime
watch filtered on changed resourceVersions delivers).
One asyncio task per reflector, owned by :meth:`start`/:meth:`stop`; no threads.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from epp.discovery.kubeclient import JsonObj, KubeApi, KubeApiError, status_reason

log = logging.getLogger(__name__)

#: ``on_event(type, key, value)``: ``ADDED``, ``MODIFIED`` or ``DELETED``.
EventCallback = Callable[[str, str, Any], None]


@dataclass(frozen=True)
class ReflectorOptions:
    """Timing of one reflector. Defaults follow client-go (backoff 0.8 s → 30 s; watch
    timeouts 5–10 min); tests shorten them."""

    backoff_initial_s: float = 0.8
    backoff_max_s: float = 30.0
    watch_timeout_s: tuple[int, int] = (300, 600)
    page_size: int = 500
    # A watch that ends cleanly sooner than this counts as a failure (backoff), so a
    # server that closes every stream at once is not hammered.
    min_healthy_watch_s: float = 1.0


_ABSENT = object()  # not in the cache


class _Gone(Exception):
    """The resourceVersion is too old: relist."""


class _WatchError(Exception):
    """An ERROR event other than 410: back off, then relist."""


def object_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace") or ""
    return f"{ns}/{meta.get('name', '')}"


class Reflector:
    """Keeps ``objects`` equal to the collection at ``path`` (filtered by the selectors).

    ``synced`` turns True after the first complete list and stays True (a relist swaps the
    cache in one step). ``forbidden`` is True while the server answers 403 (RBAC) — the
    caller decides whether that is fatal. ``last_error`` describes the latest failure.
    """

    def __init__(self, api: KubeApi, path: str, *, name: str,
                 on_change: Callable[[], None],
                 label_selector: str | None = None, field_selector: str | None = None,
                 transform: Callable[[JsonObj], Any] | None = None,
                 accept_list: str | None = None, accept_watch: str | None = None,
                 options: ReflectorOptions = ReflectorOptions(),
                 on_event: EventCallback | None = None) -> None:
        self.api = api
        self.path = path
        self.name = name
        self.label_selector = label_selector
        self.field_selector = field_selector
        self._on_change = on_change
        self._on_event = on_event
        self._transform = transform or (lambda o: o)
        self._accept_list = accept_list
        self._accept_watch = accept_watch
        self.options = options
        self.objects: dict[str, Any] = {}
        self.resource_version = ""
        self.synced = False
        self.forbidden = False
        self.not_found = False  # 404 on list: the resource is not served (CRD missing)
        self.last_error: str | None = None
        self.lists = 0  # completed lists (observability, tests)
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Start listing and watching in a task (returns at once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name=f"reflector-{self.name}")

    async def stop(self) -> None:
        """Cancel the task and close its connection (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    # -- protocol ---------------------------------------------------------------------
    def _selectors(self) -> list[tuple[str, str]]:
        q: list[tuple[str, str]] = []
        if self.label_selector:
            q.append(("labelSelector", self.label_selector))
        if self.field_selector:
            q.append(("fieldSelector", self.field_selector))
        return q

    async def _list(self) -> None:
        items: dict[str, Any] = {}
        cont = ""
        rv = ""
        while True:
            q = self._selectors() + [("limit", str(self.options.page_size))]
            if cont:
                q.append(("continue", cont))
            headers = {"Accept": self._accept_list} if self._accept_list else None
            status, data = await self.api.request("GET", self.path, query=q, headers=headers)
            if status == 410:
                # The continue token expired mid-listing: start over.
                raise _Gone()
            self._set_denied(status)
            if not 200 <= status < 300 or not isinstance(data, dict):
                raise KubeApiError(status, status_reason(data), self.path)
            for obj in data.get("items") or []:
                if isinstance(obj, dict):
                    items[object_key(obj)] = self._transform(obj)
            meta = data.get("metadata") or {}
            rv = str(meta.get("resourceVersion") or rv)
            cont = str(meta.get("continue") or "")
            if not cont:
                break
        old = self.objects
        self.objects = items
        self.resource_version = rv
        self.synced = True
        self.lists += 1
        log.debug("%s: listed %d objects at resourceVersion %s", self.name, len(items), rv)
        if self._on_event is not None:
            self._report_list(old, items, self._on_event)
        self._on_change()

    @staticmethod
    def _report_list(old: Mapping[str, Any], new: Mapping[str, Any],
                     on_event: EventCallback) -> None:
        """The changes a (re)list made to the cache, as events."""
        for key, value in new.items():
            before = old.get(key, _ABSENT)
            if before is _ABSENT:
                on_event("ADDED", key, value)
            elif before != value:
                on_event("MODIFIED", key, value)
        for key, value in old.items():
            if key not in new:
                on_event("DELETED", key, value)

    async def _watch(self) -> None:
        lo, hi = self.options.watch_timeout_s
        timeout = random.randint(lo, hi) if hi > lo else lo
        q = self._selectors() + [("watch", "1"), ("resourceVersion", self.resource_version),
                                 ("allowWatchBookmarks", "true"),
                                 ("timeoutSeconds", str(timeout))]
        headers = {"Accept": self._accept_watch} if self._accept_watch else None
        try:
            async for event in self.api.stream(self.path, query=q, headers=headers,
                                               read_timeout_s=timeout + 30):
                self._apply(event)
        except KubeApiError as e:
            if e.status == 410:
                raise _Gone() from e
            self._set_denied(e.status)
            raise

    def _apply(self, event: Mapping[str, Any]) -> None:
        etype = event.get("type")
        obj = event.get("object")
        if not isinstance(obj, dict):
            raise _WatchError(f"malformed watch event {str(event)[:200]}")
        if etype == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise _WatchError(f"watch error {obj.get('code')}: {status_reason(obj)}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if etype == "BOOKMARK":
            if rv:
                self.resource_version = str(rv)
            return
        key = object_key(obj)
        if etype in ("ADDED", "MODIFIED"):
            value = self.objects[key] = self._transform(obj)
        elif etype == "DELETED":
            self.objects.pop(key, None)
            value = self._transform(obj)
        else:
            raise _WatchError(f"unknown watch event type {etype!r}")
        if rv:
            self.resource_version = str(rv)
        if self._on_event is not None:
            self._on_event(etype, key, value)
        self._on_change()

    async def _run(self) -> None:
        opts = self.options
        delay = opts.backoff_initial_s
        need_list = True
        while True:
            started = time.monotonic()
            try:
                if need_list:
                    await self._list()
                    need_list = False
                    delay = opts.backoff_initial_s
                    self._set_error(None)
                started = time.monotonic()
                await self._watch()
                if time.monotonic() - started >= opts.min_healthy_watch_s:
                    delay = opts.backoff_initial_s
                    self._set_error(None)
                    continue  # a normal end: watch again from the last resourceVersion
                failure = "watch ended at once"
            except _Gone:
                log.info("%s: resourceVersion %s too old (410 Gone), relisting", self.name,
                         self.resource_version)
                need_list = True
                continue
            except _WatchError as e:
                need_list = True
                failure = str(e)
            except (KubeApiError, aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
                failure = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                if not need_list and time.monotonic() - started >= opts.min_healthy_watch_s:
                    # A watch that was healthy for a while and then dropped: retry soon.
                    delay = opts.backoff_initial_s
            self._set_error(failure)
            sleep = delay * random.uniform(0.8, 1.2)
            log.debug("%s: retrying in %.2fs", self.name, sleep)
            await asyncio.sleep(sleep)
            delay = min(delay * 2, opts.backoff_max_s)

    def _set_denied(self, status: int) -> None:
        """Track 403 (``forbidden``) and 404 (``not_found``); a change is a change."""
        forbidden, not_found = status == 403, status == 404
        if (forbidden, not_found) != (self.forbidden, self.not_found):
            self.forbidden, self.not_found = forbidden, not_found
            self._on_change()

    def _set_error(self, error: str | None) -> None:
        if error != self.last_error:
            if error is not None:
                log.warning("%s: %s (retrying with backoff)", self.name, error)
            elif self.last_error is not None:
                log.info("%s: watching again", self.name)
            self.last_error = error
