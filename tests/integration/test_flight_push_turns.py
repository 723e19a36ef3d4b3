"""On the Flight data port a sync push is read on its turn: once every lower worker of the
round has pushed. Pushes that come early wait unread (the round holds none of their bytes),
and the round's result is the average in worker order, whatever order the pushes came in. A
push streamed from backward (its own descriptor command) is read as it arrives: the round
holds it until its turn, with the same result."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import psworker
from psserver.flight_service import start_flight_service
from psserver.metrics import ShardMetrics
from psserver.records import Limits
from psserver.server import start_server
from psserver.shard import Shard
from pswire import flightwire as fw
from psworker.flight_link import FlightLink

pytestmark = pytest.mark.timeout(120)
N = 1 << 16  # 256 KiB a push


@pytest.fixture
def shard_ports() -> Iterator[tuple[Shard, str, ShardMetrics]]:
    shard = Shard(Limits(max_wait_s=20.0))
    control = start_server(shard)
    metrics = ShardMetrics(shard, "ps0")
    data = start_flight_service(shard, piece_bytes=64 << 10, metrics=metrics)
    client = psworker.connect([control.address], worker_id=0, num_workers=3, mode="sync")
    client.init({"w": np.zeros(N, np.float32)}, psworker.SGD(lr=1.0))
    try:
        yield shard, data.address, metrics
    finally:
        client.close()
        data.stop()
        control.stop(grace=0.5)


def test_early_pushes_wait_unread_and_the_round_averages_in_worker_order(
    shard_ports: tuple[Shard, str, ShardMetrics], monkeypatch: pytest.MonkeyPatch
) -> None:
    shard, address, _ = shard_ports
    entered = {w: threading.Event() for w in range(3)}
    wait_turn = shard.wait_turn

    def watched(worker_id: int, *args: Any, **kwargs: Any) -> None:
        entered[worker_id].set()
        wait_turn(worker_id, *args, **kwargs)

    monkeypatch.setattr(shard, "wait_turn", watched)
    rng = np.random.default_rng(0)
    grads = [(rng.standard_normal(N) * 10.0 ** (3 * w - 3)).astype(np.float32) for w in range(3)]
    links = [FlightLink(0, address, w, 20.0) for w in range(3)]
    try:
        with ThreadPoolExecutor(3) as pool:
            late = [pool.submit(links[w].push_pull, 0, {"w": grads[w]}) for w in (2, 1)]
            for w in (2, 1):
                assert entered[w].wait(10), f"worker {w}'s push never reached its turn's wait"
            assert shard.status().pushes_applied == 0  # neither taken: their bytes unread
            assert not any(f.done() for f in late)
            first = pool.submit(links[0].push_pull, 0, {"w": grads[0]})
            results = [f.result(timeout=60) for f in (first, *late)]
    finally:
        for link in links:
            link.close()
    assert all(pushed.applied for pushed, _ in results)
    expected = np.zeros(N, np.float32) - (grads[0] + grads[1] + grads[2]) / np.float32(3)
    for _, arrays in results:
        assert arrays["w"].tobytes() == expected.tobytes()


def test_a_streamed_push_is_read_as_it_arrives_and_the_round_keeps_worker_order(
    shard_ports: tuple[Shard, str, ShardMetrics], monkeypatch: pytest.MonkeyPatch
) -> None:
    shard, address, metrics = shard_ports
    turns: list[int] = []
    taken = {w: threading.Event() for w in range(3)}
    wait_turn, push_pull = shard.wait_turn, shard.push_pull

    def watched_turn(worker_id: int, *args: Any, **kwargs: Any) -> None:
        turns.append(worker_id)
        wait_turn(worker_id, *args, **kwargs)

    def watched_push(worker_id: int, *args: Any, **kwargs: Any) -> Any:
        taken[worker_id].set()
        return push_pull(worker_id, *args, **kwargs)

    monkeypatch.setattr(shard, "wait_turn", watched_turn)
    monkeypatch.setattr(shard, "push_pull", watched_push)
    rng = np.random.default_rng(1)
    grads = [(rng.standard_normal(N) * 10.0 ** (3 * w - 3)).astype(np.float32) for w in range(3)]
    links = [FlightLink(0, address, w, 20.0) for w in range(3)]
    try:
        entry, raw = fw.encode_tensor("w", grads[2])
        stream = links[2].begin_stream(0, [entry])
        stream.write([raw])
        # Read whole and handed to the shard with workers 0 and 1 still to push: no turn.
        assert taken[2].wait(10), "the streamed push was held back for its turn"
        assert turns == [] and shard.status().pushes_applied == 1
        with ThreadPoolExecutor(3) as pool:
            ended = pool.submit(stream.end)
            whole = [pool.submit(links[w].push_pull, 0, {"w": grads[w]}) for w in (1, 0)]
            results = [f.result(timeout=60) for f in (ended, *whole)]
    finally:
        for link in links:
            link.close()
    assert sorted(turns) == [0, 1]  # whole pushes still wait for theirs
    assert all(pushed.applied for pushed, _ in results)
    expected = np.zeros(N, np.float32) - (grads[0] + grads[1] + grads[2]) / np.float32(3)
    for _, arrays in results:
        assert arrays["w"].tobytes() == expected.tobytes()

    def calls(rpc: str) -> float | None:
        labels = {"shard": "ps0", "rpc": rpc, "code": "OK"}
        return metrics.registry.get_sample_value("psserver_rpcs_total", labels)

    # Timed apart: a streamed step's time includes the backward it overlapped.
    assert (calls("PushPullStreamed"), calls("PushPull")) == (1.0, 2.0)
