"""``precise-prefix-cache-producer``'s optional balance guard (this project's addition)."""

from __future__ import annotations

from epp.framework.params import decode_params
from epp.scheduling.plugins.precise_prefix import (
    PrecisePrefixCacheProducer,
    PrecisePrefixParameters,
)
from epp.scheduling.types import Endpoint


def _eps() -> list[Endpoint]:
    return [Endpoint(n, "127.0.0.1", p) for n, p in (("a", 1), ("b", 2), ("c", 3))]


def test_off_by_default() -> None:
    prod = PrecisePrefixCacheProducer("p")
    prod.inflight["127.0.0.1:1"] = 100
    assert prod.hot(_eps()) == set()


def test_guard_marks_the_overloaded_endpoint() -> None:
    prod = PrecisePrefixCacheProducer("p", decode_params(
        PrecisePrefixParameters, {"balanceAbsThreshold": 2, "balanceRelThreshold": 1.5}, "p"))
    prod.inflight.update({"127.0.0.1:1": 5, "127.0.0.1:2": 2})
    assert prod.hot(_eps()) == {"127.0.0.1:1"}  # 5 > max(0 + 2, 0 * 1.5)
    for _ in range(3):
        prod.response_complete(None, "127.0.0.1:1", False)  # type: ignore[arg-type]  # unused
    assert prod.hot(_eps()) == set()
    prod.endpoint_removed("127.0.0.1:2")
    assert "127.0.0.1:2" not in prod.inflight
