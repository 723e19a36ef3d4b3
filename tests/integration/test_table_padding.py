"""``Embedding(..., padding_idx=...)`` and ``EmbeddingBag(..., padding_idx=...)`` train as
torch's do: the padding row reads as zeros (torch starts it so) and never trains, and a bag
leaves it out of its sum and mean; with ``scale_grad_by_freq`` too; on 2 shards as in local
mode."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import psworker  # noqa: E402
from pswire.errors import ConfigError  # noqa: E402
from psworker.torch import DistributedOptimizer, Embedding, EmbeddingBag  # noqa: E402

ROWS, DIM, STEPS = 12, 3, 6


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Ids with padding (0, and -1 meaning the last row) and targets, one pair per step."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, ROWS - 1, (4, 3), generator=g)
        ids[0, 1:] = 0  # a short sequence, padded
        ids[2, 2] = 0
        out.append((ids, torch.randn(4, 1, generator=g)))
    return out


class Net(torch.nn.Module):
    def __init__(self, emb: torch.nn.Module, bag: bool) -> None:
        super().__init__()
        self.emb, self.bag = emb, bag
        torch.manual_seed(2)
        self.head = torch.nn.Linear(DIM if bag else 3 * DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(h if self.bag else h.flatten(1))


def train(net: Net, opt: torch.optim.Optimizer) -> None:
    for ids, y in batches():
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(ids), y).backward()
        opt.step()


# Ours, and torch's on a dense nn.Embedding: the same math on the rows a step touches, and
# none on the others (a zero gradient moves no row under these two).
OPTIMIZERS = {
    "sgd": (lambda: psworker.SGD(lr=0.3), lambda p: torch.optim.SGD(p, lr=0.3)),
    "adagrad": (lambda: psworker.Adagrad(lr=0.3), lambda p: torch.optim.Adagrad(p, lr=0.3)),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "bag"])
@pytest.mark.parametrize("shards_count", [0, 2], ids=["local", "2-shards"])
@pytest.mark.parametrize("freq", [False, True], ids=["", "scale_grad_by_freq"])
def test_the_padding_row_reads_as_zeros_and_never_trains(
    shards, optimizer, bag, shards_count, freq
):
    ours, theirs = OPTIMIZERS[optimizer]
    if shards_count:
        client = psworker.connect([s.address for s in shards(shards_count)], mode="sync")
    else:
        client = psworker.connect(mode="local")
    with client:
        kind = EmbeddingBag if bag else Embedding
        emb = kind(
            ROWS, DIM, client, name="emb", init="uniform", padding_idx=0, scale_grad_by_freq=freq
        )
        net = Net(emb, bag)
        opt = DistributedOptimizer(net, client, ours())
        start = torch.from_numpy(client.pull_rows("emb", np.arange(ROWS)).copy())
        assert start[0].abs().sum() > 0  # the shard's row: never read
        train(net, opt)
        rows = torch.from_numpy(client.pull_rows("emb", np.arange(ROWS)))
        head = net.head.weight.detach().clone()
    if bag:
        reference = torch.nn.EmbeddingBag(
            ROWS, DIM, mode="mean", padding_idx=0, scale_grad_by_freq=freq
        )
    else:
        reference = torch.nn.Embedding(ROWS, DIM, padding_idx=0, scale_grad_by_freq=freq)
    with torch.no_grad():
        reference.weight.copy_(start)
        reference.weight[0] = 0  # as torch's reset_parameters leaves it
    ref_net = Net(reference, bag)
    train(ref_net, theirs(ref_net.parameters()))
    assert torch.equal(rows[0], start[0])  # never trained
    torch.testing.assert_close(rows[1:], reference.weight.detach()[1:], rtol=0, atol=1e-6)
    torch.testing.assert_close(head, ref_net.head.weight.detach(), rtol=0, atol=1e-6)
    assert not torch.allclose(rows[1:], start[1:])  # it trained


def test_a_padding_row_from_a_file_reads_as_the_files_and_never_trains(tmp_path):
    rows = np.full((ROWS, DIM), 7.0, np.float32)
    np.save(tmp_path / "emb.npy", rows)
    with psworker.connect(mode="local") as client:
        emb = Embedding(
            ROWS, DIM, client, name="emb", padding_idx=0, init_from=str(tmp_path / "emb.npy")
        )
        opt = DistributedOptimizer(emb, client, psworker.SGD(lr=1.0))
        out = emb(torch.tensor([0, 3]))
        assert out.tolist() == [[7.0] * DIM] * 2  # as from_pretrained(..., padding_idx=0)
        out.sum().backward()
        opt.step()
        got = client.pull_rows("emb", [0, 3])
    assert got[0].tolist() == [7.0] * DIM and got[1].tolist() == [6.0] * DIM


def test_a_padding_idx_outside_the_table_is_refused_and_a_negative_one_counts_from_the_end():
    with psworker.connect(mode="local") as client:
        with pytest.raises(ConfigError, match=r"table 'emb': padding_idx 12 is outside its 12"):
            Embedding(ROWS, DIM, client, name="emb", padding_idx=ROWS)
        for bad in (0.5, 2**64):
            with pytest.raises(ConfigError, match=rf"padding_idx must be an int64 id, got {bad}"):
                Embedding(None, DIM, client, name="emb", padding_idx=bad)  # type: ignore[arg-type]
        assert Embedding(ROWS, DIM, client, name="emb", padding_idx=-1).padding_idx == ROWS - 1
        assert Embedding(None, DIM, client, name="hashed", padding_idx=-1).padding_idx == -1
