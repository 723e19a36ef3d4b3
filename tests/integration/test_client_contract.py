"""The client contract (``psworker.api.Client``), run against every implementation: the local
client, the parameter-server client in sync and async (two real shard servers), the elastic
client and the all-reduce client (a real ring server). One worker each, so every one of them
must train exactly as the local reference does; what a training loop may rely on holds for all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import psworker
from pscore.optim import SGD
from pscore.optspec import StepOptions
from pswire.errors import (
    ClientClosedError,
    ShapeMismatchError,
    UnknownVariableError,
)
from psworker.api import Client
from psworker.local import LocalClient
from psworker.ring.client import AllReduceClient
from psworker.ring.ring import RingServer

VALUES = {
    "w": np.arange(12, dtype=np.float32).reshape(3, 4) / 10,
    "b": np.ones(4, np.float32),
}
# Two parameter groups, momentum (optimizer slots), and a step whose lr a scheduler changed.
OPTIMIZERS = [SGD(lr=0.1, momentum=0.9), SGD(lr=0.05, momentum=0.5)]
GROUPS = {"b": 1}
STEPS = 4


def grads(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in VALUES.items()}


def options(step: int) -> StepOptions | None:
    return StepOptions(values={0: {"lr": 0.02}}) if step >= 2 else None


KINDS = ["local", "sync", "async", "elastic", "allreduce"]


@pytest.fixture(params=KINDS)
def make(request: Any, shards: Callable[..., list]) -> Iterator[Callable[[], Client]]:
    made: list[Client] = []

    def build() -> Client:
        kind = request.param
        client: Client
        if kind == "local":
            client = LocalClient()
        elif kind == "allreduce":
            server = RingServer("127.0.0.1:0")
            client = AllReduceClient(0, [server.address], server=server, timeout=10)
        else:
            addresses = [s.address for s in shards(2)]
            extra: dict[str, Any] = {"elastic": "1:2"} if kind == "elastic" else {}
            mode = "async" if kind == "async" else "sync"
            client = psworker.connect(
                addresses, worker_id=0, num_workers=1, mode=mode, timeout=20, **extra
            )
        made.append(client)
        client.init(VALUES, OPTIMIZERS, groups=GROUPS)
        return client

    yield build
    for client in made:
        client.close()


def reference() -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    with LocalClient() as local:
        local.init(VALUES, OPTIMIZERS, groups=GROUPS)
        for step in range(STEPS):
            local.push(grads(step), options=options(step))
        return local.pull(), local.optimizer_state()


def test_it_is_a_client_and_starts_from_worker_0s_values(make) -> None:
    client = make()
    assert isinstance(client, Client)
    assert client.step == 0
    weights = client.pull()
    assert sorted(weights) == ["b", "w"]
    for key, value in VALUES.items():
        np.testing.assert_array_equal(weights[key], value)


def test_steps_train_exactly_as_the_local_reference(make) -> None:
    client = make()
    for step in range(STEPS):
        client.push_pull(grads(step), options=options(step))
    assert client.step == STEPS
    want, want_slots = reference()
    got = client.pull()
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value)
    slots = client.optimizer_state()
    for key, value in want_slots.items():
        np.testing.assert_array_equal(slots[key]["momentum_buffer"], value["momentum_buffer"])


def test_pull_into_the_callers_arrays(make) -> None:
    client = make()
    client.push(grads(0))
    out = {"w": np.empty((3, 4), np.float32)}
    got = client.pull(out=out)
    assert got["w"] is out["w"]
    np.testing.assert_array_equal(out["w"], client.pull(["w"])["w"])


def test_bad_names_and_shapes_are_refused_and_change_nothing(make) -> None:
    client = make()
    with pytest.raises(UnknownVariableError, match="nope"):
        client.pull(["nope"])
    bad = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(4, np.float32)}
    with pytest.raises(ShapeMismatchError, match=r"'w' has shape \(3, 4\)"):
        client.push(bad)
    assert client.step == 0
    for key, value in VALUES.items():
        np.testing.assert_array_equal(client.pull()[key], value)


def test_a_closed_client_refuses_every_call(make) -> None:
    client = make()
    client.close()
    with pytest.raises(ClientClosedError):
        client.pull()
    with pytest.raises(ClientClosedError):
        client.push(grads(0))
