"""Embedding-table rows under torch.amp.GradScaler on real shards, against torch's own
Embedding: the rows' gradients are unscaled like the dense ones, and an inf in one row alone
(the dense gradients finite, so only our check sees it) skips the step and backs the scale
off exactly as torch does."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import psworker  # noqa: E402
from pscore.tables import init_rows  # noqa: E402
from psworker.torch import DistributedOptimizer, Embedding  # noqa: E402

ROWS, DIM, BAG, BATCH, STEPS, INF_AT = 20, 4, 3, 6, 8, 3


class Net(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Module) -> None:
        super().__init__()
        self.embedding = embedding
        self.head = torch.nn.Linear(DIM, 1)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, DIM, generator=g))
            self.head.bias.zero_()
        self.poison = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.embedding(ids)
        if self.poison and rows.requires_grad:
            rows.register_hook(one_inf)
        return self.head(rows.mean(dim=1))


def one_inf(g: torch.Tensor) -> torch.Tensor:
    """The gradient reaching the embedding with one entry inf: one row's, nothing else's."""
    g = g.clone()
    g[0, 0, 0] = float("inf")
    return g


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, ROWS, (STEPS * BATCH, BAG), generator=g), torch.randn(
        STEPS * BATCH, 1, generator=g
    )


def train(net: Net, opt: torch.optim.Optimizer) -> list[float]:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    ids, y = data()
    scales = []
    for t in range(STEPS):
        net.poison = t == INF_AT
        batch = slice(t * BATCH, (t + 1) * BATCH)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(ids[batch]), y[batch])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_table_rows_are_unscaled_and_an_inf_row_skips_the_step_as_in_torch(shards):
    dense = torch.nn.Embedding(ROWS, DIM)
    with torch.no_grad():
        dense.weight.copy_(
            torch.from_numpy(init_rows(np.arange(ROWS), DIM, "float32", "normal", 1.0, 0))
        )
    reference = Net(dense)
    # Plain SGD: torch's dense update leaves untouched rows as they are, as the shards do.
    want = train(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    assert want[INF_AT] == want[INF_AT - 1] / 2, want  # torch skipped and backed off

    addresses = [s.address for s in shards(2)]
    with psworker.connect(addresses, mode="sync", num_workers=1) as client:
        net = Net(Embedding(ROWS, DIM, client, name="emb"))
        opt = DistributedOptimizer(net, client, torch.optim.SGD(net.parameters(), lr=0.1))
        got = train(net, opt)
        rows = client.pull_rows("emb", np.arange(ROWS))
    assert got == want
    expected = reference.embedding.weight.detach().numpy()
    assert np.abs(rows - expected).max() < 1e-5
    assert torch.allclose(net.head.weight, reference.head.weight, atol=1e-5)
    start = init_rows(np.arange(ROWS), DIM, "float32", "normal", 1.0, 0)
    assert np.abs(rows - start).max() > 1e-3  # the rows trained
