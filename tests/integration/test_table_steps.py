"""One round trip per shard per step for tables: push_pull carries the next batch's row reads
and returns what a push followed by pull_rows would, on real shards."""

from __future__ import annotations

import numpy as np
import pytest

import psworker
from pscore.tables import RowSparse, Table, init_rows
from pswire.errors import InvalidRequestError

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
    ("n", "dynamic", "chunk_bytes", "dim"),
    [
        (1, False, None, DIM),
        (2, False, None, DIM),
        (2, True, None, DIM),
        (2, False, 256, DIM),
        (2, False, None, 8192),  # ~6 rows x 8192 float32 per shard: messages built by hand
    ],
    ids=["fixed-1", "fixed-2", "dynamic-2", "fixed-2-streamed", "fixed-2-large-messages"],
)
def test_push_pull_with_rows_equals_push_then_pull_rows(shards, n, dynamic, chunk_bytes, dim):
    table = Table(None if dynamic else 40, dim, init="uniform", seed=3)
    options = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    fused_shards, plain_shards = shards(n), shards(n)
    ids = batches(dynamic)
    grads = [np.full((len(b), dim), 0.25 * (i + 1), np.float32) for i, b in enumerate(ids)]
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
            assert got["t"].shape == (len(after), dim)
            assert got["t"].tobytes() == expected.tobytes(), f"step {step}"
            assert got["w"].tobytes() == plain.pull()["w"].tobytes()
        # The rows really moved: what the last read returned is not what the seed gives.
        seeded = init_rows(ids[0], dim, "float32", "uniform", 1.0, 3)
        assert got["t"].shape == seeded.shape and not np.allclose(got["t"], seeded)
        if not dynamic:  # a bad id is refused before anything is sent
            with pytest.raises(InvalidRequestError, match=r"table 't'.*id 40\b"):
                fused.push_pull({}, rows={"t": [1, 40]})
            assert fused.status()[0].pushes_applied == len(ids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_embedding_prefetch_trains_exactly_as_pulling_in_the_forward(shards, mode):
    """The next batch's rows come back with the step's push (no pull in the forward), and
    training is bit for bit what pulling in each forward gives."""
    torch = pytest.importorskip("torch")
    from workers import run_workers

    from psworker.torch import DistributedOptimizer, Embedding

    workers = 2 if mode == "sync" else 1
    g = torch.Generator().manual_seed(5)
    data = [
        (torch.randint(0, 30, (8, 3), generator=g), torch.randn(8, 1, generator=g))
        for _ in range(12)
    ]

    def train(addresses: list[str], prefetch: bool, results: dict, i: int) -> None:
        with psworker.connect(addresses, worker_id=i, num_workers=workers, mode=mode) as client:
            emb = Embedding(30, DIM, client, name="emb", init="uniform", seed=2)
            head = torch.nn.Linear(DIM, 1)
            with torch.no_grad():
                head.weight.fill_(0.5)
                head.bias.zero_()
            opt = DistributedOptimizer(
                torch.nn.ModuleDict({"emb": emb, "head": head}), client, psworker.Adagrad(lr=0.2)
            )
            pulls = []
            pull_rows = client.pull_rows
            client.pull_rows = lambda t, ids: pulls.append(t) or pull_rows(t, ids)  # type: ignore[method-assign]
            mine = data[i::workers]
            losses = []
            for t, (ids, y) in enumerate(mine):
                if prefetch and t + 1 < len(mine):
                    # Once, a guess that turns out wrong: that forward must pull its own rows.
                    emb.prefetch(mine[t + 1 if t != 2 else 0][0])
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(head(emb(ids).mean(dim=1)), y)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
            results[i] = (losses, pull_rows("emb", np.arange(30)), len(pulls))

    outcomes = {}
    for prefetch in (False, True):
        addresses = [s.address for s in shards(2)]
        results: dict = {}
        run_workers(
            [
                lambda i=i, a=addresses, p=prefetch, r=results: train(a, p, r, i)
                for i in range(workers)
            ]
        )
        outcomes[prefetch] = results
    for i in range(workers):
        (losses, rows, pulls), (plain_losses, plain_rows, plain_pulls) = (
            outcomes[True][i],
            outcomes[False][i],
        )
        assert pulls == 2 and plain_pulls == len(plain_losses)  # the first, and the bad guess
        assert losses == plain_losses and rows.tobytes() == plain_rows.tobytes()
        assert not np.allclose(rows, init_rows(np.arange(30), DIM, "float32", "uniform", 1.0, 2))
