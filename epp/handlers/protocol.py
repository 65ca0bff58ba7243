"""What the ext_proc handler needs from the domain, declared on the consumer side.

The handler imports nothing from parsing/, scheduling/ or requestcontrol/: a Director
implements :class:`RequestDirector` and returns :class:`Routing` values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

#: Envoy dynamic metadata, ``{namespace: {key: value}}`` (each namespace must be one the
#: gateway's ext_proc filter accepts: ``metadata_options.receiving_namespaces``).
DynamicMetadata: TypeAlias = Mapping[str, Mapping[str, Any]]

#: What the handler asks once per routed request whose response ended (not for an aborted
#: stream), after :meth:`RequestDirector.on_done`, with the request's ``Routing.context``:
#: dynamic metadata to send to Envoy with the last response message, or None (GIE's
#: ``reqCtx.Response.DynamicMetadata``, e.g. from ``request-attribute-reporter``).
ResponseMetadata: TypeAlias = Callable[[Any], DynamicMetadata | None]


@dataclass(slots=True)
class Routing:
    """Where a request goes.

    ``destination`` is ``ip:port[,ip:port…]`` (primary first, then fallbacks); it becomes
    both the ``x-gateway-destination-endpoint`` header and the ``envoy.lb`` metadata.
    ``set_headers`` are further request headers to set (e.g. ``x-prefiller-host-port``);
    routing headers not set here are removed from the request. ``body`` replaces the
    request body when not None (a model rewrite). ``context`` is opaque to the handler and
    handed back in the response callbacks.
    """

    destination: str
    set_headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes | None = None
    context: Any = None
    # llm-d's --emit-endpoint-scores: endpoint ``ip:port`` -> the primary profile's
    # weighted score, sent as envoy.lb's x-gateway-destination-endpoint-scores; None: off.
    scores: Mapping[str, float] | None = None


class RequestDirector(Protocol):
    async def route(
        self,
        headers: Mapping[str, str],
        body: bytes,
        has_body: bool,
        subset: Sequence[str] | None,
    ) -> Routing:
        """Decide where the request goes.

        ``headers`` are lower-cased request headers (pseudo-headers included); ``has_body``
        is False for header-only requests; ``subset`` is Envoy's subset hint (None when
        absent; an empty list means no endpoint is eligible). Raises ``epp.errors.EppError``
        to reject the request with its HTTP status.
        """
        ...

    def on_response_headers(
        self, context: Any, status: int, headers: Mapping[str, str]
    ) -> Mapping[str, str] | None:
        """Response headers arrived; return headers to set on the response, if any."""
        ...

    def on_response_body(self, context: Any, chunk: bytes, end_of_stream: bool) -> bytes | None:
        """A response body chunk passes through; return a replacement chunk, or None."""
        ...

    def on_upstream_failure(self, context: Any, address: str) -> None:
        """Envoy could not connect to ``address`` (``ip:port``), an endpoint this request
        was routed to (from the response attributes, when the gateway sends them)."""
        ...

    def on_done(self, context: Any, aborted: bool) -> bool | None:
        """Called exactly once per routed request: response complete, or stream aborted.

        May return whether the request is, after all, to be counted as aborted (Envoy can
        end a stream cleanly without the final end-of-stream message; the Director may
        know from the body that the response was complete). None: as given.
        """
        ...

    def on_rejected(self, headers: Mapping[str, str], status: int) -> None:
        """The handler rejected a request without routing it (e.g. 413, or its own 500)."""
        ...
