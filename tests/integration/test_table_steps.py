"""One round trip per shard per step for tables: push_pull carries the next batch's row reads
and returns what a push followed by pull_rows would, on real shards."""

from __future__ import annotations

import numpy as np
import pytest

import psworker
from pswire.errors import InvalidRequestError
from pswire.tables import RowSparse, Table, init_rows

DIM = 5


def batches(dynamic: bool) -> list[np.ndarray]:
    """Ids in every shape a batch takes: distinct unsorted, sorted, repeated, one, none."""
    g = np.random.default_rng(7)
    scale = 1_000_003 if dynamic else 1
    return [
        g.choice(40, 12, replace=False) * scale,
        np.sort(g.choice(40, 9, replace=False)) * scale,
        g.integers(0, 40, 15) * scale,  # repeats
        np.array([39]) * scale,
        np.zeros(0, np.int64),
        g.choice(40, 12, replace=False) * scale,
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("n", "dynamic", "chunk_bytes"),
    [(1, False, None), (2, False, None), (2, True, None), (2, False, 256)],
    ids=["fixed-1-shard", "fixed-2-shards", "dynamic-2-shards", "fixed-2-shards-streamed"],
)
def test_push_pull_with_rows_equals_push_then_pull_rows(shards, n, dynamic, chunk_bytes):
    table = Table(None if dynamic else 40, DIM, init="uniform", seed=3)
    options = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    fused_shards, plain_shards = shards(n), shards(n)
    ids = batches(dynamic)
    grads = [np.full((len(b), DIM), 0.25 * (i + 1), np.float32) for i, b in enumerate(ids)]
    with (
        psworker.connect([s.address for s in fused_shards], mode="async", **options) as fused,
        psworker.connect([s.address for s in plain_shards], mode="async", **options) as plain,
    ):
        for client in (fused, plain):
            w = np.arange(6, dtype=np.float32)
            client.init({"w": w}, psworker.Adagrad(lr=0.1), tables={"t": table})
        for step, (batch, grad) in enumerate(zip(ids, grads, strict=True)):
            after = ids[(step + 1) % len(ids)]
            pushed = {"t": RowSparse(batch, grad), "w": np.ones(6, np.float32)}
            got = fused.push_pull(pushed, rows={"t": after})
            plain.push(pushed)
            expected = plain.pull_rows("t", after)
            assert got["t"].shape == (len(after), DIM)
            assert got["t"].tobytes() == expected.tobytes(), f"step {step}"
            assert got["w"].tobytes() == plain.pull()["w"].tobytes()
        # The rows really moved: what the last read returned is not what the seed gives.
        seeded = init_rows(ids[0], DIM, "float32", "uniform", 1.0, 3)
        assert got["t"].shape == seeded.shape and not np.allclose(got["t"], seeded)
        if not dynamic:  # a bad id is refused before anything is sent
            with pytest.raises(InvalidRequestError, match=r"table 't'.*id 40\b"):
                fused.push_pull({}, rows={"t": [1, 40]})
            assert fused.status()[0].pushes_applied == len(ids)
