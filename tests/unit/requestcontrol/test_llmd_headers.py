"""llm-d-router v0.10.0's renamed request headers (pkg/epp/metadata/consts.go): the new
``x-llm-d-*`` name is read first, GIE's name is its deprecated alias."""

from __future__ import annotations

import orjson

from epp import keys
from epp.latency.types import parse_slo_header
from epp.requestcontrol.director import build_request

BODY = orjson.dumps({"model": "m", "prompt": "hi"})
BASE = {":path": "/v1/completions", ":method": "POST"}


def test_llmd_names_are_read() -> None:
    req, _ = build_request({**BASE, "x-llm-d-inference-objective": "gold",
                            "x-llm-d-inference-fairness-id": "tenant-a",
                            "x-llm-d-model-name-rewrite": "m2"}, BODY, True)
    assert (req.objective, req.fairness_id, req.target_model) == ("gold", "tenant-a", "m2")
    assert req.incoming_model == "m"


def test_gie_names_still_work_and_the_new_name_wins() -> None:
    req, _ = build_request({**BASE, "x-gateway-inference-objective": "old",
                            "x-gateway-inference-fairness-id": "t"}, BODY, True)
    assert (req.objective, req.fairness_id) == ("old", "t")
    both = {**BASE, "x-gateway-inference-objective": "old",
            "x-llm-d-inference-objective": "new"}
    assert build_request(both, BODY, True)[0].objective == "new"


def test_slo_headers() -> None:
    assert parse_slo_header({"x-llm-d-slo-ttft-ms": "250"}, keys.HEADER_SLO_TTFT_MS) == 250
    assert parse_slo_header({"x-slo-tpot-ms": "20"}, keys.HEADER_SLO_TPOT_MS) == 20
    assert parse_slo_header({"x-llm-d-slo-tpot-ms": "5", "x-slo-tpot-ms": "20"},
                            keys.HEADER_SLO_TPOT_MS) == 5
