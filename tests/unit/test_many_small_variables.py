"""A shard holding many small variables (whose checks run over all of them at once) applies,
refuses and names a non-finite step exactly as it does for one variable; so does a worker
checking many small gradients."""

from __future__ import annotations

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD, Adam, Optimizer
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import InvalidRequestError, StepRefusedError
from psworker.outgoing import split_push
from psworker.placement import VarInfo, plan

N = 200  # well past the batch threshold (pscore.checks.BATCH_ARRAYS)
BAD = "v137"


def shard_of(mode: str, workers: int, optimizer: Optimizer) -> tuple[Shard, dict]:
    values = {f"v{i}": np.full(4, float(i), np.float32) for i in range(N)}
    specs = tuple(VarSpec(k, (4,), "float32") for k in values)
    shard = Shard(Limits(max_wait_s=5))
    assert shard.init(0, Job(mode, 0, workers, optimizer, specs, "digest", 0), values)
    return shard, values


def grads(value: float = 1.0, bad: float | None = None) -> dict[str, np.ndarray]:
    out = {f"v{i}": np.full(4, value, np.float32) for i in range(N)}
    if bad is not None:
        out[BAD] = np.full(4, bad, np.float32)
    return out


def state(shard: Shard) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in shard.snapshot().items()}


@pytest.mark.parametrize("optimizer", [SGD(lr=0.5, momentum=0.9), Adam(lr=0.5)])
def test_every_small_variable_steps_as_alone(optimizer: Optimizer) -> None:
    shard, values = shard_of("async", 1, optimizer)
    alone = {k: v.copy() for k, v in values.items()}
    slots = {k: optimizer.make_state(v) for k, v in alone.items()}
    for step in range(3):
        assert shard.push(0, step, grads(0.25 * (step + 1))).applied
        for k in alone:
            optimizer.apply(alone[k], np.full(4, 0.25 * (step + 1), np.float32), slots[k])
    after = shard.snapshot()
    assert all(after[k].tobytes() == alone[k].tobytes() for k in alone)


def test_an_optimizer_result_that_overflows_in_one_of_many_is_refused_naming_it() -> None:
    shard, _ = shard_of("async", 1, SGD(lr=10.0, momentum=0.9))
    assert shard.push(0, 0, grads()).applied  # momentum buffers exist: slots are measured
    before = state(shard)
    with pytest.raises(StepRefusedError, match=rf"made \['{BAD}'\] non-finite"):
        shard.push(0, 1, grads(bad=3e38))  # finite gradient, but v - 10 * 3e38 is -inf
    assert state(shard) == before
    assert shard.push(0, 1, grads()).applied  # the step was not used up


def test_a_sync_sum_that_overflows_in_one_of_many_is_refused_naming_it() -> None:
    shard, _ = shard_of("sync", 2, SGD(lr=0.1))
    before = state(shard)
    assert shard.push(0, 0, grads(bad=3e38)).applied
    with pytest.raises(StepRefusedError, match=f"the gradient to apply to '{BAD}' is not finite"):
        shard.push(1, 0, grads(bad=3e38))  # float32 sum: inf
    assert state(shard) == before


def test_a_nan_in_one_of_many_gradients_is_named_by_the_worker_and_the_shard() -> None:
    # Both sides check many small gradients at once; the one that fails is still named.
    shard, values = shard_of("async", 1, SGD(lr=0.1))
    bad = grads()
    bad[BAD][2] = np.nan
    infos = [VarInfo(k, v.shape, "float32") for k, v in values.items()]
    with pytest.raises(InvalidRequestError, match=rf"'{BAD}': gradient has 1 non-finite"):
        split_push(bad, plan(infos, 2), {}, set(), None)
    before = state(shard)
    with pytest.raises(InvalidRequestError, match=rf"'{BAD}': gradient has 1 non-finite"):
        shard.push(0, 0, bad)
    assert state(shard) == before
    assert shard.push(0, 0, grads()).applied
