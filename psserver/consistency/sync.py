"""Synchronous rule: one optimizer update per step from the average of every live worker's push.

A step is averaged over the workers that were members when it opened (its first read or push),
less any that leave or are dropped before pushing it. In an elastic job a worker joining while
step t is open trains from step t + 1; one joining before t opens trains from t (the two-phase
join in ``psserver/elastic.py`` makes every shard agree on which).

A round sums its pushes in worker order as they arrive: a push is added to the round's sum
once every lower worker id that may still push this step has been added (in a job of fixed
size every lower id, since a dropped worker may come back into the open step; in an elastic
job the step's lower members, since one that left or was dropped cannot). A push that arrives
before its turn is held until then, and the push that completes the round adds whatever is
held, in order. So the sum is the same additions in the same order as summing every push in
worker order at the close: bit-identical whatever order the pushes arrived in, and a replayed
round reproduces it exactly. The shard then applies once and advances its clock, which
releases pulls waiting for the next step. An open round holds the sum and the pushes that
came before their turn (bench/NOTES.md 27), not one gradient per pushed worker.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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
        self._pushed: set[int] = set()  # the workers whose push is in the open round
        self._sums = _Sums()  # the open round's pushes held, and their sum so far
        # Workers whose push, when it comes, is summed only at the round's close (``defer``).
        self._deferred: set[int] = set()
        # The workers whose pushes the last round to close averaged, in order (what a preview
        # of that round assumed: psserver/pipeline.py).
        self.last_closed: tuple[int, ...] = ()

    def push_ready(self, clocks: Clocks, worker: int, step: int) -> bool:
        # A push for a later step waits for the current round to close.
        return step <= clocks.updates

    def read_ready(self, clocks: Clocks, step: int) -> bool:
        return clocks.updates >= step

    def waiting_for(self, clocks: Clocks, step: int) -> str:
        missing = [w for w in clocks.members(clocks.updates) if w not in self._pushed]
        need = f"{self.quorum} pushes" if self.quorum else "every live worker's push"
        return (
            f"sync barrier: step {step} needs round {clocks.updates} complete ({need}); "
            f"pushed: {sorted(self._pushed)}, still waiting for workers {missing}"
        )

    def classify(self, clocks: Clocks, worker: int, step: int) -> str | None:
        if step < clocks.updates:
            # The step already closed: a retry if this worker was in it, else a late push.
            return "duplicate" if step < clocks.finished.get(worker, 0) else "late"
        if step == clocks.updates and worker in self._pushed:
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
        self._pushed.add(worker)
        self._sums.hold(worker, grads, owned)
        self._add_in_turn(clocks)
        return self._close_if_complete(clocks)

    def defer(self, worker: int) -> None:
        """``worker``'s push to the open round, when it comes, is added only once the round
        closes, not on its turn: a preview of the round (psserver/pipeline.py) reads its
        arrays until every push is in, and where the preview is the round's step its sum is
        never needed (the update the round returns sums on first use: ``_RoundMean``)."""
        self._deferred.add(worker)

    def membership_changed(self, clocks: Clocks) -> Mapping[str, Any] | None:
        if self._pushed:
            self._add_in_turn(clocks)  # a lower member gone: pushes after it may be added
            return self._close_if_complete(clocks)
        if clocks.joined and clocks.live and not clocks.members(clocks.updates):
            # Elastic: every member of the open step left before pushing it, and the members
            # now joined after it: it can never close with a push, so it closes with none.
            return {}
        return None

    def turn(self, clocks: Clocks, worker: int, step: int) -> bool:
        # Every lower worker the open round waits for has pushed. Not with quorum: the round's
        # pushes are whichever come first. A lower worker that is not live (dropped) is not
        # waited for: it may never come back (if it does, the rule holds what came after it).
        if self.quorum or step != clocks.updates:
            return True
        members = clocks.members(clocks.updates) if clocks.joined else sorted(clocks.live)
        if len(members) <= 2:
            # Two pushes: the round's peak holds both whatever the order (on its turn the
            # second is read while the first is the sum; before it, the second is read and
            # held while the first arrives), so a wait would only serialise the reads.
            return True
        return all(w in self._pushed for w in members if w < worker)

    def _add_in_turn(self, clocks: Clocks) -> None:
        """Adds the held pushes whose turn has come, lowest worker first (up to a deferred
        one: those after it wait for the close too)."""
        held = self._sums.held
        while held:
            worker = min(held)
            if worker in self._deferred or not self._turn(clocks, worker):
                return
            self._sums.add(worker)

    def _turn(self, clocks: Clocks, worker: int) -> bool:
        """Whether no lower worker id can still push into the open round before ``worker``."""
        if clocks.joined:  # elastic: the step's members; one gone cannot come back into it
            return all(m in self._pushed for m in clocks.members(clocks.updates) if m < worker)
        return all(w in self._pushed for w in range(worker))

    def _close_if_complete(self, clocks: Clocks) -> Mapping[str, Any] | None:
        pushed = self._pushed
        enough = self.quorum > 0 and len(pushed) >= self.quorum
        if not (enough or self._all_pushed(clocks)):
            return None
        count = len(pushed)
        self.last_closed = tuple(sorted(pushed))
        sums, deferred = self._sums, self._deferred & set(self._sums.held)
        self._pushed, self._sums, self._deferred = set(), _Sums(), set()
        if deferred:
            return _RoundMean(sums, count)
        return sums.mean(count)

    def _all_pushed(self, clocks: Clocks) -> bool:
        """Every member of the open step has pushed it (a job of fixed size: every live one)."""
        pushed = self._pushed
        if not clocks.joined:
            return clocks.live <= pushed
        return all(w in pushed for w in clocks.members(clocks.updates))

    def pending_bytes(self) -> int:
        return self._sums.nbytes()


class _Sums:
    """One round's pushes: those held (not added yet) and the sum of those added, in worker
    order."""

    def __init__(self) -> None:
        self.held: dict[int, Mapping[str, Any]] = {}  # pushes not added yet
        self._owned: set[int] = set()  # held workers whose arrays are ours to change
        self._sum: dict[str, np.ndarray] = {}  # dense gradients added so far, in worker order
        # Sums that are still a push's own array, not ours to change (read-only, as Flight
        # decodes a tensor that arrived in one batch): replaced, never written, by the next add.
        self._borrowed: set[str] = set()
        self._rows: dict[str, list[RowSparse]] = {}  # table rows added so far, in order

    def hold(self, worker: int, grads: Mapping[str, Any], owned: bool) -> None:
        self.held[worker] = grads
        if owned:
            self._owned.add(worker)

    def add(self, worker: int) -> None:
        """Adds ``worker``'s held push to the round's sum (every lower one is in already)."""
        grads = self.held.pop(worker)
        mine = worker in self._owned
        self._owned.discard(worker)
        for key, grad in grads.items():
            if isinstance(grad, RowSparse):
                self._rows.setdefault(key, []).append(grad)
                continue
            acc = self._sum.get(key)
            if acc is None:
                # The first push's own array when it was decoded for this call alone: no copy,
                # one model copy less while a step is open (the same additions, in the same
                # order); borrowed while it is read-only.
                flags = grad.flags
                if mine and flags.c_contiguous:
                    if not flags.writeable:
                        self._borrowed.add(key)
                    self._sum[key] = grad
                else:
                    self._sum[key] = grad.copy()
            elif key in self._borrowed:
                self._borrowed.discard(key)
                with np.errstate(over="ignore"):  # an overflow is refused when applied
                    self._sum[key] = np.add(acc, grad, out=np.empty_like(acc))
            else:
                with np.errstate(over="ignore"):  # an overflow is refused when applied
                    acc += grad

    def keys(self) -> list[str]:
        """Every key the round's mean will hold."""
        keys = dict.fromkeys([*self._sum, *self._rows])
        for grads in self.held.values():
            keys.update(dict.fromkeys(grads))
        return list(keys)

    def mean(self, count: int) -> dict[str, Any]:
        """The round's update: the rest added in worker order (no other push joins it), then
        averaged over ``count`` pushes."""
        while self.held:
            self.add(min(self.held))
        mean = self._sum
        for key, acc in mean.items():
            if acc.dtype.kind == "f":
                if key not in self._borrowed:
                    acc /= acc.dtype.type(count)
                elif count != 1:  # x / 1 is x, bit for bit: a lone push's array is the mean
                    mean[key] = np.divide(acc, acc.dtype.type(count), out=np.empty_like(acc))
            else:  # integer buffers such as BatchNorm's num_batches_tracked
                mean[key] = acc // count
        self._borrowed.clear()
        update: dict[str, Any] = dict(mean)
        for key, parts in self._rows.items():
            # A row only some workers touched averages with zeros from the rest, exactly as a
            # dense gradient would.
            with np.errstate(over="ignore"):  # an overflow is refused when applied
                ids, values = sum_duplicates(
                    np.concatenate([p.ids for p in parts]),
                    np.concatenate([p.values for p in parts]),
                )
                values /= values.dtype.type(count)
            update[key] = RowSparse(ids, values)
        return update

    def nbytes(self) -> int:
        held = sum(g.nbytes for grads in self.held.values() for g in grads.values())
        rows = sum(p.nbytes for parts in self._rows.values() for p in parts)
        return held + rows + sum(a.nbytes for a in self._sum.values())


class _RoundMean(Mapping[str, Any]):
    """A closed round's update whose sum is made on first use: its keys are known at once,
    and a round whose predicted step is installed (psserver/pipeline.py) never sums."""

    def __init__(self, sums: _Sums, count: int) -> None:
        self._sums: _Sums | None = sums
        self._count = count
        self._keys = sums.keys()
        self._mean: dict[str, Any] | None = None

    def _made(self) -> dict[str, Any]:
        if self._mean is None:
            assert self._sums is not None
            self._mean, self._sums = self._sums.mean(self._count), None
        return self._mean

    def __getitem__(self, key: str) -> Any:
        return self._made()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
