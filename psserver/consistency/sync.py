"""Synchronous rule: one optimizer update per step from the average of every live worker's push.

The round is accumulated under the shard's lock; the push that completes it averages, and the
shard applies once and advances its clock, which releases pulls waiting for the next step.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from psserver.consistency.base import Clocks, ConsistencyPolicy


class SyncPolicy(ConsistencyPolicy):
    name = "sync"

    def __init__(self) -> None:
        self._sum: dict[str, np.ndarray] = {}
        self._pushed: set[int] = set()

    def push_ready(self, clocks: Clocks, worker: int, step: int) -> bool:
        # A push for a later step waits for the current round to close.
        return step <= clocks.updates

    def read_ready(self, clocks: Clocks, step: int) -> bool:
        return clocks.updates >= step

    def waiting_for(self, clocks: Clocks, step: int) -> str:
        missing = sorted(clocks.live - self._pushed)
        return (
            f"sync barrier: step {step} needs round {clocks.updates} complete; "
            f"pushed: {sorted(self._pushed)}, still waiting for workers {missing}"
        )

    def is_duplicate(self, clocks: Clocks, worker: int, step: int) -> bool:
        if step < clocks.updates:
            return True  # round already closed: a retry, or a late push from a dropped worker
        return step == clocks.updates and worker in self._pushed

    def submit(
        self, clocks: Clocks, worker: int, step: int, grads: Mapping[str, np.ndarray]
    ) -> Mapping[str, np.ndarray] | None:
        for key, grad in grads.items():
            acc = self._sum.get(key)
            if acc is None:
                self._sum[key] = np.array(grad, copy=True)  # owns memory: the push's may not
            else:
                acc += grad
        self._pushed.add(worker)
        return self._close_if_complete(clocks)

    def membership_changed(self, clocks: Clocks) -> Mapping[str, np.ndarray] | None:
        return self._close_if_complete(clocks) if self._pushed else None

    def _close_if_complete(self, clocks: Clocks) -> Mapping[str, np.ndarray] | None:
        if not clocks.live <= self._pushed:
            return None
        count = len(self._pushed)
        mean = self._sum
        for key, acc in mean.items():
            if acc.dtype.kind == "f":
                acc /= acc.dtype.type(count)
            else:  # integer buffers such as BatchNorm's num_batches_tracked
                mean[key] = acc // count
        self._sum = {}
        self._pushed = set()
        return mean

    def pending_bytes(self) -> int:
        return sum(a.nbytes for a in self._sum.values())
