"""examples/train_lm.py (AdamW with two parameter groups, warm-up + cosine, GradScaler) trains
as two workers under ``psctl local`` in sync and async, its plain torch loop unchanged."""

from __future__ import annotations

import ast
import re
import sys

import pytest
from e2e_support import REPO, Processes

EXAMPLE = REPO / "examples" / "train_lm.py"
PSCTL = [sys.executable, "-m", "psctl.main"]
MARKER = "# (distributed)"
EPOCHS = 8
LINE = r"epoch (\d+): loss \S+, corpus loss (\d+\.\d+) \(perplexity \S+\), lr (\d\.\d+)(?:, .*)?"


def epochs(out: str, worker: int) -> list[tuple[int, float, float]]:
    """(epoch, corpus loss, lr) each epoch ``worker`` printed."""
    found = re.findall(rf"^\[worker{worker}\] {LINE}$", out, re.M)
    return [(int(e), float(loss), float(lr)) for e, loss, lr in found]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_language_model_trains_as_two_workers(procs: Processes, mode: str) -> None:
    args = [*PSCTL, "local", "--servers", "2", "--workers", "2", "--mode", mode]
    code, out = procs.run([*args, "--timeout", "170", "--", sys.executable, str(EXAMPLE)], 190)
    for name, pid in re.findall(r"\[psctl\] (\w+) (?:serving at \S+|started) \(pid (\d+)\)", out):
        procs.adopt(int(pid), "psserver" if name.startswith("ps") else EXAMPLE.name)
    assert code == 0, out
    runs = [epochs(out, w) for w in (0, 1)]
    for run in runs:
        assert [e for e, _, _ in run] == list(range(EPOCHS)), out
        assert run[-1][1] < 1.0, out  # it learned (ln 33 = 3.5 at the start)
    # In sync both take their first epoch from scratch, in step; in async a worker that starts
    # late pulls weights the other has trained for epochs (the whole job takes seconds).
    firsts = [run[0][1] for run in runs]
    assert (min(firsts) if mode == "sync" else max(firsts)) > 1.0, out
    for run in runs:
        # The schedule ran to its end: warm-up, then cosine down to eta_min.
        assert run[-1][2] == 0.001 and run[0][2] > 0.009, out
    if mode == "sync":
        # Both replicas hold the shards' weights after every step: identical losses.
        assert [loss for _, loss, _ in runs[0]] == [loss for _, loss, _ in runs[1]], out


def test_only_the_marked_lines_touch_the_sdk() -> None:
    text = EXAMPLE.read_text()
    docstring_end = ast.parse(text).body[0].end_lineno or 0
    code = text.splitlines()[docstring_end:]
    marked = [line for line in code if line.rstrip().endswith(MARKER)]
    distributed = [
        line
        for line in code
        if re.search(r"psworker|connect\(|shard\(|\.client|\.synchronize\(", line)
    ]
    assert distributed == marked, distributed
    # The import, wrapping the optimizer, sharding the data, and after the loop the last
    # local steps' outer step (DiLoCo; nothing to do in the other modes).
    assert len(marked) == 4, marked
    plain = [line for line in code if "torch.optim." in line or "GradScaler" in line]
    assert any("AdamW" in line for line in plain) and any("GradScaler" in line for line in plain)
