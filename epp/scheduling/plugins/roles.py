"""Role filters for encode/prefill/decode disaggregation: ``decode-filter``,
``prefill-filter``, ``encode-filter``; and ``leader-filter`` for multi-node model servers.

llm-d-router v0.10.0 ``pkg/epp/framework/plugins/scheduling/filter/bylabel/roles.go``:
``decode-filter`` keeps decode, prefill-decode, both, encode-prefill-decode and unlabelled
pods; ``prefill-filter`` keeps prefill, encode-prefill, encode-prefill-decode (llm-d also
keeps prefill-decode and both there; this EPP keeps those pods for decode only);
``encode-filter`` keeps encode, encode-prefill, encode-prefill-decode — unlabelled pods
are never encode pods.

The role is read from the endpoint label ``roleLabel`` (default ``llm-d.ai/role``), falling
back to Dynamo's ``nvidia.com/dynamo-sub-component-type``; values compare lower-cased.

``leader-filter``: in a multi-node group (one model instance spanning several pods: a
leader and workers) only the leader takes traffic. A pod is in such a group when it carries
one of ``indexLabels`` (its index in the group); it is kept only when that index equals
``leaderIndex``. Pods carrying none of them are single-pod servers and are kept.
Defaults: ``indexLabels: [leaderworkerset.sigs.k8s.io/worker-index]`` (LeaderWorkerSet,
what KServe's llm-d integration selects leaders by), ``leaderIndex: "0"``.
For Grove, ``indexLabels: [grove.io/podcliquescalinggroup-pod-index]`` when every
PodCliqueScalingGroup in the pool is one leader clique plus worker cliques with the leader
listed first in ``cliqueNames`` (Grove numbers a scaling-group replica's pods in that
order). See docs/disaggregation.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

from epp import keys
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import param
from epp.scheduling.types import CycleState, Endpoint, LLMRequest


def endpoint_role(e: Endpoint, label: str) -> str | None:
    role = e.labels.get(label)
    if role is None and label == keys.LABEL_ROLE:
        role = e.labels.get(keys.LABEL_ROLE_DYNAMO)
    return role.lower() if role is not None else None


@dataclass(frozen=True)
class RoleFilterParameters:
    role_label: str = param("roleLabel", keys.LABEL_ROLE)


class _RoleFilter:
    type_name = ""
    Parameters = RoleFilterParameters

    def __init__(self, name: str, role_label: str = keys.LABEL_ROLE) -> None:
        self.name = name
        self.role_label = role_label

    @classmethod
    def from_params(cls, name: str, params: RoleFilterParameters,
                    handle: PluginHandle) -> Self:
        return cls(name, params.role_label or keys.LABEL_ROLE)


class DecodeFilter(_RoleFilter):
    """Keeps endpoints that can decode: role decode / prefill-decode / both, or unlabelled."""

    type_name = "decode-filter"

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        out = []
        for e in endpoints:
            role = endpoint_role(e, self.role_label)
            if role is None or role in keys.ROLES_DECODE_CAPABLE:
                out.append(e)
        return out


class PrefillFilter(_RoleFilter):
    """Keeps endpoints whose role is prefill, encode-prefill or encode-prefill-decode."""

    type_name = "prefill-filter"

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        return [e for e in endpoints
                if endpoint_role(e, self.role_label) in keys.ROLES_PREFILL_CAPABLE]


class EncodeFilter(_RoleFilter):
    """llm-d's ``encode-filter``: keeps endpoints whose role is encode, encode-prefill or
    encode-prefill-decode (the encode stage's candidates); unlabelled ones are dropped."""

    type_name = "encode-filter"

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        return [e for e in endpoints
                if endpoint_role(e, self.role_label) in keys.ROLES_ENCODE_CAPABLE]


def _index_labels(raw: Any, path: str) -> tuple[str, ...]:
    if (not isinstance(raw, list) or not raw
            or not all(isinstance(x, str) and x.strip() for x in raw)):
        raise ConfigError(f"{path}: expected a non-empty list of label keys (the pod's index "
                          "in its multi-node group)")
    return tuple(x.strip() for x in raw)


def _leader_index(raw: Any, path: str) -> str:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)
    if not isinstance(raw, str) or not raw:
        raise ConfigError(f"{path}: expected the leader's index label value, e.g. \"0\"; "
                          f"got {raw!r}")
    return raw


@dataclass(frozen=True)
class LeaderFilterParameters:
    index_labels: tuple[str, ...] = param("indexLabels", (keys.LABEL_LWS_WORKER_INDEX,),
                                          parse=_index_labels)
    leader_index: str = param("leaderIndex", "0", parse=_leader_index)


class LeaderFilter:
    """Keeps single-pod servers and the leaders of multi-node groups (order kept)."""

    type_name = "leader-filter"
    Parameters = LeaderFilterParameters

    def __init__(self, name: str, index_labels: Sequence[str] = (keys.LABEL_LWS_WORKER_INDEX,),
                 leader_index: str = "0") -> None:
        self.name = name
        self.index_labels = tuple(index_labels)
        self.leader_index = leader_index

    @classmethod
    def from_params(cls, name: str, params: LeaderFilterParameters,
                    handle: PluginHandle) -> LeaderFilter:
        return cls(name, params.index_labels, params.leader_index)

    def is_leader(self, e: Endpoint) -> bool:
        for key in self.index_labels:
            v = e.labels.get(key)
            if v is not None:
                return v.strip() == self.leader_index
        return True  # not in a multi-node group

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        return [e for e in endpoints if self.is_leader(e)]
