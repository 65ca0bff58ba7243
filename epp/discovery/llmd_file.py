"""llm-d-router's endpoint discovery by file: ``file-discovery`` and
``multicluster-file-discovery`` (llm-d-router v0.10.0,
pkg/epp/framework/plugins/datalayer/discovery/file: plugin.go, multicluster.go;
docs/discovery.md; selected by the config's ``dataLayer.discovery.pluginRef``).

When the config names one of these plugins in ``dataLayer.discovery``, the EPP runs
without Kubernetes and without ``--endpoints``/``--endpoints-file``: the plugin is the
endpoint source (epp/server/options.py ``ConfigDiscovery``, epp/server/wiring.py). It
feeds the datastore through the same :class:`~epp.discovery.static.StaticFileSource`
that serves ``--endpoints-file`` (read at startup, then polled for changes), with this
module's reader for llm-d's file format::

    endpoints:
      - name: vllm-0              # unique within the namespace; a later entry wins
        namespace: inference      # optional, default "default"
        address: "10.0.0.1"       # IPv4 literal (multicluster: an IP or DNS-1123 host)
        port: "8000"              # 1-65535, a string in llm-d (an integer is accepted)
        labels: {model: llama}    # optional, string values

Parameters: ``path`` (required) and ``watchFile`` (default false: the file is read once).

Validation, as llm-d's ``load``: a file that cannot be read, is over 1 MiB or is not
YAML/JSON of that shape is a file-level error; an entry whose address or port is invalid
is an entry error. At startup either fails the EPP (llm-d's ``Start`` returns "initial
load failed"). On a reload (``watchFile: true``; a write, an atomic rename, a removal) a
file-level error is logged and the last good set stays; entry errors are logged, those
entries are skipped (an endpoint whose entry went bad leaves the pool) and the valid
entries are applied, as llm-d applies them. Unknown keys in an entry are ignored (Go's
``json.Unmarshal``).

``multicluster-file-discovery`` lists peer clusters as endpoints: the address may also be
a hostname (a cluster gateway), and a ``metricsAddress`` label (with an optional
``metricsPort``, default the endpoint's port) moves the scrape target of
``multicluster-metrics-data-source`` off the routable address (:func:`metrics_host`).
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import yaml

from epp.datastore.store import Datastore
from epp.discovery.static import StaticFileSource
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import Plugin
from epp.framework.params import ParameterError, param
from epp.scheduling.types import Endpoint, host_port

log = logging.getLogger(__name__)

FILE_DISCOVERY = "file-discovery"
MULTICLUSTER_FILE_DISCOVERY = "multicluster-file-discovery"
#: llm-d's maxEndpointsFileSize.
MAX_FILE_BYTES = 1 << 20
DEFAULT_NAMESPACE = "default"
#: The labels a multicluster entry moves its metrics scrape with (llm-d's
#: metricsHostFromLabels).
METRICS_ADDRESS_LABEL = "metricsAddress"
METRICS_PORT_LABEL = "metricsPort"

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")
_GO_ATOI = re.compile(r"[+-]?[0-9]+")


@runtime_checkable
class EndpointDiscovery(Plugin, Protocol):
    """A plugin the config's ``dataLayer.discovery.pluginRef`` can name (llm-d's
    ``EndpointDiscovery``): it makes the source that fills the datastore."""

    def endpoint_source(self, store: Datastore, poll_interval_s: float) -> StaticFileSource:
        """The source: ``load_initial()`` at startup (raises ConfigError on a bad file),
        then ``start_polling()`` / ``stop()`` (epp/server/app.py)."""
        ...


def validate_ipv4(address: str) -> None:
    """llm-d's validateIPv4Address: an IPv4 literal (the pod discovery contract)."""
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        raise ValueError(f"invalid IPv4 address {address!r}") from None


def validate_host_or_ip(address: str) -> None:
    """llm-d's validateHostOrIP: an IP literal (v4 or v6) or a DNS-1123 subdomain (a
    cluster gateway host: lower case, no trailing dot, at most 253 characters)."""
    try:
        ipaddress.ip_address(address)
        return
    except ValueError:
        pass
    if len(address) <= 253 and _DNS1123_SUBDOMAIN.fullmatch(address):
        return
    raise ValueError(f"invalid host {address!r}")


def _port(value: Any) -> int:
    """strconv.Atoi in 1..65535 (llm-d's port is a string; an integer is accepted)."""
    port: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        port = value
    elif isinstance(value, str) and _GO_ATOI.fullmatch(value):
        port = int(value)
    if port is None or not 1 <= port <= 65535:
        raise ValueError(f"invalid port {value!r}")
    return port


def _string(entry: Mapping[str, Any], key: str, where: str) -> str:
    v = entry.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ConfigError(f"{where}.{key}: expected a string, got {v!r}")
    return v


def _labels(entry: Mapping[str, Any], where: str) -> dict[str, str]:
    raw = entry.get("labels")
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}.labels: expected a mapping of label: value")
    out: dict[str, str] = {}
    for k, v in raw.items():
        if not isinstance(v, str):
            raise ConfigError(f"{where}.labels.{k}: expected a string value, got {v!r} "
                              "(quote it)")
        out[str(k)] = v
    return out


@dataclass(frozen=True)
class ParsedFile:
    """The valid endpoints of a file, and the errors of the entries left out."""

    endpoints: list[Endpoint]
    errors: list[str]


def parse_endpoints(text: str | bytes, source: str,
                    validate_address: Callable[[str], None] = validate_ipv4) -> ParsedFile:
    """llm-d's ``load`` without the datastore: file-level problems raise
    :class:`ConfigError`; invalid entries are left out and named in ``errors``."""
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(f"endpoints file {source} exceeds 1 MiB limit")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"parsing {source}: not valid YAML or JSON: {e}") from e
    if doc is None:
        doc = {}
    if not isinstance(doc, Mapping):
        raise ConfigError(f"unmarshalling {source}: expected a mapping with an 'endpoints' "
                          "list")
    raw = doc.get("endpoints")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise ConfigError(f"unmarshalling {source}: endpoints: expected a list of "
                          "{name, address, port, …}")
    by_id: dict[tuple[str, str], Endpoint] = {}
    errors: list[str] = []
    for i, entry in enumerate(raw):
        where = f"{source}: endpoints[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"unmarshalling {where}: expected a mapping with name, address "
                              "and port")
        name = _string(entry, "name", where)
        namespace = _string(entry, "namespace", where) or DEFAULT_NAMESPACE
        address = _string(entry, "address", where)
        labels = _labels(entry, where)
        try:
            validate_address(address)
        except ValueError as e:
            errors.append(f"endpoint {name!r}: {e}")
            continue
        try:
            port = _port(entry.get("port"))
        except ValueError as e:
            errors.append(f"endpoint {name!r}: {e}")
            continue
        ep = Endpoint(name=name or host_port(address, port), namespace=namespace,
                      address=address, port=port, labels=labels)
        by_id.pop((namespace, name), None)  # a later entry of the same identity wins
        by_id[(namespace, name)] = ep
    return ParsedFile(list(by_id.values()), errors)


def metrics_host(endpoint: Endpoint) -> str:
    """Where a multicluster endpoint's metrics are scraped: ``metricsAddress`` (and
    ``metricsPort``, default the endpoint port) when labelled, else ``address:port``."""
    addr = endpoint.labels.get(METRICS_ADDRESS_LABEL, "")
    if not addr:
        return endpoint.key
    port = endpoint.labels.get(METRICS_PORT_LABEL, "") or str(endpoint.port)
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _path(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a file path, got {value!r}")
    return value


@dataclass(frozen=True)
class FileDiscoveryParameters:
    path: str = param("path", "", parse=_path)
    watch_file: bool = param("watchFile", False)


class _ReadOnce(StaticFileSource):
    """``watchFile: false``: read at startup, never again (llm-d's default)."""

    def start_polling(self) -> None:
        return None


class FileDiscovery:
    """``file-discovery``: endpoints from a YAML/JSON file (pod addresses: IPv4)."""

    type_name = FILE_DISCOVERY
    Parameters = FileDiscoveryParameters

    def __init__(self, name: str, path: str, watch_file: bool = False) -> None:
        self.name = name
        self.path = path
        self.watch_file = watch_file
        self._loaded = False  # after the first good load, entry errors are only logged

    @classmethod
    def from_params(cls, name: str, params: FileDiscoveryParameters,
                    handle: PluginHandle) -> FileDiscovery:
        if not params.path:
            raise ParameterError("path", f"{cls.type_name}: 'path' parameter is required "
                                 "(the endpoints file)")
        return cls(name, params.path, params.watch_file)

    def validate_address(self, address: str) -> None:
        validate_ipv4(address)

    def read(self, path: Path) -> list[Endpoint]:
        """Read the file (the reader of :class:`StaticFileSource`). Any error before the
        first good load raises; later, entry errors are logged and the rest applied."""
        what = (f"{self.type_name} {self.name!r}: "
                + ("" if self._loaded else "initial load failed: "))
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"{what}reading {path}: {e.strerror or e}") from e
        try:
            parsed = parse_endpoints(data, str(path), self.validate_address)
        except ConfigError as e:
            raise ConfigError(f"{what}{e}") from e
        if parsed.errors:
            problems = "; ".join(parsed.errors)
            if not self._loaded:
                raise ConfigError(f"{what}{path}: {problems}")
            log.error("%s %r: failed to reload endpoints file %s (the other entries are "
                      "applied): %s", self.type_name, self.name, path, problems)
        elif self._loaded:
            log.info("%s %r: endpoints file %s changed, reloaded (%d endpoints)",
                     self.type_name, self.name, path, len(parsed.endpoints))
        self._loaded = True
        return parsed.endpoints

    def endpoint_source(self, store: Datastore, poll_interval_s: float) -> StaticFileSource:
        cls = StaticFileSource if self.watch_file else _ReadOnce
        return cls(Path(self.path), store, poll_interval_s, reader=self.read)


class MultiClusterFileDiscovery(FileDiscovery):
    """``multicluster-file-discovery``: the endpoints are peer clusters, reached by their
    gateway host (an IP or a DNS-1123 hostname); ``metricsAddress``/``metricsPort``
    labels name where their pool metrics are scraped (:func:`metrics_host`)."""

    type_name = MULTICLUSTER_FILE_DISCOVERY

    def validate_address(self, address: str) -> None:
        validate_host_or_ip(address)
