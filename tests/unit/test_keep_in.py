"""``Variables.keep_in``: the values held in arrays the caller gives (a CPU model's own memory,
in allreduce and local modes): a step updates them in place, a refused step puts the old
values back into them, and an array that cannot hold its variable is refused by name before
any is taken."""

from __future__ import annotations

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from pscore.variables import Variables, same_memory
from pswire.errors import InvalidRequestError, StepRefusedError, UnknownVariableError


def installed(value: np.ndarray, lr: float = 0.5) -> tuple[Variables, Job]:
    job = Job("sync", 0, 1, SGD(lr=lr), (VarSpec("w", value.shape, value.dtype.name),), "m")
    state = Variables()
    state.install(job, {"w": value}, take=False)
    return state, job


def test_a_step_updates_the_arrays_the_values_are_kept_in() -> None:
    state, job = installed(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    model = np.zeros(4, np.float32)
    state.keep_in({"w": model})
    assert model.tolist() == [1.0, 2.0, 3.0, 4.0]  # the current values, copied in
    state.apply(job, {"w": np.ones(4, np.float32)})
    assert model.tolist() == [0.5, 1.5, 2.5, 3.5]
    assert state.values["w"] is model
    model *= 2  # written between steps: the values themselves
    state.apply(job, {"w": np.ones(4, np.float32)})
    assert model.tolist() == [0.5, 2.5, 4.5, 6.5]


def test_a_refused_step_puts_the_old_values_back_into_the_kept_arrays() -> None:
    # Inputs this large are backed up before the step, which then overflows: refused.
    state, job = installed(np.full(4, 3e38, np.float32), lr=1.0)
    model = np.zeros(4, np.float32)
    state.keep_in({"w": model})
    before = model.tobytes()
    with pytest.raises(StepRefusedError, match="left as before"):
        state.apply(job, {"w": np.full(4, -3e38, np.float32)})
    assert model.tobytes() == before
    assert same_memory(state.values["w"], model)


@pytest.mark.parametrize(
    ("offered", "says"),
    [
        (np.zeros(5, np.float32), r"\(5,\)"),
        (np.zeros(4, np.float64), "float64"),
        (np.zeros(8, np.float32)[::2], "contiguous False"),
        (np.frombuffer(bytes(16), np.float32), "writable False"),
    ],
    ids=["shape", "dtype", "strided", "read-only"],
)
def test_an_array_that_cannot_hold_its_variable_is_refused_by_name(
    offered: np.ndarray, says: str
) -> None:
    state, _ = installed(np.arange(4, dtype=np.float32))
    kept = np.zeros(4, np.float32)
    with pytest.raises(InvalidRequestError, match=f"'w'.*{says}"):
        state.keep_in({"w": offered})
    with pytest.raises(UnknownVariableError, match="'v'"):
        state.keep_in({"w": kept, "v": kept})
    assert state.values["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert not same_memory(state.values["w"], kept)  # checked before any was taken


def test_same_memory_means_one_array_of_bytes() -> None:
    a = np.zeros(8, np.float32)
    assert same_memory(a, a.view())
    assert not same_memory(a, a.copy())
    assert not same_memory(a[:4], a[4:])
    assert not same_memory(a[:4], a)  # overlapping is not the same
    assert not same_memory(a, a.view(np.int32))
