"""Bounded staleness (SSP): apply on arrival, but no worker runs more than s steps ahead.

A worker that has finished c steps may start step c+1 only when every live worker has finished
at least c - s steps. s=0 is lock-step; a very large s is asynchronous.
"""

from __future__ import annotations

from psserver.consistency.base import Clocks, ConsistencyPolicy


class StalenessPolicy(ConsistencyPolicy):
    name = "ssp"

    def __init__(self, staleness: int) -> None:
        self.staleness = staleness

    def read_ready(self, clocks: Clocks, step: int) -> bool:
        return clocks.min_live() >= step - self.staleness

    def push_ready(self, clocks: Clocks, worker: int, step: int) -> bool:
        return self.read_ready(clocks, step)

    def waiting_for(self, clocks: Clocks, step: int) -> str:
        need = step - self.staleness
        lag = {w: clocks.finished.get(w, 0) for w in clocks.laggards(need)}
        return (
            f"ssp gate (staleness {self.staleness}) at step {step}: needs every worker to have "
            f"finished {need} steps; behind (worker: steps finished): {lag}"
        )

    def join_clock(self, clocks: Clocks, worker: int) -> int:
        # A worker registering for the first time in a job of fixed size starts at its own
        # step 0: it is credited with no step it never ran (the others wait for it within the
        # bound, as ssp means). A returning one (dropped, restarted) starts level with the
        # slowest of the others, so it neither blocks them nor runs ahead of the bound.
        if worker not in clocks.finished:
            return 0
        return self.join_step(clocks, worker)

    def join_step(self, clocks: Clocks, worker: int) -> int:
        # An elastic joiner counts from its join: level with the slowest member.
        mine = clocks.finished.get(worker, 0)
        others = [clocks.finished.get(w, 0) for w in clocks.live if w != worker]
        return max(mine, min(others)) if others else mine
