"""Figures the tools report are true: the demo's wall time is the slowest worker's, status
says what a shard's clock counts (outer steps in a DiLoCo job), and a checkpoint file knows
when it was written."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from psctl import demo_results
from psctl.status_view import local_steps_of, render_json, render_table
from psserver.checkpoint import Checkpointer
from psserver.records import Limits
from psserver.shard import Shard
from pswire.proto import ps_pb2
from psworker.diloco import DiLoCoSettings

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


def diloco_reply(settings: DiLoCoSettings, mode: str) -> ps_pb2.StatusResponse:
    reply = status_reply(mode)
    reply.job.model_digest = "1dd2e9643d8c52fe" + settings.variant("AdamW[{lr=0.01}]")
    reply.history.add(step=12, worker_id=1, kind="left", seconds_ago=1.0)
    return reply


@pytest.mark.parametrize(
    ("settings", "mode", "shown"),
    [
        (DiLoCoSettings(local_steps=25), "sync", "diloco(H=25)"),
        (DiLoCoSettings(local_steps=5, outer_sync=False), "async", "diloco(H=5,async)"),
        (
            DiLoCoSettings(local_steps=8, outer_sync=False, dynamic_local_steps=True),
            "async",
            "diloco(H<=8,async)",
        ),
        (
            DiLoCoSettings(local_steps=10, fragments=5, overlap_steps=1, mix=0.5),
            "sync",
            "diloco(H=10,P=5)",
        ),
    ],
)
def test_status_says_a_diloco_jobs_clocks_count_outer_steps(
    settings: DiLoCoSettings, mode: str, shown: str
) -> None:
    # What the workers declare (psworker/diloco.py) is what status reads back.
    reply = diloco_reply(settings, mode)
    read = local_steps_of(reply.job.model_digest)
    assert read is not None
    assert {
        k: read[k] for k in ("local_steps", "outer_sync", "dynamic_local_steps", "fragments")
    } == {
        "local_steps": settings.local_steps,
        "outer_sync": settings.outer_sync,
        "dynamic_local_steps": settings.dynamic_local_steps,
        "fragments": settings.fragments,
    }
    table = render_table(["ps0:1"], [reply], ["SERVING"])
    assert table.splitlines()[1].split()[3] == shown
    between = settings.local_steps // settings.fragments
    said = f"H={between} inner steps" if settings.fragments == 1 else f"H/P={between} inner steps"
    assert said in table
    assert "CLOCK: outer steps" in table and "OUTER STEP  WORKER" in table
    assert "CLOCK: updates applied" not in table  # the async note would say pushes of steps
    (shard,) = json.loads(render_json(["ps0:1"], [reply]))["shards"]
    assert shard["clock_counts"] == (
        "outer steps" if settings.outer_sync else "outer steps applied (one per push)"
    )


def test_a_job_without_local_steps_has_no_diloco_settings() -> None:
    assert local_steps_of("1dd2e9643d8c52fe") is None
    assert local_steps_of("") is None
    (shard,) = json.loads(render_json(["ps0:1"], [status_reply("sync")]))["shards"]
    assert shard["diloco"] is None and shard["clock_counts"] == "steps"


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
