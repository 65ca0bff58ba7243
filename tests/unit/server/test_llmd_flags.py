"""llm-d-router v0.10.0's serving flags (pkg/epp/server/options.go): parsing and
validation with Go's messages, and what each does in a running ``epp serve`` — Alpha
plugins refused without --allow-experimental-plugins, endpoint scores in the request-path
metadata, the ext_proc stream series, gRPC message limits on a real gRPC stream, TLS (and
mTLS) on the metrics port, and the ext_proc cipher list through gRPC."""

from __future__ import annotations

import asyncio
import datetime
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.json_format import MessageToDict

from epp import keys
from epp.cli import build_parser, serve_options
from epp.errors import ConfigError
from epp.framework.registry import LLMD_ALPHA_TYPES, Registry, check_plugin_stability
from epp.scheduling.plugins.catalog import default_registry
from epp.server import llmd_flags
from epp.server.app import EppServer
from epp.server.llmd_flags import cipher_suite_list, parse_message_size
from epp.server.options import (
    ConfigOptions,
    GrpcOptions,
    ListenOptions,
    ObservabilityOptions,
    RoutingOptions,
    ScrapingOptions,
    ServeOptions,
    StaticSourceOptions,
    TlsOptions,
    WorkerOptions,
    validate,
)
from epp.stack.procs import LOCAL_SERVE_FLAGS, ManagedProcess, free_port, wait_port
from tests.polling import eventually

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
ALPHA_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: session-affinity-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: session-affinity-scorer
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: max-score-picker
"""
ALPHA_MESSAGE = ("plugin 'session-affinity-scorer' (type: 'session-affinity-scorer') has Alpha "
                 "stability level, but command line flag --allow-experimental-plugins is not "
                 "set")
FORMAT = ("quantities must match the regular expression "
          "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")


def _opts(**groups: Any) -> ServeOptions:
    """Plaintext, untraced, open /metrics, two static endpoints, no scraping."""
    groups.setdefault("static", StaticSourceOptions(endpoints=f"{A},{B}"))
    groups.setdefault("tls", TlsOptions(secure_serving=False))
    groups.setdefault("observability", ObservabilityOptions(tracing=False,
                                                            metrics_auth="false"))
    groups.setdefault("scraping", ScrapingOptions(enabled=False))
    groups.setdefault("listen", ListenOptions(
        grpc_port=free_port(), grpc_health_port=free_port(), metrics_port=free_port(),
        bind_address="127.0.0.1"))
    return ServeOptions(**groups)


# --------------------------------------------------------------- message-size quantities

@pytest.mark.parametrize(("raw", "size"), [
    ("10MiB", 10 << 20), ("25MB", 25_000_000), ("4Mi", 4 << 20), (" 1Ki ", 1024),
    ("1.5Ki", 1536), ("1e6", 1_000_000), ("100b", 100), ("0", 0), ("", 0), (None, 0),
])
def test_message_size_quantities(raw: str | None, size: int) -> None:
    assert parse_message_size("grpc-max-recv-msg-size", raw) == size


@pytest.mark.parametrize(("raw", "message"), [
    ("abc", f"invalid grpc-max-recv-msg-size: {FORMAT}"),
    ("1.2.3", f"invalid grpc-max-recv-msg-size: {FORMAT}"),
    ("10KB", "invalid grpc-max-recv-msg-size: unable to parse quantity's suffix"),
    ("0.5", "grpc-max-recv-msg-size overflows maximum supported size: 0.5"),
    ("100m", "grpc-max-recv-msg-size overflows maximum supported size: 100m"),
    ("-1Mi", "grpc-max-recv-msg-size must be non-negative, got -1048576"),
    ("3Gi", "grpc-max-recv-msg-size: 3221225472 bytes is over grpcio's limit"),
])
def test_message_size_errors_are_llmds(raw: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_message_size("grpc-max-recv-msg-size", raw)
    assert str(e.value).startswith(message)


def test_send_size_is_checked_by_validate() -> None:
    with pytest.raises(ConfigError, match="invalid grpc-max-send-msg-size: unable to parse"):
        validate(_opts(grpc=GrpcOptions(max_send_msg_size="5KB")))
    plan = validate(_opts(grpc=GrpcOptions(max_recv_msg_size="10MiB", max_send_msg_size="1M")))
    assert (plan.grpc_max_recv_msg_size, plan.grpc_max_send_msg_size) == (10 << 20, 1_000_000)


# --------------------------------------------------------------- ext_proc TLS policy

def test_tls_min_version() -> None:
    secure = TlsOptions(secure_serving=True, tls_min_version="VersionTLS12")
    assert validate(_opts(tls=secure)).secure_serving
    with pytest.raises(ConfigError) as e:
        validate(_opts(tls=TlsOptions(secure_serving=True, tls_min_version="TLS1.2")))
    assert str(e.value) == ("invalid tls-min-version 'TLS1.2': unknown TLS version 'TLS1.2'; "
                            "supported values: VersionTLS10, VersionTLS11, VersionTLS12, "
                            "VersionTLS13")
    for version in ("VersionTLS13", "VersionTLS10", "VersionTLS11"):
        with pytest.raises(ConfigError, match=f"--tls-min-version {version}: cannot be "
                           "honoured: grpcio's server TLS always accepts TLS 1.2 and 1.3"):
            validate(_opts(tls=TlsOptions(secure_serving=True, tls_min_version=version)))


def test_cipher_suites() -> None:
    assert cipher_suite_list(("TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256", " ",
                              "TLS_AES_128_GCM_SHA256", "TLS_RSA_WITH_AES_128_CBC_SHA")) == \
        "ECDHE-RSA-AES128-GCM-SHA256:AES128-SHA"
    assert cipher_suite_list(()) is None
    with pytest.raises(ConfigError) as e:
        cipher_suite_list(("TLS_NOPE",))
    assert str(e.value) == "invalid tls-cipher-suites: unknown cipher suite 'TLS_NOPE'"
    with pytest.raises(ConfigError, match="TLS_RSA_WITH_RC4_128_SHA: cannot be honoured: "
                       r"grpcio's TLS \(BoringSSL\) does not implement this suite"):
        cipher_suite_list(("TLS_RSA_WITH_RC4_128_SHA",))
    with pytest.raises(ConfigError, match="only TLS 1.3 suites given"):
        cipher_suite_list(("TLS_AES_256_GCM_SHA384",))


def test_tls_flags_without_secure_serving_are_noted() -> None:
    plan = validate(_opts(tls=TlsOptions(
        secure_serving=False, tls_cipher_suites=("TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",))))
    assert plan.tls_cipher_list is None
    assert any("--tls-min-version/--tls-cipher-suites: accepted, no effect" in n
               for n in plan.notes)
    # What grpcio could not honour does not matter without TLS; bad names still fail.
    plan = validate(_opts(tls=TlsOptions(secure_serving=False, tls_min_version="VersionTLS13",
                                         tls_cipher_suites=("TLS_RSA_WITH_RC4_128_SHA",))))
    assert plan.tls_cipher_list is None
    with pytest.raises(ConfigError, match="unknown cipher suite 'X'"):
        validate(_opts(tls=TlsOptions(secure_serving=False, tls_cipher_suites=("X",))))


def test_cipher_list_must_reach_grpc_before_it_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process gRPC is loaded: the flag cannot be applied any more."""
    monkeypatch.delenv(llmd_flags.CIPHER_ENV, raising=False)
    names = ("TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",)
    with pytest.raises(ConfigError, match="gRPC is already loaded in this process"):
        llmd_flags.apply_cipher_suites_env(names)
    with pytest.raises(ConfigError, match="this process loaded gRPC without it"):
        llmd_flags.check_cipher_suites_applied(names)


# --------------------------------------------------------------- metrics TLS

def _write_pki(d: Path) -> dict[str, Path]:
    """A CA; a server pair in d/server (tls.crt, tls.key) signed by it; a client pair."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(name: str, key: Any, issuer: x509.Name, signer: Any, ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(x509.Name([
            x509.NameAttribute(NameOID.COMMON_NAME, name)])).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]),
                                critical=False)
        return b.sign(signer, hashes.SHA256())

    def pem_key(key: Any) -> bytes:
        return bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-ca")])
    ca = cert("test-ca", ca_key, ca_name, ca_key, True)
    out = {"ca": d / "ca.crt", "server": d / "server", "client_crt": d / "client.crt",
           "client_key": d / "client.key"}
    out["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out["server"].mkdir()
    skey = ec.generate_private_key(ec.SECP256R1())
    (out["server"] / "tls.crt").write_bytes(
        cert("localhost", skey, ca_name, ca_key, False).public_bytes(serialization.Encoding.PEM))
    (out["server"] / "tls.key").write_bytes(pem_key(skey))
    ckey = ec.generate_private_key(ec.SECP256R1())
    out["client_crt"].write_bytes(
        cert("prometheus", ckey, ca_name, ca_key, False).public_bytes(serialization.Encoding.PEM))
    out["client_key"].write_bytes(pem_key(ckey))
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _write_pki(tmp_path_factory.mktemp("pki"))


def _obs(auth: str | None = "false", cert_dir: Path | str | None = None,
         ca: Path | str | None = None) -> ObservabilityOptions:
    return ObservabilityOptions(tracing=False, metrics_auth=auth,
                                metrics_cert_dir=None if cert_dir is None else str(cert_dir),
                                metrics_client_ca_file=None if ca is None else str(ca))


def test_metrics_tls_validation_is_llmds(pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        validate(_opts(observability=_obs(ca=pki["ca"])))
    assert str(e.value) == '"metrics-client-ca-file" requires "metrics-cert-dir"'
    with pytest.raises(ConfigError) as e:
        validate(_opts(observability=_obs(cert_dir=pki["server"])))
    assert str(e.value) == ('"metrics-cert-dir" enables metrics TLS without authentication; '
                            'set "metrics-client-ca-file" or "metrics-endpoint-auth"')
    missing = tmp_path / "nothing"
    with pytest.raises(ConfigError, match=f"metrics TLS cert file unreadable: {missing}/tls.crt"):
        validate(_opts(observability=_obs(cert_dir=missing, ca=pki["ca"])))
    with pytest.raises(ConfigError, match=f"metrics TLS cert file unreadable: {missing}"):
        validate(_opts(observability=_obs(cert_dir=pki["server"], ca=missing)))
    # With auth (the default, or a token file) or a client CA, TLS alone is fine.
    assert validate(_opts(observability=_obs(auth=None, cert_dir=pki["server"]))).metrics_tls
    plan = validate(_opts(observability=_obs(cert_dir=pki["server"], ca=pki["ca"])))
    assert plan.metrics_tls is not None and plan.metrics_tls.client_ca == pki["ca"]
    bad_ca = tmp_path / "bad.pem"
    bad_ca.write_text("not a certificate\n")
    bad = validate(_opts(observability=_obs(cert_dir=pki["server"], ca=bad_ca))).metrics_tls
    assert bad is not None
    with pytest.raises(ConfigError, match="no valid CA certs in metrics client CA file"):
        bad.context()


async def test_metrics_port_serves_mtls(pki: dict[str, Path]) -> None:
    opts = _opts(observability=_obs(cert_dir=pki["server"], ca=pki["ca"]))
    server = EppServer(opts)
    await server.start()
    url = f"https://localhost:{opts.listen.metrics_port}/metrics"

    async def get(with_client_cert: bool) -> int:
        ctx = ssl.create_default_context(cafile=str(pki["ca"]))
        if with_client_cert:
            ctx.load_cert_chain(pki["client_crt"], pki["client_key"])
        async with aiohttp.ClientSession() as s, s.get(url, ssl=ctx) as r:
            return r.status

    try:
        assert await get(True) == 200
        with pytest.raises(aiohttp.ClientError):  # no client certificate: handshake refused
            await get(False)
        with pytest.raises(aiohttp.ClientError):  # plaintext is not served
            async with aiohttp.ClientSession() as s, s.get(url.replace("https", "http")):
                pass
    finally:
        await server.stop(0)


def _served_cert(port: int) -> bytes:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s, \
            ctx.wrap_socket(s) as t:
        return t.getpeercert(binary_form=True) or b""


async def test_metrics_cert_is_reloaded(tmp_path: Path) -> None:
    """A renewed tls.crt/tls.key is served to new connections (controller-runtime's
    CertWatcher); a half-written pair keeps the previous one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = _write_pki(tmp_path / "a"), _write_pki(tmp_path / "b")
    cert_dir = tmp_path / "certs"
    cert_dir.mkdir()
    for name in ("tls.crt", "tls.key"):
        (cert_dir / name).write_bytes((first["server"] / name).read_bytes())
    opts = _opts(observability=_obs(auth=None, cert_dir=cert_dir))
    server = EppServer(opts)
    await server.start()
    port = opts.listen.metrics_port
    loop = asyncio.get_running_loop()

    def der(p: Path) -> bytes:
        return x509.load_pem_x509_certificate(p.read_bytes()).public_bytes(
            serialization.Encoding.DER)

    try:
        assert await loop.run_in_executor(None, _served_cert, port) == \
            der(first["server"] / "tls.crt")
        (cert_dir / "tls.crt").write_bytes((second["server"] / "tls.crt").read_bytes())
        # Only the certificate so far: it does not match the key, the old pair stays.
        assert await loop.run_in_executor(None, _served_cert, port) == \
            der(first["server"] / "tls.crt")
        (cert_dir / "tls.key").write_bytes((second["server"] / "tls.key").read_bytes())
        want = der(second["server"] / "tls.crt")

        async def renewed() -> bool:
            return await loop.run_in_executor(None, _served_cert, port) == want

        await eventually(renewed, timeout=15, interval=0.2, what="the renewed pair served")
    finally:
        await server.stop(0)


# --------------------------------------------------------------- --allow-experimental-plugins

def test_every_llmd_alpha_type_is_registered_alpha() -> None:
    reg = default_registry()
    assert {t for t in reg.types if reg.stability(t) == "alpha"} == LLMD_ALPHA_TYPES
    assert reg.stability("queue-scorer") == "stable"
    assert reg.stability("mypkg.module:MyScorer") == "stable"  # import path: not gated
    own = Registry()
    own.register("x", lambda *a: None, stability="alpha")  # type: ignore[arg-type]  # a stand-in builder
    assert own.stability("x") == "alpha"


def test_check_plugin_stability_names_the_first_alpha_plugin() -> None:
    class P:
        def __init__(self, type_name: str) -> None:
            self.type_name = type_name

    plugins: dict[str, Any] = {"z": P("utilization-filter"), "b": P("topology-extractor"),
                               "a": P("queue-scorer")}
    with pytest.raises(ConfigError) as e:
        check_plugin_stability(plugins, default_registry(), False)
    assert str(e.value) == ("plugin 'b' (type: 'topology-extractor') has Alpha stability "
                            "level, but command line flag --allow-experimental-plugins is "
                            "not set")
    check_plugin_stability(plugins, default_registry(), True)


async def test_serve_refuses_alpha_plugins_without_the_flag() -> None:
    server = EppServer(_opts(config=ConfigOptions(text=ALPHA_CONFIG)))
    with pytest.raises(ConfigError) as e:
        await server.start()
    assert str(e.value) == ALPHA_MESSAGE
    server = EppServer(_opts(config=ConfigOptions(text=ALPHA_CONFIG,
                                                  allow_experimental_plugins=True)))
    await server.start()
    await server.stop(0)


async def test_only_llmd_documents_are_gated() -> None:
    """The gate is llm-d's rule for llm-d documents: the same plugins under GIE's
    apiVersion (this project's config/session.yaml, config/pd-grove.yaml) start without
    the flag, and the local stack does not pass it."""
    gie_doc = ALPHA_CONFIG.replace("apiVersion: llm-d.ai/v1alpha1",
                                   "apiVersion: inference.networking.x-k8s.io/v1alpha1")
    server = EppServer(_opts(config=ConfigOptions(text=gie_doc)))
    await server.start()
    await server.stop(0)
    args = build_parser().parse_args(["serve", "--endpoints", A, *LOCAL_SERVE_FLAGS])
    assert not serve_options(args).config.allow_experimental_plugins


# --------------------------------------------------------------- ext_proc over real gRPC

def _headers_msg(body_len: int) -> pb.ProcessingRequest:
    hs = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json",
          "x-request-id": "r1", "content-length": str(body_len)}
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])))
    msg.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    msg.protocol_config.response_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    return msg


async def _route(port: int, body: bytes) -> list[pb.ProcessingResponse]:
    """One request through the ext_proc port as Envoy sends it (full duplex); the
    responses up to the request-headers answer."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(_headers_msg(len(body)))
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(
            body=body, end_of_stream=True)))
        out: list[pb.ProcessingResponse] = []
        async for resp in call:
            out.append(resp)
            if resp.HasField("request_headers"):
                break
        call.cancel()
        return out


BODY = orjson.dumps({"model": "m", "prompt": "hello"})


async def _metrics(port: int) -> str:
    async with aiohttp.ClientSession() as s, \
            s.get(f"http://127.0.0.1:{port}/metrics") as r:
        return await r.text()


async def test_emit_endpoint_scores_in_request_path_metadata() -> None:
    opts = _opts(config=ConfigOptions(text=ALPHA_CONFIG, allow_experimental_plugins=True),
                 routing=RoutingOptions(emit_endpoint_scores=True))
    server = EppServer(opts)
    await server.start()
    try:
        out = await _route(opts.listen.grpc_port, BODY)
        md = MessageToDict(out[-1].dynamic_metadata)
        lb = md[keys.METADATA_NAMESPACE_LB]
        assert lb[keys.METADATA_DESTINATION_KEY] in (A, B)
        # Every candidate, picked or not: session (0, no session) + 2 x queue (1: idle).
        assert lb["x-gateway-destination-endpoint-scores"] == {A: 2.0, B: 2.0}
    finally:
        await server.stop(0)
    opts = _opts()  # off (the default): the destination only
    server = EppServer(opts)
    await server.start()
    try:
        out = await _route(opts.listen.grpc_port, BODY)
        md = MessageToDict(out[-1].dynamic_metadata)
        assert set(md[keys.METADATA_NAMESPACE_LB]) == {keys.METADATA_DESTINATION_KEY}
    finally:
        await server.stop(0)


async def test_stream_metrics_and_max_recv_size() -> None:
    """--grpc-max-recv-msg-size 1KiB: a larger body chunk fails the stream on the real
    gRPC server (RESOURCE_EXHAUSTED), and --enable-grpc-stream-metrics counts both streams
    by code, with Go's code names."""
    opts = _opts(grpc=GrpcOptions(max_recv_msg_size="1KiB", enable_stream_metrics=True))
    server = EppServer(opts)
    await server.start()
    port, metrics_port = opts.listen.grpc_port, opts.listen.metrics_port
    try:
        assert (await _route(port, BODY))[-1].HasField("request_headers")
        big = orjson.dumps({"model": "m", "prompt": "x" * 4096})
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _route(port, big)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        async def counted() -> str | None:
            text = await _metrics(metrics_port)
            return text if "llm_d_epp_extproc_stream_duration_seconds_count 2.0" in text \
                else None

        text = await eventually(counted, what="both streams counted")
        assert text is not None
        assert "llm_d_epp_extproc_streams_inflight 0.0" in text
        by_code = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("llm_d_epp_extproc_streams_total{")}
        # The first stream ends when we cancel it: Canceled, or OK when its handler was
        # done first. grpcio ends the oversized one itself and shows the handler only an
        # end of stream, so it counts as OK here (llm-d: ResourceExhausted;
        # docs/configuration.md says so).
        assert sum(by_code.values()) == 2 and set(by_code) <= {"OK", "Canceled"}
        assert by_code.get("OK", 0) >= 1
    finally:
        await server.stop(0)
    opts = _opts()  # off: the series are not exported
    server = EppServer(opts)
    await server.start()
    try:
        assert "llm_d_epp_extproc_streams" not in await _metrics(opts.listen.metrics_port)
    finally:
        await server.stop(0)


def test_workers_refuse_what_the_fronts_do_not_apply() -> None:
    with pytest.raises(ConfigError, match="--emit-endpoint-scores is not supported with "
                       "--workers 2"):
        validate(_opts(workers=WorkerOptions(count=2),
                       routing=RoutingOptions(emit_endpoint_scores=True)))
    with pytest.raises(ConfigError, match="--grpc-max-recv-msg-size is not supported"):
        validate(_opts(workers=WorkerOptions(count=2),
                       grpc=GrpcOptions(max_recv_msg_size="1Mi")))


# --------------------------------------------------------------- the command line

def test_flags_parse_into_options() -> None:
    args = build_parser().parse_args([
        "serve", "--endpoints", A, "--allow-experimental-plugins", "--emit-endpoint-scores",
        "--enable-grpc-stream-metrics=true", "--grpc-max-recv-msg-size", "10MiB",
        "--grpc-max-send-msg-size=25MB", "--metrics-cert-dir", "/c",
        "--metrics-client-ca-file", "/ca.pem", "--tls-min-version", "VersionTLS12",
        "--tls-cipher-suites", "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,TLS_AES_128_GCM_SHA256",
        "--tls-cipher-suites", "TLS_RSA_WITH_AES_128_CBC_SHA"])
    o = serve_options(args)
    assert o.config.allow_experimental_plugins and o.routing.emit_endpoint_scores
    assert o.grpc == GrpcOptions("10MiB", "25MB", True)
    assert (o.observability.metrics_cert_dir, o.observability.metrics_client_ca_file) == \
        ("/c", "/ca.pem")
    assert o.tls.tls_min_version == "VersionTLS12"
    assert o.tls.tls_cipher_suites == ("TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
                                       "TLS_AES_128_GCM_SHA256", "TLS_RSA_WITH_AES_128_CBC_SHA")
    d = serve_options(build_parser().parse_args(["serve", "--endpoints", A]))
    assert not d.config.allow_experimental_plugins and not d.routing.emit_endpoint_scores
    assert d.grpc == GrpcOptions() and d.tls.tls_cipher_suites == ()


def test_help_lists_the_flags() -> None:
    text = subprocess.run([sys.executable, "-m", "epp.cli", "serve", "--help"],
                          capture_output=True, text=True, check=True).stdout
    for flag in ("--allow-experimental-plugins", "--emit-endpoint-scores",
                 "--enable-grpc-stream-metrics", "--grpc-max-recv-msg-size",
                 "--grpc-max-send-msg-size", "--metrics-cert-dir", "--metrics-client-ca-file",
                 "--tls-min-version", "--tls-cipher-suites"):
        assert flag in text


def _handshake(port: int, cipher: str) -> str:
    """A TLS 1.2 handshake offering only ``cipher``: the suite agreed, or the error."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(cipher)
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s, \
                ctx.wrap_socket(s) as t:
            agreed = t.cipher()
            return agreed[0] if agreed else "none"
    except (ssl.SSLError, OSError) as e:
        return f"refused: {e}"


async def test_cipher_suites_reach_grpc(tmp_path: Path) -> None:
    """`epp serve --secure-serving --tls-cipher-suites X`: the ext_proc port's TLS 1.2
    handshake agrees on X and refuses another suite (the self-signed key is ECDSA)."""
    port = free_port()
    proc = ManagedProcess(
        [sys.executable, "-m", "epp.cli", "serve", "--endpoints", A, "--secure-serving",
         "--tracing=false", "--metrics-endpoint-auth=false", "--no-metrics-scraping",
         "--bind-address", "127.0.0.1", "--grpc-port", str(port), "--grpc-health-port",
         str(free_port()), "--metrics-port", str(free_port()), "--drain-timeout", "0",
         "--tls-min-version=VersionTLS12",
         "--tls-cipher-suites", "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384"],
        log_path=tmp_path / "epp.log")
    await proc.start()
    try:
        await wait_port("127.0.0.1", port, timeout=30)
        await _check_ciphers(port)
    finally:
        await proc.stop()


async def _check_ciphers(port: int) -> None:
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, _handshake, port,
                                      "ECDHE-ECDSA-AES256-GCM-SHA384") == \
        "ECDHE-ECDSA-AES256-GCM-SHA384"
    refused = await loop.run_in_executor(None, _handshake, port,
                                         "ECDHE-ECDSA-AES128-GCM-SHA256")
    assert refused.startswith("refused")
