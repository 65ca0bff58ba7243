"""P/D through real Envoy: `epp serve` with config/pd-grove.yaml in front of prefill and
decode `epp sim` pods in two racks (Grove labels, node topology), the decode pods acting
as llm-d's decode sidecar.

Layout: rack-1 has 2 *slow* prefill pods (2 ms per prompt token, one sequence at a time:
easy to saturate) and 2 decode pods; rack-2 has 2 fast prefill pods and 2 decode pods;
one more prefill pod in rack-2 always answers 500 and is outside the EPP's pool until a
test puts it there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from epp.stack.pd import PdLayout, PdPod, PdStack, grove_layout, repo_config
from epp.stack.procs import free_port
from tests.integration.conftest import eventually

HEADER = "x-prefiller-host-port"
FAILING = "llm-1-prefill-failing"


def layout() -> PdLayout:
    def slow(role: str, rack: str, i: int) -> list[str]:
        if role == "prefill" and rack == "rack-1":
            return ["--prefill-ms-per-token", "2", "--max-num-seqs", "1"]
        return []

    lay = grove_layout(pod_args=slow)
    node = "node-rack-2-prefill-failing"
    lay.nodes[node] = dict(lay.nodes["node-rack-2-prefill-0"], **{"kubernetes.io/hostname": node})
    labels = dict(lay.by_role("prefill")[-1].labels)
    lay.pods.append(PdPod("prefill", "rack-2", free_port(), FAILING, node, labels,
                          ("--error-rate", "1")))
    return lay


@pytest_asyncio.fixture(scope="module")
async def pd(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PdStack]:
    stack = PdStack(tmp_path_factory.mktemp("pd"), layout(),
                    config_file=repo_config("pd-grove.yaml"), log_level="info",
                    epp_include=lambda p: p.name != FAILING,
                    # scrape every 50 ms even on a busy machine (no stretching)
                    epp_args=["--metrics-max-loop-lag", "0"])
    await stack.start()
    try:
        yield stack
    finally:
        await stack.stop()


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


def prompt(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def chat(session: aiohttp.ClientSession, stack: PdStack, text: str,
               headers: dict[str, str] | None = None, max_tokens: int = 4) -> str:
    """One streamed chat completion through Envoy; returns the serving pod's key."""
    body = {"model": "sim-model", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "stream": True}
    async with session.post(f"{stack.url}/v1/chat/completions", json=body,
                            headers=headers or {}) as r:
        data = await r.read()
        assert r.status == 200, data
        assert data.rstrip().endswith(b"data: [DONE]"), data[-200:]
        server = r.headers["x-sim-server"]
    return "127.0.0.1:" + server.removeprefix("sim-")


async def last_record(session: aiohttp.ClientSession, key: str) -> dict[str, Any]:
    async with session.get(f"http://{key}/debug/requests") as r:
        recs = await r.json()
    assert recs
    return dict(recs[-1])


async def restore(stack: PdStack, session: aiohttp.ClientSession) -> None:
    stack.set_pool()

    async def paired() -> bool:
        key = await chat(session, stack, prompt("restore", 8))
        return HEADER in (await last_record(session, key))["headers"]

    await eventually(paired, timeout=10, interval=0.2)


async def test_decode_pod_gets_the_header_and_the_prefill_pod_a_one_token_request(
        pd: PdStack, session: aiohttp.ClientSession) -> None:
    await pd.clear_debug(session)
    decode = await chat(session, pd, prompt("hdr", 60), max_tokens=5)
    assert decode in {p.key for p in pd.layout.by_role("decode")}
    rec = await last_record(session, decode)
    prefill = rec["headers"][HEADER]
    assert prefill in {p.key for p in pd.layout.by_role("prefill")}
    assert rec["pd"]["status"] == 200 and rec["pd"]["fallback"] is False
    assert rec["fields"]["max_tokens"] == 5 and rec["fields"]["stream"] is True
    prec = await last_record(session, prefill)
    assert prec["fields"]["max_tokens"] == 1 and prec["fields"]["max_completion_tokens"] == 1
    assert prec["fields"]["stream"] is False
    assert prec["fields"]["kv_transfer_params"]["do_remote_decode"] is True
    assert prec["body_len"] != rec["body_len"]  # a rewritten body, not the client's
    assert (await pd.decisions(session)).get("disaggregated", 0) >= 1


async def test_pairs_stay_in_the_rack_when_load_allows(
        pd: PdStack, session: aiohttp.ClientSession) -> None:
    before = await pd.pair_stats(session)
    decodes = set()
    for i in range(12):  # one at a time: no prefill pod has a queue
        key = await chat(session, pd, prompt(f"calm{i}-", 40))
        rec = await last_record(session, key)
        decodes.add(key)
        assert pd.layout.rack_of(rec["headers"][HEADER]) == pd.layout.rack_of(key), rec
        assert rec["pd"]["distance"] == "rack"
    stats = (await pd.pair_stats(session)).minus(before)
    assert stats.remote_prefills == 12 and stats.same_rack_share == 1.0
    assert {pd.layout.rack_of(k) for k in decodes} == {"rack-1", "rack-2"}


async def test_a_saturated_rack_spills_over(pd: PdStack, session: aiohttp.ClientSession) -> None:
    # Only rack-1's decode pods in the pool: every request wants rack-1's slow prefill
    # pods (0.6 s per 300-word prompt, one at a time).
    rack1_decodes = {p.key for p in pd.layout.by_role("decode") if p.rack == "rack-1"}
    pd.set_pool(lambda p: p.name != FAILING and (p.role == "prefill" or p.rack == "rack-1"))
    try:
        async def only_rack1() -> bool:
            served = [await chat(session, pd, prompt(f"probe{i}-", 8)) for i in range(4)]
            return set(served) <= rack1_decodes

        await eventually(only_rack1, timeout=10, interval=0.2)

        async def prefill_idle() -> bool:  # as the EPP sees it: the probes' prefills are done
            async with session.get(pd.metrics_url) as r:
                text = await r.text()
            values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(("epp_role_average_running_requests{",
                                          "epp_role_average_queue_size{"))
                      and 'role="prefill"' in line]
            return len(values) == 2 and not any(values)

        await eventually(prefill_idle)
        await pd.clear_debug(session)
        before = await pd.pair_stats(session)
        # Long prompts staggered by 100 ms: rack-1's prefill queues grow (the EPP scrapes
        # every 50 ms), and the pairing spills over to rack-2's idle prefill pods.
        tasks = []
        for i in range(16):
            tasks.append(asyncio.create_task(chat(session, pd, prompt(f"hot{i}-", 300))))
            await asyncio.sleep(0.1)  # pacing, not a wait
        await asyncio.gather(*tasks)
        pairs = []
        for key in rack1_decodes:
            async with session.get(f"http://{key}/debug/requests") as r:
                for rec in await r.json():
                    pairs.append(pd.layout.rack_of(rec["headers"][HEADER]))
        assert len(pairs) == 16
        assert pairs.count("rack-1") >= 2, pairs  # while rack-1 had room: local pairs
        assert pairs.count("rack-2") >= 2, pairs  # then: spilled over to the other rack
        stats = (await pd.pair_stats(session)).minus(before)
        assert stats.remote_prefills == 16
        assert stats.by_distance["block"] == pairs.count("rack-2")
    finally:
        await restore(pd, session)


async def test_without_prefill_pods_decode_serves_alone_and_a_spoofed_header_is_removed(
        pd: PdStack, session: aiohttp.ClientSession) -> None:
    spoof = {HEADER: "127.0.0.1:9"}
    # Normal pool: the client's header is replaced by the EPP's choice.
    key = await chat(session, pd, prompt("spoof", 20), headers=spoof)
    assert (await last_record(session, key))["headers"][HEADER] != spoof[HEADER]
    decisions = await pd.decisions(session)
    pd.set_pool(lambda p: p.role == "decode")
    try:
        async def unpaired() -> bool:
            k = await chat(session, pd, prompt("alone", 20), headers=spoof)
            rec = await last_record(session, k)
            return HEADER not in rec["headers"] and "pd" not in rec

        await eventually(unpaired, timeout=10, interval=0.2)
        after = await pd.decisions(session)
        assert after.get("decode-only", 0) > decisions.get("decode-only", 0)
    finally:
        await restore(pd, session)


async def test_a_failing_prefill_pod_falls_back_to_a_local_prefill(
        pd: PdStack, session: aiohttp.ClientSession) -> None:
    failing = next(p for p in pd.layout.pods if p.name == FAILING)
    pd.set_pool(lambda p: p.role == "decode" or p.name == FAILING)
    try:
        async def fell_back() -> bool:
            k = await chat(session, pd, prompt("fail", 20), max_tokens=3)
            rec = await last_record(session, k)
            return rec["headers"].get(HEADER) == failing.key and rec["pd"]["fallback"] is True

        await eventually(fell_back, timeout=10, interval=0.2)
        stats = await pd.pair_stats(session)
        assert stats.fallbacks >= 1 and stats.prefill_failures >= 1
        async with session.get(f"http://{failing.key}/debug/requests") as r:
            assert (await r.json())[-1]["fields"]["max_tokens"] == 1  # it was asked
    finally:
        await restore(pd, session)
