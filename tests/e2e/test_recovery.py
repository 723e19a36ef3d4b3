"""Faults against real daemons: kill -9 a shard mid-training, kill a worker; the job goes on."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from e2e_support import Processes, child_env

from psctl.progress import PREFIX


class Output:
    """Drains a process's output in a thread (a full pipe would block it) and keeps it."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()

    def text(self) -> str:
        return "\n".join(self.lines)

    def progress(self) -> int:
        """The highest training step this worker has reported."""
        steps = [
            json.loads(ln[len(PREFIX) :])["step"] for ln in self.lines if ln.startswith(PREFIX)
        ]
        return max(steps, default=0)

    def wait_for(self, predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate():
                left = deadline - time.monotonic()
                assert left > 0, "timed out waiting; output so far:\n" + self.text()[-3000:]
                self.changed.wait(left)


def start_shard(procs: Processes, tmp: Path, name: str, port: int = 0) -> tuple:
    folder = tmp / name
    folder.mkdir(parents=True, exist_ok=True)
    port_file = folder / "port"
    port_file.unlink(missing_ok=True)
    flags = ["--port", str(port), "--port-file", str(port_file)]
    flags += ["--checkpoint-dir", str(folder / "ckpt"), "--checkpoint-every-steps", "10"]
    flags += ["--heartbeat-timeout", "5"]
    daemon = procs.psserver(*flags, port_file=port_file)
    return daemon, Output(daemon.proc)


def start_workers(procs: Processes, ps: list[str], out: Path, n: int = 2, epochs: int = 6):
    workers = []
    for i in range(n):
        tf_config = {"cluster": {"ps": ps, "worker": [f"w{j}:0" for j in range(n)]}}
        tf_config["task"] = {"type": "worker", "index": i}
        env = child_env(TF_CONFIG=json.dumps(tf_config), PS_MODE="sync")
        argv = [sys.executable, "-m", "psctl.demo", "--epochs", str(epochs), "--out", str(out)]
        proc = procs.start(argv, env)
        workers.append((proc, Output(proc)))
    return workers


def accuracy_of(output: Output) -> float:
    match = re.search(r"held-out accuracy (\d\.\d+)", output.text())
    assert match, output.text()[-3000:]
    return float(match.group(1))


def finish(workers, timeout: float) -> None:
    for proc, output in workers:
        code = proc.wait(timeout=timeout)
        assert code == 0, output.text()[-3000:]


@pytest.mark.timeout(240)
def test_shard_killed_mid_training_restarts_and_the_job_completes(procs: Processes, tmp_path):
    # The fault-free reference run.
    shards = [start_shard(procs, tmp_path / "clean", f"ps{i}") for i in range(2)]
    workers = start_workers(procs, [d.address for d, _ in shards], tmp_path / "out-clean")
    finish(workers, 120)
    clean = accuracy_of(workers[0][1])

    (tmp_path / "faulty").mkdir()
    shards = [start_shard(procs, tmp_path / "faulty", f"ps{i}") for i in range(2)]
    ps = [d.address for d, _ in shards]
    workers = start_workers(procs, ps, tmp_path / "out-faulty")
    leader = workers[0][1]
    leader.wait_for(lambda: leader.progress() >= 40, 120)  # the chosen step
    victim = shards[1][0]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=10)
    killed_at, killed_step = time.monotonic(), leader.progress()
    # Same address, same checkpoint folder: the workers were never restarted.
    start_shard(procs, tmp_path / "faulty", "ps1", port=victim.port)
    leader.wait_for(lambda: leader.progress() > killed_step + 10, 120)
    recovery_s = time.monotonic() - killed_at
    finish(workers, 120)
    faulty = accuracy_of(leader)
    print(
        f"clean {clean:.4f} faulty {faulty:.4f}; killed at step {killed_step}, training "
        f"moved 10 steps past it {recovery_s:.1f}s after the kill"
    )
    assert abs(faulty - clean) <= 0.01, (clean, faulty)
    assert faulty >= 0.9
    # Replayed steps reproduce the lost ones exactly: the same final model, bit for bit.
    import torch

    before = torch.load(tmp_path / "out-clean" / "model.pt", weights_only=True)
    after = torch.load(tmp_path / "out-faulty" / "model.pt", weights_only=True)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "replaying" in workers[0][1].text() + workers[1][1].text()
    assert all(w.poll() == 0 for w, _ in workers)


@pytest.mark.timeout(120)
def test_killed_worker_leaves_the_quorum_and_the_others_finish(procs: Processes, tmp_path):
    shard = procs.psserver("--heartbeat-timeout", "2", "--checkpoint-dir", str(tmp_path / "c"))
    Output(shard.proc)
    workers = start_workers(procs, [shard.address], tmp_path / "out", n=3, epochs=6)
    victim_proc, victim = workers[2]
    victim.wait_for(lambda: victim.progress() >= 5, 60)
    os.kill(victim_proc.pid, signal.SIGKILL)
    victim_proc.wait(timeout=10)
    killed_at = time.monotonic()
    survivors = workers[:2]
    target = max(o.progress() for _, o in survivors) + 5
    for _, output in survivors:
        output.wait_for(lambda o=output: o.progress() > target, 30)
    resumed_s = time.monotonic() - killed_at
    print(f"survivors resumed {resumed_s:.1f}s after the kill (heartbeat timeout 2s)")
    assert resumed_s < 15
    finish(survivors, 90)
    assert accuracy_of(survivors[0][1]) >= 0.85
