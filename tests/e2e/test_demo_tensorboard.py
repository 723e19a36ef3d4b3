"""``psctl demo`` writes a TensorBoard event file per worker, which TensorBoard's own reader
reads back: the loss the workers reported, and each step's time, bytes and staleness."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from e2e_support import Processes

pytest.importorskip("torch")
pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)

TAGS = {
    "loss",
    "psworker/step_time_s",
    "psworker/bytes_sent",
    "psworker/bytes_received",
    "psworker/staleness_steps",
}


@pytest.mark.timeout(150)
def test_the_demo_writes_event_files_tensorboard_reads_back(
    procs: Processes, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = [sys.executable, "-m", "psctl.main", "demo", "--epochs", "1", "--out", str(out)]
    code, text = procs.run([*args, "--timeout", "120"], timeout=140)
    assert code == 0, text
    steps = json.loads((out / "metrics.json").read_text())["steps_per_worker"]
    for worker in (0, 1):
        folder = out / "tensorboard" / f"worker{worker}"
        assert len(list(folder.glob("events.out.tfevents.*"))) == 1
        events = EventAccumulator(str(folder))
        events.Reload()
        assert set(events.Tags()["scalars"]) == TAGS
        for tag in TAGS:
            assert len(events.Scalars(tag)) == steps, tag
        history = json.loads((out / f"loss-worker{worker}.json").read_text())["loss"]
        logged = [e.value for e in events.Scalars("loss")]
        assert logged == pytest.approx(history, rel=1e-6)  # the losses the worker saw
        assert all(e.value > 0 for e in events.Scalars("psworker/bytes_sent"))
        # sync: a worker reads the shards' clocks when its step closed, when the other may
        # have pushed its next step already, never more.
        assert {e.value for e in events.Scalars("psworker/staleness_steps")} <= {0.0, 1.0}
