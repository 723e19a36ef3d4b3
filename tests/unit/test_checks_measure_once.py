"""A step measures each large gradient's sum of squares once: the finite check's measure is
handed to the optimizer's overflow guard (in the local client and on the shard, where the
push is applied as it came), and one measured elsewhere (the all-reduce's ring) is trusted
when finite; the results and refusals are those of measuring everything."""

from __future__ import annotations

import numpy as np
import pytest

import psworker
from pscore import checks, variables
from pscore.job import Job, VarSpec
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import InvalidRequestError
from psworker.local import LocalClient

N = 1 << 17  # large enough for the BLAS measure (checks.measured_squares)


def client(values: dict[str, np.ndarray]) -> LocalClient:
    c = LocalClient()
    c.init(values, psworker.SGD(lr=0.1, momentum=0.9))
    return c


def test_check_tensor_returns_the_measure_only_when_it_made_one():
    big, small = np.ones(N, np.float32), np.ones(8, np.float32)
    assert checks.check_tensor("w", (N,), "float32", big, "gradient") == float(N)
    assert checks.check_tensor("b", (8,), "float32", small, "gradient") is None
    assert checks.check_tensor("w", (N,), "float32", big, "gradient", finite=True) is None


def count_measures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the size of every array the step measures (``variables.sum_squares``)."""
    calls: list[int] = []
    real = variables.sum_squares

    def counted(array: np.ndarray) -> float:
        calls.append(array.size)
        return real(array)

    monkeypatch.setattr(variables, "sum_squares", counted)
    return calls


def test_each_large_gradient_is_measured_once_per_step(monkeypatch):
    rng = np.random.default_rng(0)
    start = {"w": rng.standard_normal(N).astype(np.float32), "b": np.zeros(8, np.float32)}
    grads = {"w": rng.standard_normal(N).astype(np.float32), "b": np.ones(8, np.float32)}
    reference, measured = client(start), client(start)
    reference.push(grads)
    calls = count_measures(monkeypatch)
    measured.push(grads)
    assert N not in calls  # the check's measure was reused by the step
    for name, value in reference.pull().items():
        assert measured.pull()[name].tobytes() == value.tobytes()


def test_a_finite_known_measure_is_trusted_and_a_nan_one_is_checked():
    start = {"w": np.zeros(N, np.float32)}
    grad = np.ones(N, np.float32)
    c = client(start)
    c.push({"w": grad}, known_squares={"w": float(N)})
    bad = grad.copy()
    bad[3] = np.nan
    with pytest.raises(InvalidRequestError, match="'w': gradient has 1 non-finite"):
        c.push({"w": bad}, known_squares={"w": float("nan")})
    assert np.isfinite(c.pull()["w"]).all()


def shard(mode: str, start: dict[str, np.ndarray]) -> Shard:
    s = Shard(Limits(max_wait_s=5.0))
    specs = tuple(VarSpec(k, v.shape, "float32") for k, v in start.items())
    job = Job(mode, 0, 1, psworker.SGD(lr=0.1, momentum=0.9), specs, "m")
    assert s.init(0, job, {k: v.copy() for k, v in start.items()})
    return s


@pytest.mark.parametrize(("mode", "measured_again"), [("async", False), ("sync", True)])
def test_the_shard_reuses_a_push_checks_measure_only_for_the_push_itself(
    monkeypatch: pytest.MonkeyPatch, mode: str, measured_again: bool
) -> None:
    # A push applied as it comes (async, ssp) is the very arrays its checks measured; a sync
    # round applies a sum (new arrays, or one summed into): measured again before its step.
    rng = np.random.default_rng(1)
    start = {"w": rng.standard_normal(N).astype(np.float32), "b": np.zeros(8, np.float32)}
    grads = [
        {"w": rng.standard_normal(N).astype(np.float32), "b": np.ones(8, np.float32)}
        for _ in range(2)
    ]
    reference, s = client(start), shard(mode, start)
    for g in grads:
        reference.push(g)
    calls = count_measures(monkeypatch)
    for step, g in enumerate(grads):
        s.push(0, step, {k: v.copy() for k, v in g.items()}, timeout=5.0, take=True)
    assert (N in calls) is measured_again
    # The same bits as the local client's step (which measures through the same checks).
    for name, value in reference.pull().items():
        assert s.snapshot()[name].tobytes() == value.tobytes(), name
