"""models-data-source / models-data-extractor (llm-d-router v0.10.0,
pkg/epp/framework/plugins/datalayer/{source,extractor,attribute}/models and their tests:
datasource_test.go, parsercontract_test.go, extractor_test.go): each endpoint's served
models polled from a local aiohttp ``/v1/models`` (plain and mTLS), and this project's
``served-models-filter`` routing by them."""

from __future__ import annotations

import datetime
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from epp.config.loader import load_and_build
from epp.datalayer.models import (
    DATA_MODELS,
    BadModelsResponse,
    ModelData,
    ModelResponse,
    ModelsDataSource,
    ModelsExtractor,
    ServedModelsFilter,
    parse_models,
)
from epp.datalayer.polling import PollingRunner
from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.types import ApiType, CycleState, Endpoint, LLMRequest
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, wire
from tests.polling import eventually


def make(type_name: str, params: dict[str, Any] | None = None, name: str | None = None) -> Any:
    build = default_registry().builder(type_name, "t")
    return build(name or type_name, params, "plugins[0].parameters", PluginHandle())


def ep(i: int, port: int = 8000) -> Endpoint:
    return Endpoint(name=f"pod-{i}", address=f"127.0.0.{i}", port=port)


def req(model: str) -> LLMRequest:
    return LLMRequest(request_id="r", target_model=model, incoming_model=model,
                      api=ApiType.CHAT_COMPLETIONS, prompt="p", headers={})


# ------------------------------------------------------------------------- the parser


@pytest.mark.parametrize("body", [  # llm-d's parser contract bodies
    b'{"object":"list","data":[]}',
    b'{"object":"list","data":[{"id":"qwen2.5-7b"}]}',
    b'{"object":"list","data":[{"id":"a","parent":"a"},{"id":"b"}]}',
])
def test_parse_contract(body: bytes) -> None:
    got = parse_models(body.decode())
    want = orjson.loads(body)
    assert got.object == "list"
    assert [(m.id, m.parent) for m in got.data] == [
        (m["id"], m.get("parent", "")) for m in want["data"]]


def test_parse_vllm_body_and_bad_bodies() -> None:
    vllm = {"object": "list", "data": [
        {"id": "food-review", "object": "model", "created": 1, "owned_by": "vllm",
         "root": "/models/base", "parent": None, "max_model_len": 4096, "permission": []},
        {"id": "lora1", "object": "model", "parent": "food-review"}]}
    assert parse_models(orjson.dumps(vllm).decode()) == ModelResponse(
        "list", (ModelData("food-review"), ModelData("lora1", "food-review")))
    assert parse_models("{}") == ModelResponse()
    for bad, msg in (("not json", "not JSON"), ("[]", "expected a JSON object"),
                     ('{"data": {}}', "'data' must be a list"),
                     ('{"data": [1]}', r"data\[0\] must be an object"),
                     ('{"data": [{"id": 5}]}', r"data\[0\].id must be a string"),
                     ('{"object": 1}', "'object' must be a string")):
        with pytest.raises(BadModelsResponse, match=msg):
            parse_models(bad)


# ------------------------------------------------------------------------- the plugins


def test_source_defaults_and_url() -> None:
    src = make("models-data-source")
    assert isinstance(src, ModelsDataSource) and src.data_output == DATA_MODELS
    assert (src.scheme, src.path, src.insecure_skip_verify, src.interval_s) == (
        "http", "/v1/models", True, None)
    assert src.url(ep(1)) == "http://127.0.0.1:8000/v1/models"
    assert src.ssl_context() is False
    src = make("models-data-source", {"scheme": "https", "path": "models", "interval": "5s"})
    assert src.url(Endpoint(name="x", address="fd00::1", port=9000)) == \
        "https://[fd00::1]:9000/models"
    assert src.interval_s == 5.0
    ctx = src.ssl_context()  # https, insecureSkipVerify (default): no verification
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize(("params", "fragment"), [
    ({"scheme": "ftp"}, "scheme: unsupported scheme 'ftp'"),
    ({"interval": "soon"}, "interval: expected a duration"),
    ({"path": ""}, "path: expected a URL path"),
    ({"insecureSkipVerify": "no"}, "insecureSkipVerify: expected true or false"),
    ({"scheme": "https", "insecureSkipVerify": False, "caCertPath": "/nope/ca.pem"},
     "plugins[0].parameters.caCertPath: reading CA cert /nope/ca.pem"),
    ({"scheme": "https", "clientCertPath": "/nope/c.pem", "clientKeyPath": "/nope/k.pem"},
     "plugins[0].parameters.clientCertPath: loading client cert /nope/c.pem"),
    ({"scheme": "https", "clientCertPath": "/nope/c.pem"},
     "clientKeyPath: loading client cert: set clientCertPath and clientKeyPath together"),
    ({"caCertPath": 3}, "caCertPath: expected a file path string"),
])
def test_source_rejects(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        make("models-data-source", params)
    assert fragment in str(info.value)


def test_source_tls_paths_are_ignored_with_http(caplog: pytest.LogCaptureFixture) -> None:
    src = make("models-data-source", {"caCertPath": "/nope/ca.pem"})
    assert src.ssl_context() is False
    assert "apply to scheme https only" in caplog.text


def test_extractor_stores_models_and_count() -> None:
    x = make("models-data-extractor", name="models")
    assert isinstance(x, ModelsExtractor) and x.data_input == DATA_MODELS
    assert dict(x.produces) == {"/v1/models/models": "ModelDataCollection"}
    e = ep(1)
    assert x.served_models(e) is None
    assert x.extract_poll(ModelResponse(), e) == {"/v1/models/models/count": 0.0}
    assert x.served_models(e) == ()
    data = (ModelData("food-review"), ModelData("lora1", "food-review"))
    assert x.extract_poll(ModelResponse("list", data), e) == {"/v1/models/models/count": 2.0}
    assert x.served_models(e.key) == data
    with pytest.raises(BadModelsResponse, match="expected a /v1/models response"):
        x.extract_poll({"DCGM_FI_DEV_GPU_UTIL": []}, e)
    x.endpoint_removed(e.key)
    assert x.served_models(e) is None
    with pytest.raises(ConfigError, match="unknown parameter"):
        from epp.framework.params import decoding
        with decoding(strict=True):
            make("models-data-extractor", {"x": 1})


# ------------------------------------------------------------------- the config


MODELS_CONFIG = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: models-data-source
  name: vllm-models-source
  parameters:
    scheme: "http"
    interval: "5s"
- type: models-data-extractor
  name: vllm-models-extractor
- type: metrics-data-source
- type: core-metrics-extractor
- type: served-models-filter
  parameters:
    modelsProducerName: vllm-models-extractor
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: served-models-filter
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors:
    - pluginRef: core-metrics-extractor
  - pluginRef: vllm-models-source
    extractors:
    - pluginRef: vllm-models-extractor
"""


def test_readme_config_loads_strictly() -> None:
    built = load_and_build(None, MODELS_CONFIG, strict=True)
    assert built.data_layer is not None
    sources = {s.source.name: s for s in built.data_layer.sources}
    entry = sources["vllm-models-source"]
    assert isinstance(entry.source, ModelsDataSource) and entry.source.interval_s == 5.0
    assert [e.name for e in entry.extractors] == ["vllm-models-extractor"]
    f = built.plugins["served-models-filter"]
    assert isinstance(f, ServedModelsFilter)
    assert f.extractor is built.plugins["vllm-models-extractor"]


@pytest.mark.parametrize(("old", "new", "fragment"), [
    # a dcgm extractor on the models source, a models extractor on the metrics source
    ("    extractors:\n    - pluginRef: vllm-models-extractor\n",
     ("    extractors:\n    - pluginRef: vllm-models-extractor\n    - pluginRef: dcgm\n"
     "- type: dcgm-extractor\n  name: dcgm\n"),
     ("reads prometheus-metrics, but source 'vllm-models-source' (models-data-source) "
     "produces models-response")),
    (("    - pluginRef: core-metrics-extractor\n  - pluginRef: vllm-models-source\n    "
     "extractors:\n    - pluginRef: vllm-models-extractor\n"),
     "    - pluginRef: core-metrics-extractor\n    - pluginRef: vllm-models-extractor\n",
     "reads models-response, but source 'metrics-data-source'"),
    ("    modelsProducerName: vllm-models-extractor\n", "    modelsProducerName: other\n",
     "no models-data-extractor named 'other'"),
    ("    modelsProducerName: vllm-models-extractor\n",
     "    modelsProducerName: vllm-models-extractor\n    onMissing: Maybe\n",
     "onMissing: must be 'Pass' or 'Fail', got 'Maybe'"),
])
def test_config_errors(old: str, new: str, fragment: str) -> None:
    assert old in MODELS_CONFIG
    text = MODELS_CONFIG.replace(old, new)
    if "name: dcgm\n" in text:  # move the new plugin into the plugins list
        text = text.replace("- type: dcgm-extractor\n  name: dcgm\n", "")
        text = text.replace("plugins:\n", "plugins:\n- type: dcgm-extractor\n  name: dcgm\n", 1)
    with pytest.raises(ConfigError) as info:
        load_and_build(None, text, strict=True)
    assert fragment in str(info.value)


# ------------------------------------------------------------------ served-models-filter


def test_served_models_filter() -> None:
    x = ModelsExtractor()
    f = make("served-models-filter")
    f.bind(PluginHandle({x.name: x, f.name: f}))
    a, b, c, d = ep(1), ep(2), ep(3), ep(4)
    x.extract_poll(ModelResponse("list", (ModelData("base"), ModelData("lora1", "base"))), a)
    x.extract_poll(ModelResponse("list", (ModelData("other"),)), b)
    x.extract_poll(ModelResponse("list", (ModelData("lora2", "base"),)), c)
    s = CycleState()
    assert f.filter(s, req("lora1"), [a, b, c, d]) == [a, d]  # d never polled: kept
    assert f.filter(s, req("base"), [a, b, c]) == [a]
    assert f.filter(s, req("nothing"), [a, b, c]) == []
    g = make("served-models-filter", {"matchParent": True, "onMissing": "Fail"})
    g.bind(PluginHandle({x.name: x, g.name: g}))
    assert g.filter(s, req("base"), [a, b, c, d]) == [a, c]


# ------------------------------------------------------------------ the fake server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeModelServer:
    """``/v1/models`` for every 127.0.0.x address: the models set for the address the
    request came in on (the pod IP)."""

    def __init__(self) -> None:
        self.models: dict[str, list[dict[str, str]]] = {}
        self.status = 200
        self.raw: str | None = None
        self.hits = 0
        self.accept: list[str] = []
        self.client_certs: list[Any] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        self.accept.append(request.headers.get("Accept", ""))
        tr = request.transport
        local = tr.get_extra_info("sockname")[0] if tr else ""
        if tr is not None and tr.get_extra_info("peercert") is not None:
            self.client_certs.append(tr.get_extra_info("peercert"))
        if self.raw is not None:
            return web.Response(text=self.raw, status=self.status)
        body = {"object": "list", "data": self.models.get(local, [])}
        return web.json_response(body, status=self.status)


async def start_server(fake: FakeModelServer, port: int,
                       ssl_ctx: ssl.SSLContext | None = None) -> web.AppRunner:
    app = web.Application()
    app.router.add_get("/v1/models", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port, ssl_context=ssl_ctx).start()
    return runner


@pytest.fixture
async def model_server() -> AsyncIterator[tuple[FakeModelServer, int]]:
    fake, port = FakeModelServer(), free_port()
    runner = await start_server(fake, port)
    try:
        yield fake, port
    finally:
        await runner.cleanup()


async def test_runner_polls_models_per_endpoint(
        model_server: tuple[FakeModelServer, int]) -> None:
    fake, port = model_server
    fake.models = {"127.0.0.1": [{"id": "base"}, {"id": "lora1", "parent": "base"}],
                   "127.0.0.2": [{"id": "other"}]}
    store = Datastore()
    store.set_endpoints([ep(1, port), ep(2, port)])
    x = ModelsExtractor()
    runner = PollingRunner(store, [(ModelsDataSource(), [x])], 0.02)
    runner.start()
    try:
        await eventually(lambda: x.served_models(ep(2, port)) is not None
                         and x.served_models(ep(1, port)) is not None)
        assert x.served_models(ep(1, port)) == (ModelData("base"), ModelData("lora1", "base"))
        assert x.served_models(ep(2, port)) == (ModelData("other"),)
        e1 = store.get(ep(1, port).key)
        assert e1 is not None and dict(e1.metrics.attributes) == {
            "/v1/models/models-data-extractor/count": 2.0}
        assert set(fake.accept) == {"application/json"}
        # an adapter unloaded: the next poll replaces the list
        fake.models["127.0.0.1"] = [{"id": "base"}]
        await eventually(lambda: x.served_models(ep(1, port)) == (ModelData("base"),))
        # a bad body or status is a failed poll: the last list stays
        fake.raw = "<html>"
        failed = runner.polls_failed
        await eventually(lambda: runner.polls_failed > failed + 2)
        fake.raw, fake.status = None, 503
        failed = runner.polls_failed
        await eventually(lambda: runner.polls_failed > failed + 2)
        assert x.served_models(ep(1, port)) == (ModelData("base"),)
    finally:
        await runner.stop()


async def test_config_routes_to_the_endpoint_serving_the_model(
        model_server: tuple[FakeModelServer, int]) -> None:
    """The README config through the server: models polled from the fake server, the
    request for ``lora1`` goes to the pod that serves it, ``other`` to the other."""
    fake, port = model_server
    fake.models = {"127.0.0.1": [{"id": "base"}, {"id": "lora1", "parent": "base"}],
                   "127.0.0.2": [{"id": "base"}, {"id": "other"}]}
    timings = PluginTimings()
    text = MODELS_CONFIG.replace('interval: "5s"', 'interval: "10ms"')
    built = load_and_build(None, text, timer=timings)
    keys_ = f"127.0.0.1:{port},127.0.0.2:{port}"
    parts = wire(validate(ServeOptions(static=StaticSourceOptions(endpoints=keys_))),
                 built, timings, None)
    assert parts.pollers is not None
    x = built.plugins["vllm-models-extractor"]
    assert isinstance(x, ModelsExtractor)
    parts.pollers.start()
    try:
        await eventually(lambda: all(x.served_models(e) is not None
                                     for e in parts.store.snapshot()))
        d = parts.director
        for i, (model, want) in enumerate((("lora1", 1), ("other", 2), ("lora1", 1))):
            body = orjson.dumps({"model": model, "messages": [{"role": "user",
                                                               "content": "hi"}]})
            routing = await d.route({":method": "POST", ":path": "/v1/chat/completions",
                                     "x-request-id": f"m{i}"}, body, True, None)
            d.on_done(routing.context, aborted=False)
            assert routing.destination == f"127.0.0.{want}:{port}"
    finally:
        await parts.pollers.stop()


# ------------------------------------------------------------------------------ mTLS


def _pki(tmp: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    crypto = pytest.importorskip("cryptography")
    del crypto
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("test-ca")).issuer_name(name("test-ca"))
          .public_key(ca_key.public_key()).serial_number(1)
          .not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    out = {"ca": tmp / "ca.pem"}
    out["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for who, usage, serial in (("server", ExtendedKeyUsageOID.SERVER_AUTH, 2),
                               ("client", ExtendedKeyUsageOID.CLIENT_AUTH, 3)):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(who)).issuer_name(ca.subject)
             .public_key(key.public_key()).serial_number(serial)
             .not_valid_before(now - datetime.timedelta(hours=1))
             .not_valid_after(now + datetime.timedelta(hours=1))
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if who == "server":
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        out[who] = tmp / f"{who}.pem"
        out[who].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{who}-key"] = tmp / f"{who}-key.pem"
        write_key(key, out[f"{who}-key"])
    return out


async def test_mtls_poll_with_ca_and_client_certificate(tmp_path: Path) -> None:
    pki = _pki(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki["ca"]))
    server_ctx.load_cert_chain(pki["server"], pki["server-key"])
    server_ctx.verify_mode = ssl.CERT_REQUIRED  # the server requires a client certificate
    fake, port = FakeModelServer(), free_port()
    fake.models = {"127.0.0.1": [{"id": "secure"}]}
    site = await start_server(fake, port, server_ctx)
    store = Datastore()
    store.set_endpoints([ep(1, port)])
    good = make("models-data-source", {
        "scheme": "https", "insecureSkipVerify": False, "caCertPath": str(pki["ca"]),
        "clientCertPath": str(pki["client"]), "clientKeyPath": str(pki["client-key"])})
    no_client = make("models-data-source", {"scheme": "https", "insecureSkipVerify": False,
                                            "caCertPath": str(pki["ca"])}, name="nc")
    system_ca = make("models-data-source", {
        "scheme": "https", "insecureSkipVerify": False, "clientCertPath": str(pki["client"]),
        "clientKeyPath": str(pki["client-key"])}, name="sys")
    xs = [ModelsExtractor("good"), ModelsExtractor("nc"), ModelsExtractor("sys")]
    runner = PollingRunner(store, [(good, [xs[0]]), (no_client, [xs[1]]),
                                   (system_ca, [xs[2]])], 0.02)
    runner.start()
    try:
        await eventually(lambda: xs[0].served_models(ep(1, port)) == (ModelData("secure"),))
        assert fake.client_certs  # the client certificate was presented
        await eventually(lambda: runner.polls_failed >= 4)
        # without a client certificate the server refuses; with the system CAs the
        # server's certificate is not trusted
        assert xs[1].served_models(ep(1, port)) is None
        assert xs[2].served_models(ep(1, port)) is None
    finally:
        await runner.stop()
        await site.cleanup()


def test_example_config_loads_strictly() -> None:
    """config/examples/llmd-models-dcgm.yaml: models + DCGM DaemonSet sources."""
    path = Path(__file__).parents[3] / "config" / "examples" / "llmd-models-dcgm.yaml"
    built = load_and_build(str(path), strict=True)
    assert built.data_layer is not None
    assert [s.source.type_name for s in built.data_layer.sources] == [
        "metrics-data-source", "models-data-source", "dcgm-data-source"]
    dcgm = built.plugins["dcgm-data-source"]
    assert getattr(dcgm, "use_node_address", False) is True
    f = built.plugins["served-models-filter"]
    assert isinstance(f, ServedModelsFilter)
    assert f.extractor is built.plugins["models-data-extractor"]
