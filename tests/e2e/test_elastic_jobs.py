"""Elastic jobs as real processes: workers launched by torchrun and by Slurm's variables grow a
running sync job from 2 to 3 and shrink it back (a clean leave), nobody restarting, to the
single-process reference's weights; ``psctl local --elastic`` trains the digits example while a
worker is added and one is killed, to the accuracy of a fixed-size run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from e2e_support import Processes, child_env

HERE = Path(__file__).resolve().parent
JOB = HERE / "elastic_job.py"
sys.path.insert(0, str(HERE))
import elastic_job  # noqa: E402

PSCTL = [sys.executable, "-m", "psctl.main"]
EXAMPLE = HERE.parents[1] / "examples" / "train_elastic.py"


def check_job(out: Path) -> None:
    """Every worker ran the schedule's steps and nobody restarted; the weights are the
    reference's to 1e-5."""
    expected = elastic_job.reference()
    runs = {w: json.loads((out / f"steps-{w}.json").read_text()) for w in (0, 1, 2)}
    g, s, n = elastic_job.GROW_AT, elastic_job.SHRINK_AT, elastic_job.STEPS
    assert runs[0]["steps"] == runs[1]["steps"] == list(range(n)), runs
    assert runs[2] == {"steps": list(range(g, s)), "joined_at": g}, runs
    for worker in (0, 1):
        final = np.load(out / f"final-{worker}.npz")
        for key, value in expected.items():
            np.testing.assert_allclose(final[key], value, rtol=0, atol=1e-5)
    assert not np.allclose(expected["w"], elastic_job.init_values()["w"], atol=1e-3)


def job_env(procs: Processes, **extra: str) -> dict[str, str]:
    shards = [procs.psserver("--port", "0") for _ in range(2)]
    return child_env(PS_SHARDS=",".join(s.address for s in shards), PS_ELASTIC="2:4", **extra)


def finish(proc: subprocess.Popen[str], what: str, timeout: float = 120) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what} failed:\n{out}"
    return out


@pytest.mark.timeout(240)
def test_torchrun_workers_grow_and_shrink_to_the_reference(procs: Processes, tmp_path: Path):
    env = job_env(procs)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    founders = procs.start(
        [*torchrun, "--nproc-per-node", "2", str(JOB), "--out", str(tmp_path)], env
    )
    joiner = procs.start(
        [sys.executable, str(JOB), "--out", str(tmp_path), "--join"], {**env, "PS_WORKER_ID": "2"}
    )
    finish(joiner, "the joiner")
    finish(founders, "torchrun")
    check_job(tmp_path)


@pytest.mark.timeout(240)
def test_slurm_variables_set_by_hand_grow_and_shrink_to_the_reference(
    procs: Processes, tmp_path: Path
):
    env = job_env(procs, SLURM_NODELIST="localhost", SLURM_JOB_ID="18")
    started = []
    for task, tasks, join in ((0, 2, False), (1, 2, False), (2, 3, True)):
        slurm = {"SLURM_PROCID": str(task), "SLURM_NTASKS": str(tasks)}
        args = [sys.executable, str(JOB), "--out", str(tmp_path), *(["--join"] if join else [])]
        started.append(procs.start(args, {**env, **slurm}))
    for i, proc in enumerate(started):
        finish(proc, f"task {i}")
    check_job(tmp_path)


def final_accuracy(out: str) -> float:
    found = re.findall(r"^\[worker\d\] epoch 11: .*held-out accuracy (\d\.\d+)", out, re.M)
    assert found, out
    assert len(set(found)) == 1, found  # sync: every worker holds the shards' weights
    return float(found[0])


@pytest.mark.timeout(600)
def test_example_trains_while_a_worker_is_added_and_one_killed(procs: Processes):
    env = child_env(PS_HEARTBEAT_TIMEOUT="3")
    args = [*PSCTL, "local", "--servers", "2", "--workers", "2", "--timeout", "400"]
    command = ["--", sys.executable, str(EXAMPLE), "--epochs", "12"]
    code, fixed_out = procs.run([*args, *command], timeout=420, env=env)
    assert code == 0, fixed_out
    fixed = final_accuracy(fixed_out)

    # The same run, elastic: a third worker is added after the first epoch (it joins a few
    # epochs in, once python and torch are up), and worker 1 is killed (SIGKILL, no goodbye)
    # once the third has trained an epoch. Each step is paced so both happen mid-training:
    # 12 epochs of 24 steps at 0.12 s leave the added worker ~30 s to start python and torch
    # (at 0.05 s, on a machine at load 13, the founders finished before it joined).
    paced = [*command, "--pace", "0.12"]
    proc = procs.start([*args, "--elastic", "2:4", *paced], env)
    lines: list[str] = []
    pids: dict[str, int] = {}
    events: list[str] = []

    def react(line: str) -> None:
        started = re.match(r"\[psctl\] (worker\d) started \(pid (\d+)\)", line)
        if started:
            pids[started[1]] = int(started[2])
            procs.adopt(int(started[2]), EXAMPLE.name)
        if line.startswith("[worker0] epoch 0:") and not events:
            added = subprocess.run(
                [*PSCTL, "local", "add"], env=env, capture_output=True, text=True, timeout=60
            )
            events.append(f"add: {added.returncode} {added.stdout.strip()}")
        if line.startswith("[worker2] epoch") and len(events) == 1:
            events.append("kill worker1")
            os.kill(pids["worker1"], signal.SIGKILL)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            react(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.wait(timeout=450)
    reader.join(10)
    out = "".join(lines)
    print(out)  # the closing note quotes it
    assert proc.returncode == 0, out
    assert events == [f"add: 0 worker2 started (pid {pids['worker2']})", "kill worker1"], out
    assert "[psctl] worker1 failed with signal SIGKILL; the elastic job goes on" in out
    assert re.search(r"^\[worker2\] epoch \d+: .*split among workers \[0, 1, 2\]", out, re.M)
    assert re.search(r"^\[worker0\] epoch 11: .*split among workers \[0, 2\]", out, re.M)
    elastic = final_accuracy(out)
    print(f"held-out accuracy: fixed 2 workers {fixed:.4f}, elastic {elastic:.4f}")
    # The held-out set is 297 images: 0.01 is 3 of them. Adding a worker and losing one
    # changes which samples each step sees, and when depends on timing, so the elastic run
    # may land 3-4 images below (0.0101 was seen) and be right; a job that lost updates or
    # trained on a stale model lands far lower.
    assert elastic >= fixed - 0.02, (fixed, elastic)
