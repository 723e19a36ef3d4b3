"""What a mutation run of the shard and its consistency rules showed untested (make mutate,
issue 21): where a worker resumes or joins, a step already open, the step limits, refused sync
rounds closed by a leave or an expiry, cancelled waits for initial values, the claim grace,
a provisional job's refusal, duplicates behind a returning ssp worker, and what ``push_pull``
reports. Unit level, on a Shard with an injected clock; every wait is bounded."""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
from hand_clock import Clock

from pscore.job import OBSERVER, Job, VarSpec
from pscore.optim import SGD
from pscore.optspec import StepOptions
from pscore.tables import RowSparse, TableSlice
from psserver.records import Limits
from psserver.shard import MAX_STEP, Shard
from pswire.errors import (
    CallCancelledError,
    DuplicateWorkerError,
    InvalidRequestError,
    ModelMismatchError,
    StepRefusedError,
    WaitTimeoutError,
)

HEARTBEAT_S = 10.0
SHORT_S = 0.2  # a wait that must end at once in the real code; a broken one times out
SPECS = (VarSpec("w", (2,), "float32"),)
START = {"w": np.array([1.0, 2.0], np.float32)}
HUGE = 3e38  # two of these overflow float32 when a sync round sums them


def make_job(mode: str = "sync", workers: int = 2, lr: float = 1.0, **fields) -> Job:
    return Job(mode, fields.pop("staleness", 0), workers, SGD(lr=lr), SPECS, "m", **fields)


def shard_for(
    mode: str = "sync", workers: int = 2, values: bool = True, limits: Limits | None = None, **job
) -> tuple[Shard, Clock]:
    clock = Clock(100.0)
    limits = limits or Limits(max_wait_s=5.0, heartbeat_timeout_s=HEARTBEAT_S)
    shard = Shard(limits, clock=clock)
    shard.init(0, make_job(mode, workers, **job), START if values else None)
    return shard, clock


def grad(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(2, value, np.float32)}


def keep(arrays, clock):
    return {k: np.array(v) for k, v in arrays.items()}


def cancelled() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def silence(shard: Shard, clock: Clock, heard: tuple[int, ...]) -> None:
    """Moves the clock past the heartbeat timeout in half-timeout strides, hearing ``heard``
    at each (so the silence of the others is theirs, not the shard's)."""
    for _ in range(3):
        clock.now += HEARTBEAT_S / 2
        for w in heard:
            shard.heartbeat(w)


# -- where a worker resumes or joins ------------------------------------------------------------


def test_an_ssp_worker_registering_again_before_the_others_started_resumes_at_its_own_step():
    # Guards StalenessPolicy.join_step: a live worker that never pushed counts as 0 steps done.
    shard, _ = shard_for("ssp", 2, staleness=1)
    assert shard.register_worker(0, 2).clock == 0
    assert shard.register_worker(0, 2).clock == 0  # worker 0 restarted; worker 1 never came
    assert shard.status().workers[0][0] == 0


def elastic_shard(mode: str, workers: int, min_workers: int) -> Shard:
    """An elastic job of up to ``workers`` that workers 0 and 1 have joined at step 0."""
    shard = Shard(Limits(max_wait_s=5.0), clock=Clock(100.0))
    shard.init(0, make_job(mode, workers, min_workers=min_workers, max_workers=workers), START)
    for w in (0, 1):
        shard.register_worker(w, workers)
        assert shard.join(w, "", "prepare", 0).accepted
        assert shard.join(w, "", "commit", 0).accepted
    return shard


def test_an_async_elastic_worker_rejoining_is_offered_the_step_after_its_own_pushes():
    # Guards ConsistencyPolicy.join_step: it asks join_clock about the joining worker itself.
    shard = elastic_shard("async", 2, min_workers=1)
    for step in range(3):
        assert shard.push(1, step, grad(1.0)).applied
    shard.leave(1)
    assert shard.register_worker(1, 2).clock == 3
    assert shard.join(1, "", "propose").step == 3


def test_an_open_elastic_step_runs_to_its_end_after_a_member_leaves_below_the_minimum():
    # Guards ConsistencyPolicy.admits: a step already open is admitted whatever the members.
    shard = elastic_shard("sync", 3, min_workers=2)
    shard.pull(0, 0, timeout=SHORT_S)  # step 0 opens with two members
    shard.leave(1)
    result = shard.push(0, 0, grad(1.0), timeout=SHORT_S)
    assert result.applied and shard.status().clock == 1
    np.testing.assert_array_equal(shard.snapshot()["w"], START["w"] - 1.0)
    with pytest.raises(WaitTimeoutError, match="needs at least 2 members to open step 1"):
        shard.pull(0, 1, timeout=SHORT_S)  # a new step does not open below the minimum


# -- step limits --------------------------------------------------------------------------------


def test_a_sync_worker_moved_on_by_a_late_push_may_push_the_step_it_was_told():
    # Guards Shard._check_ahead: in sync the expected step is at least the shard's clock.
    limits = Limits(max_wait_s=5.0, heartbeat_timeout_s=HEARTBEAT_S, max_step_ahead=1)
    shard, _ = shard_for("sync", 2, limits=limits, quorum=1)
    for step in range(3):
        assert shard.push(0, step, grad(1.0)).applied  # quorum 1: each step closes at once
    late = shard.push(1, 0, grad(1.0))
    assert (late.applied, late.reason, late.next_step) == (False, "late", 3)
    result = shard.push(1, 3, grad(1.0))
    assert result.applied and result.next_step == 4
    with pytest.raises(InvalidRequestError, match="its next step here is 4"):
        shard.push(1, 6, grad(1.0))  # the limit still holds: 6 > 4 + 1


def test_a_push_by_the_observer_id_is_refused_as_no_worker():
    # Guards Shard._check_call's reader=False default: only a pull may come from OBSERVER.
    shard, _ = shard_for("async", 1)
    with pytest.raises(InvalidRequestError, match=r"push from worker -1, but the job has workers"):
        shard.push(OBSERVER, 0, grad(1.0))
    assert shard.status().pushes_applied == 0
    np.testing.assert_array_equal(shard.snapshot()["w"], START["w"])


def test_a_step_of_exactly_2_to_the_62_is_refused_and_one_below_is_read():
    # Guards Shard._check_call's bound: step >= MAX_STEP is refused.
    shard, _ = shard_for("async", 1)
    with pytest.raises(
        InvalidRequestError, match=rf"pull by worker 0 has step {MAX_STEP} >= 2\*\*62"
    ):
        shard.pull(0, MAX_STEP, timeout=SHORT_S)
    values, _ = shard.pull(0, MAX_STEP - 1, timeout=SHORT_S)
    np.testing.assert_array_equal(values["w"], START["w"])


# -- refused sync rounds ------------------------------------------------------------------------


def test_a_fresh_shard_reports_no_failure_as_an_empty_string():
    # Guards Shard.__init__'s _failure: status().failure is a str ("" = none), never None.
    assert Shard().status().failure == ""
    shard, _ = shard_for("sync", 1)
    assert shard.status().failure == ""


def table_values(shard: Shard, table: str) -> np.ndarray:
    state = shard.export_state()
    assert state is not None
    return state.tables[table].values


def test_a_sync_round_whose_summed_rows_overflow_is_refused_before_anything_changes():
    # Guards Shard._apply passing summed=sync_round: a round's rows are checked before the
    # dense variables move, so a refusal leaves every variable as it was.
    table = TableSlice("emb", 3, num_rows=4, row_start=0, row_end=4)
    specs = (*SPECS, VarSpec("emb", (4, 3), "float32", table=table))
    shard = Shard(Limits(max_wait_s=5.0, heartbeat_timeout_s=HEARTBEAT_S), clock=Clock())
    shard.init(0, Job("sync", 0, 2, SGD(lr=1.0), specs, "m"), START)
    rows_before = table_values(shard, "emb").copy()

    def pushed():
        return {**grad(1.0), "emb": RowSparse(np.array([1]), np.full((1, 3), HUGE, np.float32))}

    with warnings.catch_warnings():  # the refusal is the report: no numpy warning besides
        warnings.simplefilter("error")
        assert shard.push(0, 0, pushed()).applied
        with pytest.raises(StepRefusedError, match="the gradient to apply to 'emb' is not finite"):
            shard.push(1, 0, pushed())
    np.testing.assert_array_equal(shard.snapshot()["w"], START["w"])
    assert shard.status().clock == 0
    np.testing.assert_array_equal(table_values(shard, "emb"), rows_before)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_an_update_a_table_refuses_changes_no_variable_buffer_or_row(mode):
    # A table's result is known only after its optimizer step; the dense variables and buffers
    # of the same update must not have moved by then (found by a mutation run: they had).
    table = TableSlice("emb", 3, num_rows=4, row_start=0, row_end=4)
    specs = (
        *SPECS,
        VarSpec("bn", (2,), "float32", average=True),
        VarSpec("emb", (4, 3), "float32", table=table),
    )
    start = {**START, "bn": np.zeros(2, np.float32)}
    shard = Shard(Limits(max_wait_s=5.0, heartbeat_timeout_s=HEARTBEAT_S), clock=Clock())
    shard.init(0, Job(mode, 0, 1, SGD(lr=2.0), specs, "m"), start)
    rows_before = table_values(shard, "emb").copy()
    # lr 2 x 3e38 overflows float32 in the step itself; the gradient alone is finite.
    pushed = {
        **grad(1.0),
        "bn": np.ones(2, np.float32),
        "emb": RowSparse(np.array([1]), np.full((1, 3), HUGE, np.float32)),
    }
    with pytest.raises(StepRefusedError, match=r"made \['emb'\] non-finite .* left as before"):
        shard.push(0, 0, pushed)
    after = shard.snapshot()
    np.testing.assert_array_equal(after["w"], START["w"])
    np.testing.assert_array_equal(after["bn"], [0, 0])
    np.testing.assert_array_equal(table_values(shard, "emb"), rows_before)
    assert (shard.status().clock, shard.status().pushes_applied) == (0, 0)
    if mode == "sync":
        return  # a refused sync step fails every later one (test above)
    pushed["emb"] = RowSparse(np.array([1]), np.ones((1, 3), np.float32))
    assert shard.push(0, 0, pushed).applied  # the same step, finite: every part moves
    after = shard.snapshot()
    np.testing.assert_array_equal(after["w"], START["w"] - 2)
    np.testing.assert_array_equal(after["bn"], [1, 1])
    np.testing.assert_array_equal(table_values(shard, "emb")[1], rows_before[1] - 2)


def test_an_overflowing_sync_sum_is_refused_without_a_numpy_warning():
    # Guards SyncPolicy._close_if_complete's errstate(over="ignore"): the refusal is the report;
    # no RuntimeWarning spills onto the server's stderr (here: raised as an error).
    shard, _ = shard_for("sync", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shard.push(0, 0, grad(HUGE)).applied
        with pytest.raises(StepRefusedError, match="the gradient to apply to 'w' is not finite"):
            shard.push(1, 0, grad(HUGE))


def test_a_sync_round_closed_by_a_leave_and_refused_fails_every_later_step():
    # Guards Shard._membership_changed: the round applies as a sync round (its refusal kept as
    # the shard's failure) and the refusal does not escape the leave.
    shard, _ = shard_for("sync", 3)
    assert shard.push(0, 0, grad(HUGE)).applied
    assert shard.push(1, 0, grad(HUGE)).applied
    shard.leave(2)  # the round closes on workers 0 and 1: their sum overflowed
    failure = shard.status().failure
    assert failure.startswith("step 0 was refused and not applied: the gradient to apply to 'w'")
    with pytest.raises(StepRefusedError, match="step 0 was refused"):
        shard.pull(0, 1, timeout=SHORT_S)
    np.testing.assert_array_equal(shard.snapshot()["w"], START["w"])


def test_a_waiting_pull_fails_with_the_refusal_of_a_round_its_wait_closed():
    # Guards Shard._wait: a refusal met while waiting raises with the shard's failure message.
    shard, clock = shard_for("sync", 3)
    assert shard.push(0, 0, grad(HUGE)).applied
    assert shard.push(1, 0, grad(HUGE)).applied
    silence(shard, clock, heard=(0, 1))  # worker 2 silent past the timeout
    with pytest.raises(StepRefusedError) as info:
        shard.pull(0, 1, timeout=SHORT_S)  # its wait drops worker 2: the round closes, refused
    assert str(info.value).startswith("step 0 was refused and not applied")
    assert shard.status().live == frozenset({0, 1})


# -- cancelled waits ----------------------------------------------------------------------------


def test_a_cancelled_pull_at_the_barrier_says_what_it_was_waiting_for():
    # Guards Shard._wait's CallCancelledError message.
    shard, _ = shard_for("sync", 2)
    with pytest.raises(CallCancelledError) as info:
        shard.pull(0, 1, timeout=SHORT_S, cancelled=cancelled())
    assert str(info.value).startswith(
        "the caller went away while waiting for pull by worker 0: sync barrier"
    )


def test_a_cancelled_pull_waiting_for_initial_values_ends_as_cancelled_not_timed_out():
    # Guards Shard.pull passing its cancel event to the wait for initial values.
    shard, _ = shard_for("sync", 1, values=False)
    with pytest.raises(CallCancelledError, match="initial values from the initialising worker"):
        shard.pull(0, 0, timeout=SHORT_S, cancelled=cancelled())


def test_a_cancelled_push_waiting_for_initial_values_ends_as_cancelled_not_timed_out():
    # Guards Shard.push passing its cancel event to the wait for initial values.
    shard, _ = shard_for("sync", 1, values=False)
    with pytest.raises(CallCancelledError, match="initial values from the initialising worker"):
        shard.push(0, 0, grad(1.0), timeout=SHORT_S, cancelled=cancelled())
    assert shard.status().pushes_applied == 0


# -- init, claims, agreement --------------------------------------------------------------------


def test_init_values_from_a_worker_other_than_0_are_refused_with_a_message_naming_it():
    # Guards Shard.init's InvalidRequestError message.
    shard = Shard()
    with pytest.raises(InvalidRequestError) as info:
        shard.init(1, make_job("sync", 2), START)
    assert str(info.value) == (
        "init from worker 1 carries initial values: only worker 0 sends them"
    )
    assert shard.job_id == "" and not shard.status().initialized


def test_worker_0_initialising_again_withdraws_its_optimizer_state_load():
    # Guards Shard.init forgetting worker 0's load: the others check against its next one.
    shard, _ = shard_for("sync", 2)
    shard.load_state(0, "digest-1", None, {})
    shard.init(1, make_job("sync", 2), None)
    shard.load_state(1, "digest-1", None, {}, timeout=SHORT_S)
    assert not shard.init(0, make_job("sync", 2), START)  # worker 0 restarted
    with pytest.raises(WaitTimeoutError, match="worker 0 to load its optimizer state"):
        shard.load_state(1, "digest-1", None, {}, timeout=SHORT_S)
    shard.load_state(0, "digest-2", None, {})
    with pytest.raises(ModelMismatchError, match="digest-1, worker 0's digest-2"):
        shard.load_state(1, "digest-1", None, {}, timeout=SHORT_S)


@pytest.mark.parametrize(("grace_s", "silent_s", "taken"), [(1.0, 2.0, True), (30.0, 10.0, False)])
def test_a_worker_id_is_taken_over_after_the_limits_claim_grace(grace_s, silent_s, taken):
    # Guards Shard.__init__ handing Limits.claim_grace_s to Membership (its default is 5 s).
    limits = Limits(max_wait_s=5.0, heartbeat_timeout_s=HEARTBEAT_S, claim_grace_s=grace_s)
    shard, clock = shard_for("sync", 1, limits=limits)
    shard.register_worker(0, 1, session="old")
    clock.now += silent_s
    if taken:
        shard.register_worker(0, 1, session="new")
        with pytest.raises(DuplicateWorkerError, match="now held by client session new"):
            shard.heartbeat(0, session="old")
    else:
        with pytest.raises(DuplicateWorkerError, match=f"takes over after {grace_s:g}s"):
            shard.register_worker(0, 1, session="new")


def test_a_push_from_a_worker_whose_provisional_job_lost_to_worker_0s_is_refused():
    # Guards Shard.push checking the agreement for the pushing worker.
    shard = Shard(Limits(max_wait_s=5.0), clock=Clock())
    shard.init(1, make_job("sync", 2, lr=0.5), None)  # worker 1 came first, with another lr
    shard.init(0, make_job("sync", 2, lr=1.0), START)
    with pytest.raises(ModelMismatchError, match="worker 1's job differs from worker 0's"):
        shard.push(1, 0, grad(1.0), timeout=SHORT_S)
    assert shard.status().pushes_applied == 0


# -- duplicates ---------------------------------------------------------------------------------


def test_an_ssp_retry_is_a_duplicate_at_once_even_when_a_returning_worker_holds_the_gate():
    # Guards Shard.push classifying before it waits: a retried step is answered "duplicate"
    # at once, though the ssp gate would now make a new push of it wait.
    shard, clock = shard_for("ssp", 2, staleness=0)
    silence(shard, clock, heard=(0,))
    assert shard.expire_silent() == [1]
    for step in range(3):
        assert shard.push(0, step, grad(1.0), timeout=SHORT_S).applied
    shard.heartbeat(1)  # back without registering: 0 steps finished, in the gate again
    retry = shard.push(0, 2, grad(1.0), timeout=SHORT_S)
    assert (retry.applied, retry.reason, retry.next_step) == (False, "duplicate", 3)
    assert shard.status().pushes_duplicate == 1


# -- what push_pull reports ---------------------------------------------------------------------


def test_push_pull_reports_the_workers_absent_when_its_step_could_be_read():
    # Guards Shard.push_pull setting result.absent after its pull.
    shard, _ = shard_for("sync", 2)
    shard.leave(1)
    result, snapshot, clock = shard.push_pull(0, 0, grad(1.0), keep, timeout=SHORT_S)
    assert (result.absent, clock) == ((1,), 1)
    np.testing.assert_array_equal(snapshot["w"], START["w"] - 1.0)


def test_push_pull_reports_a_step_another_worker_skipped():
    # Guards Shard.push_pull asking step_skipped about the step it pushed.
    shard, _ = shard_for("sync", 2)
    assert shard.push(1, 0, {}, options=StepOptions(skip=True)).applied
    result, snapshot, _ = shard.push_pull(0, 0, grad(1.0), keep, timeout=SHORT_S)
    assert result.applied and result.skipped
    np.testing.assert_array_equal(snapshot["w"], START["w"])  # no optimizer step


def test_a_wait_without_a_heartbeat_timeout_sleeps_instead_of_spinning():
    # Guards Shard._wait's tick when heartbeat_timeout_s is 0 (no silent-worker checks): a
    # zero tick would wake the wait continuously until its deadline, burning a core.
    reads = 0

    def clock() -> float:
        nonlocal reads
        reads += 1
        return time.monotonic()

    shard = Shard(Limits(max_wait_s=5.0, heartbeat_timeout_s=0), clock=clock)
    shard.init(0, make_job("sync", 2), START)
    assert shard.push(0, 0, grad(1.0)).applied
    reads = 0
    with pytest.raises(WaitTimeoutError):
        shard.pull(0, 1, timeout=0.3)  # worker 1 never pushes
    assert reads < 50, f"the wait read the clock {reads} times in 0.3 s"
