"""Director: parsing → snapshot (subset) → scheduler → routing; response lifecycle."""

from __future__ import annotations

import orjson
import pytest

from epp.config.loader import load_and_build
from epp.datastore.store import Datastore
from epp.errors import BadRequest, ServiceUnavailable
from epp.observability.metrics import EppMetrics
from epp.requestcontrol.director import Director, SchedulingCore
from epp.scheduling.types import Endpoint, Metrics


def make_director(n: int = 3) -> tuple[Director, Datastore]:
    store = Datastore()
    store.set_endpoints(Endpoint(f"p{i}", f"10.0.0.{i}", 8000) for i in range(1, n + 1))
    built = load_and_build()
    return Director(SchedulingCore(store, built.scheduler, EppMetrics(store), built.pre_request,
                                   built.response_complete)), store


H = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r1"}
CHAT = orjson.dumps({"model": "llama", "messages": [{"role": "user", "content": "hi"}]})


def sample(d: Director, name: str) -> float:
    v = d.core.core.metrics.registry.get_sample_value(name, {"model_name": "llama", "target_model_name": "llama"})
    return v or 0.0


async def test_routes_to_least_loaded_endpoint() -> None:
    d, store = make_director()
    store.update_metrics("10.0.0.1:8000", Metrics(waiting_queue_size=5, kv_cache_usage=0.9))
    store.update_metrics("10.0.0.2:8000", Metrics(waiting_queue_size=0, kv_cache_usage=0.1))
    store.update_metrics("10.0.0.3:8000", Metrics(waiting_queue_size=3, kv_cache_usage=0.5))
    r = await d.route(H, CHAT, True, None)
    assert r.destination == "10.0.0.2:8000"
    assert r.body is None
    assert "x-request-id" not in r.set_headers
    # GIE's priority label: "0" without an InferenceObjective.
    assert d.core.core.metrics.registry.get_sample_value(  # type: ignore[attr-defined]
        "inference_objective_request_total",
        {"model_name": "llama", "target_model_name": "llama", "priority": "0"}) == 1


async def test_subset_hint_narrows_candidates() -> None:
    d, _ = make_director()
    for _ in range(10):
        r = await d.route(H, CHAT, True, ["10.0.0.3:8000", "10.9.9.9:1"])
        assert r.destination == "10.0.0.3:8000"


async def test_empty_subset_and_empty_pool_are_503() -> None:
    d, store = make_director()
    with pytest.raises(ServiceUnavailable) as e:
        await d.route(H, CHAT, True, [])
    assert e.value.status == 503
    store.set_endpoints([])
    with pytest.raises(ServiceUnavailable, match="no ready endpoints"):
        await d.route(H, CHAT, True, None)
    v = d.core.core.metrics.registry.get_sample_value(
        "inference_objective_request_error_total",
        {"model_name": "llama", "target_model_name": "llama",
         "error_code": "ServiceUnavailable"})
    assert v == 2


async def test_bad_body_is_400() -> None:
    d, _ = make_director()
    with pytest.raises(BadRequest):
        await d.route(H, b"not json", True, None)


async def test_header_only_request_is_routed_and_gets_request_id() -> None:
    d, _ = make_director()
    r = await d.route({":method": "GET", ":path": "/v1/models"}, b"", False, None)
    assert r.destination.startswith("10.0.0.")
    assert len(r.set_headers["x-request-id"]) == 32


async def test_model_rewrite_and_rewrite_back() -> None:
    d, _ = make_director()
    r = await d.route({**H, "x-gateway-model-name-rewrite": "llama-v2"}, CHAT, True, None)
    assert r.body is not None and orjson.loads(r.body)["model"] == "llama-v2"
    d.on_response_headers(r.context, 200, {"content-type": "application/json"})
    out = d.on_response_body(r.context, b'{"id":"x","model":"llama-v2","usage":{}}', True)
    assert out == b'{"id":"x","model":"llama","usage":{}}'


async def test_usage_recorded_and_running_requests_balanced() -> None:
    d, _ = make_director()
    r = await d.route(H, CHAT, True, None)
    running = d.core.core.metrics.registry.get_sample_value("inference_objective_running_requests",
                                                  {"model_name": "llama"})
    assert running == 1
    d.on_response_headers(r.context, 200, {"content-type": "application/json"})
    body = orjson.dumps({"usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                   "prompt_tokens_details": {"cached_tokens": 4}}})
    assert d.on_response_body(r.context, body, True) is None
    d.on_done(r.context, aborted=False)
    assert d.core.core.metrics.registry.get_sample_value("inference_objective_running_requests",
                                               {"model_name": "llama"}) == 0
    assert sample(d, "inference_objective_input_tokens_sum") == 7
    assert sample(d, "inference_objective_output_tokens_sum") == 3
    assert sample(d, "inference_objective_prompt_cached_tokens_sum") == 4
    assert sample(d, "inference_objective_request_duration_seconds_count") == 1


async def test_session_affinity_token_round_trip() -> None:
    from pathlib import Path

    store = Datastore()
    store.set_endpoints(Endpoint(f"p{i}", f"10.0.0.{i}", 8000, namespace="ns")
                        for i in range(1, 5))
    built = load_and_build(str(Path(__file__).resolve().parents[3] / "config" / "session.yaml"))
    d = Director(SchedulingCore(store, built.scheduler, EppMetrics(store), built.pre_request,
                                built.response_complete, built.request_headers,
                                built.response_headers))
    r = await d.route(H, CHAT, True, None)
    extra = d.on_response_headers(r.context, 200, {"content-type": "application/json"})
    assert extra is not None and "x-session-token" in extra
    token = extra["x-session-token"]
    for _ in range(10):
        r2 = await d.route({**H, "x-session-token": token}, CHAT, True, None)
        assert r2.destination == r.destination


def _running(d: Director) -> float:
    v = d.core.core.metrics.registry.get_sample_value(  # type: ignore[attr-defined]
        "inference_objective_running_requests", {"model_name": "llama"})
    return v or 0.0


@pytest.mark.parametrize("depth", [100, 300, 1000])
async def test_deeply_nested_body_with_model_rewrite_is_routed(depth: int) -> None:
    """orjson serialises only 254 levels (it parses 1,024): the rewrite must not fail after
    the request is counted (it used to: 500 and a running request never completed)."""
    d, _ = make_director()
    body = (b'{"model":"llama","messages":[{"role":"user","content":"hi"}],"x":'
            + b"[" * depth + b"]" * depth + b"}")
    r = await d.route({**H, "x-gateway-model-name-rewrite": "llama-v2"}, body, True, None)
    assert r.body is not None
    out = orjson.loads(r.body)
    assert out["model"] == "llama-v2"
    assert r.body.endswith(b"[" * depth + b"]" * depth + b"}")
    assert _running(d) == 1
    d.on_done(r.context, aborted=True)
    assert _running(d) == 0


async def test_failing_plugins_after_the_decision_do_not_leak_it() -> None:
    d, _ = make_director()
    core = d.core.core  # type: ignore[attr-defined]

    class Boom:
        name = "boom"

        def pre_request(self, request: object, result: object) -> None:
            raise RuntimeError("pre_request bug")

        def request_headers(self, request: object, result: object) -> dict[str, str]:
            raise RuntimeError("request_headers bug")

    core.pre_request = (*core.pre_request, Boom())
    core.request_headers = (*core.request_headers, Boom())
    r = await d.route(H, CHAT, True, None)
    assert r.destination and _running(d) == 1
    d.on_done(r.context, aborted=True)
    assert _running(d) == 0


async def test_upstream_failure_is_counted_per_pod_and_handed_to_the_hook() -> None:
    d, _ = make_director()
    core = d.core.core  # type: ignore[attr-defined]
    seen: list[str] = []
    core.on_upstream_failure = seen.append
    r = await d.route(H, CHAT, True, None)
    d.on_upstream_failure(r.context, "10.0.0.2:8000")
    assert seen == ["10.0.0.2:8000"]
    assert core.metrics.registry.get_sample_value(
        "epp_gateway_upstream_connect_failures_total", {"model_server_pod": "p2"}) == 1


async def test_subset_of_unreachable_endpoints_fails_open_within_the_hint() -> None:
    d, store = make_director()
    store.update_metrics("10.0.0.2:8000", Metrics(unreachable=True))
    r = await d.route(H, CHAT, True, ["10.0.0.2:8000"])
    assert r.destination == "10.0.0.2:8000"
    # Without a hint the unreachable endpoint is not a candidate.
    for _ in range(10):
        r = await d.route(H, CHAT, True, None)
        assert r.destination != "10.0.0.2:8000"


# ------------------------------------------------ decision observers: explain, P/D metric


def _core(config: str | None = None, roles: list[str] | None = None,
          **kwargs: object) -> SchedulingCore:
    from pathlib import Path

    store = Datastore()
    roles = roles or ["decode", "decode", "prefill"]
    store.set_endpoints(Endpoint(f"p{i}", f"10.0.0.{i}", 8000,
                                 labels={"llm-d.ai/role": role})
                        for i, role in enumerate(roles, 1))
    path = None if config is None else str(
        Path(__file__).resolve().parents[3] / "config" / config)
    built = load_and_build(path)
    return SchedulingCore(store, built.scheduler, EppMetrics(store), built.pre_request,
                          built.response_complete, built.request_headers,
                          built.response_headers, **kwargs)  # type: ignore[arg-type]


LONG = orjson.dumps({"model": "llama",
                     "messages": [{"role": "user", "content": "tell me more " * 400}]})


async def test_explain_history_keeps_placed_and_unplaceable_requests() -> None:
    from epp.errors import NoCapacity
    from epp.observability.explain import DecisionLog

    history = DecisionLog(10)
    core = _core("pd.yaml", decisions=history)
    d = Director(core)
    r = await d.route(H, LONG, True, None)
    (rec,) = history.last()
    assert rec["destination"] == r.destination and rec["primary_profile"] == "decode"
    assert rec["request_id"] == "r1" and rec["candidates"] == 3
    decode = rec["profiles"]["decode"]
    assert decode["dropped"] == {"10.0.0.3:8000": "filter decode-filter (decode-filter)"}
    assert set(decode["scores"]) == {"queue-scorer", "kv-cache-utilization-scorer",
                                     "prefix-cache-scorer"}
    assert decode["picked"] == [r.destination] and decode["picker"] == "max-score-picker"
    # The P/D handler ran the prefill profile too; its pick is named upstream.
    assert rec["profiles"]["prefill"]["picked"] == ["10.0.0.3:8000"]
    assert rec["headers"]["x-prefiller-host-port"] == "10.0.0.3:8000"
    # The client did not ask for the record.
    assert "x-epp-explain" not in r.context.response_headers
    # Every profile filtered to nothing: 429, recorded with the error.
    with pytest.raises(NoCapacity):
        await d.route(H, LONG, True, ["10.0.0.3:8000"])
    rec = history.last(1)[0]
    assert rec["error"]["status"] == 429
    assert rec["profiles"]["decode"]["result"] == "no endpoint left after filters"
    assert "destination" not in rec
    # No candidates at all: 503 before scheduling, nothing to explain.
    with pytest.raises(ServiceUnavailable):
        await d.route(H, LONG, True, [])
    assert len(history.last()) == 2


async def test_explain_header_needs_the_flag_and_the_request_header() -> None:
    d = Director(_core(explain_header=True))
    r = await d.route(H, CHAT, True, None)
    assert "x-epp-explain" not in r.context.response_headers
    r = await d.route({**H, "x-epp-explain": "true"}, CHAT, True, None)
    rec = orjson.loads(r.context.response_headers["x-epp-explain"])
    assert rec["destination"] == r.destination and "default" in rec["profiles"]
    d = Director(_core())
    r = await d.route({**H, "x-epp-explain": "true"}, CHAT, True, None)
    assert "x-epp-explain" not in r.context.response_headers


async def test_explain_history_does_not_send_the_record_to_clients() -> None:
    """--explain-history without --enable-explain-header: the record is kept for the
    admin endpoint, and a client asking for it with the header still does not get it."""
    from epp.observability.explain import DecisionLog

    history = DecisionLog(10)
    d = Director(_core(decisions=history))
    r = await d.route({**H, "x-epp-explain": "true"}, CHAT, True, None)
    assert "x-epp-explain" not in r.context.response_headers
    assert history.last()[0]["destination"] == r.destination
    d = Director(_core(decisions=history, explain_header=True))
    r = await d.route({**H, "x-epp-explain": "true"}, CHAT, True, None)
    assert orjson.loads(r.context.response_headers["x-epp-explain"])["destination"] \
        == r.destination


async def test_a_plugin_crash_is_500_counted_and_not_recorded() -> None:
    from epp.errors import EppError
    from epp.observability.explain import DecisionLog

    history = DecisionLog(10)
    core = _core(decisions=history)

    def boom(*args: object) -> None:
        raise RuntimeError("plugin bug")

    core.scheduler.handler.pick = boom  # type: ignore[method-assign,assignment]
    with pytest.raises(EppError) as e:
        await Director(core).route(H, CHAT, True, None)
    assert e.value.status == 500
    assert core.metrics.registry.get_sample_value(
        "inference_objective_request_error_total",
        {"model_name": "llama", "target_model_name": "llama", "error_code": "Internal"}) == 1
    assert history.last() == []


async def test_pd_decisions_are_counted_only_for_a_classifying_handler() -> None:
    core = _core("pd.yaml")
    d = Director(core)
    await d.route(H, LONG, True, None)
    await d.route(H, CHAT, True, None)
    reg = core.metrics.registry
    assert reg.get_sample_value("epp_pd_decisions_total",
                                {"decision_type": "disaggregated"}) == 1
    assert reg.get_sample_value("epp_pd_decisions_total",
                                {"decision_type": "decode-only"}) == 1
    core = _core()
    await Director(core).route(H, CHAT, True, None)
    assert not [s for m in core.metrics.registry.collect() for s in m.samples
                if s.name == "epp_pd_decisions_total"]
