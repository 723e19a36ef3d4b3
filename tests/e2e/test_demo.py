"""``psctl demo`` end to end: the digits CNN learns in every mode, its results land on disk."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import sys
import termios
import threading
from pathlib import Path

import pytest
from e2e_support import Processes

PSCTL = [sys.executable, "-m", "psctl.main"]
# The bars: 95% where every gradient is averaged (or in one process), 90% where stale
# gradients are applied as they come.
THRESHOLDS = {"sync": 0.95, "local": 0.95, "allreduce": 0.95, "async": 0.90, "ssp": 0.90}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def adopt_launched(procs: Processes, out: str) -> dict[str, int]:
    """Names and PIDs psctl reports, each reaped after the test if it still runs."""
    found = re.findall(r"\[psctl\] (\w+) (?:serving at \S+|started) \(pid (\d+)\)", out)
    pids = {name: int(pid) for name, pid in found}
    for name, pid in pids.items():
        procs.adopt(pid, "psserver" if name.startswith("ps") else "psctl.demo")
    return pids


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp", "local", "allreduce"])
def test_demo_reaches_accuracy_and_writes_model_and_plot(
    procs: Processes, tmp_path: Path, mode: str
) -> None:
    out_dir = tmp_path / "out"
    args = [*PSCTL, "demo", "--mode", mode, "--out", str(out_dir), "--timeout", "120"]
    code, out = procs.run(args, timeout=140)
    pids = adopt_launched(procs, out)
    assert code == 0, out
    workers = 1 if mode == "local" else 2
    expected = {
        "local": ["worker0"],
        "allreduce": ["worker0", "worker1"],  # no shards: the workers form a ring
    }.get(mode, ["ps0", "ps1", "worker0", "worker1"])
    assert sorted(pids) == expected, out

    # psctl's summary, worker 0's own line and its metrics file agree, and clear the bar.
    match = re.search(r"^  held-out accuracy\s+(\d\.\d{4}) \(360 images\)$", out, re.M)
    assert match, out
    acc = float(match.group(1))
    assert acc >= THRESHOLDS[mode], out
    assert f"[worker0] held-out accuracy {acc:.4f} on 360 samples" in out
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert (metrics["mode"], metrics["workers"]) == (mode, workers)
    assert metrics["accuracy"] == pytest.approx(acc, abs=5e-5)
    # shard() pads each worker's slice of the 1437 training images to the same length.
    assert metrics["samples"] == workers * -(-1437 // workers) * 8
    assert re.search(r"^  throughput\s+\d+ samples/s \(\d+ samples, all workers\)$", out, re.M)
    # The wall time reported is the slowest worker's, as each worker printed its own.
    done = r"^\[worker\d\] worker \d done: \d+ samples in (\d+\.\d\d)s$"
    walls = [float(w) for w in re.findall(done, out, re.M)]
    assert len(walls) == workers, out
    assert re.search(rf"^  training wall time {max(walls):.2f}s", out, re.M), out
    assert f"  model              {out_dir / 'model.pt'}" in out
    assert f"  loss curves        {out_dir / 'loss.png'}" in out

    # The saved state_dict is the model that was evaluated.
    import torch

    from psctl.demo import DigitsCNN, accuracy, load_data

    model = DigitsCNN()
    model.load_state_dict(torch.load(out_dir / "model.pt", weights_only=True))
    assert accuracy(model, load_data(seed=0)[1]) == pytest.approx(acc, abs=5e-5)
    png = (out_dir / "loss.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000

    # Without a terminal, progress is a few plain lines per worker, ending at 100%, loss down.
    assert "PSPROGRESS" not in out
    for w in range(workers):
        steps = re.findall(
            rf"^\[worker{w}\] step (\d+)/(\d+) \(\d+%\) loss (\S+), \d+ samples/s$", out, re.M
        )
        assert 3 <= len(steps) <= 12, out
        assert steps[-1][0] == steps[-1][1] == str(metrics["steps_per_worker"]), out
        assert float(steps[-1][2]) < float(steps[0][2]), out
        history = json.loads((out_dir / f"loss-worker{w}.json").read_text())
        assert len(history["loss"]) == metrics["steps_per_worker"]


@pytest.mark.timeout(120)
def test_demo_draws_one_bar_per_worker_on_a_terminal(procs: Processes, tmp_path: Path) -> None:
    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    drawn: list[bytes] = []

    def drain() -> None:  # a full pty would block psctl's writes
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not chunk:
                return
            drawn.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    args = [*PSCTL, "demo", "--epochs", "2", "--out", str(tmp_path / "out"), "--timeout", "100"]
    try:
        proc = procs.start(args, stderr=terminal)
    finally:
        os.close(terminal)  # only psctl holds the terminal now, so its exit ends the reader
    out, _ = proc.communicate(timeout=110)
    adopt_launched(procs, out)
    reader.join(timeout=10)
    os.close(master)
    assert proc.returncode == 0, out
    bars = ANSI.sub("", b"".join(drawn).decode(errors="replace"))
    for w in (0, 1):
        assert re.search(rf"worker{w}: 100%.*46/46 .*loss \d\.\d{{4}}, \d+ samples/s", bars), bars
    # Progress went to the bars only; the rest of the output still reads as before.
    assert "PSPROGRESS" not in out and not re.search(r"\] step \d+/", out), out
    assert "[worker0] held-out accuracy" in out and "  held-out accuracy" in out, out
