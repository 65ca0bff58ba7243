"""GIE's conformance-test plugins: ``header-based-testing-filter`` and
``destination-endpoint-served-verifier`` (registered in GIE's EPP; used by the
conformance suite's config, conformance/resources/base.yaml).

``header-based-testing-filter`` keeps the endpoints the request names in its
``test-epp-endpoint-selection`` header: a comma-separated list of ``IP`` (every port of
that IP — the last endpoint listed with it, as GIE keys its lookup by IP) or ``IP:port``
(that endpoint exactly); IPv6 with or without brackets (``fd00::1``, ``[fd00::1]:3000``).
The order is the header's, an IP is kept once, and names that match nothing are skipped.
No header (or an empty one) keeps nothing, so the profile fails.

``destination-endpoint-served-verifier`` sets ``x-conformance-test-served-endpoint`` on the
response. GIE's reads the endpoint Envoy reports as served (the response's ``envoy.lb``
metadata); this EPP does not receive that metadata, so the header carries the endpoint
the EPP routed the request to (``address:port``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

HEADER_ENDPOINT_SELECTION = "test-epp-endpoint-selection"
HEADER_SERVED_ENDPOINT = "x-conformance-test-served-endpoint"


def _ip(s: str) -> str:
    return s.strip().strip("[]")


def _split_host_port(item: str) -> tuple[str, str]:
    """Go's net.SplitHostPort where it succeeds, else (item, "")."""
    if item.startswith("["):
        end = item.find("]")
        if end != -1 and item[end + 1:end + 2] == ":" and ":" not in item[end + 2:]:
            return item[1:end], item[end + 2:]
        return item, ""
    if item.count(":") == 1:
        host, port = item.split(":")
        return host, port
    return item, ""


class HeaderBasedTestingFilter:
    type_name = "header-based-testing-filter"
    Parameters = NoParameters

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> HeaderBasedTestingFilter:
        return cls(name)

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        value = request.headers.get(HEADER_ENDPOINT_SELECTION, "")
        if not value.strip():
            return []
        by_ip: dict[str, Endpoint] = {}
        by_host_port: dict[str, Endpoint] = {}
        for e in endpoints:
            ip = _ip(e.address)
            if not ip:
                continue
            by_ip[ip] = e
            by_host_port[f"{ip}:{e.port}"] = e
        kept: list[Endpoint] = []
        seen: set[str] = set()
        for raw in value.split(","):
            item = raw.strip()
            if not item:
                continue
            host, port = _split_host_port(item)
            host = _ip(host)
            found = by_host_port.get(f"{host}:{port}") if port else by_ip.get(host)
            if found is not None and _ip(found.address) not in seen:
                seen.add(_ip(found.address))
                kept.append(found)
        return kept


class DestinationEndpointServedVerifier:
    type_name = "destination-endpoint-served-verifier"
    Parameters = NoParameters

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> DestinationEndpointServedVerifier:
        return cls(name)

    def response_headers(self, request: LLMRequest, endpoint_key: str, status: int,
                         headers: Mapping[str, str]) -> Mapping[str, str] | None:
        if not endpoint_key:
            return {HEADER_SERVED_ENDPOINT: "fail: missing destination endpoint served metadata"}
        return {HEADER_SERVED_ENDPOINT: endpoint_key}
