"""TLS for the ext_proc port (``--secure-serving``), as GIE's EPP serves it.

Gateways built for GIE (kgateway, Istio with its DestinationRule, GKE, NGINX Gateway
Fabric) connect to the EPP over TLS without verifying the certificate, because GIE's EPP
serves a self-signed one unless ``--cert-path`` names a directory with ``tls.crt`` and
``tls.key`` (e.g. a mounted cert-manager Secret). The health port stays plaintext (the
kubelet's gRPC probes speak plaintext), as in GIE.
"""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

from epp.errors import ConfigError


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
