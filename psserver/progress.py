"""A shard's progress clocks: the updates it applied, the steps each worker finished, the newest
step opened, and what became of each push."""

from __future__ import annotations

from psserver.records import ShardState

# What a push came to: applied, or acknowledged without being applied.
OUTCOMES = ("applied", "duplicate", "late")


class Progress:
    """How far a shard's job has gone; not thread-safe (the shard's lock guards it).

    ``updates`` is the shard's clock (optimizer updates applied); ``finished`` maps each worker
    to the steps it has pushed here; ``opened`` is the newest step read or pushed at (-1: none);
    ``counters`` counts each outcome of a push.
    """

    def __init__(
        self,
        updates: int = 0,
        finished: dict[int, int] | None = None,
        counters: dict[str, int] | None = None,
    ) -> None:
        self.updates = updates
        self.finished: dict[int, int] = dict(finished or {})
        self.opened = -1
        self.counters = dict.fromkeys(OUTCOMES, 0)
        self.counters.update(counters or {})

    @classmethod
    def restored(cls, state: ShardState) -> Progress:
        """The clocks a checkpoint holds (no step opened since)."""
        return cls(state.updates, state.finished, state.counters)

    def finished_by(self, worker: int) -> int:
        """The steps ``worker`` has pushed here (0 for one never heard)."""
        return self.finished.get(worker, 0)

    def reach(self, worker: int, steps: int) -> None:
        """``worker`` has finished at least ``steps`` steps (a clock never goes back)."""
        self.finished[worker] = max(self.finished.get(worker, 0), steps)

    def open(self, step: int) -> bool:
        """A worker read or pushed at ``step``; True when that opened a newer step."""
        if step <= self.opened:
            return False
        self.opened = step
        return True
