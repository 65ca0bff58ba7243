"""`epp serve`'s server assembly: grouped options → validate() → plan → wire() → graph;
startup and teardown through the exit stack (epp/server/options.py, wiring.py, app.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
from pathlib import Path

import pytest

from epp.config.loader import load_and_build
from epp.discovery.kubernetes import PoolSpec
from epp.errors import ConfigError
from epp.server.app import EppServer, StartupError, serve_forever
from epp.server.leader import lease_name
from epp.server.options import (
    DrainOptions,
    EndpointsFile,
    HaOptions,
    KubernetesDiscovery,
    KubernetesSourceOptions,
    ListenOptions,
    ObservabilityOptions,
    ScrapingOptions,
    ServeOptions,
    StaticEndpoints,
    StaticSourceOptions,
    WorkerOptions,
    validate,
)
from epp.server.wiring import PluginTimings, body_consumers, wire
from epp.stack.procs import free_port

TWO = StaticSourceOptions(endpoints="10.0.0.1:8000,10.0.0.2:8000")


def _listen() -> ListenOptions:
    return ListenOptions(grpc_port=free_port(), grpc_health_port=free_port(),
                         metrics_port=free_port(), bind_address="127.0.0.1")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ------------------------------------------------------------------------------ validate


def test_validate_resolves_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = validate(ServeOptions(static=TWO))
    assert isinstance(plan.source, StaticEndpoints)
    assert [e.key for e in plan.source.endpoints] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert plan.workers == 1 and plan.metrics_auth_token is None
    assert DrainOptions().quiet_period_s == 30.0  # the whole window
    assert DrainOptions(timeout_s=5.0).quiet_period_s == 5.0
    assert DrainOptions(timeout_s=5.0, quiet_s=0.5).quiet_period_s == 0.5

    plan = validate(ServeOptions(static=StaticSourceOptions(endpoints_file="eps.yaml"),
                                 workers=WorkerOptions(count=0)))
    assert plan.source == EndpointsFile(Path("eps.yaml"), 0.5)
    assert plan.workers == (os.cpu_count() or 1)  # 0: one per CPU core

    monkeypatch.setenv("NAMESPACE", "ns")
    plan = validate(ServeOptions(
        kubernetes=KubernetesSourceOptions(endpoint_selector="app=x", endpoint_target_ports="8000",
                                           pool_name="p"),
        ha=HaOptions(enable_leader_election=True)))
    assert isinstance(plan.source, KubernetesDiscovery)
    assert plan.source.options.namespace == "ns"
    assert plan.source.options.standalone == PoolSpec({"app": "x"}, (8000,))
    assert plan.source.election is not None
    assert plan.source.election.name == lease_name("ns", "p")  # --pool-name names the Lease


def test_validate_reads_the_bearer_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")

    def auth(flag: str) -> ServeOptions:
        return ServeOptions(static=TWO, observability=ObservabilityOptions(metrics_auth=flag))

    assert validate(auth(str(token))).metrics_auth_token == "s3cret"
    assert validate(auth("false")).metrics_auth_token is None  # GIE's boolean form: off
    with pytest.raises(ConfigError, match="takes a file holding the bearer token"):
        validate(auth("true"))


@pytest.mark.parametrize("options, message", [
    (ServeOptions(), "exactly one endpoint source"),
    (ServeOptions(static=TWO, workers=WorkerOptions(count=-1)), "--workers must be >= 0"),
    (ServeOptions(static=TWO, drain=DrainOptions(quiet_s=-1)),
     "--drain-quiet-period must be >= 0"),
    (ServeOptions(static=TWO, ha=HaOptions(enable_leader_election=True)),
     "needs a Kubernetes endpoint source"),
    (ServeOptions(kubernetes=KubernetesSourceOptions(pool_name="")), "--pool-name: empty name"),
    (ServeOptions(static=TWO, scraping=ScrapingOptions(
        scrape=dataclasses.replace(ScrapingOptions().scrape, interval_s=0))),
     "--refresh-metrics-interval must be > 0"),
])
def test_validate_rejects(options: ServeOptions, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(options)


def test_scrape_options_are_not_checked_without_scraping() -> None:
    scrape = dataclasses.replace(ScrapingOptions().scrape, interval_s=0)
    validate(ServeOptions(static=TWO, scraping=ScrapingOptions(enabled=False, scrape=scrape)))


# ---------------------------------------------------------------------------------- wire


async def test_wire_makes_the_graph_and_starts_nothing() -> None:
    plan = validate(ServeOptions(static=TWO, observability=ObservabilityOptions(
        explain_history=3)))
    timings = PluginTimings()
    built = load_and_build(timer=timings)
    tasks = asyncio.all_tasks()
    parts = wire(plan, built, timings, None)
    assert asyncio.all_tasks() == tasks  # no task started
    assert len(parts.store) == 2 and parts.store.synced and parts.health.ready
    assert parts.scraper is not None
    assert parts.core.on_upstream_failure == parts.scraper.report_unreachable
    assert parts.decisions is not None and parts.ext_proc is not None
    assert parts.endpoints_file is None and parts.tracing is None
    # The config's timer now reports to the per-plugin latency histogram.
    plugin = next(iter(built.plugins.values()))
    timings("Scorer", plugin, 0.001)
    count = parts.metrics.registry.get_sample_value(
        "inference_extension_plugin_duration_seconds_count",
        {"extension_point": "Scorer", "plugin_type": plugin.type_name,
         "plugin_name": plugin.name})
    assert count == 1
    # --workers N: the fronts serve ext_proc, not this process.
    workers = validate(ServeOptions(static=TWO, workers=WorkerOptions(count=2)))
    assert wire(workers, built, PluginTimings(), None).ext_proc is None


class _Index:
    type_name, name = "test-index", "index"

    def prefix_index_size(self) -> int:
        return 7


class _BodyObserver:
    type_name, name = "test-observer", "observer"
    response_needs = frozenset({"body"})


class _HeadersObserver:
    type_name, name = "test-headers", "headers"
    response_needs = frozenset({"headers"})


def test_wire_reaches_plugins_by_protocol_only() -> None:
    timings = PluginTimings()
    built = load_and_build(timer=timings)
    built = dataclasses.replace(built, plugins={
        **built.plugins, "index": _Index(), "observer": _BodyObserver(),
        "headers": _HeadersObserver()})
    parts = wire(validate(ServeOptions(static=TWO)), built, timings, None)
    # The default config's own prefix index is empty: only the test plugin counts.
    assert parts.metrics.registry.get_sample_value(
        "inference_extension_prefix_indexer_size") == 7
    assert body_consumers(built) == ["observer"]


# ------------------------------------------------------------------- startup, teardown


async def test_a_failed_start_unwinds_what_had_started() -> None:
    listen = _listen()
    with socket.socket() as busy:  # the health port is taken: bound after the metrics port
        busy.bind(("127.0.0.1", listen.grpc_health_port))
        busy.listen()
        server = EppServer(ServeOptions(listen=listen, static=TWO))
        with pytest.raises(StartupError, match="cannot listen for gRPC health"):
            await server.start()
    assert _port_free(listen.metrics_port)  # released again
    with pytest.raises(RuntimeError, match="has not completed"):
        _ = server.store
    await server.stop(0)  # nothing left to stop


async def test_stop_unwinds_everything_once() -> None:
    listen = _listen()
    server = EppServer(ServeOptions(listen=listen, static=TWO))
    before = asyncio.all_tasks()
    await server.start()
    assert not any(_port_free(p) for p in (listen.grpc_port, listen.grpc_health_port,
                                           listen.metrics_port))
    started = asyncio.all_tasks() - before
    assert "metrics-staleness-sweeper" in {t.get_name() for t in started}  # the scraper's
    await server.stop(0)
    assert all(_port_free(p) for p in (listen.grpc_port, listen.grpc_health_port,
                                       listen.metrics_port))
    assert all(t.done() for t in started)
    await server.stop(0)  # a second stop does nothing


async def test_serve_forever_drains_then_stops() -> None:
    listen = _listen()
    stop = asyncio.Event()
    stop.set()  # the signal has come already
    options = ServeOptions(listen=listen, static=TWO, scraping=ScrapingOptions(enabled=False),
                           drain=DrainOptions(timeout_s=5.0, quiet_s=0.0))
    await asyncio.wait_for(serve_forever(options, stop), 5)
    assert all(_port_free(p) for p in (listen.grpc_port, listen.grpc_health_port,
                                       listen.metrics_port))
