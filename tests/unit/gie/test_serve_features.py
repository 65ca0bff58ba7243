"""What GIE's flags switch on, in process: --metrics-endpoint-auth=true (TokenReview and
SubjectAccessReview, as controller-runtime's filter), --enable-cert-reload, and
--disable-endpoint-subset-filter."""

from __future__ import annotations

import asyncio
import ssl
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.config.loader import load_and_build
from epp.errors import ServiceUnavailable
from epp.scheduling.types import ApiType, LLMRequest
from epp.server.app import EppServer
from epp.server.health import HealthReporter
from epp.server.listeners import grpc_server
from epp.server.metrics_auth import ACCESS_REVIEWS, TOKEN_REVIEWS
from epp.server.options import (
    KubernetesSourceOptions,
    ListenOptions,
    ObservabilityOptions,
    RoutingOptions,
    ScrapingOptions,
    ServeOptions,
    StaticSourceOptions,
    validate,
)
from epp.server.tls import self_signed_key_pair, server_credentials
from epp.server.wiring import PluginTimings, wire
from epp.stack.procs import free_port
from tests.k8s_fake import FakeApiServer

PROMETHEUS = "system:serviceaccount:monitoring:prometheus"
USERS = {"prom-token": PROMETHEUS, "bob-token": "bob"}


class ReviewingApiServer(FakeApiServer):
    """The fake API server, plus TokenReview and SubjectAccessReview: tokens in USERS
    authenticate; PROMETHEUS may GET /metrics, nobody anything else."""

    def __init__(self) -> None:
        super().__init__(bookmark_interval_s=0.5)
        self.reviews: Counter[str] = Counter()
        self.broken = False

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path not in (TOKEN_REVIEWS, ACCESS_REVIEWS):
            return await super()._handle(request)
        if request.headers.get("Authorization", "") != f"Bearer {self.token}":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        self.reviews[request.path] += 1
        if self.broken:
            return web.json_response({"kind": "Status", "code": 500, "message": "down"},
                                     status=500)
        body = await request.json()
        spec = body["spec"]
        if request.path == TOKEN_REVIEWS:
            user = USERS.get(spec["token"])
            status: dict[str, Any] = {"authenticated": user is not None}
            if user is not None:
                status["user"] = {"username": user, "uid": f"uid-{user}",
                                  "groups": ["system:authenticated"]}
        else:
            status = {"allowed": spec["user"] == PROMETHEUS and spec["uid"] == f"uid-{PROMETHEUS}"
                      and spec["nonResourceAttributes"] == {"path": "/metrics", "verb": "get"}}
        return web.json_response({**body, "status": status}, status=201)


@pytest_asyncio.fixture
async def reviewing() -> AsyncIterator[ReviewingApiServer]:
    server = ReviewingApiServer()
    await server.start()
    yield server
    await server.stop()


def _listen() -> ListenOptions:
    return ListenOptions(grpc_port=free_port(), grpc_health_port=free_port(),
                         metrics_port=free_port(), bind_address="127.0.0.1")


async def test_metrics_endpoint_auth_reviews_tokens_with_kubernetes(
        reviewing: ReviewingApiServer, tmp_path: Path) -> None:
    reviewing.put_pod("a", "10.0.0.1", labels={"app": "vllm"})
    listen = _listen()
    server = EppServer(ServeOptions(
        listen=listen,
        kubernetes=KubernetesSourceOptions(
            endpoint_selector="app=vllm", endpoint_target_ports="8000",
            kubeconfig=str(reviewing.write_kubeconfig(tmp_path / "kc"))),
        scraping=ScrapingOptions(enabled=False),
        observability=ObservabilityOptions(metrics_auth="true")))
    await server.start()
    url = f"http://127.0.0.1:{listen.metrics_port}"

    async def get(path: str, token: str | None = None) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with aiohttp.ClientSession() as s, s.get(url + path, headers=headers) as r:
            return r.status, await r.text()

    try:
        assert await get("/metrics") == (401, "Unauthorized\n")
        assert await get("/metrics", "nope") == (401, "Unauthorized\n")
        status, text = await get("/metrics", "prom-token")
        assert status == 200 and "inference_pool_ready_pods" in text
        assert await get("/metrics", "bob-token") == (
            403, "Authorization denied for user bob\n")
        # Authorized per path: the same user, another path.
        assert await get("/debug/decisions", "prom-token") == (
            403, f"Authorization denied for user {PROMETHEUS}\n")
        # Cached as controller-runtime caches: no new review for a known token and path.
        before = dict(reviewing.reviews)
        assert (await get("/metrics", "prom-token"))[0] == 200
        assert (await get("/metrics", "nope"))[0] == 401
        assert dict(reviewing.reviews) == before == {TOKEN_REVIEWS: 3, ACCESS_REVIEWS: 3}
        # A review that fails is an authentication failure, and not cached.
        reviewing.broken = True
        assert await get("/metrics", "new-token") == (401, "Authentication failed\n")
        reviewing.broken = False
        assert (await get("/metrics", "prom-token"))[0] == 200
    finally:
        await server.stop(0)


# ---------------------------------------------------------------------------- cert reload


async def _served_cert(port: int) -> str:
    return await asyncio.to_thread(ssl.get_server_certificate, ("127.0.0.1", port))


async def test_enable_cert_reload_serves_the_renewed_pair(tmp_path: Path) -> None:
    key1, cert1 = self_signed_key_pair()
    (tmp_path / "tls.key").write_bytes(key1)
    (tmp_path / "tls.crt").write_bytes(cert1)
    server = grpc_server(4 << 20)
    reporter = HealthReporter()
    health_pb2_grpc.add_HealthServicer_to_server(reporter.servicer, server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(str(tmp_path), True))
    await server.start()
    try:
        assert (await _served_cert(port)).strip() == cert1.decode().strip()
        key2, cert2 = self_signed_key_pair()
        # Half renewed (a new certificate, the old key): the old pair stays in service.
        (tmp_path / "tls.crt").write_bytes(cert2)
        assert (await _served_cert(port)).strip() == cert1.decode().strip()
        (tmp_path / "tls.key").write_bytes(key2)
        assert (await _served_cert(port)).strip() == cert2.decode().strip()
        # Clients trusting the new certificate connect.
        creds = grpc.ssl_channel_credentials(root_certificates=cert2)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=[
                ("grpc.ssl_target_name_override", "localhost")]) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


def test_without_reload_the_pair_is_read_once(tmp_path: Path) -> None:
    key, cert = self_signed_key_pair()
    other_key, _ = self_signed_key_pair()
    (tmp_path / "tls.key").write_bytes(other_key)
    (tmp_path / "tls.crt").write_bytes(cert)
    from epp.errors import ConfigError

    with pytest.raises(ConfigError, match="tls.key is not the key of tls.crt"):
        server_credentials(str(tmp_path))
    (tmp_path / "tls.key").write_bytes(key)
    server_credentials(str(tmp_path))


# ------------------------------------------------------------------ subset filter


def _request() -> LLMRequest:
    return LLMRequest(request_id="r1", target_model="m", incoming_model="m",
                      api=ApiType.COMPLETIONS, prompt="hi", headers={})


@pytest.mark.parametrize("disabled", [False, True])
async def test_disable_endpoint_subset_filter(disabled: bool) -> None:
    plan = validate(ServeOptions(
        static=StaticSourceOptions(endpoints="10.0.0.1:8000,10.0.0.2:8000"),
        routing=RoutingOptions(disable_endpoint_subset_filter=disabled)))
    timings = PluginTimings()
    parts = wire(plan, load_and_build(timer=timings), timings, None)
    if disabled:  # the hint is ignored: any pod of the pool
        d = parts.core.decide(_request(), ["10.9.9.9:8000"])
        assert d.destination in ("10.0.0.1:8000", "10.0.0.2:8000")
    else:
        for _ in range(3):
            assert parts.core.decide(_request(), ["10.0.0.2:8000"]).destination == \
                "10.0.0.2:8000"
        with pytest.raises(ServiceUnavailable, match="subset hint"):
            parts.core.decide(_request(), ["10.9.9.9:8000"])
