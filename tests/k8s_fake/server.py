"""A fake Kubernetes API server for tests: the list/watch protocol over plain HTTP.

It serves what the EPP uses — Pods (namespaced), Nodes (cluster-scoped), InferencePools
(v1 and v1alpha2 groups), InferenceObjectives and InferenceModelRewrites (v1alpha2),
Grove PodGangs (404 when ``serve_podgangs`` is False, as without Grove's CRDs), Leases
(GET/POST/PUT) — with the semantics that matter:

- one global, increasing ``resourceVersion`` (RV); every write stamps the object;
- LIST returns ``{"kind": …List, "metadata": {"resourceVersion"}, "items": […]}``, with
  ``labelSelector`` (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``), ``fieldSelector``
  (``metadata.name=``, ``metadata.namespace=``) and ``limit``/``continue`` paging;
- WATCH (``?watch=1&resourceVersion=RV``) streams JSON lines ``{"type", "object"}``:
  first every recorded event after RV, then live events; an object leaving a label
  selector arrives as DELETED, one entering it as ADDED (as the real server does);
  ``allowWatchBookmarks=true`` gets BOOKMARK events (every ``bookmark_interval_s`` and
  on :meth:`bookmark`); ``timeoutSeconds`` ends the stream;
- an RV older than the compaction floor (:meth:`compact`) gets an ERROR event with a 410
  Status (what a real server sends), or HTTP 410 when ``gone_as_http`` is set;
- :meth:`drop_watches` cuts every open watch connection mid-stream (no clean end);
- Lease writes check ``metadata.resourceVersion``: stale → 409 Conflict; POST of an
  existing name → 409 AlreadyExists;
- :meth:`fail_next` makes the next N requests on a path prefix answer an error status;
- ``requests`` counts requests by (method, kind, "list"|"watch"|"get"|…) for assertions.

Runs in the test's event loop (``start()``/``stop()``); EPP subprocesses reach it through
a kubeconfig file (:meth:`write_kubeconfig`).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from aiohttp import web

Obj = dict[str, Any]

POOL_GROUPS: Mapping[str, str] = MappingProxyType({
    "inference.networking.k8s.io": "v1", "inference.networking.x-k8s.io": "v1alpha2"})


@dataclass(frozen=True)
class _Kind:
    name: str  # "pods", "nodes", "inferencepools", "leases"
    kind: str
    api_version: str
    namespaced: bool


KINDS: Mapping[str, _Kind] = MappingProxyType({
    "pods": _Kind("pods", "Pod", "v1", True),
    "nodes": _Kind("nodes", "Node", "v1", False),
    "inferencepools": _Kind("inferencepools", "InferencePool",
                            "inference.networking.k8s.io/v1", True),
    "leases": _Kind("leases", "Lease", "coordination.k8s.io/v1", True),
    "podgangs": _Kind("podgangs", "PodGang", "scheduler.grove.io/v1alpha1", True),
    "inferenceobjectives": _Kind("inferenceobjectives", "InferenceObjective",
                                 "inference.networking.x-k8s.io/v1alpha2", True),
    "inferencemodelrewrites": _Kind("inferencemodelrewrites", "InferenceModelRewrite",
                                    "inference.networking.x-k8s.io/v1alpha2", True),
})


@dataclass(frozen=True)
class _Event:
    rv: int
    type: str
    obj: Obj


@dataclass(eq=False)
class _Watch:
    kind: str
    namespace: str | None
    selector: Any
    fields: dict[str, str]
    queue: asyncio.Queue[_Event | None] = field(default_factory=asyncio.Queue)
    request: web.Request | None = None


def parse_label_selector(text: str) -> list[tuple[str, str, str | None]]:
    """``k=v,k!=v,k,!k`` → [(op, key, value)]."""
    out: list[tuple[str, str, str | None]] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if "!=" in item:
            k, v = item.split("!=", 1)
            out.append(("!=", k.strip(), v.strip()))
        elif "==" in item:
            k, v = item.split("==", 1)
            out.append(("=", k.strip(), v.strip()))
        elif "=" in item:
            k, v = item.split("=", 1)
            out.append(("=", k.strip(), v.strip()))
        elif item.startswith("!"):
            out.append(("!", item[1:].strip(), None))
        else:
            out.append(("exists", item, None))
    return out


def selector_matches(sel: list[tuple[str, str, str | None]], labels: Mapping[str, str]) -> bool:
    for op, k, v in sel:
        if op == "=" and labels.get(k) != v:
            return False
        if op == "!=" and labels.get(k) == v:
            return False
        if op == "exists" and k not in labels:
            return False
        if op == "!" and k in labels:
            return False
    return True


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class FakeApiServer:
    """See the module docstring. All mutators are synchronous and safe to call from the
    test's event loop while EPPs watch."""

    def __init__(self, bookmark_interval_s: float = 0.5) -> None:
        self.bookmark_interval_s = bookmark_interval_s
        self.token = "test-token"
        self.gone_as_http = False
        self.serve_podgangs = True  # False: Grove's CRDs are not installed (404)
        self.rv = 1
        self.floor = 0  # events at or below this RV are compacted away
        self.objects: dict[str, dict[tuple[str, str], Obj]] = {k: {} for k in KINDS}
        self.events: dict[str, list[_Event]] = {k: [] for k in KINDS}
        # Object states at the last compaction: the "before" of the first kept events.
        self._base: dict[str, dict[tuple[str, str], Obj]] = {k: {} for k in KINDS}
        self.watches: set[_Watch] = set()
        self.requests: Counter[tuple[str, str, str]] = Counter()
        self._failures: list[tuple[str, int, list[int]]] = []
        self._uid = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    # ---------------------------------------------------------------- lifecycle
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = site._server
        assert server is not None and server.sockets
        self.port = server.sockets[0].getsockname()[1]
        if self.bookmark_interval_s > 0:
            t = asyncio.get_running_loop().create_task(self._bookmarks())
            self._tasks.add(t)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            try:
                await t
            except asyncio.CancelledError:
                pass
        self._tasks.clear()
        for w in list(self.watches):
            w.queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path) -> Path:
        doc = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }
        path.write_text(yaml.safe_dump(doc))
        return path

    # ---------------------------------------------------------------- mutators
    def put(self, kind: str, obj: Obj) -> Obj:
        """Create or replace an object (ADDED or MODIFIED). Returns the stored copy."""
        obj = copy.deepcopy(obj)
        k = KINDS[kind]
        meta = obj.setdefault("metadata", {})
        ns = meta.get("namespace", "default") if k.namespaced else ""
        if k.namespaced:
            meta["namespace"] = ns
        key = (ns, meta["name"])
        old = self.objects[kind].get(key)
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        meta.setdefault("uid", old["metadata"]["uid"] if old else f"uid-{next(self._uid)}")
        meta.setdefault("creationTimestamp", old["metadata"].get("creationTimestamp")
                        if old else _now())
        obj.setdefault("kind", k.kind)
        obj.setdefault("apiVersion", k.api_version)
        self.objects[kind][key] = obj
        self._record(kind, _Event(self.rv, "MODIFIED" if old else "ADDED", obj), old)
        return copy.deepcopy(obj)

    def delete(self, kind: str, name: str, namespace: str = "default") -> bool:
        k = KINDS[kind]
        key = (namespace if k.namespaced else "", name)
        old = self.objects[kind].pop(key, None)
        if old is None:
            return False
        self.rv += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        self._record(kind, _Event(self.rv, "DELETED", gone), old)
        return True

    def get(self, kind: str, name: str, namespace: str = "default") -> Obj | None:
        k = KINDS[kind]
        obj = self.objects[kind].get((namespace if k.namespaced else "", name))
        return copy.deepcopy(obj) if obj is not None else None

    def compact(self) -> None:
        """Forget history: a watch from any resourceVersion handed out so far gets 410 Gone
        (a fresh list returns a new, watchable one)."""
        self.rv += 1  # lists from now on return an RV at the floor: watchable again
        self.floor = self.rv
        for kind, evs in self.events.items():
            evs.clear()
            self._base[kind] = copy.deepcopy(self.objects[kind])

    def drop_watches(self) -> int:
        """Cut every open watch connection abruptly; returns how many were cut."""
        n = 0
        for w in list(self.watches):
            transport = w.request.transport if w.request is not None else None
            if transport is not None:
                transport.abort()
                n += 1
            w.queue.put_nowait(None)
        return n

    def bookmark(self) -> None:
        """Send a BOOKMARK at the current RV to every watch that allows them."""
        for w in list(self.watches):
            w.queue.put_nowait(_Event(self.rv, "BOOKMARK", {}))

    def fail_next(self, path_prefix: str, status: int, times: int = 1) -> None:
        """The next ``times`` requests whose path starts with ``path_prefix`` get ``status``."""
        self._failures.append((path_prefix, status, [times]))

    def clear_failures(self) -> None:
        self._failures.clear()

    def open_watches(self, kind: str) -> int:
        return sum(1 for w in self.watches if w.kind == kind)

    # ---------------------------------------------------------------- convenience
    def put_pod(self, name: str, ip: str | None, *, labels: Mapping[str, str],
                ready: bool = True, namespace: str = "default", node: str | None = None,
                annotations: Mapping[str, str] | None = None,
                deleting: bool = False) -> Obj:
        pod: Obj = {
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                         "annotations": dict(annotations or {})},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            "status": {"phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        }
        if ip:
            pod["status"]["podIP"] = ip
        if node:
            pod["spec"]["nodeName"] = node
        if deleting:
            pod["metadata"]["deletionTimestamp"] = _now()
        return self.put("pods", pod)

    def put_pool(self, name: str, selector: Mapping[str, str], ports: Iterable[int], *,
                 namespace: str = "default", epp_service: str = "epp") -> Obj:
        return self.put("inferencepools", {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": dict(selector)},
                     "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": epp_service, "port": {"number": 9002}}},
        })

    def put_podgang(self, name: str, groups: Mapping[str, tuple[Iterable[str], int]], *,
                    namespace: str = "default") -> Obj:
        """A Grove PodGang: ``groups`` maps pod-group name → (pod names, minReplicas)."""
        return self.put("podgangs", {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"podgroups": [
                {"name": g, "minReplicas": m,
                 "podReferences": [{"namespace": namespace, "name": p} for p in pods]}
                for g, (pods, m) in groups.items()]},
        })

    def put_node(self, name: str, labels: Mapping[str, str]) -> Obj:
        return self.put("nodes", {"metadata": {"name": name, "labels": dict(labels)},
                                  "status": {"images": [{"names": ["x" * 64]}] * 3}})

    # ---------------------------------------------------------------- internals
    def _record(self, kind: str, ev: _Event, old: Obj | None) -> None:
        self.events[kind].append(ev)
        for w in list(self.watches):
            if w.kind != kind:
                continue
            out = self._project(w, ev, old)
            if out is not None:
                w.queue.put_nowait(out)

    def _visible(self, w: _Watch | None, obj: Obj, kind: str, ns: str | None,
                 selector: Any, fields: Mapping[str, str]) -> bool:
        meta = obj.get("metadata") or {}
        if KINDS[kind].namespaced and ns is not None and meta.get("namespace") != ns:
            return False
        if fields.get("metadata.name") not in (None, meta.get("name")):
            return False
        if fields.get("metadata.namespace") not in (None, meta.get("namespace")):
            return False
        return selector_matches(selector, meta.get("labels") or {})

    def _project(self, w: _Watch, ev: _Event, old: Obj | None) -> _Event | None:
        """The event as a watcher with a selector sees it (entering → ADDED, leaving →
        DELETED), or None when invisible."""
        now_vis = self._visible(w, ev.obj, w.kind, w.namespace, w.selector, w.fields)
        was_vis = old is not None and self._visible(w, old, w.kind, w.namespace, w.selector,
                                                    w.fields)
        if ev.type == "DELETED":
            return ev if was_vis else None
        if now_vis and not was_vis:
            return _Event(ev.rv, "ADDED", ev.obj)
        if was_vis and not now_vis:
            return _Event(ev.rv, "DELETED", ev.obj)
        return ev if now_vis else None

    def _route(self, path: str) -> tuple[str, str | None, str | None] | None:
        """path → (kind, namespace, name)."""
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            rest = parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version = parts[1], parts[2]
            ok = (group == "coordination.k8s.io" and version == "v1") or \
                POOL_GROUPS.get(group) == version or \
                (group == "scheduler.grove.io" and version == "v1alpha1" and self.serve_podgangs)
            if not ok:
                return None
            rest = parts[3:]
        else:
            return None
        ns: str | None = None
        if len(rest) >= 2 and rest[0] == "namespaces":
            ns, rest = rest[1], rest[2:]
        if not rest or rest[0] not in KINDS:
            return None
        kind = rest[0]
        if not KINDS[kind].namespaced and ns is not None:
            return None
        name = rest[1] if len(rest) > 1 else None
        return kind, ns, name

    def _injected_failure(self, path: str) -> int | None:
        for prefix, status, left in self._failures:
            if path.startswith(prefix) and left[0] > 0:
                left[0] -= 1
                return status
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization", "") != f"Bearer {self.token}":
            return web.json_response(_status(401, "Unauthorized", "bad token"), status=401)
        route = self._route(request.path)
        if route is None:
            return web.json_response(_status(404, "NotFound", f"no route {request.path}"),
                                     status=404)
        kind, ns, name = route
        q = request.query
        op = ("watch" if q.get("watch") in ("1", "true") else
              "list" if name is None and request.method == "GET" else request.method.lower())
        self.requests[(request.method, kind, op)] += 1
        failure = self._injected_failure(request.path)
        if failure is not None:
            return web.json_response(_status(failure, "Injected", "injected failure"),
                                     status=failure)
        if request.method == "GET" and name is None:
            if op == "watch":
                return await self._watch(request, kind, ns)
            return self._list(request, kind, ns)
        if kind != "leases":
            if request.method == "GET" and name is not None:
                obj = self.get(kind, name, ns or "")
                if obj is None:
                    return web.json_response(_status(404, "NotFound", f"{name} not found"),
                                             status=404)
                return web.json_response(obj)
            return web.json_response(_status(405, "MethodNotAllowed", "read-only kind"),
                                     status=405)
        return await self._lease(request, ns or "default", name)

    def _list(self, request: web.Request, kind: str, ns: str | None) -> web.Response:
        q = request.query
        selector = parse_label_selector(q.get("labelSelector", ""))
        fields = dict(f.split("=", 1) for f in q.get("fieldSelector", "").split(",") if "=" in f)
        items = [copy.deepcopy(o) for (ons, _), o in sorted(self.objects[kind].items())
                 if self._visible(None, o, kind, ns, selector, fields)]
        start = int(q.get("continue") or 0)
        limit = int(q.get("limit") or 0)
        meta: Obj = {"resourceVersion": str(self.rv)}
        if limit and start + limit < len(items):
            meta["continue"] = str(start + limit)
        page = items[start:start + limit] if limit else items[start:]
        if "PartialObjectMetadataList" in request.headers.get("Accept", ""):
            page = [{"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                     "metadata": o["metadata"]} for o in page]
        return web.json_response({"kind": KINDS[kind].kind + "List",
                                  "apiVersion": KINDS[kind].api_version,
                                  "metadata": meta, "items": page})

    async def _watch(self, request: web.Request, kind: str, ns: str | None) -> web.StreamResponse:
        q = request.query
        rv = int(q.get("resourceVersion") or 0)
        bookmarks = q.get("allowWatchBookmarks") == "true"
        timeout = float(q.get("timeoutSeconds") or 0)
        too_old = rv != 0 and rv < self.floor
        if too_old and self.gone_as_http:
            return web.json_response(_status(410, "Expired", "too old resource version"),
                                     status=410)
        w = _Watch(kind, ns, parse_label_selector(q.get("labelSelector", "")),
                   dict(f.split("=", 1) for f in q.get("fieldSelector", "").split(",")
                        if "=" in f))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        w.request = request

        async def send(ev: _Event) -> None:
            obj = ev.obj
            if ev.type == "BOOKMARK":
                obj = {"kind": KINDS[kind].kind, "apiVersion": KINDS[kind].api_version,
                       "metadata": {"resourceVersion": str(ev.rv)}}
            elif ev.type == "ERROR":
                pass
            elif "PartialObjectMetadata" in request.headers.get("Accept", ""):
                obj = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                       "metadata": obj["metadata"]}
            await resp.write(json.dumps({"type": ev.type, "object": obj}).encode() + b"\n")

        if too_old:
            await send(_Event(self.rv, "ERROR", _status(
                410, "Expired", f"too old resource version: {rv} ({self.floor})")))
            return resp
        # Replay history after rv (as seen through this watch's selector), then go live.
        backlog: list[_Event] = []
        prev: dict[tuple[str, str], Obj] = dict(self._base[kind])
        for ev in self.events[kind]:
            key = ((ev.obj["metadata"].get("namespace") or ""), ev.obj["metadata"]["name"])
            old = prev.get(key)
            prev[key] = ev.obj
            if ev.type == "DELETED":
                prev.pop(key, None)
            if ev.rv > rv:
                out = self._project(w, ev, old)
                if out is not None:
                    backlog.append(out)
        self.watches.add(w)
        try:
            for ev in backlog:
                await send(ev)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout if timeout else None
            while True:
                wait = None if deadline is None else deadline - loop.time()
                if wait is not None and wait <= 0:
                    break
                try:
                    ev2 = await asyncio.wait_for(w.queue.get(), wait)
                except TimeoutError:
                    break
                if ev2 is None:
                    break
                if ev2.type == "BOOKMARK" and not bookmarks:
                    continue
                await send(ev2)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.watches.discard(w)
        return resp

    async def _bookmarks(self) -> None:
        while True:  # a period, as a real API server's bookmarks: not a wait
            await asyncio.sleep(self.bookmark_interval_s)
            self.bookmark()

    async def _lease(self, request: web.Request, ns: str, name: str | None) -> web.Response:
        leases = self.objects["leases"]
        if request.method == "GET":
            obj = leases.get((ns, name or ""))
            if obj is None:
                return web.json_response(_status(404, "NotFound", f"lease {name} not found"),
                                         status=404)
            return web.json_response(obj)
        body = await request.json()
        lname = (body.get("metadata") or {}).get("name")
        if request.method == "POST" and name is None:
            if (ns, lname) in leases:
                return web.json_response(_status(409, "AlreadyExists", f"{lname} exists"),
                                         status=409)
            body["metadata"]["namespace"] = ns
            body["metadata"].pop("resourceVersion", None)
            return web.json_response(self.put("leases", body), status=201)
        if request.method == "PUT" and name is not None:
            cur = leases.get((ns, name))
            if cur is None:
                return web.json_response(_status(404, "NotFound", f"lease {name} not found"),
                                         status=404)
            if (body.get("metadata") or {}).get("resourceVersion") != \
                    cur["metadata"]["resourceVersion"]:
                return web.json_response(_status(409, "Conflict", "the object has been "
                                                 "modified; please apply your changes to the "
                                                 "latest version and try again"), status=409)
            body["metadata"]["namespace"] = ns
            body["metadata"].pop("resourceVersion", None)
            return web.json_response(self.put("leases", body))
        return web.json_response(_status(405, "MethodNotAllowed", request.method), status=405)
