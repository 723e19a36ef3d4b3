"""Restarting a job from its shards' checkpoints, as the README tells a user to: with a smaller
learning rate (the answer to StepRefusedError), told the step it resumes at, or started fresh
on the same folder with the old checkpoints kept aside (real daemons, real worker processes)."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
from e2e_support import Processes, child_env, numpy_worker

from psworker.link import shard_status

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


def checkpoint_steps(folder: Path) -> list[int]:
    return sorted(int(p.name[5:-12]) for p in folder.glob("ckpt-*.safetensors"))


@pytest.mark.timeout(150)
def test_two_shards_checkpoint_the_same_steps_and_a_restore_keeps_left_workers_left(
    procs: Processes, tmp_path: Path
) -> None:
    folders = [tmp_path / "ps0", tmp_path / "ps1"]
    flags = ["--checkpoint-every-steps", "5", "--keep-checkpoints", "20"]
    daemons = [procs.psserver("--checkpoint-dir", str(f), *flags) for f in folders]
    addresses = [d.address for d in daemons]
    workers = [
        numpy_worker(procs, addresses, w, 2, "--steps", "23", "--fused", "--pieces", "4")
        for w in range(2)
    ]
    for lines in workers:  # both finished and closed their clients: they left the job
        lines.wait_for(lambda lines=lines: lines.latest("done") == 23, 90, "done line")
    for folder in folders:
        deadline = time.monotonic() + 20
        while 20 not in checkpoint_steps(folder) and time.monotonic() < deadline:
            time.sleep(0.1)
    for d in daemons:
        stop(d.proc)  # the final checkpoint, at 23
    saved = [checkpoint_steps(f) for f in folders]
    for steps in saved:
        periodic = steps[:-1]
        assert steps[-1] == 23 and periodic and all(s % 5 == 0 for s in periodic), saved
        assert periodic[-1] == 20, saved
    daemons = [procs.psserver("--checkpoint-dir", str(f), *flags) for f in folders]
    for st in shard_status([d.address for d in daemons], 10.0):
        assert st.clock == 23
        assert list(st.live_workers) == [] and list(st.left_workers) == [0, 1], st
    code, out = procs.run(
        [sys.executable, "-m", "psctl", "status", "--json", *[d.address for d in daemons]],
        timeout=30,
    )
    assert code == 0, out
    workers = json.loads(out)["workers"]
    assert [w["worker_id"] for w in workers] == [0, 1], out
    assert all(w["left"] and not w["live"] for w in workers), out


@pytest.mark.timeout(120)
def test_psserver_fresh_starts_a_new_job_and_keeps_the_old_checkpoints_aside(
    procs: Processes, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpt"
    daemon = procs.psserver("--checkpoint-dir", str(folder))
    train(procs, daemon.address, 1.0, 3)
    stop(daemon.proc)
    old = checkpoint_steps(folder)
    assert old == [0, 3]  # the initial values (saved at init) and the state at close
    daemon = procs.psserver("--checkpoint-dir", str(folder), "--fresh")
    again, out = train(procs, daemon.address, 1.0, 1)
    assert again["start"] == 0 and again["w"] == [-1.0] * 3, again  # a new job from step 0
    assert "already at step" not in out
    log = stop(daemon.proc)
    assert "--fresh: the checkpoints in" in log and "(kept, not deleted)" in log, log
    (aside,) = folder.glob("before-fresh-*")
    assert checkpoint_steps(aside) == old  # moved, not deleted
    assert checkpoint_steps(folder) == [0, 1]  # the new job's own (at init, at close)


JOB = """
import json
import numpy as np
import psworker
with psworker.connect() as client:
    client.init({"w": np.zeros(3, np.float32)}, psworker.SGD(lr=1.0))
    start = client.step
    for _ in range(2):
        client.push({"w": np.ones(3, np.float32)})
print(json.dumps({"start": start}))
"""


@pytest.mark.timeout(150)
def test_psctl_local_resumes_by_default_and_starts_over_with_fresh(
    procs: Processes, tmp_path: Path
) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = child_env(PS_CHECKPOINT_DIR=str(tmp_path / "ckpt"))

    def run(*flags: str) -> tuple[int, str]:
        args = [sys.executable, "-m", "psctl", "local", *flags, "--", sys.executable, str(script)]
        code, out = procs.run(args, timeout=60, env=env)
        assert code == 0, out
        line = next(x for x in out.splitlines() if '{"start"' in x)
        return json.loads(line[line.index("{") :])["start"], out

    assert run()[0] == 0
    start, out = run()  # the same folder: the job resumes, and the worker says so
    assert start == 2 and "already at step 2" in out, out
    start, out = run("--fresh")
    assert start == 0 and "already at step" not in out, out
    assert len(list((tmp_path / "ckpt" / "ps0").glob("before-fresh-*"))) == 1
