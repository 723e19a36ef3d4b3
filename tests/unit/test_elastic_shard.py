"""The shard's side of elastic jobs, with no server: the two-phase join that keeps every shard
counting a joiner from the same step, members per step, the minimum, leaving and dropping,
and the membership kept in a checkpoint. Membership timing runs on an injected clock."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import InvalidRequestError, WaitTimeoutError, WorkerDroppedError

VALUES = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
SPECS = (VarSpec("w", (2, 3), "float32"),)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def job(mode: str = "sync", low: int = 2, high: int = 4, **fields) -> Job:
    return Job(mode, 0, high, SGD(lr=1.0), SPECS, "m1", min_workers=low, max_workers=high, **fields)


def elastic_shard(mode: str = "sync", low: int = 2, high: int = 4, clock=None, **limits) -> Shard:
    shard = Shard(Limits(max_wait_s=5, **limits), clock=clock or Clock())
    assert shard.init(0, job(mode, low, high), VALUES)
    return shard


def join(shard: Shard, worker: int, step: int | None = None) -> int:
    """The client's protocol on one shard: propose, prepare, commit; returns the step."""
    shard.register_worker(worker, shard.status().job.num_workers)
    at = shard.join(worker, "", "propose").step if step is None else step
    assert shard.join(worker, "", "prepare", at).accepted
    assert shard.join(worker, "", "commit", at).accepted
    return at


def grad(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((2, 3), value, np.float32)}


def test_an_elastic_job_starts_empty_and_opens_no_step_below_its_minimum():
    shard = elastic_shard()
    assert shard.status().live == frozenset()
    assert join(shard, 0) == 0
    with pytest.raises(WaitTimeoutError) as info:
        shard.pull(0, 0, timeout=0.2)
    assert "needs at least 2 members to open step 0, and has 1: [0]" in str(info.value)
    assert "no other worker has joined yet" in str(info.value)
    assert join(shard, 1) == 0  # step 0 never opened: the second joins at it
    shard.pull(0, 0, timeout=0.2)
    shard.push(0, 0, grad(1.0))
    shard.push(1, 0, grad(3.0))
    np.testing.assert_array_equal(shard.snapshot()["w"], VALUES["w"] - 2.0)


def test_a_joiner_trains_from_the_next_step_once_the_current_one_opened():
    shard = elastic_shard()
    join(shard, 0), join(shard, 1)
    shard.pull(0, 0)  # step 0 is open
    assert join(shard, 2) == 1
    shard.push(0, 0, grad(1.0))
    assert shard.status().clock == 0
    shard.push(1, 0, grad(3.0))  # step 0 closes on its own members: worker 2 is not one
    assert shard.status().clock == 1
    with pytest.raises(InvalidRequestError, match="joined at step 1"):
        shard.push(2, 0, grad(1.0))
    for w, g in ((0, 1.0), (1, 2.0)):
        shard.push(w, 1, grad(g))
    assert shard.status().clock == 1  # step 1 waits for worker 2 too
    shard.push(2, 1, grad(6.0))
    np.testing.assert_array_equal(shard.snapshot()["w"], VALUES["w"] - 2.0 - 3.0)


def test_two_shards_a_step_apart_agree_on_the_joiners_step():
    ahead, behind = elastic_shard(), elastic_shard()
    for s in (ahead, behind):
        join(s, 0, 0), join(s, 1, 0)
    ahead.pull(0, 0)  # a worker's pull reached one shard first: step 0 is open there only
    for s in (ahead, behind):
        s.register_worker(2, 4)
    proposals = [s.join(2, "", "propose").step for s in (ahead, behind)]
    assert proposals == [1, 0]
    step = max(proposals)  # what the client prepares everywhere
    assert all(s.join(2, "", "prepare", step).accepted for s in (ahead, behind))
    # Meanwhile step 1 cannot open on either shard: it waits for the join to commit.
    for s in (ahead, behind):
        for w in (0, 1):
            s.push(w, 0, grad(1.0))
    with pytest.raises(WaitTimeoutError, match=r"worker\(s\) \[2\] finish joining"):
        behind.pull(0, 1, timeout=0.2)
    for s in (ahead, behind):
        s.join(2, "", "commit", step)
        assert s.status().live == {0, 1, 2}
        s.pull(0, 1, timeout=0.2)
        assert s.list_members(0, 1).members == (0, 1, 2)


def test_a_prepare_at_an_opened_step_is_refused_with_the_step_to_take_instead():
    shard = elastic_shard()
    join(shard, 0, 0), join(shard, 1, 0)
    shard.register_worker(2, 4)
    shard.pull(1, 0)  # opens step 0
    refused = shard.join(2, "", "prepare", 0)
    assert (refused.accepted, refused.step) == (False, 1)
    assert shard.status().pending == frozenset()
    with pytest.raises(InvalidRequestError, match="prepared none here"):
        shard.join(2, "", "commit", 0)
    assert shard.join(2, "", "prepare", 1).accepted
    assert shard.join(2, "", "abort").accepted and not shard.status().pending


def test_joins_into_a_fixed_job_past_the_maximum_or_twice_are_refused():
    shard = elastic_shard(low=1, high=2)
    join(shard, 0), join(shard, 1)
    with pytest.raises(InvalidRequestError, match="member already"):
        shard.join(0, "", "propose")
    with pytest.raises(InvalidRequestError, match=r"workers 0\.\.1"):
        shard.join(2, "", "propose")  # at most MAX members: their ids are below it
    shard.leave(1)
    assert join(shard, 1) == 0  # a worker that left joins again
    fixed = Shard(Limits(max_wait_s=5))
    fixed.init(0, Job("sync", 0, 2, SGD(lr=1.0), SPECS, "m1"), VALUES)
    with pytest.raises(InvalidRequestError, match="not elastic"):
        fixed.join(1, "", "propose")


def test_a_member_that_left_or_was_dropped_cannot_push_until_it_joins_again():
    clock = Clock()
    shard = elastic_shard(low=1, clock=clock, heartbeat_timeout_s=10.0)
    join(shard, 0), join(shard, 1)
    shard.leave(1)
    with pytest.raises(WorkerDroppedError, match=r"worker 1 .*left at step 0"):
        shard.push(1, 0, grad(1.0))
    shard.heartbeat(1)  # hearing from it does not bring it back in an elastic job
    assert shard.status().live == {0}
    # Heard every 4 s (the shard's own silence, half the timeout, would not count against
    # anyone): worker 0 goes silent for 12 s while worker 2 is heard.
    clock.now += 4
    shard.heartbeat(0)
    clock.now += 4
    join(shard, 2)
    for _ in range(2):
        clock.now += 4
        shard.heartbeat(2)
    assert shard.expire_silent() == [0]
    with pytest.raises(WorkerDroppedError, match=r"worker 0 .*dropped at step 0"):
        shard.push(0, 0, grad(1.0))
    kinds = [(e.kind, e.worker) for e, _ in shard.status().history]
    assert kinds == [("joined", 0), ("joined", 1), ("left", 1), ("joined", 2), ("dropped", 0)]


def test_a_silent_joiner_is_forgotten_and_the_step_it_held_opens():
    clock = Clock()
    shard = elastic_shard(clock=clock, heartbeat_timeout_s=10.0)
    join(shard, 0), join(shard, 1)
    shard.register_worker(2, 4)
    assert shard.join(2, "", "prepare", 0).accepted
    for _ in range(3):  # heard every 4 s: no pause (over 5 s of silence from everyone)
        clock.now += 4
        shard.heartbeat(0), shard.heartbeat(1)
    assert shard.expire_silent() == [2]  # its prepared join, not a member
    shard.pull(0, 0, timeout=0.2)
    assert shard.status().live == {0, 1}


def test_a_step_whose_members_all_left_closes_empty_for_those_who_joined_after_it():
    shard = elastic_shard(low=1)
    join(shard, 0)
    shard.pull(0, 0)  # step 0 open, with worker 0 alone
    assert join(shard, 1) == 1
    shard.leave(0)  # nobody will push step 0 now
    assert shard.status().clock == 1  # it closed with no update...
    np.testing.assert_array_equal(shard.snapshot()["w"], VALUES["w"])  # ...and nothing applied
    shard.push(1, 1, grad(1.0))
    assert shard.status().clock == 2


def test_members_wait_for_a_step_to_open_and_are_those_it_opened_with():
    shard = elastic_shard(low=1)
    join(shard, 0), join(shard, 1)
    done = threading.Event()
    views = []

    def ask() -> None:
        views.append(shard.list_members(0, 1, timeout=5))
        done.set()

    threading.Thread(target=ask, daemon=True).start()
    time.sleep(0.1)
    assert not done.is_set()  # step 1 cannot be read before step 0 closes
    shard.push(0, 0, grad(1.0)), shard.push(1, 0, grad(1.0))
    assert done.wait(5)
    shard.leave(1)  # after step 1 opened: its members stay those it opened with
    assert views[0].members == shard.list_members(0, 1).members == (0, 1)
    assert shard.list_members(0, 1).rosters == ((0, (0, 1)),)


def test_a_checkpoint_keeps_the_members_and_the_rosters():
    shard = elastic_shard(low=1)
    join(shard, 0), join(shard, 1)
    shard.pull(0, 0)
    join(shard, 2)
    state = shard.export_state()
    assert state is not None and state.members == {0: 0, 1: 0, 2: 1}
    restored = Shard(Limits(max_wait_s=5))
    restored.restore(state)
    assert restored.status().live == {0, 1, 2}
    assert restored.list_members(-1, 0).members == (0, 1)
    assert restored.status().job.min_workers == 1


def test_ssp_and_async_count_a_joiner_from_its_join_and_hold_nothing_below_the_minimum():
    ssp = Shard(Limits(max_wait_s=5), clock=Clock())
    ssp.init(0, Job("ssp", 1, 4, SGD(lr=1.0), SPECS, "m1", min_workers=2, max_workers=4), VALUES)
    join(ssp, 0), join(ssp, 1)
    ssp.push(1, 0, grad(1.0))
    for step in range(3):
        ssp.push(0, step, grad(1.0))  # worker 0 finished 3 steps, worker 1 one
    assert join(ssp, 2) == 1  # level with the slowest member: it holds nobody back
    with pytest.raises(WaitTimeoutError, match="ssp gate"):
        ssp.push(0, 3, grad(1.0), timeout=0.2)  # staleness 1: waits for workers 1 and 2
    ssp.leave(1), ssp.leave(2)
    with pytest.raises(WaitTimeoutError, match="at least 2 members to open step 3"):
        ssp.pull(0, 3, timeout=0.2)  # alone, worker 0 may not run on
    asynchronous = elastic_shard("async", low=1)
    join(asynchronous, 0)
    for step in range(4):
        asynchronous.push(0, step, grad(1.0))
    assert join(asynchronous, 1) == 0  # async: a worker's steps are its own
    asynchronous.push(1, 0, grad(1.0))
    assert asynchronous.status().clock == 5


def test_a_prepared_join_outlives_a_shard_pause_as_members_do():
    # The repro: a pause (nobody heard for 60 s) is the shard's silence, not the
    # joiner's; members equally silent are kept, so the prepared join must be kept too.
    from psserver.membership import Membership

    m = Membership(timeout_s=10)
    m.start(4, 0.0, elastic=True, members={0: 0, 2: 0}, min_workers=1)
    m.prepare(1, step=5, now=0.0)
    m.touch(0, now=60.0)
    assert m.expire(60.1) == []
    assert m.pending == {1: 5}
    # Once the shard hears others again, a joiner that stays silent is dropped as a member is.
    for t in (64.0, 68.0, 72.0):
        m.touch(0, now=t), m.touch(2, now=t)
    assert m.expire(72.0) == [1]


def test_a_join_prepared_before_a_shard_pause_commits_after_it():
    clock = Clock()
    shard = elastic_shard(low=1, clock=clock, heartbeat_timeout_s=10.0)
    join(shard, 0)
    shard.register_worker(2, 4)
    at = shard.join(2, "", "propose").step
    assert shard.join(2, "", "prepare", at).accepted
    clock.now += 60  # the shard is paused: nobody is heard
    shard.heartbeat(0)
    assert shard.expire_silent() == []
    assert shard.join(2, "", "commit", at).accepted  # was: "prepared none here"
    assert shard.status().live == {0, 2}


def test_a_restored_member_keeps_its_join_step_and_pushes_before_it_are_refused(tmp_path):
    # Issue 27 item 21: restored at k, the joiner's pushes before k are still refused, its
    # push at k is taken, and the members from the start keep theirs (through a real file).
    from psserver.checkpoint import Checkpointer

    shard = elastic_shard(low=1)
    join(shard, 0), join(shard, 1)
    for step in range(3):
        shard.push(0, step, grad(1.0)), shard.push(1, step, grad(1.0))
    k = join(shard, 2)
    assert k == 3
    checkpointer = Checkpointer(tmp_path)
    state = shard.export_state()
    assert state is not None
    checkpointer.save(state)
    restored = Shard(Limits(max_wait_s=5), clock=Clock())
    loaded = checkpointer.load_latest()
    assert loaded is not None
    restored.restore(loaded)
    assert restored.status().live == {0, 1, 2}
    with pytest.raises(
        InvalidRequestError, match=f"push by worker 2 for step {k - 1}, but it joined at step {k}"
    ):
        restored.push(2, k - 1, grad(1.0))
    assert restored.status().pushes_applied == state.counters["applied"]  # nothing changed
    for w in (0, 1, 2):
        assert restored.push(w, k, grad(1.0)).applied
    assert restored.status().clock == k + 1  # step k closed with all three
