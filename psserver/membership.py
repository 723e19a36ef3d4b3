"""Which workers count: heartbeats, dropping the silent from the quorum, leaving, rejoining, and
which client process holds each worker id."""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet

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

    @property
    def dead_air_s(self) -> float:
        """A silence from every worker longer than this is the shard's own (paused, cut off):
        workers heartbeat every 2 s by default, far more often than half the timeout. A shorter
        stall cannot make a live worker look silent for a whole timeout."""
        return self.timeout_s / 2

    def start(self, num_workers: int, now: float) -> None:
        """Begins the job: every worker live, as if just heard from."""
        for w in range(num_workers):
            self._last_seen.setdefault(w, now)
            self._counted_from.setdefault(w, self._last_seen[w])
        self._live = set(range(num_workers))
        self._heard_any = now
        self._started = True

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
        if self._started and worker not in self._live:
            self._live.add(worker)
            self._left.discard(worker)
            log.info("worker %d rejoined the quorum", worker)
            return True
        return False

    def leave(self, worker: int) -> bool:
        """``worker`` left the job; True when that changed the quorum."""
        self._sessions.pop(worker, None)
        if worker not in self._live:
            return False
        self._live.discard(worker)
        self._left.add(worker)
        log.info("worker %d left the job", worker)
        return True

    def expire(self, now: float) -> list[int]:
        """Drops every live worker silent for longer than the timeout while others were heard
        within it; returns them."""
        if self.timeout_s <= 0 or self._heard_any is None:
            return []
        if now - self._heard_any > self.dead_air_s:
            return []  # nobody heard lately: the shard's silence, not theirs (see touch)
        silent = sorted(
            w for w in self._live if now - self._counted_from.get(w, now) > self.timeout_s
        )
        for w in silent:
            self._live.discard(w)
            log.warning(
                "worker %d silent for %.1fs (timeout %.1fs) while others were heard: dropped "
                "from the quorum",
                w,
                now - self._counted_from[w],
                self.timeout_s,
            )
        return silent

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
