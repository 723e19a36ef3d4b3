"""A worker process whose init fails and that exits without closing its client gives up its
claim on its worker id at exit: the corrected rerun takes the id at once."""

from __future__ import annotations

import sys

import pytest
from e2e_support import Processes

SCRIPT = """
import sys
import numpy as np
import psworker

client = psworker.connect(["{address}"], worker_id=0, num_workers=1, mode="async")
client.init({{"w": np.zeros(int(sys.argv[1]), np.float32)}}, psworker.SGD(lr=0.1))
print("init ok", client.step, flush=True)
if sys.argv[2] == "close":
    client.close()
"""


@pytest.mark.timeout(90)
def test_a_worker_whose_init_failed_frees_its_id_at_exit(procs: Processes) -> None:
    daemon = procs.psserver()
    script = SCRIPT.format(address=daemon.address)

    def run(size: int, end: str) -> tuple[int, str]:
        return procs.run([sys.executable, "-c", script, str(size), end], timeout=60)

    code, out = run(4, "close")
    assert code == 0 and "init ok 0" in out, out
    # A changed model: init fails, and the script ends with the error, its client open.
    code, out = run(5, "exit")
    assert code == 1 and "ModelMismatchError" in out, out
    code, out = run(4, "close")
    assert code == 0 and "init ok 0" in out, out
    assert "waiting for the old claim to lapse" not in out, out
