"""examples/: the plain-torch-loop example trains alone and as workers under ``psctl local``."""

from __future__ import annotations

import ast
import re
import sys

import pytest
from e2e_support import REPO, Processes

EXAMPLE = REPO / "examples" / "train_digits.py"
PSCTL = [sys.executable, "-m", "psctl.main"]
MARKER = "# (distributed)"


def final_accuracies(out: str, prefix: str = "") -> list[float]:
    """Held-out accuracy after the last epoch, one per worker, in output order."""
    pattern = rf"^{re.escape(prefix)}epoch 4: loss \S+, held-out accuracy (\d\.\d+)$"
    return [float(a) for a in re.findall(pattern, out, re.M)]


@pytest.mark.timeout(120)
def test_example_trains_as_two_workers_under_psctl_local(procs: Processes) -> None:
    args = [*PSCTL, "local", "--servers", "2", "--workers", "2", "--timeout", "100"]
    code, out = procs.run([*args, "--", sys.executable, str(EXAMPLE)], timeout=110)
    for name, pid in re.findall(r"\[psctl\] (\w+) (?:serving at \S+|started) \(pid (\d+)\)", out):
        procs.adopt(int(pid), "psserver" if name.startswith("ps") else EXAMPLE.name)
    assert code == 0, out
    accuracies = [final_accuracies(out, f"[worker{w}] ") for w in (0, 1)]
    assert all(len(a) == 1 and a[0] >= 0.9 for a in accuracies), out
    # sync: both replicas hold the shards' weights after the last step, so they agree exactly.
    assert accuracies[0] == accuracies[1], out


@pytest.mark.timeout(120)
def test_example_runs_alone_in_local_mode(procs: Processes) -> None:
    code, out = procs.run([sys.executable, str(EXAMPLE)], timeout=110)  # no TF_CONFIG, no PS_*
    assert code == 0, out
    (accuracy,) = final_accuracies(out)
    assert accuracy >= 0.9, out


def test_example_marks_every_distributed_line() -> None:
    text = EXAMPLE.read_text()
    docstring_end = ast.parse(text).body[0].end_lineno or 0
    code = text.splitlines()[docstring_end:]
    marked = [line for line in code if line.rstrip().endswith(MARKER)]
    distributed = [line for line in code if re.search(r"psworker|connect\(|shard\(|\.client", line)]
    # Every line that touches the SDK is marked, and only a few are needed.
    assert distributed == marked, distributed
    assert 2 <= len(marked) <= 3, marked  # the README's promise: at most three lines
