"""A worked example of docs/plugins.md: a notification extractor that is also a filter.

``DrainFilter`` keeps new requests off pods an operator marks for draining
(``kubectl annotate pod vllm-0 example.com/drain=true``). It reads the Pods through a
``k8s-notification-source`` (the config's ``dataLayer.sources``), remembers the IPs of the
annotated ones, and as a filter drops the endpoints at those IPs — all of them when every
candidate is draining would leave none, so then it keeps them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epp.framework.handle import PluginHandle
from epp.framework.interfaces import (
    DATA_K8S_NOTIFICATIONS,
    EVENT_DELETE,
    gvk_string,
)
from epp.framework.params import param
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

DEFAULT_ANNOTATION = "example.com/drain"


@dataclass(frozen=True)
class DrainParameters:
    annotation: str = param("annotation", DEFAULT_ANNOTATION)


class DrainFilter:
    type_name = "drain-filter"
    Parameters = DrainParameters
    # The extractor side: what it reads, and from which kind (its source's).
    data_input = DATA_K8S_NOTIFICATIONS
    gvk = gvk_string("", "v1", "Pod")  # "/v1, Kind=Pod"

    def __init__(self, name: str, annotation: str = DEFAULT_ANNOTATION) -> None:
        self.name = name
        self.annotation = annotation
        self.draining: dict[str, str] = {}  # "namespace/name" → pod IP

    @classmethod
    def from_params(cls, name: str, params: DrainParameters,
                    handle: PluginHandle) -> DrainFilter:
        return cls(name, params.annotation or DEFAULT_ANNOTATION)

    def extract_notification(self, event: str, obj: dict[str, Any]) -> None:
        """Each Pod added, changed (``add-or-update``) or deleted (``delete``)."""
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        ip = (obj.get("status") or {}).get("podIP")
        annotations = meta.get("annotations") or {}
        if event == EVENT_DELETE or annotations.get(self.annotation) != "true" or not ip:
            self.draining.pop(key, None)
        else:
            self.draining[key] = ip

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        ips = set(self.draining.values())
        kept = [e for e in endpoints if e.address not in ips]
        return kept or endpoints
