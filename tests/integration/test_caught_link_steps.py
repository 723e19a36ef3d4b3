"""A worker's step through the replay link (psworker/link.py) against a real shard server: the
fused step sends before it waits, carries the step's options, session and deadline, is sent
again when the shard cancelled its idle stream; the streamed push-then-pull reads the step
after its push; a skipped sync step is reported by every read of it."""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import grpc
import numpy as np
import pytest
from faults import FaultPlan
from link_cluster import grad, pull_request

import psworker
from pscore.optim import SGD
from pscore.optspec import StepOptions
from pscore.tables import RowSparse
from psserver.records import Limits
from pswire.errors import (
    ClientClosedError,
    DuplicateWorkerError,
    ModelMismatchError,
    TooLargeError,
    UnavailableError,
    WaitTimeoutError,
)
from pswire.write import SMALL_BYTES
from psworker.link import ShardLink

HALF_LR = StepOptions(values={0: {"lr": 0.5}})  # the job's lr is 1


def test_a_fused_step_is_sent_before_its_reply_is_awaited(cluster) -> None:
    c = cluster()
    finish = c.link.start_push_pull(0, grad(0))
    deadline = time.monotonic() + 10
    while c.server.shard.status().pushes_applied == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.server.shard.status().pushes_applied == 1  # nobody has asked for the reply yet
    pushed, pulled = finish()
    assert pushed.applied
    np.testing.assert_array_equal(pulled["w"], [-1, -1])


def test_a_fused_steps_options_reach_the_shard_and_the_replay_log(cluster) -> None:
    c = cluster()
    _, pulled = c.link.push_pull(0, grad(0), options=HALF_LR)
    np.testing.assert_array_equal(pulled["w"], [-0.5, -0.5])
    assert c.link.logged_options == {0: HALF_LR}  # a replay applies it with the same lr


def test_a_fused_step_waits_at_the_shard_no_longer_than_the_links_timeout(cluster) -> None:
    # The step carries its own deadline: the shard gives up on the sync barrier and says what
    # it waited for (without it, the shard would wait its own 5 s and the link's watchdog
    # would cut the call with no reason given).
    # A step under SMALL_BYTES and one over it (its tensors written aligned).
    for size in (2, SMALL_BYTES // 4):
        c = cluster(mode="sync", workers=2, timeout=2.0, size=size)
        with pytest.raises(WaitTimeoutError, match=r"^PushPull on shard 0 .*gave up after 1\.\ds"):
            c.link.push_pull(0, {"w": np.ones(size, np.float32)})


def test_a_step_carries_the_client_process_session(cluster) -> None:
    c = cluster()
    channel = grpc.insecure_channel(c.server.address)
    try:
        # Another process using this worker's id, past registration: its steps are refused.
        config = dataclasses.replace(c.link.config, session="another-process", retry_s=0.5)
        intruder = ShardLink(0, c.server.address, channel, config)
        intruder.incarnation = c.link.incarnation
        with pytest.raises(DuplicateWorkerError, match="worker id 0"):
            intruder.push_pull(0, grad(0))
        with pytest.raises(DuplicateWorkerError, match="worker id 0"):
            intruder.push(0, grad(0))
        intruder.close()
    finally:
        channel.close()
    assert c.server.shard.status().pushes_applied == 0
    c.link.push_pull(0, grad(0))  # the holder's own steps go through
    c.link.push(1, grad(1))
    assert c.server.shard.status().pushes_applied == 2


def test_a_streamed_pushs_options_reach_the_shard_and_the_replay_log(cluster) -> None:
    c = cluster()
    c.link.push(0, grad(0), HALF_LR)
    np.testing.assert_array_equal(c.weights(), [-0.5, -0.5])
    assert c.link.logged_options == {0: HALF_LR}


def test_a_replayed_push_is_applied_with_its_own_options(cluster) -> None:
    c = cluster()
    state = c.server.shard.export_state()
    assert state is not None
    c.server.shard.mark_checkpoint(state)
    c.link.push(0, grad(0), HALF_LR)  # lost with the shard, then replayed at lr 0.5
    c.link.push(1, grad(1))
    c.restart(state)
    c.link.push(2, grad(2))
    assert c.link.recoveries == 1
    np.testing.assert_array_equal(c.weights(), [-(0.5 + 2 + 3)] * 2)


def test_a_fused_step_that_finds_no_shard_names_the_call_when_it_gives_up(cluster) -> None:
    c = cluster(FaultPlan("PushPullStream", range(1, 1000), "drop"), retry_s=0.5)
    with pytest.raises(
        UnavailableError, match=r"^PushPull on shard 0 \(127\.0\.0\.1:\d+\): shard unreachable"
    ):
        c.link.push_pull(0, grad(0))
    assert c.server.shard.status().pushes_applied == 0


def test_a_closed_link_sends_no_step(cluster) -> None:
    c = cluster()
    c.link.close()
    with pytest.raises(ClientClosedError, match=r"^PushPull on shard 0 .*the client was closed"):
        c.link.push_pull(0, grad(0))
    assert c.server.shard.status().pushes_applied == 0


def test_a_step_sent_as_the_shard_cancels_its_idle_stream_is_sent_again(cluster) -> None:
    c = cluster(stream_idle_s=0.3)
    c.link.push_pull(0, grad(0))
    time.sleep(1.5)  # the shard cancels the open stream; the link still holds it
    pushed, pulled = c.link.push_pull(1, grad(1))
    assert pushed.applied
    np.testing.assert_array_equal(pulled["w"], [-3, -3])
    assert c.server.shard.status().pushes_applied == 2


def test_push_then_pull_reads_the_step_after_its_push_into_the_callers_arrays(cluster) -> None:
    c = cluster(mode="sync")
    into = {"w": np.empty(2, np.float32)}
    pull = pull_request(0)
    pushed, pulled = c.link.push_then_pull(0, grad(0), None, pull, into)
    assert (pushed.applied, pushed.skipped, pull.step) == (True, False, 1)
    np.testing.assert_array_equal(pulled["w"], [-1, -1])
    assert np.shares_memory(pulled["w"], into["w"])
    assert sorted(c.link.log) == [0]
    pushed, pulled = c.link.push_then_pull(1, grad(1), HALF_LR, pull_request(0), into)
    np.testing.assert_array_equal(pulled["w"], [-2, -2])  # -1 - 0.5 * 2
    assert c.link.logged_options == {1: HALF_LR}


def test_a_step_another_worker_skipped_is_reported_by_every_read_of_it(cluster) -> None:
    c = cluster(mode="sync", workers=2)
    other = psworker.PSClient(
        psworker.ClientSettings(
            addresses=(c.server.address,), worker_id=1, num_workers=2, heartbeat_s=0
        )
    )
    try:
        other.init({"w": np.zeros(2, np.float32)}, SGD(lr=1.0))
        assert other.links[0].push(0, {}, StepOptions(skip=True)).applied
        pushed, pulled = c.link.push_then_pull(0, grad(0), None, pull_request(0), {})
        assert pushed.skipped is True  # this worker did not skip: the pull said so
        np.testing.assert_array_equal(pulled["w"], [0, 0])  # no update for step 0
        c.link.pull(pull_request(1))
        assert c.link.pull_skipped is True
        other.links[0].push(1, grad(1))
        c.link.push(1, grad(1))
        pulled = c.link.pull(pull_request(2))
        assert c.link.pull_skipped is False
        np.testing.assert_array_equal(pulled["w"], [-2, -2])
    finally:
        other.close()


def test_a_full_replay_log_the_shard_cannot_checkpoint_is_an_error_naming_the_push(
    cluster,
) -> None:
    c = cluster()  # its server has no checkpoint saver: the Checkpoint call fails
    c.link.config = dataclasses.replace(c.link.config, replay_bytes=1)
    for step in range(4):  # the log takes at least four pushes (4 x 8 bytes)
        c.link.push(step, grad(step))
    with pytest.raises(TooLargeError) as info:
        c.link.push(4, grad(4))
    where = re.escape(f"Push on shard 0 ({c.server.address})")
    assert re.match(
        rf"{where}: this worker's replay log holds 32 bytes of pushes no checkpoint covers "
        r"\(limit 32, PS_REPLAY_BYTES\), and the shard could not checkpoint \(.+\); refusing to "
        r"grow it further$",
        str(info.value),
    ), str(info.value)
    assert sorted(c.link.log) == [0, 1, 2, 3] and c.server.shard.status().pushes_applied == 4


def test_a_reply_from_a_shard_holding_another_job_is_refused_naming_it(cluster) -> None:
    c = cluster()
    job = c.link.identity.value
    assert job  # learnt at registration
    c.link.identity.value = "another-run"  # as if this worker had trained another run
    with pytest.raises(ModelMismatchError) as info:
        c.link.push(0, grad(0))
    assert str(info.value).startswith(
        f"shard 0 ({c.server.address}) holds job {job}, but this worker trains job another-run"
    )


def test_the_replay_log_counts_the_bytes_it_holds_as_it_forgets(cluster) -> None:
    c = cluster()
    rows = RowSparse(np.array([1, 2], np.int64), np.ones((2, 3), np.float32))
    c.link.note_push(0, grad(0), HALF_LR)  # 8 bytes
    c.link.note_push(1, {"t": rows})  # 16 bytes of ids, 24 of rows
    c.link.note_push(2, grad(2), HALF_LR)
    assert c.link.log_bytes == 8 + 40 + 8
    c.link.durable = 1
    c.link._forget()
    assert (sorted(c.link.log), c.link.log_bytes) == ([1, 2], 40 + 8)
    assert c.link.logged_options == {2: HALF_LR}  # forgotten with their pushes
    c.link.durable = 2
    c.link._forget()
    assert (sorted(c.link.log), c.link.log_bytes) == ([2], 8)


def test_a_process_that_lost_its_worker_id_cannot_make_the_new_holder_leave(cluster) -> None:
    c = cluster(limits=Limits(max_wait_s=5, claim_grace_s=0.2))
    time.sleep(0.5)  # this process is silent past the claim grace (no heartbeats here)
    channel = grpc.insecure_channel(c.server.address)
    try:
        config = dataclasses.replace(c.link.config, session="restarted-process")
        successor = ShardLink(0, c.server.address, channel, config)
        successor.register()  # takes worker 0 over
        c.link.leave()  # the old process's leave is refused (and only logged)
        assert 0 not in c.server.shard.status().left
        successor.leave()
        assert 0 in c.server.shard.status().left
        successor.close()
    finally:
        channel.close()


def test_registering_with_a_shard_that_holds_another_job_is_refused_naming_it(cluster) -> None:
    c = cluster()
    job = c.link.identity.value
    c.link.identity.value = "another-run"
    with pytest.raises(ModelMismatchError) as info:
        c.link.register()
    assert str(info.value).startswith(
        f"shard 0 ({c.server.address}) holds job {job}, but this worker trains job another-run"
    )


def test_a_restarted_process_waits_for_its_old_claim_to_lapse_and_says_so(
    cluster, caplog: pytest.LogCaptureFixture
) -> None:
    c = cluster(limits=Limits(max_wait_s=5, claim_grace_s=1.0))
    channel = grpc.insecure_channel(c.server.address)
    try:
        config = dataclasses.replace(c.link.config, session="restarted-process")
        successor = ShardLink(0, c.server.address, channel, config)
        with caplog.at_level(logging.WARNING, logger="psworker.link"):
            assert successor.register().job_id == c.link.identity.value  # after the grace
        said = {r.getMessage() for r in caplog.records if r.name == "psworker.link"}
        assert said == {
            f"Register on shard 0 ({c.server.address}): waiting for the old claim to lapse"
        }
        successor.close()
    finally:
        channel.close()
