"""Epochs of an elastic job: where each one starts, which members split it, and the part of it a
worker takes, all worked out from the job's membership history, so every worker agrees.

An epoch is split among the members at the step it starts (the shards record the members of
every step as it opens): each of n members takes ``ceil(length / n)`` samples, in batches, so
the epoch has as many steps as a member has batches. A change of members takes effect at the
next epoch boundary; the epoch in progress keeps its split:

- a worker that leaves mid-epoch leaves the rest of its part unseen in that epoch;
- a worker that joins mid-epoch takes over the rest of the part of a worker that left in that
  epoch, if there is one (from the step it joins), else it repeats the rest of another
  member's part (those samples are seen twice in that epoch).

Every epoch that starts with the members it ends with sees every sample once (up to the
padding that gives members equal parts). In ``sync`` the members of a step are the same on
every worker; in ``async``/``ssp`` each worker counts its own steps, so the split is the same
rule over each worker's own count, and coverage is only approximate.
"""

from __future__ import annotations

from dataclasses import dataclass

from pswire.errors import ConfigError
from psworker.api import Members


@dataclass(frozen=True)
class EpochPlan:
    """This worker's part of the epoch in progress at some step."""

    epoch: int
    start: int  # the step the epoch started at
    steps: int  # its length in steps
    members: tuple[int, ...]  # who it is split among (the members at ``start``)
    rank: int  # the part this worker takes
    offset: int  # steps of the epoch done before this worker's iteration starts
    repeats: bool = False  # a mid-epoch joiner repeating another member's part


def steps_per_epoch(length: int, members: int, batch: int, drop_last: bool) -> int:
    """Steps of an epoch of ``length`` samples split among ``members`` in ``batch``es.

    Raises:
        ConfigError: not even one step (too few samples for the members and batch size).
    """
    per_member = -(-length // members) if length else 0
    steps = per_member // batch if drop_last else -(-per_member // batch)
    if steps < 1:
        raise ConfigError(
            f"{length} samples split among {members} workers in batches of {batch} "
            f"(drop_last={drop_last}) give no step at all"
        )
    return steps


def plan_epoch(
    view: Members,
    worker: int,
    length: int,
    batch: int = 1,
    drop_last: bool = False,
    first_step: int = 0,
) -> EpochPlan:
    """The epoch in progress at ``view.step`` (epoch 0 starts at ``first_step``) and this
    worker's part of it.

    Raises:
        ConfigError: no members recorded yet, or an epoch with no step.
    """
    step = view.step
    starts = [s for s, _ in view.rosters]
    if not starts:
        raise ConfigError(f"the job recorded no members up to step {step}")

    def members_at(at: int) -> tuple[int, ...]:
        return view.at(at) or view.rosters[0][1]

    start, epoch = first_step, 0
    while True:
        members = members_at(start)
        steps = steps_per_epoch(length, len(members), batch, drop_last)
        later = [s for s in starts if s > start]
        limit = min(later[0] if later else step + 1, step + 1)
        # Epochs starting before the next change of members all have these members.
        jump = max(0, (limit - 1 - start) // steps)
        start, epoch = start + jump * steps, epoch + jump
        if start + steps > step:
            break
        start, epoch = start + steps, epoch + 1
    rank, repeats = _rank(members, view.members, worker)
    return EpochPlan(epoch, start, steps, members, rank, step - start, repeats)


def _rank(split: tuple[int, ...], now: tuple[int, ...], worker: int) -> tuple[int, bool]:
    """The part of an epoch split among ``split`` that ``worker`` takes, while ``now`` train:
    its own; a joiner's, the part of one that left; else another's, repeated."""
    if worker in split:
        return split.index(worker), False
    joiners = sorted(w for w in now if w not in split)
    gone = [r for r, w in enumerate(split) if w not in now]
    i = joiners.index(worker) if worker in joiners else 0
    if i < len(gone):
        return gone[i], False
    return i % len(split), True
