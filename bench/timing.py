"""Interleaved timing of several systems doing the same step, so noise hits them all alike."""

from __future__ import annotations

import time
from collections.abc import Callable

# A step returns its own duration in seconds when it timed itself (a child process that must not
# count the pipe to it), or None to be timed here around the call.
Step = Callable[[], float | None]


def interleave(steps: dict[str, Step], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Times ``rounds`` calls of every step, one of each in turn, after ``warmup`` untimed ones.

    The order rotates every round so no system always runs right after the same neighbour.
    """
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            own = steps[name]()
            times[name].append(own if own is not None else time.perf_counter() - t0)
    return times
