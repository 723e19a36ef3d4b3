"""Which workers count: heartbeats, dropping the silent from the quorum, rejoining."""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet

log = logging.getLogger(__name__)


class Membership:
    """Live workers of one job as a shard sees them; not thread-safe (the shard's lock guards it).

    Every worker id in ``[0, num_workers)`` starts live, so the first sync step waits for all
    of them. A worker not heard from (any RPC or heartbeat) for ``timeout_s`` seconds leaves
    the quorum; hearing from it again brings it back. ``timeout_s <= 0`` never drops anyone.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last_seen: dict[int, float] = {}
        self._live: set[int] = set()
        self._started = False

    def start(self, num_workers: int, now: float) -> None:
        """Begins the job: every worker live, as if just heard from."""
        for w in range(num_workers):
            self._last_seen.setdefault(w, now)
        self._live = set(range(num_workers))
        self._started = True

    def touch(self, worker: int, now: float) -> bool:
        """Records that ``worker`` was heard from; True when that brings it back into the quorum."""
        self._last_seen[worker] = now
        if self._started and worker not in self._live:
            self._live.add(worker)
            log.info("worker %d rejoined the quorum", worker)
            return True
        return False

    def expire(self, now: float) -> list[int]:
        """Drops every live worker silent for longer than the timeout; returns them."""
        if self.timeout_s <= 0:
            return []
        silent = sorted(w for w in self._live if now - self._last_seen.get(w, now) > self.timeout_s)
        for w in silent:
            self._live.discard(w)
            log.warning(
                "worker %d silent for %.1fs (timeout %.1fs): dropped from the quorum",
                w,
                now - self._last_seen[w],
                self.timeout_s,
            )
        return silent

    @property
    def live(self) -> frozenset[int]:
        return frozenset(self._live)

    @property
    def live_view(self) -> AbstractSet[int]:
        """The live set itself, not a copy: for readers under the shard's lock."""
        return self._live

    def seconds_since(self, worker: int, now: float) -> float:
        return now - self._last_seen.get(worker, now)

    def known(self) -> list[int]:
        return sorted(self._last_seen)
