"""Parameter groups, per-update hyper-parameters, skips and optimizer state on a Shard (plain
Python), and their wire and checkpoint forms."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD, Adam
from pscore.optspec import StepOptions
from pscore.tables import TableSlice
from psserver.checkpoint_codec import decode_state, encode_state
from psserver.records import Limits
from psserver.shard import Shard
from pswire.codec import header_options
from pswire.errors import (
    HyperParameterMismatchError,
    InvalidRequestError,
    ModelMismatchError,
    UnknownVariableError,
)
from pswire.jobspec import job_from_proto, job_to_proto
from pswire.write import push_header

VALUES = {
    "w": np.ones((2, 3), np.float32),
    "b": np.ones(3, np.float32),
    "bn": np.zeros(3, np.float32),
}


def job(mode: str, workers: int = 1, optimizer=None, groups=None, tables=()) -> Job:
    return Job(
        mode=mode,
        staleness=0,
        num_workers=workers,
        optimizer=optimizer or SGD(lr=1.0),
        variables=(
            VarSpec("w", (2, 3), "float32"),
            VarSpec("b", (3,), "float32", group=1),
            VarSpec("bn", (3,), "float32", average=True),
            *tables,
        ),
        model_digest="m",
        groups=groups if groups is not None else (SGD(lr=0.5),),
    )


def shard_for(the_job: Job) -> Shard:
    shard = Shard(Limits(max_wait_s=5))
    assert shard.init(0, the_job, VALUES)
    return shard


def grads(scale: float = 1.0, bn: float = 0.0) -> dict[str, np.ndarray]:
    return {
        "w": np.full((2, 3), scale, np.float32),
        "b": np.full(3, scale, np.float32),
        "bn": np.full(3, bn, np.float32),
    }


def test_each_group_steps_with_its_own_hyper_parameters():
    shard = shard_for(job("async"))
    shard.push(0, 0, grads())
    snap = shard.snapshot()
    np.testing.assert_array_equal(snap["w"], 0.0)  # lr 1
    np.testing.assert_array_equal(snap["b"], 0.5)  # group 1: lr 0.5


def test_a_push_replaces_hyper_parameters_for_its_update_only():
    shard = shard_for(job("async"))
    shard.push(0, 0, grads(), options=StepOptions({1: {"lr": 0.0}, 0: {"lr": 0.25}}))
    snap = shard.snapshot()
    np.testing.assert_array_equal(snap["w"], 0.75)
    np.testing.assert_array_equal(snap["b"], 1.0)  # lr 0: did not move
    shard.push(0, 1, grads())  # no values: the job's again
    np.testing.assert_array_equal(shard.snapshot()["b"], 0.5)


@pytest.mark.parametrize(
    ("options", "detail"),
    [
        (StepOptions({2: {"lr": 0.1}}), "parameter group 2; the job has groups 0"),
        (StepOptions({0: {"momentum": 0.9}}), "which optimizer state exists"),
        (StepOptions({1: {"lr": -1.0}}), "parameter group 1.*invalid lr"),
        (StepOptions({0: {"betas": 0.9}}), "no parameter 'betas'"),
    ],
)
def test_bad_values_are_refused_and_change_nothing(options, detail):
    shard = shard_for(job("sync"))
    with pytest.raises(InvalidRequestError, match=detail):
        shard.push(0, 0, grads(), options=options)
    assert shard.status().clock == 0
    np.testing.assert_array_equal(shard.snapshot()["w"], 1.0)


def test_weight_decay_for_a_tables_group_is_refused():
    table = TableSlice("emb", 4, num_rows=8, row_start=0, row_end=8)
    shard = shard_for(job("async", tables=(VarSpec.of_table(table, group=1),)))
    with pytest.raises(InvalidRequestError, match=r"table 'emb': weight_decay 0\.1"):
        shard.push(0, 0, grads(), options=StepOptions({1: {"weight_decay": 0.1}}))
    shard.push(0, 0, grads(), options=StepOptions({0: {"weight_decay": 0.1}}))  # no table there


def test_sync_pushes_of_one_step_that_disagree_are_refused_naming_workers_group_values():
    shard = shard_for(job("sync", workers=2))
    shard.push(0, 0, grads(), options=StepOptions({1: {"lr": 0.1}}))
    with pytest.raises(HyperParameterMismatchError) as info:
        shard.push(1, 0, grads(), options=StepOptions({1: {"lr": 0.2}}))
    message = str(info.value)
    assert info.value.status == "FAILED_PRECONDITION"
    assert "sync step 0" in message and "parameter group 1" in message
    assert "worker 0 pushed {'lr': 0.1}" in message and "worker 1 pushed {'lr': 0.2}" in message
    assert shard.status().clock == 0  # the step is still open; worker 1 not in it
    shard.push(1, 0, grads(), options=StepOptions({1: {"lr": 0.1}}))  # agreeing: closes it
    assert shard.status().clock == 1
    np.testing.assert_allclose(shard.snapshot()["b"], 0.9)


@pytest.mark.parametrize("skipper", [0, 1], ids=["first-push-skips", "last-push-skips"])
def test_in_sync_a_skip_by_one_worker_skips_the_step_but_buffers_still_average(skipper):
    shard = shard_for(job("sync", workers=2))
    for worker in (0, 1):  # in this order: the skip opens or closes the step
        if worker == skipper:
            bn = {"bn": np.full(3, 2.0, np.float32)}
            shard.push(worker, 0, bn, options=StepOptions(skip=True))
        else:
            shard.push(worker, 0, grads(bn=4.0))
        assert shard.step_skipped(0) == (worker == 1)  # known once the step closed
    assert shard.status().clock == 1
    snap = shard.snapshot()
    np.testing.assert_array_equal(snap["w"], 1.0)
    np.testing.assert_array_equal(snap["bn"], 3.0)
    shard.push(0, 1, grads())
    shard.push(1, 1, grads())
    assert not shard.step_skipped(1)
    np.testing.assert_array_equal(shard.snapshot()["w"], 0.0)


def test_in_async_a_skip_drops_only_that_push():
    shard = shard_for(job("async", workers=2))
    shard.push(1, 0, {"bn": np.full(3, 5.0, np.float32)}, options=StepOptions(skip=True))
    snap = shard.snapshot()
    np.testing.assert_array_equal(snap["w"], 1.0)
    np.testing.assert_array_equal(snap["bn"], 5.0)
    assert not shard.step_skipped(0)  # async: the worker knows its own skip
    shard.push(0, 0, grads())
    np.testing.assert_array_equal(shard.snapshot()["w"], 0.0)
    assert shard.status().clock == 2


def test_worker_0s_loaded_state_becomes_the_shards_and_others_check_the_digest():
    shard = shard_for(job("sync", workers=2, optimizer=Adam(), groups=(Adam(lr=0.1),)))
    shard.push(0, 0, grads())
    shard.push(1, 0, grads())
    state = shard.optimizer_state()
    assert set(state) == {"w", "b"} and state["w"]["step"] == 1
    waiter_error: list[BaseException] = []

    def worker_1() -> None:
        try:
            shard.load_state(1, "digest-a", None, {}, timeout=5)
        except BaseException as exc:
            waiter_error.append(exc)

    waiting = threading.Thread(target=worker_1)
    waiting.start()  # waits for worker 0's load
    slots = {"w": {"step": np.array(7), "exp_avg": np.full((2, 3), 0.5, np.float32)}}
    shard.load_state(0, "digest-a", {"w": np.full((2, 3), 3.0, np.float32)}, slots)
    waiting.join(5)
    assert not waiting.is_alive() and not waiter_error
    state = shard.optimizer_state()
    assert state["w"]["step"] == 7
    np.testing.assert_array_equal(state["w"]["exp_avg"], 0.5)
    np.testing.assert_array_equal(state["w"]["exp_avg_sq"], 0.0)  # not given: fresh
    assert state["b"]["step"] == 0  # not given: fresh
    np.testing.assert_array_equal(shard.snapshot()["w"], 3.0)
    with pytest.raises(ModelMismatchError, match="worker 1 loaded another optimizer state"):
        shard.load_state(1, "digest-b", None, {})


@pytest.mark.parametrize(
    ("slots", "error", "detail"),
    [
        ({"w": {"momentum_buffer": np.zeros((2, 3), np.float32)}}, InvalidRequestError, "slot"),
        ({"w": {"exp_avg": np.zeros((3, 2), np.float32)}}, InvalidRequestError, "shape"),
        ({"w": {"step": np.array(1.5)}}, InvalidRequestError, "count"),
        ({"bn": {"step": np.array(1)}}, UnknownVariableError, "not a trained variable"),
        ({"zz": {"step": np.array(1)}}, UnknownVariableError, "zz"),
    ],
)
def test_a_bad_loaded_state_changes_nothing(slots, error, detail):
    shard = shard_for(job("async", optimizer=Adam(), groups=(Adam(),)))
    shard.push(0, 0, grads())
    before, weights = shard.optimizer_state(), shard.snapshot()
    with pytest.raises(error, match=detail):
        shard.load_state(0, "d", {"w": np.zeros((2, 3), np.float32)}, slots)
    after = shard.optimizer_state()
    assert after["w"]["step"] == before["w"]["step"] == 1
    np.testing.assert_array_equal(after["w"]["exp_avg"], before["w"]["exp_avg"])
    np.testing.assert_array_equal(shard.snapshot()["w"], weights["w"])  # not the zeros sent


def test_options_round_trip_through_the_push_header():
    options = StepOptions({1: {"lr": 0.25, "momentum": 0.5}, 0: {"lr": 1e-3}}, skip=True)
    header = push_header(3, 9, "inc", options)
    assert header_options(header) == options
    assert header_options(push_header(3, 9, None, None)) == StepOptions()
    header.values.add(group=1, params={"lr": 0.1})
    with pytest.raises(InvalidRequestError, match="parameter group 1's hyper-parameters twice"):
        header_options(header)


def test_groups_round_trip_through_the_job_proto_and_a_checkpoint():
    table = TableSlice("emb", 4, num_rows=8, row_start=0, row_end=8)
    the_job = job("sync", tables=(VarSpec.of_table(table, group=1),))
    again = job_from_proto(job_to_proto(the_job))
    assert again == the_job and again.optimizers == (SGD(lr=1.0), SGD(lr=0.5))
    assert again.optimizer_of("emb") == SGD(lr=0.5)
    assert again.differences(job("sync", groups=(SGD(lr=0.4),), tables=the_job.variables[3:]))
    shard = shard_for(the_job)
    state = shard.export_state()
    assert state is not None
    tensors, text = encode_state(state, "inc")
    assert decode_state(text, tensors).job == the_job


def test_groups_of_different_optimizer_classes_each_step_with_their_own():
    # Two models' optimizers in one job (a GAN's SGD and Adam): each group its own class,
    # its own slots, kept across a checkpoint.
    the_job = job("async", groups=(Adam(lr=0.1),))
    shard = shard_for(the_job)
    shard.push(0, 0, {"b": np.full(3, 2.0, np.float32)})
    snap = shard.snapshot()
    np.testing.assert_array_equal(snap["w"], 1.0)  # no gradient: untouched
    np.testing.assert_allclose(snap["b"], 0.9, rtol=1e-6)  # Adam's first step moves lr
    state = shard.export_state()
    assert state is not None
    tensors, text = encode_state(state, "inc")
    assert decode_state(text, tensors).job == the_job


def test_a_job_whose_group_is_out_of_range_is_refused():
    with pytest.raises(InvalidRequestError, match=r"'b' is in parameter group 1; .* groups 0\.\.0"):
        Shard().init(0, job("sync", groups=()), VALUES)  # "b" is in group 1
