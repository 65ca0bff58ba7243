"""A small, bounded load generator: OpenAI chat requests through a gateway URL.

Reusable by the demo and benchmarks. Every run is bounded by a request count and a
deadline and stops by itself.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import orjson

SERVER_HEADER = "x-sim-server"

SYSTEM_PROMPTS = (
    "You are a helpful assistant for a travel agency. Answer briefly and politely.",
    "You are a senior Python reviewer. Point out bugs first, then style issues.",
    "You are a support agent for a cloud provider. Ask for the region before answering.",
)
QUESTIONS = (
    "What should I pack for a week in Lisbon in March?",
    "Why does this function leak file handles when it raises?",
    "My instance will not boot after resizing the disk. What can I check?",
    "Summarise the trade-offs of continuous batching.",
    "How do I rotate credentials without downtime?",
)


@dataclass(frozen=True, slots=True)
class Result:
    status: int
    server: str
    latency_s: float
    error: str = ""


@dataclass
class LoadReport:
    results: list[Result] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.status == 200]

    def share(self) -> Counter[str]:
        return Counter(r.server for r in self.ok)

    def errors(self) -> Counter[str]:
        return Counter(r.error or str(r.status) for r in self.results if r.status != 200)

    def latency_quantile(self, q: float) -> float:
        lat = sorted(r.latency_s for r in self.ok)
        if not lat:
            return float("nan")
        return lat[min(len(lat) - 1, int(q * len(lat)))]


def chat_body(rng: random.Random, model: str, max_tokens: int = 16) -> bytes:
    return orjson.dumps({
        "model": model,
        "max_tokens": max_tokens,
        "messages": [
            {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
            {"role": "user", "content": rng.choice(QUESTIONS)},
        ],
    })


async def run_load(url: str, *, requests: int, concurrency: int, model: str = "sim-model",
                   deadline_s: float = 120.0, seed: int = 1) -> LoadReport:
    """Send ``requests`` chat completions to ``url`` with ``concurrency`` workers."""
    rng = random.Random(seed)
    bodies = [chat_body(rng, model) for _ in range(requests)]
    report = LoadReport()
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=30)

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.monotonic() - start < deadline_s:
            try:
                body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t0 = time.monotonic()
            try:
                async with session.post(endpoint, data=body,
                                        headers={"content-type": "application/json"}) as r:
                    await r.read()
                    report.results.append(Result(r.status, r.headers.get(SERVER_HEADER, "?"),
                                                 time.monotonic() - t0))
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                report.results.append(Result(0, "", time.monotonic() - t0, type(e).__name__))

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(max(1, concurrency))))
    report.elapsed_s = time.monotonic() - start
    return report
