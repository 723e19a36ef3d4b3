"""The model-state contract, run against both holders of a model's state: the local client
and a shard (called directly, and behind real gRPC servers through a PSClient). Both apply a
step through ``pscore.variables.Variables.apply`` after ``Job.checked_grads``: a bad gradient,
a wrong shape or an update that overflows float32 gets the same error from each, and leaves
the weights and optimizer slots as they were."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import pytest

import psworker
from pscore.job import Job, VarSpec
from pscore.optim import SGD, Optimizer
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import (
    InvalidRequestError,
    PSError,
    ShapeMismatchError,
    StepRefusedError,
    UnknownVariableError,
)
from psworker.local import LocalClient

VALUES = {"w": np.full((2, 3), 3e38, np.float32), "b": np.zeros(3, np.float32)}
OPTIMIZER = SGD(lr=0.5, momentum=0.9)


class Holder(Protocol):
    def push(self, grads: dict[str, np.ndarray]) -> None: ...
    def weights(self) -> dict[str, np.ndarray]: ...
    def slots(self) -> dict[str, dict[str, Any]]: ...


class LocalHolder:
    def __init__(self, optimizer: Optimizer, values: dict[str, np.ndarray] = VALUES) -> None:
        self.client = LocalClient()
        self.client.init(values, optimizer)

    def push(self, grads: dict[str, np.ndarray]) -> None:
        self.client.push(grads)

    def weights(self) -> dict[str, np.ndarray]:
        return self.client.pull()

    def slots(self) -> dict[str, dict[str, Any]]:
        return self.client.optimizer_state()


class ShardHolder:
    """A ``Shard`` called as its servicer calls it: no client-side checks in front."""

    def __init__(self, optimizer: Optimizer, values: dict[str, np.ndarray] = VALUES) -> None:
        self.shard = Shard(Limits(max_wait_s=5))
        variables = tuple(VarSpec(k, v.shape, v.dtype.name) for k, v in values.items())
        self.shard.init(0, Job("async", 0, 1, optimizer, variables, "m"), values)
        self.step = 0

    def push(self, grads: dict[str, np.ndarray]) -> None:
        self.shard.push(0, self.step, grads, timeout=5)
        self.step += 1

    def weights(self) -> dict[str, np.ndarray]:
        return self.shard.snapshot()

    def slots(self) -> dict[str, dict[str, Any]]:
        return self.shard.optimizer_state(timeout=5)


class ClientHolder(LocalHolder):
    """A PSClient on a real shard server. (On several shards an overflow one shard refuses
    while another applied its part is reported as such, with the step used up: README, "A
    push applies wholly or says so"; not this contract.)"""

    def __init__(
        self, optimizer: Optimizer, addresses: list[str], values: dict[str, np.ndarray] = VALUES
    ) -> None:
        self.client = psworker.PSClient(
            psworker.ClientSettings(addresses=tuple(addresses), mode="async", heartbeat_s=0)
        )
        self.client.init(values, optimizer)


@pytest.fixture(params=["local", "shard", "grpc"])
def make(request: Any, shards: Callable[..., list]) -> Iterator[Callable[[Optimizer], Holder]]:
    made: list[Any] = []

    def build(optimizer: Optimizer) -> Holder:
        holder: Holder
        if request.param == "local":
            holder = LocalHolder(optimizer)
        elif request.param == "shard":
            holder = ShardHolder(optimizer)
        else:
            holder = ClientHolder(optimizer, [s.address for s in shards(1)])
            made.append(holder.client)
        return holder

    yield build
    for client in made:
        client.close()


def good() -> dict[str, np.ndarray]:
    return {"w": np.zeros((2, 3), np.float32), "b": np.ones(3, np.float32)}


BAD = {
    "nan": (
        {"w": np.zeros((2, 3), np.float32), "b": np.array([1, np.nan, 1], np.float32)},
        InvalidRequestError,
        "variable 'b': gradient has 1 non-finite values (NaN or Inf)",
    ),
    "shape": (
        {"w": np.zeros((3, 2), np.float32), "b": np.ones(3, np.float32)},
        ShapeMismatchError,
        "variable 'w' has shape (2, 3) on the server, gradient sent (3, 2)",
    ),
    "unknown": (
        {"w": np.zeros((2, 3), np.float32), "nope": np.ones(3, np.float32)},
        UnknownVariableError,
        "'nope'",
    ),
    # Finite, but w - lr * g leaves float32 (3e38 + 0.5 * 3e38): refused, nothing applied.
    "overflow": (
        {"w": np.full((2, 3), -3e38, np.float32), "b": np.ones(3, np.float32)},
        StepRefusedError,
        "non-finite",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_refused_step_names_its_cause_and_changes_nothing(make, case: str) -> None:
    grads, error, words = BAD[case]
    holder = make(OPTIMIZER)
    holder.push(good())  # momentum buffers exist: they must not move either
    weights, slots = holder.weights(), holder.slots()
    with pytest.raises(error) as caught:
        holder.push(grads)
    assert words in str(caught.value)
    after = holder.weights()
    for key, value in weights.items():
        np.testing.assert_array_equal(after[key], value)
    for key, slot in holder.slots().items():
        np.testing.assert_array_equal(slot["momentum_buffer"], slots[key]["momentum_buffer"])
    holder.push(good())  # and the holder goes on
    assert not np.array_equal(holder.weights()["b"], weights["b"])


def test_every_holder_ends_a_run_with_the_same_weights(shards: Callable[..., list]) -> None:
    rng = np.random.default_rng(0)
    steps = [
        {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in VALUES.items()}
        for _ in range(5)
    ]
    start = {k: np.ones_like(v) for k, v in VALUES.items()}
    results = []
    for holder in (
        LocalHolder(OPTIMIZER, start),
        ShardHolder(OPTIMIZER, start),
        ClientHolder(OPTIMIZER, [s.address for s in shards(2)], start),
    ):
        for grads in steps:
            holder.push(grads)
        results.append(holder.weights())
        if isinstance(holder, LocalHolder):
            holder.client.close()
    assert not np.array_equal(results[0]["w"], start["w"])
    for other in results[1:]:
        for key, value in results[0].items():
            np.testing.assert_array_equal(other[key], value)


def test_errors_are_the_family_users_catch() -> None:
    assert all(issubclass(e, PSError) for _, e, _ in BAD.values())


def test_local_and_shard_steps_run_the_one_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not two copies of the rule that agree today: the very same function.
    from pscore.variables import Variables

    calls: list[str] = []
    apply = Variables.apply

    def counted(self: Variables, *args: Any, **kwargs: Any) -> None:
        calls.append(type(self).__qualname__)
        apply(self, *args, **kwargs)

    monkeypatch.setattr(Variables, "apply", counted)
    LocalHolder(OPTIMIZER).push(good())
    ShardHolder(OPTIMIZER).push(good())
    assert calls == ["Variables", "Variables"]


def test_a_step_that_leaves_a_slot_nan_is_refused() -> None:
    # The finiteness check after a step covers every slot, whichever comes first: a NaN slot
    # behind a finite one was once read as finite (Python's max() drops NaN there).
    from dataclasses import dataclass

    from pscore.variables import Variables

    @dataclass(frozen=True)
    class NaNSlot(SGD):
        def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
            super().apply(param, grad, state)
            state["momentum_buffer"][0] = np.nan

    opt = NaNSlot(lr=0.0, momentum=0.9)
    job = Job("async", 0, 1, opt, (VarSpec("w", (2,), "float32"),), "m")
    state = Variables()
    state.install(job, {"w": np.ones(2, np.float32)}, take=False)
    with pytest.raises(StepRefusedError, match="non-finite"):
        state.apply(job, {"w": np.ones(2, np.float32)}, summed=False)
