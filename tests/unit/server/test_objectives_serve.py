"""`epp serve` and InferenceObjectives / InferenceModelRewrites: the ``--objectives-file``
flag and its validation, the wiring (one store: discovery or the file writes it, the
Directors read it), startup on a bad file, pool mode through the server, and the
replication to ``--workers`` fronts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from epp.cli import build_parser, serve_options
from epp.config.loader import load_and_build
from epp.datastore.objectives import (
    ModelRewrite,
    Objective,
    ObjectiveStore,
    RewriteRule,
    TargetModel,
)
from epp.errors import ConfigError
from epp.scheduling.types import ApiType, LLMRequest
from epp.server import workers
from epp.server.app import EppServer
from epp.server.options import (
    KubernetesSourceOptions,
    ListenOptions,
    ObjectivesFile,
    ObjectivesOptions,
    ObservabilityOptions,
    ScrapingOptions,
    ServeOptions,
    StaticSourceOptions,
    validate,
)
from epp.server.wiring import PluginTimings, wire
from epp.stack.procs import free_port
from tests.k8s_fake import FakeApiServer
from tests.polling import eventually

TWO = StaticSourceOptions(endpoints="10.0.0.1:8000,10.0.0.2:8000")
QUIET = ObservabilityOptions(tracing=False, metrics_auth="false")
API = "apiVersion: inference.networking.x-k8s.io/v1alpha2"
GOOD = f"""\
{API}
kind: InferenceObjective
metadata: {{name: critical}}
spec: {{priority: 10}}
---
{API}
kind: InferenceModelRewrite
metadata: {{name: canary}}
spec:
  rules:
  - matches: [{{model: {{value: llama}}}}]
    targets: [{{modelRewrite: llama-v2}}]
"""


def _listen() -> ListenOptions:
    return ListenOptions(grpc_port=free_port(), grpc_health_port=free_port(),
                         metrics_port=free_port(), bind_address="127.0.0.1")


def test_the_flag() -> None:
    args = build_parser().parse_args(["serve", "--endpoints", "10.0.0.1:8000",
                                      "--objectives-file", "objectives.yaml"])
    assert serve_options(args).objectives == ObjectivesOptions(file="objectives.yaml")
    args = build_parser().parse_args(["serve", "--endpoints", "10.0.0.1:8000"])
    assert serve_options(args).objectives.file is None


def test_validation() -> None:
    plan = validate(ServeOptions(static=TWO, objectives=ObjectivesOptions(file="o.yaml")))
    assert plan.objectives_file == ObjectivesFile(Path("o.yaml"), 0.5)
    assert validate(ServeOptions(static=TWO)).objectives_file is None
    standalone = KubernetesSourceOptions(endpoint_selector="app=x", endpoint_target_ports="8000")
    assert validate(ServeOptions(kubernetes=standalone, observability=QUIET,
                                 objectives=ObjectivesOptions(file="o.yaml"))).objectives_file
    with pytest.raises(ConfigError, match="--objectives-file cannot be used with --pool-name"):
        validate(ServeOptions(kubernetes=KubernetesSourceOptions(pool_name="p"),
                              objectives=ObjectivesOptions(file="o.yaml")))
    with pytest.raises(ConfigError, match="--objectives-file: empty path"):
        validate(ServeOptions(static=TWO, objectives=ObjectivesOptions(file="")))
    with pytest.raises(ConfigError, match="poll interval"):
        validate(ServeOptions(static=TWO, objectives=ObjectivesOptions(file="o",
                                                                       poll_interval_s=0)))


def test_wiring_shares_one_store(tmp_path: Path) -> None:
    timings = PluginTimings()
    plan = validate(ServeOptions(static=TWO, objectives=ObjectivesOptions(
        file=str(tmp_path / "o.yaml"))))
    parts = wire(plan, load_and_build(timer=timings), timings, None)
    assert parts.core.objectives is parts.objectives
    assert parts.director.objectives is parts.objectives
    assert parts.objectives_file is not None and parts.objectives_file.store is parts.objectives
    assert parts.objectives_file.path == tmp_path / "o.yaml"
    # Without the flag: an empty store all the same (pool mode fills it).
    plan = validate(ServeOptions(static=TWO))
    parts = wire(plan, load_and_build(timer=timings), timings, None)
    assert parts.objectives_file is None and len(parts.objectives) == 0
    assert parts.director.objectives is parts.objectives


async def test_a_bad_file_fails_startup_before_any_port(tmp_path: Path) -> None:
    path = tmp_path / "objectives.yaml"
    path.write_text(GOOD.replace("priority: 10", "priority: ten"))
    listen = _listen()
    server = EppServer(ServeOptions(listen=listen, static=TWO, observability=QUIET,
                                    objectives=ObjectivesOptions(file=str(path))))
    with pytest.raises(ConfigError) as e:
        await server.start()
    assert f"{path}: document 1 (InferenceObjective 'critical'): spec.priority" in str(e.value)
    await server.stop(0)
    server = EppServer(ServeOptions(listen=listen, static=TWO, observability=QUIET,
                                    objectives=ObjectivesOptions(file=str(tmp_path / "no"))))
    with pytest.raises(ConfigError, match="cannot read objectives file"):
        await server.start()


async def test_the_file_is_loaded_and_polled(tmp_path: Path) -> None:
    path = tmp_path / "objectives.yaml"
    path.write_text(GOOD)
    server = EppServer(ServeOptions(listen=_listen(), static=TWO, observability=QUIET,
                                    scraping=ScrapingOptions(enabled=False),
                                    objectives=ObjectivesOptions(file=str(path),
                                                                 poll_interval_s=0.01)))
    await server.start()
    try:
        objectives = server.parts.objectives
        assert objectives.priority("critical") == 10
        assert objectives.rewrite("llama") == ("llama-v2", "canary")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(GOOD.replace("priority: 10", "priority: 11") + " ")  # size changes
        tmp.replace(path)
        await eventually(lambda: objectives.priority("critical") == 11)
    finally:
        await server.stop(0)
    assert server.parts.objectives_file is not None
    assert server.parts.objectives_file._task is None  # polling stopped


async def test_pool_mode_fills_the_store(fake: FakeApiServer, tmp_path: Path) -> None:
    fake.put_pool("pool", {"app": "vllm"}, [8000])
    fake.put_pod("a", "10.0.0.1", labels={"app": "vllm"})
    fake.put("inferenceobjectives", {"metadata": {"name": "critical"},
                                     "spec": {"priority": 5, "poolRef": {"name": "pool"}}})
    server = EppServer(ServeOptions(
        listen=_listen(), observability=QUIET, scraping=ScrapingOptions(enabled=False),
        kubernetes=KubernetesSourceOptions(
            pool_name="pool", pool_namespace="default",
            kubeconfig=str(fake.write_kubeconfig(tmp_path / "kc")))))
    await server.start()
    try:
        assert server.k8s_source is not None and await server.k8s_source.wait_ready(5)
        assert server.parts.objectives.priority("critical") == 5
        assert server.k8s_source.objectives is server.parts.objectives
        fake.put("inferenceobjectives", {"metadata": {"name": "critical"},
                                         "spec": {"priority": 6, "poolRef": {"name": "pool"}}})
        await eventually(lambda: server.parts.objectives.priority("critical") == 6)
    finally:
        await server.stop(0)


# ---------------------------------------------------------------------- --workers N
class _Writer:
    """Collects what the core writes to a front."""

    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.transport = self

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.frames.append(orjson.loads(data[4:]))

    def close(self) -> None:
        pass


def test_priority_and_rewrite_cross_the_worker_socket() -> None:
    request = LLMRequest("r1", "m2", "m", ApiType.COMPLETIONS, "hi", {}, priority=-4,
                         model_rewrite="rw")
    back = workers._request_from_wire(orjson.loads(orjson.dumps(
        workers._request_to_wire(request))))
    assert (back.priority, back.model_rewrite, back.target_model) == (-4, "rw", "m2")


async def test_the_core_sends_its_store_to_each_front() -> None:
    timings = PluginTimings()
    parts = wire(validate(ServeOptions(static=TWO)), load_and_build(timer=timings), timings,
                 None)
    parts.objectives.set_objective(Objective("critical", 10))
    server = workers.CoreServer(parts.core, lambda outcome: None)
    reader = asyncio.StreamReader()
    writer = _Writer()
    task = asyncio.ensure_future(server._serve(reader, writer))  # type: ignore[arg-type]
    await eventually(lambda: writer.frames)
    assert writer.frames[0] == ["M", parts.objectives.export()]
    parts.objectives.set_rewrite(ModelRewrite("rw", (RewriteRule(
        ("m",), (TargetModel("m2"),)),)))
    assert writer.frames[-1] == ["M", parts.objectives.export()]  # broadcast on change
    replica = ObjectiveStore()
    replica.load(writer.frames[-1][1])
    assert replica.priority("critical") == 10 and replica.rewrite("m") == ("m2", "rw")
    # The rewrite the front applied is counted by the core.
    request = LLMRequest("r1", "m2", "m", ApiType.COMPLETIONS, "hi", {}, model_rewrite="rw")
    reader.feed_data(workers._frame(["R", 1, workers._request_to_wire(request), None]))
    reader.feed_eof()
    await task
    assert writer.frames[-1][0] == "D"
    assert parts.metrics.registry.get_sample_value(
        "inference_extension_model_rewrite_decisions_total",
        {"model_rewrite_name": "rw", "model_name": "m", "target_model": "m2"}) == 1


async def test_the_front_hands_store_frames_to_its_handler() -> None:
    reader = asyncio.StreamReader()
    got: list[Any] = []
    writer: Any = _Writer()
    core = workers.RemoteCore(reader, writer, got.append)
    export = {"objectives": [["critical", 3]], "rewrites": []}
    reader.feed_data(workers._frame(["M", export]))
    reader.feed_eof()
    await core.closed.wait()
    assert got == [["M", export]]


async def test_objective_created_changed_deleted_while_serving(fake: FakeApiServer,
                                                              tmp_path: Path) -> None:
    """Issue 16: in Kubernetes mode an InferenceObjective created, changed and deleted
    while the EPP serves changes what its requests get. Without scraping the
    utilization-detector reads the pool as saturated, so GIE's legacy admission sheds a
    request whose objective is sheddable (priority < 0) and passes every other one."""
    from epp import keys
    from epp.errors import NoCapacity
    fake.put_pool("pool", {"app": "vllm"}, [8000])
    fake.put_pod("a", "10.0.0.1", labels={"app": "vllm"})
    server = EppServer(ServeOptions(
        listen=_listen(), observability=QUIET, scraping=ScrapingOptions(enabled=False),
        kubernetes=KubernetesSourceOptions(
            pool_name="pool", pool_namespace="default",
            kubeconfig=str(fake.write_kubeconfig(tmp_path / "kc")))))
    await server.start()
    director = server.parts.director
    headers = {":path": "/v1/completions", keys.HEADER_OBJECTIVE: "batch"}
    body = orjson.dumps({"model": "llama", "prompt": "hi"})

    async def outcome() -> int:
        try:
            routed = await director.route(headers, body, True, None)
        except NoCapacity as e:
            return e.status
        director.on_done(routed.context, aborted=True)
        return 200

    def objective(priority: int) -> dict[str, Any]:
        return {"metadata": {"name": "batch"},
                "spec": {"priority": priority, "poolRef": {"name": "pool"}}}

    try:
        assert server.k8s_source is not None and await server.k8s_source.wait_ready(5)
        assert await outcome() == 200  # unknown objective: priority 0, not sheddable
        fake.put("inferenceobjectives", objective(-1))  # created: sheddable
        await eventually(lambda: server.parts.objectives.priority("batch") == -1)
        assert await outcome() == 429
        fake.put("inferenceobjectives", objective(3))  # changed
        await eventually(lambda: server.parts.objectives.priority("batch") == 3)
        assert await outcome() == 200
        fake.put("inferenceobjectives", objective(-2))
        await eventually(lambda: server.parts.objectives.priority("batch") == -2)
        assert await outcome() == 429
        fake.delete("inferenceobjectives", "batch")  # deleted: GIE's default priority 0
        await eventually(lambda: server.parts.objectives.priority("batch") == 0)
        assert await outcome() == 200
    finally:
        await server.stop(0)
