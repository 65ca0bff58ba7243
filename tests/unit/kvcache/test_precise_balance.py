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


def test_token_ids_a_client_sent_that_cannot_be_keyed_match_nothing() -> None:
    from epp.kvcache.tokenization import TokenizedPrompt
    from epp.scheduling.plugins.token_producer import TOKENIZED_PROMPT
    from epp.scheduling.types import ApiType, LLMRequest

    prod = PrecisePrefixCacheProducer("p")
    for ids, want in (((-1,) * 32, 0), ((2**64,) * 32, 0), ((7,) * 32, 2)):
        r = LLMRequest("r", "m", "m", ApiType.COMPLETIONS, "", {})
        r.plugin_state[TOKENIZED_PROMPT] = TokenizedPrompt(ids)
        assert len(prod.block_keys(r)) == want  # 16-token blocks; bad ids: no keys, no crash


async def test_speculative_entries_follow_the_decision_and_expire() -> None:
    import asyncio

    from epp.kvcache.tokenization import TokenizedPrompt
    from epp.scheduling.plugins.token_producer import TOKENIZED_PROMPT
    from epp.scheduling.types import ApiType, LLMRequest, ProfileRunResult, SchedulingResult

    prod = PrecisePrefixCacheProducer("p", decode_params(
        PrecisePrefixParameters, {"speculativeIndexing": True, "speculativeTTL": "200ms"},
        "p"))
    r = LLMRequest("r", "m", "m", ApiType.COMPLETIONS, "", {})
    r.plugin_state[TOKENIZED_PROMPT] = TokenizedPrompt(tuple(range(64)))
    eps = _eps()
    prod.pre_request(r, SchedulingResult({"default": ProfileRunResult((eps[1],))}, "default"))
    keys = prod.block_keys(r)
    assert len(keys) == 4
    await asyncio.sleep(0)  # indexed on the loop's next turn
    assert prod.index.longest_prefix(keys, [e.key for e in eps])[1] == {eps[1].key: 4}
    await asyncio.sleep(0.3)
    assert prod.index.longest_prefix(keys, [e.key for e in eps])[1] == {}
