"""Parameters torch trains that are not plain dense float tensors: a sparse gradient
(``nn.Embedding(sparse=True)``) trains as torch's sparse SGD and Adagrad do; a lazy module's
parameter before its first forward, and a bfloat16 model, are refused by name before anything
is sent (numpy, the wire's host form, has no bfloat16)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

import psworker  # noqa: E402
from pswire.errors import ConfigError  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402


class Bag(torch.nn.Module):
    """A sparse-gradient embedding and a dense head, as a word2vec or CTR model."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(50, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(50, 4, generator=g))
            self.head.weight.copy_(torch.randn(1, 4, generator=g))
            self.head.bias.zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(-1)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


def train(model: Bag, opt: torch.optim.Optimizer, g: torch.Generator, steps: int = 4) -> None:
    for _ in range(steps):
        ids = torch.randint(0, 12, (6,), generator=g)  # rows 12.. never touched
        opt.zero_grad()
        ((model(ids) - 1.0) ** 2).mean().backward()
        assert model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse
        opt.step()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["local", "sync", "sync+overlap"])
def test_a_sparse_gradient_trains_as_torchs_sparse_optimizer(shards, mode, optimizer):
    make = OPTIMIZERS[optimizer]
    ref = Bag()
    train(ref, make(ref.parameters()), torch.Generator().manual_seed(1))
    model = Bag()
    address = [] if mode == "local" else [shards(1)[0].address]
    with psworker.connect(address, mode=mode.split("+")[0]) as client:
        opt = DistributedOptimizer(
            model, client, make(model.parameters()), overlap=mode.endswith("overlap")
        )
        g = torch.Generator().manual_seed(1)
        train(model, opt, g, steps=2)
        if mode.endswith("overlap"):
            assert opt._overlap is not None and opt._overlap.armed  # the hooks push them
        train(model, opt, g, steps=2)
    for name, want in ref.state_dict().items():
        got = model.state_dict()[name]
        assert torch.allclose(got, want, rtol=0, atol=1e-6), (name, (got - want).abs().max())
    assert not torch.equal(model.emb.weight[:12], Bag().emb.weight[:12])  # trained
    assert torch.equal(model.emb.weight[12:], Bag().emb.weight[12:])  # untouched rows kept


def test_a_lazy_modules_parameter_is_refused_until_its_first_forward(shards):
    address = shards(1)[0].address
    model = torch.nn.Sequential(torch.nn.LazyLinear(2))
    refused = pytest.raises(ConfigError, match=r"parameter '0.weight' is not initialized yet")
    with psworker.connect([address], mode="sync") as client, refused:
        DistributedOptimizer(model, client, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 3))  # the dry run torch's docs ask for
    with psworker.connect([address], mode="sync") as client:  # nothing was registered
        opt = DistributedOptimizer(model, client, torch.optim.SGD(model.parameters(), lr=0.1))
        before = model[0].weight.detach().clone()
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        assert not torch.equal(model[0].weight, before)


def test_a_bfloat16_model_is_refused_naming_the_parameter_and_autocast(shards):
    address = shards(1)[0].address
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).to(torch.bfloat16)
    refused = pytest.raises(ConfigError, match=r"'0.weight' has dtype torch.bfloat16.*autocast")
    with psworker.connect([address], mode="sync") as client, refused:
        DistributedOptimizer(model, client, torch.optim.AdamW(model.parameters()))
    model.float()
    with psworker.connect([address], mode="sync") as client:  # nothing was registered
        DistributedOptimizer(model, client, torch.optim.AdamW(model.parameters()))
