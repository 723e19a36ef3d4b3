"""What ``Shard.push_pull`` hands its push and its pull (session, cancellation, options, table
rows), what every push result carries, the step-ahead limit, the membership history's
"rejoined", a refused sync step's message, and how a worker's ``init`` resolves its parameter
groups (``resolve_groups``): found untested by mutation testing (make mutate). Unit level, on
a Shard with an injected clock."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
from hand_clock import Clock

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from pscore.optspec import StepOptions, resolve_groups
from pscore.tables import RowSparse, TableSlice
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import (
    CallCancelledError,
    DuplicateWorkerError,
    InvalidRequestError,
    StepRefusedError,
)

TABLE = TableSlice("emb", 3, num_rows=4, row_start=0, row_end=4)
SPECS = (VarSpec("w", (2,), "float32"), VarSpec("emb", (4, 3), "float32", table=TABLE))
START = {"w": np.array([1.0, 2.0], np.float32)}


HEARTBEAT_S = 10.0


def shard_for(mode: str, workers: int, ahead: int = 16) -> tuple[Shard, Clock]:
    clock = Clock(100.0)
    limits = Limits(max_wait_s=5.0, heartbeat_timeout_s=HEARTBEAT_S, max_step_ahead=ahead)
    shard = Shard(limits, clock=clock)
    job = Job(mode, 0, workers, SGD(lr=1.0), SPECS, "m", job_id="job-7")
    assert shard.init(0, job, START)
    return shard, clock


def keep(arrays, clock):
    return {k: np.array(v) for k, v in arrays.items()}


def grads(scale: float = 1.0) -> dict:
    return {"w": np.full(2, scale, np.float32)}


def test_push_pull_with_rows_reads_every_dense_variable_and_those_rows_after_its_push() -> None:
    shard, _ = shard_for("async", 1)
    before = shard.pull(0, 0, rows=[("emb", np.array([1, 2]))])[0]["emb"]
    pushed = {**grads(), "emb": RowSparse([1], np.ones((1, 3), np.float32))}
    result, snapshot, clock = shard.push_pull(
        0, 0, pushed, keep, timeout=1, rows=[("emb", np.array([1, 2]))]
    )
    assert result.applied and clock == 1
    assert sorted(snapshot) == ["emb", "w"]
    assert snapshot["w"].tolist() == [0.0, 1.0]
    assert np.array_equal(snapshot["emb"], before - np.array([[1, 1, 1], [0, 0, 0]], np.float32))
    _, plain, _ = shard.push_pull(0, 1, grads(), keep, timeout=1)  # no rows: no table
    assert sorted(plain) == ["w"]


def test_push_pull_checks_the_session_that_holds_the_worker_id() -> None:
    shard, _ = shard_for("async", 1)
    shard.register_worker(0, 1, session="first")
    with pytest.raises(DuplicateWorkerError, match="held by client session first"):
        shard.push_pull(0, 0, grads(), keep, timeout=1, session="second")
    assert shard.push_pull(0, 0, grads(), keep, timeout=1, session="first")[0].applied
    # A caller that names no session (a raw client) is not taken for another process.
    assert shard.push_pull(0, 1, grads(), keep, timeout=1)[0].applied
    assert shard.push(0, 2, grads()).applied


def test_push_pull_takes_its_options() -> None:
    shard, _ = shard_for("async", 1)
    result, snapshot, _ = shard.push_pull(0, 0, {}, keep, timeout=1, options=StepOptions(skip=True))
    assert result.skipped and snapshot["w"].tolist() == [1.0, 2.0]
    result, snapshot, _ = shard.push_pull(
        0, 1, grads(), keep, timeout=1, options=StepOptions(values={0: {"lr": 0.5}})
    )
    assert not result.skipped and snapshot["w"].tolist() == [0.5, 1.5]


@pytest.mark.parametrize("waits_in", ["push", "pull"])
def test_a_cancelled_push_pull_ends_at_once_whether_its_push_or_its_pull_waits(
    waits_in: str,
) -> None:
    shard, clock = shard_for("sync", 2)
    step = 0
    if waits_in == "push":  # a push for step 1 waits for round 0, which worker 1 never closes
        assert shard.push(0, 0, grads()).applied
        step = 1
    cancelled = threading.Event()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            shard.push_pull(0, step, grads(), keep, timeout=4, cancelled=cancelled)
        except BaseException as exc:
            errors.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    clock.wait_for_reader(caller)
    cancelled.set()
    caller.join(2)  # well inside the call's own 4 s: only the cancellation ends it this soon
    assert not caller.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], CallCancelledError), errors


def test_every_push_result_carries_the_job_id() -> None:
    shard, _ = shard_for("sync", 1)
    assert shard.push(0, 0, grads()).job_id == "job-7"
    again = shard.push(0, 0, grads())
    assert (again.applied, again.reason, again.job_id) == (False, "duplicate", "job-7")
    assert shard.push_pull(0, 1, grads(), keep, timeout=1)[0].job_id == "job-7"


def test_a_step_too_far_ahead_of_this_workers_own_is_refused_naming_the_limit() -> None:
    shard, _ = shard_for("async", 2, ahead=3)
    for step in range(5):
        assert shard.push(0, step, grads()).applied
    assert shard.push(0, 8, grads()).applied  # its next step is 5: 3 ahead is allowed
    before = shard.snapshot()
    message = (
        "push by worker 1 is for step 4, but its next step here is 0 (at most 3 ahead "
        "allowed: psserver --max-step-ahead); a step from the future would make this "
        "worker's real pushes look like retries"
    )
    # Worker 1 has finished nothing: the others' steps do not move its own limit (async).
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        shard.push(1, 4, grads())
    assert all(np.array_equal(before[k], v) for k, v in shard.snapshot().items())
    assert shard.push(1, 3, grads()).applied


def silence(shard: Shard, clock: Clock, silent: int, workers: int) -> None:
    """Moves the clock past the heartbeat timeout with every worker but ``silent`` heard in
    half-timeout strides (so the silence is that worker's), then expires it."""
    for _ in range(3):
        clock.now += HEARTBEAT_S / 2
        for w in range(workers):
            if w != silent:
                shard.heartbeat(w)
    assert shard.expire_silent() == [silent]


@pytest.mark.parametrize("pushed", [0, 2])
def test_a_dropped_worker_heard_again_is_recorded_as_rejoined_at_its_own_step(
    pushed: int,
) -> None:
    shard, clock = shard_for("async", 2)
    shard.heartbeat(1)
    for step in range(pushed):
        assert shard.push(1, step, grads()).applied
    silence(shard, clock, 1, 2)
    shard.heartbeat(1)
    events = [e for e, _ in shard.status().history if e.kind == "rejoined"]
    assert [(e.worker, e.step) for e in events] == [(1, pushed)]


def test_a_refused_sync_step_says_what_the_shard_holds_and_what_to_do() -> None:
    shard, _ = shard_for("sync", 2)
    huge = {"w": np.full(2, 3e38, np.float32)}
    assert shard.push(0, 0, huge).applied
    with pytest.raises(StepRefusedError):
        shard.push(1, 0, huge)  # the sum overflows
    with pytest.raises(StepRefusedError) as refused:
        shard.push(0, 1, grads())
    assert str(refused.value).startswith("step 0 was refused and not applied: ")
    assert str(refused.value).endswith(
        "; the shard holds the weights from before it. Restart the job (from a checkpoint) "
        "with a smaller learning rate or gradient scaling"
    )
    assert shard.snapshot()["w"].tolist() == [1.0, 2.0]


def test_resolve_groups_gives_each_name_its_group() -> None:
    one = SGD(lr=0.1)
    optimizers, groups = resolve_groups(one, None, ["a", "b"])
    assert optimizers == (one,) and optimizers[0] is one
    assert groups == {"a": 0, "b": 0}
    first, second = SGD(lr=0.1), SGD(lr=0.2)
    optimizers, groups = resolve_groups([first, second], {"b": 1, "a": 0}, ["a", "b", "c"])
    assert optimizers[0] is first and optimizers[1] is second and len(optimizers) == 2
    assert groups == {"a": 0, "b": 1, "c": 0}


@pytest.mark.parametrize(
    ("optimizers", "groups", "message"),
    [
        ([], None, "no optimizer: give one, or one per parameter group"),
        ([SGD()], {"x": 0, "a": 0}, "parameter groups name ['x'], which the model lacks"),
        (
            [SGD(), SGD()],
            {"a": 2, "b": 1},
            "parameter groups {'a': 2} out of range: there are 2 optimizers",
        ),
        ([SGD(), SGD()], {"a": -1}, "parameter groups {'a': -1} out of range"),
    ],
)
def test_resolve_groups_refuses_what_cannot_be_a_grouping(optimizers, groups, message) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        resolve_groups(optimizers, groups, ["a", "b"])
