"""The interface every consistency rule implements, and the clocks it reads."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from types import MappingProxyType
from typing import Any, NamedTuple

_NONE: Mapping[int, int] = MappingProxyType({})


class Clocks(NamedTuple):
    """What a rule may look at: optimizer updates applied and each worker's finished steps.

    Built several times per push, hence a tuple over the shard's live containers (read only,
    under its lock) rather than copies. The elastic fields keep their defaults in a job of
    fixed size: every live worker is a member from step 0, and no join is pending."""

    updates: int
    finished: Mapping[int, int]  # worker id -> steps it has pushed
    live: AbstractSet[int]
    joined: Mapping[int, int] = _NONE  # elastic: member -> the step it joined at
    pending: Mapping[int, int] = _NONE  # elastic: prepared joins, worker -> their step
    min_workers: int = 0  # elastic: no step opens with fewer members
    opened: int = -1  # the newest step any worker has read or pushed at

    def min_live(self) -> int:
        return min((self.finished.get(w, 0) for w in self.live), default=0)

    def laggards(self, below: int) -> list[int]:
        return sorted(w for w in self.live if self.finished.get(w, 0) < below)

    def members(self, step: int) -> list[int]:
        """The live workers that train at ``step`` (joined at it or before)."""
        return sorted(w for w in self.live if self.joined.get(w, 0) <= step)


class ConsistencyPolicy:
    """Decides when a push may proceed, what it applies, and when a pull may read.

    Called by the shard with its lock held; implementations do no I/O and never block.
    """

    name: str = ""
    staleness: int = 0

    def push_ready(self, clocks: Clocks, worker: int, step: int) -> bool:
        """May a push for ``step`` be taken now (otherwise the shard waits)?"""
        return True

    def read_ready(self, clocks: Clocks, step: int) -> bool:
        """May a worker that has finished ``step`` steps read now?"""
        return True

    def waiting_for(self, clocks: Clocks, step: int) -> str:
        """Says, for an error message, what a wait at ``step`` is waiting for."""
        return "nothing"

    def classify(self, clocks: Clocks, worker: int, step: int) -> str | None:
        """Why a push must not be applied: "duplicate" (already applied: a retry) or "late"
        (its step closed without it); None to take it."""
        return "duplicate" if step < clocks.finished.get(worker, 0) else None

    def join_clock(self, clocks: Clocks, worker: int) -> int:
        """The step a worker (re)joining now resumes at."""
        return clocks.finished.get(worker, 0)

    def admits(self, clocks: Clocks, step: int) -> bool:
        """May ``step`` open (its first read or push)? An elastic job opens a step only with
        at least its minimum of members and no join prepared for it; a step already open
        runs to its end with the members that remain. Always True in a job of fixed size."""
        if step <= clocks.opened:
            return True
        if step in clocks.pending.values():
            return False
        return len(clocks.members(step)) >= clocks.min_workers

    def join_step(self, clocks: Clocks, worker: int) -> int:
        """The earliest step an elastic join may take effect at now (see ``join_clock``)."""
        return self.join_clock(clocks, worker)

    def durable_clock(self, updates: int, finished: int) -> int:
        """A worker's finished steps as a checkpoint taken now records them."""
        return finished

    def submit(
        self,
        clocks: Clocks,
        worker: int,
        step: int,
        grads: Mapping[str, Any],
        owned: bool = False,
    ) -> Mapping[str, Any] | None:
        """Takes a validated, non-duplicate push; returns the gradient to apply now, if any.

        ``owned``: the push's arrays are this call's to change (decoded for it alone), so a
        rule may sum into one of them instead of copying it. By default every push applies
        on arrival (async, ssp).
        """
        return grads

    def membership_changed(self, clocks: Clocks) -> Mapping[str, Any] | None:
        """Re-evaluates after workers leave; returns a gradient to apply if that completes one."""
        return None

    def turn(self, clocks: Clocks, worker: int, step: int) -> bool:
        """Whether ``worker``'s push for ``step``, arriving now, would be taken without being
        held for another push first (a front end reads its bytes only then). Always, unless
        the rule holds pushes."""
        return True

    def pending_bytes(self) -> int:
        return 0
