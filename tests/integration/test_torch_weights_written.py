"""A weight the script writes between steps: in the parameter-server modes the step loads the
shards' weights into the model, so the write is lost; it must not be lost without a word (the
common case: ``model.load_state_dict`` of pretrained weights after the optimizer was made)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import psworker  # noqa: E402
from psworker.torch import CONTENT_CHECK_EVERY, DistributedOptimizer  # noqa: E402

LOST = r"changed 1 parameters \(0.weight\) in place .* 'sync' mode .* that change is lost"


def net() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.Tanh())
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(3, 4, generator=g))
    return model


def train(opt: DistributedOptimizer, steps: int) -> None:
    x = torch.ones(2, 4)
    for _ in range(steps):
        opt.zero_grad()
        opt.model(x).sum().backward()
        opt.step()


def test_pretrained_weights_loaded_after_the_optimizer_are_named_in_a_warning(shards):
    address = shards(1)[0].address
    pretrained = {"0.weight": torch.full((3, 4), 0.5)}
    with psworker.connect([address], mode="sync") as client:
        model = net()
        opt = DistributedOptimizer(model, client, psworker.SGD(lr=0.1))
        opt.model = model
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # plain training warns of nothing
            train(opt, 2)
        model.load_state_dict(pretrained)  # too late: the shards hold the job's weights
        with pytest.warns(UserWarning, match=LOST):
            train(opt, 1)
        assert (model[0].weight - 0.5).abs().max() > 0.3  # the loaded 0.5s are gone
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            model.load_state_dict(pretrained)
            train(opt, 1)


def trained_once(client: psworker.PSClient) -> tuple[torch.nn.Module, DistributedOptimizer]:
    model = net()
    opt = DistributedOptimizer(model, client, psworker.SGD(lr=0.1))
    train(opt, 1)
    return model, opt


def test_weights_made_the_jobs_through_the_optimizer_warn_of_nothing(shards):
    address = shards(1)[0].address
    with psworker.connect([address], mode="sync") as client:
        model, opt = trained_once(client)
        model.load_state_dict({"0.weight": torch.full((3, 4), 0.5)})
        opt.load_state_dict(opt.state_dict())  # the model's weights become the job's
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            train(opt, 1)
        assert model[0].weight.abs().max() < 0.6  # trained from the loaded 0.5s


def test_a_new_tensor_assigned_to_data_is_named_too(shards):
    """MoCo's momentum update of its key encoder (in the optimizer, never given a gradient):
    ``param_k.data = param_k.data * m + param_q.data * (1 - m)``. The version does not move;
    the parameter's memory does."""
    address = shards(1)[0].address
    with psworker.connect([address], mode="sync") as client:
        model, opt = trained_once(client)
        weight = model[0].weight
        weight.data = weight.data * 0.9 + 0.1
        with pytest.warns(UserWarning, match=r"changed 1 parameters \(0.weight\).*p\.data"):
            train(opt, 1)


def test_a_model_moved_to_channels_last_warns_of_nothing_and_trains_as_torch(shards):
    """``model.to(memory_format=torch.channels_last)`` after the optimizer was made gives the
    conv weights new memory of another layout, with the same values: nothing was written
    (was: named as a write, with a warning that the change is lost)."""
    address = shards(1)[0].address

    def fit(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        x = torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(1))
        for t in range(4):
            if t == 2:
                model.to(memory_format=torch.channels_last)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    def conv() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Flatten())

    reference = conv()
    fit(reference, torch.optim.SGD(reference.parameters(), lr=0.5))
    model = conv()
    with psworker.connect([address], mode="sync") as client, warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(model, DistributedOptimizer(model, client, torch.optim.SGD(model.parameters(), lr=0.5)))
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_weight_clipping_through_data_is_named(shards):
    """WGAN's critic: ``p.data.clamp_(-c, c)`` after each step writes through ``.data``,
    which moves no autograd version: the weights' contents show it, at the first steps."""
    address = shards(1)[0].address
    with psworker.connect([address], mode="sync") as client:
        model, opt = trained_once(client)
        model[0].weight.data.clamp_(-0.1, 0.1)
        with pytest.warns(UserWarning, match=r"changed 1 parameters \(0.weight\).*clamp_"):
            train(opt, 1)


def test_writes_through_data_from_a_late_step_on_are_named_within_64_steps(shards):
    """Clipping that starts at step 70 (a schedule) is seen at the next checked step."""
    address = shards(1)[0].address
    with psworker.connect([address], mode="sync") as client:
        model, opt = trained_once(client)
        opt.model = model
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the checked steps (1-3, 64) find nothing
            train(opt, 69)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(CONTENT_CHECK_EVERY):
                model[0].weight.data.clamp_(-0.01, 0.01)
                train(opt, 1)
        assert [str(w.message) for w in seen if "(0.weight)" in str(w.message)]


def test_local_mode_keeps_the_write_and_warns_of_nothing():
    with psworker.connect(mode="local") as client:
        model = net()
        opt = DistributedOptimizer(model, client, psworker.SGD(lr=0.0))
        opt.model = model
        train(opt, 1)
        with torch.no_grad():
            model[0].weight.fill_(0.25)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            train(opt, 1)
        assert torch.equal(model[0].weight, torch.full((3, 4), 0.25))  # lr 0: kept as written


def embedded(max_norm: float | None) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(10, 4, max_norm=max_norm), torch.nn.Flatten())


def test_an_embedding_with_max_norm_is_named_where_its_rescaling_would_be_lost(shards):
    """``nn.Embedding(max_norm=...)`` rescales looked-up rows in place in forward: the shards
    never see it (and allreduce's replicas would drift apart, as DDP's do)."""
    address = shards(1)[0].address
    lost = r"module '0' \(Embedding, max_norm=1.0\).*lost"
    with (
        psworker.connect([address], mode="sync") as client,
        pytest.warns(UserWarning, match=lost),
    ):
        DistributedOptimizer(embedded(1.0), client, psworker.SGD(lr=0.1))
    with psworker.connect(mode="local") as client, warnings.catch_warnings():
        warnings.simplefilter("error")  # one process holding its own weights: as torch
        DistributedOptimizer(embedded(1.0), client, psworker.SGD(lr=0.1))
    with psworker.connect([address], mode="sync") as client, warnings.catch_warnings():
        warnings.simplefilter("error")
        DistributedOptimizer(embedded(None), client, psworker.SGD(lr=0.1))
