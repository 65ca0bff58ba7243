"""The Director applies InferenceObjectives (priority) and InferenceModelRewrites (the body's
model) as GIE v1.5.0's Director does (pkg/epp/requestcontrol/director.go).

Cases translate GIE's director_test.go: ``TestDirector_HandleRequest`` (its objectives
ioFoodReview 2, imFoodReviewSheddable -1, imFoodReviewResolve 1 and the rewrite
"rewrite-rule") and ``TestDirector_ApplyWeightedModelRewrite``.
"""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from epp import keys
from epp.config.loader import load_and_build
from epp.datastore.objectives import (
    ModelRewrite,
    Objective,
    ObjectiveStore,
    RewriteRule,
    TargetModel,
)
from epp.datastore.store import Datastore
from epp.observability.metrics import EppMetrics
from epp.parsing.parsers import PassthroughParser
from epp.requestcontrol.director import (
    Director,
    SchedulingCore,
    apply_objectives,
    build_request,
)
from epp.scheduling.types import Endpoint

H = {":method": "POST", ":path": "/v1/completions", "x-request-id": "r1"}

MODEL = "food-review"
TO_BE_REWRITTEN = "food-review-to-be-rewritten"
REWRITTEN = "food-review-rewritten"


def gie_store() -> ObjectiveStore:
    """GIE's TestDirector_HandleRequest datastore."""
    store = ObjectiveStore()
    store.replace([Objective("ioFoodReview", 2), Objective("imFoodReviewSheddable", -1),
                   Objective("imFoodReviewResolve", 1)],
                  [ModelRewrite("rewrite-rule", (RewriteRule(
                      (TO_BE_REWRITTEN,), (TargetModel(REWRITTEN, 100),)),), 1000.0)])
    return store


def make(objectives: ObjectiveStore | None = None, parser: Any = None
         ) -> tuple[Director, SchedulingCore]:
    store = Datastore()
    store.set_endpoints([Endpoint("pod1", "192.168.1.100", 8000)])
    built = load_and_build()
    core = SchedulingCore(store, built.scheduler, EppMetrics(store), built.pre_request,
                          built.response_complete,
                          objectives=objectives if objectives is not None else gie_store())
    return Director(core, parser), core


def body(model: str, prompt: str = "p") -> bytes:
    return orjson.dumps({"model": model, "prompt": prompt})


def headers(objective: str | None = None, rewrite: str | None = None) -> dict[str, str]:
    h = dict(H)
    if objective is not None:
        h[keys.HEADER_OBJECTIVE] = objective
    if rewrite is not None:
        h[keys.HEADER_MODEL_REWRITE] = rewrite
    return h


def sample(core: SchedulingCore, name: str, **labels: str) -> float | None:
    return core.metrics.registry.get_sample_value(name, labels)


@pytest.mark.parametrize(("case", "model", "objective", "header_target", "want_target",
                          "want_priority"), [
    ("successful completions request", MODEL, "ioFoodReview", None, MODEL, 2),
    ("successful request with model rewrite", TO_BE_REWRITTEN, MODEL, None, REWRITTEN, 0),
    ("successful request with target model resolution", "food-review-resolve",
     "imFoodReviewResolve", "resolved-target-model-A", "resolved-target-model-A", 1),
    ("nonexistent target defined, use default inference model", "food-review-1",
     "food-review-1", None, "food-review-1", 0),
    ("sheddable objective", "food-review-sheddable", "imFoodReviewSheddable", None,
     "food-review-sheddable", -1),
    ("no objective header", MODEL, None, None, MODEL, 0),
], ids=lambda v: v if isinstance(v, str) and " " in v else "")
async def test_handle_request_gie_cases(case: str, model: str, objective: str | None,
                                        header_target: str | None, want_target: str,
                                        want_priority: int) -> None:
    d, core = make()
    seen: list[Any] = []
    decide = core.decide
    core.decide = lambda req, subset: (seen.append(req), decide(req, subset))[1]  # type: ignore[method-assign]
    r = await d.route(headers(objective, header_target), body(model), True, None)
    (request,) = seen
    assert request.target_model == want_target and request.incoming_model == model
    assert request.priority == want_priority
    # The body sent upstream: Go's wantMutatedBody.
    sent = orjson.loads(r.body) if r.body is not None else orjson.loads(body(model))
    assert sent == {"model": want_target, "prompt": "p"}
    assert sample(core, "inference_objective_request_total", model_name=model,
                  target_model_name=want_target, priority=str(want_priority)) == 1


async def test_rewrite_is_counted_with_gies_labels_and_sizes_the_new_body() -> None:
    d, core = make()
    r = await d.route(headers(MODEL), body(TO_BE_REWRITTEN), True, None)
    assert r.body == body(REWRITTEN)
    assert sample(core, "inference_extension_model_rewrite_decisions_total",
                  model_rewrite_name="rewrite-rule", model_name=TO_BE_REWRITTEN,
                  target_model=REWRITTEN) == 1
    assert sample(core, "inference_objective_request_sizes_sum", model_name=TO_BE_REWRITTEN,
                  target_model_name=REWRITTEN) == len(body(REWRITTEN))
    # No rule for this model: no rewrite decision counted.
    await d.route(headers(MODEL), body(MODEL), True, None)
    total = sum(s.value for m in core.metrics.registry.collect()
                if m.name == "inference_extension_model_rewrite_decisions"
                for s in m.samples if s.name.endswith("_total"))
    assert total == 1


async def test_the_response_model_is_rewritten_back() -> None:
    d, _ = make()
    r = await d.route(headers(), body(TO_BE_REWRITTEN), True, None)
    d.on_response_headers(r.context, 200, {"content-type": "application/json"})
    out = d.on_response_body(r.context, b'{"model":"food-review-rewritten","x":1}', True)
    assert out == b'{"model":"food-review-to-be-rewritten","x":1}'
    d.on_done(r.context, aborted=False)


async def test_a_rule_wins_over_the_rewrite_header() -> None:
    """GIE: the header sets TargetModelName first, applyWeightedModelRewrite then replaces
    it when a rule matches the body's model."""
    d, core = make()
    r = await d.route(headers(rewrite="from-header"), body(TO_BE_REWRITTEN), True, None)
    assert orjson.loads(r.body or b"")["model"] == REWRITTEN
    assert sample(core, "inference_extension_model_rewrite_decisions_total",
                  model_rewrite_name="rewrite-rule", model_name=TO_BE_REWRITTEN,
                  target_model=REWRITTEN) == 1


# GIE's TestDirector_ApplyWeightedModelRewrite objects.
def _rw(name: str, created: float, model: str, *targets: tuple[str, int]) -> ModelRewrite:
    return ModelRewrite(name, (RewriteRule((model,), tuple(TargetModel(*t) for t in targets)),),
                        created)


REWRITE_OLD = _rw("rewrite-old", 1000, "model-a", ("model-a-old-tuned", 100))
REWRITE_NEW = _rw("rewrite-new", 2000, "model-a", ("model-a-new-tuned", 100))
REWRITE_B = _rw("rewrite-b", 1500, "model-b", ("model-b-tuned", 100))
REWRITE_WEIGHTED = _rw("rewrite-weighted", 1200, "model-c", ("model-c-v1", 70),
                       ("model-c-v2", 30))


@pytest.mark.parametrize(("rewrites", "incoming", "initial", "expected"), [
    ([], "model-x", None, {"model-x"}),
    ([REWRITE_B], "model-b", None, {"model-b-tuned"}),
    ([REWRITE_B], "model-x", None, {"model-x"}),
    ([REWRITE_NEW, REWRITE_OLD], "model-a", None, {"model-a-old-tuned"}),
    ([REWRITE_WEIGHTED], "model-c", None, {"model-c-v1", "model-c-v2"}),
    ([REWRITE_B], "model-x", "pre-existing-target", {"pre-existing-target"}),
], ids=["no rewrites", "single matching rewrite", "no matching rewrite",
        "oldest rewrite wins for duplicate model", "weighted rewrite applied",
        "initial TargetModelName is respected if no rewrite matches"])
def test_apply_weighted_model_rewrite(rewrites: list[ModelRewrite], incoming: str,
                                      initial: str | None, expected: set[str]) -> None:
    store = ObjectiveStore(rng=random.Random(3))
    store.replace_rewrites(rewrites)
    h = headers(rewrite=initial)
    seen = set()
    for _ in range(50):
        request, parsed = build_request(h, body(incoming), True)
        apply_objectives(request, parsed, store)
        seen.add(request.target_model)
    assert seen == expected


async def test_bodies_the_parser_does_not_decode_are_not_rewritten() -> None:
    """GIE rewrites map payloads only; the passthrough parser's bodies go as they are.
    The objective's priority still applies."""
    d, core = make(parser=PassthroughParser())
    seen: list[Any] = []
    decide = core.decide
    core.decide = lambda req, subset: (seen.append(req), decide(req, subset))[1]  # type: ignore[method-assign]
    r = await d.route(headers("ioFoodReview", rewrite="t"), body(TO_BE_REWRITTEN), True, None)
    assert r.body is None
    assert seen[0].priority == 2 and seen[0].model_rewrite is None
    assert seen[0].target_model == "t"


async def test_requests_without_body_get_their_priority() -> None:
    d, core = make()
    seen: list[Any] = []
    decide = core.decide
    core.decide = lambda req, subset: (seen.append(req), decide(req, subset))[1]  # type: ignore[method-assign]
    get = {**headers("imFoodReviewResolve"), ":method": "GET", ":path": "/v1/models"}
    await d.route(get, b"", False, None)
    assert seen[0].priority == 1 and seen[0].model_rewrite is None


async def test_store_changes_apply_to_the_next_request() -> None:
    objectives = ObjectiveStore()
    d, core = make(objectives)
    r = await d.route(headers("live"), body("m"), True, None)
    assert r.body is None
    objectives.set_objective(Objective("live", 7))
    objectives.set_rewrite(_rw("rw", 0, "m", ("m2", 1)))
    r = await d.route(headers("live"), body("m"), True, None)
    assert orjson.loads(r.body or b"")["model"] == "m2"
    assert sample(core, "inference_objective_request_total", model_name="m",
                  target_model_name="m2", priority="7") == 1


async def test_a_director_without_objectives() -> None:
    """A Director over a core without a store: GIE's defaults."""
    _, core = make()
    plain = Director(core.__class__(core.store, core.scheduler, core.metrics))
    assert plain.objectives is None
    r = await plain.route(headers("ioFoodReview"), body(TO_BE_REWRITTEN), True, None)
    assert r.body is None
    assert sample(core, "inference_objective_request_total", model_name=TO_BE_REWRITTEN,
                  target_model_name=TO_BE_REWRITTEN, priority="0") == 1
