"""bench/diloco.py runs end to end: seven jobs of four worker processes on two shards print the
table, write the figures and draw the plot; DiLoCo sends at least 12x fewer bytes than sync."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_support import REPO, child_env


@pytest.mark.slow  # seven jobs of four worker processes (torch each): ~6 minutes on 2 cores
@pytest.mark.timeout(900)
def test_the_diloco_bench_runs_and_diloco_sends_far_fewer_bytes(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.diloco", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "diloco.json").read_text())["rows"]
    assert len(rows) == 7 and "sync" in rows, rows
    samples = {r["samples"] for r in rows.values()}
    assert len(samples) == 1, rows  # every job trained on the same number of samples
    for label, row in rows.items():
        if label != "sync":
            assert rows["sync"]["bytes_sent"] >= 12 * row["bytes_sent"], (label, rows)
    assert (tmp_path / "diloco.png").stat().st_size > 10_000
