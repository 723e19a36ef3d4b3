"""A job's membership history as one shard saw it: who joined and left when, the members of
each step at which they changed, and counts of each kind of change."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Events kept for ``psctl status``; the counts and rosters are never trimmed.
MAX_EVENTS = 1000
KINDS = ("joined", "rejoined", "left", "dropped", "replaced")


@dataclass(frozen=True)
class MembershipEvent:
    """One change: at ``step`` (the first step it applies to), ``worker`` ``kind``."""

    step: int
    worker: int
    kind: str
    at: float  # the shard's clock when it happened
    members: tuple[int, ...]  # the members after it


class MembershipHistory:
    """Events, per-kind counts and rosters (the members of each step at which they changed);
    not thread-safe (the shard's lock guards it).

    A roster is recorded when a step opens (its first read or push), so every worker asking
    for the members of a step gets the same answer however late it asks.
    """

    def __init__(self, rosters: list[tuple[int, tuple[int, ...]]] | None = None) -> None:
        """A history holding ``rosters`` (a checkpoint's) or none; events and counts start
        afresh."""
        self.events: deque[MembershipEvent] = deque(maxlen=MAX_EVENTS)
        self.counts = dict.fromkeys(KINDS, 0)
        self.rosters: list[tuple[int, tuple[int, ...]]] = list(rosters or [])

    def record(self, step: int, worker: int, kind: str, at: float, members: list[int]) -> None:
        """Notes one change."""
        self.events.append(MembershipEvent(step, worker, kind, at, tuple(members)))
        self.counts[kind] += 1

    def note_roster(self, step: int, members: list[int]) -> None:
        """``members`` train at ``step`` (which just opened): kept if they differ from the
        step before's. A step older than the newest roster's is ignored (an ssp straggler)."""
        current = tuple(members)
        if self.rosters:
            last_step, last = self.rosters[-1]
            if step < last_step or last == current:
                return
            if step == last_step:
                self.rosters[-1] = (step, current)
                return
        self.rosters.append((step, current))

    def roster_at(self, step: int) -> tuple[int, ...]:
        """The members that trained at ``step`` (as it opened); () before the first roster."""
        found: tuple[int, ...] = ()
        for start, members in self.rosters:
            if start > step:
                break
            found = members
        return found
