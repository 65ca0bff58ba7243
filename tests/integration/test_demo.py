"""`epp demo` end to end: the README's main command, short, with its summary checked."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def ports_in(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", text)]


def test_demo_runs_and_summarises() -> None:
    r = subprocess.run([sys.executable, "-m", "epp.cli", "demo", "--duration", "2",
                        "--servers", "3", "--concurrency", "8"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    for needle in ("EPP:", "round-robin:", "TTFT p50", "TTFT p90", "prefix-cache hit rate",
                   "throughput", "pod 0", "pod 2",
                   "response lean"):  # the shipped gateway shape is the default
        assert needle in out, needle
    # The per-pod counts add up; conversations sharing a system prompt may share a pod
    # (prefix affinity), but 4 prompts do not all land on one pod.
    epp_part = out.split("EPP:")[-1].split("round-robin:")[0]
    counts = [int(m) for m in re.findall(r"pod \d \(sim-\d+\s*\)\s+(\d+)", epp_part)]
    total = int(re.search(r"EPP: (\d+) requests", out).group(1))  # type: ignore[union-attr]
    assert len(counts) == 3 and sum(counts) == total and total > 0
    assert sum(c > 0 for c in counts) >= 2
    # The summary ends with the verdict, computed from the table above it, and the doc.
    last = out.strip().splitlines()
    assert last[-1] == ("How to read these numbers: docs/local-stack.md, "
                        "\"Reading the demo's summary\"."), last[-1]
    verdict = last[-2]
    assert verdict.startswith("Verdict: ") and " Why: the EPP sent " in verdict, verdict
    for needle in ("computed / request", "in the pods", "outside (gateway, HTTP)"):
        assert needle in out, needle
    row = re.search(r"TTFT p90 +(\d+) ms +(\d+) ms", out)
    assert row is not None, out
    epp_p90, rr_p90 = int(row.group(1)), int(row.group(2))
    said = verdict.split(" Why: ")[0]
    if abs(epp_p90 - rr_p90) > 0.1 * max(epp_p90, rr_p90):  # clear of the 3% "even" band
        winner = "the EPP won on" if epp_p90 < rr_p90 else "round robin won on"
        part = next(p for p in said.split("; ") if "TTFT p90" in p)
        assert winner in part, (winner, verdict)
    # Nothing is left listening.
    for port in set(ports_in(out)):
        assert not port_open(port), port


def _sigint_as_in_a_terminal() -> None:
    """Ctrl-C in a terminal: SIGINT at its default action. A test run started as a
    background job of a non-interactive shell has SIGINT ignored, and an ignored signal is
    inherited: Python then installs no KeyboardInterrupt handler, as for any program."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def test_demo_keep_running_stops_everything_on_ctrl_c() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", "demo", "--duration", "1", "--servers", "2",
        "--concurrency", "2", "--no-compare", "--keep-running", "--response-path", "observer",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=ROOT,
        preexec_fn=_sigint_as_in_a_terminal)
    assert proc.stdout is not None
    seen = []
    try:
        async with asyncio.timeout(90):
            while True:
                line = (await proc.stdout.readline()).decode()
                assert line, "".join(seen)
                seen.append(line)
                if "keeps running" in line:
                    break
        text = "".join(seen)
        assert "response observer" in text and "EPP: " in text and " 0 errors" in text, text
        gateway = int(re.search(r"gateway  http://127\.0\.0\.1:(\d+)", text).group(1))  # type: ignore[union-attr]
        assert port_open(gateway)
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            rest = (await proc.stdout.read()).decode()
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 130, rest
    assert "stopped" in rest
    for port in set(ports_in(text)):
        assert not port_open(port), port


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), from /proc."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat.rpartition(")")[2].split()
        parent[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
async def test_demo_keep_running_stops_everything_on_sigterm_and_sighup(
        sig: signal.Signals) -> None:
    # Both gateways (--compare, the default): two sim processes, the EPP and two Envoys.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", "demo", "--duration", "1", "--servers", "2",
        "--concurrency", "2", "--keep-running", "--sim-args", "--time-scale 0.25",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=ROOT)
    assert proc.stdout is not None
    seen = []
    try:
        async with asyncio.timeout(90):
            while True:
                line = (await proc.stdout.readline()).decode()
                assert line, "".join(seen)
                seen.append(line)
                if "keeps running" in line:
                    break
        text = "".join(seen)
        children = descendants(proc.pid)
        assert len(children) >= 5, (children, text)  # 2 sims, the EPP, 2 Envoys (+ forks)
        proc.send_signal(sig)
        async with asyncio.timeout(30):
            rest = (await proc.stdout.read()).decode()
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 128 + sig, rest
    assert f"{sig.name}: stopped" in rest, rest
    assert not [p for p in children if alive(p)], rest
    for port in set(ports_in(text)):
        assert not port_open(port), port
