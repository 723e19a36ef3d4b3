"""A shard paused (SIGSTOP) for longer than its heartbeat timeout in the middle of a sync job:
the job must end with exactly the weights of a run without the pause (issue 14, item 2)."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from e2e_support import Lines, Processes, numpy_worker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP, /proc")

HEARTBEAT_TIMEOUT_S = 2.0
PAUSE_S = 4.0  # twice the heartbeat timeout
STEPS = 40
PAUSES_AT = (10, 25)  # worker 0's steps when the shard is stopped (twice: a second gap too)


# Worker 1 "computes" longer, so worker 0's push is usually waiting in the shard for it when
# a pause begins: the case where the shard used to close the step without it.
PACES = ("0", "0.1")


def train(
    procs: Processes,
    tmp: Path,
    pauses: Sequence[tuple[int, float]] = (),
    delay: float = 0.0,
    fused: bool = False,
    steps: int = STEPS,
    worker_flags: Sequence[Sequence[str]] = (("--pace", PACES[0]), ("--pace", PACES[1])),
) -> dict[str, np.ndarray]:
    """Two sync workers train ``steps`` steps against one daemon, stopped (SIGSTOP) for s
    seconds ``delay`` seconds after worker 0 reaches step n, for each (n, s) of ``pauses``;
    returns worker 0's final weights, checked equal to worker 1's."""
    tmp.mkdir()
    daemon = procs.psserver("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
    log = Lines(daemon.proc)
    workers = [
        numpy_worker(
            procs,
            [daemon.address],
            i,
            2,
            *("--steps", str(steps), "--out", str(tmp / f"w{i}.npz"), "--timeout", "60"),
            *(["--fused"] if fused else []),
            *flags,
        )
        for i, flags in enumerate(worker_flags)
    ]
    first = workers[0]
    paused_at = []
    for pause_at, seconds in pauses:
        reached = lambda at=pause_at: (first.latest("step") or 0) >= at  # noqa: E731
        first.wait_for(reached, 60, f"step {pause_at}")
        time.sleep(delay)  # where in worker 1's step the pause falls
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            paused_at.append(first.latest("step") or 0)
            time.sleep(seconds)  # the fault itself: the shard hears nothing for this long
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
    for i, worker in enumerate(workers):
        code = worker.proc.wait(timeout=120)
        assert code == 0, f"worker {i} exited {code}:\n{worker.text()}\nshard:\n{log.text()}"
        assert worker.latest("done") == steps, worker.text()
    # Each pause fell well inside the run (else it would show nothing).
    assert all(at < steps - 5 for at in paused_at), (paused_at, steps)
    finals = [dict(np.load(tmp / f"w{i}.npz")) for i in range(2)]
    for name in finals[0]:
        assert finals[0][name].tobytes() == finals[1][name].tobytes(), name
    return finals[0]


def assert_same(clean: dict[str, np.ndarray], faulty: dict[str, np.ndarray]) -> None:
    assert clean.keys() == faulty.keys()
    differ = [k for k in clean if clean[k].tobytes() != faulty[k].tobytes()]
    assert not differ, {
        k: float(np.abs(clean[k].astype(np.float64) - faulty[k]).max()) for k in differ
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fused", [False, True], ids=["pull-push", "push-pull-stream"])
def test_shard_paused_past_heartbeat_timeout_leaves_the_model_bit_identical(
    procs: Processes, tmp_path: Path, fused: bool
) -> None:
    clean = train(procs, tmp_path / "clean", fused=fused)
    pauses = [(at, PAUSE_S) for at in PAUSES_AT]
    assert_same(clean, train(procs, tmp_path / "paused", pauses, fused=fused))


# Slow (~40 s on 2 cores: repeated pauses of a real daemon). The rule it guards is also held,
# with an injected clock, by test_a_pause_just_under_the_timeout_does_not_drop_a_live_worker in
# tests/unit/test_shard_reliability.py. Run: `pytest -m slow tests/e2e/test_shard_pause.py`.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shard_paused_just_under_the_heartbeat_timeout_drops_no_live_worker(
    procs: Processes, tmp_path: Path
) -> None:
    # Worker 1 is heard every second (a step, a heartbeat), well inside the 2 s timeout;
    # worker 0 waits in the shard for it, heartbeating often. Each pause (0.8 of the timeout)
    # begins 0.7 s into worker 1's step: its silence as the shard counts it is then 2.3 s.
    flags = (("--pace", "0", "--heartbeat", "0.1"), ("--pace", "1.0", "--heartbeat", "1.0"))
    clean = train(procs, tmp_path / "clean", steps=14, worker_flags=flags)
    pauses = [(at, 0.8 * HEARTBEAT_TIMEOUT_S) for at in (2, 5, 8)]
    paused = train(procs, tmp_path / "paused", pauses, 0.7, steps=14, worker_flags=flags)
    assert_same(clean, paused)
