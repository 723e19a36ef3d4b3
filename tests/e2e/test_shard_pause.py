"""A shard paused (SIGSTOP) for longer than its heartbeat timeout in the middle of a sync job:
the job must end with exactly the weights of a run without the pause (issue 14, item 2)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from e2e_support import Lines, Processes, numpy_worker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP, /proc")

HEARTBEAT_TIMEOUT_S = 2.0
PAUSE_S = 4.0  # twice the heartbeat timeout
STEPS = 40
PAUSES_AT = (10, 25)  # worker 0's steps when the shard is stopped (twice: a second gap too)


def train(procs: Processes, tmp: Path, pause: bool, fused: bool) -> dict[str, np.ndarray]:
    """Two sync workers train STEPS steps against one daemon (paused for PAUSE_S seconds at
    each of PAUSES_AT when ``pause``); returns worker 0's final weights, checked equal to
    worker 1's."""
    tmp.mkdir()
    daemon = procs.psserver("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
    log = Lines(daemon.proc)
    # Worker 1 "computes" longer, so worker 0's push is usually waiting in the shard for it
    # when the pause begins: the case where the shard used to close the step without it.
    paces = ["0", "0.1"]
    workers = [
        numpy_worker(
            procs,
            [daemon.address],
            i,
            2,
            "--steps",
            str(STEPS),
            "--pace",
            paces[i],
            "--out",
            str(tmp / f"w{i}.npz"),
            "--timeout",
            "60",
            *(["--fused"] if fused else []),
        )
        for i in range(2)
    ]
    first = workers[0]
    for pause_at in PAUSES_AT if pause else ():
        reached = lambda at=pause_at: (first.latest("step") or 0) >= at  # noqa: E731
        first.wait_for(reached, 60, f"step {pause_at}")
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            at = first.latest("step") or 0
            time.sleep(PAUSE_S)  # the fault itself: the shard hears nothing for this long
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert at < STEPS - 5, f"a pause came too late to matter (step {at} of {STEPS})"
    for i, worker in enumerate(workers):
        code = worker.proc.wait(timeout=120)
        assert code == 0, f"worker {i} exited {code}:\n{worker.text()}\nshard:\n{log.text()}"
        assert worker.latest("done") == STEPS, worker.text()
    finals = [dict(np.load(tmp / f"w{i}.npz")) for i in range(2)]
    for name in finals[0]:
        assert finals[0][name].tobytes() == finals[1][name].tobytes(), name
    return finals[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fused", [False, True], ids=["pull-push", "push-pull-stream"])
def test_shard_paused_past_heartbeat_timeout_leaves_the_model_bit_identical(
    procs: Processes, tmp_path: Path, fused: bool
) -> None:
    clean = train(procs, tmp_path / "clean", pause=False, fused=fused)
    paused = train(procs, tmp_path / "paused", pause=True, fused=fused)
    assert clean.keys() == paused.keys()
    differ = [k for k in clean if clean[k].tobytes() != paused[k].tobytes()]
    assert not differ, {
        k: float(np.abs(clean[k].astype(np.float64) - paused[k]).max()) for k in differ
    }
