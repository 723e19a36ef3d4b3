"""What a shard reports and saves: its status, a consistent state for checkpoints, and the
restore from one. A part of ``Shard`` (its base class), kept apart to keep each file short."""

from __future__ import annotations

import time

import numpy as np

from pscore.variables import Variables
from psserver.consistency import make_policy
from psserver.records import ShardState, ShardStatus
from psserver.shard_parts import ShardParts


class Reports(ShardParts):
    """Status, snapshot, export and restore of a ``Shard``'s state (under its lock)."""

    # Periodic checkpoints by steps: the state is copied the moment the clock reaches a
    # multiple of this (0: never), so every shard of a job saves the same steps (a poller
    # reading the clock later would save at 54 here and 52 there).
    _capture_every = 0
    _captured: ShardState | None = None
    _captured_at = 0  # the clock of the last copy taken (or restored): none at the start

    def capture_every(self, steps: int) -> None:
        """Copies the state for a checkpoint whenever the clock reaches a multiple of
        ``steps`` (0: never); ``take_captured`` hands the copy over."""
        with self._cond:
            self._capture_every = steps

    def take_captured(self) -> ShardState | None:
        """The newest state copied at a multiple of the capture interval, once; else None."""
        with self._cond:
            state, self._captured = self._captured, None
            return state

    def _capture_due(self) -> None:
        """After an update (lock held): copies the state if the clock is at a multiple of the
        capture interval and no copy was taken at it yet."""
        every = self._capture_every
        if every and self._updates % every == 0 and self._updates > self._captured_at:
            self._captured_at = self._updates
            self._captured = self.export_state()

    def status(self) -> ShardStatus:
        """What the shard holds and who it counts, read without changing anything."""
        with self._cond:
            now = self._now()
            workers = {
                w: (self._finished.get(w, 0), self._members.seconds_since(w, now))
                for w in self._members.known()
            }
            age = -1.0 if self._checkpoint_time is None else now - self._checkpoint_time
            return ShardStatus(
                initialized=self._ready,
                job=self._agreement.job,
                clock=self._updates,
                workers=workers,
                live=self._members.live,
                total_bytes=self._state.nbytes,
                pushes_applied=self._counters["applied"],
                pushes_duplicate=self._counters["duplicate"],
                pushes_late=self._counters["late"],
                checkpoint_step=self._checkpoint_step,
                checkpoint_age_s=age,
                tables={
                    k: (t.rows, t.nbytes, t.evictions, t.spec.capacity)
                    for k, t in self._state.tables.items()
                },
                left=self._members.left,
                failure=self._failure,
                history=tuple((e, now - e.at) for e in self._history.events),
                pending=frozenset(self._members.pending),
                membership_counts=dict(self._history.counts),
            )

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of every variable (for tests and exports)."""
        with self._cond:
            return {k: v.copy() for k, v in self._state.values.items()}

    def export_state(self) -> ShardState | None:
        """A consistent copy of everything a checkpoint needs; None before initial values.

        Taken between updates, so a sync step is either wholly in it or not at all: pushes to
        the open step are left out (their workers' clocks say so) and get re-sent by the
        workers after a restart.
        """
        with self._cond:
            if not self._ready:
                return None
            job = self._agreement.job
            policy = self._policy
            assert job is not None and policy is not None
            finished = {
                w: policy.durable_clock(self._updates, f) for w, f in self._finished.items()
            }
            variables, slots, tables = self._state.export()
            return ShardState(
                job=job,
                variables=variables,
                slots=slots,
                updates=self._updates,
                finished=finished,
                counters=dict(self._counters),
                tables=tables,
                members=dict(self._members.joined),
                rosters=list(self._history.rosters),
                left=sorted(self._members.left),
            )

    def mark_checkpoint(self, state: ShardState) -> None:
        """Records that ``state`` is durable: workers may forget pushes it covers."""
        with self._cond:
            self._durable = dict(state.finished)
            self._checkpoint_step = state.updates
            # Its age counts from the file's write (a restored one was written long ago).
            ago = 0.0 if state.saved_at is None else max(0.0, time.time() - state.saved_at)
            self._checkpoint_time = self._now() - ago

    def restore(self, state: ShardState) -> None:
        """Becomes the shard that saved ``state`` (on a fresh shard, before serving).

        Raises:
            InvalidRequestError: the state does not match its own job.
        """
        restored = Variables.restored(state.job, state.variables, state.slots, state.tables)
        with self._cond:
            self._agreement.restore(state.job)
            self._policy = make_policy(state.job.mode, state.job.staleness, state.job.quorum)
            job = state.job
            self._members.start(
                job.num_workers, self._now(), job.elastic, state.members, job.min_workers
            )
            self._members.restore_left(state.left)
            self._history.restore(state.rosters)
            self._start_optimizer_side(state.job)
            self._state = restored
            self._updates = self._captured_at = state.updates
            self._finished = dict(state.finished)
            self._counters.update(state.counters)
            self._ready = True
            self._cond.notify_all()
        self.mark_checkpoint(state)
