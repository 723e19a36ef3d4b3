"""Prometheus metrics scraped over HTTP from live shards while workers train through them."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import psworker
from psserver.metrics import OTHER_GROUP, MetricsServer, ShardMetrics, variable_group
from psserver.server import RunningServer, start_server
from psserver.shard import Shard
from pswire.channel import insecure_channel
from pswire.proto import ps_pb2, ps_pb2_grpc

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
MODEL = {
    "fc.weight": np.zeros((64, 32), np.float32),
    "fc.bias": np.zeros(32, np.float32),
    "emb.weight": np.zeros((100, 16), np.float32),
}


@pytest.fixture
def metered() -> Iterator[Callable[[int], list[tuple[RunningServer, MetricsServer]]]]:
    """Factory: n shards, each with metrics served over HTTP on a free port."""
    started: list[tuple[RunningServer, MetricsServer]] = []

    def make(n: int) -> list[tuple[RunningServer, MetricsServer]]:
        for i in range(n):
            shard = Shard()
            metrics = ShardMetrics(shard, f"ps{i}")
            started.append((start_server(shard, metrics=metrics), metrics.serve("127.0.0.1", 0)))
        return started

    yield make
    for server, exporter in started:
        server.stop(grace=0.5)
        exporter.stop()


def scrape(exporter: MetricsServer) -> Samples:
    """Every sample at ``/metrics``, keyed by (name, labels)."""
    url = f"http://127.0.0.1:{exporter.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def train(client: Any, steps: int) -> None:
    for _ in range(steps):
        client.pull()
        client.push({k: np.ones_like(v) for k, v in MODEL.items()})


@pytest.mark.timeout(60)
def test_counters_move_and_staleness_is_reported_during_training(metered) -> None:
    (s0, m0), (s1, m1) = metered(2)
    addresses = [s0.address, s1.address]
    clients = [
        psworker.connect(addresses, worker_id=w, num_workers=2, mode="ssp", staleness=3)
        for w in range(2)
    ]
    try:
        for c in clients:
            c.init(MODEL, optimizer=psworker.SGD(lr=0.01))
        # Worker 0 runs ahead while worker 1 has done one step: staleness 3 allows that.
        train(clients[0], 4)
        train(clients[1], 1)
        during = [scrape(m0), scrape(m1)]
        # The rest of training: worker 1 catches up while worker 0 goes on.
        threads = [
            threading.Thread(target=train, args=(c, n))
            for c, n in ((clients[0], 2), (clients[1], 5))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        after = [scrape(m0), scrape(m1)]
    finally:
        for c in clients:
            c.close()

    for shard, (mid, end) in enumerate(zip(during, after, strict=True)):
        name = f"ps{shard}"
        # Per-worker clocks and the observed staleness (newest clock minus the worker's).
        assert value(mid, "psserver_worker_clock", shard=name, worker="0") == 4
        assert value(mid, "psserver_worker_clock", shard=name, worker="1") == 1
        assert value(mid, "psserver_worker_staleness_steps", shard=name, worker="1") == 3
        assert value(mid, "psserver_worker_staleness_steps", shard=name, worker="0") == 0
        assert value(mid, "psserver_max_staleness_steps", shard=name) == 3
        assert value(mid, "psserver_live_workers", shard=name) == 2
        assert value(end, "psserver_worker_clock", shard=name, worker="1") == 6
        assert value(end, "psserver_worker_staleness_steps", shard=name, worker="1") == 0
        # Counters only grow, and they grew with the 7 further pushes and pulls.
        mid_pushes = value(mid, "psserver_push_results_total", shard=name, result="applied")
        end_pushes = value(end, "psserver_push_results_total", shard=name, result="applied")
        assert (mid_pushes, end_pushes) == (5, 12)
        assert value(end, "psserver_rpc_duration_seconds_count", shard=name, rpc="Pull") == (
            value(mid, "psserver_rpc_duration_seconds_count", shard=name, rpc="Pull") + 7
        )
        assert value(end, "psserver_rpcs_total", shard=name, rpc="Push", code="OK") == 12
        assert value(end, "psserver_barrier_wait_seconds_count", shard=name, rpc="Pull") == 12
    assert value(during[0], "psserver_initialized", shard="ps0") == 1

    # Traffic by variable group, summed over the shards, counts every byte pushed and pulled.
    pushed: dict[str, float] = {}
    pulled: dict[str, float] = {}
    requests: dict[str, float] = {}
    for samples in after:
        for (metric, labels), v in samples.items():
            for name, totals in (
                ("psserver_push_bytes_total", pushed),
                ("psserver_pull_bytes_total", pulled),
                ("psserver_pushes_total", requests),
            ):
                if metric == name:
                    group = dict(labels)["group"]
                    totals[group] = totals.get(group, 0.0) + v
    fc_bytes = (MODEL["fc.weight"].nbytes + MODEL["fc.bias"].nbytes) * 12
    emb_bytes = MODEL["emb.weight"].nbytes * 12
    assert pushed == pulled == {"fc": fc_bytes, "emb": emb_bytes}
    # 12 pushes carried each group, counted once per request on each shard holding some of it.
    assert requests["emb"] == 12 and requests["fc"] in (12, 24)


@pytest.mark.timeout(30)
def test_failed_calls_are_counted_by_status_code(metered) -> None:
    ((server, exporter),) = metered(1)
    with psworker.connect([server.address], worker_id=0, num_workers=1, mode="async") as c:
        c.init({"w": np.zeros(4, np.float32)}, optimizer=psworker.SGD(lr=0.1))
    # A raw stub: the client would refuse an unknown name before sending it.
    with insecure_channel(server.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            list(stub.Pull(ps_pb2.PullRequest(worker_id=0, step=0, names=["nope"]), timeout=5))
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    samples = scrape(exporter)
    assert value(samples, "psserver_rpcs_total", shard="ps0", rpc="Pull", code="NOT_FOUND") == 1
    assert value(samples, "psserver_rpcs_total", shard="ps0", rpc="Init", code="OK") == 1
    assert value(samples, "psserver_checkpoint_step", shard="ps0") == -1
    # No checkpoint yet: the age is absent rather than a made-up number.
    assert not [k for k in samples if k[0] == "psserver_checkpoint_age_seconds"]


def test_two_shards_in_one_process_keep_separate_registries() -> None:
    a, b = ShardMetrics(Shard(), "a"), ShardMetrics(Shard(), "b")
    a.pushed({"fc.w": np.zeros(4, np.float32)})
    assert a.registry.get_sample_value("psserver_push_bytes_total", {"shard": "a", "group": "fc"})
    assert (
        b.registry.get_sample_value("psserver_push_bytes_total", {"shard": "a", "group": "fc"})
        is None
    )


def test_variable_groups_are_first_path_components_and_bounded() -> None:
    assert variable_group("features.0.weight") == "features"
    assert variable_group("emb.weight/part1of4") == "emb"
    assert variable_group("buffer:bn1.running_mean") == "bn1"
    assert variable_group("w") == "w"
    metrics = ShardMetrics(Shard(), "s")
    groups = {metrics.group(f"layer{i}.weight") for i in range(200)}
    assert OTHER_GROUP in groups and len(groups) <= 65
    assert metrics.group("layer0.bias") == "layer0"  # a known group stays itself


@pytest.mark.timeout(30)
def test_table_rows_bytes_and_evictions_are_exported(metered) -> None:
    ((server, exporter),) = metered(1)
    table = psworker.Table(None, 4, capacity=3)
    with psworker.connect([server.address], worker_id=0, num_workers=1, mode="async") as c:
        c.init({}, optimizer=psworker.Adagrad(lr=0.1), tables={"item": table})
        c.pull_rows("item", [1, 2, 3])
        c.push({"item": psworker.RowSparse([4, 5], np.ones((2, 4), np.float32))})  # evicts 2
    samples = scrape(exporter)
    labels = {"shard": "ps0", "table": "item"}
    assert value(samples, "psserver_table_rows", **labels) == 3
    assert value(samples, "psserver_table_bytes", **labels) == 3 * 4 * 4 * 2  # rows + sums
    assert value(samples, "psserver_table_evictions_total", **labels) == 2
    # Row pushes count as traffic of the table's group: 2 rows of 4 floats and their ids.
    assert value(samples, "psserver_push_bytes_total", shard="ps0", group="item") == 2 * 16 + 16
