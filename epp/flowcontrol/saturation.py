"""The controller's saturation callback, built from the config's saturation detector.

GIE's dispatch cycle reads ``SaturationDetector.Saturation(endpoints)`` over the pool's
candidates (``EndpointCandidates.Locate``). This EPP's detectors (``utilization-detector``,
``concurrency-detector``) give the same gradient as ``saturation(endpoints)``; a detector
that only answers ``is_saturated(endpoints)`` reads as 1.0 (saturated) or 0.0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from epp.flowcontrol.controller import SaturationFn
from epp.framework.interfaces import SaturationDetector
from epp.scheduling.types import Endpoint


@runtime_checkable
class SaturationGradient(Protocol):
    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        """0 idle … 1 saturated, > 1 overloaded; 1.0 for no endpoints."""
        ...


def detector_saturation(detector: SaturationDetector,
                        endpoints: Callable[[], Sequence[Endpoint]]) -> SaturationFn:
    """A :data:`~epp.flowcontrol.controller.SaturationFn` over ``endpoints()`` (e.g.
    ``Datastore.routable``): the whole pool for ``None``, else the endpoints whose
    ``key`` (``ip:port``) is in the subset (none matching: saturated, the detectors'
    rule for no endpoints)."""
    gradient = detector if isinstance(detector, SaturationGradient) else None

    def saturation(subset: Sequence[str] | None) -> float:
        eps = endpoints()
        if subset is not None:
            allowed = set(subset)
            eps = [e for e in eps if e.key in allowed]
        if gradient is not None:
            return float(gradient.saturation(eps))
        return 1.0 if detector.is_saturated(eps) else 0.0

    return saturation
