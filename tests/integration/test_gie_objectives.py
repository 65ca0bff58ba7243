"""InferenceObjectives and InferenceModelRewrites through real Envoy → `epp serve
--objectives-file` → fake pods: GIE v1.5.0's hermetic "Standard" mode cases that need the
CRDs (test/integration/epp/hermetic_test.go, "rewrite request model"; the objective
priorities of common_tests.go), which tests/integration/test_gie_hermetic.py (Go's
Standalone-NoCRD mode) skips.

The objects are GIE's own (test/testdata/inferencepool-with-model-hermetic.yaml), less the
InferencePool and the ``targetModels`` field the API server would prune, written to the
objectives file. Go drives the ext_proc stream and checks the body mutation and its
metrics; here a client talks HTTP to Envoy: the pod receives the rewritten body, the
client gets the model name rewritten back, and the EPP's /metrics shows the rewrite
decision and the objective's priority. With ``--workers 2`` the fronts apply the core's
objects (replicated over the core socket).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from epp import keys
from epp.stack.envoy import EnvoyProcess, render_envoy_config
from epp.stack.procs import free_port
from tests.integration.conftest import Epp, eventually

pytestmark = pytest.mark.integration

GIE = Path(__file__).resolve().parents[1] / "fixtures/gie-v1.5.0"
HERMETIC = GIE / "test/testdata/inferencepool-with-model-hermetic.yaml"
DEFAULT_CONFIG = (GIE / "test/integration/epp/testdata/default-config.yaml").read_text()
MODEL_MY = "my-model"  # Go's modelMyModel, an objective with priority 2
MODEL_MY_TARGET = "my-model-12345"
MODEL_TO_BE_WRITTEN = "model-to-be-rewritten"  # Go's modelToBeWritten
MODEL_AFTER_REWRITE = "rewritten-model"  # Go's modelAfterRewrite


@dataclass
class Pod:
    """Go's podState: the queue, KV-cache use and running adapters a pod reports."""

    queue: int
    kv: float
    models: tuple[str, ...] = ()


def P(queue: int, kv: float, *models: str) -> Pod:  # Go's helper name
    return Pod(queue, kv, models)


def metrics_text(pod: Pod) -> str:
    """The pod's state as vLLM's /metrics."""
    return "\n".join([
        f'vllm:num_requests_waiting{{model_name="base"}} {pod.queue}',
        'vllm:num_requests_running{model_name="base"} 0',
        f'vllm:kv_cache_usage_perc{{model_name="base"}} {pod.kv}',
        (f'vllm:lora_requests_info{{max_lora="{len(pod.models)}",'
         f'running_lora_adapters="{",".join(pod.models)}",waiting_lora_adapters=""}} 1.7e9'),
    ]) + "\n"


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name]


def llm_body(prompt: str, model: str) -> bytes:
    """Go's GenerateRequest body (json.Marshal of a map: keys sorted)."""
    return orjson.dumps({"max_tokens": 100, "model": model, "prompt": prompt,
                         "temperature": 0})


def llm_headers(objective: str, rewrite: str) -> dict[str, str]:
    """Go's generateHeaders: the objective and model-rewrite headers when given."""
    h = {"x-request-id": "test-request-id", "content-type": "application/json"}
    if objective:
        h[keys.HEADER_OBJECTIVE] = objective
    if rewrite:
        h[keys.HEADER_MODEL_REWRITE] = rewrite
    return h


def gie_objects() -> list[dict[str, Any]]:
    """GIE's hermetic InferenceObjectives and InferenceModelRewrite, as the API server
    would store them (``targetModels`` pruned)."""
    out = []
    for doc in yaml.safe_load_all(HERMETIC.read_text()):
        if doc["kind"] == "InferencePool":
            continue
        doc["spec"].pop("targetModels", None)
        out.append(doc)
    return out


def write_objectives(path: Path, docs: list[dict[str, Any]], tail: str = "") -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(docs, sort_keys=False) + tail)
    tmp.replace(path)


class Stack:
    def __init__(self, epp: Epp, envoy: EnvoyProcess, port: int, ports: list[int],
                 seen: list[bytes], objectives: Path) -> None:
        self.epp, self.envoy, self.port, self.ports = epp, envoy, port, ports
        self.seen, self.objectives = seen, objectives

    async def metrics(self, session: aiohttp.ClientSession) -> str:
        async with session.get(f"http://127.0.0.1:{self.epp.metrics_port}/metrics") as r:
            return await r.text()

    async def send(self, session: aiohttp.ClientSession, headers: dict[str, str],
                   body: bytes) -> tuple[int, bytes]:
        async with session.post(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                headers=headers) as r:
            return r.status, await r.read()


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []
    stacks: list[Stack] = []

    async def start(pods: list[Pod], workers: int = 1) -> Stack:
        seen: list[bytes] = []
        ports = [free_port() for _ in pods]
        for pod, port in zip(pods, ports, strict=True):
            def make(pod: Pod) -> Any:
                async def metrics(request: web.Request) -> web.Response:
                    return web.Response(text=metrics_text(pod))

                async def handle(request: web.Request) -> web.Response:
                    body = await request.read()
                    seen.append(body)
                    # Echo the model, as a model server names the model it ran.
                    model = orjson.loads(body).get("model")
                    return web.json_response({"model": model, "choices": []})
                return metrics, handle
            metrics_h, handle_h = make(pod)
            app = web.Application()
            app.router.add_get("/metrics", metrics_h)
            app.router.add_route("*", "/{tail:.*}", handle_h)
            runner = web.AppRunner(app)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", port).start()
        workdir = tmp_path / f"stack-{len(stacks)}"
        workdir.mkdir()
        objectives = workdir / "objectives.yaml"
        write_objectives(objectives, gie_objects())
        epp = Epp(workdir, workdir / "endpoints.yaml", config=DEFAULT_CONFIG,
                  extra_args=["--objectives-file", str(objectives),
                              "--workers", str(workers)])
        epp.write_endpoints(ports)
        await epp.start()
        port = free_port()
        envoy = EnvoyProcess()
        s = Stack(epp, envoy, port, ports, seen, objectives)
        stacks.append(s)
        await envoy.start(render_envoy_config(
            listen_port=port, epp_port=epp.grpc_port, admin_port=free_port(),
            body_mode="FULL_DUPLEX_STREAMED", response_path="inline"), workdir)
        await envoy.wait_ready()
        async with aiohttp.ClientSession() as session:
            async def synced() -> bool:
                text = await s.metrics(session)
                ready = samples(text, "inference_pool_ready_pods")
                return bool(ready) and ready[0][1] == len(pods)
            await eventually(synced, what="the EPP to load its endpoints")
        return s

    yield start
    for s in stacks:
        await s.envoy.stop()
        await s.epp.stop()
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


async def _metric(s: Stack, session: aiohttp.ClientSession, name: str,
                  want: list[tuple[dict[str, str], float]]) -> None:
    async def ok() -> bool:
        return sorted(samples(await s.metrics(session), name), key=str) == sorted(want, key=str)
    try:
        await eventually(ok, timeout=5)
    except AssertionError:
        got = samples(await s.metrics(session), name)
        raise AssertionError(f"{name}: {got} != {want}") from None


@pytest.mark.parametrize("workers", [1, 2])
async def test_rewrite_request_model(stack: Any, session: aiohttp.ClientSession,
                                     workers: int) -> None:
    """Go: "rewrite request model" — ReqLLM("test-rewrite", modelToBeWritten,
    modelToBeWritten), one pod serving the rewritten model; routed with the rewritten
    body, request counter priority 0 (no objective of that name), and the rewrite
    decision counted with GIE's labels."""
    s = await stack([P(0, 0.1, "foo", MODEL_AFTER_REWRITE)], workers=workers)
    status, body = await s.send(session, llm_headers(MODEL_TO_BE_WRITTEN, MODEL_TO_BE_WRITTEN),
                                llm_body("test-rewrite", MODEL_TO_BE_WRITTEN))
    assert status == 200, body
    assert [orjson.loads(b) for b in s.seen] == [orjson.loads(
        llm_body("test-rewrite", MODEL_AFTER_REWRITE))]
    # The model name is rewritten back in the response the client sees.
    assert orjson.loads(body)["model"] == MODEL_TO_BE_WRITTEN
    await _metric(s, session, "inference_objective_request_total", [
        ({"model_name": MODEL_TO_BE_WRITTEN, "target_model_name": MODEL_AFTER_REWRITE,
          "priority": "0"}, 1.0)])
    await _metric(s, session, "inference_extension_model_rewrite_decisions_total", [
        ({"model_rewrite_name": "rewrite-test", "model_name": MODEL_TO_BE_WRITTEN,
          "target_model": MODEL_AFTER_REWRITE}, 1.0)])


async def test_objective_priority_and_hot_reload(stack: Any,
                                                 session: aiohttp.ClientSession) -> None:
    """Go's Standard mode: "select lower queue and kv cache" with the objective my-model
    counts priority 2 (NoCRD mode: 0). A changed file applies to the next request; a
    broken one leaves the last good objects in force."""
    s = await stack([P(3, 0.2), P(0, 0.1), P(10, 0.2)])
    status, _ = await s.send(session, llm_headers(MODEL_MY, MODEL_MY_TARGET),
                             llm_body("test1", MODEL_MY))
    assert status == 200
    assert [orjson.loads(b)["model"] for b in s.seen] == [MODEL_MY_TARGET]
    await _metric(s, session, "inference_objective_request_total", [
        ({"model_name": MODEL_MY, "target_model_name": MODEL_MY_TARGET, "priority": "2"},
         1.0)])
    # Hot reload: my-model now has priority 7 and requests for it are rewritten.
    docs = gie_objects()
    (mine,) = [d for d in docs if d["metadata"]["name"] == MODEL_MY]
    mine["spec"]["priority"] = 7
    docs.append({"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                 "kind": "InferenceModelRewrite", "metadata": {"name": "my-model-v2"},
                 "spec": {"rules": [{"matches": [{"model": {"value": MODEL_MY}}],
                                     "targets": [{"modelRewrite": "my-model-v2"}]}]}})
    write_objectives(s.objectives, docs)

    async def reloaded() -> bool:
        status, _ = await s.send(session, llm_headers(MODEL_MY, ""), llm_body("t", MODEL_MY))
        assert status == 200
        return orjson.loads(s.seen[-1])["model"] == "my-model-v2"
    await eventually(reloaded, timeout=10, interval=0.2)
    await _metric(s, session, "inference_extension_model_rewrite_decisions_total", [
        ({"model_rewrite_name": "my-model-v2", "model_name": MODEL_MY,
          "target_model": "my-model-v2"}, 1.0)])
    got = samples(await s.metrics(session), "inference_objective_request_total")
    assert ({"model_name": MODEL_MY, "target_model_name": "my-model-v2", "priority": "7"},
            1.0) in got
    # A broken file: logged, the last good objects stay.
    mine["spec"]["priority"] = "seven"
    write_objectives(s.objectives, docs)
    proc = s.epp.proc
    assert proc is not None
    await eventually(lambda: "objectives file change ignored" in proc.log_tail(), timeout=10)
    assert "spec.priority: expected an integer" in proc.log_tail()
    status, _ = await s.send(session, llm_headers(MODEL_MY, ""), llm_body("t", MODEL_MY))
    assert status == 200 and orjson.loads(s.seen[-1])["model"] == "my-model-v2"
