"""llm-d-router v0.10.0's serving flags (pkg/epp/server/options.go ``Complete`` and
``Validate``): message-size quantities, the TLS policy of the ext_proc port and TLS on
the metrics port — parsed and checked here, with Go's error texts.

This module imports no gRPC: ``epp serve`` applies ``--tls-cipher-suites`` through gRPC's
``GRPC_SSL_CIPHER_SUITES``, which gRPC reads once, when it is imported, so the CLI calls
:func:`apply_cipher_suites_env` before anything imports ``grpc``.

What grpcio can honour (``--secure-serving``, epp/server/tls.py): its server TLS is fixed
to TLS 1.2 through 1.3 (``grpc.ssl_server_credentials`` has no version knob), and its TLS
1.2 cipher list is ``GRPC_SSL_CIPHER_SUITES`` (BoringSSL names). So ``--tls-min-version
VersionTLS12`` holds as given, any other version fails startup naming that limit; Go's
TLS 1.2 cipher names map to BoringSSL's, and a name BoringSSL lacks fails startup. TLS 1.3
suites are not configurable, in Go as here: given, they change nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import sys
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Final

from epp.errors import ConfigError

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ message sizes

#: k8s.io/apimachinery resource.ParseQuantity's errors (quantity.go).
_SPLIT_RE: Final = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
ERR_FORMAT_WRONG: Final = f"quantities must match the regular expression '{_SPLIT_RE}'"
ERR_SUFFIX: Final = "unable to parse quantity's suffix"
ERR_NUMERIC: Final = "unable to parse numeric part of quantity"

_BINARY: Final = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL: Final = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12,
                   "P": 15, "E": 18}
_SUFFIX_CHARS: Final = frozenset("eEinumkKMGTP")
_INT64_MAX: Final = (1 << 63) - 1
#: grpcio's message-size options are C ints.
GRPC_MAX_MESSAGE: Final = (1 << 31) - 1


def _split_quantity(s: str) -> tuple[bool, str, str, str]:
    """(positive, numerator, denominator, suffix) as apimachinery's parseQuantityString
    splits a quantity; ValueError(ERR_FORMAT_WRONG) when it does not match."""
    positive, pos, end = True, 0, len(s)
    if pos < end and s[0] in "+-":
        positive = s[0] == "+"
        pos += 1
    while pos < end and s[pos] == "0":
        pos += 1
    if pos >= end:
        return positive, "0", "", ""
    start = pos
    while pos < end and s[pos].isdigit():
        pos += 1
    num = s[start:pos] or "0"
    denom = ""
    if pos < end and s[pos] == ".":
        pos += 1
        start = pos
        while pos < end and s[pos].isdigit():
            pos += 1
        denom = s[start:pos]
    suffix_start = pos
    while pos < end and s[pos] in _SUFFIX_CHARS:
        pos += 1
    if pos < end and s[pos] in "+-":
        pos += 1
    while pos < end and s[pos].isdigit():
        pos += 1
    if pos < end:
        raise ValueError(ERR_FORMAT_WRONG)
    return positive, num, denom, s[suffix_start:]


def parse_quantity(s: str) -> Decimal:
    """A Kubernetes quantity (``10Mi``, ``25M``, ``1e6``) as an exact number; ValueError
    with apimachinery's message when it is not one."""
    if not s:
        raise ValueError(ERR_FORMAT_WRONG)
    positive, num, denom, suffix = _split_quantity(s)
    if suffix in _BINARY:
        scale = Decimal(2) ** _BINARY[suffix]
    elif suffix in _DECIMAL:
        scale = Decimal(10) ** _DECIMAL[suffix]
    elif len(suffix) > 1 and suffix[0] in "eE":
        try:
            scale = Decimal(10) ** int(suffix[1:])
        except ValueError:
            raise ValueError(ERR_SUFFIX) from None
    else:
        raise ValueError(ERR_SUFFIX)
    try:
        value = Decimal(f"{num}.{denom or '0'}") * scale
    except InvalidOperation:
        raise ValueError(ERR_NUMERIC) from None
    return value if positive else -value


def _sanitize_size(s: str) -> str:
    """llm-d's sanitizeSizeString: trimmed, one trailing ``B``/``b`` dropped (``10MiB``)."""
    s = s.strip()
    if len(s) > 1 and s[-1] in "Bb":
        return s[:-1]
    return s


def parse_message_size(flag: str, raw: str | None) -> int:
    """``--grpc-max-recv-msg-size``/``--grpc-max-send-msg-size`` (``flag`` without the
    dashes) in bytes; 0 when not given. :class:`ConfigError` with llm-d's message."""
    if raw is None or raw == "":
        return 0
    s = _sanitize_size(raw)
    try:
        q = parse_quantity(s)
    except ValueError as e:
        raise ConfigError(f"invalid {flag}: {e}") from None
    if q != q.to_integral_value() or not -_INT64_MAX - 1 <= q <= _INT64_MAX:
        raise ConfigError(f"{flag} overflows maximum supported size: {s}")
    value = int(q)
    if value < 0:
        raise ConfigError(f"{flag} must be non-negative, got {value}")
    if value > GRPC_MAX_MESSAGE:
        raise ConfigError(f"{flag}: {value} bytes is over grpcio's limit of "
                          f"{GRPC_MAX_MESSAGE} bytes (its message-size options are C ints); "
                          "give at most 2Gi less one byte")
    return value


# ------------------------------------------------------------------ ext_proc TLS policy

#: Go's crypto/tls version names (llm-d's parseTLSVersion).
TLS_VERSIONS: Final = ("VersionTLS10", "VersionTLS11", "VersionTLS12", "VersionTLS13")
#: grpcio's fixed server floor.
GRPC_TLS_MIN: Final = "VersionTLS12"

#: Go's TLS 1.3 suites (tls.CipherSuites()): valid names, not configurable in Go either.
TLS13_SUITES: Final = frozenset({"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384",
                                 "TLS_CHACHA20_POLY1305_SHA256"})
#: Go's TLS 1.0-1.2 suite names (tls.CipherSuites() and tls.InsecureCipherSuites()) →
#: the BoringSSL name gRPC's cipher list takes; None: grpcio's BoringSSL lacks it (a list
#: of only that name fails gRPC's port binding; checked with grpcio 1.85).
TLS12_SUITES: Final[dict[str, str | None]] = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    # tls.InsecureCipherSuites()
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_RSA_WITH_3DES_EDE_CBC_SHA": "DES-CBC3-SHA",
    "TLS_RSA_WITH_RC4_128_SHA": None,
    "TLS_ECDHE_ECDSA_WITH_RC4_128_SHA": None,
    "TLS_ECDHE_RSA_WITH_RC4_128_SHA": None,
    "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA": None,
    "TLS_RSA_WITH_AES_128_CBC_SHA256": None,
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
}
CIPHER_ENV: Final = "GRPC_SSL_CIPHER_SUITES"


def check_tls_min_version(value: str | None, honour: bool = True) -> None:
    """``--tls-min-version``: a Go name (llm-d's message when not), and, with ``honour``
    (TLS is served), one grpcio can serve: its server TLS is TLS 1.2 to 1.3, not settable
    from Python."""
    if value is None or value == "":
        return
    if value not in TLS_VERSIONS:
        raise ConfigError(f"invalid tls-min-version {value!r}: unknown TLS version "
                          f"{value!r}; supported values: {', '.join(TLS_VERSIONS)}")
    if honour and value != GRPC_TLS_MIN:
        raise ConfigError(
            f"--tls-min-version {value}: cannot be honoured: grpcio's server TLS always "
            "accepts TLS 1.2 and 1.3 (grpc.ssl_server_credentials has no minimum-version "
            f"setting), so its minimum is {GRPC_TLS_MIN}; give --tls-min-version="
            f"{GRPC_TLS_MIN} or leave the flag out")


def cipher_suite_list(names: tuple[str, ...] | list[str], honour: bool = True) -> str | None:
    """``--tls-cipher-suites`` as gRPC's cipher list (``GRPC_SSL_CIPHER_SUITES``), or None
    when it names none (blank entries are skipped, as in llm-d). :class:`ConfigError`
    with llm-d's message for an unknown name, and, with ``honour`` (TLS is served),
    naming the limit for what grpcio cannot serve."""
    out: list[str] = []
    tls13 = False
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if name in TLS13_SUITES:
            tls13 = True
            continue
        if name not in TLS12_SUITES:
            raise ConfigError(f"invalid tls-cipher-suites: unknown cipher suite {name!r}")
        boring = TLS12_SUITES[name]
        if boring is None and not honour:
            continue
        if boring is None:
            raise ConfigError(
                f"--tls-cipher-suites {name}: cannot be honoured: grpcio's TLS (BoringSSL) "
                "does not implement this suite; supported: "
                + ", ".join(k for k, v in TLS12_SUITES.items() if v is not None))
        if boring not in out:
            out.append(boring)
    if not out and tls13 and honour:
        raise ConfigError(
            "--tls-cipher-suites: only TLS 1.3 suites given: in Go that leaves TLS 1.2 "
            "without a suite, but grpcio cannot turn TLS 1.2 off (its server TLS is fixed "
            "to TLS 1.2-1.3), so this cannot be honoured; name TLS 1.2 suites too")
    return ":".join(out) if out else None


def split_cipher_flag(values: list[str] | tuple[str, ...] | str | None) -> tuple[str, ...]:
    """The comma-separated (and repeatable, as pflag's StringSlice) flag as names."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    return tuple(n for v in values for n in v.split(","))


#: The cipher list this process set before gRPC loaded (:func:`apply_cipher_suites_env`).
_applied_cipher_list: str | None = None


def apply_cipher_suites_env(names: tuple[str, ...]) -> str | None:
    """Set ``GRPC_SSL_CIPHER_SUITES`` for ``--tls-cipher-suites``; must run before
    ``grpc`` is imported (gRPC reads it once then). Returns the list set, None when the
    flag names no TLS 1.2 suite. :class:`ConfigError` for a bad name."""
    global _applied_cipher_list
    value = cipher_suite_list(names, honour=False)  # the limits: options.validate
    if value is None:
        return None
    if "grpc" in sys.modules and os.environ.get(CIPHER_ENV) != value:
        raise ConfigError("--tls-cipher-suites: gRPC is already loaded in this process, "
                          f"so it no longer reads {CIPHER_ENV}; set it before importing "
                          "grpc (epp serve does)")
    os.environ[CIPHER_ENV] = value
    _applied_cipher_list = value
    return value


def check_cipher_suites_applied(names: tuple[str, ...]) -> str | None:
    """At server start: the cipher list ``names`` need, checked to be the one gRPC
    loaded with. :class:`ConfigError` when this process set no such list before
    importing grpc (an EPP started in-process by a program that imported grpc first)."""
    value = cipher_suite_list(names)
    if value is None:
        return None
    if _applied_cipher_list != value and os.environ.get(CIPHER_ENV) != value:
        raise ConfigError(
            f"--tls-cipher-suites: gRPC takes its TLS 1.2 cipher list from {CIPHER_ENV}, "
            "read once when grpc is imported; this process loaded gRPC without it. Start "
            f"the EPP with `epp serve` (which sets it first) or set {CIPHER_ENV}={value} "
            "in its environment")
    return value


# ------------------------------------------------------------------ metrics TLS

ERR_METRICS_CA_REQUIRES_CERT_DIR: Final = (
    '"metrics-client-ca-file" requires "metrics-cert-dir"')
ERR_METRICS_TLS_WITHOUT_AUTH: Final = (
    '"metrics-cert-dir" enables metrics TLS without authentication; set '
    '"metrics-client-ca-file" or "metrics-endpoint-auth"')
ERR_METRICS_CERT_UNREADABLE: Final = "metrics TLS cert file unreadable"
ERR_READ_METRICS_CA: Final = "reading metrics client CA"
ERR_NO_VALID_METRICS_CA: Final = "no valid CA certs in metrics client CA file"


@dataclass(frozen=True)
class MetricsTls:
    """TLS on the metrics port: ``cert_dir``'s tls.crt/tls.key, TLS 1.2 or later; with
    ``client_ca`` a verified client certificate is required (mTLS)."""

    cert_dir: Path
    client_ca: Path | None

    def signature(self) -> tuple[tuple[int, int, int], ...]:
        """What changes when tls.crt or tls.key is replaced (OSError when one is gone)."""
        out = []
        for name in ("tls.crt", "tls.key"):
            st = os.stat(self.cert_dir / name)
            out.append((st.st_mtime_ns, st.st_ino, st.st_size))
        return tuple(out)

    def load_pair(self, ctx: ssl.SSLContext) -> None:
        """(Re)load tls.crt/tls.key into ``ctx``: new connections get them."""
        try:
            ctx.load_cert_chain(self.cert_dir / "tls.crt", self.cert_dir / "tls.key")
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"--metrics-cert-dir {self.cert_dir}: tls.crt/tls.key do not "
                              f"load: {e}") from e

    def context(self) -> ssl.SSLContext:
        """A server context (:class:`ConfigError` when the files do not load)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self.load_pair(ctx)
        if self.client_ca is not None:
            try:
                pem = self.client_ca.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"{ERR_READ_METRICS_CA} {self.client_ca}: {e}") from e
            if "-----BEGIN CERTIFICATE-----" not in pem:
                raise ConfigError(f"{ERR_NO_VALID_METRICS_CA}: {self.client_ca}")
            try:
                ctx.load_verify_locations(cadata=pem)
            except ssl.SSLError as e:
                raise ConfigError(f"{ERR_NO_VALID_METRICS_CA}: {self.client_ca} ({e})") from e
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


async def watch_metrics_cert(tls: MetricsTls, ctx: ssl.SSLContext,
                             interval_s: float = 1.0) -> None:
    """Serve a renewed tls.crt/tls.key to new metrics connections, as controller-runtime's
    CertWatcher does for llm-d: checked every ``interval_s``; a pair that does not load
    (a Secret half updated) keeps the previous one in service, logged once. Runs until
    cancelled."""
    try:
        loaded = tls.signature()
    except OSError:
        loaded = ()
    failed: tuple[tuple[int, int, int], ...] | None = None
    while True:
        await asyncio.sleep(interval_s)  # a poll, as the endpoints file's
        try:
            sig = tls.signature()
        except OSError:
            continue
        if sig == loaded:
            continue
        try:
            tls.load_pair(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))  # a pair that matches?
            tls.load_pair(ctx)
        except ConfigError as e:
            if sig != failed:
                log.error("metrics TLS certificate reload failed, still serving the "
                          "previous one: %s", e)
                failed = sig
            continue
        loaded, failed = sig, None
        log.info("metrics TLS certificate reloaded from %s", tls.cert_dir)


def metrics_tls(cert_dir: str | None, client_ca: str | None,
                auth_off: bool) -> MetricsTls | None:
    """``--metrics-cert-dir``/``--metrics-client-ca-file`` checked as llm-d's Complete
    and Validate check them (in that order); None when neither is given. ``auth_off``:
    ``--metrics-endpoint-auth=false`` was given."""
    if client_ca:
        _stat(Path(client_ca))
    if cert_dir:
        for name in ("tls.crt", "tls.key"):
            _stat(Path(cert_dir) / name)
    if client_ca and not cert_dir:
        raise ConfigError(ERR_METRICS_CA_REQUIRES_CERT_DIR)
    if cert_dir and not client_ca and auth_off:
        raise ConfigError(ERR_METRICS_TLS_WITHOUT_AUTH)
    if not cert_dir:
        return None
    return MetricsTls(Path(cert_dir), Path(client_ca) if client_ca else None)


def _stat(p: Path) -> None:
    try:
        os.stat(p)
    except OSError as e:
        raise ConfigError(f"{ERR_METRICS_CERT_UNREADABLE}: {p}: stat {p}: "
                          f"{(e.strerror or str(e)).lower()}") from None

