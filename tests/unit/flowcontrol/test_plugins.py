"""The flow-control policy plugins, case by case as GIE v1.5.0's tests check them
(pkg/epp/framework/plugins/flowcontrol/{fairness,ordering,usagelimits}/*_test.go), and
their construction through this project's plugin framework."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from epp.errors import ConfigError
from epp.flowcontrol.interfaces import (
    CAPABILITY_PRIORITY_CONFIGURABLE,
    FairnessPolicy,
    OrderingPolicy,
    UsageLimitPolicy,
)
from epp.flowcontrol.plugins import (
    FLOW_CONTROL_PLUGINS,
    EDFOrderingPolicy,
    FCFSOrderingPolicy,
    GlobalStrictFairnessPolicy,
    RoundRobinFairnessPolicy,
    SLODeadlineOrderingPolicy,
    StaticUsageLimitPolicy,
    edf_deadline,
    slo_deadline,
)
from epp.flowcontrol.types import FlowControlRequest, FlowKey
from epp.framework.handle import PluginHandle
from epp.framework.params import decoding
from epp.framework.registry import Registry


def registry() -> Registry:
    reg = Registry()
    for cls in FLOW_CONTROL_PLUGINS:
        reg.register_class(cls)
    return reg


def make(type_name: str, params: dict[str, Any] | None = None, name: str = "x") -> Any:
    return registry().builder(type_name, "t")(name, params, "plugins[0].parameters",
                                              PluginHandle())


class Item:
    """A QueueItemView."""

    def __init__(self, enqueue_time: float = 0.0, ttl: float = 0.0,
                 received: float | None = None, headers: dict[str, str] | None = None) -> None:
        self.request = FlowControlRequest(received_at=received, headers=headers or {})
        self.enqueue_time = enqueue_time
        self.effective_ttl = ttl


class Queue:
    """A FlowQueueView over a list (head first)."""

    def __init__(self, flow_id: str, items: Sequence[Item] = (),
                 ordering: OrderingPolicy | None = None) -> None:
        self.key = FlowKey(flow_id, 0)
        self.items = list(items)
        self.ordering_policy: OrderingPolicy = ordering or FCFSOrderingPolicy()
        self.byte_size = 0

    def __len__(self) -> int:
        return len(self.items)

    def peek_head(self) -> Item | None:
        return self.items[0] if self.items else None


class Band:
    """A PriorityBandView over queues."""

    def __init__(self, queues: Sequence[Queue], state: Any = None) -> None:
        self.priority = 0
        self.policy_state = state
        self.queues = {q.key.id: q for q in queues}

    def flow_ids(self) -> Sequence[str]:
        return sorted(self.queues)

    def queue(self, flow_id: str) -> Queue | None:
        return self.queues.get(flow_id)

    def active_ids(self) -> Sequence[str]:
        return [i for i in sorted(self.queues) if len(self.queues[i])]

    def active_queues(self) -> Iterator[Queue]:
        return (self.queues[i] for i in self.active_ids())


# ================================================================ registration


def test_type_names_and_protocols() -> None:
    assert registry().types == [
        "edf-ordering-policy", "fcfs-ordering-policy", "global-strict-fairness-policy",
        "round-robin-fairness-policy", "slo-deadline-ordering-policy",
        "static-usage-limit-policy"]
    assert isinstance(make("global-strict-fairness-policy"), FairnessPolicy)
    assert isinstance(make("round-robin-fairness-policy"), FairnessPolicy)
    for t in ("fcfs-ordering-policy", "edf-ordering-policy", "slo-deadline-ordering-policy"):
        p = make(t, name="custom")
        assert isinstance(p, OrderingPolicy) and not isinstance(p, FairnessPolicy)
        assert (p.type_name, p.name) == (t, "custom")
    assert isinstance(make("static-usage-limit-policy"), UsageLimitPolicy)


def test_required_queue_capabilities() -> None:
    """GIE: FCFS works on any queue; EDF and SLO-deadline need a priority-configurable one."""
    assert FCFSOrderingPolicy().required_queue_capabilities == frozenset()
    assert EDFOrderingPolicy().required_queue_capabilities == {CAPABILITY_PRIORITY_CONFIGURABLE}
    assert SLODeadlineOrderingPolicy().required_queue_capabilities == {
        CAPABILITY_PRIORITY_CONFIGURABLE}


def test_static_usage_limit_parameters() -> None:
    assert make("static-usage-limit-policy").threshold == 1.0  # GIE: no gating
    p = make("static-usage-limit-policy", {"threshold": 0.8})
    assert p.compute_limit(0.5, [10, 0, -1]) == [0.8, 0.8, 0.8]
    assert p.compute_limit(0.5, []) == []
    assert StaticUsageLimitPolicy(threshold=0.0).compute_limit(0.0, [1]) == [0.0]
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.threshold: must be "
                                          r">= 0\.0, got -1"):
        make("static-usage-limit-policy", {"threshold": -1})
    with pytest.raises(ConfigError, match=r"threshold: expected a number, got 'high'"):
        make("static-usage-limit-policy", {"threshold": "high"})


def test_parameterless_policies_report_unknown_parameters() -> None:
    """GIE's factories ignore their parameters; here an unknown key is a warning, or an
    error in strict mode, as for every plugin of this EPP."""
    with decoding(strict=False) as policy:
        make("round-robin-fairness-policy", {"x": 1})
    assert any("parameters.x: unknown parameter" in w for w in policy.warnings)
    with decoding(strict=True), pytest.raises(ConfigError, match="unknown parameter"):
        make("edf-ordering-policy", {"x": 1})


# ================================================================ ordering (Less)


def test_fcfs_less() -> None:
    """fcfs_test.go: earlier logical enqueue time first."""
    p = FCFSOrderingPolicy()
    a, b = Item(enqueue_time=1.0), Item(enqueue_time=2.0)
    assert p.less(a, b) and not p.less(b, a) and not p.less(a, a)
    assert p.sort_key(a) < p.sort_key(b)


def test_edf_less() -> None:
    """edf_test.go's cases."""
    p = EDFOrderingPolicy()
    now = 1000.0
    item_a = Item(enqueue_time=now, ttl=10)               # deadline now+10
    item_b = Item(enqueue_time=now + 1, ttl=5)            # now+6: later enqueue, earlier deadline
    item_c = Item(enqueue_time=now - 5, ttl=-1)           # no deadline
    item_d = Item(enqueue_time=now - 1, ttl=7)            # now+6: same as B, enqueued earlier
    item_e = Item(enqueue_time=now - 10, ttl=0)           # no deadline, earlier than C
    cases = [
        (item_b, item_a, True), (item_a, item_b, False),
        (item_a, item_c, True), (item_c, item_a, False),
        (item_d, item_b, True), (item_b, item_d, False),
        (item_e, item_c, True), (item_c, item_e, False),
    ]
    for a, b, expected in cases:
        assert p.less(a, b) is expected
        assert (p.sort_key(a) < p.sort_key(b)) is expected
    assert edf_deadline(item_c) == math.inf and edf_deadline(item_a) == now + 10


def test_slo_deadline_less() -> None:
    """slo_deadline_test.go's cases: received + x-slo-ttft-ms, missing header last,
    ties by received time."""
    p = SLODeadlineOrderingPolicy()
    now = 1000.0
    a = Item(received=now, headers={"x-slo-ttft-ms": "100"})
    b = Item(received=now, headers={"x-slo-ttft-ms": "50"})
    c = Item(received=now + 0.020, headers={"x-slo-ttft-ms": "50"})
    d = Item(received=now, headers={})
    e = Item(received=now - 1, headers={"x-slo-ttft-ms": "1050"})
    cases = [(b, a, True), (a, b, False), (c, a, True), (a, d, True), (d, a, False),
             (e, b, True), (b, e, False)]
    for x, y, expected in cases:
        assert p.less(x, y) is expected
        assert (p.sort_key(x) < p.sort_key(y)) is expected


@pytest.mark.parametrize(("header", "expected"), [
    ("250", 1000.25), (" 250 ", 1000.25), ("+250", 1000.25), ("0", 1000.0),
    (None, math.inf), ("", math.inf), ("abc", math.inf), ("-5", math.inf), ("1.5", math.inf),
    ("٣", math.inf),  # a non-ASCII digit: Go's ParseInt refuses it
])
def test_slo_deadline_header_parsing(header: str | None, expected: float) -> None:
    """calculateSLODeadline: ParseInt of the trimmed header; missing, empty, invalid or
    negative → far future."""
    headers = {} if header is None else {"x-slo-ttft-ms": header}
    assert slo_deadline(Item(received=1000.0, headers=headers)) == expected


def test_slo_deadline_without_received_time_counts_from_enqueue() -> None:
    item = Item(enqueue_time=5.0, headers={"x-slo-ttft-ms": "1000"})
    assert slo_deadline(item) == 6.0


# ================================================================ fairness


def test_global_strict_picks_the_best_head_across_flows() -> None:
    """besthead_test.go: BasicSelection_TwoQueues, IgnoresEmptyQueues,
    SingleNonEmptyQueue, AllQueuesEmpty."""
    p = GlobalStrictFairnessPolicy()
    q1 = Queue("flow1", [Item(enqueue_time=2.0)])
    q2 = Queue("flow2", [Item(enqueue_time=1.0)])
    empty = Queue("empty")
    assert p.pick(Band([q1, q2])) is q2
    assert p.pick(Band([q1, empty, q2])) is q2
    assert p.pick(Band([empty, q1])) is q1
    assert p.pick(Band([empty])) is None
    assert p.pick(Band([])) is None
    policy: FairnessPolicy = p
    assert policy.new_state() is None


def test_global_strict_uses_the_flows_ordering_policy() -> None:
    edf = EDFOrderingPolicy()
    late_deadline = Queue("a", [Item(enqueue_time=0.0, ttl=100)], edf)
    early_deadline = Queue("b", [Item(enqueue_time=5.0, ttl=1)], edf)
    assert GlobalStrictFairnessPolicy().pick(Band([late_deadline, early_deadline])) \
        is early_deadline


def test_round_robin_cycles_and_skips_empty_queues() -> None:
    """roundrobin_test.go: Pick_SkipsEmptyQueues — flow1, flow3, flow1, …"""
    p = RoundRobinFairnessPolicy()
    band = Band([Queue("flow1", [Item()]), Queue("flowEmpty"), Queue("flow3", [Item()] * 3)],
                p.new_state())
    picks = [p.pick(band) for _ in range(4)]
    assert [q.key.id if q else None for q in picks] == ["flow1", "flow3", "flow1", "flow3"]


def test_round_robin_handles_dynamic_flows() -> None:
    """roundrobin_test.go: Pick_HandlesDynamicFlows."""
    p = RoundRobinFairnessPolicy()
    q1, q2, q3 = Queue("flow1", [Item()]), Queue("flow2", [Item()]), Queue("flow3", [Item()])
    band = Band([q1, q2], p.new_state())
    assert p.pick(band) is q1
    band.queues["flow3"] = q3  # a flow joins
    assert p.pick(band) is q2
    assert p.pick(band) is q3
    del band.queues["flow2"]  # a flow leaves: wrap around after flow3
    assert p.pick(band) is q1


def test_round_robin_resets_when_empty_and_rejects_foreign_state() -> None:
    p = RoundRobinFairnessPolicy()
    state = p.new_state()
    assert p.pick(Band([Queue("a")], state)) is None
    assert state.last is None
    q = Queue("b", [Item()])
    assert p.pick(Band([q], state)) is q
    with pytest.raises(TypeError, match="band state"):
        p.pick(Band([q], state=object()))
