"""Where overlap meets recovery: a shard killed (-9) in the middle of a sync job whose workers
overlap (pushes streamed from backward, replies predicted ahead), restarted from its last
periodic checkpoint; the workers replay what it lost and the job ends bit-identical to the
fault-free run, with no deadline waited out."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from e2e_support import OVERLAP_WORKER, Daemon, Lines, Processes, pipelined_replies

from psworker.link import shard_status

pytestmark = pytest.mark.timeout(240)

STEPS, EVERY, KILL_AT = 30, 10, 17  # the kill loses the steps since the checkpoint at 10
TIMEOUT_S = 20  # each worker call's deadline: a recovery that deadlocks fails after this


def start_shard(procs: Processes, folder: Path, *flags: str) -> tuple[Daemon, int | None]:
    """A shard checkpointing into ``folder`` every EVERY steps, and its metrics port (None:
    ``flags`` name the port, as a restart on the old one does)."""
    ckpt = ["--checkpoint-dir", str(folder), "--checkpoint-every-steps", str(EVERY)]
    if flags:
        return procs.psserver(*ckpt, *flags), None
    return procs.metered_psserver(*ckpt)


def job(procs: Processes, tmp: Path, kill: bool) -> tuple[dict[str, np.ndarray], str, float]:
    """Two overlap workers, two shards; with ``kill``, shard 0 is killed once worker 0 has
    done KILL_AT steps and started again on its port. Returns the final weights (both
    workers', checked equal), the workers' output and the seconds from the kill to the end."""
    tmp.mkdir()
    shards = [start_shard(procs, tmp / f"ckpt{i}") for i in range(2)]
    addresses = [d.address for d, _ in shards]

    def worker(i: int) -> Lines:
        args = [sys.executable, OVERLAP_WORKER, "--addresses", ",".join(addresses)]
        args += ["--workers", "2", "--worker-id", str(i), "--steps", str(STEPS)]
        args += ["--timeout", str(TIMEOUT_S), "--out", str(tmp / f"w{i}.npz")]
        return Lines(procs.start(args))

    workers = [worker(0), worker(1)]
    killed_at = time.monotonic()
    if kill:
        lead, (victim, _) = workers[0], shards[0]
        lead.wait_for(lambda: (lead.latest("step") or 0) >= KILL_AT, 120, f"step {KILL_AT}")
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        killed_at = time.monotonic()
        assert (lead.latest("done") or 0) < STEPS, "the kill came after the job ended"
        start_shard(procs, tmp / "ckpt0", "--port", str(victim.port))
    for w in workers:
        w.wait_for(lambda w=w: w.proc.poll() is not None, 120, "the worker's exit")
        assert w.proc.returncode == 0 and w.latest("done") == STEPS, w.text()
    after = time.monotonic() - killed_at
    assert [s.clock for s in shard_status(addresses)] == [STEPS, STEPS]
    finals = [dict(np.load(tmp / f"w{i}.npz")) for i in range(2)]
    for name, value in finals[0].items():
        assert finals[1][name].tobytes() == value.tobytes(), name
    # The surviving shard answered with predictions confirmed on most steps: overlap ran.
    _, metrics_port = shards[1]
    held = pipelined_replies([f"http://127.0.0.1:{metrics_port}/metrics"], "held")
    assert held >= STEPS, held
    return finals[0], "\n".join(w.text(100_000) for w in workers), after


def test_a_shard_killed_under_overlap_restarts_and_the_job_ends_bit_identical(
    procs: Processes, tmp_path: Path
) -> None:
    clean, _, _ = job(procs, tmp_path / "clean", kill=False)
    faulty, text, after_kill = job(procs, tmp_path / "killed", kill=True)
    assert sorted(faulty) == sorted(clean)
    for name, value in clean.items():
        assert faulty[name].tobytes() == value.tobytes(), f"{name} differs from the clean run"
    assert "replaying" in text, text[-3000:]  # the restart lost steps; the workers re-sent them
    assert "WaitTimeout" not in text and "no answer within" not in text
    assert after_kill < TIMEOUT_S, after_kill
