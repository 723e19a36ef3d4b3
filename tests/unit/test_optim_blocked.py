"""Unit tests for the fused optimizer step: pieces that stay in cache, the optimizer threads,
the per-piece measurement of the results, and the shard state's checks that rely on it."""

from __future__ import annotations

import multiprocessing
import tracemalloc
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import pscore.optim as optim
from pscore.job import Job, VarSpec
from pscore.optim import (
    DEFAULT_BLOCK_ELEMENTS,
    SGD,
    Adadelta,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    NAdam,
    Optimizer,
    RAdam,
    RMSprop,
)
from pscore.rowstore import RowStore
from pscore.tables import TableSlice
from pscore.variables import Variables
from pswire.errors import StepRefusedError

EVERY = [
    SGD(lr=0.1, momentum=0.9),
    SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    SGD(lr=0.1, momentum=0.9, dampening=0.3),
    Adam(lr=0.01),
    Adam(lr=0.01, weight_decay=0.01, amsgrad=True),
    AdamW(lr=0.01),
    Adagrad(lr=0.1, weight_decay=0.01),
    RMSprop(lr=0.01, momentum=0.9, centered=True, weight_decay=0.01),
    Adadelta(weight_decay=0.01),
    Adamax(lr=0.01, weight_decay=0.01),
    NAdam(lr=0.01, weight_decay=0.01),
    RAdam(lr=0.01, weight_decay=0.01),
]
IDS = [f"{o.name}-{i}" for i, o in enumerate(EVERY)]


def arrays(size: int, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    param = rng.standard_normal(size).astype(np.float32)
    return param, [rng.standard_normal(size).astype(np.float32) for _ in range(3)]


@pytest.mark.parametrize("optimizer", EVERY, ids=IDS)
def test_a_blocked_step_makes_no_temporaries_the_size_of_a_piece(
    optimizer: Optimizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every intermediate goes to the thread's scratch blocks: before, each piece (1M elements)
    # allocated its own temporaries (a pass over memory each, and 4 MiB apiece).
    monkeypatch.setattr(optim, "OPTIMIZER_THREADS", 1)  # this thread: tracemalloc sees all
    param, grads = arrays(4 * DEFAULT_BLOCK_ELEMENTS)
    state = optimizer.make_state(param)
    for grad in grads[:2]:  # the first step makes lazy slots (SGD's momentum buffer)
        optimizer.apply_blocked(param, grad, state)
    before = param.copy()
    tracemalloc.start()
    try:
        optimizer.apply_blocked(param, grads[2], state)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not np.array_equal(param, before)  # it did step
    piece = DEFAULT_BLOCK_ELEMENTS * param.itemsize
    assert peak < piece // 4, f"a step of {param.size} elements allocated {peak} bytes"


@pytest.mark.parametrize("optimizer", EVERY, ids=IDS)
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_threads_change_no_bit_of_the_result(
    optimizer: Optimizer, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    param, grads = arrays(1000)
    whole = param.copy()
    whole_state, blocked_state = optimizer.make_state(whole), optimizer.make_state(param)
    monkeypatch.setattr(optim, "OPTIMIZER_THREADS", threads)
    monkeypatch.setattr(optim, "PIECES_PER_THREAD", 1)  # 16 pieces: every thread takes some
    for grad in grads:
        optimizer.apply(whole, grad, whole_state)
        optimizer.apply_blocked(param, grad, blocked_state, block=64)  # 16 pieces, 1 short
    assert param.tobytes() == whole.tobytes()
    for key, value in whole_state.items():
        if isinstance(value, np.ndarray):
            assert value.tobytes() == blocked_state[key].tobytes(), key
        else:
            assert value == blocked_state[key], key


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1, momentum=0.9), Adam(lr=0.01)], ids=str)
def test_measure_returns_the_largest_sum_of_squares_of_the_results(
    optimizer: Optimizer,
) -> None:
    param, grads = arrays(1000)
    state = optimizer.make_state(param)
    for grad in grads:
        squares = optimizer.apply_blocked(param, grad, state, block=64, measure=True)
    results = [param, *(v for v in state.values() if isinstance(v, np.ndarray))]
    expected = max(float(np.dot(a.astype(np.float64), a.astype(np.float64))) for a in results)
    assert squares == pytest.approx(expected, rel=1e-5)
    # No larger than a piece: applied whole, left to the caller to measure.
    small, small_grad = arrays(64)[0], arrays(64)[1][0]
    assert optimizer.apply_blocked(small, small_grad, optimizer.make_state(small), 64, True) is None


@dataclass(frozen=True)
class NaNSlot(SGD):
    """SGD that leaves one element of its momentum buffer NaN (in whichever piece holds it)."""

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        super().apply(param, grad, state)
        if state["momentum_buffer"].size == DEFAULT_BLOCK_ELEMENTS:  # a middle piece
            state["momentum_buffer"][7] = np.nan


def test_a_nan_slot_in_one_piece_is_measured_as_nan() -> None:
    opt = NaNSlot(lr=0.0, momentum=0.9)
    param = np.ones(3 * DEFAULT_BLOCK_ELEMENTS + 5, np.float32)
    state = opt.make_state(param)
    squares = opt.apply_blocked(param, np.ones_like(param), state, measure=True)
    assert squares is not None and np.isnan(squares)


def big_job(optimizer: Optimizer, size: int) -> Job:
    return Job("async", 0, 1, optimizer, (VarSpec("w", (size,), "float32"),), "m")


def test_a_large_variable_whose_step_leaves_a_slot_nan_is_refused() -> None:
    size = 3 * DEFAULT_BLOCK_ELEMENTS + 5  # measured piece by piece as the step runs
    job = big_job(NaNSlot(lr=0.0, momentum=0.9), size)
    state = Variables()
    state.install(job, {"w": np.ones(size, np.float32)}, take=False)
    with pytest.raises(StepRefusedError, match=r"\['w'\] non-finite"):
        state.apply(job, {"w": np.ones(size, np.float32)}, summed=False)


def test_a_large_variable_whose_step_overflows_is_refused_and_left_as_before() -> None:
    size = 3 * DEFAULT_BLOCK_ELEMENTS + 5
    job = big_job(Adam(lr=0.01), size)
    state = Variables()
    state.install(job, {"w": np.linspace(-1, 1, size, dtype=np.float32)}, take=False)
    state.apply(job, {"w": np.full(size, 0.5, np.float32)}, summed=False)
    values = state.values["w"].copy()
    slots = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in state.slots["w"].items()}
    grad = np.full(size, 1.0, np.float32)
    grad[size - 3] = 3e38  # squared, it overflows the second moment in the last piece
    with pytest.raises(StepRefusedError, match="left as before"):
        state.apply(job, {"w": grad}, summed=False)
    assert state.values["w"].tobytes() == values.tobytes()
    for key, value in slots.items():
        got = state.slots["w"][key]
        assert (got.tobytes() == value.tobytes()) if isinstance(value, np.ndarray) else got == value
    # A NaN gradient is refused before anything changes, in any piece.
    grad[size - 3] = np.nan
    with pytest.raises(StepRefusedError, match="gradient to apply to 'w' is not finite"):
        state.apply(job, {"w": grad}, summed=True)
    assert state.values["w"].tobytes() == values.tobytes()


def _child_step(conn: Any) -> None:
    param, grads = arrays(16 * 64)
    opt = Adam(lr=0.01)
    state = opt.make_state(param)
    opt.apply_blocked(param, grads[0], state, block=64)
    conn.send(param.tobytes())
    conn.close()


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
def test_a_forked_child_runs_its_own_optimizer_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # The parent's pool threads do not survive a fork: a child using the parent's pool object
    # would wait forever for them.
    monkeypatch.setattr(optim, "OPTIMIZER_THREADS", 4)
    monkeypatch.setattr(optim, "PIECES_PER_THREAD", 1)
    param, grads = arrays(16 * 64)
    opt = Adam(lr=0.01)
    state = opt.make_state(param)
    opt.apply_blocked(param, grads[0], state, block=64)  # the parent's pool is running
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_step, args=(child,))
    proc.start()
    try:
        assert parent.poll(60), "the forked child's step did not finish within 60 s"
        assert parent.recv() == param.tobytes()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_a_large_row_sparse_step_that_overflows_is_refused_and_changes_nothing() -> None:
    # 2,048 rows of 64: the step runs in pieces and is measured as it goes, as a dense one.
    rows, dim = 2048, 64
    store = RowStore(TableSlice("t", dim, num_rows=rows, row_end=rows, seed=3), Adam(lr=0.01))
    ids = np.arange(rows, dtype=np.int64)
    assert store.apply(ids, np.full((rows, dim), 0.5, np.float32))
    before = store.export()
    grad = np.ones((rows, dim), np.float32)
    grad[rows - 2, 5] = 3e38  # its square overflows the second moment, in the last piece
    assert store.apply(ids, grad) is False
    after = store.export()
    assert after.values.tobytes() == before.values.tobytes()
    for key, value in before.slots.items():
        got = after.slots[key]
        assert (got.tobytes() == value.tobytes()) if isinstance(value, np.ndarray) else got == value
    # A finite step is taken: the measure proved it finite.
    assert store.apply(ids, np.ones((rows, dim), np.float32))
    assert store.export().values.tobytes() != before.values.tobytes()


def test_the_pool_takes_a_variable_only_with_enough_pieces_per_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Handing pieces to threads costs more than it saves on a small variable (a 4,096 x 64
    # table step, a 1M-param model's 10-piece embedding): each thread gets at least
    # PIECES_PER_THREAD pieces, else the calling thread runs them all.
    used: list[int] = []

    class Pool:
        def map(self, fn: Any, firsts: list[int], lasts: list[int]) -> Any:
            used.append(len(firsts))
            return map(fn, firsts, lasts)

    monkeypatch.setattr(optim, "OPTIMIZER_THREADS", 4)
    monkeypatch.setattr(optim, "_pool", Pool)
    opt = SGD(lr=0.1, momentum=0.9)
    per = optim.PIECES_PER_THREAD
    cases = ((4, None), (2 * per - 1, None), (2 * per, 2), (3 * per, 3), (9 * per, 4))
    for pieces, threads in cases:
        used.clear()
        param, grads = arrays(pieces * 64)
        whole = param.copy()
        state, whole_state = opt.make_state(param), opt.make_state(whole)
        opt.apply_blocked(param, grads[0], state, block=64)
        opt.apply(whole, grads[0], whole_state)
        assert used == ([] if threads is None else [threads]), pieces
        assert param.tobytes() == whole.tobytes()
