"""A shard-held table frozen as torch freezes an embedding: ``emb.requires_grad_(False)``
(fine-tuning on pretrained embeddings; unfrozen later, as gradual unfreezing does) or left
out of the optimizer, is read but never trained, as torch's ``nn.Embedding`` would be (was:
trained all the same, with no word); local and on 2 shards."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import psworker  # noqa: E402
from psworker.torch import DistributedOptimizer, Embedding  # noqa: E402

ROWS, DIM, STEPS, UNFROZEN_AT = 10, 3, 6, 3


def fit(emb: torch.nn.Module, how: str, make_opt) -> torch.nn.Module:
    """Trains emb + a head STEPS steps; ``how``: "frozen" (until UNFROZEN_AT) or "left_out"
    (the optimizer holds the head only). Returns the head."""
    torch.manual_seed(3)
    head = torch.nn.Linear(2 * DIM, 1)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    if how == "frozen":
        emb.requires_grad_(False)
    opt = make_opt(model, head.parameters() if how == "left_out" else model.parameters())
    g = torch.Generator().manual_seed(4)
    for t in range(STEPS):
        if how == "frozen" and t == UNFROZEN_AT:
            emb.requires_grad_(True)
        ids, y = torch.randint(0, ROWS, (4, 2), generator=g), torch.randn(4, 1, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(head(emb(ids).flatten(1)), y).backward()
        opt.step()
    return head


@pytest.mark.parametrize("how", ["frozen", "left_out"])
@pytest.mark.parametrize("shards_count", [0, 2], ids=["local", "2-shards"])
def test_a_frozen_table_is_not_trained_as_torch_trains_none(shards, how, shards_count):
    if shards_count:
        client = psworker.connect([s.address for s in shards(shards_count)], mode="sync")
    else:
        client = psworker.connect(mode="local")
    with client:
        emb = Embedding(ROWS, DIM, client, name="emb", init="uniform")
        start = None

        def ours(model: torch.nn.Module, params) -> DistributedOptimizer:
            nonlocal start
            opt = DistributedOptimizer(model, client, torch.optim.SGD(params, lr=0.5))
            start = torch.from_numpy(client.pull_rows("emb", np.arange(ROWS)).copy())
            return opt

        head = fit(emb, how, ours)
        rows = torch.from_numpy(client.pull_rows("emb", np.arange(ROWS)))
    assert start is not None
    reference = torch.nn.Embedding(ROWS, DIM)
    with torch.no_grad():
        reference.weight.copy_(start)
    ref_head = fit(reference, how, lambda _, params: torch.optim.SGD(params, lr=0.5))
    torch.testing.assert_close(rows, reference.weight.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(head.weight, ref_head.weight, rtol=0, atol=1e-6)
    moved = not torch.equal(rows, start)
    assert moved is (how == "frozen")  # trained once unfrozen; left out: never
