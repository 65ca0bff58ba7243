"""The same requests get the same decisions as before the framework refactor (issue 13).

tests/golden/decisions.py replays a fixed request sequence through every shipped config;
decisions.json is its record from before the refactor.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from tests.golden.decisions import CONFIGS, replay

GOLDEN = orjson.loads((Path(__file__).parent / "decisions.json").read_bytes())


def test_every_shipped_config_is_covered() -> None:
    assert sorted(GOLDEN) == sorted(CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
def test_same_decisions(config: str) -> None:
    got = orjson.loads(orjson.dumps(asyncio.run(replay(config))))
    want = GOLDEN[config]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == w, f"{config}: request {w['i']} decided differently"
