"""Unit tests for pscore.optim: numpy optimizers that must follow torch.optim's math exactly."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from pscore.optim import (
    OPTIMIZERS,
    SGD,
    Adadelta,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    NAdam,
    Optimizer,
    RAdam,
    RMSprop,
)
from pscore.optspec import StepOptions, group_optimizers, optimizer_from_spec, with_values
from pswire.errors import InvalidRequestError

STEPS = 50
SHAPES = [(6, 5), (7,)]

CASES: list[tuple[type[Optimizer], dict[str, Any]]] = [
    (SGD, {"lr": 0.1}),
    (SGD, {"lr": 0.05, "momentum": 0.9}),
    (SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.5}),
    (SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    (SGD, {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.05}),
    (SGD, {"lr": 0.1, "weight_decay": 0.1}),
    (Adam, {"lr": 0.01}),
    (Adam, {"lr": 0.02, "beta1": 0.5, "beta2": 0.9, "eps": 1e-6}),
    (Adam, {"lr": 0.01, "weight_decay": 0.05}),
    (Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.05}),
    (AdamW, {"lr": 0.01}),
    (AdamW, {"lr": 0.02, "beta1": 0.5, "weight_decay": 0.1, "amsgrad": True}),
    (RMSprop, {"lr": 0.01}),
    (RMSprop, {"lr": 0.01, "alpha": 0.9, "momentum": 0.8, "weight_decay": 0.05}),
    (RMSprop, {"lr": 0.01, "alpha": 0.3, "centered": True, "eps": 1e-4}),
    (RMSprop, {"lr": 0.005, "momentum": 0.5, "centered": True}),
    (Adagrad, {"lr": 0.1}),
    (Adagrad, {"lr": 0.1, "lr_decay": 0.05}),
    (Adagrad, {"lr": 0.1, "weight_decay": 0.1, "initial_accumulator_value": 0.5}),
    (Adagrad, {"lr": 0.2, "lr_decay": 0.01, "eps": 1e-3}),
    (Adadelta, {}),
    (Adadelta, {"lr": 0.5, "rho": 0.8, "eps": 1e-4, "weight_decay": 0.05}),
    (Adamax, {"lr": 0.01}),
    (Adamax, {"lr": 0.02, "beta1": 0.5, "beta2": 0.9, "eps": 1e-4, "weight_decay": 0.05}),
    (NAdam, {"lr": 0.01}),
    (NAdam, {"lr": 0.01, "beta1": 0.8, "momentum_decay": 0.01, "weight_decay": 0.05}),
    (NAdam, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    (RAdam, {"lr": 0.01}),
    (RAdam, {"lr": 0.01, "beta2": 0.9, "weight_decay": 0.05}),
    (RAdam, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
]


def case_id(case: tuple[type[Optimizer], dict[str, Any]]) -> str:
    cls, hp = case
    return cls.name + "-" + "-".join(f"{k}={v}" for k, v in hp.items())


def gradients(seed: int, shape: tuple[int, ...], dtype: type) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype(dtype) for _ in range(STEPS)]


def initial(seed: int, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return np.random.default_rng(seed + 1000).normal(size=shape).astype(dtype)


# --- against torch.optim -------------------------------------------------------------------


def torch_optimizer(cls: type[Optimizer], hp: dict[str, Any], params: list) -> Any:
    torch = pytest.importorskip("torch")
    if cls is SGD:
        return torch.optim.SGD(params, **hp)
    if cls in (Adam, AdamW):
        kw = dict(hp)
        kw["betas"] = (kw.pop("beta1", 0.9), kw.pop("beta2", 0.999))
        return (torch.optim.AdamW if cls is AdamW else torch.optim.Adam)(params, **kw)
    if cls is RMSprop:
        return torch.optim.RMSprop(params, **hp)
    if cls is Adagrad:
        return torch.optim.Adagrad(params, **hp)
    if cls is Adadelta:
        return torch.optim.Adadelta(params, **hp)
    kw = dict(hp)
    kw["betas"] = (kw.pop("beta1", 0.9), kw.pop("beta2", 0.999))
    kind = {Adamax: torch.optim.Adamax, NAdam: torch.optim.NAdam, RAdam: torch.optim.RAdam}
    return kind[cls](params, **kw)


@pytest.mark.torch
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_torch_optim_float32(case: tuple[type[Optimizer], dict[str, Any]]) -> None:
    torch = pytest.importorskip("torch")
    cls, hp = case
    opt = cls(**hp)

    ours = [initial(i, s, np.float32) for i, s in enumerate(SHAPES)]
    states = [opt.make_state(p) for p in ours]
    theirs = [torch.tensor(p.copy(), requires_grad=True) for p in ours]
    reference = torch_optimizer(cls, hp, theirs)
    grads = [gradients(i, s, np.float32) for i, s in enumerate(SHAPES)]
    start = [p.copy() for p in ours]

    for step in range(STEPS):
        for p, state, g in zip(ours, states, grads, strict=True):
            opt.apply(p, g[step], state)
        for t, g in zip(theirs, grads, strict=True):
            t.grad = torch.from_numpy(g[step].copy())
        reference.step()
        for p, t in zip(ours, theirs, strict=True):
            assert p.dtype == np.float32
            np.testing.assert_allclose(
                p, t.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=f"step {step + 1}"
            )
            if cls in (Adadelta, Adamax, NAdam, RAdam):  # measured <= 1.2e-7 (issue 27)
                assert np.abs(p - t.detach().numpy()).max() < 1e-6, f"step {step + 1}"
    # The parameters really moved, so the comparison above is not vacuous.
    for p, s in zip(ours, start, strict=True):
        assert np.abs(p - s).max() > 0.05


# --- float64 reference formulas, no torch --------------------------------------------------


def reference_run(
    cls: type[Optimizer], hp: dict[str, Any], param: np.ndarray, grads: list[np.ndarray]
) -> np.ndarray:
    """The published update rules, written out plainly (no in-place tricks)."""
    h = {**cls().params(), **hp}
    p = param.copy()
    if cls is SGD:
        buf = None
        for g in grads:
            d = g + h["weight_decay"] * p
            if h["momentum"]:
                buf = d.copy() if buf is None else h["momentum"] * buf + (1 - h["dampening"]) * d
                d = d + h["momentum"] * buf if h["nesterov"] else buf
            p = p - h["lr"] * d
    elif cls in (Adam, AdamW):
        m = np.zeros_like(p)
        v = np.zeros_like(p)
        v_max = np.zeros_like(p)
        for t, g in enumerate(grads, start=1):
            if cls is AdamW:
                p = p * (1 - h["lr"] * h["weight_decay"])
            else:
                g = g + h["weight_decay"] * p
            m = h["beta1"] * m + (1 - h["beta1"]) * g
            v = h["beta2"] * v + (1 - h["beta2"]) * g**2
            v_max = np.maximum(v_max, v)
            m_hat = m / (1 - h["beta1"] ** t)
            v_hat = (v_max if h["amsgrad"] else v) / (1 - h["beta2"] ** t)
            p = p - h["lr"] * m_hat / (np.sqrt(v_hat) + h["eps"])
    elif cls is RMSprop:
        sq, mean, buf = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
        for g in grads:
            g = g + h["weight_decay"] * p
            sq = h["alpha"] * sq + (1 - h["alpha"]) * g**2
            mean = h["alpha"] * mean + (1 - h["alpha"]) * g
            avg = np.sqrt(sq - mean**2 if h["centered"] else sq) + h["eps"]
            if h["momentum"]:
                buf = h["momentum"] * buf + g / avg
                p = p - h["lr"] * buf
            else:
                p = p - h["lr"] * g / avg
    elif cls is Adadelta:
        sq, acc_delta = np.zeros_like(p), np.zeros_like(p)
        for g in grads:
            g = g + h["weight_decay"] * p
            sq = h["rho"] * sq + (1 - h["rho"]) * g**2
            delta = np.sqrt(acc_delta + h["eps"]) / np.sqrt(sq + h["eps"]) * g
            acc_delta = h["rho"] * acc_delta + (1 - h["rho"]) * delta**2
            p = p - h["lr"] * delta
    elif cls is Adamax:
        m, u = np.zeros_like(p), np.zeros_like(p)
        for t, g in enumerate(grads, start=1):
            g = g + h["weight_decay"] * p
            m = h["beta1"] * m + (1 - h["beta1"]) * g
            u = np.maximum(h["beta2"] * u, np.abs(g) + h["eps"])
            p = p - h["lr"] / (1 - h["beta1"] ** t) * m / u
    elif cls is NAdam:  # Dozat 2016 with torch's momentum schedule
        m, v, mu_product = np.zeros_like(p), np.zeros_like(p), 1.0
        for t, g in enumerate(grads, start=1):
            if h["decoupled_weight_decay"]:
                p = p * (1 - h["lr"] * h["weight_decay"])
            else:
                g = g + h["weight_decay"] * p
            mu = h["beta1"] * (1 - 0.5 * 0.96 ** (t * h["momentum_decay"]))
            mu_next = h["beta1"] * (1 - 0.5 * 0.96 ** ((t + 1) * h["momentum_decay"]))
            mu_product *= mu
            m = h["beta1"] * m + (1 - h["beta1"]) * g
            v = h["beta2"] * v + (1 - h["beta2"]) * g**2
            denom = np.sqrt(v / (1 - h["beta2"] ** t)) + h["eps"]
            p = p - h["lr"] * (1 - mu) / (1 - mu_product) * g / denom
            p = p - h["lr"] * mu_next / (1 - mu_product * mu_next) * m / denom
    elif cls is RAdam:  # Liu et al. 2019
        m, v = np.zeros_like(p), np.zeros_like(p)
        rho_inf = 2 / (1 - h["beta2"]) - 1
        for t, g in enumerate(grads, start=1):
            if h["decoupled_weight_decay"]:
                p = p * (1 - h["lr"] * h["weight_decay"])
            else:
                g = g + h["weight_decay"] * p
            m = h["beta1"] * m + (1 - h["beta1"]) * g
            v = h["beta2"] * v + (1 - h["beta2"]) * g**2
            m_hat = m / (1 - h["beta1"] ** t)
            rho_t = rho_inf - 2 * t * h["beta2"] ** t / (1 - h["beta2"] ** t)
            if rho_t > 5:
                rect = math.sqrt(
                    (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
                )
                adaptive = math.sqrt(1 - h["beta2"] ** t) / (np.sqrt(v) + h["eps"])
                p = p - h["lr"] * m_hat * adaptive * rect
            else:
                p = p - h["lr"] * m_hat
    else:
        acc = np.full_like(p, h["initial_accumulator_value"])
        for t, g in enumerate(grads, start=1):
            g = g + h["weight_decay"] * p
            acc = acc + g**2
            p = p - h["lr"] / (1 + (t - 1) * h["lr_decay"]) * g / (np.sqrt(acc) + h["eps"])
    return p


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference_formulas_float64(case: tuple[type[Optimizer], dict[str, Any]]) -> None:
    cls, hp = case
    opt = cls(**hp)
    for i, shape in enumerate(SHAPES):
        param = initial(i, shape, np.float64)
        grads = gradients(i, shape, np.float64)
        want = reference_run(cls, hp, param, grads)
        state = opt.make_state(param)
        start = param.copy()
        for g in grads:
            opt.apply(param, g, state)
        assert param.dtype == np.float64
        np.testing.assert_allclose(param, want, rtol=1e-10, atol=1e-12)
        assert np.abs(param - start).max() > 0.05


def test_first_steps_by_hand() -> None:
    # Small enough to check on paper.
    p = np.array([1.0, -2.0])
    sgd = SGD(lr=0.5, momentum=0.5)
    state = sgd.make_state(p)
    sgd.apply(p, np.array([1.0, 1.0]), state)  # buf = g = 1
    np.testing.assert_array_equal(p, [0.5, -2.5])
    sgd.apply(p, np.array([1.0, 1.0]), state)  # buf = 0.5 * 1 + 1 = 1.5
    np.testing.assert_array_equal(p, [-0.25, -3.25])

    p = np.array([3.0])
    adam = Adam(lr=0.1, eps=0.0)
    adam.apply(p, np.array([-4.0]), adam.make_state(p))  # first step is lr * sign(g)
    np.testing.assert_allclose(p, [3.1], rtol=1e-15)

    p = np.array([1.0])
    adagrad = Adagrad(lr=1.0, eps=0.0, initial_accumulator_value=5.0)
    adagrad.apply(p, np.array([2.0]), adagrad.make_state(p))  # 1 - 2 / sqrt(5 + 4)
    np.testing.assert_allclose(p, [1 - 2 / 3], rtol=1e-15)


# --- in place ------------------------------------------------------------------------------

ALL_OPTIMIZERS = [
    SGD(lr=0.1),
    SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    Adam(lr=0.1, weight_decay=0.01),
    Adagrad(lr=0.1, lr_decay=0.01, weight_decay=0.01),
    AdamW(lr=0.1, amsgrad=True),
    RMSprop(lr=0.1, momentum=0.9, centered=True, weight_decay=0.01),
    Adadelta(weight_decay=0.01),
    Adamax(lr=0.1, weight_decay=0.01),
    NAdam(lr=0.1, weight_decay=0.01),
    RAdam(lr=0.1, weight_decay=0.01, decoupled_weight_decay=True),
]


@pytest.mark.parametrize("opt", ALL_OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_apply_updates_in_place(opt: Optimizer, dtype: type) -> None:
    storage: np.ndarray = np.ones(12, dtype=dtype)
    param = storage[2:8].reshape(2, 3)  # a view, as a shard's slice of a larger buffer may be
    grad = np.arange(6, dtype=dtype).reshape(2, 3) - 2.5
    grad_before = grad.copy()
    state = opt.make_state(param)
    for _ in range(3):
        opt.apply(param, grad, state)
    assert param.base is not None and np.shares_memory(param, storage)
    assert param.dtype == dtype
    # Every element with a nonzero gradient moved; the storage outside the view did not.
    assert (storage[2:8] != 1).all()
    np.testing.assert_array_equal(storage[:2], 1)
    np.testing.assert_array_equal(storage[8:], 1)
    np.testing.assert_array_equal(grad, grad_before)


@pytest.mark.parametrize("opt", ALL_OPTIMIZERS, ids=repr)
def test_states_are_independent_per_variable(opt: Optimizer) -> None:
    a, b = np.zeros(4), np.zeros(4)
    sa, sb = opt.make_state(a), opt.make_state(b)
    for _ in range(3):
        opt.apply(a, np.ones(4), sa)
    opt.apply(b, np.ones(4), sb)
    fresh = np.zeros(4)
    opt.apply(fresh, np.ones(4), opt.make_state(fresh))
    np.testing.assert_array_equal(b, fresh)
    assert not np.array_equal(a, b)


# --- optimizer_from_spec -------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_spec_round_trips(case: tuple[type[Optimizer], dict[str, Any]]) -> None:
    cls, hp = case
    opt = cls(**hp)
    params = opt.params()
    assert all(type(v) is float for v in params.values())
    assert set(params) == {f.name for f in dataclasses.fields(cls)}
    again = optimizer_from_spec(cls.name, params)
    assert type(again) is cls
    assert again == opt
    assert again.params() == params


def test_spec_defaults_and_partial_params() -> None:
    assert sorted(OPTIMIZERS) == [
        "adadelta",
        "adagrad",
        "adam",
        "adamax",
        "adamw",
        "nadam",
        "radam",
        "rmsprop",
        "sgd",
    ]
    for name, cls in OPTIMIZERS.items():
        assert optimizer_from_spec(name, {}) == cls()
    assert optimizer_from_spec("adam", {"lr": 0.5}) == Adam(lr=0.5)
    sgd = optimizer_from_spec("sgd", {"momentum": 0.9, "nesterov": 1.0})
    assert sgd.nesterov is True  # type: ignore[attr-defined]


def test_spec_rejects_an_unknown_optimizer() -> None:
    with pytest.raises(InvalidRequestError, match=r"'lamb'.*adagrad.*adam.*sgd"):
        optimizer_from_spec("lamb", {})


@pytest.mark.parametrize(
    ("name", "params", "detail"),
    [
        ("sgd", {"beta1": 0.9}, "no parameter 'beta1'"),
        ("adam", {"momentum": 0.9}, "no parameter 'momentum'"),
        ("adagrad", {"name": 1.0}, "no parameter 'name'"),
        ("sgd", {"lr": math.nan}, "'lr' is nan"),
        ("adam", {"eps": math.inf}, "'eps' is inf"),
        ("adagrad", {"lr_decay": -math.inf}, "'lr_decay' is -inf"),
        ("sgd", {"nesterov": 1.0}, "nesterov"),  # needs momentum
        ("sgd", {"momentum": 0.9, "dampening": 0.1, "nesterov": 1.0}, "nesterov"),
        ("sgd", {"nesterov": 0.5}, "'nesterov' is a flag"),
        ("sgd", {"lr": -0.1}, "lr"),
        ("sgd", {"momentum": -0.5}, "momentum"),
        ("sgd", {"weight_decay": -1.0}, "weight_decay"),
        ("adam", {"beta1": 1.0}, "beta1"),
        ("adam", {"beta2": -0.1}, "beta2"),
        ("adam", {"eps": -1e-8}, "eps"),
        ("adagrad", {"initial_accumulator_value": -1.0}, "initial_accumulator_value"),
        ("adagrad", {"lr_decay": -0.1}, "lr_decay"),
        ("adadelta", {"rho": 1.5}, "rho"),
        ("adamax", {"beta1": 1.0}, "beta1"),
        ("nadam", {"momentum_decay": -0.1}, "momentum_decay"),
        ("radam", {"decoupled_weight_decay": 0.5}, "is a flag"),
    ],
)
def test_spec_rejects_bad_params(name: str, params: dict[str, float], detail: str) -> None:
    with pytest.raises(InvalidRequestError, match=detail) as info:
        optimizer_from_spec(name, params)
    assert repr(name) in str(info.value)


def test_torch_rejects_the_same_ranges() -> None:
    """The range checks are torch's: each bad value above is also refused by torch.optim."""
    torch = pytest.importorskip("torch")
    w = [torch.zeros(2, requires_grad=True)]
    bad = [
        lambda: torch.optim.SGD(w, lr=-0.1),
        lambda: torch.optim.SGD(w, lr=0.1, momentum=-0.5),
        lambda: torch.optim.SGD(w, lr=0.1, weight_decay=-1.0),
        lambda: torch.optim.SGD(w, lr=0.1, nesterov=True),
        lambda: torch.optim.Adam(w, betas=(1.0, 0.999)),
        lambda: torch.optim.Adam(w, betas=(0.9, -0.1)),
        lambda: torch.optim.Adam(w, eps=-1e-8),
        lambda: torch.optim.Adagrad(w, initial_accumulator_value=-1.0),
        lambda: torch.optim.Adagrad(w, lr_decay=-0.1),
        lambda: torch.optim.Adadelta(w, rho=1.5),
        lambda: torch.optim.Adamax(w, betas=(1.0, 0.999)),
        lambda: torch.optim.NAdam(w, momentum_decay=-0.1),
    ]
    for make in bad:
        with pytest.raises(ValueError):
            make()


@pytest.mark.parametrize(
    "optimizer",
    [
        SGD(lr=0.1),
        SGD(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01),
        SGD(lr=0.1, momentum=0.9, nesterov=True),
        Adam(lr=0.01, weight_decay=0.01),
        Adagrad(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
        AdamW(lr=0.01, amsgrad=True),
        RMSprop(lr=0.01, momentum=0.9, centered=True),
        Adadelta(weight_decay=0.01),
        Adamax(lr=0.01),
        NAdam(lr=0.01, weight_decay=0.01, decoupled_weight_decay=True),
        RAdam(lr=0.01, weight_decay=0.01),
    ],
    ids=[
        "sgd",
        "momentum-dampening-decay",
        "nesterov",
        "adam",
        "adagrad",
        "adamw",
        "rmsprop",
        "adadelta",
        "adamax",
        "nadam",
        "radam",
    ],
)
def test_blocked_apply_is_bit_identical_to_whole_apply(optimizer) -> None:
    rng = np.random.default_rng(0)
    whole = rng.standard_normal((13, 7)).astype(np.float32)
    blocked = whole.copy()
    whole_state, blocked_state = optimizer.make_state(whole), optimizer.make_state(blocked)
    for _ in range(4):
        grad = rng.standard_normal((13, 7)).astype(np.float32)
        optimizer.apply(whole, grad, whole_state)
        optimizer.apply_blocked(blocked, grad, blocked_state, block=10)  # 10 pieces, 1 short
    assert whole.tobytes() == blocked.tobytes()
    assert whole_state.keys() == blocked_state.keys()
    for key, value in whole_state.items():
        if isinstance(value, np.ndarray):
            assert value.tobytes() == blocked_state[key].tobytes(), key
            assert blocked_state[key].shape == value.shape
        else:
            assert value == blocked_state[key], key


# --- hyper-parameters that change during training ----------------------------------------


def test_with_values_replaces_values_and_keeps_the_rest() -> None:
    base = AdamW(lr=0.01, weight_decay=0.1)
    assert with_values(base, {}) is base
    changed = with_values(base, {"lr": 0.5, "beta1": 0.8})
    assert changed == AdamW(lr=0.5, beta1=0.8, weight_decay=0.1)
    assert type(changed) is AdamW


@pytest.mark.parametrize(
    ("base", "values", "detail"),
    [
        (SGD(lr=0.1, momentum=0.9), {"momentum": 0.0}, "which optimizer state"),
        (SGD(lr=0.1), {"momentum": 0.9}, "which optimizer state"),
        (Adam(), {"amsgrad": 1.0}, "which optimizer state"),
        (RMSprop(), {"centered": 1.0}, "which optimizer state"),
        (RMSprop(momentum=0.5), {"momentum": 0.0}, "which optimizer state"),
        (SGD(), {"lr": -1.0}, "invalid lr"),
        (Adam(), {"beta2": 1.0}, "beta2"),
        (Adam(), {"lr": math.nan}, "'lr' is nan"),
        (Adam(), {"momentum": 0.9}, "no parameter 'momentum'"),
        (SGD(momentum=0.9), {"nesterov": 0.5}, "is a flag"),
    ],
)
def test_with_values_refuses_bad_or_layout_changing_values(base, values, detail) -> None:
    with pytest.raises(InvalidRequestError, match=detail) as info:
        with_values(base, values, "parameter group 3")
    assert "parameter group 3" in str(info.value)


def test_group_optimizers_applies_each_groups_values() -> None:
    groups = (SGD(lr=0.1, momentum=0.9), SGD(lr=0.2))
    assert group_optimizers(groups, None) == groups
    assert group_optimizers(groups, StepOptions()) == groups
    out = group_optimizers(groups, StepOptions({1: {"lr": 0.0}}))
    assert out == (groups[0], SGD(lr=0.0))
    assert out[0] is groups[0]
    with pytest.raises(InvalidRequestError, match=r"parameter group 2; the job has groups 0\.\.1"):
        group_optimizers(groups, StepOptions({2: {"lr": 0.1}}))
