"""Replies on the Flight data port are one step's values, written without a whole-model copy.

A reply is copied a batch at a time under the shard's lock as it is written; should an update
change the values first, the reply copies what it has not sent (``Shard.steady_reader``). A
reply never mixes two steps, checked with replies cut into many batches while other workers'
pushes land; and the shard allocates a few batches per reply, not the model.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import psworker
from psserver.flight_service import RunningFlightService, start_flight_service
from psserver.records import Limits
from psserver.server import RunningServer, start_server
from psserver.shard import Shard
from pswire.proto import ps_pb2
from psworker.flight_link import FlightLink

pytestmark = pytest.mark.timeout(120)
PIECE = 4 << 10  # the shard's record batches: a reply of ``N`` floats is 64 of them
N = 1 << 16
LR = 1.0


class Ports:
    """A shard's control server and data port, the model initialised through the control port."""

    def __init__(self, mode: str, workers: int, model: dict[str, np.ndarray], piece: int) -> None:
        self.shard = Shard(Limits(max_wait_s=20.0))
        self.control: RunningServer = start_server(self.shard)
        self.data: RunningFlightService = start_flight_service(self.shard, piece_bytes=piece)
        self.client = psworker.connect(
            [self.control.address], worker_id=0, num_workers=workers, mode=mode, timeout=20
        )
        self.client.init(model, psworker.SGD(lr=LR))
        self.links: list[FlightLink] = []

    def link(self, worker_id: int) -> FlightLink:
        link = FlightLink(0, self.data.address, worker_id, 20.0)
        self.links.append(link)
        return link

    def close(self) -> None:
        for link in self.links:
            link.close()
        self.client.close()
        self.data.stop()
        self.control.stop(grace=0.5)


@pytest.fixture
def ports() -> Iterator[type[Ports]]:
    started: list[Ports] = []

    class Started(Ports):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            started.append(self)

    yield Started
    for p in started:
        p.close()


def one_state(arrays: dict[str, np.ndarray]) -> float:
    """The number of updates a reply's values show; fails unless every element shows the same
    (each update subtracts LR from every element of every variable)."""
    w, b = arrays["w"], arrays["b"]
    first = float(w[0])
    assert np.all(w == first) and np.all(b == first), (
        f"a reply mixes steps: w spans {np.unique(w)[:8]}, b {np.unique(b)}"
    )
    return -first


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_reply_is_never_a_mix_of_two_steps_while_other_pushes_land(ports, mode) -> None:
    model = {"w": np.zeros(N, np.float32), "b": np.zeros(8, np.float32)}
    p = ports(mode, 2, model, PIECE)
    grads = {"w": np.ones(N, np.float32), "b": np.ones(8, np.float32)}
    steps = 12

    def train(worker_id: int) -> list[float]:
        link = p.link(worker_id)
        seen = []
        for step in range(steps):
            pushed, arrays = link.push_pull(step, grads)
            assert pushed.applied
            seen.append(one_state(arrays))
        return seen

    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(train, w) for w in (0, 1)]
        seen = [r.result(timeout=100) for r in runs]
    for run in seen:
        assert run == sorted(run)  # a worker never reads an older state than it read before
    if mode == "sync":
        # sync sums the round's two pushes and averages them: one LR per step, both workers
        # read the same state after each step.
        assert seen[0] == seen[1] == [float(s + 1) for s in range(steps)]
    else:
        assert max(max(run) for run in seen) <= 2 * steps
    assert float(-p.shard.snapshot()["w"][0]) == (steps if mode == "sync" else 2 * steps)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_reply_copies_batches_not_the_model(ports, mode) -> None:
    """The shard's allocations while it serves a pull of 16 MiB are a few 256 KiB batches: the
    reply is not copied whole (the old encode's copy was the model's size)."""
    n = 4 << 20  # 16 MiB of float32
    model = {"w": np.zeros(n, np.float32), "b": np.zeros(8, np.float32)}
    p = ports(mode, 1, model, 256 << 10)
    link = p.link(0)
    into = {k: np.empty_like(v) for k, v in model.items()}
    request = ps_pb2.PullRequest(worker_id=0, step=0, names=["w", "b"])
    link.pull(request, into=into)  # warm: the exchange and its buffers
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        link.pull(ps_pb2.PullRequest(worker_id=0, step=0, names=["w", "b"]), into=into)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert np.all(into["w"] == 0)
    assert peak < model["w"].nbytes // 2, f"a pull allocated {peak} bytes for 16 MiB"


def test_a_live_reply_copies_what_it_has_not_sent_before_the_values_change() -> None:
    """Copy on write: the shard calls the reply's hook before an update changes the values in
    place, once, and the reply's pieces read after it show the values from before."""
    shard = Shard(Limits(max_wait_s=5.0))
    control = start_server(shard)
    try:
        client = psworker.connect([control.address], worker_id=0, num_workers=1, mode="sync")
        with client:
            client.init({"w": np.zeros(4, np.float32)}, psworker.SGD(lr=LR))
            held: dict[str, np.ndarray] = {}
            calls: list[str] = []

            def detach() -> None:
                calls.append("detach")
                held["w"] = held["w"].copy()

            def encode(arrays: Mapping[str, np.ndarray], clock: int) -> object:
                held.update(arrays)
                return shard.steady_reader(detach)

            (read, release), _ = shard.pull(0, 0, encode=encode)
            assert read(lambda: held["w"].copy()).tolist() == [0.0] * 4 and calls == []
            shard.push(0, 0, {"w": np.ones(4, np.float32)})  # the round closes: an update
            assert calls == ["detach"]
            assert read(lambda: held["w"].copy()).tolist() == [0.0] * 4  # the step it read
            assert shard.snapshot()["w"].tolist() == [-LR] * 4
            shard.push(0, 1, {"w": np.ones(4, np.float32)})
            assert calls == ["detach"]  # once: it has its copy
            release()
    finally:
        control.stop(grace=0.5)


def test_a_released_reply_is_not_called() -> None:
    shard = Shard(Limits(max_wait_s=5.0))
    control = start_server(shard)
    try:
        client = psworker.connect([control.address], worker_id=0, num_workers=1, mode="async")
        with client:
            client.init({"w": np.zeros(4, np.float32)}, psworker.SGD(lr=LR))
            calls: list[int] = []
            (_, release), _ = shard.pull(
                0, 0, encode=lambda arrays, clock: shard.steady_reader(lambda: calls.append(1))
            )
            release()
            shard.push(0, 0, {"w": np.ones(4, np.float32)})
            assert calls == []
    finally:
        control.stop(grace=0.5)
