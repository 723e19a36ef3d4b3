"""SGD's safe steps are finite by proof, so the shard bounds their results instead of reading
them again (``Optimizer.result_bound``), and reuses the sums of squares the push's checks took
(``Job.checked_grads``): a step refused still changes nothing, an overflow from finite inputs
is still caught, and the bound never falls below the results it stands for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pscore.variables as variables_module
from pscore.job import Job, VarSpec
from pscore.optim import DEFAULT_BLOCK_ELEMENTS, ROUNDING, SGD, Adam, Optimizer
from pscore.variables import HYPER_SAFE, SAFE_SUM_SQUARES, Variables
from pswire.errors import StepRefusedError

BIG = 3 * DEFAULT_BLOCK_ELEMENTS + 5  # applied in pieces


def exact_squares(*arrays: np.ndarray) -> float:
    return max(
        float(np.dot(a.astype(np.float64).ravel(), a.astype(np.float64).ravel())) for a in arrays
    )


def job_of(optimizer: Optimizer, size: int, dtype: str = "float32") -> Job:
    return Job("async", 0, 1, optimizer, (VarSpec("w", (size,), dtype),), "m")


def installed(optimizer: Optimizer, value: np.ndarray) -> tuple[Variables, Job]:
    job = job_of(optimizer, value.size, value.dtype.name)
    state = Variables()
    state.install(job, {"w": value}, take=False)
    return state, job


def results(state: Variables) -> list[np.ndarray]:
    return [state.values["w"], *(v for v in state.slots["w"].values() if isinstance(v, np.ndarray))]


def snapshot(state: Variables) -> list[bytes]:
    return [a.tobytes() for a in results(state)]


@settings(max_examples=150, deadline=None)
@given(
    lr=st.floats(0.0, 10.0),
    momentum=st.sampled_from([0.0, 0.5, 0.9, 0.99, 3.0]),
    dampening=st.floats(-3.0, 3.0),
    nesterov=st.booleans(),
    weight_decay=st.sampled_from([0.0, 1e-4, 0.5, 5.0]),
    scale=st.sampled_from([1e-20, 1e-3, 1.0, 1e6, 1e12]),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 4),
)
def test_the_bound_is_never_below_the_results(
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    scale: float,
    dtype: type,
    seed: int,
    steps: int,
) -> None:
    nesterov = nesterov and momentum > 0
    opt = SGD(lr, momentum, 0.0 if nesterov else dampening, nesterov, weight_decay)
    rng = np.random.default_rng(seed)
    param = (rng.standard_normal(300) * scale).astype(dtype)
    state = opt.make_state(param)
    squares = exact_squares(param)
    for _ in range(steps):  # the first step makes the momentum buffer: bounded too
        grad = (rng.standard_normal(300) * scale * rng.uniform(0, 3)).astype(dtype)
        bound = opt.result_bound(param.dtype, squares, float(np.dot(grad, grad)))
        opt.apply(param, grad, state)
        slots = [v for v in state.values() if isinstance(v, np.ndarray)]
        assert bound is not None and bound >= exact_squares(param, *slots)
        squares = bound  # chained, as the shard keeps it


def test_the_bound_follows_each_line_of_the_step() -> None:
    # Minkowski line by line (S = 4, G = 9: ||p||, ||b|| <= 2, ||g|| = 3).
    r2 = ROUNDING**2
    f32 = np.dtype(np.float32)
    assert SGD(lr=0.5).result_bound(f32, 4.0, 9.0) == pytest.approx((2 + 0.5 * 3) ** 2 * r2)
    # weight decay: ||d|| <= 3 + 0.25 * 2
    got = SGD(lr=0.5, weight_decay=0.25).result_bound(f32, 4.0, 9.0)
    assert got == pytest.approx((2 + 0.5 * 3.5) ** 2 * r2)
    # momentum: ||b'|| <= 0.9 * 2 + 3 = 4.8, ||p'|| <= 2 + 1 * 4.8 = 6.8; the larger counts
    got = SGD(lr=1.0, momentum=0.9).result_bound(f32, 4.0, 9.0)
    assert got == pytest.approx(6.8**2 * r2)
    got = SGD(lr=0.25, momentum=0.9).result_bound(f32, 4.0, 9.0)
    assert got == pytest.approx(4.8**2 * r2)  # p' <= 3.2: b' is the larger
    # dampening 3: |1 - 3| = 2 scales the new gradient: ||b'|| <= 1.8 + 6 = 7.8 (lr 0: b' wins)
    got = SGD(lr=0.0, momentum=0.9, dampening=3.0).result_bound(f32, 4.0, 9.0)
    assert got == pytest.approx(7.8**2 * r2)
    # dampening 0.5 still counts the first step's whole gradient (b' = d): 1.8 + 3
    got = SGD(lr=0.0, momentum=0.9, dampening=0.5).result_bound(f32, 4.0, 9.0)
    assert got == pytest.approx(4.8**2 * r2)
    # nesterov: ||n|| <= 3 + 0.9 * 4.8 = 7.32, ||p'|| <= 2 + 0.5 * 7.32 = 5.66
    got = SGD(lr=0.5, momentum=0.9, nesterov=True).result_bound(f32, 4.0, 9.0)
    assert got == pytest.approx(5.66**2 * r2)
    assert SGD(lr=0.5).result_bound(np.dtype(np.float64), 4.0, 9.0) is not None
    # float16 (largest value 65504) is outside the proof; so is every other optimizer.
    assert SGD(lr=0.5).result_bound(np.dtype(np.float16), 4.0, 9.0) is None
    assert Adam().result_bound(f32, 4.0, 9.0) is None
    # A subclass with its own apply is not SGD's math: no bound, its results are measured.
    assert OwnApply(lr=0.5).result_bound(f32, 4.0, 9.0) is None
    assert Subclass(lr=0.5).result_bound(f32, 4.0, 9.0) is not None


@dataclass(frozen=True)
class OwnApply(SGD):
    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        super().apply(param, grad, state)


@dataclass(frozen=True)
class Subclass(SGD):
    pass


@pytest.mark.parametrize("nesterov", [False, True])
def test_the_largest_safe_step_stays_finite(nesterov: bool) -> None:
    # The proof's corner: every input and hyper-parameter at the largest size the shard calls
    # safe (no backup, no measure), signs chosen so that every term adds up.
    top = float(np.sqrt(SAFE_SUM_SQUARES))  # one element: its square is the sum, 1e30
    opt = SGD(
        lr=HYPER_SAFE,
        momentum=HYPER_SAFE,
        dampening=0.0 if nesterov else -HYPER_SAFE,
        nesterov=nesterov,
        weight_decay=HYPER_SAFE,
    )
    edge = np.array([top], np.float32)
    state, job = installed(opt, edge.copy())
    state.apply(job, {"w": edge.copy()}, summed=False)  # the momentum buffer is made
    state.values["w"][:] = edge  # back to the safe edge, every term of the same sign
    state.slots["w"]["momentum_buffer"][:] = edge
    assert state._measure("w")
    assert not state._risky(job.optimizers, {"w": edge}, ["w"], {})
    state.apply(job, {"w": edge.copy()}, summed=False)
    assert all(np.isfinite(a).all() for a in results(state))
    assert abs(float(state.values["w"][0])) > 1e32  # the proof's order of size: 1e33-2e33
    # Measured (the bound passed the safe level): in float32 the square overflows to inf,
    # which makes the next step run with a backup, as it must at this size.
    assert state._squares["w"] >= exact_squares(*results(state)) > SAFE_SUM_SQUARES


def test_an_overflow_from_finite_inputs_is_refused_and_changes_nothing() -> None:
    # Finite values, a finite gradient, an inf result: the inputs are past the safe bounds,
    # so the step runs with a backup and its results are measured.
    value = np.full(BIG, 1.0, np.float32)
    state, job = installed(SGD(lr=1.0, momentum=0.9), value)
    state.apply(job, {"w": np.full(BIG, 1e-3, np.float32)}, summed=False)  # bounded
    grad = np.full(BIG, 1e-3, np.float32)
    grad[BIG - 2] = -3e38  # b' = -3e38, p' = 1 + 3e38: still finite
    state.apply(job, {"w": grad}, summed=False)
    assert all(np.isfinite(a).all() for a in results(state))
    before = snapshot(state)
    # b' = 0.9 * -3e38 - 3e38 = -5.7e38: past float32's largest value, so -inf, and p' inf
    with pytest.raises(StepRefusedError, match="left as before"):
        state.apply(job, {"w": grad}, summed=False)
    assert snapshot(state) == before


def test_a_bounded_step_grows_the_bound_until_it_is_measured_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured: list[bool] = []
    blocked = SGD.apply_blocked

    def spy(self: SGD, *args: Any, **kwargs: Any) -> float | None:
        measured.append(bool(kwargs.get("measure")))
        return blocked(self, *args, **kwargs)

    monkeypatch.setattr(SGD, "apply_blocked", spy)
    state, job = installed(SGD(lr=1.0, momentum=0.9), np.full(BIG, 1e6, np.float32))
    for _ in range(3):
        state.apply(job, {"w": np.full(BIG, 1e5, np.float32)}, summed=False)
        assert state._squares["w"] >= exact_squares(*results(state))
    assert measured == [False, False, False]  # bounded by proof: no pass over the results
    # A bound that would pass the safe level is not kept: the step is measured instead, so
    # the next step's guard reads the real size (no backup copy for a loose bound).
    state._squares["w"] = SAFE_SUM_SQUARES / 2
    state.apply(job, {"w": np.full(BIG, 1e5, np.float32)}, summed=False)
    assert measured[-1] is True
    assert state._squares["w"] == pytest.approx(exact_squares(*results(state)), rel=1e-4)


def test_a_push_is_read_once_for_its_checks_and_the_overflow_guard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = variables_module.sum_squares

    def counting(array: np.ndarray) -> float:
        calls.append(array.size)
        return real(array)

    state, job = installed(Adam(lr=0.01), np.zeros(BIG, np.float32))
    monkeypatch.setattr(variables_module, "sum_squares", counting)
    squares: dict[str, float] = {}
    checked = job.checked_grads({"w": np.full(BIG, 0.5, np.float32)}, squares)
    assert squares["w"] == pytest.approx(0.25 * BIG)
    state.apply(job, checked, summed=False, known_squares=squares)
    assert BIG not in calls  # the checks' sum served the guard
    # A sync round's sum is measured anew (the arrays may have been summed into).
    state.apply(job, checked, summed=True, known_squares=squares)
    assert BIG in calls
    # A sum the checks took is used as measured: a huge one makes the step run with a backup.
    calls.clear()
    squares = {}
    checked = job.checked_grads({"w": np.full(BIG, 0.5, np.float32)}, squares)
    squares["w"] = 2 * SAFE_SUM_SQUARES
    backups: list[list[str]] = []
    backup = Variables._backup

    def spy(self: Variables, keys: list[str]) -> dict[str, tuple[np.ndarray, dict]]:
        backups.append(keys)
        return backup(self, keys)

    monkeypatch.setattr(Variables, "_backup", spy)
    state.apply(job, checked, summed=False, known_squares=squares)
    assert backups == [["w"]] and BIG not in calls


def test_a_nan_gradient_is_refused_before_anything_changes_with_sgd() -> None:
    state, job = installed(SGD(lr=0.1, momentum=0.9), np.ones(BIG, np.float32))
    state.apply(job, {"w": np.full(BIG, 0.5, np.float32)}, summed=False)
    before = snapshot(state)
    grad = np.full(BIG, 0.5, np.float32)
    grad[BIG - 1] = np.nan
    with pytest.raises(StepRefusedError, match="not finite"):
        state.apply(job, {"w": grad}, summed=True)
    assert snapshot(state) == before
