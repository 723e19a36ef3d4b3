"""DelayedNesterov (pscore/outer.py): N pushes are one Nesterov step on their mean; momentum
moves only on every N-th push; its wire form round-trips through the registry and its state
through a shard's checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from pscore.optspec import optimizer_from_spec
from pscore.outer import DelayedNesterov
from psserver.checkpoint import Checkpointer
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import ConfigError, InvalidRequestError

SPECS = (VarSpec("w", (2, 3), "float32"),)


def grads(count: int, rounds: int, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        [rng.standard_normal(5).astype(np.float32) for _ in range(count)] for _ in range(rounds)
    ]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_delay_pushes_equal_one_nesterov_step_on_their_mean(workers):
    delayed = DelayedNesterov(lr=0.7, momentum=0.9, delay=workers)
    nesterov = SGD(lr=0.7, momentum=0.9, nesterov=True)
    start = np.linspace(-1, 1, 5).astype(np.float32)
    a, b = start.copy(), start.copy()
    sa, sb = delayed.make_state(a), nesterov.make_state(b)
    for round_grads in grads(workers, 5):
        for g in round_grads:
            delayed.apply(a, g, sa)
        nesterov.apply(b, np.mean(round_grads, axis=0, dtype=np.float32), sb)
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert not np.array_equal(a, start)


def test_momentum_moves_only_on_every_delay_th_push():
    opt = DelayedNesterov(lr=1.0, momentum=0.5, delay=3)
    param = np.zeros(2, np.float32)
    state = opt.make_state(param)
    g = np.ones(2, np.float32)
    opt.apply(param, g, state)
    opt.apply(param, g, state)
    assert np.array_equal(state["momentum_buffer"], np.zeros(2, np.float32))
    np.testing.assert_allclose(param, -2 / 3)  # the gradient part only: lr * g / delay each
    opt.apply(param, g, state)
    np.testing.assert_allclose(state["momentum_buffer"], 1.0)  # the mean of the three
    np.testing.assert_allclose(param, -1.0 - 0.5)  # plus lr * momentum * buf
    assert np.array_equal(state["pending"], np.zeros(2, np.float32))


def test_wire_form_round_trips_and_bad_delay_is_refused():
    opt = DelayedNesterov(lr=0.5, momentum=0.8, delay=4)
    assert optimizer_from_spec(opt.name, opt.params()) == opt
    with pytest.raises(InvalidRequestError, match=r"invalid delay: 2\.5"):
        optimizer_from_spec("delayed_nesterov", {"delay": 2.5})
    with pytest.raises(ConfigError, match="invalid delay: 0"):
        DelayedNesterov(delay=0)
    with pytest.raises(ConfigError, match="invalid momentum"):
        DelayedNesterov(momentum=1.0)


def test_a_checkpoint_keeps_the_pending_sum_and_count_and_resumes_bit_identically(tmp_path):
    """The outer optimizer's state (momentum, pending sum, push count) is in the shard's
    checkpoint: a shard restored mid-way through a set of delayed pushes continues exactly."""
    job = Job("async", 0, 2, DelayedNesterov(lr=0.7, momentum=0.9, delay=2), SPECS, "digest")
    original = Shard(Limits(max_wait_s=5))
    assert original.init(0, job, {"w": np.linspace(-1, 1, 6).astype(np.float32).reshape(2, 3)})
    pushes = [(w, s) for s in range(3) for w in range(2)][:5]  # odd: a push is pending

    def push(shard: Shard, worker: int, step: int) -> None:
        g = np.random.default_rng(10 * step + worker).standard_normal((2, 3)).astype(np.float32)
        assert shard.push(worker, step, {"w": g}, timeout=5).applied

    for worker, step in pushes[:3]:
        push(original, worker, step)
    saved = original.export_state()
    assert saved is not None
    assert saved.slots["w"]["step"] == 3 and np.any(saved.slots["w"]["pending"])
    Checkpointer(tmp_path).save(saved, incarnation=original.incarnation)
    loaded = Checkpointer(tmp_path).load_latest()
    assert loaded is not None
    restored = Shard(Limits(max_wait_s=5))
    restored.restore(loaded)
    for worker, step in pushes[3:]:
        push(original, worker, step)
        push(restored, worker, step)
    a, b = original.export_state(), restored.export_state()
    assert a is not None and b is not None
    np.testing.assert_array_equal(a.variables["w"], b.variables["w"])
    for slot in ("momentum_buffer", "pending"):
        np.testing.assert_array_equal(a.slots["w"][slot], b.slots["w"][slot])
    assert a.slots["w"]["step"] == b.slots["w"]["step"] == 5
