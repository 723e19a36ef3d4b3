"""A sync worker whose partner never arrives says so on its stderr, naming the missing worker,
long before any timeout (real shard daemon, real worker process)."""

from __future__ import annotations

import time

import pytest
from e2e_support import Processes, child_env, numpy_worker


@pytest.mark.timeout(60)
def test_a_worker_that_never_arrives_is_named_in_a_stall_warning_within_15s(
    procs: Processes,
) -> None:
    daemon = procs.psserver()
    # Worker 1 of 2 never starts; the default period (10 s) is what a user gets.
    lines = numpy_worker(procs, [daemon.address], 0, 2, "--steps", "3", "--fused", env=child_env())
    lines.wait_for(lambda: lines.latest("ready") is not None, 30, "ready line")
    ready = time.monotonic()
    lines.wait_for(lambda: any("has waited" in line for line in lines.lines), 15, "stall warning")
    waited = time.monotonic() - ready
    warning = next(line for line in lines.lines if "has waited" in line)
    assert "worker 0: step 0 has waited" in warning, warning
    assert "worker 1 (silent" in warning and "0 steps finished" in warning, warning
    assert waited < 15, waited


@pytest.mark.timeout(60)
def test_the_period_comes_from_ps_stall_warning(procs: Processes) -> None:
    daemon = procs.psserver()
    env = child_env(PS_STALL_WARNING="0.5")
    lines = numpy_worker(procs, [daemon.address], 0, 2, "--steps", "3", "--fused", env=env)
    lines.wait_for(lambda: sum("has waited" in x for x in lines.lines) >= 2, 30, "two warnings")
    assert "stall warnings every 0.5s" in lines.text()
