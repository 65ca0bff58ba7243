"""llm-d's deprecated ``by-label`` filter (llm-d-router v0.10.0 filter/bylabel/filter.go
and filter_test.go's cases)."""

from __future__ import annotations

from typing import Any

import pytest

from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.filters import ByLabelFilter
from epp.scheduling.types import ApiType, CycleState, Endpoint, LLMRequest

REQ = LLMRequest(request_id="r", target_model="m", incoming_model="m",
                 api=ApiType.CHAT_COMPLETIONS, prompt="p", headers={})
EPS = [Endpoint(name="p", address="10.0.0.1", port=8000, labels={"role": "prefill"}),
       Endpoint(name="d", address="10.0.0.2", port=8000, labels={"role": "decode"}),
       Endpoint(name="b", address="10.0.0.3", port=8000, labels={"role": "both"}),
       Endpoint(name="n", address="10.0.0.4", port=8000, labels={})]


def build(params: dict[str, Any] | None) -> ByLabelFilter:
    f = default_registry().builder("by-label", "t")("f", params, "plugins[0].parameters",
                                                    PluginHandle())
    assert isinstance(f, ByLabelFilter)
    return f


def names(params: dict[str, Any]) -> list[str]:
    return [e.name for e in build(params).filter(CycleState(), REQ, EPS)]


def test_valid_values_and_no_label() -> None:
    assert names({"label": "role", "validValues": ["decode", "both"]}) == ["d", "b"]
    assert names({"label": "role", "validValues": ["prefill"], "allowsNoLabel": True}) == [
        "p", "n"]
    assert names({"label": "role", "allowsNoLabel": True}) == ["n"]
    assert names({"label": "other", "validValues": ["x"]}) == []


@pytest.mark.parametrize(("params", "message"), [
    ({}, "'label' must be specified"),
    ({"label": "role"}, "either 'validValues' must be non-empty or 'allowsNoLabel'"),
    ({"label": "role", "validValues": [1]}, "list of strings"),
])
def test_bad_parameters(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(params)
