"""A worker paused (SIGSTOP) in the middle of an overlapped step, its pushes streaming
to both shards while the other worker's replies are being predicted (``fw.PIPELINED``):

- paused for less than the shards' heartbeat timeout, the round waits for it and the job ends
  bit-identical to a run without the pause, the predictions confirmed (``held``);
- paused for longer, the shards drop it and close the round without it: the other worker's
  prediction (made for two workers) is refused, its step is answered with the round's weights
  and it trains on alone; the paused worker, resumed, fails with ``WorkerDroppedError`` naming
  the step its gradient missed, never training on with its data silently left out;
- in async, the other worker trains to its end while this one is stopped, and every push of
  both is applied once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from e2e_support import OVERLAP_WORKER, Lines, Processes, pipelined_replies

from psworker.link import shard_status

pytest.importorskip("torch")
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP"),
]
STEPS, PAUSED_AT = 8, 4


def job(
    procs: Processes,
    tmp: Path,
    pause_s: float = 0.0,
    heartbeat_s: float = 30.0,
    mode: str = "sync",
    while_paused: Callable[[list[Lines]], None] | None = None,
    killed: bool = False,
) -> tuple[list[Lines], list[str], list[str]]:
    """Two overlap workers (2 shards) until both exit; worker 0 stops itself mid-stream at
    step PAUSED_AT for ``pause_s`` seconds when that is not 0, then ``while_paused(workers)``
    runs before it is resumed; or, ``killed``, is killed (-9) there and started again.
    Returns the workers (worker 0's last start first), the shards' addresses and their
    metrics pages."""
    tmp.mkdir()
    metered = [procs.metered_psserver("--heartbeat-timeout", str(heartbeat_s)) for _ in range(2)]
    addresses = [s.address for s, _ in metered]
    ports = [port for _, port in metered]

    def start(i: int, *flags: str) -> Lines:
        args = [
            sys.executable,
            OVERLAP_WORKER,
            "--addresses",
            ",".join(addresses),
            "--workers",
            "2",
        ]
        args += ["--worker-id", str(i), "--steps", str(STEPS), "--out", str(tmp / f"w{i}.npz")]
        return Lines(procs.start([*args, "--mode", mode, "--timeout", "60", *flags]))

    fault = ["--pause-at"] if pause_s else ["--stall-at"] if killed else []
    workers = [start(0, *fault, str(PAUSED_AT)) if fault else start(0), start(1)]
    if killed:
        victim = workers[0]
        victim.wait_for(lambda: victim.latest("streaming") is not None, 120, "the stall")
        assert victim.latest("shards") == 2, victim.text()  # both shards' pushes streaming
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        workers[0] = start(0)
    if pause_s:
        paused = workers[0]
        paused.wait_for(lambda: paused.latest("pausing") is not None, 120, "the pause")
        time.sleep(pause_s)
        try:
            if while_paused is not None:
                while_paused(workers)
        finally:
            os.kill(paused.proc.pid, signal.SIGCONT)
    for w in workers:
        w.wait_for(lambda w=w: w.proc.poll() is not None, 120, "the worker's exit")
    return workers, addresses, [f"http://127.0.0.1:{p}/metrics" for p in ports]


def finished(workers: list[Lines], tmp: Path, addresses: list[str]) -> dict[str, np.ndarray]:
    """Both workers' weights, checked: every step done, on both shards, and one model."""
    for w in workers:
        assert w.proc.returncode == 0, w.text()
        assert w.latest("done") == STEPS, w.text()
    assert [s.clock for s in shard_status(addresses)] == [STEPS, STEPS]
    finals = [dict(np.load(tmp / f"w{i}.npz")) for i in range(2)]
    for name, value in finals[0].items():
        assert finals[1][name].tobytes() == value.tobytes(), name
    return finals[0]


def test_a_worker_paused_mid_stream_under_the_heartbeat_timeout_changes_nothing(
    procs: Processes, tmp_path: Path
) -> None:
    workers, addresses, _ = job(procs, tmp_path / "clean")
    clean = finished(workers, tmp_path / "clean", addresses)
    workers, addresses, metrics = job(procs, tmp_path / "paused", pause_s=4.0)
    paused = finished(workers, tmp_path / "paused", addresses)
    for name, value in clean.items():
        assert paused[name].tobytes() == value.tobytes(), name
    # The steps overlapped and the shards' predictions were confirmed, across the pause too.
    assert pipelined_replies(metrics, "held") >= 2 * 2 * (STEPS - 2)
    assert pipelined_replies(metrics, "resent") == 0


def test_a_worker_paused_mid_stream_past_the_heartbeat_timeout_is_dropped_and_told(
    procs: Processes, tmp_path: Path
) -> None:
    (paused, other), addresses, metrics = job(
        procs, tmp_path / "paused", pause_s=6.0, heartbeat_s=2.0
    )
    assert paused.proc.returncode != 0, paused.text()
    assert "WorkerDroppedError" in paused.text(), paused.text()
    assert f"push for step {PAUSED_AT} arrived after that step closed" in paused.text()
    # Its paused step() returned (an overlapped step does not wait); the error came before the
    # next forward used the weights.
    assert paused.latest("step") == PAUSED_AT + 1
    assert other.proc.returncode == 0, other.text()
    assert other.latest("done") == STEPS, other.text()
    # Every step applied once on each shard: the paused step without the dropped worker.
    status = shard_status(addresses)
    assert [s.clock for s in status] == [STEPS, STEPS]
    # The round it was predicted for (two workers) closed with one: refused, answered whole.
    assert pipelined_replies(metrics, "resent") >= 1
    assert pipelined_replies(metrics, "held") >= 2 * (STEPS - 2)


def test_a_worker_paused_mid_stream_in_async_holds_nobody_back(
    procs: Processes, tmp_path: Path
) -> None:
    def other_done(workers: list[Lines]) -> None:
        other = workers[1]
        other.wait_for(lambda: other.proc.poll() is not None, 60, "the other worker's end")

    workers, addresses, _ = job(
        procs, tmp_path / "async", pause_s=1.0, mode="async", while_paused=other_done
    )
    for w in workers:
        assert w.proc.returncode == 0, w.text()
        assert w.latest("done") == STEPS, w.text()
    # Both workers' every push applied once on each shard, the paused one's on its resume.
    assert [s.pushes_applied for s in shard_status(addresses)] == [2 * STEPS, 2 * STEPS]


def test_a_worker_killed_mid_stream_and_restarted_ends_bit_identical(
    procs: Processes, tmp_path: Path
) -> None:
    # The other worker's reply may be predicted for the round the killed one never finished;
    # the restarted one pushes that step again (a preview then fails: whose gradients went in
    # is unknown), and both are answered with the round's own weights.
    workers, addresses, _ = job(procs, tmp_path / "clean")
    clean = finished(workers, tmp_path / "clean", addresses)
    workers, addresses, _ = job(procs, tmp_path / "killed", killed=True)
    assert workers[0].latest("ready") == PAUSED_AT, workers[0].text()  # resumed at that step
    again = finished(workers, tmp_path / "killed", addresses)
    for name, value in clean.items():
        assert again[name].tobytes() == value.tobytes(), name
