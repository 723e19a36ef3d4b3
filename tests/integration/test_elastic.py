"""Elastic jobs over real shards: workers join and leave a running sync job and the weights are
exactly those of one process that averaged the same members' gradients each step; below its
minimum a job waits, and the wait ends at its deadline with the missing workers named."""

from __future__ import annotations

import re
import threading
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from workers import run_workers

import psworker
from pscore.optim import SGD
from psctl import status_view
from psserver.metrics import ShardMetrics
from psserver.server import start_server
from psserver.shard import Shard
from psworker.elastic import ElasticPSClient

SHAPES = {"w": (4, 3), "b": (3,)}
STEPS, GROW_AT, SHRINK_AT = 10, 3, 7


def init_values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def grad(worker: int, step: int) -> dict[str, np.ndarray]:
    """Worker ``worker``'s gradient at ``step``: its 'batch' is fixed by (worker, step)."""
    rng = np.random.default_rng([worker, step])
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def optimizer() -> SGD:
    return SGD(lr=0.1, momentum=0.9)


def members_at(step: int) -> list[int]:
    """The schedule: workers 0 and 1 throughout; worker 2 from GROW_AT until SHRINK_AT."""
    return [0, 1, 2] if GROW_AT <= step < SHRINK_AT else [0, 1]


def reference() -> dict[str, np.ndarray]:
    """One process (mode local) stepping on each step's members' mean gradient, in worker
    order as the shards sum them."""
    with psworker.connect(mode="local") as local:
        local.init(init_values(), optimizer())
        for step in range(STEPS):
            members = members_at(step)
            total = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
            for w in members:
                for k, g in grad(w, step).items():
                    total[k] += g
            local.push({k: v / np.float32(len(members)) for k, v in total.items()})
        return local.pull()


def elastic(addresses: list[str], worker: int, timeout: float = 30, **kw) -> ElasticPSClient:
    client = psworker.connect(addresses, worker_id=worker, elastic="2:4", timeout=timeout, **kw)
    assert isinstance(client, ElasticPSClient)
    return client


@pytest.mark.timeout(120)
def test_a_sync_job_grows_and_shrinks_without_restarts_and_matches_one_process(shards):
    servers = shards(2)
    addresses = [s.address for s in servers]
    ready = threading.Barrier(3, timeout=30)  # both founders have read at GROW_AT - 1
    joined = threading.Event()
    finals: dict[int, dict[str, np.ndarray]] = {}
    steps_done: dict[int, list[int]] = {}

    def founder(worker: int):
        def run() -> None:
            with elastic(addresses, worker) as client:
                client.init(init_values(), optimizer())
                assert client.step == 0
                weights = client.pull()
                done = []
                for step in range(STEPS):
                    if step == GROW_AT - 1:
                        # Step GROW_AT - 1 is open (we read at it): a joiner now trains from
                        # GROW_AT on every shard.
                        ready.wait()
                        assert joined.wait(30), "the joiner never joined"
                    weights = client.push_pull(grad(worker, step))
                    done.append(step)
                finals[worker] = weights
                steps_done[worker] = done

        return run

    def joiner() -> None:
        ready.wait()
        with elastic(addresses, 2) as client:
            client.init(init_values(), optimizer())
            assert client.joined_at == client.step == GROW_AT
            joined.set()
            client.pull()  # the job's current weights: nothing is initialised again
            done = []
            while client.step < SHRINK_AT:
                done.append(client.step)
                client.push_pull(grad(2, client.step))
            steps_done[2] = done
        # close() left the job: steps from SHRINK_AT on average workers 0 and 1 alone.

    run_workers([founder(0), founder(1), joiner])
    assert steps_done == {0: list(range(STEPS)), 1: list(range(STEPS)), 2: [3, 4, 5, 6]}
    expected = reference()
    for worker in (0, 1):
        for key, value in expected.items():
            np.testing.assert_allclose(finals[worker][key], value, rtol=0, atol=1e-5)
    # A different schedule gives different weights: the comparison can fail.
    assert not np.allclose(finals[0]["w"], init_values()["w"], atol=1e-3)
    for server in servers:
        status = server.shard.status()
        assert status.clock == STEPS
        events = [(e.kind, e.worker, e.step) for e, _ in status.history]
        assert ("joined", 2, GROW_AT) in events and ("left", 2, SHRINK_AT) in events
        assert status.membership_counts["joined"] == 3  # 0 and 1 at step 0, then 2


@pytest.mark.timeout(60)
def test_below_the_minimum_the_wait_ends_at_its_deadline_naming_who_is_missing(shards):
    servers = shards(2)
    addresses = [s.address for s in servers]
    # The pull below waits out the client's deadline: a short one.
    clients = [elastic(addresses, w, heartbeat_s=0.2, timeout=5.0) for w in (0, 1)]
    try:
        run_workers([lambda c=c: c.init(init_values(), optimizer()) for c in clients])
        run_workers(
            [lambda c=c: [c.push_pull(grad(c.worker_id, s)) for s in range(3)] for c in clients]
        )
        clients[1].close()  # leaves: step 3 opened with both, so it ends with worker 0 alone
        survivor = clients[0]
        survivor.push(grad(0, 3))
        with pytest.raises(psworker.WaitTimeoutError) as info:
            survivor.pull()  # step 4 may not open with one member of at least two
        message = str(info.value)
        assert "at least 2 members to open step 4" in message, message
        assert "worker 1 (left at step 3" in message, message
        assert all(s.shard.status().clock == 4 for s in servers)  # nothing trained on
    finally:
        for client in clients:
            client.close()


@pytest.mark.timeout(60)
def test_status_shows_the_membership_history_and_metrics_count_joins_and_leaves():
    shard = Shard()
    metrics = ShardMetrics(shard, "ps0")
    server = start_server(shard, metrics=metrics)
    exporter = metrics.serve("127.0.0.1", 0)
    try:
        address = [server.address]

        def client(worker: int) -> ElasticPSClient:
            c = psworker.connect(address, worker_id=worker, elastic="1:3", timeout=20)
            assert isinstance(c, ElasticPSClient)
            return c

        with client(0) as first:
            first.init(init_values(), optimizer())
            with client(1) as second:
                second.init(init_values(), optimizer())
                run_workers(
                    [lambda c=c: c.push_pull(grad(c.worker_id, 0)) for c in (first, second)]
                )
            # Worker 1 left at step 1 (open: worker 0 read at it), so worker 2 joins at 2.
            with client(2) as third:
                third.init(init_values(), optimizer())
                assert third.step == 2
                first.push_pull(grad(0, 1))  # step 1 closes with worker 0 alone
                assert third.members().members == (0, 2)
                health, statuses = status_view.gather(address, timeout=5)
                table = status_view.render_table(address, statuses, health)
        assert "membership (shard 0): 3 joins, 1 leaves, 0 drops" in table, table
        assert re.search(r"^1\s+1\s+left\s+\S+ ago\s+0$", table, re.M), table
        assert re.search(r"^2\s+2\s+joined\s+\S+ ago\s+0,2$", table, re.M), table
        assert "2 (1..3)" in table, table  # live members, and the elastic bounds
        data = status_view.to_data(address, statuses, health)["shards"][0]
        assert data["elastic"] == {"min_workers": 1, "max_workers": 3}
        assert [e["kind"] for e in data["membership"]["history"]] == ["joined"] * 2 + [
            "left",
            "joined",
        ]
        samples = scrape(exporter)
        changes = "psserver_membership_changes_total"
        counted = {
            kind: value(samples, changes, shard="ps0", kind=kind) for kind in ("joined", "left")
        }
        assert counted == {"joined": 3, "left": 3}  # 1 left, then 2 and 0 closed
    finally:
        server.stop(grace=0.5)
        exporter.stop()


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(exporter) -> dict:
    url = f"http://127.0.0.1:{exporter.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
