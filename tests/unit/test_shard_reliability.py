"""Shard rules that keep a job from going silently wrong (issue 14, 17): its own stall is not
the workers' silence, reads never change state, steps are bounded, non-finite results are
refused, the job is worker 0's, waits end on cancellation and shutdown. Timing via an
injected clock: nothing here sleeps for membership."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from pscore.tables import TableSlice
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import (
    CallCancelledError,
    DuplicateWorkerError,
    InvalidRequestError,
    ModelMismatchError,
    StepRefusedError,
    TooLargeError,
    UnavailableError,
    WaitTimeoutError,
)

VALUES = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
SPECS = (VarSpec("w", (2, 3), "float32"), VarSpec("b", (3,), "float32"))


class Clock:
    """A monotonic clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def job(mode: str, workers: int, **overrides) -> Job:
    fields = dict(
        mode=mode,
        staleness=0,
        num_workers=workers,
        optimizer=SGD(lr=1.0),
        variables=SPECS,
        model_digest="m1",
    )
    fields.update(overrides)
    return Job(**fields)  # type: ignore[arg-type]


def shard_with(mode: str, workers: int, clock: Clock | None = None, **limits) -> Shard:
    shard = Shard(Limits(max_wait_s=5, **limits), clock=clock or Clock())
    assert shard.init(0, job(mode, workers), VALUES)
    for w in range(workers):
        shard.register_worker(w, workers)
    return shard


def grad(value: float) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, value) for k, v in VALUES.items()}


# -- item 2: the shard's own stall -----------------------------------------------------------


def test_a_shard_that_heard_nobody_does_not_count_that_time_against_anyone():
    clock = Clock()
    shard = shard_with("sync", 2, clock, heartbeat_timeout_s=30.0)
    clock.now += 45  # the shard was stopped (or cut off) for longer than the timeout
    assert shard.expire_silent() == []  # nobody was heard: nobody is blamed
    first = shard.push(0, 0, grad(1.0))  # the first call after the gap...
    assert first.applied and shard.status().clock == 0  # ...does not close the step alone
    assert shard.expire_silent() == []  # the 45 s are not counted against worker 1
    shard.push(1, 0, grad(3.0))
    assert shard.status().clock == 1
    np.testing.assert_array_equal(shard.snapshot()["w"], VALUES["w"] - 2.0)  # mean of 1 and 3


def test_a_worker_silent_while_others_are_heard_is_dropped():
    clock = Clock()
    shard = shard_with("sync", 2, clock, heartbeat_timeout_s=30.0)
    for _ in range(7):  # worker 0 heartbeats every 5 s; worker 1 is silent for 35 s
        clock.now += 5
        shard.heartbeat(0)
    assert shard.expire_silent() == [1]
    result = shard.push(0, 0, grad(1.0))
    assert result.applied and result.absent == (1,)
    assert shard.status().clock == 1


def test_status_is_a_pure_read():
    clock = Clock()
    shard = shard_with("sync", 2, clock, heartbeat_timeout_s=30.0)
    shard.push(0, 0, grad(1.0))
    for _ in range(7):
        clock.now += 5
        shard.heartbeat(0)
    before = shard.status()
    assert before.live == {0, 1} and before.clock == 0  # status did not drop worker 1
    assert shard.status().live == {0, 1}
    assert shard.expire_silent() == [1]  # the explicit, timed action does
    assert shard.status().clock == 1  # and the round waiting only on worker 1 closed


# -- items 4, 9: steps and dtypes ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["async", "ssp", "sync"])
def test_a_future_or_overflowing_step_is_refused_and_changes_nothing(mode):
    shard = shard_with(mode, 1)
    shard.push(0, 0, grad(1.0))
    before = shard.snapshot()
    for step in (10**9, 2**63 - 1, 18):
        with pytest.raises(InvalidRequestError, match=rf"step {step}"):
            shard.push(0, step, grad(1.0))
    assert {k: v.tobytes() for k, v in shard.snapshot().items()} == {
        k: v.tobytes() for k, v in before.items()
    }
    result = shard.push(0, 1, grad(1.0))  # the real next step is applied, not a "duplicate"
    assert result.applied and shard.status().pushes_applied == 2
    assert shard.heartbeat(0) == 2 and shard.register_worker(0, 1).clock == 2


def test_the_allowed_lead_is_a_limit():
    shard = shard_with("async", 1, max_step_ahead=3)
    assert shard.push(0, 3, grad(1.0)).applied
    with pytest.raises(InvalidRequestError, match="at most 3 ahead"):
        shard.push(0, 8, grad(1.0))


def test_integer_and_bool_variables_cannot_be_trained_but_travel_as_buffers():
    shard = Shard(Limits(max_wait_s=5))
    steps = VarSpec("steps", (1,), "int64")
    with pytest.raises(InvalidRequestError, match=r"'steps' is int64"):
        shard.init(0, job("async", 1, variables=(*SPECS, steps)), None)
    flag = VarSpec("flag", (2,), "bool", average=True)
    assert shard.init(
        0, job("async", 1, variables=(*SPECS, flag)), {**VALUES, "flag": np.ones(2, bool)}
    )


# -- item 5: non-finite results --------------------------------------------------------------


def test_a_sync_step_whose_average_overflows_is_refused_and_every_later_step_fails():
    shard = shard_with("sync", 2)
    before = shard.snapshot()
    shard.push(0, 0, grad(3e38))
    with pytest.raises(StepRefusedError, match="not finite"):
        shard.push(1, 0, grad(3e38))  # float32 sum: inf
    assert shard.snapshot()["w"].tobytes() == before["w"].tobytes()
    with pytest.raises(StepRefusedError, match="step 0 was refused"):
        shard.pull(0, 1)
    with pytest.raises(StepRefusedError):
        shard.push(0, 1, grad(1.0))
    assert "refused" in shard.status().failure


def test_an_async_push_whose_optimizer_result_overflows_is_refused_alone():
    shard = Shard(Limits(max_wait_s=5))
    shard.init(0, job("async", 1, optimizer=SGD(lr=10.0)), VALUES)
    before = shard.snapshot()
    with pytest.raises(StepRefusedError, match="non-finite"):
        shard.push(0, 0, grad(3e38))  # finite gradient, but w - 10 * 3e38 is -inf
    assert {k: v.tobytes() for k, v in shard.snapshot().items()} == {
        k: v.tobytes() for k, v in before.items()
    }
    assert shard.status().pushes_applied == 0 and not shard.status().failure
    assert shard.push(0, 0, grad(1.0)).applied  # the step was not used up


# -- 17.4: the job is worker 0's -------------------------------------------------------------


def test_the_worker_that_differs_from_worker_0_is_blamed_even_when_it_came_first():
    shard = Shard(Limits(max_wait_s=2))
    other = job("async", 2, model_digest="m2", variables=(VarSpec("w", (3, 3), "float32"),))
    assert not shard.init(1, other, None)  # first: provisional, no error yet
    assert shard.init(0, job("async", 2), VALUES)  # worker 0's job is the job
    with pytest.raises(ModelMismatchError, match=r"worker 1's job differs from worker 0's"):
        shard.pull(1, 0)
    assert shard.pull(0, 0)[0]["w"].shape == (2, 3)
    with pytest.raises(ModelMismatchError, match="worker 1's job differs"):
        shard.init(1, other, None)  # and said again at once from now on


# -- items 7, 8: who is in the job -----------------------------------------------------------


def test_a_second_live_process_cannot_claim_a_worker_id_but_a_restarted_one_takes_over():
    clock = Clock()
    shard = Shard(Limits(max_wait_s=2, claim_grace_s=5.0), clock=clock)
    shard.init(0, job("async", 2), VALUES)
    shard.register_worker(1, 2, session="first")
    with pytest.raises(DuplicateWorkerError, match="session first"):
        shard.register_worker(1, 2, session="second")
    clock.now += 6  # the first went silent: a restart takes over
    shard.register_worker(1, 2, session="second")
    with pytest.raises(DuplicateWorkerError, match="now held by client session second"):
        shard.push(1, 0, grad(1.0), session="first")
    assert shard.push(1, 0, grad(1.0), session="second").applied


def test_a_process_whose_init_failed_gives_up_its_claim_and_nothing_else():
    clock = Clock()
    shard = Shard(Limits(max_wait_s=2, claim_grace_s=5.0), clock=clock)
    shard.init(0, job("sync", 2), VALUES)
    shard.register_worker(0, 2, session="zero")
    shard.register_worker(1, 2, session="first")
    # Worker 1's process is restarted once the first went silent, and the restart's init
    # fails (say, a changed model): it gives up its claim.
    clock.now += 6
    shard.register_worker(1, 2, session="wrong")
    shard.release(1, "first")  # no longer the holder: changes nothing
    with pytest.raises(DuplicateWorkerError, match="session wrong"):
        shard.register_worker(1, 2, session="fixed")
    shard.release(1, "wrong")
    # Worker 1 is still in the sync quorum: worker 0's push leaves the round open (a leave
    # would close it); the fixed rerun takes the id at once, not after the grace.
    shard.push(0, 0, grad(1.0), session="zero")
    status = shard.status()
    assert (status.clock, 1 in status.live, status.left) == (0, True, frozenset())
    shard.register_worker(1, 2, session="fixed")
    shard.push(1, 0, grad(1.0), session="fixed")
    assert shard.status().clock == 1


def test_a_worker_that_leaves_stops_holding_back_sync_and_ssp():
    for mode in ("sync", "ssp"):
        shard = shard_with(mode, 2)
        shard.push(0, 0, grad(1.0))
        shard.leave(1)
        assert shard.status().left == {1}
        # sync: the round waiting only on worker 1 closed; ssp: worker 0 may run ahead.
        assert shard.pull(0, 1, timeout=0.5)[1] == 1
        shard.push(0, 1, grad(1.0))
        shard.push(0, 2, grad(1.0))
        shard.heartbeat(1)  # anything it sends brings it back
        assert 1 in shard.status().live


# -- 10, 11, 17.3: waits end; allocation bounded ---------------------------------------------


def test_a_cancelled_wait_ends_at_once():
    shard = shard_with("sync", 2)
    cancelled = threading.Event()
    errors: list[Exception] = []

    def pull() -> None:
        try:
            shard.pull(0, 5, cancelled=cancelled, timeout=30)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=pull)
    thread.start()
    time.sleep(0.2)
    start = time.monotonic()
    cancelled.set()
    shard.wake()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - start < 2
    assert isinstance(errors[0], CallCancelledError)


def test_closing_the_shard_ends_every_wait():
    shard = Shard(Limits(max_wait_s=60))
    shard.init(1, job("async", 2), None)  # worker 1: no values; a pull waits for worker 0
    errors: list[Exception] = []
    thread = threading.Thread(target=lambda: _catch(errors, lambda: shard.pull(1, 0)))
    thread.start()
    time.sleep(0.2)
    shard.close()
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(errors[0], UnavailableError) and "stopping" in str(errors[0])


def _catch(errors: list[Exception], fn) -> None:
    try:
        fn()
    except Exception as exc:
        errors.append(exc)


def test_a_table_over_the_memory_limit_is_refused_and_one_under_it_costs_nothing_until_used():
    table = TableSlice("t", 64, num_rows=10_000_000, row_start=0, row_end=10_000_000)
    big = VarSpec.of_table(table)  # 2.4 GiB of rows, plus SGD's none
    shard = Shard(Limits(max_wait_s=2, memory_limit_bytes=1 << 30))
    with pytest.raises(TooLargeError, match=r"memory limit of 1\.00 GiB"):
        shard.init(0, job("async", 1, variables=(*SPECS, big)), VALUES)
    shard = Shard(Limits(max_wait_s=2, memory_limit_bytes=4 << 30))
    start = time.monotonic()
    assert shard.init(0, job("async", 1, variables=(*SPECS, big)), VALUES)
    assert time.monotonic() - start < 2  # no row drawn at init (it took ~15 s per 2 GiB)
    rows, _ = shard.pull(0, 0, rows=[("t", np.array([5, 9_999_999]))])
    assert rows["t"].shape == (2, 64)


def test_a_refused_declaration_changes_nothing_for_the_worker_that_holds_the_id():
    # Found by the fuzz suite: a stray Init claiming worker 0 with another model must not
    # leave worker 0 refused from then on.
    shard = shard_with("async", 1)
    with pytest.raises(ModelMismatchError, match="worker 0's job differs"):
        shard.init(0, job("async", 1, model_digest="other"), None)
    assert shard.push(0, 0, grad(1.0)).applied
    assert shard.pull(0, 1)[1] == 1


def test_a_pause_just_under_the_timeout_does_not_drop_a_live_worker():
    # A stall shorter than the timeout, then a few seconds before worker 1's next heartbeat:
    # counting the stall would make it look silent for longer than the timeout.
    clock = Clock()
    shard = shard_with("sync", 2, clock, heartbeat_timeout_s=30.0)
    clock.now += 2
    shard.heartbeat(1)
    clock.now += 28  # the shard is stopped, just under the timeout
    shard.heartbeat(0)
    clock.now += 4  # worker 1's next heartbeat is still on its way: 32 s since its last
    shard.heartbeat(0)
    assert shard.expire_silent() == []
    for _ in range(7):  # now worker 1 really is silent while worker 0 is heard
        clock.now += 5
        shard.heartbeat(0)
    assert shard.expire_silent() == [1]


def test_a_worker_registering_late_in_ssp_is_credited_with_no_step_it_never_ran():
    shard = Shard(Limits(max_wait_s=1), clock=Clock())
    shard.init(0, job("ssp", 2, staleness=1), VALUES)
    shard.register_worker(0, 2)
    for step in range(2):
        shard.push(0, step, grad(1.0))
    # Worker 1 first registers now: it starts at 0, and worker 0 waits for it at the gate.
    assert shard.register_worker(1, 2).clock == 0
    with pytest.raises(WaitTimeoutError):
        shard.pull(0, 3, timeout=0.2)
    shard.push(1, 0, grad(1.0))
    shard.push(1, 1, grad(1.0))
    assert shard.pull(0, 3, timeout=0.5)[1] == 4
    # A worker that comes back (it had registered before) resumes level with the others.
    assert shard.register_worker(1, 2).clock == 2
