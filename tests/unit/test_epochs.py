"""Elastic epochs: every worker works out the same epochs from the membership history; a change
of members re-splits the data at the next epoch boundary, after which every sample is seen
once per epoch; mid-epoch joiners take over a departed worker's part."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import psworker
from psworker.api import Members
from psworker.data import shard_indices
from psworker.epochs import plan_epoch, steps_per_epoch

LENGTH, BATCH = 50, 4


def view(step: int, rosters: list[tuple[int, tuple[int, ...]]]) -> Members:
    known = tuple((s, m) for s, m in rosters if s <= step)
    return Members(step, known[-1][1], known, 1, 8)


def drawn(rosters, steps: int, length: int = LENGTH, batch: int = BATCH):
    """{epoch: Counter of samples} and {(worker, step): plan} when each member draws one batch
    per step as its plan at that step says."""
    seen: dict[int, Counter] = {}
    plans = {}
    for step in range(steps):
        v = view(step, rosters)
        for worker in v.members:
            plan = plan_epoch(v, worker, length, batch)
            plans[worker, step] = plan
            idx = shard_indices(length, plan.rank, len(plan.members), plan.epoch, seed=0)
            part = idx[plan.offset * batch : (plan.offset + 1) * batch]
            seen.setdefault(plan.epoch, Counter()).update(part.tolist())
    return seen, plans


def test_a_fixed_membership_is_the_plain_split():
    seen, plans = drawn([(0, (0, 1))], steps=7 * 3)  # 25 samples a worker: 7 steps of 4
    assert steps_per_epoch(LENGTH, 2, BATCH, False) == 7
    assert sorted(seen) == [0, 1, 2]
    for counts in seen.values():
        assert set(counts) == set(range(LENGTH)) and sum(counts.values()) == LENGTH
    assert plans[1, 9].epoch == 1 and plans[1, 9].offset == 2 and plans[1, 9].rank == 1


def test_members_change_at_the_next_epoch_boundary_and_later_epochs_see_every_sample_once():
    # Worker 2 joins at step 3 (mid epoch 0) and worker 1 leaves at step 10 (mid epoch 1).
    rosters = [(0, (0, 1)), (3, (0, 1, 2)), (10, (0, 2))]
    seen, plans = drawn(rosters, steps=40)
    # Epoch 0 (steps 0-6) was split between 0 and 1; 2 joined mid-way, with nobody gone, so it
    # repeated a part: some samples twice, none missed.
    assert plans[2, 3].epoch == 0 and plans[2, 3].repeats
    assert set(seen[0]) == set(range(LENGTH)) and max(seen[0].values()) == 2
    # Epoch 1 starts at 7 with three members (5 steps); worker 1 leaves at step 10, so the rest
    # of its part goes unseen in epoch 1.
    assert plans[0, 7].members == (0, 1, 2) and plans[0, 7].steps == 5
    assert len(seen[1]) < LENGTH
    # From epoch 2 on (two members again) every sample once per epoch.
    for epoch in (2, 3):
        assert set(seen[epoch]) == set(range(LENGTH)), epoch
        assert sum(seen[epoch].values()) == LENGTH  # two parts of 25, no padding


def test_a_joiner_takes_over_the_part_of_a_worker_that_left_in_the_same_epoch():
    rosters = [(0, (0, 1, 2)), (2, (0, 2)), (4, (0, 2, 5))]  # 1 leaves at 2, 5 joins at 4
    seen, plans = drawn(rosters, steps=5)  # epoch 0: 17 samples a worker, 5 steps of 4
    assert plans[5, 4].rank == 1 and not plans[5, 4].repeats  # worker 1's part
    # Only worker 1's batches at steps 2 and 3 went unseen.
    ranks1 = shard_indices(LENGTH, 1, 3, 0, seed=0)
    assert set(range(LENGTH)) - set(seen[0]) <= set(ranks1[8:16].tolist())


@settings(max_examples=60, deadline=None)
@given(
    changes=st.lists(
        st.tuples(st.integers(1, 60), st.sets(st.integers(0, 5), min_size=1, max_size=4)),
        max_size=4,
    ),
    probe=st.integers(0, 80),
)
def test_every_member_agrees_on_the_epoch_and_parts_are_distinct(changes, probe):
    rosters = [(0, (0, 1))]
    for step, members in sorted(changes):
        if step > rosters[-1][0]:
            rosters.append((step, tuple(sorted(members))))
    v = view(probe, rosters)
    plans = [plan_epoch(v, w, LENGTH, BATCH) for w in v.members]
    assert len({(p.epoch, p.start, p.steps, p.members) for p in plans}) == 1
    assert all(0 <= p.offset < p.steps for p in plans)
    own = [p.rank for p in plans if not p.repeats]
    assert len(own) == len(set(own))  # no two workers take the same part unless repeating
    assert plans[0].start <= probe < plans[0].start + plans[0].steps


def test_shard_of_an_elastic_client_follows_the_members_and_reports_counts():
    class FakeElastic:
        worker_id, num_workers, step, min_workers, max_workers = 2, 4, 3, 1, 4
        rosters = ((0, (0, 1)), (3, (0, 1, 2)))

        def members(self, step=None):
            return view(self.step if step is None else step, list(self.rosters))

    client = FakeElastic()
    data = psworker.shard(list(range(20)), client, shuffle=False)
    first = list(data)  # epoch 0 (10 steps of one item) from step 3: repeats part 0
    assert data.plan is not None and data.plan.repeats and data.plan.offset == 3
    assert first == shard_indices(20, 0, 2, 0, shuffle=False)[3:].tolist()
    assert data.samples == {0: 7}
    client.step = 10  # epoch 1 starts with three members: 7 items each
    second = list(data)
    assert len(second) == 7 and data.samples[1] == 7 and data.plan.rank == 2


def test_epochs_refuse_a_loop_that_skips_the_data():
    data = psworker.shard(list(range(10)), _Fixed())
    epochs = data.epochs(3)
    assert next(epochs) == 0
    with pytest.raises(RuntimeError, match="iterate the data"):
        next(epochs)


class _Fixed:
    worker_id, num_workers = 0, 1


def test_plan_needs_a_step_per_epoch():
    with pytest.raises(psworker.ConfigError, match="no step at all"):
        steps_per_epoch(3, 4, 2, drop_last=True)
    assert np.array_equal(shard_indices(4, 0, 1, 0, shuffle=False), [0, 1, 2, 3])
