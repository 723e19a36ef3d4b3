"""Who is in a shard's job: registration, heartbeats, leaving, and dropping the silent. A part of
``Shard`` (its base class), kept apart to keep each file short."""

from __future__ import annotations

import threading

from psserver.records import Registration
from psserver.shard_parts import ShardParts
from pswire.errors import InvalidRequestError, ModelMismatchError, TooLargeError


class Roster(ShardParts):
    """Registration, heartbeats, leaving and expiry of a ``Shard``'s workers (its lock held)."""

    def register_worker(self, worker_id: int, num_workers: int, session: str = "") -> Registration:
        """Records a worker (new, restarted or reconnecting); says where it (re)joins.

        In an elastic job only a member resumes; another worker joins (``Shard.join``) and is
        told the earliest step it could join at. A new process taking over a member's id ends
        that membership ("replaced"): the new one joins afresh.

        Raises:
            InvalidRequestError: ids out of range.
            TooLargeError: more workers than the shard's limit.
            ModelMismatchError: ``num_workers`` differs from the job's.
            DuplicateWorkerError: another live process holds this worker id.
        """
        if num_workers < 1 or not 0 <= worker_id < num_workers:
            raise InvalidRequestError(
                f"worker_id {worker_id} must be in [0, num_workers) with num_workers >= 1, "
                f"got num_workers {num_workers}"
            )
        if num_workers > self.limits.max_workers:
            raise TooLargeError(
                f"num_workers {num_workers} is over this shard's limit of {self.limits.max_workers}"
            )
        with self._cond:
            job = self._agreement.job
            if job is not None and job.num_workers != num_workers:
                raise ModelMismatchError(
                    f"worker {worker_id} says num_workers {num_workers}; the job on this shard "
                    f"has {job.num_workers}"
                )
            holder = self._members.holder(worker_id)
            self._members.claim(worker_id, session, self._now())
            member = worker_id in self._members.live_view
            if self._members.elastic and member and holder not in (None, session):
                self._members.drop(worker_id)
                self._record(self._finished.get(worker_id, 0), worker_id, "replaced")
                self._membership_changed()
                member = False
            self._touch(worker_id)
            if self._members.elastic and not member and self._policy is not None:
                clock = self._policy.join_step(self._clocks(), worker_id)
                return Registration(clock, self._ready, 0, job.job_id if job else "")
            if self._policy is not None:
                # A worker that fell behind (dropped, restarted) resumes at the current step.
                joined = self._policy.join_clock(self._clocks(), worker_id)
                self._finished[worker_id] = max(self._finished.get(worker_id, 0), joined)
            return Registration(
                self._finished.get(worker_id, 0),
                self._ready,
                self._durable.get(worker_id, 0),
                job.job_id if job is not None else "",
            )

    def heartbeat(self, worker_id: int, session: str = "") -> int:
        """Marks a worker alive; returns the steps it has finished here.

        Raises:
            InvalidRequestError: an id outside the job's workers (before a job: the limit).
            DuplicateWorkerError: another process holds this worker id now.
        """
        with self._cond:
            job = self._agreement.job
            self._check_worker(
                worker_id, job.num_workers if job else self.limits.max_workers, "heartbeat"
            )
            self._members.check(worker_id, session)
            self._touch(worker_id)
            return self._finished.get(worker_id, 0)

    def leave(self, worker_id: int, session: str = "") -> None:
        """A worker leaves the job (its client closed): it no longer counts in the sync quorum
        or the ssp gate, and a round waiting only on it closes now.

        Raises:
            InvalidRequestError: an id outside the job's workers.
            DuplicateWorkerError: another process holds this worker id now.
        """
        with self._cond:
            job = self._agreement.job
            if job is None:
                return
            self._check_worker(worker_id, job.num_workers, "leave")
            self._members.check(worker_id, session)
            member = worker_id in self._members.live_view
            if self._members.leave(worker_id):
                if member:
                    self._record(self._finished.get(worker_id, 0), worker_id, "left")
                self._membership_changed()

    def expire_silent(self) -> list[int]:
        """Drops workers silent past the heartbeat timeout (see ``Membership.expire``); a sync
        step waiting only on them closes now. The server calls this on a timer; reads
        (``status``, metrics) never do."""
        with self._cond:
            return self._expire()

    def _expire(self) -> list[int]:
        """``Membership.expire``, the drops recorded, the rule told (lock held)."""
        if self._policy is None:
            return []
        before = set(self._members.live_view)
        changed = self._members.expire(self._now())
        for worker in sorted(before - self._members.live_view):
            self._record(self._finished.get(worker, 0), worker, "dropped")
        if changed:
            self._membership_changed()
        return changed

    def _absent(self) -> tuple[int, ...]:
        """The job's workers out of the quorum now (sync and ssp jobs of fixed size)."""
        job = self._agreement.job
        if job is None or job.mode == "async" or job.elastic:
            return ()
        live = self._members.live_view
        return tuple(w for w in range(job.num_workers) if w not in live)

    def _wait_agreed(
        self, worker_id: int, timeout: float | None, cancelled: threading.Event | None
    ) -> None:
        """Waits for the initial values and, in a job restored from a checkpoint, for worker
        0's declaration when this worker declared other hyper-parameters (only worker 0 sets
        them: applying the checkpoint's meanwhile would be silently wrong); then refuses a
        worker whose declaration is not the job (lock held).

        Raises:
            ModelMismatchError: this worker declared another job than the shard's.
            WaitTimeoutError: worker 0 did not declare within the deadline.
        """
        self._wait_values(timeout, cancelled)
        if self._agreement.awaiting(worker_id):
            self._wait(
                lambda: not self._agreement.awaiting(worker_id),
                timeout,
                cancelled,
                lambda: (
                    f"worker 0's init: worker {worker_id} declared other hyper-parameters than "
                    "the job in this shard's checkpoint, and only worker 0 changes them"
                ),
            )
        self._agreement.check(worker_id)
