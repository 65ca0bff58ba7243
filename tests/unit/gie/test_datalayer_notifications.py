"""``k8s-notification-source`` against the fake API server: GIE v1.5.0's
test/integration/epp/k8s_datasource_integration_test.go and runtime_notification_test.go
(envtest there, tests/k8s_fake here), with pkg/epp/datalayer's Configure checks and this
EPP's own rules (where each kind is watched, how startup fails, no API server).

Go's cases create, update and delete Pods (and a Service) in a fresh namespace and wait
for the mock extractor (``mocks.NotificationExtractor``: records every event, optionally
fails) to see them; :class:`Recorder` is that mock as a Python plugin.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

import tests.k8s_fake.server as fake_server
from epp.config.loader import BuiltConfig, build, load_and_build, parse_config
from epp.datalayer.config import DataLayerConfig, SourceConfig
from epp.datalayer.notifications import NotificationWatch, NotificationWatches, watch_restriction
from epp.discovery.kubeclient import KubeApi, find_resource
from epp.discovery.kubernetes import KubernetesOptions, PoolSpec
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import (
    DATA_K8S_NOTIFICATIONS,
    NotificationExtractor,
    gvk_string,
)
from epp.framework.params import param
from epp.framework.registry import Registry
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.datalayer import K8sNotificationSource
from epp.scheduling.types import ApiType, Endpoint, LLMRequest
from epp.server.app import EppServer, ServeOptions
from epp.server.options import (
    ConfigOptions,
    KubernetesSourceOptions,
    ListenOptions,
    ObservabilityOptions,
    ScrapingOptions,
    StaticSourceOptions,
)
from epp.stack.procs import free_port
from tests.k8s_fake import FakeApiServer
from tests.polling import eventually
from tests.unit.conftest import FAST

APP = {"app": "vllm"}
POD = gvk_string("", "v1", "Pod")
SERVICE = gvk_string("", "v1", "Service")
WIDGET = gvk_string("example.com", "v1", "Widget")


# ------------------------------------------------------------ a fake that serves discovery

_EXTRA_KINDS = {
    "services": fake_server._Kind("services", "Service", "v1", True),
    "namespaces": fake_server._Kind("namespaces", "Namespace", "v1", False),
    "widgets": fake_server._Kind("widgets", "Widget", "example.com/v1", False),
}


class DiscoveryFake(FakeApiServer):
    """The fake API server plus API discovery (``GET /api/v1``, ``GET /apis/G/V``: an
    APIResourceList of the kinds it serves) and three more kinds: Services, Namespaces
    and a cluster-scoped custom resource ``example.com/v1`` Widget (its "CRD" installed
    while ``serve_widgets``)."""

    serve_widgets = True

    def _served(self) -> list[Any]:
        return [k for name, k in fake_server.KINDS.items()
                if name != "widgets" or self.serve_widgets]

    def _route(self, path: str) -> tuple[str, str | None, str | None] | None:
        route = super()._route(path)
        parts = [p for p in path.split("/") if p]
        if route is None and parts[:3] == ["apis", "example.com", "v1"] and self.serve_widgets:
            rest = parts[3:]
            if rest and rest[0] == "widgets":
                return "widgets", None, rest[1] if len(rest) > 1 else None
        return route

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        if request.method == "GET" and (parts == ["api", "v1"] or
                                        (len(parts) == 3 and parts[0] == "apis")):
            if request.headers.get("Authorization", "") != f"Bearer {self.token}":
                return web.json_response({"code": 401}, status=401)
            gv = "v1" if parts[0] == "api" else f"{parts[1]}/{parts[2]}"
            self.requests[("GET", gv, "discovery")] += 1
            failure = self._injected_failure(request.path)
            if failure is not None:
                return web.json_response({"kind": "Status", "code": failure,
                                          "message": "injected failure"}, status=failure)
            resources: list[dict[str, Any]] = []
            for k in self._served():
                if k.api_version == gv:
                    resources.append({"name": k.name, "singularName": k.kind.lower(),
                                      "namespaced": k.namespaced, "kind": k.kind,
                                      "verbs": ["get", "list", "watch"]})
                    resources.append({"name": f"{k.name}/status", "namespaced": k.namespaced,
                                      "kind": k.kind, "verbs": ["get"]})
            if not resources:
                return web.json_response({"kind": "Status", "code": 404,
                                          "message": "the server could not find the "
                                          "requested resource"}, status=404)
            return web.json_response({"kind": "APIResourceList", "groupVersion": gv,
                                      "resources": resources})
        return await super()._handle(request)

    def put_service(self, name: str, namespace: str = "default") -> Obj:
        return self.put("services", {"metadata": {"name": name, "namespace": namespace},
                                     "spec": {"ports": [{"port": 80}]}})


Obj = dict[str, Any]


@pytest_asyncio.fixture
async def fake(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[DiscoveryFake]:
    monkeypatch.setattr(fake_server, "KINDS",
                        MappingProxyType({**fake_server.KINDS, **_EXTRA_KINDS}))
    server = DiscoveryFake(bookmark_interval_s=0.1)
    await server.start()
    yield server
    await server.stop()


# --------------------------------------------------- the mock extractor (Go's mocks package)

@dataclass(frozen=True)
class RecorderParameters:
    group: str = param("group", "")
    version: str = param("version", "v1")
    kind: str = param("kind", "Pod")
    fail: bool = param("fail", False)


class Recorder:
    """GIE's ``mocks.NotificationExtractor``: records every event; ``fail`` raises after
    recording (Go: ``WithExtractError``); the kind defaults to Pod (Go: ``WithGVK``)."""

    type_name = "recorder"
    Parameters = RecorderParameters
    data_input = DATA_K8S_NOTIFICATIONS

    def __init__(self, name: str, gvk: str = POD, fail: bool = False) -> None:
        self.name = name
        self.gvk = gvk
        self.fail = fail
        self.events: list[tuple[str, Obj]] = []

    @classmethod
    def from_params(cls, name: str, params: RecorderParameters,
                    handle: PluginHandle) -> Recorder:
        return cls(name, gvk_string(params.group, params.version, params.kind), params.fail)

    def extract_notification(self, event: str, obj: dict[str, Any]) -> None:
        self.events.append((event, obj))
        if self.fail:
            raise RuntimeError("test error")

    def seen(self, event: str, name: str, since: int = 0) -> bool:
        return any(e == event and o["metadata"]["name"] == name
                   for e, o in self.events[since:])

    def names(self) -> list[tuple[str, str]]:
        return [(e, o["metadata"]["name"]) for e, o in self.events]


def registry() -> Registry:
    reg = default_registry()
    reg.register_class(Recorder)
    return reg


def load(text: str) -> BuiltConfig:
    return build(parse_config(text, "cfg.yaml"), registry())


POD_WATCHER = """
plugins:
- type: queue-scorer
- {type: k8s-notification-source, name: pod-watcher, parameters: {version: v1, kind: Pod}}
- {type: recorder, name: pod-extractor}
dataLayer:
  sources:
  - pluginRef: pod-watcher
    extractors: [{pluginRef: pod-extractor}]
"""


@dataclass
class Link:
    """What :class:`NotificationWatches` reads of the Kubernetes discovery."""

    api: KubeApi
    options: KubernetesOptions


def link(api: KubeApi, **kw: Any) -> Link:
    if "pool_name" not in kw:
        kw["standalone"] = PoolSpec(APP, (8000,))
    return Link(api, KubernetesOptions(namespace=kw.pop("namespace", "default"),
                                       reflector=FAST, **kw))


@pytest_asyncio.fixture
async def watching(api: KubeApi) -> AsyncIterator[Callable[..., Any]]:
    """``await watching(config_text, **scope)`` → (built config, started watches)."""
    started: list[NotificationWatches] = []

    async def start(text: str = POD_WATCHER, **kw: Any) -> tuple[BuiltConfig,
                                                                  NotificationWatches]:
        built = load(text)
        timeout = kw.pop("sync_timeout_s", 10.0)
        watches = NotificationWatches(built.data_layer, link(api, **kw), sync_timeout_s=timeout)
        started.append(watches)
        await watches.start()
        return built, watches

    yield start
    for w in started:
        await w.stop()


def pod(fake: DiscoveryFake, name: str, namespace: str = "default", **labels: str) -> Obj:
    return fake.put_pod(name, "10.0.0.1", labels={**APP, **labels}, namespace=namespace)


# ======================================= k8s_datasource_integration_test.go

async def test_bind_notification_source_create_update_delete(
        fake: DiscoveryFake, api: KubeApi) -> None:
    """TestIntegrationBindNotificationSource: a source bound on its own (Go:
    ``BindNotificationSource(src, [extractor], mgr)``) sees a Pod's creation, update and
    deletion."""
    src = K8sNotificationSource("pod-watcher", "", "v1", "Pod")
    ext = Recorder("pod-extractor")
    watch = NotificationWatch(api, SourceConfig(src, (ext,)), link(api).options, FAST)
    await watch.resolve()
    watch.start()
    try:
        assert watch.reflector is not None
        await eventually(lambda: watch.reflector is not None and watch.reflector.synced)
        before = len(ext.events)
        pod(fake, "integration-test-pod")
        await eventually(lambda: ext.seen("add-or-update", "integration-test-pod", before))
        before = len(ext.events)
        pod(fake, "integration-test-pod", updated="true")
        await eventually(lambda: ext.seen("add-or-update", "integration-test-pod", before))
        assert ext.events[-1][1]["metadata"]["labels"]["updated"] == "true"
        before = len(ext.events)
        fake.delete("pods", "integration-test-pod")
        await eventually(lambda: ext.seen("delete", "integration-test-pod", before))
        _, gone = ext.events[-1]
        assert (gone["metadata"]["name"], gone["metadata"]["namespace"]) == (
            "integration-test-pod", "default")
    finally:
        await watch.stop()
    await eventually(lambda: fake.open_watches("pods") == 0)


async def test_notification_source_coexists_with_endpoint_discovery(
        fake: DiscoveryFake, watching: Any, harness: Any) -> None:
    """TestIntegrationBindNotificationSourceWithReconciler: the source and another
    controller of the same kind (Go: a Pod reconciler; here the endpoint discovery,
    which watches the same Pods) both see every change."""
    h = await harness(standalone=PoolSpec(APP, (8000,)))
    built, _ = await watching()
    ext: Recorder = built.plugins["pod-extractor"]  # type: ignore[assignment]
    assert await h.source.wait_ready(5)
    fake.put_pod("test-pod-with-reconciler", "10.0.0.7", labels=APP)
    await eventually(lambda: ext.seen("add-or-update", "test-pod-with-reconciler")
                     and h.keys() == ["10.0.0.7:8000"])
    fake.put_pod("test-pod-with-reconciler", "10.0.0.7", labels=APP, ready=False)
    await eventually(lambda: len(ext.events) == 2 and h.keys() == [])
    fake.delete("pods", "test-pod-with-reconciler")
    await eventually(lambda: ext.seen("delete", "test-pod-with-reconciler"))


# ============================================ runtime_notification_test.go

@pytest.mark.parametrize("case", ["add", "update", "delete"])
async def test_runtime_dispatches_events(case: str, fake: DiscoveryFake,
                                         watching: Any) -> None:
    """TestRuntimeNotificationDispatch: the add, update and delete cases, through the
    config (Go: ``Runtime.Configure`` then ``Start``)."""
    built, _ = await watching()
    ext: Recorder = built.plugins["pod-extractor"]  # type: ignore[assignment]
    before = len(ext.events)
    pod(fake, "test-pod")
    if case == "update":
        pod(fake, "test-pod", updated="true")
    if case == "delete":
        await eventually(lambda: ext.seen("add-or-update", "test-pod", before))
        fake.delete("pods", "test-pod")
    want = "delete" if case == "delete" else "add-or-update"
    await eventually(lambda: ext.seen(want, "test-pod", before))
    if case == "update":
        await eventually(lambda: sum(1 for e, o in ext.events[before:]
                                     if o["metadata"]["name"] == "test-pod") == 2)


async def test_multiple_extractors_and_a_failing_one(fake: DiscoveryFake,
                                                     watching: Any) -> None:
    """TestRuntimeNotificationDispatch "multiple extractors receive events" and
    "extractor error doesn't stop other extractors"."""
    built, watches = await watching("""
        plugins:
        - type: queue-scorer
        - {type: k8s-notification-source, name: pod-watcher, parameters: {version: v1, kind: Pod}}
        - {type: recorder, name: error-extractor, parameters: {fail: true}}
        - {type: recorder, name: working-extractor}
        dataLayer:
          sources:
          - pluginRef: pod-watcher
            extractors: [{pluginRef: error-extractor}, {pluginRef: working-extractor}]
    """)
    failing: Recorder = built.plugins["error-extractor"]  # type: ignore[assignment]
    working: Recorder = built.plugins["working-extractor"]  # type: ignore[assignment]
    pod(fake, "test-pod-error")
    await eventually(lambda: working.seen("add-or-update", "test-pod-error"))
    assert failing.seen("add-or-update", "test-pod-error")
    # One copy per event, shared by the source's extractors; the cache keeps its own.
    assert failing.events[-1][1] is working.events[-1][1]
    working.events[-1][1]["metadata"]["name"] = "mutated"
    reflector = watches.watches[0].reflector
    assert reflector is not None
    assert reflector.objects["default/test-pod-error"]["metadata"]["name"] == "test-pod-error"


async def test_runtime_with_different_gvks(fake: DiscoveryFake, watching: Any) -> None:
    """TestRuntimeNotificationDifferentGVKs: a Pod source and a Service source, each
    feeding its own extractor."""
    built, _ = await watching("""
        plugins:
        - type: queue-scorer
        - {type: k8s-notification-source, name: pod-watcher, parameters: {version: v1, kind: Pod}}
        - {type: k8s-notification-source, name: svc-watcher,
           parameters: {version: v1, kind: Service}}
        - {type: recorder, name: pod-extractor}
        - {type: recorder, name: svc-extractor, parameters: {kind: Service}}
        dataLayer:
          sources:
          - pluginRef: pod-watcher
            extractors: [{pluginRef: pod-extractor}]
          - pluginRef: svc-watcher
            extractors: [{pluginRef: svc-extractor}]
    """)
    pods: Recorder = built.plugins["pod-extractor"]  # type: ignore[assignment]
    services: Recorder = built.plugins["svc-extractor"]  # type: ignore[assignment]
    pod(fake, "test-pod-gvk")
    await eventually(lambda: pods.seen("add-or-update", "test-pod-gvk"))
    fake.put_service("test-svc")
    await eventually(lambda: services.seen("add-or-update", "test-svc"))
    assert pods.names() == [("add-or-update", "test-pod-gvk")]
    assert services.names() == [("add-or-update", "test-svc")]


# ====================================================== Configure's checks (the loader)

def test_configure_rejects_what_go_rejects() -> None:
    def rejected(text: str, *fragments: str) -> None:
        with pytest.raises(ConfigError) as info:
            load(text)
        for f in fragments:
            assert f in str(info.value), str(info.value)

    # validateSourceExtractors: the GVKs must match.
    rejected("""
        plugins:
        - type: queue-scorer
        - {type: k8s-notification-source, name: w, parameters: {version: v1, kind: Pod}}
        - {type: recorder, name: r, parameters: {kind: Service}}
        dataLayer: {sources: [{pluginRef: w, extractors: [{pluginRef: r}]}]}
    """, "cfg.yaml: dataLayer.sources[0].extractors[0].pluginRef: extractor 'r' GVK "
         "/v1, Kind=Service does not match source 'w' GVK /v1, Kind=Pod")
    # validateExtractorCompatible: the extractor must be a NotificationExtractor.
    rejected("""
        plugins:
        - type: queue-scorer
        - {type: k8s-notification-source, name: w, parameters: {version: v1, kind: Pod}}
        - {type: tests.unit.gie.test_datalayer_notifications:NoMethod, name: r}
        dataLayer: {sources: [{pluginRef: w, extractors: [{pluginRef: r}]}]}
    """, "dataLayer.sources[0].extractors[0].pluginRef: extractor 'r' (no-method) is not a "
         "k8s-notification-source extractor: it needs gvk and extract_notification")
    # Configure: one source per GVK.
    rejected("""
        plugins:
        - type: queue-scorer
        - {type: k8s-notification-source, name: source1, parameters: {version: v1, kind: Pod}}
        - {type: k8s-notification-source, name: source2, parameters: {version: v1, kind: Pod}}
        dataLayer: {sources: [{pluginRef: source1}, {pluginRef: source2}]}
    """, "duplicate notification source GVK /v1, Kind=Pod")


class NoMethod:
    """Reads k8s notifications but implements no ``extract_notification``."""

    type_name = "no-method"
    data_input = DATA_K8S_NOTIFICATIONS
    gvk = POD

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: Any, handle: PluginHandle) -> NoMethod:
        return cls(name)


def test_recorder_is_a_notification_extractor() -> None:
    assert isinstance(Recorder("r"), NotificationExtractor)
    assert not isinstance(NoMethod("n"), NotificationExtractor)


async def test_a_source_without_extractors_is_watched_all_the_same(
        fake: DiscoveryFake, watching: Any) -> None:
    """Go's TestRuntimeConfigureWithNilExtractor: accepted; and Start binds it anyway."""
    _, watches = await watching("""
        plugins:
        - type: queue-scorer
        - {type: k8s-notification-source, name: w, parameters: {version: v1, kind: Service}}
        dataLayer: {sources: [{pluginRef: w}]}
    """)
    assert len(watches) == 1 and watches.watches[0].extractors == ()
    assert fake.requests[("GET", "services", "list")] == 1
    fake.put_service("s")
    await eventually(lambda: fake.open_watches("services") == 1)
    assert watches.watches[0].delivered == 0


# ====================================================== where each kind is watched

def test_watch_restriction_follows_gies_manager_cache() -> None:
    standalone = KubernetesOptions(namespace="ns", standalone=PoolSpec(APP, (8000,)))
    pool = KubernetesOptions(namespace="ns", pool_name="pool")
    assert watch_restriction("", "v1", "Pod", standalone) == ("ns", None)
    assert watch_restriction("", "v1", "Pod", pool) == ("ns", None)
    assert watch_restriction("", "v1", "Service", pool) == (None, None)
    assert watch_restriction("apps", "v1", "Deployment", pool) == (None, None)
    ip = ("inference.networking.k8s.io", "v1", "InferencePool")
    assert watch_restriction(*ip, pool) == ("ns", "metadata.name=pool")
    assert watch_restriction(*ip, standalone) == (None, None)  # no CRD reconcilers
    io = ("inference.networking.x-k8s.io", "v1alpha2", "InferenceObjective")
    assert watch_restriction(*io, pool) == ("ns", None)
    assert watch_restriction(*io, standalone) == (None, None)


async def test_pods_in_the_pool_namespace_services_everywhere(fake: DiscoveryFake,
                                                              watching: Any) -> None:
    built, watches = await watching("""
        plugins:
        - type: queue-scorer
        - {type: k8s-notification-source, name: pods, parameters: {version: v1, kind: Pod}}
        - {type: k8s-notification-source, name: svcs, parameters: {version: v1, kind: Service}}
        - {type: recorder, name: p}
        - {type: recorder, name: s, parameters: {kind: Service}}
        dataLayer:
          sources:
          - {pluginRef: pods, extractors: [{pluginRef: p}]}
          - {pluginRef: svcs, extractors: [{pluginRef: s}]}
    """, namespace="llm")
    p: Recorder = built.plugins["p"]  # type: ignore[assignment]
    s: Recorder = built.plugins["s"]  # type: ignore[assignment]
    assert [w.describe() for w in watches.watches] == [
        "'pods' (k8s-notification-source, /v1, Kind=Pod, namespace llm)",
        "'svcs' (k8s-notification-source, /v1, Kind=Service, all namespaces)"]
    pod(fake, "elsewhere", namespace="other")
    pod(fake, "mine", namespace="llm")
    fake.put_service("a", namespace="other")
    fake.put_service("b", namespace="llm")
    await eventually(lambda: p.names() == [("add-or-update", "mine")]
                     and sorted(s.names()) == [("add-or-update", "a"), ("add-or-update", "b")])


async def test_pool_mode_watches_its_inference_pool_by_name(fake: DiscoveryFake,
                                                            watching: Any) -> None:
    fake.put_pool("pool", APP, [8000])
    fake.put_pool("other", APP, [8000])
    built, _ = await watching("""
        plugins:
        - type: queue-scorer
        - {type: k8s-notification-source, name: pools,
           parameters: {group: inference.networking.k8s.io, version: v1, kind: InferencePool}}
        - {type: recorder, name: r,
           parameters: {group: inference.networking.k8s.io, kind: InferencePool}}
        dataLayer: {sources: [{pluginRef: pools, extractors: [{pluginRef: r}]}]}
    """, pool_name="pool")
    r: Recorder = built.plugins["r"]  # type: ignore[assignment]
    assert r.names() == [("add-or-update", "pool")]  # the first list, before start returned
    fake.put_pool("other", APP, [9000])
    fake.put_pool("pool", APP, [9000])
    await eventually(lambda: r.names()[-1] == ("add-or-update", "pool") and len(r.events) == 2)


async def test_custom_resource_and_cluster_scoped_kinds(fake: DiscoveryFake,
                                                        watching: Any) -> None:
    fake.put("widgets", {"metadata": {"name": "w1"}, "spec": {"size": 1}})
    built, watches = await watching("""
        plugins:
        - type: queue-scorer
        - {type: k8s-notification-source, name: widgets,
           parameters: {group: example.com, version: v1, kind: Widget}}
        - {type: recorder, name: r, parameters: {group: example.com, kind: Widget}}
        dataLayer: {sources: [{pluginRef: widgets, extractors: [{pluginRef: r}]}]}
    """)
    r: Recorder = built.plugins["r"]  # type: ignore[assignment]
    assert watches.watches[0].resource is not None
    assert watches.watches[0].resource.collection_path("default") == "/apis/example.com/v1/widgets"
    assert r.events == [("add-or-update", fake.get("widgets", "w1"))]
    fake.put("widgets", {"metadata": {"name": "w1"}, "spec": {"size": 2}})
    await eventually(lambda: r.events[-1][1]["spec"] == {"size": 2})


async def test_find_resource(fake: DiscoveryFake, api: KubeApi) -> None:
    pods = await find_resource(api, "", "v1", "Pod")
    assert (pods.name, pods.namespaced) == ("pods", True)
    assert pods.collection_path("ns") == "/api/v1/namespaces/ns/pods"
    assert pods.collection_path(None) == "/api/v1/pods"
    nodes = await find_resource(api, "", "v1", "Node")
    assert nodes.collection_path("ns") == "/api/v1/nodes"  # cluster-scoped
    pools = await find_resource(api, "inference.networking.k8s.io", "v1", "InferencePool")
    assert pools.collection_path("ns") == \
        "/apis/inference.networking.k8s.io/v1/namespaces/ns/inferencepools"


# ======================================================================= history

async def test_relist_reports_only_what_changed(fake: DiscoveryFake, watching: Any) -> None:
    """After 410 Gone the watch relists: unchanged objects are not reported again (GIE's
    filter on changed resourceVersions), changed and deleted ones are."""
    pod(fake, "same")
    pod(fake, "changed")
    pod(fake, "deleted")
    built, _ = await watching()
    ext: Recorder = built.plugins["pod-extractor"]  # type: ignore[assignment]
    assert sorted(ext.names()) == [("add-or-update", "changed"), ("add-or-update", "deleted"),
                                   ("add-or-update", "same")]
    lists = fake.requests[("GET", "pods", "list")]
    # In one step (no await): cut the watch, change things, forget the history — the
    # watch comes back to a 410 and relists.
    fake.drop_watches()
    pod(fake, "changed", v="2")
    fake.delete("pods", "deleted")
    pod(fake, "new")
    fake.compact()
    await eventually(lambda: fake.requests[("GET", "pods", "list")] > lists)
    await eventually(lambda: len(ext.events) == 6)
    assert sorted(ext.names()[3:]) == [("add-or-update", "changed"), ("add-or-update", "new"),
                                       ("delete", "deleted")]


# =================================================================== startup failures

async def test_kind_not_served_fails_startup(fake: DiscoveryFake, watching: Any) -> None:
    fake.serve_widgets = False
    text = """
        plugins:
        - type: queue-scorer
        - {type: k8s-notification-source, name: widgets,
           parameters: {group: example.com, version: v1, kind: Widget}}
        dataLayer: {sources: [{pluginRef: widgets}]}
    """
    with pytest.raises(ConfigError, match=r"^cfg.yaml: dataLayer.sources\[0\]: 'widgets' "
                       r"\(k8s-notification-source, example.com/v1, Kind=Widget, all "
                       r"namespaces\): the API server does not serve example.com/v1 .*install"):
        await watching(text)
    with pytest.raises(ConfigError, match=r"no kind 'Gadget' in core/v1 \(served: .*Pod.*\)"):
        await watching(text.replace("group: example.com, version: v1, kind: Widget",
                                    "version: v1, kind: Gadget"))


async def test_forbidden_list_fails_startup(fake: DiscoveryFake, watching: Any) -> None:
    fake.fail_next("/api/v1/services", 403, times=100)
    with pytest.raises(ConfigError, match=r"forbids listing services \(403: .*\); grant the "
                       r"EPP's service account get, list and watch on services in every "
                       r"namespace \(a ClusterRole\)"):
        await watching("""
            plugins:
            - type: queue-scorer
            - {type: k8s-notification-source, name: s, parameters: {version: v1, kind: Service}}
            dataLayer: {sources: [{pluginRef: s}]}
        """)


async def test_first_list_must_complete_in_time(fake: DiscoveryFake, watching: Any) -> None:
    fake.fail_next("/api/v1/namespaces/default/pods", 500, times=1000)
    with pytest.raises(ConfigError, match=r"the first list of pods did not complete within "
                       r"0.5s \(KubeApiError: .*500"):
        await watching(sync_timeout_s=0.5)


async def test_transient_failures_are_retried(fake: DiscoveryFake, watching: Any) -> None:
    fake.fail_next("/api/v1", 503, times=2)  # discovery, then the list
    built, _ = await watching()
    pod(fake, "p")
    ext: Recorder = built.plugins["pod-extractor"]  # type: ignore[assignment]
    await eventually(lambda: ext.seen("add-or-update", "p"))


def test_without_an_api_server_a_k8s_source_fails_startup() -> None:
    """GIE's EPP cannot run without an API server; here --endpoints/--endpoints-file
    have none, and a data layer with a k8s-notification-source is a startup error."""
    built = load(POD_WATCHER)
    with pytest.raises(ConfigError, match=r"^cfg.yaml: dataLayer.sources\[0\]: 'pod-watcher' "
                       r"\(k8s-notification-source\) watches /v1, Kind=Pod through the "
                       r"Kubernetes API, and this EPP has none: .* --pool-name or "
                       r"--endpoint-selector, or remove the source from dataLayer.sources"):
        NotificationWatches(built.data_layer, None)
    # Nothing to watch: nothing needed.
    assert len(NotificationWatches(None, None)) == 0
    assert len(NotificationWatches(DataLayerConfig(), None)) == 0


# ============================================================ through `epp serve`

async def test_epp_serve_feeds_a_python_extractor(fake: DiscoveryFake, tmp_path: Path) -> None:
    fake.put_pod("a", "10.0.0.1", labels=APP)
    config = POD_WATCHER.replace("type: recorder",
                                 "type: tests.unit.gie.test_datalayer_notifications:Recorder")
    server = EppServer(ServeOptions(
        listen=ListenOptions(grpc_port=free_port(), grpc_health_port=free_port(),
                             metrics_port=free_port(), bind_address="127.0.0.1"),
        config=ConfigOptions(text=config),
        kubernetes=KubernetesSourceOptions(
            endpoint_selector="app=vllm", endpoint_target_ports="8000", reflector=FAST,
            kubeconfig=str(fake.write_kubeconfig(tmp_path / "kc"))),
        scraping=ScrapingOptions(enabled=False),
        observability=ObservabilityOptions(tracing=False)))
    await server.start()
    try:
        ext = server.parts.built.plugins["pod-extractor"]
        assert isinstance(ext, Recorder)
        assert ext.names() == [("add-or-update", "a")]  # listed before start() returned
        fake.put_pod("b", "10.0.0.2", labels=APP)
        await eventually(lambda: ext.seen("add-or-update", "b"))
    finally:
        await server.stop()
    await eventually(lambda: fake.open_watches("pods") == 0)
    n = len(ext.events)
    fake.put_pod("c", "10.0.0.3", labels=APP)
    assert len(ext.events) == n  # stopped with the server


async def test_epp_serve_with_static_endpoints_refuses_a_k8s_source() -> None:
    server = EppServer(ServeOptions(
        listen=ListenOptions(grpc_port=free_port(), grpc_health_port=free_port(),
                             metrics_port=free_port(), bind_address="127.0.0.1"),
        config=ConfigOptions(text=POD_WATCHER.replace(
            "type: recorder", "type: tests.unit.gie.test_datalayer_notifications:Recorder")),
        static=StaticSourceOptions(endpoints="127.0.0.1:8000"),
        scraping=ScrapingOptions(enabled=False),
        observability=ObservabilityOptions(tracing=False)))
    with pytest.raises(ConfigError, match=r"^--config-text: dataLayer.sources\[0\]: "
                       r"'pod-watcher' \(k8s-notification-source\) watches /v1, Kind=Pod"):
        await server.start()


# ================================ docs/plugins.md's worked example (examples/plugins/)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


async def test_drain_filter_example(fake: DiscoveryFake, api: KubeApi,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.delitem(sys.modules, "plugins.drain", raising=False)
    monkeypatch.delitem(sys.modules, "plugins", raising=False)
    built = load_and_build(str(EXAMPLES / "plugins" / "drain.yaml"))
    drain = built.plugins["drain"]
    assert isinstance(drain, NotificationExtractor)
    fake.put_pod("vllm-0", "10.0.0.1", labels=APP)
    fake.put_pod("vllm-1", "10.0.0.2", labels=APP,
                 annotations={"example.com/drain": "true"})
    watches = NotificationWatches(built.data_layer, link(api))
    await watches.start()
    try:
        eps = [Endpoint(name=f"vllm-{i}-rank-0", address=f"10.0.0.{i + 1}", port=8000)
               for i in range(2)]
        request = LLMRequest(request_id="r", target_model="m", incoming_model="m",
                             prompt="hi", api=ApiType.COMPLETIONS, headers={})
        profile = built.scheduler.profiles["default"]
        assert profile.filters == (drain,)

        def kept() -> list[str]:
            return [e.name for e in profile.filters[0].filter({}, request, eps)]

        assert kept() == ["vllm-0-rank-0"]
        fake.put_pod("vllm-1", "10.0.0.2", labels=APP)  # the annotation removed
        await eventually(lambda: kept() == ["vllm-0-rank-0", "vllm-1-rank-0"])
        fake.put_pod("vllm-0", "10.0.0.1", labels=APP,
                     annotations={"example.com/drain": "true"})
        await eventually(lambda: kept() == ["vllm-1-rank-0"])
        fake.delete("pods", "vllm-0")
        await eventually(lambda: kept() == ["vllm-0-rank-0", "vllm-1-rank-0"])
    finally:
        await watches.stop()
