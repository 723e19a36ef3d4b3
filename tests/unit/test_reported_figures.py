"""Figures the tools report are true: the demo's wall time is the slowest worker's, status
says what a shard's clock counts, and a checkpoint file knows when it was written."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from psctl import demo_results
from psctl.status_view import render_json, render_table
from psserver.checkpoint import Checkpointer
from psserver.records import Limits
from psserver.shard import Shard
from pswire.proto import ps_pb2

METRICS = {
    "mode": "sync",
    "workers": 2,
    "epochs": 1,
    "steps_per_worker": 23,
    "accuracy": 0.9,
    "held_out": 360,
    "wall_s": 3.0,  # worker 0's own
    "samples": 1440,
    "samples_per_s": 480.0,
}


def test_demo_summary_reports_the_slowest_workers_wall_time(tmp_path: Path) -> None:
    for worker, wall in enumerate([3.0, 33.0]):
        demo_results.write_losses(tmp_path, worker, "sync", [1.0, 0.5], wall)
    walls = demo_results.read_walls(tmp_path, 2)
    assert walls == [3.0, 33.0]
    text = demo_results.summary(METRICS, walls, 2, 40.0, tmp_path, tmp_path / "loss.png")
    assert "training wall time 33.00s (worker 1, the slowest; fastest 3.00s)" in text
    assert "throughput         44 samples/s (1440 samples, all workers)" in text  # 1440/33


def status_reply(mode: str) -> ps_pb2.StatusResponse:
    job = ps_pb2.JobSpec(mode=mode, num_workers=2)
    job.optimizer.name = "sgd"
    reply = ps_pb2.StatusResponse(initialized=True, job=job, clock=14, checkpoint_step=-1)
    reply.live_workers.extend([0, 1])
    for worker, clock in ((0, 7), (1, 7)):
        reply.workers.add(worker_id=worker, clock=clock)
    return reply


def test_status_says_what_an_async_shards_clock_counts() -> None:
    table = render_table(["ps0:1"], [status_reply("async")], ["SERVING"])
    assert "CLOCK: updates applied; in async and ssp one per push" in table
    (shard,) = json.loads(render_json(["ps0:1"], [status_reply("ssp")]))["shards"]
    assert (shard["clock"], shard["clock_counts"]) == (14, "pushes applied")
    sync = render_table(["ps0:1"], [status_reply("sync")], ["SERVING"])
    assert "CLOCK: updates applied" not in sync
    (shard,) = json.loads(render_json(["ps0:1"], [status_reply("sync")]))["shards"]
    assert shard["clock_counts"] == "steps"


def test_a_checkpoint_records_when_it_was_written(tmp_path: Path) -> None:
    shard = Shard(Limits(max_wait_s=5))
    job = Job("sync", 0, 1, SGD(lr=0.1), (VarSpec("w", (3,), "float32"),), "digest")
    shard.init(0, job, {"w": np.zeros(3, np.float32)})
    state = shard.export_state()
    assert state is not None
    before = time.time()
    Checkpointer(tmp_path).save(state, incarnation=shard.incarnation)
    after = time.time()
    loaded = Checkpointer(tmp_path).load_latest()
    assert loaded is not None and loaded.saved_at is not None
    assert before <= loaded.saved_at <= after
