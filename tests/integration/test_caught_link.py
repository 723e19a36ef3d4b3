"""The replay link (psworker/link.py) against real shard servers on port 0: retries through
lost calls, a shard restarted from its checkpoint gets the pushes since it replayed exactly,
and what cannot be recovered fails with a clear error. Restarts are scheduled, not random."""

from __future__ import annotations

import logging
import random
import re

import numpy as np
import pytest
from faults import FaultPlan
from link_cluster import grad, pull_request

from pswire.errors import (
    InvalidRequestError,
    ShapeMismatchError,
    UnavailableError,
    UnknownVariableError,
    WaitTimeoutError,
)
from pswire.proto import ps_pb2
from psworker.link import BACKOFF_BASE_S, BACKOFF_CAP_S, backoff


def test_backoff_doubles_from_the_base_to_the_cap_with_jitter() -> None:
    rng, same = random.Random(1), random.Random(1)
    for attempt in range(8):
        top = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt)
        pause = backoff(attempt, rng)
        assert top / 2 <= pause <= top
        assert pause == backoff(attempt, same)  # the jitter comes from the rng given
    assert (BACKOFF_BASE_S, BACKOFF_CAP_S) == (0.1, 2.0)
    assert max(backoff(30, rng) for _ in range(50)) <= BACKOFF_CAP_S


def test_pushes_are_logged_until_a_checkpoint_covers_them(cluster) -> None:
    c = cluster()
    assert c.link.checkpointing and c.link.durable == 0
    for step in range(3):
        reply = c.link.push(step, grad(step))
        assert reply.applied and reply.incarnation == c.server.shard.incarnation
    assert sorted(c.link.log) == [0, 1, 2]
    pushed = grad(1)
    np.testing.assert_array_equal(c.link.log[1]["w"], pushed["w"])
    state = c.server.shard.export_state()
    assert state is not None
    c.server.shard.mark_checkpoint(state)  # covers steps 0-2
    c.link.push(3, grad(3))
    assert (c.link.durable, sorted(c.link.log)) == (3, [3])
    assert c.link.register().durable_step == 3


@pytest.mark.parametrize("worker", [0, 1])
def test_a_shard_restarted_from_its_checkpoint_gets_the_lost_pushes_replayed(
    cluster, worker: int
) -> None:
    c = cluster(worker=worker, workers=2)
    for step in range(2):
        c.link.push(step, grad(step))
    state = c.server.shard.export_state()
    assert state is not None
    c.server.shard.mark_checkpoint(state)  # covers steps 0-1
    for step in range(2, 5):
        c.link.push(step, grad(step))
    old = c.link.incarnation
    c.restart(state)  # steps 2-4 are gone with the old process
    reply = c.link.push(5, grad(5))  # refused for the old incarnation, then recovered
    # The replay re-sent every logged step from the checkpoint on, this one included, so the
    # retried call itself finds it applied.
    assert (reply.applied, reply.reason, c.link.recoveries) == (False, "duplicate", 1)
    assert c.link.incarnation == c.server.shard.incarnation != old
    np.testing.assert_array_equal(c.weights(), -np.full(2, 1 + 2 + 3 + 4 + 5 + 6))
    status = c.server.shard.status()
    assert status.pushes_applied == 6 and status.workers[worker][0] == 6  # replayed as itself
    pulled = c.link.pull(pull_request())  # reads carry the new incarnation too
    np.testing.assert_array_equal(pulled["w"], c.weights())


def test_a_restart_found_by_a_pull_replays_too_and_decodes_into_the_callers_array(
    cluster,
) -> None:
    c = cluster()
    state = c.server.shard.export_state()
    assert state is not None
    c.server.shard.mark_checkpoint(state)
    c.link.push(0, grad(0))
    c.restart(state)
    into = {"w": np.empty(2, np.float32)}
    pulled = c.link.pull(pull_request(step=1), into=into)
    assert c.link.recoveries == 1
    np.testing.assert_array_equal(pulled["w"], [-1, -1])
    assert pulled["w"] is into["w"] or np.shares_memory(pulled["w"], into["w"])


def test_a_restart_without_a_checkpoint_is_a_clear_error(cluster) -> None:
    c = cluster(retry_s=2)
    c.link.push(0, grad(0))
    c.restart(None)
    with pytest.raises(
        UnavailableError,
        match=r"restarted without a checkpoint, so its variables are gone: its checkpoint "
        r"directory held no checkpoint \(it saves one as soon as it takes the initial values",
    ):
        c.link.push(1, grad(1))


@pytest.mark.parametrize(
    ("forgotten", "named"), [([7], "[7]"), ([1, 2, 3, 4, 5, 6], "[1, 2, 3, 4, 5]")]
)
def test_a_restart_past_what_the_log_holds_is_a_clear_error(cluster, forgotten, named) -> None:
    c = cluster(retry_s=2)
    state = c.server.shard.export_state()
    assert state is not None
    c.server.shard.mark_checkpoint(state)
    for step in range(8):
        c.link.push(step, grad(step))
    for step in forgotten:  # as if a wrong checkpoint report had made it forget them
        del c.link.log[step]
    c.restart(state)
    with pytest.raises(
        UnavailableError, match=rf"restarted at step 0, .* for steps {re.escape(named)}$"
    ):
        c.link.push(8, grad(8))


def test_a_restart_right_after_a_checkpoint_replays_nothing_and_says_so(cluster, caplog) -> None:
    c = cluster()
    state = c.server.shard.export_state()
    assert state is not None
    c.server.shard.mark_checkpoint(state)
    old = c.link.incarnation
    c.restart(state)  # nothing pushed since: the log is empty
    with caplog.at_level(logging.WARNING, logger="psworker.link"):
        pulled = c.link.pull(pull_request())
    assert c.link.recoveries == 1 and not c.link.log
    np.testing.assert_array_equal(pulled["w"], [0, 0])
    said = (
        f"shard 0 ({c.server.address}) restarted (incarnation {old} -> "
        f"{c.server.shard.incarnation}) at step 0: replaying 0 pushes"
    )
    messages = [r.getMessage() for r in caplog.records if r.name == "psworker.link"]
    assert messages == [said]  # a restarted shard is not an unreachable one
    c.link.push(0, grad(0))
    c.restart(c.server.shard.export_state())  # a second restart: recoveries count on
    c.link.push(1, grad(1))
    assert c.link.recoveries == 2


def test_calls_name_their_rpc_and_wait_no_longer_than_the_links_timeout(cluster) -> None:
    c = cluster()
    with pytest.raises(UnknownVariableError, match=r"^Pull on shard 0 \(127\.0\.0\.1:\d+\)"):
        c.link.pull(ps_pb2.PullRequest(worker_id=0, step=0, names=["nope"]))
    with pytest.raises(ShapeMismatchError, match=r"^PushPull on shard 0 \(127"):
        c.link.push_pull(0, {"w": np.ones(3, np.float32)})
    into = {"w": np.empty(2, np.float32)}
    _, pulled = c.link.push_pull(0, grad(0), into=into)
    assert np.shares_memory(pulled["w"], into["w"]) and (into["w"] == -1).all()
    # The shard waits as long as the call's deadline allows, here the link's timeout (2 s)
    # less the servicer's margin, not its own limit (5 s): a sync barrier that cannot close.
    sync = cluster(mode="sync", workers=2, timeout=2.0)
    sync.link.push(0, grad(0))
    for call in (
        lambda: sync.link.pull(pull_request(step=1)),
        lambda: sync.link.push(1, grad(1)),
    ):
        with pytest.raises(WaitTimeoutError, match=r"gave up after 1\.\ds"):
            call()


def test_calls_are_retried_through_dropped_and_lost_replies(cluster) -> None:
    # The first plan is the outer one: the second counts only the calls the first let through.
    drop, lose = FaultPlan("Push", {1, 2}, "drop"), FaultPlan("Push", {2}, "lose_reply")
    c = cluster(drop, lose)
    replies = [c.link.push(step, grad(step)) for step in range(3)]
    assert [(r.applied, r.reason) for r in replies] == [
        (True, ""),
        (False, "duplicate"),
        (True, ""),
    ]
    assert (drop.fired, lose.fired) == (2, 1)
    assert c.link.recoveries == 0  # the same shard all along: nothing to replay
    np.testing.assert_array_equal(c.weights(), -np.full(2, 1 + 2 + 3))  # each applied once
    status = c.server.shard.status()
    assert (status.pushes_applied, status.pushes_duplicate) == (3, 1)  # the lost reply's retry


def test_the_retry_window_ends_with_an_error_naming_the_call_and_the_shard(cluster) -> None:
    c = cluster(FaultPlan("Push", range(1, 1000), "drop"), retry_s=0.5)
    with pytest.raises(UnavailableError, match=r"Push on shard 0 \(127\.0\.0\.1:\d+\)"):
        c.link.push(0, grad(0))
    assert c.server.shard.status().pushes_applied == 0


def test_other_errors_are_not_retried(cluster) -> None:
    plan = FaultPlan("Push", set(), "drop")  # counts the calls, fires on none
    c = cluster(plan)
    with pytest.raises(InvalidRequestError, match=r"Push on shard 0 .*'w' has shape \(2,\)"):
        c.link.push(0, {"w": np.ones(3, np.float32)})
    assert plan.calls == 1


def test_the_fused_step_recovers_like_the_others(cluster) -> None:
    c = cluster()
    state = c.server.shard.export_state()
    assert state is not None
    c.server.shard.mark_checkpoint(state)
    pushed, pulled = c.link.push_pull(0, grad(0))
    assert pushed.applied and sorted(c.link.log) == [0]
    np.testing.assert_array_equal(pulled["w"], [-1, -1])
    c.restart(state)
    pushed, pulled = c.link.push_pull(1, grad(1))
    assert (pushed.reason, c.link.recoveries) == ("duplicate", 1)  # replayed first
    np.testing.assert_array_equal(pulled["w"], [-3, -3])


def test_a_fused_step_to_a_shard_replaced_while_no_stream_was_open_is_refused_and_replayed(
    cluster,
) -> None:
    c = cluster()
    state = c.server.shard.export_state()
    assert state is not None
    c.server.shard.mark_checkpoint(state)
    c.link.push_pull(0, grad(0))
    with pytest.raises(ShapeMismatchError):  # a refused step ends the open stream
        c.link.push_pull(1, {"w": np.ones(3, np.float32)})
    c.restart(state)  # the next step opens a new stream, to the new shard, with no error
    _, pulled = c.link.push_pull(1, grad(1))
    assert c.link.recoveries == 1  # the step carried the old incarnation and was refused
    np.testing.assert_array_equal(pulled["w"], [-3, -3])


def test_the_replay_log_keeps_copies_of_what_was_pushed(cluster) -> None:
    c = cluster()
    state = c.server.shard.export_state()
    assert state is not None
    c.server.shard.mark_checkpoint(state)
    pushed = grad(0)
    c.link.push(0, pushed)
    pushed["w"][:] = 1000  # the caller reuses its gradient buffer (as torch does)
    c.restart(state)
    c.link.push(1, grad(1))  # replays step 0 from the log, not from the reused buffer
    np.testing.assert_array_equal(c.weights(), [-3, -3])


def test_each_retry_is_logged_with_its_number_and_pause(cluster, caplog) -> None:
    c = cluster(FaultPlan("Push", {1, 2, 3}, "drop"))
    with caplog.at_level(logging.INFO, logger="psworker.link"):
        assert c.link.push(0, grad(0)).applied
    said = [r.getMessage() for r in caplog.records if "; retry " in r.getMessage()]
    where = re.escape(f"Push on shard 0 ({c.server.address})")
    assert len(said) == 3
    for number, message in enumerate(said, start=1):
        assert re.fullmatch(rf"{where}: UNAVAILABLE; retry {number} in \d\.\d\ds", message)


def test_a_fused_step_whose_reply_never_comes_is_named_after_the_stream(cluster) -> None:
    c = cluster(FaultPlan("PushPullStream", {1}, "delay", delay_s=2.0), timeout=0.5)
    with pytest.raises(
        WaitTimeoutError, match=r"^PushPullStream on shard 0 \(127\.0\.0\.1:\d+\): no reply within"
    ):
        c.link.push_pull(0, grad(0))
