"""A dynamic table's new row starts its optimizer state afresh on a real shard, wherever it is
stored: Adagrad's accumulator at initial_accumulator_value, Adam's moments at zero, also in a
slot an evicted row left behind and for an evicted id that comes back (the row re-drawn from
its seed, not the trained one)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import psworker  # noqa: E402
from pscore.tables import RowSparse, Table, init_rows  # noqa: E402

DIM, SEED = 3, 7


def grad(k: int) -> np.ndarray:
    return np.random.default_rng(k).normal(size=(1, DIM)).astype(np.float32)


def fresh_step(kind: str, row: np.ndarray, g: np.ndarray, step: int) -> np.ndarray:
    """torch's first update of a row with fresh state, as the ``step``-th update of its table
    (Adam's bias correction counts the table's updates, as torch.optim.SparseAdam does)."""
    p = torch.nn.Parameter(torch.from_numpy(row.copy()))
    if kind == "adagrad":
        opt: torch.optim.Optimizer = torch.optim.Adagrad([p], lr=0.3, initial_accumulator_value=0.5)
    else:
        opt = torch.optim.Adam([p], lr=0.1)
        zeros = torch.zeros_like(p)
        opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": zeros,
                        "exp_avg_sq": zeros.clone()}  # fmt: skip
    p.grad = torch.from_numpy(g.copy())
    opt.step()
    return p.detach().numpy()


def start(ids: list[int]) -> np.ndarray:
    return init_rows(np.array(ids), DIM, "float32", "uniform", 0.5, SEED)


@pytest.mark.parametrize("kind", ["adagrad", "adam"])
def test_new_and_recreated_rows_of_a_dynamic_table_start_with_fresh_optimizer_state(shards, kind):
    (server,) = shards(1)
    table = Table(None, DIM, init="uniform", init_scale=0.5, seed=SEED, capacity=2)
    optimizer = (
        psworker.Adagrad(lr=0.3, initial_accumulator_value=0.5)
        if kind == "adagrad"
        else psworker.Adam(lr=0.1)
    )
    updates = 0
    with psworker.connect([server.address], mode="async") as client:
        client.init({}, optimizer, tables={"t": table})

        def push(row_id: int, k: int) -> np.ndarray:
            nonlocal updates
            client.push({"t": RowSparse([row_id], grad(k))})
            updates += 1
            return client.pull_rows("t", [row_id])

        # Row 10: its first step is a fresh one; three more fill its state.
        assert np.allclose(push(10, 0), fresh_step(kind, start([10]), grad(0), 1), atol=1e-6)
        for k in (1, 2, 3):
            push(10, k)
        trained = client.pull_rows("t", [10])
        push(20, 4)
        client.pull_rows("t", [30])  # a third row: 10, the least recently used, is evicted
        # Row 40 takes the slot 10 left, with 10's accumulated state there: it must not see it.
        want = fresh_step(kind, start([40]), grad(5), updates + 1)
        assert np.allclose(push(40, 5), want, atol=1e-6)
        # 10 comes back: drawn again from its seed, its state fresh, its training gone.
        want = fresh_step(kind, start([10]), grad(6), updates + 1)
        again = push(10, 6)
        assert np.allclose(again, want, atol=1e-6)
        assert not np.allclose(again, trained)
        (status,) = client.status()
        assert status.tables[0].evictions >= 3
