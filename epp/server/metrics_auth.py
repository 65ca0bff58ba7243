"""Authentication and authorization on the metrics port (``--metrics-endpoint-auth``).

GIE's EPP (cmd/epp/runner/runner.go) puts controller-runtime's
``filters.WithAuthenticationAndAuthorization`` in front of its metrics server: the
bearer token of each request is checked with a Kubernetes TokenReview, and the user it
names must be allowed the request's verb on its path by a SubjectAccessReview
(``nonResourceURLs: ["/metrics"], verbs: ["get"]`` in a ClusterRole — what GIE's chart
grants Prometheus). :class:`KubernetesAuth` does the same, with the same answers (401
``Unauthorized`` without a valid token, 401 ``Authentication failed`` when the review
fails, 403 ``Authorization denied for user …``) and the same caching (token reviews one
minute; access reviews five minutes when allowed, thirty seconds when denied).

:class:`BearerToken` is this EPP's own form, for running without Kubernetes: one static
token read from a file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from epp.discovery.kubeclient import KubeApi, status_reason

log = logging.getLogger(__name__)

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
# controller-runtime's DelegatingAuthenticatorConfig / DelegatingAuthorizerConfig.
TOKEN_CACHE_TTL_S = 60.0
ALLOW_CACHE_TTL_S = 300.0
DENY_CACHE_TTL_S = 30.0
REVIEW_TIMEOUT_S = 10.0
CACHE_SIZE = 4096


class MetricsAuth(Protocol):
    async def check(self, request: web.Request) -> web.Response | None:
        """None when ``request`` may proceed, else the answer to send instead."""


def _bearer(request: web.Request) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive,
    as Kubernetes' bearer-token authenticator reads it)."""
    parts = request.headers.get("Authorization", "").split()
    if len(parts) != 2 or parts[0].lower() != "bearer" or not parts[1]:
        return None
    return parts[1]


class BearerToken:
    """One static token (this EPP's ``--metrics-endpoint-auth FILE``)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

    async def check(self, request: web.Request) -> web.Response | None:
        if hmac.compare_digest(request.headers.get("Authorization", ""), self._expected):
            return None
        return web.Response(status=401, text="missing or wrong bearer token\n",
                            headers={"WWW-Authenticate": "Bearer"})


@dataclass(frozen=True)
class User:
    name: str
    uid: str
    groups: tuple[str, ...]
    extra: Mapping[str, tuple[str, ...]]


class _TtlCache:
    """A small expiring map; the oldest entries go first when it is full."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self._size = size
        self._items: dict[Any, tuple[float, Any]] = {}

    def get(self, key: Any) -> Any:
        hit = self._items.get(key)
        if hit is None:
            return None
        expires, value = hit
        if time.monotonic() >= expires:
            del self._items[key]
            return None
        return value

    def put(self, key: Any, value: Any, ttl_s: float) -> None:
        self._items.pop(key, None)
        while len(self._items) >= self._size:
            del self._items[next(iter(self._items))]
        self._items[key] = (time.monotonic() + ttl_s, value)


class ReviewError(Exception):
    """A review could not be made (transport failure or an error status)."""


class KubernetesAuth:
    """TokenReview + SubjectAccessReview, as GIE's metrics endpoint (see the module doc)."""

    def __init__(self, api: KubeApi) -> None:
        self._api = api
        self._tokens = _TtlCache()  # sha256(token) → User | False
        self._access = _TtlCache()  # (user, verb, path) → bool

    async def check(self, request: web.Request) -> web.Response | None:
        token = _bearer(request)
        if token is None:
            return _error(401, "Unauthorized")
        try:
            user = await self.authenticate(token)
        except ReviewError as e:
            log.error("metrics endpoint: token review failed: %s", e)
            return _error(401, "Authentication failed")
        if user is None:
            return _error(401, "Unauthorized")
        verb = request.method.lower()
        try:
            allowed = await self.authorize(user, verb, request.path)
        except ReviewError as e:
            log.error("metrics endpoint: access review for user %s failed: %s", user.name, e)
            return _error(403, f"Authorization for user {user.name} failed")
        if not allowed:
            log.debug("metrics endpoint: %s %s denied for user %s", verb, request.path,
                      user.name)
            return _error(403, f"Authorization denied for user {user.name}")
        return None

    async def authenticate(self, token: str) -> User | None:
        key = hashlib.sha256(token.encode()).digest()
        cached = self._tokens.get(key)
        if cached is not None:
            return cached or None
        status = await self._review(TOKEN_REVIEWS, {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "spec": {"token": token}})
        user: User | None = None
        if status.get("authenticated") is True:
            u = status.get("user") or {}
            user = User(name=str(u.get("username", "")), uid=str(u.get("uid", "")),
                        groups=tuple(str(g) for g in u.get("groups") or ()),
                        extra={str(k): tuple(str(x) for x in v)
                               for k, v in (u.get("extra") or {}).items()})
        self._tokens.put(key, user or False, TOKEN_CACHE_TTL_S)
        return user

    async def authorize(self, user: User, verb: str, path: str) -> bool:
        key = (user.name, user.uid, user.groups, tuple(sorted(user.extra.items())), verb,
               path)
        cached = self._access.get(key)
        if cached is not None:
            return bool(cached)
        spec: dict[str, Any] = {"user": user.name, "groups": list(user.groups),
                                "nonResourceAttributes": {"path": path, "verb": verb}}
        if user.uid:
            spec["uid"] = user.uid
        if user.extra:
            spec["extra"] = {k: list(v) for k, v in user.extra.items()}
        status = await self._review(ACCESS_REVIEWS, {
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": spec})
        allowed = status.get("allowed") is True
        self._access.put(key, allowed, ALLOW_CACHE_TTL_S if allowed else DENY_CACHE_TTL_S)
        return allowed

    async def _review(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            code, data = await self._api.request("POST", path, body=body,
                                                 timeout_s=REVIEW_TIMEOUT_S)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise ReviewError(f"{path}: {type(e).__name__}: {e}") from e
        if not 200 <= code < 300 or not isinstance(data, dict):
            raise ReviewError(f"{path}: HTTP {code}: {status_reason(data)}")
        status = data.get("status")
        return status if isinstance(status, dict) else {}


def _error(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text + "\n")
