"""The harness of the GIE v1.5.0 integration suites through real Envoy (test_gie_*.py):
GIE's test/integration/epp/harness.go and the helpers of common_tests.go, as a stack of
fake model-server pods → real Envoy → ``epp serve`` (static endpoints, standalone).

Go drives the EPP's ext_proc stream directly and compares the ProcessingResponses; here a
client talks HTTP (or gRPC) to Envoy, so each case asserts the observable equivalent at
the gateway boundary: the status, which pod served (Go: the
``x-gateway-destination-endpoint`` header / dynamic metadata), the body the pod received
(Go: the body mutation), the body and headers the client received (Go: the response
mutations), the dynamic metadata Envoy ended the request with (Go: ``DynamicMetadata``;
here Envoy's access log, :meth:`Stack.access_log`), and the EPP's /metrics where Go checks
them.

Go's ``P(idx, queue, kv, models...)`` fixes a pod's metrics in a fake metrics client; here
each pod reports exactly that state on a vLLM ``/metrics`` (``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:lora_requests_info`` running adapters) and records
every request it gets. Two layouts:

- ``ports`` (the hermetic suite): pod ``idx`` is an HTTP server on ``127.0.0.1:<its
  port>`` serving traffic and ``/metrics`` on that port.
- ``addresses``: pod ``idx`` is ``127.0.0.{idx+1}:<one port>`` — Go's
  ``192.168.1.{idx+1}:8000`` — with its ``/metrics`` on another common port (``epp serve
  --model-server-metrics-port``). This is what gRPC pods need (an HTTP/2 gRPC server
  cannot answer the HTTP/1.1 scrape); HTTP pods may use it too.
"""

from __future__ import annotations

import asyncio
import json
import socket
import stat
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import grpc
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from epp.parsing import vllm_grpc as g
from epp.stack.envoy import EnvoyProcess, envoy_binary, render_envoy_config
from epp.stack.procs import free_port
from tests.integration.conftest import Epp, eventually

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gie-v1.5.0"

# GIE v1.5.0 test/integration/epp/testdata/default-config.yaml.
DEFAULT_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: prefix-cache-scorer
  - type: lora-affinity-scorer
  - type: openai-parser
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
      - pluginRef: kv-cache-utilization-scorer
      - pluginRef: prefix-cache-scorer
      - pluginRef: lora-affinity-scorer
parser:
  pluginRef: openai-parser
featureGates:
  - enableLegacyMetrics
"""

MODEL_MY = "my-model"
MODEL_MY_TARGET = "my-model-12345"
MODEL_SQL_LORA = "sql-lora"
MODEL_SQL_LORA_TARGET = "sql-lora-1fdg2"

#: A request header that a header_to_metadata filter (before ext_proc) turns into Envoy's
#: subset hint (``envoy.lb.subset_hint``), which Go's requests carry as metadata.
SUBSET_HEADER = "x-test-subset"

#: Go's integration.GenerateGRPCMethodName / EmbedGRPCMethodName.
GENERATE = g.GENERATE_PATH
EMBED = g.EMBED_PATH

Layout = Literal["ports", "addresses"]

#: A dynamic metadata namespace Envoy's access log also writes (``test``); the ext_proc
#: filter accepts it only when a stack is started with ``receive=[TEST_NAMESPACE]``.
TEST_NAMESPACE = "epp.test"


@dataclass
class Pod:
    queue: int
    kv: float
    models: tuple[str, ...] = ()


def P(queue: int, kv: float, *models: str) -> Pod:  # Go's helper name
    return Pod(queue, kv, models)


@dataclass
class Seen:
    """One request a pod got. For a gRPC pod: ``body`` is the request message (unframed,
    as the server decoded it), ``headers`` its invocation metadata."""
    idx: int
    method: str
    headers: dict[str, str]
    body: bytes
    path: str = ""


@dataclass
class Reply:
    """What every HTTP pod answers: ``chunks`` written one by one (a pause between them,
    so Envoy sees separate body frames)."""
    chunks: Sequence[bytes] = (b'{"ok":true}',)
    content_type: str = "application/json"


@dataclass
class GrpcReply:
    """What every gRPC pod answers: ``generate``, the serialised ``GenerateResponse``
    messages Generate streams; ``embed``, the serialised ``EmbedResponse``."""
    generate: Sequence[bytes] = ()
    embed: bytes = b""


@dataclass
class Stack:
    pods: list[Pod]
    addresses: list[str]  # pod idx -> "ip:port"
    epp: Epp
    envoy: EnvoyProcess
    port: int
    workdir: Path
    seen: list[Seen] = field(default_factory=list)

    @property
    def ports(self) -> list[int]:
        return [int(a.rsplit(":", 1)[1]) for a in self.addresses]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def target(self) -> str:
        """Envoy's listener as a gRPC target."""
        return f"127.0.0.1:{self.port}"

    def key(self, idx: int) -> str:
        """Pod ``idx`` as the EPP names it (Go: ``192.168.1.{idx+1}:8000``)."""
        return self.addresses[idx]

    async def metrics(self, session: aiohttp.ClientSession) -> str:
        async with session.get(f"http://127.0.0.1:{self.epp.metrics_port}/metrics") as r:
            return await r.text()

    def access_log(self) -> list[dict[str, Any]]:
        """Envoy's access log so far, one entry per finished request: ``request_id``,
        ``path``, ``status``; ``lb``, the ``envoy.lb`` dynamic metadata the request
        ended with (an object; null when none), and ``test``, the same for the
        :data:`TEST_NAMESPACE` namespace."""
        path = self.workdir / "access.log"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    async def access_entry(self, request_id: str) -> dict[str, Any]:
        """The access log entry of the request with ``x-request-id: request_id``, once
        Envoy has written it (it flushes every 50 ms here)."""
        def entry() -> dict[str, Any] | None:
            found = [e for e in self.access_log() if e.get("request_id") == request_id]
            return found[-1] if found else None
        got: dict[str, Any] = await eventually(
            entry, what=f"Envoy's access log entry for request {request_id}")
        return got


def gie_objects() -> list[dict[str, Any]]:
    """GIE's base resources (test/testdata/inferencepool-with-model-hermetic.yaml) as the
    API server would store them: less the InferencePool (the static endpoints are the
    pool), ``targetModels`` pruned (tests/integration/test_gie_objectives.py does the
    same)."""
    out = []
    path = FIXTURES / "test/testdata/inferencepool-with-model-hermetic.yaml"
    for doc in yaml.safe_load_all(path.read_text()):
        if doc["kind"] == "InferencePool":
            continue
        doc["spec"].pop("targetModels", None)
        out.append(doc)
    return out


def metrics_text(pod: Pod) -> str:
    lines = [
        '# TYPE vllm:num_requests_waiting gauge',
        f'vllm:num_requests_waiting{{model_name="base"}} {pod.queue}',
        '# TYPE vllm:num_requests_running gauge',
        'vllm:num_requests_running{model_name="base"} 0',
        '# TYPE vllm:kv_cache_usage_perc gauge',
        f'vllm:kv_cache_usage_perc{{model_name="base"}} {pod.kv}',
        '# TYPE vllm:lora_requests_info gauge',
        # Go's fake metrics leave MaxActiveModels at 0 (no free adapter slot): max_lora is
        # the number of running adapters, so no pod can load one more.
        (f'vllm:lora_requests_info{{max_lora="{len(pod.models)}",'
         f'running_lora_adapters="{",".join(pod.models)}",waiting_lora_adapters=""}} 1.7e9'),
    ]
    return "\n".join(lines) + "\n"


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name]


def value(text: str, name: str) -> float | None:
    got = samples(text, name)
    return got[0][1] if got else None


def go_le(le: str) -> str:
    """Go's text format writes 1048576 as 1.048576e+06; Python's client as 1048576.0."""
    if le == "+Inf":
        return le
    f = float(le)
    return "1.048576e+06" if f == 1048576 else str(int(f))


# GIE's token histograms' bounds (pkg/epp/metrics/metrics.go), as Go's text format writes
# them.
INPUT_TOKEN_BOUNDS = ("1", "8", "16", "32", "64", "128", "256", "512", "1024", "2048",
                      "4096", "8192", "16384", "32778", "65536", "131072", "262144",
                      "524288", "1.048576e+06", "+Inf")
OUTPUT_TOKEN_BOUNDS = ("1", "8", "16", "32", "64", "128", "256", "512", "1024", "2048",
                       "4096", "8192", "+Inf")


async def expect_token_histogram(session: aiohttp.ClientSession, h: Stack, name: str,
                                 labels: dict[str, str], bounds: Sequence[str],
                                 observed: float) -> None:
    """Go's wantMetrics for ``inference_objective_{input,output}_tokens``: one
    observation of ``observed`` with ``labels``, bucket by bucket."""
    async def counted() -> str | None:
        text = await h.metrics(session)
        return text if samples(text, f"{name}_count") else None
    text = await eventually(counted, timeout=5, what=f"{name} to be recorded")
    assert samples(text, f"{name}_count") == [(labels, 1.0)]
    assert samples(text, f"{name}_sum") == [(labels, observed)]
    got = [({**lab, "le": go_le(lab["le"])}, v)
           for lab, v in samples(text, f"{name}_bucket")]
    assert got == [({**labels, "le": le}, 0.0 if le != "+Inf" and float(le) < observed
                    else 1.0) for le in bounds]


def _shared_port(ips: Sequence[str]) -> int:
    """A port free on every one of ``ips`` a moment ago."""
    for _ in range(100):
        port = free_port()
        socks: list[socket.socket] = []
        try:
            for ip in ips:
                s = socket.socket()
                socks.append(s)
                s.bind((ip, port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return port
    raise RuntimeError(f"no port free on all of {list(ips)}")


def _envoy_wrapper(workdir: Path) -> str:
    """An ``envoy`` that flushes its access log every 50 ms (default 10 s), so a test
    reads a request's entry right after the request."""
    path = workdir / "envoy-flushing"
    path.write_text(f'#!/bin/sh\nexec "{envoy_binary()}" --file-flush-interval-msec 50 "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


class Stacks:
    """Starts stacks (:meth:`start`); :meth:`close` stops everything they started."""

    def __init__(self, tmp_path: Path) -> None:
        self._tmp = tmp_path
        self._runners: list[web.AppRunner] = []
        self._servers: list[grpc.aio.Server] = []
        self._stacks: list[Stack] = []

    async def start(self, pods: list[Pod], config: str = DEFAULT_CONFIG,
                    reply: Reply | None = None, *, grpc_reply: GrpcReply | None = None,
                    layout: Layout = "ports",
                    body_mode: str = "FULL_DUPLEX_STREAMED",
                    receive: Sequence[str] = (), objectives: bool = False) -> Stack:
        """Pods (HTTP answering ``reply``, or gRPC answering ``grpc_reply`` — which needs
        the ``addresses`` layout), the EPP with ``config``, Envoy in GIE's gateway shape
        (``response_path="inline"``) with ``body_mode``, its ext_proc filter accepting
        dynamic metadata in ``envoy.lb`` and the namespaces ``receive`` names; returns
        once the EPP has scraped every pod's state (Go: WaitForReadyPodsMetric).
        ``objectives``: Go's standard mode with its base resources (``WithStandardMode()
        … WithBaseResources()``): GIE's hermetic InferenceObjectives and
        InferenceModelRewrite (:func:`gie_objects`) in ``epp serve --objectives-file``."""
        if grpc_reply is not None and layout != "addresses":
            raise ValueError("gRPC pods need layout='addresses'")
        workdir = self._tmp / f"stack-{len(self._stacks)}"
        workdir.mkdir()
        seen: list[Seen] = []
        extra_args: list[str] = []
        if layout == "ports":
            ports = [free_port() for _ in pods]
            addresses = [f"127.0.0.1:{p}" for p in ports]
            for idx, (pod, port) in enumerate(zip(pods, ports, strict=True)):
                await self._http_pod(idx, pod, reply or Reply(), seen,
                                     [("127.0.0.1", port)], metrics=True)
        else:
            ips = [f"127.0.0.{i + 1}" for i in range(len(pods))]
            traffic, scrape = _shared_port(ips), _shared_port(ips)
            while scrape == traffic:
                scrape = _shared_port(ips)
            addresses = [f"{ip}:{traffic}" for ip in ips]
            extra_args = ["--model-server-metrics-port", str(scrape)]
            for idx, (pod, ip) in enumerate(zip(pods, ips, strict=True)):
                if grpc_reply is not None:
                    await self._grpc_pod(idx, grpc_reply, seen, ip, traffic)
                    await self._http_pod(idx, pod, None, seen, [(ip, scrape)], metrics=True)
                else:
                    await self._http_pod(idx, pod, reply or Reply(), seen,
                                         [(ip, traffic), (ip, scrape)], metrics=True)

        if objectives:
            path = workdir / "objectives.yaml"
            path.write_text(yaml.safe_dump_all(gie_objects(), sort_keys=False))
            extra_args += ["--objectives-file", str(path)]
        epp = Epp(workdir, workdir / "endpoints.yaml", config=config, extra_args=extra_args)
        if layout == "ports":
            epp.write_endpoints([int(a.rsplit(":", 1)[1]) for a in addresses])
        else:
            doc = {"endpoints": [{"address": a.rsplit(":", 1)[0],
                                  "port": int(a.rsplit(":", 1)[1]), "name": f"pod-{i}"}
                                 for i, a in enumerate(addresses)]}
            epp.endpoints_file.write_text(yaml.safe_dump(doc))
        await epp.start()
        port = free_port()
        doc = yaml.safe_load(render_envoy_config(
            listen_port=port, epp_port=epp.grpc_port, admin_port=free_port(),
            body_mode=body_mode, response_path="inline"))
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"]
        # Go's ReqSubset puts the subset in the ext_proc metadata (envoy.lb.subset_hint);
        # with real Envoy a header_to_metadata filter before ext_proc sets it.
        hcm["http_filters"].insert(0, {
            "name": "envoy.filters.http.header_to_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http."
                         "header_to_metadata.v3.Config",
                "request_rules": [{"header": SUBSET_HEADER, "remove": True,
                                   "on_header_present": {
                                       "metadata_namespace": "envoy.lb.subset_hint",
                                       "key": "x-gateway-destination-endpoint-subset",
                                       "type": "STRING"}}]}})
        # What Envoy knows at the end of each request, the EPP's dynamic metadata
        # included (Go's tests read ProcessingResponse.DynamicMetadata).
        hcm["access_log"] = [{
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3."
                         "FileAccessLog",
                "path": str(workdir / "access.log"),
                "log_format": {"json_format": {
                    "request_id": "%REQ(X-REQUEST-ID)%",
                    "path": "%REQ(:PATH)%",
                    "status": "%RESPONSE_CODE%",
                    "lb": "%DYNAMIC_METADATA(envoy.lb)%",
                    "test": f"%DYNAMIC_METADATA({TEST_NAMESPACE})%",
                }}}}]
        ext_proc = next(f for f in hcm["http_filters"]
                        if f["name"] == "envoy.filters.http.ext_proc")
        ext_proc["typed_config"]["metadata_options"]["receiving_namespaces"]["untyped"] += \
            list(receive)
        if grpc_reply is not None:
            for cluster in doc["static_resources"]["clusters"]:
                if cluster["name"] == "original_destination_cluster":
                    cluster["typed_extension_protocol_options"] = {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http."
                                     "v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}}}}
        envoy = EnvoyProcess(binary=_envoy_wrapper(workdir))
        h = Stack(pods, addresses, epp, envoy, port, workdir, seen)
        self._stacks.append(h)
        await envoy.start(yaml.safe_dump(doc, sort_keys=False), workdir)
        await envoy.wait_ready()
        if pods:
            await self._synced(h)
        return h

    async def _synced(self, h: Stack) -> None:
        # Go: WaitForReadyPodsMetric, and its fake metrics client is set before the EPP
        # starts. Here: wait until the EPP's pool gauges show the scraped state.
        pods = h.pods
        async with aiohttp.ClientSession() as session:
            want_q = sum(p.queue for p in pods) / len(pods)
            want_kv = sum(p.kv for p in pods) / len(pods)

            async def synced() -> bool:
                text = await h.metrics(session)
                q = value(text, "inference_pool_average_queue_size")
                kv = value(text, "inference_pool_average_kv_cache_utilization")
                return (value(text, "inference_pool_ready_pods") == len(pods)
                        and q is not None and abs(q - want_q) < 1e-9
                        and kv is not None and abs(kv - want_kv) < 1e-9)
            await eventually(synced, what="the EPP to scrape the pods' metrics")
            # One more scrape round for the LoRA state (a fixed pause: the scrape
            # interval is 50 ms, and nothing observable says the adapters were read).
            await asyncio.sleep(0.2)

    async def _http_pod(self, idx: int, pod: Pod, reply: Reply | None, seen: list[Seen],
                        binds: Sequence[tuple[str, int]], metrics: bool) -> None:
        async def metrics_h(request: web.Request) -> web.Response:
            return web.Response(text=metrics_text(pod))

        async def handle(request: web.Request) -> web.StreamResponse:
            assert reply is not None
            seen.append(Seen(idx, request.method,
                             {k.lower(): v for k, v in request.headers.items()},
                             await request.read(), request.path))
            resp = web.StreamResponse(headers={"content-type": reply.content_type})
            await resp.prepare(request)
            for chunk in reply.chunks:
                if chunk:
                    await resp.write(chunk)
                    await asyncio.sleep(0.05)  # separate body frames at Envoy
            await resp.write_eof()
            return resp

        app = web.Application(client_max_size=8 << 20)
        if metrics:
            app.router.add_get("/metrics", metrics_h)
        if reply is not None:
            app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._runners.append(runner)
        for host, port in binds:
            await web.TCPSite(runner, host, port).start()

    async def _grpc_pod(self, idx: int, reply: GrpcReply, seen: list[Seen], ip: str,
                        port: int) -> None:
        def record(path: str, request: bytes, context: Any) -> None:
            md = {k: str(v) for k, v in context.invocation_metadata() or ()}
            seen.append(Seen(idx, "POST", md, request, path))

        async def generate(request: bytes, context: grpc.aio.ServicerContext[Any, Any]
                           ) -> AsyncIterator[bytes]:
            record(GENERATE, request, context)
            for message in reply.generate:
                yield message

        async def embed(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            record(EMBED, request, context)
            return reply.embed

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "vllm.grpc.engine.VllmEngine", {
                "Generate": grpc.unary_stream_rpc_method_handler(generate),
                "Embed": grpc.unary_unary_rpc_method_handler(embed)}),))
        server.add_insecure_port(f"{ip}:{port}")
        await server.start()
        self._servers.append(server)

    async def close(self) -> None:
        for h in self._stacks:
            await h.envoy.stop()
            await h.epp.stop()
        for server in self._servers:
            await server.stop(None)
        for runner in self._runners:
            await runner.cleanup()


@asynccontextmanager
async def stacks(tmp_path: Path) -> AsyncIterator[Stacks]:
    s = Stacks(tmp_path)
    try:
        yield s
    finally:
        await s.close()


# --- requests (Go's ReqLLM, ReqRaw, ReqHeaderOnly …) ------------------------------------


def llm_body(prompt: str, model: str) -> bytes:
    """Go's GenerateRequest body: json.Marshal of a map (keys sorted)."""
    return (b'{"max_tokens":100,"model":"%s","prompt":"%s","temperature":0}'
            % (model.encode(), prompt.encode()))


def llm_headers(model: str, target: str) -> dict[str, str]:
    """Go's generateHeaders: hi: mom, the request id, the objective, the model rewrite."""
    h = {"hi": "mom", "x-request-id": "test-request-id", "content-type": "application/json"}
    if model:
        h["x-gateway-inference-objective"] = model
    if target:
        h["x-gateway-model-name-rewrite"] = target
    return h


async def send(session: aiohttp.ClientSession, h: Stack, headers: dict[str, str],
               *chunks: bytes, method: str = "POST", path: str = "/v1/completions"
               ) -> tuple[int, dict[str, str], bytes]:
    data: Any = None
    if len(chunks) == 1:
        data = chunks[0]
    elif chunks:
        async def gen() -> AsyncIterator[bytes]:
            # Go's ReqRaw sends one body frame per chunk; over HTTP the client writes the
            # chunks separately (chunked encoding); Envoy may still coalesce them.
            for c in chunks:
                yield c
                await asyncio.sleep(0.05)
        data = gen()
    async with session.request(method, h.url + path, data=data, headers=headers) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


# --- expectations (Go's ExpectRouteTo, ExpectReject, metricReqTotal …) -----------------


async def expect_request_total(session: aiohttp.ClientSession, h: Stack, model: str,
                               target: str, priority: int = 0) -> None:
    """Go: metricReqTotal(model, target, prio(...)) — the request's InferenceObjective's
    priority; 0 without one (a stack started without ``objectives``: Go's NoCRD mode)."""
    want = [({"model_name": model, "priority": str(priority), "target_model_name": target},
             1.0)]

    async def ok() -> bool:
        return samples(await h.metrics(session),
                       "inference_objective_request_total") == want
    try:
        await eventually(ok, timeout=5)
    except (AssertionError, TimeoutError):
        got = samples(await h.metrics(session), "inference_objective_request_total")
        raise AssertionError(f"inference_objective_request_total: {got} != {want}") from None


def expect_ready_pods(text: str, n: int) -> None:
    # Go labels the gauge with the pool's name (vllm-qwen3-32b-pool); a static-endpoints
    # EPP has no pool (Go's standalone mode always has a selector and --pool-name): ours
    # labels it "static" (epp/server/wiring.py pool_label).
    assert samples(text, "inference_pool_ready_pods") == [({"name": "static"}, float(n))]


def expect_routed(h: Stack, idx: int, body: bytes) -> Seen:
    """Go: ExpectRouteTo(endpoint, target, prompt) — the destination header names pod
    ``idx``, the body mutation is ``body``, and hi/x-request-id are kept."""
    assert [s.idx for s in h.seen] == [idx], h.seen
    s = h.seen[0]
    assert s.headers["x-gateway-destination-endpoint"] == h.key(idx)
    assert s.body == body
    assert s.headers["hi"] == "mom"
    assert s.headers["x-request-id"] == "test-request-id"
    return s


async def expect_error(status: int, headers: dict[str, str], body: bytes, want: int) -> None:
    assert status == want, body[:300]
    # design.md §2: our immediate responses carry a JSON error body (Go: plain text,
    # "inference error: <Code> - <message>"; test_gie_hermetic.py
    # test_reject_body_text_matches_go).
    assert headers["content-type"] == "application/json"


def error_message(body: bytes) -> str:
    """The message of our JSON error body ({"error": {"message", "type", "code"}})."""
    doc = json.loads(body)
    message: str = doc["error"]["message"]
    return message


@asynccontextmanager
async def client_session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s

