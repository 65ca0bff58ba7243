"""TLS for the ext_proc port (``--secure-serving``), as GIE's EPP serves it.

Gateways built for GIE (kgateway, Istio with its DestinationRule, GKE, NGINX Gateway
Fabric) connect to the EPP over TLS without verifying the certificate, because GIE's EPP
serves a self-signed one unless ``--cert-path`` names a directory with ``tls.crt`` and
``tls.key`` (e.g. a mounted cert-manager Secret). The health port stays plaintext (the
kubelet's gRPC probes speak plaintext), as in GIE.

``--enable-cert-reload`` (with ``--cert-path``, as GIE's): a renewed key pair in that
directory is served to every connection made after the change; GIE watches the directory,
here each new connection checks the two files (a ``stat`` each) before its handshake. A
pair that does not load or does not match (a Secret half updated) keeps the previous one
in service, logged, until the directory holds a good pair again.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

import grpc

from epp.errors import ConfigError

log = logging.getLogger(__name__)


def load_key_pair(cert_path: str) -> tuple[bytes, bytes]:
    """(private key PEM, certificate chain PEM) from ``cert_path``/tls.key and tls.crt."""
    d = Path(cert_path)
    try:
        return (d / "tls.key").read_bytes(), (d / "tls.crt").read_bytes()
    except OSError as e:
        raise ConfigError(f"--cert-path {cert_path}: cannot read tls.key/tls.crt: "
                          f"{e.strerror or e}") from e


def self_signed_key_pair(valid_days: int = 3650) -> tuple[bytes, bytes]:
    """A fresh ECDSA P-256 key and a self-signed certificate for this host."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "epp"),
                      x509.NameAttribute(NameOID.COMMON_NAME, socket.gethostname()[:64])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=valid_days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def server_credentials(cert_path: str | None, reload: bool = False) -> grpc.ServerCredentials:
    """Credentials for the ext_proc port: the pair in ``cert_path`` (re-read when it changes
    with ``reload``), else a fresh self-signed one. :class:`ConfigError` when the pair in
    ``cert_path`` cannot be read or does not match."""
    if cert_path is None:
        return grpc.ssl_server_credentials([self_signed_key_pair()])
    key, chain = load_key_pair(cert_path)
    check_key_pair(key, chain, cert_path)
    if not reload:
        return grpc.ssl_server_credentials([(key, chain)])
    reloader = CertReloader(cert_path)
    # gRPC documents None as "no change"; the type stubs leave it out of the return type.
    fetch = cast("Callable[[], grpc.ServerCertificateConfiguration]", reloader.fetch)
    return grpc.dynamic_ssl_server_credentials(
        grpc.ssl_server_certificate_configuration([(key, chain)]), fetch)


def check_key_pair(key_pem: bytes, chain_pem: bytes, cert_path: str) -> None:
    """:class:`ConfigError` unless ``key_pem`` is the key of ``chain_pem``'s first
    certificate (Go's tls.LoadX509KeyPair checks the same)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(chain_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--cert-path {cert_path}: tls.crt/tls.key do not load: {e}") from e
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise ConfigError(f"--cert-path {cert_path}: tls.key is not the key of tls.crt")


def _signature(cert_path: str) -> tuple[tuple[int, int, int], ...]:
    """What changes when either file is replaced (a Secret volume swaps a symlink)."""
    out = []
    for name in ("tls.crt", "tls.key"):
        st = os.stat(os.path.join(cert_path, name))
        out.append((st.st_mtime_ns, st.st_ino, st.st_size))
    return tuple(out)


class CertReloader:
    """The certificate fetcher of ``grpc.dynamic_ssl_server_credentials``: called by gRPC
    before each new connection's handshake (on its own threads), it returns the new pair
    once the files have changed, else None (no change)."""

    def __init__(self, cert_path: str) -> None:
        self.cert_path = cert_path
        self._lock = threading.Lock()
        self._loaded = _signature(cert_path)
        self._failed: tuple[tuple[int, int, int], ...] | None = None
        self.reloads = 0

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            try:
                sig = _signature(self.cert_path)
            except OSError as e:
                if self._failed is None:
                    log.error("TLS certificate reload: cannot stat %s: %s", self.cert_path, e)
                    self._failed = ()
                return None
            if sig == self._loaded:
                return None
            try:
                key, chain = load_key_pair(self.cert_path)
                check_key_pair(key, chain, self.cert_path)
            except ConfigError as e:
                if sig != self._failed:  # once per state of the files
                    log.error("TLS certificate reload failed, still serving the previous "
                              "certificate: %s", e)
                    self._failed = sig
                return None
            self._loaded, self._failed = sig, None
            self.reloads += 1
            log.info("TLS certificate reloaded from %s", self.cert_path)
            return grpc.ssl_server_certificate_configuration([(key, chain)])
