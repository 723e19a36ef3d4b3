"""examples/gan.py (two models, two optimizers): trains alone (local) and as two workers on two
shards under ``psctl local`` in sync and async."""

from __future__ import annotations

import re
import sys

import pytest
from e2e_support import REPO, Processes, child_env

EXAMPLE = REPO / "examples" / "gan.py"
PSCTL = [sys.executable, "-m", "psctl.main"]
LINE = r"epoch (\d+): loss_D (\S+) loss_G (\S+) near a mode (\S+) modes (\d)/8"


def epochs(out: str, prefix: str = "") -> list[tuple[str, ...]]:
    return re.findall(rf"^{re.escape(prefix)}{LINE}$", out, re.M)


@pytest.mark.timeout(150)
def test_the_gan_example_learns_alone(procs: Processes) -> None:
    code, out = procs.run([sys.executable, str(EXAMPLE)], timeout=140, env=child_env())
    assert code == 0, out
    lines = epochs(out)
    assert [int(e[0]) for e in lines] == list(range(12)), out
    first, last = float(lines[0][3]), float(lines[-1][3])
    # The generator's points gather on the ring's modes: measured 0.06 -> 0.375, all 8 modes.
    assert last > 0.2 and last > 2 * first and int(lines[-1][4]) >= 6, out


@pytest.mark.slow  # two workers, two shards, a few hundred pushes each: about a minute
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_gan_example_trains_as_two_workers(procs: Processes, mode: str) -> None:
    args = [*PSCTL, "local", "--servers", "2", "--workers", "2", "--mode", mode, "--timeout", "200"]
    code, out = procs.run(
        [*args, "--", sys.executable, str(EXAMPLE)], timeout=280, env=child_env(GAN_EPOCHS="4")
    )
    for name, pid in re.findall(r"\[psctl\] (\w+) (?:serving at \S+|started) \(pid (\d+)\)", out):
        procs.adopt(int(pid), "psserver" if name.startswith("ps") else EXAMPLE.name)
    assert code == 0, out
    per_worker = [epochs(out, f"[worker{w}] ") for w in (0, 1)]
    assert all([int(e[0]) for e in lines] == [0, 1, 2, 3] for lines in per_worker), out
    if mode == "sync":
        # Both replicas hold the shards' weights after each G step: the same generator.
        assert [e[3:] for e in per_worker[0]] == [e[3:] for e in per_worker[1]], out
