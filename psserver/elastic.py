"""Joining an elastic job: the two-phase join that makes every shard count a new worker from the
same step, and what a worker reads of the members of each step.

Why two phases: a worker pushes to every shard, and each shard closes its sync steps on its own.
Were a joiner simply counted from "the current step" by each shard, a shard a little ahead would
count it a step later than one behind, and the two would average one step over different
workers. So the joiner first asks every shard for the earliest step it could join at
(``propose``), then ``prepare``s the largest of them everywhere: a shard holds that step from
opening until the worker ``commit``s (or aborts), and refuses a step it has already opened,
naming the one it could take instead, which the worker then prepares everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from psserver.consistency import ConsistencyPolicy
from psserver.progress import Progress
from psserver.roster import Roster
from pswire.errors import InvalidRequestError

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


class Joins:
    """The join protocol of an elastic job, over a shard's ``Roster`` and ``Progress`` (the
    shard's lock held). ``changed`` is the shard's: the members changed, a round may close."""

    def __init__(
        self,
        roster: Roster,
        progress: Progress,
        max_step_ahead: int,
        changed: Callable[[], None],
    ) -> None:
        self._roster = roster
        self._progress = progress
        self._max_step_ahead = max_step_ahead
        self._changed = changed

    def phase(self, worker_id: int, phase: str, step: int, policy: ConsistencyPolicy) -> JoinResult:
        """One phase of ``worker_id``'s join (see the module's docstring), the worker checked
        and heard from by the caller.

        Raises:
            InvalidRequestError: a worker that is a member already, a commit without a prepare
                at that step, or a step far ahead.
        """
        roster = self._roster
        members = roster.members
        if phase == "abort":
            if members.abort(worker_id):
                self._changed()
            return JoinResult(True, step)
        joined = members.joined.get(worker_id)
        if joined is not None and worker_id in members.live_view:
            if phase == "commit" and joined == step:
                return JoinResult(True, step, tuple(roster.clocks().members(step)))
            raise InvalidRequestError(
                f"worker {worker_id} asks to {phase} a join, but it is a member already "
                f"(since step {joined})"
            )
        if phase == "commit":
            return self._commit(worker_id, step)
        earliest = policy.join_step(roster.clocks(), worker_id)
        if phase == "propose":
            return JoinResult(True, earliest)
        if step < earliest:
            members.abort(worker_id)
            self._changed()
            return JoinResult(False, earliest)
        limit = self._max_step_ahead
        if step > earliest + limit:
            raise InvalidRequestError(
                f"worker {worker_id} prepares to join at step {step}, but this shard takes "
                f"joins from step {earliest} (at most {limit} ahead)"
            )
        moved = members.pending.get(worker_id) not in (None, step)
        members.prepare(worker_id, step, roster.now())
        if moved:
            self._changed()  # the step it held before may open now
        return JoinResult(True, step)

    def _commit(self, worker_id: int, step: int) -> JoinResult:
        """Makes a prepared join a membership.

        Raises:
            InvalidRequestError: no join prepared at ``step``.
        """
        roster = self._roster
        prepared = roster.members.pending.get(worker_id)
        if prepared != step:
            raise InvalidRequestError(
                f"worker {worker_id} commits a join at step {step}, but "
                + (
                    "prepared none here (or it was dropped: silent too long)"
                    if prepared is None
                    else f"prepared step {prepared} here"
                )
            )
        roster.members.commit(worker_id, step)
        self._progress.finished[worker_id] = step
        roster.record(step, worker_id, "joined")
        self._changed()
        return JoinResult(True, step, tuple(roster.clocks().members(step)))
