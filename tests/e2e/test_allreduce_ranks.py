"""Two real all-reduce ranks (processes under ``psctl local --mode allreduce``) running the
shape of an upstream script, one rank built or scheduled differently: both stop with
HyperParameterMismatchError naming the ranks and values, and the job fails instead of
training two models apart."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
from e2e_support import Processes

PSCTL = [sys.executable, "-m", "psctl.main"]

SCRIPT = """
import os, sys
import torch
import psworker
from psworker.torch import DistributedOptimizer

rank = int(os.environ["PS_WORKER_ID"])
torch.manual_seed(0)
net = torch.nn.Linear(3, 1)
lr = 0.1 if rank == 0 or sys.argv[1] != "lr" else 0.5
with psworker.connect() as client:
    assert client.mode == "allreduce"
    opt = DistributedOptimizer(net, client, torch.optim.SGD(net.parameters(), lr=lr))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for t in range(5):
        x, y = torch.randn(4, 3), torch.randn(4, 1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        print(f"rank {rank} finished step {t}", flush=True)
        sched.step()
        if sys.argv[1] == "scheduler" and rank == 1 and t == 1:
            sched.step()  # stepped twice on one rank
print(f"rank {rank} done", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "step", "values"),
    [
        ("lr", 0, "group 0 lr: rank 0 0.1, rank 1 0.5"),
        # Slow: two more torch processes (~40 s on a loaded 2-core machine); the same check
        # runs in-process in tests/integration/test_allreduce_agreement.py.
        pytest.param(
            "scheduler",
            2,
            "group 0 lr: rank 0 0.025, rank 1 0.0125",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["lr", "scheduler"],
)
def test_ranks_that_disagree_fail_the_job_naming_ranks_and_values(
    procs: Processes, tmp_path: Path, case: str, step: int, values: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    args = [*PSCTL, "local", "--mode", "allreduce", "--workers", "2", "--timeout", "90"]
    code, out = procs.run([*args, "--", sys.executable, str(script), case], timeout=110)
    for _name, pid in re.findall(r"\[psctl\] (\w+) started \(pid (\d+)\)", out):
        procs.adopt(int(pid), script.name)
    assert code != 0, out
    assert "done" not in out, out
    for rank in (0, 1):
        assert f"[worker{rank}] rank {rank} finished step {step - 1}" in out or step == 0, out
        assert f"[worker{rank}] rank {rank} finished step {step}" not in out, out
    assert "HyperParameterMismatchError" in out, out
    assert f"at step {step}: ranks [1] apply other settings than rank 0" in out, out
    assert values in out, out
