"""``psctl dashboard``'s ``Sampler`` on a real shard: it reads a DiLoCo job's settings from the
shard's Status (its clocks count outer steps), holds a live worker's newest report between
its lines (they come at most once a second, in DiLoCo once an outer step) and stops holding
when the worker leaves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import psworker
from psctl.dashboard import DashboardSources, Sampler


def write(folder: Path, **line: object) -> None:
    with (folder / "worker0.jsonl").open("a") as f:
        f.write(json.dumps({"worker": 0, **line}) + "\n")


def test_a_live_workers_newest_report_holds_until_it_leaves(shards, tmp_path: Path) -> None:
    (server,) = shards(1)
    reports = tmp_path / "reports"
    reports.mkdir()
    now = iter(range(100, 200))
    sampler = Sampler(DashboardSources((server.address,), reports=reports), clock=lambda: next(now))
    client = psworker.connect(
        [server.address], worker_id=0, num_workers=1, mode="diloco", local_steps=5
    )
    client.declare("SGD[{lr=0.1}]")
    client.init({"w": np.zeros(2, np.float32)})
    client.push_pull({"w": np.ones(2, np.float32)})  # its first outer step
    try:
        write(reports, t=10.0, step=5, loss=2.0, rss=1024.0)
        first = sampler.sample()
        assert first.shards[0]["diloco"]["local_steps"] == 5
        assert first.workers[0] == {
            "clock": 1, "staleness": 0, "live": True, "loss": 2.0, "rss": 1024.0,
        }  # fmt: skip
        assert sampler.sample().workers[0]["loss"] == 2.0  # no new line: the last one holds
        # A line of another writer's, with text and a bool: left out, nothing else changes.
        write(reports, t="soon", step="x", loss="low", rss=True)
        assert sampler.sample().workers[0]["loss"] == 2.0
        write(reports, t=12.0, step=15, loss=1.0)
        assert sampler.sample().workers[0]["loss"] == 1.0
        row = sampler.series()["workers"][0]
        assert (row["step"], row["steps_per_s"], row["clock"]) == (15, 5.0, 1)
    finally:
        client.close()
    gone = sampler.sample()
    assert gone.workers[0]["live"] is False and "loss" not in gone.workers[0]
    write(reports, t=14.0, step=16, loss=0.5)  # a line after it left shows once
    assert sampler.sample().workers[0]["loss"] == 0.5
    assert "loss" not in sampler.sample().workers[0]
    data = sampler.series()
    assert data["step_unit"] == "outer steps"
    assert [e["text"] for e in data["events"]] == ["worker 0 left at outer step 1"]
    assert data["workers"][0]["loss"] == 0.5  # the table keeps its last report
