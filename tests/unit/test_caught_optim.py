"""Optimizer math a mutation run showed untested: SGD dampening other than 0.5 (the one value
where d == 1 - d), and every default hyper-parameter equal to torch.optim's."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from pscore.optim import SGD, Adagrad, Adam, AdamW, Optimizer, RMSprop
from pscore.rowstore import RowStore
from pscore.tables import TableSlice

# torch.optim's defaults (torch 2.x), by our names; checked against torch itself below.
TORCH_DEFAULTS: dict[type[Optimizer], dict[str, float]] = {
    SGD: {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
    Adam: {
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "amsgrad": False,
    },
    AdamW: {
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.01,
        "amsgrad": False,
    },
    RMSprop: {
        "lr": 1e-2,
        "alpha": 0.99,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "momentum": 0.0,
        "centered": False,
    },
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


# -- ranges, buffers and the blocked and row-sparse paths ---------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Adam(beta2=1.0), "invalid beta2: 1.0"),
        (lambda: Adam(weight_decay=-1.0), "invalid weight_decay"),
        (lambda: Adagrad(weight_decay=-1.0), "invalid weight_decay"),
        (lambda: Adagrad(eps=-1.0), "invalid eps"),
        (lambda: SGD(nesterov=True), "^nesterov needs momentum > 0 and dampening 0$"),
    ],
)
def test_out_of_range_hyper_parameters_are_refused(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_the_momentum_buffer_is_the_params_own_copy() -> None:
    opt = SGD(lr=1.0, momentum=0.5)
    for dtype in (np.float32, np.float64):  # as wide as the variable, or wider
        param = np.zeros(3, np.float32)
        state = opt.make_state(param)
        first = np.array([1.0, 2.0, 3.0], dtype)
        opt.apply(param, first, state)
        assert state["momentum_buffer"].dtype == np.float32
        opt.apply(param, np.ones(3, np.float32), state)
        np.testing.assert_array_equal(first, [1.0, 2.0, 3.0])  # the caller's, untouched
        np.testing.assert_allclose(param, -np.array([1, 2, 3]) - (0.5 * np.array([1, 2, 3]) + 1))


@pytest.mark.parametrize("opt", [SGD(lr=0.1, momentum=0.9), Adam(lr=0.1), Adagrad(lr=0.1)])
def test_blocked_apply_of_small_and_strided_variables_equals_apply(opt: Optimizer) -> None:
    rng = np.random.default_rng(3)
    for param in (rng.standard_normal(5), rng.standard_normal((6, 4)).T):  # small; strided
        param = param.astype(np.float32)
        whole, blocked = param.copy(), param  # ``param`` is a strided view for the 2nd
        whole_state, blocked_state = opt.make_state(whole), opt.make_state(blocked)
        for _ in range(3):
            grad = rng.standard_normal(param.shape).astype(np.float32)
            opt.apply(whole, grad, whole_state)
            opt.apply_blocked(blocked, grad, blocked_state, block=4)
        np.testing.assert_array_equal(blocked, whole)  # updated in place, even when strided


@pytest.mark.parametrize("opt", [SGD(lr=0.1, momentum=0.9), Adam(lr=0.1), Adagrad(lr=0.1)])
def test_a_table_step_is_apply_on_those_rows_and_leaves_the_rest(opt: Optimizer) -> None:
    # RowStore.step is the one row-sparse step (a shard's and the local client's).
    store = RowStore(TableSlice("t", 3, num_rows=5, row_end=5, seed=4), opt)
    everything = np.arange(5)
    param = store.gather(everything)
    # Slots as a table holds them: arrays from the start (a momentum buffer at zero).
    fresh = {k: np.zeros_like(param) if v is None else v for k, v in opt.make_state(param).items()}
    rows = np.array([3, 1])
    expected = param[rows].copy()
    expected_state = {k: v[rows] if isinstance(v, np.ndarray) else v for k, v in fresh.items()}
    untouched = param[[0, 2, 4]].copy()
    rng = np.random.default_rng(4)
    for _ in range(2):
        grad = rng.standard_normal((2, 3)).astype(np.float64)  # widened to the table's dtype
        opt.apply(expected, grad.astype(np.float32), expected_state)
        assert store.apply(rows, grad)
    after = store.gather(everything)
    np.testing.assert_array_equal(after[rows], expected)
    np.testing.assert_array_equal(after[[0, 2, 4]], untouched)
    slots = store.export().slots
    for key, value in expected_state.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(slots[key][rows], value)
            np.testing.assert_array_equal(slots[key][[0, 2, 4]], fresh[key][[0, 2, 4]])
        else:
            assert slots[key] == value == 2  # the step count advanced once per step
