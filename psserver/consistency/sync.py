"""Synchronous rule: one optimizer update per step from the average of every live worker's push.

A step is averaged over the workers that were members when it opened (its first read or push),
less any that leave or are dropped before pushing it. In an elastic job a worker joining while
step t is open trains from step t + 1; one joining before t opens trains from t (the two-phase
join in ``psserver/elastic.py`` makes every shard agree on which).

The round's pushes are held under the shard's lock; the push that completes it averages them
in worker order (so the result is bit-identical whatever order they arrived in, and a replayed
round reproduces it exactly), and the shard applies once and advances its clock, which
releases pulls waiting for the next step. An open round holds one gradient per pushed worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pscore.tables import RowSparse, sum_duplicates
from psserver.consistency.base import Clocks, ConsistencyPolicy


class SyncPolicy(ConsistencyPolicy):
    """``quorum`` k > 0: a step closes after its first k pushes (backup workers); later pushes
    for it are dropped as late. 0: it closes when every live worker has pushed."""

    name = "sync"

    def __init__(self, quorum: int = 0) -> None:
        self.quorum = quorum
        self._pushes: dict[int, Mapping[str, Any]] = {}
        self._owned: set[int] = set()  # workers whose pushed arrays are ours to change

    def push_ready(self, clocks: Clocks, worker: int, step: int) -> bool:
        # A push for a later step waits for the current round to close.
        return step <= clocks.updates

    def read_ready(self, clocks: Clocks, step: int) -> bool:
        return clocks.updates >= step

    def waiting_for(self, clocks: Clocks, step: int) -> str:
        missing = [w for w in clocks.members(clocks.updates) if w not in self._pushes]
        need = f"{self.quorum} pushes" if self.quorum else "every live worker's push"
        return (
            f"sync barrier: step {step} needs round {clocks.updates} complete ({need}); "
            f"pushed: {sorted(self._pushes)}, still waiting for workers {missing}"
        )

    def classify(self, clocks: Clocks, worker: int, step: int) -> str | None:
        if step < clocks.updates:
            # The step already closed: a retry if this worker was in it, else a late push.
            return "duplicate" if step < clocks.finished.get(worker, 0) else "late"
        if step == clocks.updates and worker in self._pushes:
            return "duplicate"
        return None

    def join_clock(self, clocks: Clocks, worker: int) -> int:
        return max(clocks.finished.get(worker, 0), clocks.updates)

    def join_step(self, clocks: Clocks, worker: int) -> int:
        # The open step's members are fixed: a joiner waits for the next one.
        return clocks.updates + (1 if clocks.opened >= clocks.updates else 0)

    def durable_clock(self, updates: int, finished: int) -> int:
        # Pushes into the open step are not in a checkpoint taken now.
        return min(finished, updates)

    def submit(
        self,
        clocks: Clocks,
        worker: int,
        step: int,
        grads: Mapping[str, Any],
        owned: bool = False,
    ) -> Mapping[str, Any] | None:
        self._pushes[worker] = grads
        if owned:
            self._owned.add(worker)
        return self._close_if_complete(clocks)

    def membership_changed(self, clocks: Clocks) -> Mapping[str, Any] | None:
        if self._pushes:
            return self._close_if_complete(clocks)
        if clocks.joined and clocks.live and not clocks.members(clocks.updates):
            # Elastic: every member of the open step left before pushing it, and the members
            # now joined after it: it can never close with a push, so it closes with none.
            return {}
        return None

    def _close_if_complete(self, clocks: Clocks) -> Mapping[str, Any] | None:
        pushed = self._pushes.keys()
        enough = self.quorum > 0 and len(pushed) >= self.quorum
        if not (enough or self._all_pushed(clocks)):
            return None
        count = len(self._pushes)
        mean: dict[str, np.ndarray] = {}
        rows: dict[str, list[RowSparse]] = {}
        for worker in sorted(self._pushes):
            for key, grad in self._pushes[worker].items():
                if isinstance(grad, RowSparse):
                    rows.setdefault(key, []).append(grad)
                    continue
                acc = mean.get(key)
                if acc is None:
                    # The first push's own array when it is ours to change: one model copy
                    # less while a step is open (the same additions, in the same order).
                    flags = grad.flags
                    mine = worker in self._owned and flags.writeable and flags.c_contiguous
                    mean[key] = grad if mine else grad.copy()
                else:
                    with np.errstate(over="ignore"):  # an overflow is refused when applied
                        acc += grad
        for key, acc in mean.items():
            if acc.dtype.kind == "f":
                acc /= acc.dtype.type(count)
            else:  # integer buffers such as BatchNorm's num_batches_tracked
                mean[key] = acc // count
        update: dict[str, Any] = dict(mean)
        for key, parts in rows.items():
            # A row only some workers touched averages with zeros from the rest, exactly as a
            # dense gradient would.
            with np.errstate(over="ignore"):  # an overflow is refused when applied
                ids, values = sum_duplicates(
                    np.concatenate([p.ids for p in parts]),
                    np.concatenate([p.values for p in parts]),
                )
                values /= values.dtype.type(count)
            update[key] = RowSparse(ids, values)
        self._pushes = {}
        self._owned = set()
        return update

    def _all_pushed(self, clocks: Clocks) -> bool:
        """Every member of the open step has pushed it (a job of fixed size: every live one)."""
        pushed = self._pushes.keys()
        if not clocks.joined:
            return clocks.live <= pushed
        return all(w in pushed for w in clocks.members(clocks.updates))

    def pending_bytes(self) -> int:
        return sum(g.nbytes for grads in self._pushes.values() for g in grads.values())
