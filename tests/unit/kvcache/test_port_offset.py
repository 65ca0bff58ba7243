"""``podDiscoveryConfig.endpointPortOffset`` (this project's rule for single-host pools)
and the stack helper that starts simulators publishing on the matching ports."""

from __future__ import annotations

import pytest

from epp.errors import ConfigError
from epp.framework.interfaces import EVENT_ADD_OR_UPDATE
from epp.framework.params import decode_params
from epp.scheduling.plugins.precise_prefix import (
    PodDiscoveryParameters,
    PrecisePrefixCacheProducer,
    PrecisePrefixParameters,
)
from epp.scheduling.types import Endpoint
from epp.sim.options import build_parser, kv_events_from_args
from epp.stack.procs import kv_events_port_offset, sim_kv_events_args


def _params(pd: dict[str, object]) -> PrecisePrefixParameters:
    return decode_params(PrecisePrefixParameters,
                         {"kvEventsConfig": {"podDiscoveryConfig": pd}}, "p")


def test_default_is_llm_ds_rule() -> None:
    pd = PodDiscoveryParameters()
    assert pd.addresses("10.0.0.1", 8000) == ("tcp://10.0.0.1:5557", None)
    pd = _params({"socketPort": 6000, "replaySocketPort": 6001}).kv_events.pod_discovery
    assert pd.addresses("10.0.0.1", 8000) == ("tcp://10.0.0.1:6000", "tcp://10.0.0.1:6001")


def test_offset_follows_the_endpoint_port() -> None:
    pd = _params({"endpointPortOffset": 1000}).kv_events.pod_discovery
    assert pd.addresses("127.0.0.1", 8000) == ("tcp://127.0.0.1:9000", None)
    assert pd.addresses("127.0.0.1", 8001) == ("tcp://127.0.0.1:9001", None)
    pd = _params({"endpointPortOffset": -500, "socketPort": 5557,
                  "replaySocketPort": 5567}).kv_events.pod_discovery
    assert pd.addresses("::1", 8000) == ("tcp://[::1]:7500", "tcp://[::1]:7510")


def test_offset_out_of_range() -> None:
    pd = _params({"endpointPortOffset": 60000}).kv_events.pod_discovery
    with pytest.raises(ValueError, match="outside 1-65535"):
        pd.addresses("127.0.0.1", 8000)
    with pytest.raises(ConfigError, match="endpointPortOffset"):
        _params({"endpointPortOffset": "x"})


def test_producer_dials_the_offset_port() -> None:
    prod = PrecisePrefixCacheProducer("p", _params({"endpointPortOffset": 7}))
    prod.extract_endpoint(EVENT_ADD_OR_UPDATE, Endpoint("a", "127.0.0.1", 8000))
    prod.extract_endpoint(EVENT_ADD_OR_UPDATE, Endpoint("b", "127.0.0.1", 70000 - 7 - 1))
    assert prod._wanted == {"127.0.0.1:8000": ("tcp://127.0.0.1:8007", None)}
    assert "<port+7>" in prod.config_summary()


def test_sim_args_match_the_offset() -> None:
    ports = [20001, 20002, 20003]
    args, offset = sim_kv_events_args(ports)
    assert offset != 0 and all(p + offset not in ports for p in ports)
    ns = build_parser().parse_args(["--port", "20001", *args])
    assert kv_events_from_args(ns).enabled and ns.kv_events_port_offset == offset
    assert kv_events_port_offset([]) != 0
