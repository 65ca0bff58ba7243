"""``topology-extractor`` and ``topology-affinity-filter`` (llm-d-router v0.10.0,
pkg/epp/framework/plugins/datalayer/{attribute,extractor}/topology,
scheduling/filter/topologyaffinity and scheduling/util/topology).

**topology-extractor** gives each endpoint a ``Topology`` (hostname, rack, zone, region),
llm-d's ``Topology/<extractor name>`` attribute. Parameters name the label each field
is read from: ``hostname`` (default ``kubernetes.io/hostname``), ``rack``
(``topology.kubernetes.io/rack``), ``zone`` (``topology.kubernetes.io/zone``), ``region``
(``topology.kubernetes.io/region``). A label is looked up in the pod's labels (llm-d),
then in its node's labels (this EPP's Kubernetes discovery watches Nodes, see
epp/discovery/kubernetes.py; static discovery's ``node``/``nodeLabels``); the hostname
falls back to the pod's node name where llm-d falls back to the Pod's ``spec.hostname``
(this EPP keeps no ``spec.hostname``; the node name is the host the NVLink boundary
follows). An endpoint with none of the four values has no ``Topology``. The attribute is
computed from the endpoint's labels when read, so it follows label changes and needs
no data-layer wiring (llm-d wires the extractor to endpoint and Pod notifications by
itself); listing it under an ``endpoint-notification-source`` in ``dataLayer`` is
accepted and changes nothing.

**topology-affinity-filter** runs in the ``prefill`` profile of a P/D setup and keeps the
candidates whose topology is co-located with the decode endpoint already chosen (llm-d's
``peer-endpoint``; here ``disagg-profile-handler``/``pd-profile-handler``'s decode pick) at
``minAffinity`` (``host`` default, ``rack``, ``zone``, ``region``) or tighter. Two values
match only when both are non-empty and equal; same host counts as same host only, the
tiers are compared tightest first. It fails open: no peer topology (aggregated serving,
no topology-extractor, or a peer without any value) or no candidate meeting
``minAffinity`` gives back every candidate. A candidate without a ``Topology`` is dropped
(when some other candidate passes). ``topologyProducerName`` names the
``topology-extractor`` to read (default: the one named ``topology-extractor``); without
one the filter passes everything, with a startup warning (llm-d's optional dependency).

This project's own ``topology-affinity-scorer`` (epp/scheduling/plugins/topology.py,
label ``levels`` with Grove defaults) is unchanged and works beside this filter, as in
llm-d's deploy/config/pd-topology-epp-config.yaml.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import DATA_ENDPOINT_EVENTS
from epp.framework.params import ParameterError, config_warning, param
from epp.scheduling.plugins.pd import DECODE_ENDPOINT_KEY
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

log = logging.getLogger(__name__)

TOPOLOGY_EXTRACTOR = "topology-extractor"
TOPOLOGY_AFFINITY_FILTER = "topology-affinity-filter"
#: llm-d's TopologyAttributeKey ("Topology") before the producer name.
TOPOLOGY_ATTRIBUTE = "Topology"
TOPOLOGY_TYPE = "Topology"

DEFAULT_HOSTNAME_LABEL = "kubernetes.io/hostname"
DEFAULT_RACK_LABEL = "topology.kubernetes.io/rack"
DEFAULT_ZONE_LABEL = "topology.kubernetes.io/zone"
DEFAULT_REGION_LABEL = "topology.kubernetes.io/region"


def topology_key(producer: str) -> str:
    """The attribute key ``Topology/<producer>`` (llm-d's ``WithNonEmptyProducerName``)."""
    return f"{TOPOLOGY_ATTRIBUTE}/{producer or TOPOLOGY_EXTRACTOR}"


@dataclass(frozen=True, slots=True)
class Topology:
    """An endpoint's locality; an empty string is an unknown value."""

    hostname: str = ""
    rack: str = ""
    zone: str = ""
    region: str = ""


class Level(enum.IntEnum):
    """Topology tiers, tightest first (llm-d's ``topology.Level``)."""

    HOST = 0
    RACK = 1
    ZONE = 2
    REGION = 3
    NONE = 4  # no common tier

    @property
    def config_name(self) -> str:
        return "none" if self is Level.NONE else self.name.lower()


LEVEL_NAMES: Mapping[str, Level] = MappingProxyType(
    {lvl.config_name: lvl for lvl in Level if lvl is not Level.NONE})


def parse_level(value: str) -> Level:
    """``host``/``rack``/``zone``/``region`` → :class:`Level`; ValueError otherwise (llm-d's
    ``ParseLevel`` message)."""
    try:
        return LEVEL_NAMES[value]
    except KeyError:
        raise ValueError(f"invalid topology level {value!r}, must be one of host, rack, "
                         "zone, region") from None


def _matches(a: str, b: str) -> bool:
    return a != "" and a == b


def compare(peer: Topology | None, candidate: Topology | None) -> Level:
    """The tightest tier where both have the same non-empty value; NONE when none (or
    either is None). Empty never matches, not even empty against empty."""
    if peer is None or candidate is None:
        return Level.NONE
    if _matches(peer.hostname, candidate.hostname):
        return Level.HOST
    if _matches(peer.rack, candidate.rack):
        return Level.RACK
    if _matches(peer.zone, candidate.zone):
        return Level.ZONE
    if _matches(peer.region, candidate.region):
        return Level.REGION
    return Level.NONE


# ------------------------------------------------------------------ topology-extractor


@dataclass(frozen=True)
class TopologyExtractorParameters:
    """Label names; empty means the Kubernetes default (llm-d's ``omitempty`` fields)."""

    hostname: str = param("hostname", "")
    rack: str = param("rack", "")
    zone: str = param("zone", "")
    region: str = param("region", "")


class TopologyExtractor:
    """Reads an endpoint's :class:`Topology` from its pod's (then its node's) labels."""

    type_name = TOPOLOGY_EXTRACTOR
    Parameters = TopologyExtractorParameters
    # Accepted under an endpoint-notification-source (llm-d wires it there itself).
    data_input = DATA_ENDPOINT_EVENTS

    def __init__(self, name: str = TOPOLOGY_EXTRACTOR, *,
                 hostname_label: str = DEFAULT_HOSTNAME_LABEL,
                 rack_label: str = DEFAULT_RACK_LABEL,
                 zone_label: str = DEFAULT_ZONE_LABEL,
                 region_label: str = DEFAULT_REGION_LABEL) -> None:
        self.name = name or TOPOLOGY_EXTRACTOR
        self.hostname_label = hostname_label
        self.rack_label = rack_label
        self.zone_label = zone_label
        self.region_label = region_label
        self.key = topology_key(self.name)
        self.produces: Mapping[str, str] = MappingProxyType({self.key: TOPOLOGY_TYPE})

    @classmethod
    def from_params(cls, name: str, params: TopologyExtractorParameters,
                    handle: PluginHandle) -> TopologyExtractor:
        return cls(name,
                   hostname_label=params.hostname or DEFAULT_HOSTNAME_LABEL,
                   rack_label=params.rack or DEFAULT_RACK_LABEL,
                   zone_label=params.zone or DEFAULT_ZONE_LABEL,
                   region_label=params.region or DEFAULT_REGION_LABEL)

    @staticmethod
    def _label(e: Endpoint, key: str) -> str:
        v = e.labels.get(key)
        if v:
            return v
        return e.node_labels.get(key) or ""

    def topology(self, endpoint: Endpoint) -> Topology | None:
        """The endpoint's topology; None when it has no value at all (llm-d writes no
        attribute then)."""
        topo = Topology(
            hostname=self._label(endpoint, self.hostname_label) or (endpoint.node_name or ""),
            rack=self._label(endpoint, self.rack_label),
            zone=self._label(endpoint, self.zone_label),
            region=self._label(endpoint, self.region_label))
        if not (topo.hostname or topo.rack or topo.zone or topo.region):
            return None
        return topo

    def extract_endpoint(self, event: str, endpoint: Endpoint) -> None:
        """Nothing to store: :meth:`topology` reads the endpoint's labels when asked."""


# ------------------------------------------------------------ topology-affinity-filter


def _min_affinity(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return value


@dataclass(frozen=True)
class TopologyAffinityFilterParameters:
    min_affinity: str = param("minAffinity", "", parse=_min_affinity)
    topology_producer_name: str = param("topologyProducerName", "")

    def __post_init__(self) -> None:
        if self.min_affinity:
            try:
                parse_level(self.min_affinity)
            except ValueError as e:
                raise ParameterError("minAffinity", f"invalid configuration for "
                                     f"{TOPOLOGY_AFFINITY_FILTER!r} filter: {e}") from None


class TopologyAffinityFilter:
    """Keeps the candidates co-located with the decode pick at ``minAffinity`` or
    tighter; fails open (module doc)."""

    type_name = TOPOLOGY_AFFINITY_FILTER
    Parameters = TopologyAffinityFilterParameters

    def __init__(self, name: str = TOPOLOGY_AFFINITY_FILTER, min_affinity: Level = Level.HOST,
                 producer_name: str = "") -> None:
        self.name = name or TOPOLOGY_AFFINITY_FILTER
        self.min_affinity = min_affinity
        self.producer_name = producer_name or TOPOLOGY_EXTRACTOR
        self.consumes: Mapping[str, str] = MappingProxyType(
            {topology_key(self.producer_name): TOPOLOGY_TYPE})
        self.extractor: TopologyExtractor | None = None

    @classmethod
    def from_params(cls, name: str, params: TopologyAffinityFilterParameters,
                    handle: PluginHandle) -> TopologyAffinityFilter:
        return cls(name, parse_level(params.min_affinity or "host"),
                   params.topology_producer_name)

    def bind(self, handle: PluginHandle) -> None:
        """Find the topology-extractor named ``topologyProducerName``; without one the
        filter passes every candidate (llm-d: an optional dependency, a warning)."""
        self.extractor = handle.named(self.producer_name, TopologyExtractor)
        if self.extractor is None:
            config_warning(self.name, f"no {TOPOLOGY_EXTRACTOR} named "
                           f"{self.producer_name!r}: endpoints have no topology and the "
                           "filter keeps every candidate; declare "
                           f"'- type: {TOPOLOGY_EXTRACTOR}'"
                           + (f" named {self.producer_name!r}"
                              if self.producer_name != TOPOLOGY_EXTRACTOR else ""))

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        ext = self.extractor
        peer_ep = state.get(DECODE_ENDPOINT_KEY)
        if ext is None or not isinstance(peer_ep, Endpoint):
            return endpoints
        peer = ext.topology(peer_ep)
        if peer is None:
            return endpoints
        kept = [e for e in endpoints
                if compare(peer, ext.topology(e)) <= self.min_affinity]
        return kept or endpoints
