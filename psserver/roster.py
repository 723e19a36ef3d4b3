"""Who is in a shard's job: its members (``Membership``) and their history, read as the clocks
a consistency rule judges, and the messages that say who is missing."""

from __future__ import annotations

from collections.abc import Callable

from pscore.job import OBSERVER, Job
from psserver.consistency import Clocks, ConsistencyPolicy
from psserver.history import MembershipHistory
from psserver.membership import Membership
from psserver.progress import Progress
from psserver.records import Limits, ShardState
from pswire.errors import InvalidRequestError, WorkerDroppedError


class Roster:
    """A job's workers as one shard counts them; not thread-safe (the shard's lock guards it).

    Owns the ``Membership`` (who is live, who joined at which step, which process holds each
    id) and the ``MembershipHistory`` (every change, the members of each step); reads the
    workers' steps from ``progress``. ``now`` is the shard's clock.
    """

    def __init__(
        self,
        limits: Limits,
        now: Callable[[], float],
        progress: Progress,
        history: MembershipHistory | None = None,
    ) -> None:
        self.members = Membership(limits.heartbeat_timeout_s, limits.claim_grace_s)
        self.history = history if history is not None else MembershipHistory()
        self.now = now
        self._progress = progress

    @classmethod
    def restored(
        cls, state: ShardState, limits: Limits, now: Callable[[], float], progress: Progress
    ) -> Roster:
        """The roster of a shard restored from ``state``: its members, rosters and leavers."""
        roster = cls(limits, now, progress, MembershipHistory(state.rosters))
        roster.start(state.job, state.members)
        roster.members.restore_left(state.left)
        return roster

    def start(self, job: Job, members: dict[int, int] | None = None) -> None:
        """Begins ``job``: every worker live (an elastic job: ``members``, or none yet)."""
        self.members.start(job.num_workers, self.now(), job.elastic, members, job.min_workers)

    def clocks(self) -> Clocks:
        """What the consistency rule reads. The live containers, not copies: rules only read
        them, under the lock, and keep nothing."""
        progress = self._progress
        return self.members.clocks(progress.updates, progress.finished, progress.opened)

    def touch(self, worker_id: int) -> bool:
        """``worker_id`` was heard from; True when that brought it back into the quorum."""
        if worker_id == OBSERVER:
            return False  # a reader such as psctl export is no worker: it must not join the quorum
        if self.members.touch(worker_id, self.now()):
            self.record(self._progress.finished_by(worker_id), worker_id, "rejoined")
            return True
        return False

    def record(self, step: int, worker_id: int, kind: str) -> None:
        """Notes a change of members in the history."""
        members = sorted(self.members.live_view)
        self.history.record(step, worker_id, kind, self.now(), members)

    def expire(self) -> list[int]:
        """``Membership.expire``, the drops recorded; returns the workers whose membership or
        prepared join ended (the caller tells the rule)."""
        before = set(self.members.live_view)
        changed = self.members.expire(self.now())
        for worker in sorted(before - self.members.live_view):
            self.record(self._progress.finished_by(worker), worker, "dropped")
        return changed

    def open(self, step: int) -> None:
        """A worker read or pushed at ``step``: the step is open, and in an elastic job its
        members are recorded."""
        if self._progress.open(step) and self.members.elastic:
            self.history.note_roster(step, self.clocks().members(step))

    def absent(self, job: Job | None) -> tuple[int, ...]:
        """The job's workers out of the quorum now (sync and ssp jobs of fixed size)."""
        if job is None or job.mode == "async" or job.elastic:
            return ()
        live = self.members.live_view
        return tuple(w for w in range(job.num_workers) if w not in live)

    def check_member(self, worker_id: int, step: int) -> None:
        """Refuses a push from a worker that is no member of the elastic job at ``step``.

        Raises:
            WorkerDroppedError: it left, was dropped or replaced, or never joined.
            InvalidRequestError: it joined at a later step.
        """
        if not self.members.elastic:
            return
        joined = self.members.joined.get(worker_id)
        if joined is None or worker_id not in self.members.live_view:
            raise WorkerDroppedError(
                f"push by worker {worker_id} for step {step}: it is not a member of this elastic "
                f"job ({self.gone(worker_id)}), so its gradient is not applied. A worker that "
                "left or was dropped joins again by connecting again"
            )
        if step < joined:
            raise InvalidRequestError(
                f"push by worker {worker_id} for step {step}, but it joined at step {joined}"
            )

    def waiting_for(self, policy: ConsistencyPolicy, step: int) -> str:
        """What a wait at ``step`` lacks: members (an elastic job), else the rule's barrier."""
        clocks = self.clocks()
        if policy.admits(clocks, step):
            return policy.waiting_for(clocks, step)
        joining = sorted(w for w, s in clocks.pending.items() if s == step)
        if joining:
            return f"step {step} opens once worker(s) {joining} finish joining (prepared it)"
        members = clocks.members(step)
        missing = self.missing()
        return (
            f"the elastic job needs at least {clocks.min_workers} members to open step "
            f"{step}, and has {len(members)}: {members}; "
            + (
                "missing: " + ", ".join(missing)
                if missing
                else "no other worker has joined yet: start more workers"
            )
        )

    def missing(self) -> list[str]:
        """Workers that were members and are gone, newest first, as 'worker 2 (left at step
        9)'."""
        seen: set[int] = set()
        out = []
        for event in reversed(self.history.events):
            if event.worker in seen:
                continue
            seen.add(event.worker)
            if event.worker not in self.members.live_view and event.kind != "joined":
                out.append(f"worker {event.worker} ({self.gone(event.worker)})")
        return out

    def gone(self, worker_id: int) -> str:
        """How ``worker_id`` stopped being a member, from the newest event about it."""
        for event in reversed(self.history.events):
            if event.worker == worker_id:
                ago = self.now() - event.at
                return f"{event.kind} at step {event.step}, {ago:.0f}s ago"
        return "it never joined"
