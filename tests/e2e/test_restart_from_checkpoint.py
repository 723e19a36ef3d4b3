"""Restarting a job from its shards' checkpoints, as the README tells a user to: with a smaller
learning rate (the answer to StepRefusedError), told the step it resumes at, or started fresh
on the same folder with the old checkpoints kept aside (real daemons, real worker processes)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from e2e_support import Processes, child_env

WORKER = """
import json, sys
import numpy as np
import psworker
address, lr, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
with psworker.connect([address], worker_id=0, num_workers=1, mode="sync") as client:
    client.init({"w": np.zeros(3, np.float32)}, psworker.SGD(lr=lr))
    start, epoch = client.step, psworker.start_epoch(client, 2)
    for _ in range(steps):
        client.push({"w": np.ones(3, np.float32)})
    w = client.pull()["w"]
print(json.dumps({"start": start, "w": w.tolist(), "epoch": epoch}))
"""


def train(procs: Processes, address: str, lr: float, steps: int) -> tuple[dict, str]:
    args = [sys.executable, "-c", WORKER, address, str(lr), str(steps)]
    code, out = procs.run(args, timeout=60)
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1]), out


def stop(daemon_proc) -> str:
    daemon_proc.send_signal(signal.SIGTERM)
    out, _ = daemon_proc.communicate(timeout=30)
    assert daemon_proc.returncode == 0, out
    return out


@pytest.mark.timeout(120)
def test_a_restart_from_the_checkpoint_with_a_smaller_lr_is_accepted(
    procs: Processes, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpt"
    env = child_env()
    daemon = procs.psserver("--checkpoint-dir", str(folder), env=env)
    first, _ = train(procs, daemon.address, 1.0, 3)
    assert first["w"] == [-3.0] * 3
    stop(daemon.proc)  # SIGTERM saves the checkpoint at step 3
    daemon = procs.psserver("--checkpoint-dir", str(folder), env=env)
    again, out = train(procs, daemon.address, 0.25, 1)
    assert "ModelMismatchError" not in out, out
    # Resumed at the checkpoint's step, and the new lr applied to the next step.
    assert again["start"] == 3 and again["w"] == [-3.25] * 3, again
    assert "worker 0 joins job" in out and "already at step 3" in out, out
    assert again["epoch"] == 1  # start_epoch(client, 2) at step 3
