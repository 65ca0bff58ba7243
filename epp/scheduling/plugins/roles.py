"""Role filters for prefill/decode disaggregation: ``decode-filter``, ``prefill-filter``.

The role is read from the endpoint label ``roleLabel`` (default ``llm-d.ai/role``), falling
back to Dynamo's ``nvidia.com/dynamo-sub-component-type``; values compare lower-cased.
"""

from __future__ import annotations

from typing import Sequence

from epp import keys
from epp.config.params import Params
from epp.config.registry import PluginHandle
from epp.scheduling.types import CycleState, Endpoint, LLMRequest


def endpoint_role(e: Endpoint, label: str) -> str | None:
    role = e.labels.get(label)
    if role is None and label == keys.LABEL_ROLE:
        role = e.labels.get(keys.LABEL_ROLE_DYNAMO)
    return role.lower() if role is not None else None


class _RoleFilter:
    type_name = ""

    def __init__(self, name: str, role_label: str = keys.LABEL_ROLE) -> None:
        self.name = name
        self.role_label = role_label

    @classmethod
    def from_params(cls, name: str, params: Params, handle: PluginHandle) -> "_RoleFilter":
        label = params.str("roleLabel", keys.LABEL_ROLE) or keys.LABEL_ROLE
        params.done()
        return cls(name, label)


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
    """Keeps endpoints whose role is exactly prefill."""

    type_name = "prefill-filter"

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        return [e for e in endpoints if endpoint_role(e, self.role_label) == keys.ROLE_PREFILL]
