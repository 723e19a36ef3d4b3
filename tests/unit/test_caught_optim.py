"""Optimizer math a mutation run showed untested: SGD dampening other than 0.5 (the one value
where d == 1 - d), and every default hyper-parameter equal to torch.optim's."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from pswire.optim import SGD, Adagrad, Adam, Optimizer

# torch.optim's defaults (torch 2.x), by our names; checked against torch itself below.
TORCH_DEFAULTS: dict[type[Optimizer], dict[str, float]] = {
    SGD: {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
    Adam: {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
    Adagrad: {
        "lr": 1e-2,
        "lr_decay": 0.0,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "eps": 1e-10,
    },
}


def ours(cls: type[Optimizer]) -> dict[str, float]:
    return {f.name: f.default for f in dataclasses.fields(cls)}  # type: ignore[misc]


@pytest.mark.parametrize("cls", list(TORCH_DEFAULTS), ids=lambda c: c.name)
def test_defaults_are_torch_optims(cls: type[Optimizer]) -> None:
    assert ours(cls) == TORCH_DEFAULTS[cls]


@pytest.mark.torch
@pytest.mark.parametrize("cls", list(TORCH_DEFAULTS), ids=lambda c: c.name)
def test_the_pinned_defaults_are_the_installed_torchs(cls: type[Optimizer]) -> None:
    torch = pytest.importorskip("torch")
    theirs = {
        k: p.default
        for k, p in inspect.signature(
            getattr(torch.optim, cls.__name__).__init__
        ).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    if "betas" in theirs:
        theirs["beta1"], theirs["beta2"] = theirs.pop("betas")
    mine = ours(cls)
    assert {k: theirs[k] for k in mine} == mine


def run_sgd(hp: dict, param: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    opt = SGD(**hp)
    state = opt.make_state(param)
    for g in grads:
        opt.apply(param, g, state)
    return param


@pytest.mark.parametrize("dampening", [0.1, 0.3, 0.9])
def test_sgd_dampening_scales_the_new_gradient_by_one_minus_it(dampening: float) -> None:
    # buf_1 = g_1 (no dampening on the first step); buf_t = m * buf + (1 - d) * g_t.
    momentum, lr = 0.9, 0.5
    grads = [np.array([1.0]), np.array([2.0]), np.array([4.0])]
    buf, p = 0.0, 0.0
    for t, g in enumerate(grads):
        buf = float(g[0]) if t == 0 else momentum * buf + (1 - dampening) * float(g[0])
        p -= lr * buf
    got = run_sgd(
        {"lr": lr, "momentum": momentum, "dampening": dampening}, np.zeros(1), [g for g in grads]
    )
    assert got[0] == pytest.approx(p, rel=1e-12)


@pytest.mark.torch
@pytest.mark.parametrize("dampening", [0.1, 0.3, 0.9])
@pytest.mark.parametrize("nesterov", [False])
def test_sgd_dampening_matches_torch(dampening: float, nesterov: bool) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    start = rng.standard_normal(11).astype(np.float32)
    grads = [rng.standard_normal(11).astype(np.float32) for _ in range(20)]
    hp = {"lr": 0.05, "momentum": 0.8, "dampening": dampening, "weight_decay": 0.01}
    mine = run_sgd(hp, start.copy(), grads)
    theirs = torch.tensor(start.copy(), requires_grad=True)
    reference = torch.optim.SGD([theirs], nesterov=nesterov, **hp)
    for g in grads:
        theirs.grad = torch.from_numpy(g.copy())
        reference.step()
    np.testing.assert_allclose(mine, theirs.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(mine - start).max() > 0.05  # it moved: the comparison is not vacuous
