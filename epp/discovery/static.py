"""The embedded default endpoint source: ``--endpoints`` or ``--endpoints-file``.

File format (YAML)::

    endpoints:
    - address: 10.0.0.5        # required
      port: 8000               # required
      name: vllm-0             # optional, default address:port
      labels: {llm-d.ai/role: decode}
      nodeName: node-a         # optional
    nodes:                     # optional: node labels (topology), by node name
    - name: node-a
      labels: {topology.kubernetes.io/rack: rack-1}

The file is polled for changes (mtime, size, inode); a change that fails to parse is
logged and the last good set stays in force.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.scheduling.types import Endpoint

log = logging.getLogger(__name__)


def _check_address(addr: str, where: str) -> str:
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        raise ConfigError(f"{where}: {addr!r} is not an IP address (Envoy's ORIGINAL_DST "
                          "routing needs ip:port)") from None
    return addr


def _check_port(port: Any, where: str) -> int:
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"{where}: port must be an integer 1..65535, got {port!r}")
    return port


def parse_endpoints_arg(value: str) -> list[Endpoint]:
    """Parse ``ip:port[,ip:port…]`` (IPv6 as ``[addr]:port``)."""
    out: list[Endpoint] = []
    seen: set[str] = set()
    for i, item in enumerate(x.strip() for x in value.split(",")):
        if not item:
            continue
        where = f"--endpoints item {i + 1} ({item!r})"
        if item.startswith("["):
            host, sep, port = item[1:].partition("]:")
        else:
            host, sep, port = item.rpartition(":")
        if not sep or not host:
            raise ConfigError(f"{where}: expected ip:port")
        ep = Endpoint(name="", address=_check_address(host, where), port=_check_port(port, where))
        ep = Endpoint(name=ep.key, address=ep.address, port=ep.port)
        if ep.key in seen:
            raise ConfigError(f"{where}: duplicate endpoint {ep.key}")
        seen.add(ep.key)
        out.append(ep)
    if not out:
        raise ConfigError("--endpoints: no endpoints given (expected ip:port[,ip:port…])")
    return out


def _str_map(v: Any, where: str) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ConfigError(f"{where}: expected a mapping of label: value")
    return {str(k): str(val) for k, val in v.items()}


def parse_endpoints_file(text: str, source: str) -> list[Endpoint]:
    """Parse the endpoints file; raise ConfigError naming the file and the bad entry."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from e
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{source}: expected a mapping with an 'endpoints' list")
    unknown = set(doc) - {"endpoints", "nodes"}
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {sorted(unknown)}; allowed: endpoints, nodes")
    nodes: dict[str, dict[str, str]] = {}
    raw_nodes = doc.get("nodes") or []
    if not isinstance(raw_nodes, list):
        raise ConfigError(f"{source}: nodes: expected a list")
    for i, n in enumerate(raw_nodes):
        where = f"{source}: nodes[{i}]"
        if not isinstance(n, Mapping) or not isinstance(n.get("name"), str):
            raise ConfigError(f"{where}: expected {{name: NODE, labels: {{…}}}}")
        extra = set(n) - {"name", "labels"}
        if extra:
            raise ConfigError(f"{where}: unknown key(s) {sorted(extra)}; allowed: name, labels")
        nodes[n["name"]] = _str_map(n.get("labels"), f"{where}.labels")
    raw = doc.get("endpoints")
    if not isinstance(raw, list):
        raise ConfigError(f"{source}: endpoints: expected a list of {{address, port, …}}")
    out: list[Endpoint] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        where = f"{source}: endpoints[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{where}: expected a mapping with address and port")
        extra = set(item) - {"address", "port", "name", "labels", "nodeName", "namespace"}
        if extra:
            raise ConfigError(f"{where}: unknown key(s) {sorted(extra)}; allowed: address, "
                              "port, name, namespace, labels, nodeName")
        if "address" not in item or "port" not in item:
            raise ConfigError(f"{where}: 'address' and 'port' are required")
        addr = _check_address(str(item["address"]), f"{where}.address")
        port = _check_port(item["port"], f"{where}.port")
        node = item.get("nodeName")
        if node is not None and not isinstance(node, str):
            raise ConfigError(f"{where}.nodeName: expected a string")
        ep = Endpoint(
            name=str(item.get("name") or ""),
            namespace=str(item.get("namespace") or ""),
            address=addr,
            port=port,
            labels=_str_map(item.get("labels"), f"{where}.labels"),
            node_name=node,
            node_labels=nodes.get(node, {}) if node else {},
        )
        if not ep.name:
            ep = Endpoint(name=ep.key, namespace=ep.namespace, address=addr, port=port,
                          labels=ep.labels, node_name=node, node_labels=ep.node_labels)
        if ep.key in seen:
            raise ConfigError(f"{where}: duplicate endpoint {ep.key}")
        seen.add(ep.key)
        out.append(ep)
    return out


def read_endpoints_file(path: Path) -> list[Endpoint]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read endpoints file: {e.strerror or e}") from e
    return parse_endpoints_file(text, str(path))


class StaticFileSource:
    """Loads the endpoints file into the datastore and re-reads it when it changes."""

    def __init__(self, path: Path, store: Datastore, poll_interval_s: float = 0.5,
                 reader: Callable[[Path], list[Endpoint]] | None = None) -> None:
        self.path = path
        self._read = reader or read_endpoints_file  # another format: llmd_file.py
        self.store = store
        self.poll_interval_s = poll_interval_s
        self._stamp: tuple[int, int, int] | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_error: str | None = None

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def load_initial(self) -> None:
        """Read the file once; errors propagate (startup must fail on a bad file)."""
        self._stamp = self._file_stamp()
        self.store.set_endpoints(self._read(self.path))

    def reload_if_changed(self) -> bool:
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            endpoints = self._read(self.path)
        except ConfigError as e:
            if str(e) != self._last_error:
                log.error("endpoints file change ignored, keeping the last good set: %s", e)
                self._last_error = str(e)
            return False
        self._last_error = None
        self.store.set_endpoints(endpoints)
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            self.reload_if_changed()

    def start_polling(self) -> None:
        """Start re-reading the file on change (after :meth:`load_initial`)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="endpoints-file")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
