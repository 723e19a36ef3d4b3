"""Which workers count: heartbeats, dropping the silent from the quorum, leaving, rejoining,
joining an elastic job, and which client process holds each worker id."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from psserver.consistency.base import Clocks
from pswire.errors import DuplicateWorkerError

log = logging.getLogger(__name__)


class Membership:
    """Live workers of one job as a shard sees them; not thread-safe (the shard's lock guards it).

    Every worker id in ``[0, num_workers)`` starts live, so the first sync step waits for all
    of them. A worker not heard from (any RPC or heartbeat) for ``timeout_s`` seconds leaves
    the quorum, counting only time in which the shard heard others: a stretch in which it heard
    nobody for over half the timeout (it was paused, or cut off from the network) says
    nothing about the workers, so it is not counted against anyone (``dead_air_s``). A
    worker that leaves (closes its client) is out at once. Hearing from a worker again brings
    it back. ``timeout_s <= 0`` never drops anyone for silence.

    Each worker id is held by one client process (its ``session``); a second process claiming
    an id whose holder was heard within ``claim_grace_s`` is refused.

    An elastic job starts with no members: a worker becomes one by joining (``prepare`` at a
    step, then ``commit``), and hearing from a worker that left or was dropped does not bring
    it back (it joins again). ``joined`` holds each member's first step.
    """

    def __init__(self, timeout_s: float, claim_grace_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self.claim_grace_s = claim_grace_s
        self._last_seen: dict[int, float] = {}
        # When each worker's silence started counting: its last call, moved later by any stretch
        # in which the shard heard nobody (the shard's own silence is not the worker's).
        self._counted_from: dict[int, float] = {}
        self._live: set[int] = set()
        self._left: set[int] = set()
        self._sessions: dict[int, str] = {}
        self._heard_any: float | None = None  # when the shard last heard any worker
        self._started = False
        self.elastic = False
        self.joined: dict[int, int] = {}  # elastic: member -> the step it joined at
        self.pending: dict[int, int] = {}  # elastic: prepared joins, worker -> their step
        self.min_workers = 0

    @property
    def dead_air_s(self) -> float:
        """A silence from every worker longer than this is the shard's own (paused, cut off):
        workers heartbeat every 2 s by default and at least four times per timeout (they learn
        it when they register). A shorter stall cannot make a live worker look silent for a
        whole timeout."""
        return self.timeout_s / 2

    def clocks(self, updates: int, finished: Mapping[int, int], opened: int) -> Clocks:
        """What the consistency rule reads: the live containers themselves, not copies (rules
        only read them, under the shard's lock, and keep nothing)."""
        return Clocks(
            updates, finished, self._live, self.joined, self.pending, self.min_workers, opened
        )

    def start(
        self,
        num_workers: int,
        now: float,
        elastic: bool = False,
        members: Mapping[int, int] | None = None,
        min_workers: int = 0,
    ) -> None:
        """Begins the job: every worker live, as if just heard from; an elastic job (of at
        least ``min_workers``) with ``members`` (member -> the step it joined at: a restored
        checkpoint's) or none."""
        self.elastic = elastic
        self.min_workers = min_workers if elastic else 0
        joined: dict[int, int] = dict(members or {}) if elastic else {}
        ids = list(joined) if elastic else range(num_workers)
        for w in ids:
            self._last_seen.setdefault(w, now)
            self._counted_from.setdefault(w, self._last_seen[w])
        self._live = set(ids)
        self.joined = joined
        self.pending = {}
        self._heard_any = now
        self._started = True

    def restore_left(self, workers: list[int]) -> None:
        """Workers a checkpoint records as left: out of the quorum until heard from again."""
        for w in workers:
            self._live.discard(w)
            self.joined.pop(w, None)
            self._left.add(w)

    def holder(self, worker: int) -> str | None:
        """The session holding ``worker``'s id, if any."""
        return self._sessions.get(worker)

    def prepare(self, worker: int, step: int, now: float) -> None:
        """Elastic: ``worker`` will join at ``step`` once it commits (until then it counts
        nowhere, and ``step`` does not open)."""
        self.pending[worker] = step
        self._last_seen[worker] = now
        self._counted_from[worker] = now

    def commit(self, worker: int, step: int) -> None:
        """Elastic: ``worker`` is a member from ``step`` on."""
        self.pending.pop(worker, None)
        self._live.add(worker)
        self._left.discard(worker)
        self.joined[worker] = step
        log.info("worker %d joined the job at step %d", worker, step)

    def abort(self, worker: int) -> bool:
        """Elastic: forgets ``worker``'s prepared join; True when there was one."""
        return self.pending.pop(worker, None) is not None

    def claim(self, worker: int, session: str, now: float) -> None:
        """Checks that ``session`` may act as ``worker``; a new session takes over an id whose
        holder has been silent for ``claim_grace_s``. An empty session (a client that does not
        say) is never checked.

        Raises:
            DuplicateWorkerError: another live process holds this worker id.
        """
        if not session:
            return
        holder = self._sessions.get(worker)
        if holder is not None and holder != session:
            silent = now - self._last_seen.get(worker, now)
            if silent < self.claim_grace_s:
                raise DuplicateWorkerError(
                    f"worker id {worker} is held by another live client process (session "
                    f"{holder}, heard {silent:.1f}s ago); this one is session {session}. Give "
                    "each process its own worker id (worker_id=, $PS_WORKER_ID or TF_CONFIG's "
                    f"task.index); a restarted worker takes over after {self.claim_grace_s:g}s "
                    "of silence from the old one"
                )
            log.warning(
                "worker %d: session %s takes over from %s (silent %.1fs)",
                worker,
                session,
                holder,
                silent,
            )
        self._sessions[worker] = session

    def check(self, worker: int, session: str) -> None:
        """Refuses a call from a process that no longer holds ``worker`` (another took over).

        Raises:
            DuplicateWorkerError: ``session`` is not the id's holder.
        """
        holder = self._sessions.get(worker)
        if session and holder is not None and holder != session:
            raise DuplicateWorkerError(
                f"worker id {worker} is now held by client session {holder}, not this one "
                f"({session}): another process registered as worker {worker}"
            )

    def touch(self, worker: int, now: float) -> bool:
        """Records that ``worker`` was heard from; True when that brings it back into the quorum."""
        gap = now - self._heard_any if self._heard_any is not None else 0.0
        if self.timeout_s > 0 and gap > self.dead_air_s:
            # The shard heard nobody for longer than workers stay quiet (they heartbeat far more
            # often): its own stall or partition, not their silence. That time is not counted
            # against anyone.
            log.warning(
                "heard no worker for %.1fs (shard paused or cut off?): that time is not "
                "counted against any worker's heartbeat timeout",
                gap,
            )
            for w, since in self._counted_from.items():
                self._counted_from[w] = min(now, since + gap)
        self._heard_any = now
        self._last_seen[worker] = now
        self._counted_from[worker] = now
        if self._started and worker not in self._live and not self.elastic:
            self._live.add(worker)
            self._left.discard(worker)
            log.info("worker %d rejoined the quorum", worker)
            return True
        return False

    def release(self, worker: int, session: str) -> bool:
        """Ends ``session``'s claim on ``worker`` (a process whose init failed: it never
        joined), so another process may take the id at once; the quorum stays as it was.
        True when ``session`` held the id."""
        if not session or self._sessions.get(worker) != session:
            return False
        del self._sessions[worker]
        log.info(
            "worker %d: session %s gave up its claim on the id (its init failed)", worker, session
        )
        return True

    def leave(self, worker: int) -> bool:
        """``worker`` left the job; True when that changed the quorum (or a prepared join)."""
        self._sessions.pop(worker, None)
        aborted = self.abort(worker)
        if worker not in self._live:
            return aborted
        self._live.discard(worker)
        self.joined.pop(worker, None)
        self._left.add(worker)
        log.info("worker %d left the job", worker)
        return True

    def drop(self, worker: int) -> None:
        """``worker`` is out of the quorum (another process took its id over)."""
        self._live.discard(worker)
        self.joined.pop(worker, None)

    def expire(self, now: float) -> list[int]:
        """Drops every live worker silent for longer than the timeout while others were heard
        within it, and forgets such workers' prepared joins; returns them."""
        if self.timeout_s <= 0 or self._heard_any is None:
            return []
        if now - self._heard_any > self.dead_air_s:
            return []  # nobody heard lately: the shard's silence, not theirs (see touch)
        # Judged as members are: by the pause-adjusted time (a shard's stall is not theirs).
        late = [w for w in self.pending if now - self._counted_from.get(w, now) > self.timeout_s]
        for w in late:
            self.abort(w)
            log.warning("worker %d prepared to join but went silent: join dropped", w)
        silent = sorted(
            w for w in self._live if now - self._counted_from.get(w, now) > self.timeout_s
        )
        for w in silent:
            self._live.discard(w)
            self.joined.pop(w, None)
            log.warning(
                "worker %d silent for %.1fs (timeout %.1fs) while others were heard: dropped "
                "from the quorum",
                w,
                now - self._counted_from[w],
                self.timeout_s,
            )
        return sorted({*silent, *late})

    @property
    def live(self) -> frozenset[int]:
        return frozenset(self._live)

    @property
    def left(self) -> frozenset[int]:
        return frozenset(self._left)

    @property
    def live_view(self) -> AbstractSet[int]:
        """The live set itself, not a copy: for readers under the shard's lock."""
        return self._live

    def seconds_since(self, worker: int, now: float) -> float:
        return now - self._last_seen.get(worker, now)

    def known(self) -> list[int]:
        return sorted(self._last_seen)
