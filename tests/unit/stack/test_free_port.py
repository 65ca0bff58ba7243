"""``free_port``: a port it handed out is not handed out again while unbound."""

from __future__ import annotations

import random
import socket

import pytest

from epp.stack import procs


def test_no_port_twice_even_when_the_draws_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    # draws that repeat (as two random draws can): each port still comes out once only
    ports = range(14000, 16000, 20)
    draws = iter([p for p in ports for _ in range(3)])
    monkeypatch.setattr(procs.random, "randint", lambda lo, hi: next(draws))
    seen = [procs.free_port() for _ in range(20)]
    assert len(set(seen)) == 20 and set(seen) <= set(ports)


def test_ports_come_back_free() -> None:
    for _ in range(20):
        port = procs.free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_the_memory_is_bounded() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        procs._remember(rng.randrange(10000, 30000))
    assert len(procs._handed_out) <= 2048 and len(procs._handed_out_order) == 2048
