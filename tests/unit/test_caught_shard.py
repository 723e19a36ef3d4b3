"""What a Shard reports back, pinned: push results, registrations, heartbeats, status, the fused
push-pull, the observer's view, what an error names, and how long a wait may take. Found
untested by mutation testing (make mutate); an injected clock keeps it exact."""

from __future__ import annotations

import re
import threading
from dataclasses import replace

import numpy as np
import pytest
from hand_clock import Clock

from pscore.job import FIXED_MARK, OBSERVER, Job, VarSpec, fixed_digest
from pscore.optim import SGD
from pscore.tables import RowSparse, TableSlice
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import (
    InvalidRequestError,
    ModelMismatchError,
    NotInitializedError,
    ShardRestartedError,
    WaitTimeoutError,
)

SPECS = (VarSpec("w", (2,), "float32"), VarSpec("b", (3,), "float32"))
START = {"w": np.array([1.0, 2.0], np.float32), "b": np.zeros(3, np.float32)}
MAX_WAIT_S = 3.0


def job(mode: str = "sync", workers: int = 1, quorum: int = 0, specs=SPECS) -> Job:
    return Job(mode, 0, workers, SGD(lr=1.0), specs, "m", quorum=quorum)


def ready(mode: str = "sync", workers: int = 1, quorum: int = 0) -> tuple[Shard, Clock]:
    clock = Clock(500.0)
    shard = Shard(Limits(max_wait_s=MAX_WAIT_S, heartbeat_timeout_s=10), clock=clock)
    assert shard.init(0, job(mode, workers, quorum), START)
    return shard, clock


def ones(scale: float = 1.0) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, scale) for k, v in START.items()}


def recorder(shard: Shard) -> tuple[list, list, list]:
    pushed: list = []
    pulled: list = []
    waited: list = []

    class Seen:
        def pushed(self, grads) -> None:
            pushed.append(sorted(grads))

        def pulled(self, arrays) -> None:
            pulled.append(sorted(arrays))

        def waited(self, call: str, seconds: float) -> None:
            assert seconds >= 0
            waited.append(call)

    shard.observer = Seen()
    return pushed, pulled, waited


# -- a fresh shard ------------------------------------------------------------------------------


def test_a_fresh_shard() -> None:
    shard = Shard()
    assert re.fullmatch(r"[0-9a-f]{12}", shard.incarnation)
    assert Shard().incarnation != shard.incarnation
    assert shard.checkpointing is False and shard.observer is None
    status = shard.status()
    assert (status.initialized, status.job, status.clock) == (False, None, 0)
    assert (status.pushes_applied, status.pushes_duplicate, status.pushes_late) == (0, 0, 0)
    assert (status.checkpoint_step, status.checkpoint_age_s) == (-1, -1.0)
    assert shard.export_state() is None
    registration = shard.register_worker(1, 2)  # before any job: nothing to join
    assert (registration.clock, registration.initialized, registration.durable_step) == (
        0,
        False,
        0,
    )
    with pytest.raises(NotInitializedError, match=r"^this shard holds no job yet: a worker must"):
        shard.push(0, 0, ones())
    with pytest.raises(NotInitializedError, match="holds no job yet"):
        shard.pull(0, 0)


# -- results and registrations ------------------------------------------------------------------


def test_push_results_say_the_clock_the_next_step_and_what_is_durable() -> None:
    shard, _ = ready("sync", workers=3, quorum=2)
    first = shard.push(0, 0, ones())
    assert (first.applied, first.reason, first.clock, first.next_step) == (True, "", 0, 1)
    assert first.durable_step == 0
    assert shard.push(1, 0, ones()).clock == 1  # closed the round
    for step in (1, 2):
        shard.push(0, step, ones())
        shard.push(1, step, ones())
    state = shard.export_state()
    assert state is not None
    shard.mark_checkpoint(state)
    assert shard.push(0, 3, ones()).durable_step == 3
    # Worker 2, three rounds behind: late, and told to go on at the round the shard is in.
    late = shard.push(2, 0, ones())
    assert (late.applied, late.reason, late.clock, late.next_step) == (False, "late", 3, 3)
    assert late.durable_step == 0  # it has nothing in the checkpoint
    duplicate = shard.push(0, 1, ones())
    assert (duplicate.reason, duplicate.next_step, duplicate.durable_step) == ("duplicate", 2, 3)


def test_registration_says_where_a_worker_resumes_and_what_is_durable() -> None:
    shard, _ = ready("sync", workers=2)
    assert shard.register_worker(1, 2) == shard.register_worker(1, 2)  # idempotent
    reg = shard.register_worker(1, 2)
    assert (reg.clock, reg.initialized, reg.durable_step) == (0, True, 0)
    shard.push(0, 0, ones())
    assert shard.register_worker(0, 2).clock == 1  # pushed into the open round: after it
    assert shard.register_worker(1, 2).clock == 0
    shard.push(1, 0, ones())
    state = shard.export_state()
    assert state is not None
    shard.mark_checkpoint(state)
    reg = shard.register_worker(1, 2)
    assert (reg.clock, reg.durable_step) == (1, 1)
    with pytest.raises(ModelMismatchError, match=r"worker 1 says num_workers 3; .* has 2"):
        shard.register_worker(1, 3)


def test_heartbeats_report_the_steps_finished_and_keep_a_worker_heard() -> None:
    shard, clock = ready("sync", workers=2)
    assert shard.heartbeat(1) == 0
    shard.push(1, 0, ones())
    assert shard.heartbeat(1) == 1
    assert shard.heartbeat(0) == 0
    clock.now += 7
    shard.heartbeat(1)
    workers = shard.status().workers
    assert workers == {0: (0, 7.0), 1: (1, 0.0)}
    with pytest.raises(InvalidRequestError, match=r"heartbeat from worker 2\b.*0\.\.1"):
        shard.heartbeat(2)
    with pytest.raises(InvalidRequestError, match="heartbeat from worker -1"):
        shard.heartbeat(-1)
    fresh = Shard(Limits(max_workers=4))
    assert fresh.heartbeat(3) == 0  # before a job, the shard's limit bounds the ids
    with pytest.raises(InvalidRequestError, match=r"heartbeat from worker 4\b.*0\.\.3"):
        fresh.heartbeat(4)


def test_status_reports_workers_bytes_counters_and_the_checkpoint_age() -> None:
    shard, clock = ready("sync", workers=2)
    shard.push(0, 0, ones())
    shard.push(0, 0, ones())  # a duplicate
    clock.now += 2
    shard.push(1, 0, ones())
    status = shard.status()
    assert (status.initialized, status.clock, status.job) == (True, 1, job("sync", 2))
    assert status.workers == {0: (1, 2.0), 1: (1, 0.0)}
    assert status.live == frozenset({0, 1})
    assert status.total_bytes == 4 * 5
    assert (status.pushes_applied, status.pushes_duplicate, status.pushes_late) == (2, 1, 0)
    state = shard.export_state()
    assert state is not None
    shard.mark_checkpoint(state)
    clock.now += 4.5
    status = shard.status()
    assert (status.checkpoint_step, status.checkpoint_age_s) == (1, 4.5)


def test_status_reports_each_table() -> None:
    table = TableSlice("emb", 2, capacity=2, seed=1)
    specs = (*SPECS, VarSpec("emb", (0, 2), "float32", table=table))
    shard = Shard()
    shard.init(0, job("async", specs=specs), START)
    shard.push(0, 0, {"emb": RowSparse([4, 5], np.ones((2, 2), np.float32))})
    shard.push(0, 1, {"emb": RowSparse([6], np.ones((1, 2), np.float32))})
    rows, nbytes, evictions, capacity = shard.status().tables["emb"]
    assert (rows, evictions, capacity) == (2, 1, 2) and nbytes > 0


# -- the fused step -----------------------------------------------------------------------------


def test_push_pull_reads_at_the_step_the_worker_goes_on_to() -> None:
    shard, _ = ready("sync", workers=3, quorum=2)
    seen: list = []

    def encode(arrays, clock):
        seen.append(clock)
        return {k: a.copy() for k, a in arrays.items()}

    shard.push(0, 0, ones(2))
    result, snapshot, clock = shard.push_pull(1, 0, ones(4), encode, timeout=1)
    assert (result.applied, result.next_step, clock, seen) == (True, 1, 1, [1])
    np.testing.assert_array_equal(snapshot["w"], START["w"] - 3)
    # A late worker's push-pull reads the round the shard is in, not its own old step.
    result, snapshot, clock = shard.push_pull(2, 0, ones(100), encode, timeout=1)
    assert (result.reason, result.next_step, clock) == ("late", 1, 1)
    np.testing.assert_array_equal(snapshot["w"], START["w"] - 3)
    with pytest.raises(ShardRestartedError, match="push by worker 0"):
        shard.push_pull(0, 1, ones(), encode, incarnation="0ld")
    with pytest.raises(WaitTimeoutError, match=r"after 0\.0s"):
        shard.push_pull(0, 1, ones(), encode, timeout=0)  # applied; round 1 needs another
    grads = ones(3)
    shard.push_pull(1, 1, grads, encode, timeout=1, take=False)
    np.testing.assert_array_equal(grads["w"], [3, 3])  # not handed over: left as it was
    mine = ones(5)
    with pytest.raises(WaitTimeoutError):
        shard.push_pull(0, 2, mine, encode, timeout=0, take=True)  # first of round 2
    shard.push(1, 2, ones(7))
    np.testing.assert_array_equal(mine["w"], [6, 6])  # handed over: the round's sum and mean


# -- reads --------------------------------------------------------------------------------------


def test_a_pull_returns_copies_of_the_names_asked_for() -> None:
    shard, _ = ready("async")
    values, clock = shard.pull(0, 0, names=["w"])
    assert (sorted(values), clock) == (["w"], 0)
    values["w"][:] = 99
    np.testing.assert_array_equal(shard.snapshot()["w"], START["w"])  # a copy
    assert sorted(shard.pull(0, 0)[0]) == ["b", "w"]


def test_an_observer_pull_reads_without_joining_the_job() -> None:
    shard, clock = ready("sync", workers=2)
    clock.now += 3
    values, _ = shard.pull(OBSERVER, 0)
    np.testing.assert_array_equal(values["w"], START["w"])
    status = shard.status()
    assert sorted(status.workers) == [0, 1] and status.live == frozenset({0, 1})
    assert status.workers[1] == (0, 3.0)  # the observer's read touched nobody
    shard.pull(1, 0)
    assert shard.status().workers[1] == (0, 0.0)  # a worker's read does


def test_the_observer_sees_pushes_pulls_and_waits() -> None:
    shard, _ = ready("async")
    pushed, pulled, waited = recorder(shard)
    shard.push(0, 0, ones())
    shard.pull(0, 1)
    shard.push_pull(0, 1, {"w": np.ones(2, np.float32)}, lambda arrays, clock: None)
    assert pushed == [["b", "w"], ["w"]]
    assert pulled == [["b", "w"], ["b", "w"]]
    assert waited == ["Push", "Pull", "Push", "Pull"]


# -- what errors name ---------------------------------------------------------------------------


def test_errors_name_the_call_the_worker_and_the_values() -> None:
    shard, _ = ready("sync", workers=2)
    with pytest.raises(InvalidRequestError, match=r"^pull from worker 2\b.*0\.\.1"):
        shard.pull(2, 0)
    with pytest.raises(InvalidRequestError, match=r"worker 1 has negative step -3$"):
        shard.pull(1, -3)
    with pytest.raises(InvalidRequestError, match=r"worker 1 has negative step -1$"):
        shard.push(1, -1, ones())
    with pytest.raises(InvalidRequestError, match=r"^init from worker 2\b.*0\.\.1"):
        shard.init(2, job("sync", 2), None)
    with pytest.raises(ShardRestartedError, match=r"^pull by worker 1 was made for .* 0ld"):
        shard.pull(1, 0, incarnation="0ld")
    with pytest.raises(ShardRestartedError, match=r"^push by worker 1 was made for .* 0ld"):
        shard.push(1, 0, ones(), incarnation="0ld")
    shard.push(0, 0, ones())
    with pytest.raises(WaitTimeoutError, match=r"push by worker 0: sync barrier: step 1 needs"):
        shard.push(0, 1, ones(), timeout=0)


def test_a_job_mismatch_names_at_most_ten_differences() -> None:
    specs = tuple(VarSpec(f"v{i:02d}", (1,), "float32") for i in range(12))
    shard = Shard()
    shard.init(0, job("async", specs=specs), {s.key: np.zeros(1, np.float32) for s in specs})
    other = tuple(VarSpec(s.key, (2,), "float32") for s in specs)
    with pytest.raises(ModelMismatchError) as info:
        shard.init(0, job("async", specs=other), None)
    message = str(info.value)
    assert message.startswith("worker 0's job differs from ")
    named = message.split(": ", 1)[1].split("; ")
    assert len(named) == 10 and all(d.startswith("variable 'v") for d in named)


def test_a_job_whose_variables_are_cut_otherwise_says_so_first() -> None:
    # A job placed with "w" whole (checkpointed, say), then a worker that cuts "w" into 12
    # parts (another part_bytes): the mismatch says why before naming ten of the slices.
    shard = Shard()
    whole = (VarSpec("w", (12, 4), "float32"), VarSpec("b", (4,), "float32"))
    shard.init(0, job("async", specs=whole), {s.key: np.zeros(s.shape, np.float32) for s in whole})
    parts = tuple(VarSpec(f"w/part{i}of12", (1, 4), "float32") for i in range(12))
    with pytest.raises(ModelMismatchError) as info:
        shard.init(0, job("async", specs=(*parts, whole[1])), None)
    named = str(info.value).split(": ", 1)[1].split("; ")
    assert named[0].startswith("the same variables, cut into other slices")
    assert "split_bytes or part_bytes" in named[0]
    # A different model (another variable's name) is not said to be cut otherwise.
    with pytest.raises(ModelMismatchError) as info:
        shard.init(0, job("async", specs=(*parts, VarSpec("c", (4,), "float32"))), None)
    assert "cut into other slices" not in str(info.value)


def test_init_keeps_arrays_handed_over_and_copies_the_rest() -> None:
    for take in (False, True):
        shard = Shard()
        values = {k: v.copy() for k, v in START.items()}
        shard.init(0, job("async"), values, take=take)
        values["w"][:] = 42
        assert (shard.snapshot()["w"] == 42).all() == take


# -- how long waits take ------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [0.0, 0.25])
def test_a_wait_gives_up_after_the_callers_timeout_not_the_shards_limit(timeout: float) -> None:
    shard, _ = ready("sync", workers=2)
    shard.push(0, 0, ones())
    for call in (
        lambda: shard.pull(0, 1, timeout=timeout),
        lambda: shard.push(0, 1, ones(), timeout=timeout),
    ):
        with pytest.raises(WaitTimeoutError, match=rf"gave up after {timeout:.1f}s"):
            call()
    unset = Shard(Limits(max_wait_s=0.3))
    unset.init(1, job("sync", 2), None)  # no values yet
    with pytest.raises(WaitTimeoutError, match=r"gave up after 0\.3s waiting for initial values"):
        unset.pull(1, 0)  # no timeout: the shard's limit
    with pytest.raises(WaitTimeoutError, match=r"gave up after 0\.0s waiting for initial values"):
        unset.push(1, 0, ones(), timeout=0)
    with pytest.raises(WaitTimeoutError, match=r"gave up after 0\.0s waiting for initial values"):
        unset.pull(1, 0, timeout=0)


def test_a_wait_with_time_left_is_woken_by_the_push_it_waits_for() -> None:
    shard, clock = ready("sync", workers=2)
    shard.push(0, 0, ones())
    got: list = []
    reader = threading.Thread(target=lambda: got.append(shard.pull(0, 1, timeout=0.9)[1]))
    reader.start()
    with clock.read:
        assert clock.read.wait_for(lambda: reader.ident in clock.readers, 10)
    with shard._cond:  # the reader holds the lock from its first clock read until it waits
        pass
    shard.push(1, 0, ones())
    reader.join(10)
    assert got == [1]


def test_worker_ids_and_counts_at_the_limits() -> None:
    shard = Shard(Limits(max_workers=4))
    assert shard.register_worker(3, 4).clock == 0  # the last id, the largest job allowed
    with pytest.raises(InvalidRequestError, match="worker_id 4 must be in"):
        shard.register_worker(4, 4)
    with pytest.raises(InvalidRequestError, match="worker_id 0 must be in"):
        shard.register_worker(0, 0)


def test_every_duplicate_is_counted() -> None:
    shard, _ = ready("async")
    shard.push(0, 0, ones())
    for _ in range(3):
        assert shard.push(0, 0, ones()).reason == "duplicate"
    assert shard.status().pushes_duplicate == 3


def test_a_push_keeps_the_callers_arrays_unless_told_to_take_them() -> None:
    shard, _ = ready("sync", workers=2)
    first = ones(2)
    shard.push(0, 0, first)  # take defaults to False
    shard.push(1, 0, ones(4))
    np.testing.assert_array_equal(first["w"], [2, 2])
    mine = ones(2)
    with pytest.raises(WaitTimeoutError):
        shard.push_pull(0, 1, mine, lambda arrays, clock: None, timeout=0)
    shard.push(1, 1, ones(4))
    np.testing.assert_array_equal(mine["w"], [2, 2])


def test_a_push_pull_whose_push_must_wait_gives_up_at_its_timeout() -> None:
    shard, _ = ready("sync", workers=2)
    shard.push(0, 0, ones())
    with pytest.raises(WaitTimeoutError, match=r"gave up after 0\.0s waiting for push by worker 0"):
        shard.push_pull(0, 1, ones(), lambda arrays, clock: None, timeout=0)


def test_fixed_values_that_differ_are_said_apart_from_the_model() -> None:
    frozen = {"0.weight": np.ones((2, 2), np.float32)}
    mine = fixed_digest(frozen)
    assert fixed_digest({"0.weight": np.ones((2, 2), np.float32)}) == mine
    for other in (
        {"0.weight": np.full((2, 2), 2.0, np.float32)},  # the values
        {"0.bias": np.ones((2, 2), np.float32)},  # the name
        {"0.weight": np.ones((4,), np.float32)},  # the shape, same bytes
        {"0.weight": np.ones((2, 2), np.float64)},  # the dtype
    ):
        assert fixed_digest(other) != mine, other
    base = job("async")
    held = replace(base, model_digest=base.model_digest + FIXED_MARK + mine)
    sent = replace(base, model_digest=base.model_digest + FIXED_MARK + "0" * 16)
    (said,) = sent.differences(held)
    assert said.startswith("parameters in no optimizer group"), said
    assert f"shard has values with digest {mine}, worker sent {'0' * 16}" in said
    (said,) = base.differences(held)  # a worker holding none where worker 0 holds some
    assert "worker sent none" in said


def test_fixed_values_are_compared_except_for_a_worker_that_restarts() -> None:
    """A worker restarting into a job it pushed steps of may hold other values by then (an EMA
    target network it restored from its own checkpoint); a newcomer is judged, even when the
    others have stepped (an async worker that starts late)."""
    base = job("async", workers=2)
    held = replace(base, model_digest=base.model_digest + FIXED_MARK + "a" * 16)
    other = replace(base, model_digest=base.model_digest + FIXED_MARK + "b" * 16)
    shard = Shard()
    shard.init(0, held, START)
    shard.push(0, 0, ones())  # worker 0 steps before worker 1 arrives
    with pytest.raises(ModelMismatchError, match="parameters in no optimizer group"):
        shard.init(1, other, None)
    shard.init(1, held, None)
    shard.push(1, 0, ones())
    shard.init(1, other, None)  # worker 1 restarts holding others: taken
    assert shard.status().job.model_digest == held.model_digest  # the job's start stays
    with pytest.raises(ModelMismatchError, match="model_digest"):  # the model is still judged
        shard.init(1, replace(other, model_digest="n" + FIXED_MARK + "b" * 16), None)
