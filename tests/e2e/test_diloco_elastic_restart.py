"""kill -9 of a DiLoCo worker of an elastic job (synchronous outer steps, 1 to 2 workers, 2
real shard daemons): the shards drop it and the other worker trains on alone; restarted with
the same command and its state folder, it rejoins at the outer step the job is at, sets its
now stale state aside (saying so) and trains from the job's weights to the end, as any
joining worker. Without that it stopped with a ConfigError (its state was outer steps behind
the step it joined at)."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from e2e_support import Lines, Processes

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(240)
WORKER = str(Path(__file__).with_name("diloco_worker.py"))
STEPS, H, TRAINED = 40, 2, 4  # the victim dies 2 outer steps after it joined


def start(procs: Processes, addresses: list[str], worker: int, out: Path, *flags: str) -> Lines:
    args = [sys.executable, WORKER, "--addresses", ",".join(addresses), "--out", str(out)]
    args += ["--worker", str(worker), "--workers", "2", "--steps", str(STEPS)]
    return Lines(procs.start([*args, "--local-steps", str(H), "--elastic", "1:2", *flags]))


def test_a_diloco_worker_of_an_elastic_job_killed_and_restarted_rejoins_from_the_jobs_weights(
    procs: Processes, tmp_path: Path
) -> None:
    addresses = [procs.psserver("--heartbeat-timeout", "2").address for _ in range(2)]
    states = ("--state-dir", str(tmp_path / "states"))
    outs = [tmp_path / f"run{w}.npz" for w in range(2)]
    steady = start(procs, addresses, 0, outs[0], "--pace", "0.25", *states)
    # Worker 0 may train alone a while first (the job's minimum is 1): the victim joins at
    # the job's step and dies TRAINED steps later, its state written at each outer step.
    victim = start(
        procs, addresses, 1, tmp_path / "victim.npz", *states, "--stall-after", str(TRAINED)
    )
    victim.wait_for(lambda: victim.latest("stalled") is not None, 120, "the stall")
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=10)
    killed_at = victim.latest("stalled")
    assert killed_at is not None and (tmp_path / "states" / "diloco-worker-1.pt").exists()
    # Dropped after the heartbeat timeout, the other trains on alone: two outer steps past.
    steady.wait_for(lambda: (steady.latest("step") or 0) >= killed_at + 2 * H, 120, "steps alone")
    again = start(procs, addresses, 1, outs[1], *states)
    final = [steady.finish(outs[0], 180), again.finish(outs[1], 180)]
    text = again.text(10**6)
    said = re.search(
        r"at outer step (\d+); its DiLoCo state from outer step (\d+) is set aside", text
    )
    assert said is not None, text
    joined_outer, state_outer = int(said[1]), int(said[2])
    assert state_outer == killed_at // H and joined_outer > state_outer, text
    assert again.latest("ready") == joined_outer * H, text  # the job's step, not its state's
    for w, got in enumerate(final):
        # The last outer step loaded the job's weights into each worker's model.
        model = {k[len("model/") :]: v for k, v in got.items() if k.startswith("model/")}
        job = {k[len("job/") :]: v for k, v in got.items() if k.startswith("job/")}
        assert all(np.array_equal(model[k], job[k]) for k in model), f"worker {w}"
