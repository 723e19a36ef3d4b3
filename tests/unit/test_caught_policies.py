"""The consistency rules' own contract, called directly (as the shard calls them, lock held),
and the parts of a sync step's average the shard-level tests do not reach: table rows, integer
buffers, fractional means, quorum 1, the waits' messages."""

from __future__ import annotations

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from pscore.tables import RowSparse, TableSlice
from psserver.consistency import (
    AsyncPolicy,
    Clocks,
    StalenessPolicy,
    SyncPolicy,
    make_policy,
)
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import InvalidRequestError, WaitTimeoutError


def clocks(updates: int, finished: dict[int, int], live: set[int]) -> Clocks:
    return Clocks(updates, finished, live)


# -- make_policy --------------------------------------------------------------------------------


def test_make_policy_builds_each_rule_with_its_settings() -> None:
    sync = make_policy("sync", quorum=2)
    assert isinstance(sync, SyncPolicy) and (sync.name, sync.quorum) == ("sync", 2)
    ssp = make_policy("ssp", staleness=3)
    assert isinstance(ssp, StalenessPolicy) and (ssp.name, ssp.staleness) == ("ssp", 3)
    assert isinstance(make_policy("async"), AsyncPolicy) and make_policy("async").name == "async"
    assert make_policy("ssp").staleness == 0 and make_policy("sync").quorum == 0  # defaults


@pytest.mark.parametrize(
    ("mode", "staleness", "quorum", "message"),
    [
        ("ssp", -1, 0, "staleness must be >= 0, got -1"),
        ("ssp", 0, 2, "quorum .* sync option"),
        ("async", 0, 1, "quorum .* sync option"),
        ("sync", 0, -1, "quorum must be >= 0"),
        ("gossip", 0, 0, "unknown mode"),
    ],
)
def test_make_policy_refuses_settings_its_mode_cannot_take(
    mode: str, staleness: int, quorum: int, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        make_policy(mode, staleness, quorum)


# -- clocks -------------------------------------------------------------------------------------


def test_min_live_and_laggards() -> None:
    c = clocks(0, {0: 5, 1: 3, 2: 4}, {0, 1, 2})
    assert c.min_live() == 3
    assert c.laggards(4) == [1]  # at 4 is not behind 4
    assert c.laggards(5) == [1, 2]
    assert clocks(0, {0: 5}, set()).min_live() == 0  # nobody live: nobody holds anyone back
    assert clocks(0, {}, {7}).min_live() == 0  # a live worker never heard pushing: 0 steps


# -- where a (re)joining worker resumes ---------------------------------------------------------


def test_join_clocks() -> None:
    c = clocks(3, {0: 4, 1: 1, 2: 6}, {0, 1, 2})
    assert AsyncPolicy().join_clock(c, 1) == 1  # async: its own steps, nothing to wait for
    assert AsyncPolicy().join_clock(c, 9) == 0
    # sync: the open round, or the one after it if this worker already pushed into it
    assert SyncPolicy().join_clock(c, 1) == 3
    assert SyncPolicy().join_clock(c, 0) == 4
    assert SyncPolicy().join_clock(clocks(0, {}, {0}), 0) == 0
    # ssp: level with the slowest of the others, never behind its own steps
    assert StalenessPolicy(1).join_clock(c, 1) == 4
    assert StalenessPolicy(1).join_clock(c, 2) == 6  # its own 6 stands
    assert StalenessPolicy(1).join_clock(clocks(0, {0: 2}, {0}), 0) == 2  # alone
    assert StalenessPolicy(1).join_clock(clocks(0, {0: 2}, {1}), 1) == 0  # 0 is not live
    assert StalenessPolicy(1).join_clock(clocks(0, {}, {1}), 1) == 0


def test_durable_clocks() -> None:
    assert SyncPolicy().durable_clock(3, 4) == 3  # a push into the open step is not saved
    assert SyncPolicy().durable_clock(3, 2) == 2
    assert AsyncPolicy().durable_clock(3, 4) == 4
    assert StalenessPolicy(2).durable_clock(3, 4) == 4


def test_the_rules_that_never_hold_anything() -> None:
    c = clocks(0, {0: 1}, {0})
    for policy in (AsyncPolicy(), StalenessPolicy(1)):
        assert policy.pending_bytes() == 0
        assert policy.membership_changed(c) is None
        grads = {"w": np.ones(2, np.float32)}
        assert policy.submit(c, 0, 1, grads) is grads  # applied on arrival, as pushed
    assert AsyncPolicy().waiting_for(c, 5) == "nothing"
    assert AsyncPolicy().push_ready(c, 0, 99) and AsyncPolicy().read_ready(c, 99)
    assert AsyncPolicy().classify(c, 0, 0) == "duplicate"
    assert AsyncPolicy().classify(c, 0, 1) is None


def test_sync_holds_pushes_until_the_round_closes_and_copies_what_it_does_not_own() -> None:
    policy = SyncPolicy()
    live = {0, 1}
    a = {"w": np.array([1.0, 2.0], np.float32)}
    b = {"w": np.array([3.0, 6.0], np.float32)}
    assert policy.submit(clocks(0, {0: 1}, live), 0, 0, a) is None
    assert policy.pending_bytes() == 8
    assert policy.membership_changed(clocks(0, {0: 1}, live)) is None
    update = policy.submit(clocks(0, {0: 1, 1: 1}, live), 1, 0, b)
    assert update is not None
    np.testing.assert_array_equal(update["w"], [2.0, 4.0])
    np.testing.assert_array_equal(a["w"], [1.0, 2.0])  # not owned (the default): not summed into
    assert policy.pending_bytes() == 0
    assert SyncPolicy().membership_changed(clocks(0, {}, live)) is None  # nothing held
    # Everyone gone and nothing pushed: no empty round closes (it would advance the clock).
    assert SyncPolicy().membership_changed(clocks(0, {}, set())) is None


def test_ssp_waits_name_the_workers_behind_and_their_steps() -> None:
    policy = StalenessPolicy(1)
    c = clocks(0, {0: 5, 1: 2, 2: 3}, {0, 1, 2})
    assert not policy.read_ready(c, 5) and not policy.push_ready(c, 0, 5)
    assert policy.read_ready(c, 3) and policy.push_ready(c, 0, 3)
    message = policy.waiting_for(c, 5)
    assert "needs every worker to have finished 4 steps" in message
    assert message.endswith("{1: 2, 2: 3}")


# -- a sync step's average, through the shard ---------------------------------------------------

TABLE = TableSlice("emb", 2, num_rows=4, row_start=0, row_end=4, init="zeros")
SPECS = (
    VarSpec("w", (2,), "float32"),
    VarSpec("emb", (4, 2), "float32", table=TABLE),
    VarSpec("steps", (), "int64", average=True),
    VarSpec("mean", (2,), "float32", average=True),
)


def sync_shard(workers: int, quorum: int = 0) -> Shard:
    shard = Shard(Limits(max_wait_s=5))
    job = Job("sync", 0, workers, SGD(lr=1.0), SPECS, "m", quorum=quorum)
    start = {
        "w": np.zeros(2, np.float32),
        "steps": np.array(0, np.int64),
        "mean": np.zeros(2, np.float32),
    }
    assert shard.init(0, job, start)
    return shard


def test_a_sync_step_averages_rows_buffers_and_fractions() -> None:
    shard = sync_shard(2)
    assert shard.push(
        0,
        0,
        {
            "w": np.array([1.0, 0.5], np.float32),
            "emb": RowSparse([1, 3, 1], np.array([[1, 1], [4, 4], [2, 2]], np.float32)),
            "steps": np.array(-3, np.int64),
            "mean": np.array([1.0, 2.0], np.float32),
        },
    ).applied
    assert shard.push(
        1,
        0,
        {
            "w": np.array([2.0, 0.0], np.float32),
            "emb": RowSparse([3], np.array([[2, 2]], np.float32)),
            "steps": np.array(-4, np.int64),
            "mean": np.array([2.0, 5.0], np.float32),
        },
    ).applied
    values, clock = shard.pull(0, 1, timeout=1, rows=[("emb", np.arange(4))])
    assert clock == 1
    np.testing.assert_array_equal(values["emb"], [[0, 0], [-1.5, -1.5], [0, 0], [-3, -3]])
    snap = shard.snapshot()
    np.testing.assert_array_equal(snap["w"], [-1.5, -0.25])  # (1 + 2) / 2, (0.5 + 0) / 2
    assert snap["steps"] == -4  # integer buffers: floor of the mean, -7 // 2
    np.testing.assert_array_equal(snap["mean"], [1.5, 3.5])  # float buffers take the mean


def test_quorum_one_closes_every_round_on_its_first_push() -> None:
    shard = sync_shard(2, quorum=1)
    assert shard.push(0, 0, {"w": np.ones(2, np.float32)}).applied
    assert shard.pull(0, 1, timeout=1)[1] == 1
    late = shard.push(1, 0, {"w": np.ones(2, np.float32)})
    assert (late.applied, late.reason) == (False, "late")
    np.testing.assert_array_equal(shard.snapshot()["w"], [-1, -1])


@pytest.mark.parametrize(("quorum", "needs"), [(0, "every live worker's push"), (2, "2 pushes")])
def test_a_sync_wait_says_what_the_round_needs(quorum: int, needs: str) -> None:
    shard = sync_shard(3, quorum=quorum)
    shard.push(0, 0, {"w": np.ones(2, np.float32)})
    with pytest.raises(WaitTimeoutError) as info:
        shard.pull(0, 1, timeout=0)
    assert f"round 0 complete ({needs}); pushed: [0], still waiting for workers [1, 2]" in str(
        info.value
    )
