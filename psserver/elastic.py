"""Joining an elastic job: the two-phase join that makes every shard count a new worker from the
same step, the members of each step, and the checks on who may push. A part of ``Shard`` (its
base class), kept apart to keep each file short.

Why two phases: a worker pushes to every shard, and each shard closes its sync steps on its own.
Were a joiner simply counted from "the current step" by each shard, a shard a little ahead would
count it a step later than one behind, and the two would average one step over different
workers. So the joiner first asks every shard for the earliest step it could join at
(``propose``), then ``prepare``s the largest of them everywhere: a shard holds that step from
opening until the worker ``commit``s (or aborts), and refuses a step it has already opened,
naming the one it could take instead, which the worker then prepares everywhere.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pscore.job import OBSERVER, Job
from psserver.consistency import ConsistencyPolicy
from psserver.shard_parts import ShardParts
from pswire.errors import InvalidRequestError, WorkerDroppedError

PHASES = ("propose", "prepare", "commit", "abort")


@dataclass(frozen=True)
class JoinResult:
    accepted: bool
    step: int  # propose, a refused prepare: the earliest step this shard takes
    members: tuple[int, ...] = ()


@dataclass(frozen=True)
class MembersView:
    """The members training at one step, and every change of members before it."""

    step: int
    members: tuple[int, ...]
    rosters: tuple[tuple[int, tuple[int, ...]], ...]
    min_workers: int
    max_workers: int


class Joins(ShardParts):
    """The elastic side of a ``Shard``: joins, members per step, the push check, the waits'
    messages (its lock held)."""

    def join(self, worker_id: int, session: str, phase: str, step: int = 0) -> JoinResult:
        """One phase of an elastic join (see the module's docstring).

        Raises:
            NotInitializedError: no job yet.
            InvalidRequestError: the job is not elastic, a worker id not below its maximum of
                workers, an unknown phase, a worker that is a member already, a commit without
                a prepare at that step, or a step far ahead.
            DuplicateWorkerError: another process holds this worker id.
        """
        if phase not in PHASES:
            raise InvalidRequestError(f"join phase {phase!r}; expected one of {list(PHASES)}")
        with self._cond:
            self._elastic_job(worker_id)
            self._members.check(worker_id, session)
            self._touch(worker_id)
            policy = self._require_policy()
            if phase == "abort":
                if self._members.abort(worker_id):
                    self._membership_changed()
                return JoinResult(True, step)
            joined = self._members.joined.get(worker_id)
            if joined is not None and worker_id in self._members.live_view:
                if phase == "commit" and joined == step:
                    return JoinResult(True, step, tuple(self._clocks().members(step)))
                raise InvalidRequestError(
                    f"worker {worker_id} asks to {phase} a join, but it is a member already "
                    f"(since step {joined})"
                )
            if phase == "commit":
                return self._commit(worker_id, step)
            earliest = policy.join_step(self._clocks(), worker_id)
            if phase == "propose":
                return JoinResult(True, earliest)
            if step < earliest:
                self._members.abort(worker_id)
                self._membership_changed()
                return JoinResult(False, earliest)
            limit = self.limits.max_step_ahead
            if step > earliest + limit:
                raise InvalidRequestError(
                    f"worker {worker_id} prepares to join at step {step}, but this shard takes "
                    f"joins from step {earliest} (at most {limit} ahead)"
                )
            moved = self._members.pending.get(worker_id) not in (None, step)
            self._members.prepare(worker_id, step, self._now())
            if moved:
                self._membership_changed()  # the step it held before may open now
            return JoinResult(True, step)

    def list_members(
        self,
        worker_id: int,
        step: int,
        timeout: float | None = None,
        cancelled: threading.Event | None = None,
    ) -> MembersView:
        """The members that train at ``step`` (in sync: as the step opened), once a worker may
        read at it (this opens it), and the rosters before it.

        Raises:
            NotInitializedError, InvalidRequestError: no elastic job; a worker outside it.
            WaitTimeoutError: the step did not open in time (the message says what it lacks).
            UnavailableError, CallCancelledError: the shard is stopping; the caller went away.
        """
        with self._cond:
            job = self._elastic_job(worker_id, reader=True)
            policy = self._require_policy()
            self._touch(worker_id)
            self._wait(
                lambda: (
                    policy.read_ready(self._clocks(), step) and policy.admits(self._clocks(), step)
                ),
                timeout,
                cancelled,
                lambda: f"members at step {step}: " + self._waiting_for(policy, step),
            )
            self._open(step)
            rosters = tuple((s, m) for s, m in self._history.rosters if s <= step)
            return MembersView(
                step,
                self._history.roster_at(step),
                rosters,
                job.min_workers,
                job.max_workers,
            )

    def _commit(self, worker_id: int, step: int) -> JoinResult:
        """Makes a prepared join a membership (lock held).

        Raises:
            InvalidRequestError: no join prepared at ``step``.
        """
        prepared = self._members.pending.get(worker_id)
        if prepared != step:
            raise InvalidRequestError(
                f"worker {worker_id} commits a join at step {step}, but "
                + (
                    "prepared none here (or it was dropped: silent too long)"
                    if prepared is None
                    else f"prepared step {prepared} here"
                )
            )
        self._members.commit(worker_id, step)
        self._finished[worker_id] = step
        self._record(step, worker_id, "joined")
        self._membership_changed()
        return JoinResult(True, step, tuple(self._clocks().members(step)))

    def _check_member(self, worker_id: int, step: int) -> None:
        """Refuses a push from a worker that is no member of the elastic job at ``step``.

        Raises:
            WorkerDroppedError: it left, was dropped or replaced, or never joined.
            InvalidRequestError: it joined at a later step.
        """
        if not self._members.elastic:
            return
        joined = self._members.joined.get(worker_id)
        if joined is None or worker_id not in self._members.live_view:
            raise WorkerDroppedError(
                f"push by worker {worker_id} for step {step}: it is not a member of this elastic "
                f"job ({self._gone(worker_id)}), so its gradient is not applied. A worker that "
                "left or was dropped joins again by connecting again"
            )
        if step < joined:
            raise InvalidRequestError(
                f"push by worker {worker_id} for step {step}, but it joined at step {joined}"
            )

    def _open(self, step: int) -> None:
        """A worker read or pushed at ``step`` (lock held): the step is open, and in an
        elastic job its members are recorded."""
        if step <= self._opened:
            return
        self._opened = step
        if self._members.elastic:
            self._history.note_roster(step, self._clocks().members(step))

    def _waiting_for(self, policy: ConsistencyPolicy, step: int) -> str:
        """What a wait at ``step`` lacks: members (an elastic job), else the rule's barrier."""
        clocks = self._clocks()
        if policy.admits(clocks, step):
            return policy.waiting_for(clocks, step)
        joining = sorted(w for w, s in clocks.pending.items() if s == step)
        if joining:
            return f"step {step} opens once worker(s) {joining} finish joining (prepared it)"
        members = clocks.members(step)
        missing = self._missing()
        return (
            f"the elastic job needs at least {clocks.min_workers} members to open step "
            f"{step}, and has {len(members)}: {members}; "
            + (
                "missing: " + ", ".join(missing)
                if missing
                else "no other worker has joined yet: start more workers"
            )
        )

    def _missing(self) -> list[str]:
        """Workers that were members and are gone, newest first, as 'worker 2 (left at step
        9)'."""
        seen: set[int] = set()
        out = []
        for event in reversed(self._history.events):
            if event.worker in seen:
                continue
            seen.add(event.worker)
            if event.worker not in self._members.live_view and event.kind != "joined":
                out.append(f"worker {event.worker} ({self._gone(event.worker)})")
        return out

    def _gone(self, worker_id: int) -> str:
        """How ``worker_id`` stopped being a member, from the newest event about it."""
        for event in reversed(self._history.events):
            if event.worker == worker_id:
                ago = self._now() - event.at
                return f"{event.kind} at step {event.step}, {ago:.0f}s ago"
        return "it never joined"

    def _record(self, step: int, worker_id: int, kind: str) -> None:
        """Notes a change of members in the history (lock held)."""
        members = sorted(self._members.live_view)
        self._history.record(step, worker_id, kind, self._now(), members)

    def _elastic_job(self, worker_id: int, reader: bool = False) -> Job:
        job = self._require_job()
        if not job.elastic:
            raise InvalidRequestError(
                f"worker {worker_id}: this job is not elastic (it has a fixed {job.num_workers} "
                "workers); start every worker with elastic=MIN:MAX (psworker --elastic) to let "
                "workers join and leave"
            )
        if not (reader and worker_id == OBSERVER):
            self._check_worker(worker_id, job.num_workers, "join")
        return job
