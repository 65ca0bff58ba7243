"""Summarise a py-spy raw profile: top self and inclusive frames.

    .venv/bin/python -m bench.pyspy_top FILE.raw [N]
"""

from __future__ import annotations

import sys
from collections import Counter


def main() -> None:
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    with open(path) as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            c = int(count)
            total += c
            frames = stack.split(";")
            own[frames[-1]] += c
            for f in set(frames):
                incl[f] += c
    print(f"{total} samples\n-- self")
    for f, c in own.most_common(n):
        print(f"{100 * c / total:5.1f}% {f[:140]}")
    print("-- inclusive (project code)")
    for f, c in incl.most_common():
        if "/epp/" in f:
            print(f"{100 * c / total:5.1f}% {f[:140]}")


if __name__ == "__main__":
    main()
