"""A table's step in cache-sized pieces of rows, each stored as it is made with its old rows
kept: the same bits as one optimizer step on the gathered rows, whatever the threads, and
every row and slot put back when any part of the update is refused (a later piece, another
table, a dense variable). No network."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pscore.optim as optim
from pscore import rowstore
from pscore.job import Job, VarSpec
from pscore.optim import SGD, Adagrad, Adam, Optimizer, RMSprop
from pscore.rowstore import RowStore
from pscore.tables import RowSparse, TableSlice
from pscore.variables import Variables
from pswire.errors import StepRefusedError

DIM = 100  # 327 float32 rows a piece
ROWS = 4000
OPTIMIZERS = [
    SGD(lr=0.1, momentum=0.9),
    Adam(lr=0.01),
    Adagrad(lr=0.1),
    RMSprop(lr=0.01, centered=True, momentum=0.5),
]


def store_for(opt: Optimizer, rows: int = ROWS, dim: int = DIM) -> RowStore:
    return RowStore(TableSlice("t", dim, num_rows=rows, row_end=rows, seed=5), opt)


def copies(state: Any) -> tuple[bytes, dict[str, Any]]:
    slots = {k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in state.slots.items()}
    return state.values.tobytes(), slots


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("threads", [1, 3])
def test_a_step_in_pieces_is_one_apply_of_the_gathered_rows_bit_for_bit(
    opt: Optimizer, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(optim, "OPTIMIZER_THREADS", threads)
    monkeypatch.setattr(optim, "PIECES_PER_THREAD", 1)
    store = store_for(opt)
    assert rowstore._PIECE_BYTES // (4 * DIM) < 3000 < ROWS  # several pieces, one short
    rng = np.random.default_rng(1)
    ids = np.sort(rng.choice(ROWS, 3000, replace=False))
    expected = store.gather(ids)
    slots = store.export().slots  # in id order
    state = {k: v[ids].copy() if isinstance(v, np.ndarray) else v for k, v in slots.items()}
    for _ in range(3):
        grad = rng.standard_normal((len(ids), DIM)).astype(np.float32)
        opt.apply(expected, grad, state)
        assert store.apply(ids, grad)
    assert store.gather(ids).tobytes() == expected.tobytes()
    slots = store.export().slots
    for key, value in state.items():
        got = slots[key]
        assert (
            (got[ids].tobytes() == value.tobytes())
            if isinstance(value, np.ndarray)
            else (got == value)
        ), key


@pytest.mark.parametrize("threads", [1, 3])
def test_a_middle_piece_that_overflows_puts_every_stored_piece_back(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(optim, "OPTIMIZER_THREADS", threads)
    monkeypatch.setattr(optim, "PIECES_PER_THREAD", 1)
    store = store_for(Adam(lr=0.01))
    ids = np.arange(ROWS, dtype=np.int64)
    assert store.apply(ids, np.full((ROWS, DIM), 0.5, np.float32))
    before = copies(store.export())
    grad = np.ones((ROWS, DIM), np.float32)
    grad[ROWS // 2, 7] = 3e38  # squared, it overflows the second moment in a middle piece
    assert store.step(ids, grad) is None
    assert copies(store.export()) == before  # rows, slots and the step count as they were


def test_undo_puts_back_the_rows_and_the_step_count() -> None:
    store = store_for(Adam(lr=0.01))
    ids = np.array([3, 700, 1500, 3999])
    assert store.apply(ids, np.ones((4, DIM), np.float32))
    before = copies(store.export())
    undo = store.step(ids, np.full((4, DIM), 2.0, np.float32))
    assert undo is not None
    assert copies(store.export()) != before
    undo()
    assert copies(store.export()) == before


def two_tables_and_a_dense_variable(opt: Optimizer) -> tuple[Job, Variables]:
    tables = [
        VarSpec(name, (50, 4), "float32", table=TableSlice(name, 4, num_rows=50, row_end=50))
        for name in ("a", "b")
    ]
    specs = (*tables, VarSpec("w", (3,), "float32"))
    job = Job("async", 0, 1, opt, specs, "m")
    state = Variables()
    state.install(job, {"w": np.ones(3, np.float32)}, take=False)
    return job, state


def everything(state: Variables) -> list[Any]:
    """Every value and slot of ``w`` and both tables, as bytes."""
    tables = [copies(state.tables[key].export()) for key in ("a", "b")]
    dense = {
        k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in state.slots["w"].items()
    }
    return [state.values["w"].tobytes(), dense, *tables]


def test_a_dense_variable_refused_after_the_tables_stepped_puts_their_rows_back() -> None:
    job, state = two_tables_and_a_dense_variable(SGD(lr=2.0, momentum=0.5))
    ids = np.array([1, 4])
    fine = np.ones((2, 4), np.float32)
    state.apply(job, {"a": RowSparse(ids, fine), "w": np.ones(3, np.float32)}, summed=False)
    before = everything(state)
    # The tables step finitely; the dense variable's step overflows (lr 2 x 3e38).
    update = {
        "a": RowSparse(ids, fine),
        "b": RowSparse(ids, fine),
        "w": np.full(3, 3e38, np.float32),
    }
    with pytest.raises(StepRefusedError, match=r"\['w'\] non-finite"):
        state.apply(job, update, summed=False)
    assert everything(state) == before


def test_a_second_table_refused_puts_the_first_back() -> None:
    job, state = two_tables_and_a_dense_variable(SGD(lr=2.0))
    ids = np.array([1, 4])
    before = everything(state)
    update = {
        "a": RowSparse(ids, np.ones((2, 4), np.float32)),
        "b": RowSparse(ids, np.full((2, 4), 3e38, np.float32)),  # lr 2 x 3e38 overflows
    }
    with pytest.raises(StepRefusedError, match=r"\['b'\] non-finite .* left as before"):
        state.apply(job, update, summed=False)
    assert everything(state) == before
