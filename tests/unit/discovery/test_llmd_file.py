"""llm-d-router's ``file-discovery`` and ``multicluster-file-discovery``
(epp/discovery/llmd_file.py), against the behaviour llm-d v0.10.0's plugin_test.go and
multicluster_test.go (pkg/epp/framework/plugins/datalayer/discovery/file) expect."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from epp.datastore.store import Datastore
from epp.discovery.llmd_file import (
    FileDiscovery,
    MultiClusterFileDiscovery,
    metrics_host,
    parse_endpoints,
    validate_host_or_ip,
    validate_ipv4,
)
from epp.discovery.static import StaticFileSource
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import decode_params
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.types import Endpoint

VALID = """
endpoints:
  - name: ep1
    namespace: ns1
    address: "10.0.0.1"
    port: "8000"
  - name: ep2
    address: "10.0.0.2"
    port: "8001"
"""


def build(type_name: str, params: dict[str, object], name: str = "") -> FileDiscovery:
    plugin = default_registry().builder(type_name, "t")(name or type_name, params,
                                                         "plugins[0].parameters",
                                                         PluginHandle())
    assert isinstance(plugin, FileDiscovery)
    return plugin


def write(tmp_path: Path, text: str, name: str = "endpoints.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def load(plugin: FileDiscovery) -> tuple[Datastore, StaticFileSource]:
    store = Datastore()
    source = plugin.endpoint_source(store, 0.01)
    source.load_initial()
    return store, source


# --- factory ---------------------------------------------------------------------------


def test_path_is_required() -> None:
    with pytest.raises(ConfigError, match="'path' parameter is required"):
        build("file-discovery", {})


def test_parameters_decode_from_an_empty_block() -> None:
    p = decode_params(FileDiscovery.Parameters, {}, "x")
    assert (p.path, p.watch_file) == ("", False)


def test_name_and_type(tmp_path: Path) -> None:
    plugin = build("file-discovery", {"path": str(write(tmp_path, VALID))}, "my-discovery")
    assert (plugin.type_name, plugin.name) == ("file-discovery", "my-discovery")
    mc = build("multicluster-file-discovery", {"path": "x"}, "mc")
    assert (mc.type_name, mc.name) == ("multicluster-file-discovery", "mc")


# --- loading ---------------------------------------------------------------------------


def test_loads_endpoints_with_default_namespace(tmp_path: Path) -> None:
    store, _ = load(build("file-discovery", {"path": str(write(tmp_path, VALID))}))
    eps = {e.key: e for e in store.snapshot()}
    assert set(eps) == {"10.0.0.1:8000", "10.0.0.2:8001"}
    assert (eps["10.0.0.1:8000"].namespace, eps["10.0.0.1:8000"].name) == ("ns1", "ep1")
    assert (eps["10.0.0.2:8001"].namespace, eps["10.0.0.2:8001"].name) == ("default", "ep2")
    assert store.synced


def test_labels_kept_and_json_accepted(tmp_path: Path) -> None:
    path = write(tmp_path, '{"endpoints": [{"name": "a", "address": "10.0.0.9", '
                           '"port": "9000", "labels": {"model": "llama", "rank": "0"}}]}',
                 "endpoints.json")
    store, _ = load(build("file-discovery", {"path": str(path)}))
    (ep,) = store.snapshot()
    assert dict(ep.labels) == {"model": "llama", "rank": "0"}
    assert metrics_host(ep) == "10.0.0.9:9000"  # llm-d: MetricsHost is address:port


def test_empty_file_and_empty_list_load_no_endpoints(tmp_path: Path) -> None:
    for text in ("", "endpoints: []\n"):
        store, _ = load(build("file-discovery", {"path": str(write(tmp_path, text))}))
        assert len(store) == 0 and store.synced


def test_duplicate_identity_last_wins(tmp_path: Path) -> None:
    text = ("endpoints:\n- {name: a, address: 10.0.0.1, port: '8000'}\n"
            "- {name: a, address: 10.0.0.2, port: '8000'}\n")
    store, _ = load(build("file-discovery", {"path": str(write(tmp_path, text))}))
    assert [e.key for e in store.snapshot()] == ["10.0.0.2:8000"]


@pytest.mark.parametrize(("entry", "error"), [
    ("{name: ep1, address: not-an-ip, port: '8000'}", "invalid IPv4 address"),
    ("{name: ep1, address: '::1', port: '8000'}", "invalid IPv4 address"),
    ("{name: ep1, address: gw.cluster-a.example.com, port: '443'}", "invalid IPv4 address"),
    ("{name: ep1, address: 10.0.0.1, port: '99999'}", "invalid port"),
    ("{name: ep1, address: 10.0.0.1, port: '0'}", "invalid port"),
    ("{name: ep1, address: 10.0.0.1, port: '80x'}", "invalid port"),
    ("{name: ep1, address: 10.0.0.1}", "invalid port"),
])
def test_an_invalid_entry_fails_the_initial_load(tmp_path: Path, entry: str,
                                                 error: str) -> None:
    path = write(tmp_path, f"endpoints:\n- {entry}\n")
    with pytest.raises(ConfigError, match=f"initial load failed: .*endpoint 'ep1': {error}"):
        load(build("file-discovery", {"path": str(path)}))


@pytest.mark.parametrize(("text", "error"), [
    ("x" * ((1 << 20) + 1), "exceeds 1 MiB limit"),
    ("endpoints: [unclosed\n", "not valid YAML or JSON"),
    ("- a\n- b\n", "expected a mapping with an 'endpoints' list"),
    ("endpoints: {a: 1}\n", "endpoints: expected a list"),
    ("endpoints:\n- {name: a, address: 10.0.0.1, port: '1', labels: {x: 1}}\n",
     "labels.x: expected a string value"),
])
def test_file_level_errors_fail_the_initial_load(tmp_path: Path, text: str,
                                                 error: str) -> None:
    with pytest.raises(ConfigError, match=f"initial load failed: .*{error}"):
        load(build("file-discovery", {"path": str(write(tmp_path, text))}))


def test_missing_file_fails_the_initial_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file-discovery 'file-discovery': initial load "
                       "failed: reading .*nope.yaml"):
        load(build("file-discovery", {"path": str(tmp_path / "nope.yaml")}))


def test_integer_port_accepted() -> None:
    parsed = parse_endpoints("endpoints: [{name: a, address: 10.0.0.1, port: 8000}]", "f")
    assert [e.key for e in parsed.endpoints] == ["10.0.0.1:8000"]


# --- reload ----------------------------------------------------------------------------


def _bump(path: Path, text: str) -> None:
    """Write ``text`` so that the poller sees a change (a new mtime even within a tick)."""
    path.write_text(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_reload_deletes_removed_and_adds_new(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    store, source = load(build("file-discovery", {"path": str(path), "watchFile": True}))
    removed: list[str] = []
    store.on_removed(lambda ep: removed.append(ep.key))
    _bump(path, "endpoints:\n- {name: ep1, namespace: ns1, address: 10.0.0.1, port: '8000'}\n"
                "- {name: ep3, address: 10.0.0.3, port: '9000'}\n")
    assert source.reload_if_changed()
    assert [e.key for e in store.snapshot()] == ["10.0.0.1:8000", "10.0.0.3:9000"]
    assert removed == ["10.0.0.2:8001"]


def test_reload_of_a_bad_file_keeps_the_last_good_set(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    path = write(tmp_path, VALID)
    store, source = load(build("file-discovery", {"path": str(path), "watchFile": True}))
    before = [e.key for e in store.snapshot()]
    _bump(path, "endpoints: [unclosed\n")
    assert not source.reload_if_changed()
    assert [e.key for e in store.snapshot()] == before
    assert "keeping the last good set" in caplog.text and "not valid YAML" in caplog.text
    path.unlink()  # removed: as llm-d, the load fails, is logged, the set stays
    assert not source.reload_if_changed()
    assert [e.key for e in store.snapshot()] == before


def test_reload_with_a_bad_entry_applies_the_others(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    path = write(tmp_path, VALID)
    store, source = load(build("file-discovery", {"path": str(path), "watchFile": True}))
    _bump(path, "endpoints:\n- {name: ep1, namespace: ns1, address: bad, port: '8000'}\n"
                "- {name: ep3, address: 10.0.0.3, port: '9000'}\n")
    assert source.reload_if_changed()
    # llm-d: the invalid entry is skipped (so ep1 leaves), the valid one applied, logged
    assert [e.key for e in store.snapshot()] == ["10.0.0.3:9000"]
    assert "failed to reload endpoints file" in caplog.text
    assert "invalid IPv4 address 'bad'" in caplog.text


async def test_watch_file_false_never_rereads(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    _, source = load(build("file-discovery", {"path": str(path)}))
    source.start_polling()
    try:
        assert getattr(source, "_task", None) is None
    finally:
        await source.stop()


async def test_watch_file_true_polls(tmp_path: Path) -> None:
    from tests.polling import eventually

    path = write(tmp_path, VALID)
    store, source = load(build("file-discovery", {"path": str(path), "watchFile": True}))
    source.start_polling()
    try:
        tmp = tmp_path / "new.yaml"
        tmp.write_text("endpoints: [{name: ep3, address: 10.0.0.3, port: '9000'}]\n")
        tmp.replace(path)  # an atomic rename (editor safe-write, ConfigMap swap)
        await eventually(lambda: [e.key for e in store.snapshot()] == ["10.0.0.3:9000"],
                         timeout=5)
    finally:
        await source.stop()


# --- multicluster ----------------------------------------------------------------------


CLUSTERS = """
endpoints:
  - name: cluster-a
    address: "gw.cluster-a.example.com"
    port: "443"
"""


def test_multicluster_accepts_a_hostname(tmp_path: Path) -> None:
    store, _ = load(build("multicluster-file-discovery",
                          {"path": str(write(tmp_path, CLUSTERS))}, "mc"))
    (ep,) = store.snapshot()
    assert ep.key == "gw.cluster-a.example.com:443"
    assert metrics_host(ep) == "gw.cluster-a.example.com:443"


def test_stock_discovery_rejects_a_hostname(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid IPv4 address"):
        load(build("file-discovery", {"path": str(write(tmp_path, CLUSTERS))}))


@pytest.mark.parametrize(("labels", "want"), [
    ({"metricsAddress": "10.0.0.11", "metricsPort": "9090"}, "10.0.0.11:9090"),
    ({"metricsAddress": "10.0.0.11"}, "10.0.0.11:8080"),
    ({"metricsPort": "9090"}, "10.0.0.12:8080"),
    ({}, "10.0.0.12:8080"),
    ({"metricsAddress": "gw.example.com", "metricsPort": "443"}, "gw.example.com:443"),
])
def test_metrics_host_from_labels(labels: dict[str, str], want: str) -> None:
    assert metrics_host(Endpoint("x", "10.0.0.12", 8080, labels=labels)) == want


@pytest.mark.parametrize(("address", "ok"), [
    ("10.0.0.1", True), ("gw.example.com", False), ("::1", False), ("", False),
])
def test_validate_ipv4(address: str, ok: bool) -> None:
    if ok:
        validate_ipv4(address)
    else:
        with pytest.raises(ValueError, match="invalid IPv4 address"):
            validate_ipv4(address)


@pytest.mark.parametrize(("address", "ok"), [
    ("10.0.0.1", True), ("::1", True), ("gw.cluster-a.example.com", True), ("gateway", True),
    ("gw.example.com.", False), ("GW.example.com", False), ("3com.example.com", True),
    ("", False), ("gw_1.example.com", False), ("12345", True), ("gw:443", False),
    ("gw\x00.example.com", False), ("user@host", False), ("-bad.example.com", False),
    ("gw..example.com", False), ("a" * 254, False),
])
def test_validate_host_or_ip(address: str, ok: bool) -> None:
    """llm-d's TestValidateHostOrIP table."""
    if ok:
        validate_host_or_ip(address)
    else:
        with pytest.raises(ValueError, match="invalid host"):
            validate_host_or_ip(address)


def test_multicluster_is_a_file_discovery() -> None:
    assert issubclass(MultiClusterFileDiscovery, FileDiscovery)
