"""The workers' paces (seconds per inner step) one shard has heard, for DiLoCo's dynamic local
steps: each worker says its own with a heartbeat and reads back the fastest live worker's, so a
slow worker takes fewer local steps per outer step (Liu et al. 2024, DyLU).

Soft state: not checkpointed (a restarted shard hears every worker's pace again within one
outer step), and a worker that is not live does not count.
"""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet

from pswire.errors import InvalidRequestError

# The longest pace a worker may report: one inner step a day.
MAX_SECONDS_PER_STEP = 86400.0


class Paces:
    """Each worker's last reported seconds per inner step; not thread-safe (the shard's lock
    guards it)."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    @staticmethod
    def check(worker_id: int, seconds_per_step: float) -> None:
        """Refuses a pace that is no number of seconds a step can take.

        Raises:
            InvalidRequestError: not finite, negative or over ``MAX_SECONDS_PER_STEP``.
        """
        if not (math.isfinite(seconds_per_step) and 0 <= seconds_per_step <= MAX_SECONDS_PER_STEP):
            raise InvalidRequestError(
                f"heartbeat from worker {worker_id}: seconds_per_step must be a finite number of "
                f"seconds in [0, {MAX_SECONDS_PER_STEP:g}], got {seconds_per_step!r}"
            )

    def record(self, worker_id: int, seconds_per_step: float) -> None:
        """Keeps ``worker_id``'s pace (checked with ``check`` first); 0 keeps the last one."""
        if seconds_per_step > 0:
            self._seconds[worker_id] = seconds_per_step

    def fastest(self, live: AbstractSet[int]) -> float:
        """The fewest seconds per step among the ``live`` workers that reported one; 0 when
        none has."""
        return min((s for w, s in self._seconds.items() if w in live), default=0.0)
