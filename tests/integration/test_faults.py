"""Worker failures, backup workers and injected RPC faults against real in-process shards."""

from __future__ import annotations

import time

import numpy as np
import pytest
from faults import FaultPlan, flight_faults
from workers import run_workers

import psworker
from pscore.optim import SGD
from psserver.records import Limits

SHAPES = {"w": (6, 4), "b": (4,)}
# Every test here runs on both transports (conftest.py's ``data_plane``).
pytestmark = pytest.mark.usefixtures("data_plane")


def init_values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def grad_for(worker: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * worker + step)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def sync_run(
    addresses, steps: int, plans=None, fused: bool = False, **client_options
) -> dict[str, np.ndarray]:
    """Two sync workers pushing fixed gradients (``fused``: one PushPull per step instead of
    a pull and a push); returns worker 0's final weights."""
    result: dict[str, np.ndarray] = {}

    def worker(i: int):
        def run():
            with psworker.connect(
                addresses,
                worker_id=i,
                num_workers=2,
                mode="sync",
                timeout=20,
                interceptors=(plans or {}).get(i, ()),
                **client_options,
            ) as client:
                client.init(init_values(), SGD(lr=0.1, momentum=0.9))
                flight_faults(client, (plans or {}).get(i, ()))  # the same faults on Flight
                for step in range(steps):
                    if fused:
                        client.push_pull(grad_for(i, step))
                        continue
                    client.pull()
                    client.push(grad_for(i, step))
                if i == 0:
                    result.update(client.pull())

        return run

    run_workers([worker(0), worker(1)])
    return result


def test_duplicated_and_dropped_pushes_change_nothing_in_sync_mode(shards):
    steps = 12
    clean = sync_run([s.address for s in shards(2)], steps)
    plans = {
        0: [FaultPlan("Push", {3, 9, 15}, "lose_reply"), FaultPlan("Push", {5}, "duplicate")],
        1: [FaultPlan("Push", {2, 8}, "drop"), FaultPlan("Pull", {4}, "lose_reply")],
    }
    servers = shards(2)
    faulty = sync_run([s.address for s in servers], steps, plans)
    assert all(p.fired for ps in plans.values() for p in ps), "every planned fault happened"
    for k in clean:
        assert clean[k].tobytes() == faulty[k].tobytes(), f"{k} differs from the fault-free run"
    statuses = [s.shard.status() for s in servers]
    assert all(st.clock == steps for st in statuses)
    assert sum(st.pushes_duplicate for st in statuses) >= 4  # lost replies and the duplicate


def test_fused_push_pull_equals_push_then_pull_through_lost_and_dropped_calls(shards):
    steps = 10
    clean = sync_run([s.address for s in shards(2)], steps)
    stream = "PushPullStream"  # the plans hit its messages: one per step per shard
    plans = {
        0: [FaultPlan(stream, {3, 9}, "lose_reply"), FaultPlan(stream, {6}, "duplicate")],
        1: [FaultPlan(stream, {2, 12}, "drop"), FaultPlan(stream, {5}, "lose_reply")],
    }
    servers = shards(2)
    faulty = sync_run([s.address for s in servers], steps, plans, fused=True)
    assert all(p.fired for ps in plans.values() for p in ps), "every planned fault happened"
    for k in clean:
        assert clean[k].tobytes() == faulty[k].tobytes(), f"{k} differs from push then pull"
    statuses = [s.shard.status() for s in servers]
    assert all(st.clock == steps for st in statuses)
    assert sum(st.pushes_duplicate for st in statuses) >= 4  # lost replies re-sent, duplicate


def test_a_silent_worker_leaves_the_quorum_and_the_rest_continue(shards):
    (server,) = shards(1, Limits(heartbeat_timeout_s=1.0))
    address = [server.address]
    done = {0: 0, 1: 0}
    killed_at = 3
    victims: list[psworker.PSClient] = []

    def victim():
        client = psworker.connect(address, worker_id=2, num_workers=3, mode="sync", timeout=20)
        client.init(init_values(), SGD(lr=0.1))
        for step in range(killed_at):
            client.pull()
            client.push(grad_for(2, step))
        client._beats.stop()  # dies: no more pushes, no more heartbeats, no goodbye
        victims.append(client)

    def survivor(i: int):
        def run():
            with psworker.connect(
                address, worker_id=i, num_workers=3, mode="sync", timeout=20, heartbeat_s=0.2
            ) as client:
                client.init(init_values(), SGD(lr=0.1))
                for step in range(10):
                    client.pull()
                    client.push(grad_for(i, step))
                    done[i] = step + 1

        return run

    start = time.monotonic()
    run_workers([victim, survivor(0), survivor(1)])
    assert done == {0: 10, 1: 10}
    # The survivors waited at most about one heartbeat timeout for the dead worker.
    assert time.monotonic() - start < 15
    status = server.shard.status()
    # Worker 2 was dropped for its silence; 0 and 1 left when they closed their clients.
    assert status.clock == 10 and status.left == {0, 1} and 2 not in status.live | status.left

    # A restarted worker 2 rejoins at the current step, not at 0 or where it died.
    with psworker.connect(address, worker_id=2, num_workers=3, mode="sync", timeout=20) as again:
        again.init(init_values(), SGD(lr=0.1))
        assert again.step == 10
        assert 2 in server.shard.status().live
    for client in victims:
        client.close()


def test_backup_workers_apply_the_first_k_pushes_and_drop_late_ones(shards):
    (server,) = shards(1)
    address = [server.address]
    steps = 8
    finished: dict[int, int] = {}

    def worker(i: int):
        def run():
            with psworker.connect(
                address, worker_id=i, num_workers=3, mode="sync", quorum=2, timeout=20
            ) as client:
                client.init(init_values(), SGD(lr=0.1))
                while client.step < steps:
                    client.pull()
                    if i == 2:
                        time.sleep(0.15)  # the straggler: injected delay
                    client.push(grad_for(i, client.step))
                finished[i] = client.step

        return run

    run_workers([worker(0), worker(1), worker(2)])
    status = server.shard.status()
    assert status.clock >= steps
    assert status.pushes_late > 0, "the straggler's pushes were dropped as late"
    assert finished[2] >= steps  # the straggler skipped ahead instead of falling behind


def test_quorum_outside_sync_mode_is_rejected(shards):
    (server,) = shards(1)
    with (
        psworker.connect([server.address], worker_id=0, num_workers=1, mode="async", quorum=1) as c,
        pytest.raises(psworker.InvalidRequestError, match="quorum"),
    ):
        c.init(init_values(), SGD(lr=0.1))


def test_unreachable_shard_fails_with_a_clear_error_within_the_retry_window():
    with psworker.connect(
        ["127.0.0.1:1"], worker_id=0, num_workers=1, mode="async", timeout=1, retry_s=2
    ) as client:
        start = time.monotonic()
        with pytest.raises(psworker.UnavailableError, match=r"shard 0 \(127.0.0.1:1\)"):
            client.init(init_values(), SGD(lr=0.1))
        assert time.monotonic() - start < 10
