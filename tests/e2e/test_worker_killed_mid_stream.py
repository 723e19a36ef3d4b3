"""kill -9 of a worker whose pushes are streaming from backward (overlap=True, steps on the
Flight data port): no shard applies any of that step, and the worker, restarted, resumes at
that step and ends bit-identical to a run that never stopped."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from e2e_support import Lines, Processes

from psworker.link import shard_status

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(180)
WORKER = str(Path(__file__).with_name("overlap_worker.py"))
STEPS, KILLED_AT = 8, 4


def worker(procs: Processes, addresses: list[str], out: Path, *flags: str) -> Lines:
    args = [sys.executable, WORKER, "--addresses", ",".join(addresses), "--out", str(out)]
    return Lines(procs.start([*args, "--steps", str(STEPS), *flags]))


def test_a_worker_killed_mid_stream_changes_no_shard_and_resumes_at_that_step(
    procs: Processes, tmp_path: Path
) -> None:
    clean_shards = [procs.psserver() for _ in range(2)]
    clean_out = tmp_path / "clean.npz"
    clean = worker(procs, [d.address for d in clean_shards], clean_out).finish(clean_out)

    shards = [procs.psserver() for _ in range(2)]
    addresses = [d.address for d in shards]
    victim = worker(procs, addresses, tmp_path / "victim.npz", "--stall-at", str(KILLED_AT))
    victim.wait_for(lambda: victim.latest("streaming") is not None, 120, "the stall")
    assert victim.latest("shards") == 2, victim.text()  # both shards' pushes were streaming
    before = [(s.clock, s.pushes_applied) for s in shard_status(addresses)]
    assert before == [(KILLED_AT, KILLED_AT)] * 2
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=10)

    out = tmp_path / "restarted.npz"
    again = worker(procs, addresses, out)
    again.wait_for(lambda: again.latest("ready") is not None, 60, "the restart")
    # The shards never had step KILLED_AT whole: the restarted worker is told to redo it.
    assert again.latest("ready") == KILLED_AT, again.text()
    final = again.finish(out)
    assert [s.clock for s in shard_status(addresses)] == [STEPS, STEPS]
    for name, value in clean.items():
        assert final[name].tobytes() == value.tobytes(), name
