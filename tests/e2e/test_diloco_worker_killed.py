"""kill -9 of a DiLoCo worker between outer steps (synchronous outer steps, 2 workers, 2 real
shard daemons): restarted with its state folder it resumes at its last outer step with its
local weights, AdamW's moments and random generator, and the job ends bit-identical to a run
without the fault, also when it died after its push reached the shards but before its state
was written, and with streaming fragments landing under an inner step. Restarted without its
state it trains on, but not to the same model: what the state is for."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from e2e_support import Lines, Processes

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(240)
WORKER = str(Path(__file__).with_name("diloco_worker.py"))
STEPS, H, KILLED_AT = 16, 4, 10  # the kill falls in outer step 2's inner steps (8..11)
STREAMING = ("--fragments", "2", "--overlap-steps", "1", "--mix", "0.5")


def start(procs: Processes, addresses: list[str], worker: int, out: Path, *flags: str) -> Lines:
    args = [sys.executable, WORKER, "--addresses", ",".join(addresses), "--out", str(out)]
    args += ["--worker", str(worker), "--workers", "2", "--steps", str(STEPS)]
    return Lines(procs.start([*args, "--local-steps", str(H), *flags]))


def job(
    procs: Processes, tmp: Path, *flags: str
) -> tuple[list[dict[str, np.ndarray]], list[Lines]]:
    """A fault-free run: each worker's final model and the job's weights, and its output."""
    addresses = [procs.psserver("--heartbeat-timeout", "0").address for _ in range(2)]
    outs = [tmp / f"clean{w}.npz" for w in range(2)]
    workers = [start(procs, addresses, w, outs[w], *flags) for w in range(2)]
    finals = [lines.finish(out, 180) for lines, out in zip(workers, outs, strict=True)]
    return finals, workers


def checksums(*runs: Lines) -> dict[int, int]:
    """Each inner step's model checksum a worker printed (a restart's replacing the killed
    run's for the steps it redid)."""
    sums: dict[int, int] = {}
    for run in runs:
        for line in run.text(10**7).splitlines():
            if line.startswith('{"step"'):
                said = json.loads(line)
                sums[said["step"]] = said["crc"]
    return sums


def parting(clean: dict[int, int], run: dict[int, int]) -> str:
    """Where a run's model first differs from the clean run's, for a failure's message."""
    for step in sorted(clean):
        if run.get(step) != clean[step]:
            return f"first differs after inner step {step}"
    return "every inner step's model equal; only the end differs"


def identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


@pytest.mark.parametrize(
    ("case", "flags", "resumes_at"),
    [
        ("between outer steps", (), 2 * H),
        ("after its push, before its state", (), H),
        ("streaming fragments with overlap", STREAMING, 2 * H + 1),
        ("without its state", (), 2 * H),
    ],
    ids=["between", "pushed", "streaming", "stateless"],
)
def test_a_diloco_worker_killed_and_restarted_ends_bit_identical(
    procs: Processes, tmp_path: Path, case: str, flags: tuple[str, ...], resumes_at: int
) -> None:
    clean, clean_runs = job(procs, tmp_path, *flags)
    # The shards never drop a silent worker here: the sync round waits for the restart.
    addresses = [procs.psserver("--heartbeat-timeout", "0").address for _ in range(2)]
    states = tmp_path / "states"
    kept = ("--keep-states",) if case.startswith("after") else ()
    with_state = ("--state-dir", str(states), *kept)
    outs = [tmp_path / f"run{w}.npz" for w in range(2)]
    steady = start(procs, addresses, 0, outs[0], *flags, *with_state)
    victim = start(
        procs, addresses, 1, tmp_path / "victim.npz", *flags, *with_state,
        "--stall-at", str(KILLED_AT),
    )  # fmt: skip
    victim.wait_for(lambda: victim.latest("stalled") is not None, 120, "the stall")
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=10)
    state = states / "diloco-worker-1.pt"
    assert state.exists()
    if case.startswith("after"):  # as if it died after outer step 1's push, before its write
        shutil.copy(states / "diloco-worker-1-kept-1.pt", state)
    if case.startswith("without"):
        state.unlink()
    again = start(procs, addresses, 1, outs[1], *flags, *with_state)
    again.wait_for(lambda: again.latest("ready") is not None, 120, "the restart")
    assert again.latest("ready") == resumes_at, again.text()
    final = [steady.finish(outs[0], 180), again.finish(outs[1], 180)]
    if case.startswith("without"):
        # Resumed from the job's weights with a fresh AdamW: trained on, another model.
        assert not identical(final[0], clean[0])
        return
    runs = [checksums(steady), checksums(victim, again)]
    for w in range(2):
        where = parting(checksums(clean_runs[w]), runs[w])
        assert identical(final[w], clean[w]), f"worker {w}: {where}; {again.text()}"
    assert identical(
        {k: v for k, v in final[0].items() if k.startswith("job/")},
        {k: v for k, v in final[1].items() if k.startswith("job/")},
    )
