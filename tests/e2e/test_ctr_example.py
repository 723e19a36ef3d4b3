"""examples/ctr.py under psctl local: a 2.25 GiB hashed table, workers capped at 1.5 GiB, AUC
within a few points of what the data's generator allows."""

from __future__ import annotations

import re
import sys

import pytest
from e2e_support import REPO, Processes, child_env

pytest.importorskip("torch")

EXAMPLE = REPO / "examples" / "ctr.py"
PSCTL = [sys.executable, "-m", "psctl.main"]
# 1.5 GiB of address space: mapped libraries (torch, grpcio, Arrow Flight) take ~0.8 GiB of
# it before any data; the table is 2.25 GiB.
CAP_BYTES = 3 << 29
TABLE_ROWS = 1 << 26  # x 9 float32: 2.25 GiB of rows, and as much of Adagrad state
# The worker command: cap the address space, then run the example as a script.
CAPPED = (
    "import resource, runpy, sys; "
    f"resource.setrlimit(resource.RLIMIT_AS, ({CAP_BYTES}, {CAP_BYTES})); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)
EPOCH = re.compile(
    r"^\[worker(\d)\] epoch 1: loss \S+, test AUC (\d\.\d+) \(the generator's own logit: "
    r"(\d\.\d+)",
    re.M,
)


@pytest.mark.timeout(240)
def test_ctr_example_reaches_the_generators_auc_with_a_table_no_worker_could_hold(
    procs: Processes,
) -> None:
    args = [*PSCTL, "local", "--servers", "2", "--workers", "2", "--timeout", "220"]
    worker = [sys.executable, "-c", CAPPED, str(EXAMPLE), "--samples", "200000", "--epochs", "2"]
    # Few malloc arenas: each thread's arena would otherwise reserve 64 MiB of address space.
    env = child_env(MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1")
    code, out = procs.run([*args, "--", *worker], timeout=230, env=env)
    for name, pid in re.findall(r"\[psctl\] (\w+) (?:serving at \S+|started) \(pid (\d+)\)", out):
        procs.adopt(int(pid), "psserver" if name.startswith("ps") else "ctr.py")
    assert code == 0, out[-4000:]
    results = {int(w): (float(got), float(best)) for w, got, best in EPOCH.findall(out)}
    assert sorted(results) == [0, 1], out[-4000:]
    for got, best in results.values():
        assert best > 0.8 and got > best - 0.04, out[-4000:]  # within 4 AUC points
    # The table lives on the shards, all 2**26 rows, while each worker had 1.5 GiB to live in.
    held = re.search(r"shard 0: (\d+) rows, \S+ MiB, shard 1: (\d+) rows", out)
    assert held is not None and int(held[1]) + int(held[2]) == TABLE_ROWS, out[-4000:]
