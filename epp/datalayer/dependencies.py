"""The data-dependency check GIE v1.5.0 runs on a loaded config
(pkg/epp/datalayer/data_graph.go, ``ValidateAndOrderDataDependencies``, called by
cmd/epp/runner/runner.go after the plugins are instantiated).

Plugins declare what they produce (:class:`~epp.framework.interfaces.ProducesData`,
GIE's ``Produces()``) and consume (:class:`~epp.framework.interfaces.ConsumesData`,
``Consumes()``): data key → type name. For every producer/consumer pair sharing a key
(a plugin is never paired with itself):

1. the types must be the same — else GIE fails: "data type mismatch between produced and
   consumed data for key: K";
2. the producer must run in an earlier layer than, or the same layer as, the consumer —
   flow control (0) before request control (1) before scheduling (2); a plugin of no known
   layer is -1 — else "invalid plugin layer execution order: producer P needs to be
   executed before consumer C";
3. the consumer depends on the producer; the dependencies must have no cycle — else
   "cycle detected: graph is not a DAG".

GIE does **not** require a consumed key to have a producer (``queue-scorer`` consumes
``WaitingQueueSize``, which no plugin declares it produces), and neither does this.

Two deliberate differences, both where GIE's result depends on accident rather than on
the config: GIE compares the declared values with Go's ``!=``, so in v1.5.0 the pointer
``&InFlightLoad{}`` never equals another one and ``inflight-load-producer`` with
``token-load-scorer`` is rejected (fixed after v1.5.0, GIE #2819) — here types are
names, equal when the names are; and GIE checks only the first shared key of a pair in
Go's random map order — here every shared key is checked, in declaration order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from epp.framework.interfaces import (
    AdmissionPlugin,
    ConsumesData,
    Filter,
    Picker,
    Plugin,
    PrepareDataPlugin,
    PreRequest,
    ProducesData,
    ProfileHandler,
    RequestHeaders,
    ResponseHeaders,
    Scorer,
)

# GIE's layers (data_graph.go): lower runs earlier.
LAYER_FLOW_CONTROL = 0
LAYER_REQUEST_CONTROL = 1
LAYER_SCHEDULING = 2
LAYER_DEFAULT = -1  # none of the above

LAYER_NAMES = {LAYER_FLOW_CONTROL: "flow control", LAYER_REQUEST_CONTROL: "request control",
               LAYER_SCHEDULING: "scheduling", LAYER_DEFAULT: "no layer"}


def execution_layer(plugin: Plugin) -> int:
    """GIE's ``pluginToLayerExecutionOrder``, checked in its order: request control
    (GIE's PrepareData, Admission, PreRequest and ResponseHeader plugins — here
    :class:`PrepareDataPlugin`, :class:`AdmissionPlugin`, :class:`PreRequest`,
    :class:`RequestHeaders`, llm-d's PreRequest header plugins, and
    :class:`ResponseHeaders`), then scheduling (profile handler, filter, scorer,
    picker). This EPP has no flow-control policy plugins yet (GIE's fairness and
    ordering policies, layer 0)."""
    if isinstance(plugin, (PrepareDataPlugin, AdmissionPlugin, PreRequest, RequestHeaders,
                           ResponseHeaders)):
        return LAYER_REQUEST_CONTROL
    if isinstance(plugin, (ProfileHandler, Filter, Scorer, Picker)):
        return LAYER_SCHEDULING
    return LAYER_DEFAULT


class DependencyError(Exception):
    """A data dependency GIE rejects. ``plugin`` is the plugin the message is about
    (its config path locates the error), None for a cycle."""

    def __init__(self, message: str, plugin: Plugin | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin


@dataclass(frozen=True)
class Edge:
    """``consumer`` reads ``key`` from ``producer``."""

    consumer: Plugin
    producer: Plugin
    key: str


def _label(p: Plugin) -> str:
    return f"{p.name!r} ({p.type_name})"


def check_data_dependencies(plugins: Iterable[Plugin]) -> list[Plugin]:
    """Check the producers and consumers among ``plugins`` (duplicates by identity are
    ignored) as GIE does; return them producers first (GIE's topological order, which
    orders its PrepareData plugins). Raises :class:`DependencyError`."""
    unique: dict[int, Plugin] = {}
    for p in plugins:
        unique.setdefault(id(p), p)
    nodes: list[Plugin] = [p for p in unique.values()
                           if isinstance(p, (ProducesData, ConsumesData))]
    producers = [p for p in nodes if isinstance(p, ProducesData)]
    consumers = [p for p in nodes if isinstance(p, ConsumesData)]
    depends: dict[int, list[Edge]] = {id(p): [] for p in nodes}
    for producer in producers:
        produced: Mapping[str, str] = producer.produces or {}
        for consumer in consumers:
            if id(consumer) == id(producer):  # GIE skips a plugin paired with itself
                continue
            consumed: Mapping[str, str] = consumer.consumes or {}
            shared = [k for k in produced if k in consumed]
            for key in shared:
                if produced[key] != consumed[key]:
                    raise DependencyError(
                        f"data key {key!r}: {_label(consumer)} consumes it as "
                        f"{consumed[key]}, but {_label(producer)} produces "
                        f"{produced[key]} (GIE: data type mismatch between produced and "
                        f"consumed data for key: {key}); make the types agree, or remove "
                        "one of the two plugins", consumer)
            if not shared:
                continue
            p_layer, c_layer = execution_layer(producer), execution_layer(consumer)
            if p_layer > c_layer:
                raise DependencyError(
                    f"{_label(consumer)} ({LAYER_NAMES[c_layer]}) consumes {shared[0]!r}, "
                    f"produced by {_label(producer)} ({LAYER_NAMES[p_layer]}), which runs "
                    "after it (GIE: invalid plugin layer execution order: the producer "
                    "needs to be executed before the consumer; layers run flow control, "
                    "request control, then scheduling); produce it in an earlier layer, or "
                    "remove one of the two plugins", consumer)
            depends[id(consumer)].append(Edge(consumer, producer, shared[0]))
    return _topological(nodes, depends)


def _topological(nodes: list[Plugin], depends: dict[int, list[Edge]]) -> list[Plugin]:
    """Producers before their consumers (declaration order among equals); a cycle raises
    :class:`DependencyError` naming one."""
    waiting = {id(p): len({id(e.producer) for e in depends[id(p)]}) for p in nodes}
    users: dict[int, list[Plugin]] = {id(p): [] for p in nodes}
    for p in nodes:
        for pid in {id(e.producer) for e in depends[id(p)]}:
            users[pid].append(p)
    ready = [p for p in nodes if waiting[id(p)] == 0]
    out: list[Plugin] = []
    while ready:
        p = ready.pop(0)
        out.append(p)
        for user in users[id(p)]:
            waiting[id(user)] -= 1
            if waiting[id(user)] == 0:
                ready.append(user)
    if len(out) != len(nodes):
        raise DependencyError(f"data dependency cycle: {_cycle(nodes, depends, out)} "
                              "(GIE: cycle detected: graph is not a DAG); break it: remove "
                              "one of these keys from a plugin's produces or consumes")
    return out


def _cycle(nodes: list[Plugin], depends: dict[int, list[Edge]], done: list[Plugin]) -> str:
    """One cycle among the plugins left unsorted, as ``a reads K from b → …``."""
    left = {id(p) for p in nodes} - {id(p) for p in done}
    start = next(p for p in nodes if id(p) in left)
    path: list[Edge] = []
    seen: dict[int, int] = {}
    cur = start
    while id(cur) not in seen:
        seen[id(cur)] = len(path)
        edge = next(e for e in depends[id(cur)] if id(e.producer) in left)
        path.append(edge)
        cur = edge.producer
    loop = path[seen[id(cur)]:]
    return ", ".join(f"{e.consumer.name!r} reads {e.key!r} from {e.producer.name!r}"
                     for e in loop)
