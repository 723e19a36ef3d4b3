"""A shard's checkpoint marks: the newest durable checkpoint (each worker's steps in it, its
step and age) and the copies of the state taken at the capture interval."""

from __future__ import annotations

import time
from collections.abc import Callable

from psserver.records import ShardState


class CheckpointMarks:
    """What the shard knows of its checkpoints; not thread-safe (the shard's lock guards it).

    Periodic checkpoints by steps: the state is copied the moment the clock reaches a multiple
    of ``every`` (0: never), so every shard of a job saves the same steps (a poller reading
    the clock later would save at 54 here and 52 there). ``now`` is the shard's clock.
    """

    def __init__(self, now: Callable[[], float], every: int = 0) -> None:
        self._now = now
        self.durable: dict[int, int] = {}  # worker -> its steps in the newest checkpoint
        self.step = -1  # the clock of the newest checkpoint (-1: none)
        self._time: float | None = None  # when it was written, on the shard's clock
        self.every = every
        self._captured: ShardState | None = None
        self._captured_at = 0  # the clock of the last copy taken (or restored): none at start

    @classmethod
    def restored(
        cls, state: ShardState, now: Callable[[], float], every: int = 0
    ) -> CheckpointMarks:
        """The marks of a shard restored from ``state``: durable, and copied at its clock."""
        marks = cls(now, every)
        marks._captured_at = state.updates
        marks.mark(state)
        return marks

    def mark(self, state: ShardState) -> None:
        """``state`` is durable: workers may forget pushes it covers."""
        self.durable = dict(state.finished)
        self.step = state.updates
        # Its age counts from the file's write (a restored one was written long ago).
        ago = 0.0 if state.saved_at is None else max(0.0, time.time() - state.saved_at)
        self._time = self._now() - ago

    def durable_step(self, worker: int) -> int:
        """The steps of ``worker`` the newest checkpoint holds."""
        return self.durable.get(worker, 0)

    def age_s(self, now: float) -> float:
        """Seconds since the newest checkpoint was written at ``now``; -1 without one."""
        return -1.0 if self._time is None else now - self._time

    def due(self, updates: int) -> bool:
        """Whether the clock ``updates`` is a multiple of the interval not copied at yet."""
        every = self.every
        return bool(every) and updates % every == 0 and updates > self._captured_at

    def keep(self, updates: int, state: ShardState | None) -> None:
        """Keeps ``state``, copied at clock ``updates``, until ``take``."""
        self._captured_at = updates
        self._captured = state

    def take(self) -> ShardState | None:
        """The newest copy kept, once; else None."""
        state, self._captured = self._captured, None
        return state
