"""Restarting a job from its checkpoint with other hyper-parameters (the documented answer to
StepRefusedError: a smaller learning rate) is accepted; what would change the model, the mode
or which optimizer state exists is refused, and the message names the two sides correctly."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import ModelMismatchError, WaitTimeoutError

SPECS = (VarSpec("w", (3,), "float32"),)


def job(workers: int = 2, mode: str = "sync", **opt: float) -> Job:
    return Job(mode, 0, workers, SGD(**{"lr": 1.0, **opt}), SPECS, "m1")


def restored(workers: int = 2, mode: str = "sync") -> Shard:
    """A shard that trained a step at lr 1 (every worker pushed ones), then restarted from its
    checkpoint."""
    first = Shard(Limits(max_wait_s=5))
    first.init(0, job(workers, mode), {"w": np.zeros(3, np.float32)})
    for w in range(workers):
        first.init(w, job(workers, mode), None)
        first.push(w, 0, {"w": np.ones(3, np.float32)})
    state = first.export_state()
    assert state is not None
    shard = Shard(Limits(max_wait_s=5))
    shard.restore(state)
    return shard


def test_worker_0_restarting_with_a_smaller_lr_is_accepted_and_the_next_step_uses_it() -> None:
    shard = restored()
    before = shard.snapshot()["w"].copy()  # -1 after one step at lr 1
    # Worker 1 may come back first: its declaration waits for worker 0's.
    shard.init(1, job(lr=0.25), None)
    shard.init(0, job(lr=0.25), None)
    assert shard._agreement.job is not None and shard._agreement.job.optimizer.lr == 0.25
    for w in range(2):
        shard.push(w, 1, {"w": np.ones(3, np.float32)})
    np.testing.assert_array_equal(shard.snapshot()["w"], before - 0.25)
    assert shard.status().clock == 2  # the run went on from its checkpoint's step


def test_a_worker_that_kept_the_old_lr_is_refused_once_worker_0_declared_the_new() -> None:
    shard = restored()
    shard.init(1, job(lr=1.0), None)  # provisional
    shard.init(0, job(lr=0.25), None)
    with pytest.raises(ModelMismatchError, match=r"worker 1's job differs from worker 0's"):
        shard.pull(1, 1)


def test_a_changed_model_or_optimizer_state_is_still_refused_naming_the_checkpoint() -> None:
    shard = restored()
    with pytest.raises(ModelMismatchError) as caught:
        shard.init(0, job(lr=1.0, momentum=0.9), None)  # momentum makes a new slot
    text = str(caught.value)
    assert "worker 0's job differs from the job in this shard's checkpoint" in text, text
    assert "worker 0's job differs from worker 0's" not in text
    with pytest.raises(ModelMismatchError, match="the job in this shard's checkpoint"):
        shard.init(1, job(mode="async"), None)


def test_a_live_job_keeps_refusing_another_lr_from_a_new_worker_0_naming_the_sides() -> None:
    shard = Shard(Limits(max_wait_s=5))
    shard.init(0, job(), {"w": np.zeros(3, np.float32)})
    with pytest.raises(ModelMismatchError) as caught:
        shard.init(0, job(lr=0.5), None)
    assert "worker 0's job differs from the one an earlier worker 0 declared" in str(caught.value)


def test_a_worker_with_the_new_lr_waits_for_worker_0_instead_of_training_with_the_old() -> None:
    shard = restored(mode="async")
    before = shard.snapshot()["w"].copy()
    shard.init(1, job(mode="async", lr=0.25), None)
    with pytest.raises(WaitTimeoutError, match="worker 0's init: worker 1 declared other"):
        shard.push(1, 1, {"w": np.ones(3, np.float32)}, timeout=0.3)
    np.testing.assert_array_equal(shard.snapshot()["w"], before)  # nothing applied meanwhile
    pushed = threading.Thread(
        target=shard.push, args=(1, 1, {"w": np.ones(3, np.float32)}), kwargs={"timeout": 10}
    )
    pushed.start()
    shard.init(0, job(mode="async", lr=0.25), None)  # worker 0 sets the lr: the push goes on
    pushed.join(timeout=10)
    assert not pushed.is_alive()
    np.testing.assert_array_equal(shard.snapshot()["w"], before - 0.25)


def test_in_sync_a_worker_that_pushed_before_worker_0_declared_steps_with_the_new_lr() -> None:
    shard = restored()
    before = shard.snapshot()["w"].copy()
    shard.init(1, job(lr=0.25), None)
    pushed = threading.Thread(
        target=shard.push, args=(1, 1, {"w": np.ones(3, np.float32)}), kwargs={"timeout": 10}
    )
    pushed.start()
    pushed.join(timeout=0.3)
    assert pushed.is_alive()  # its push started (and waits) before worker 0 declared
    shard.init(0, job(lr=0.25), None)
    shard.push(0, 1, {"w": np.ones(3, np.float32)}, timeout=10)  # no HyperParameterMismatch
    pushed.join(timeout=10)
    assert not pushed.is_alive()
    np.testing.assert_array_equal(shard.snapshot()["w"], before - 0.25)
