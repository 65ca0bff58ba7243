"""Closed-loop load runner: workers play conversations against a gateway URL.

Bounded by a request count and a duration; stops by itself. Requests are streamed chat
completions so time-to-first-token (TTFT) is measured at the client; usage
(`prompt_tokens`, `prompt_tokens_details.cached_tokens`) comes from the last SSE event.

The load generator of ``epp demo`` (:mod:`epp.stack.demo`); ``bench/pd.py`` runs it too,
and ``epp bench`` sends its open-loop traces with :func:`stream_chat`.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp
import orjson

from epp.stack.workload import Workload

SERVER_HEADER = "x-sim-server"
_CONTENT = re.compile(rb'"content":"[^"]')
_JSON_HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True, slots=True)
class Result:
    status: int
    server: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


@dataclass
class Report:
    label: str
    results: list[Result] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.status == 200 and not r.error]

    def share(self) -> Counter[str]:
        return Counter(r.server for r in self.ok)

    def errors(self) -> Counter[str]:
        return Counter(r.error or f"HTTP {r.status}" for r in self.results
                       if r.status != 200 or r.error)

    def quantile(self, attr: str, q: float) -> float:
        xs: list[float] = sorted(getattr(r, attr) for r in self.ok)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    @property
    def cache_hit_rate(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.ok)
        return sum(r.cached_tokens for r in self.ok) / prompt if prompt else 0.0

    @property
    def throughput(self) -> float:
        return len(self.ok) / self.elapsed_s if self.elapsed_s else 0.0


def _parse_sse(raw: bytes) -> tuple[str, int, int]:
    """(answer text, prompt_tokens, cached_tokens) from a chat SSE body."""
    text: list[str] = []
    prompt = cached = 0
    for event in raw.split(b"\n\n"):
        if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
            continue
        try:
            obj = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            continue
        for ch in obj.get("choices") or ():
            delta = ch.get("delta") or {}
            if delta.get("content"):
                text.append(delta["content"])
        usage = obj.get("usage")
        if usage:
            prompt = usage.get("prompt_tokens") or 0
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return "".join(text), prompt, cached


async def stream_chat(session: aiohttp.ClientSession, endpoint: str,
                      body: dict[str, object],
                      headers: Mapping[str, str] | None = None) -> tuple[Result, str]:
    """POST one streamed chat completion; (result, answer text). Never raises for HTTP or
    connection errors: they come back as a :class:`Result` with ``status``/``error``.
    ``headers`` are sent besides the content type (e.g. GIE's fairness and objective
    headers)."""
    t0 = time.monotonic()
    ttft = 0.0
    hdrs = {"content-type": "application/json", **headers} if headers else _JSON_HEADERS
    try:
        async with session.post(endpoint, data=orjson.dumps(body), headers=hdrs) as r:
            server = r.headers.get(SERVER_HEADER, "?")
            if r.status != 200:
                await r.read()
                return Result(r.status, server, 0.0, time.monotonic() - t0), ""
            chunks = []
            async for chunk in r.content.iter_any():
                # The first non-empty content (the role-only chunk, content "", may
                # arrive in the same read as the first token).
                if not ttft and _CONTENT.search(chunk):
                    ttft = time.monotonic() - t0
                chunks.append(chunk)
            answer, prompt, cached = _parse_sse(b"".join(chunks))
            lat = time.monotonic() - t0
            return Result(200, server, ttft or lat, lat, prompt, cached), answer
    except (TimeoutError, aiohttp.ClientError) as e:
        return Result(0, "", 0.0, time.monotonic() - t0, error=type(e).__name__), ""


async def run(url: str, workload: Workload, *, label: str, concurrency: int,
              max_requests: int, duration_s: float,
              progress: Callable[[Report], None] | None = None,
              progress_every_s: float = 1.0) -> Report:
    """Drive ``concurrency`` conversation workers until ``max_requests`` or ``duration_s``."""
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    report = Report(label)
    start = time.monotonic()
    deadline = start + duration_s
    budget = max_requests

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal budget
        conv = workload.new_conversation()
        while budget > 0 and time.monotonic() < deadline:
            budget -= 1
            result, answer = await stream_chat(session, endpoint, workload.next_turn(conv))
            report.results.append(result)
            if not result.error and result.status == 200 and workload.record_answer(conv, answer):
                continue
            conv = workload.new_conversation()

    async def ticker() -> None:
        while True:
            await asyncio.sleep(progress_every_s)
            report.elapsed_s = time.monotonic() - start
            if progress is not None:
                progress(report)

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        tick = asyncio.create_task(ticker())
        try:
            await asyncio.gather(*(worker(session) for _ in range(max(1, concurrency))))
        finally:
            tick.cancel()
    report.elapsed_s = time.monotonic() - start
    return report
