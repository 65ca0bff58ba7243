"""A small async Kubernetes API client: JSON in, JSON out, over kubernetes-asyncio.

kubernetes-asyncio supplies what is hard to get right — reading kubeconfig files (client
certificates, tokens, exec and OIDC auth providers) and the in-cluster service account
(with token rotation) — and an aiohttp session with the cluster's TLS settings. On top of
it this module speaks plain JSON to arbitrary API paths, so Pods, Nodes, InferencePools
(a custom resource) and Leases all go through one code path, as dicts, without building
the generated model classes (slow, and absent for custom resources).

Contract:

- :func:`connect` resolves the configuration: an explicit kubeconfig path, else the
  in-cluster service account when ``KUBERNETES_SERVICE_HOST`` is set, else ``$KUBECONFIG``
  (first entry), else ``~/.kube/config``; none usable → :class:`~epp.errors.ConfigError`.
- :meth:`KubeApi.request` returns ``(status, body)`` for any status; it raises only for
  transport failures (``aiohttp.ClientError``, ``OSError``, ``TimeoutError``).
- :meth:`KubeApi.stream` opens a watch and yields decoded JSON lines until the server ends
  the stream; a non-2xx answer raises :class:`KubeApiError`.
- :func:`find_resource` maps a kind to its resource (plural name, namespaced or not)
  with API discovery, as client-go's REST mapper does.
- No threads: kubernetes-asyncio's thread pool is only used for ``async_req`` calls,
  which this module never makes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from epp.errors import ConfigError

log = logging.getLogger(__name__)

JsonObj = dict[str, Any]
Query = Sequence[tuple[str, str]]

# Metadata-only views (what client-go's metadata informers ask for): labels without the
# status, images and conditions of a full Node. Servers that cannot do it send full objects.
ACCEPT_METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
ACCEPT_METADATA = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"


class KubeApiError(Exception):
    """The API server answered with an error status (``status``; ``reason`` from its Status)."""

    def __init__(self, status: int, reason: str, path: str = "") -> None:
        super().__init__(f"{path or 'kubernetes API'}: HTTP {status}: {reason}")
        self.status = status
        self.reason = reason


def status_reason(body: Any) -> str:
    """The human part of a Kubernetes ``Status`` body (or the body itself, shortened)."""
    if isinstance(body, Mapping):
        msg = body.get("message") or body.get("reason")
        if msg:
            return str(msg)
    return str(body)[:200]


def _default_kubeconfig() -> str | None:
    env = os.environ.get("KUBECONFIG")
    if env:
        first = env.split(os.pathsep)[0]
        if first:
            return first
    home = Path("~/.kube/config").expanduser()
    return str(home) if home.exists() else None


class KubeApi:
    """An authenticated connection to one API server. Use :func:`connect` to make one.

    Lifecycle: usable once created; :meth:`close` releases the HTTP session (idempotent).
    """

    def __init__(self, client: Any, loader: Any = None, describe: str = "") -> None:
        self._client = client
        self._loader = loader
        self.describe = describe

    @property
    def host(self) -> str:
        return str(self._client.configuration.host)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _reauth(self) -> None:
        """Reload kubeconfig credentials (exec/OIDC tokens expire); in-cluster tokens
        rotate by themselves through kubernetes-asyncio's refresh hook."""
        if self._loader is not None:
            try:
                await self._loader.load_and_set(self._client.configuration)
            except Exception as e:  # noqa: BLE001 - a broken auth plugin must not kill the watcher
                log.warning("could not refresh Kubernetes credentials: %s", e)

    async def _call(self, method: str, path: str, query: Query | None, body: Any,
                    headers: Mapping[str, str] | None,
                    timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        if self._client is None:
            raise RuntimeError("KubeApi is closed")
        hdrs = {"Accept": "application/json", "Content-Type": "application/json"}
        if headers:
            hdrs.update(headers)
        resp: aiohttp.ClientResponse = await self._client.call_api(
            path, method, query_params=list(query or []), header_params=hdrs, body=body,
            auth_settings=["BearerToken"], _preload_content=False, _request_timeout=timeout)
        return resp

    async def request(self, method: str, path: str, *, query: Query | None = None,
                      body: Any = None, headers: Mapping[str, str] | None = None,
                      timeout_s: float = 30.0) -> tuple[int, Any]:
        """One request; returns (HTTP status, decoded JSON body or None)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        for attempt in (0, 1):
            resp = await self._call(method, path, query, body, headers, timeout)
            try:
                raw = await resp.read()
            finally:
                resp.release()
            if resp.status == 401 and attempt == 0 and self._loader is not None:
                await self._reauth()
                continue
            try:
                data = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                data = raw.decode("utf-8", "replace")
            return resp.status, data
        raise AssertionError("unreachable")

    async def get_json(self, path: str, *, query: Query | None = None,
                       headers: Mapping[str, str] | None = None,
                       timeout_s: float = 30.0) -> JsonObj:
        """GET and decode; a non-2xx status raises :class:`KubeApiError`."""
        status, data = await self.request("GET", path, query=query, headers=headers,
                                          timeout_s=timeout_s)
        if not 200 <= status < 300:
            raise KubeApiError(status, status_reason(data), path)
        if not isinstance(data, dict):
            raise KubeApiError(status, "expected a JSON object", path)
        return data

    async def stream(self, path: str, *, query: Query, headers: Mapping[str, str] | None = None,
                     read_timeout_s: float = 330.0) -> AsyncIterator[JsonObj]:
        """Open a watch and yield each JSON line.

        ``read_timeout_s`` bounds the silence between two reads (a dead connection without
        a FIN); the server's own ``timeoutSeconds`` should be shorter. The connection is
        closed when the generator is closed or cancelled.
        """
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_timeout_s)
        resp = await self._call("GET", path, query, None, headers, timeout)
        try:
            if resp.status == 401 and self._loader is not None:
                await self._reauth()
            if not 200 <= resp.status < 300:
                raw = await resp.read()
                try:
                    data: Any = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    data = raw.decode("utf-8", "replace")
                raise KubeApiError(resp.status, status_reason(data), path)
            while True:
                line = await resp.content.readline()
                if not line:
                    return
                line = line.strip()
                if not line:
                    continue
                event = orjson.loads(line)
                if isinstance(event, dict):
                    yield event
        finally:
            resp.close()


@dataclass(frozen=True)
class ApiResource:
    """A kind as the API server serves it (one ``APIResourceList`` entry)."""

    group: str  # "" for the core group
    version: str
    kind: str
    name: str  # the resource (plural), e.g. "pods"
    namespaced: bool

    def collection_path(self, namespace: str | None = None) -> str:
        """The list/watch path: in ``namespace`` (namespaced kinds), else cluster-wide
        (every namespace, for a namespaced kind)."""
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        if namespace and self.namespaced:
            return f"{base}/namespaces/{namespace}/{self.name}"
        return f"{base}/{self.name}"


class KindNotServed(Exception):
    """The API server does not serve the kind (its group/version, or the kind in it)."""


async def find_resource(api: KubeApi, group: str, version: str, kind: str) -> ApiResource:
    """Map a kind to its resource with API discovery (``GET /api/v1``,
    ``GET /apis/GROUP/VERSION``), as client-go's REST mapper does.

    Raises :class:`KindNotServed` when the group/version is not served (404) or does not
    have the kind; :class:`KubeApiError` for another error status (403 …); transport
    errors as :meth:`KubeApi.request`."""
    path = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    status, data = await api.request("GET", path)
    if status == 404:
        raise KindNotServed(f"the API server does not serve {group or 'core'}/{version} "
                            f"(GET {path}: 404)")
    if not 200 <= status < 300 or not isinstance(data, dict):
        raise KubeApiError(status, status_reason(data), path)
    for res in data.get("resources") or []:
        if (isinstance(res, dict) and res.get("kind") == kind
                and "/" not in str(res.get("name", ""))):  # not a subresource
            return ApiResource(group, version, kind, str(res["name"]),
                               bool(res.get("namespaced")))
    kinds = sorted({str(r.get("kind")) for r in data.get("resources") or []
                    if isinstance(r, dict) and "/" not in str(r.get("name", ""))})
    raise KindNotServed(f"no kind {kind!r} in {group or 'core'}/{version} (served: "
                        f"{', '.join(kinds) or 'none'})")


async def connect(kubeconfig: str | None = None, context: str | None = None) -> KubeApi:
    """Build a :class:`KubeApi` from kubeconfig or the in-cluster service account.

    Raises :class:`~epp.errors.ConfigError` when no configuration is found or it does not
    load (the message says which file and why).
    """
    # Imported here: kubernetes-asyncio takes ~0.5 s to import, and only the Kubernetes
    # endpoint sources need it.
    from kubernetes_asyncio.client import ApiClient, Configuration
    from kubernetes_asyncio.config import ConfigException
    from kubernetes_asyncio.config.incluster_config import load_incluster_config
    from kubernetes_asyncio.config.kube_config import load_kube_config

    cfg = Configuration()
    loader: Any = None
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except ConfigException as e:
            raise ConfigError(f"in-cluster Kubernetes config: {e}") from e
        describe = "in-cluster service account"
    else:
        path = kubeconfig or _default_kubeconfig()
        if path is None:
            raise ConfigError("no Kubernetes configuration: not running in a cluster "
                              "(KUBERNETES_SERVICE_HOST unset) and no kubeconfig found; "
                              "give --kubeconfig FILE")
        if not Path(path).expanduser().is_file():
            raise ConfigError(f"--kubeconfig {path}: no such file")
        try:
            loader = await load_kube_config(config_file=str(Path(path).expanduser()),
                                            context=context, client_configuration=cfg,
                                            persist_config=False)
        except (ConfigException, OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"kubeconfig {path}: {e}") from e
        describe = f"kubeconfig {path}"
    client = ApiClient(configuration=cfg)
    client.user_agent = "epp"
    return KubeApi(client, loader, describe)
