"""SIGTERM means stop (issue 17): a daemon with calls waiting inside it exits within its grace
period, and the waiting callers hear that it is stopping instead of waiting out --max-wait."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
from e2e_support import Processes

import psworker


@pytest.mark.timeout(60)
def test_sigterm_ends_every_wait_and_the_daemon_exits_within_its_grace(procs: Processes) -> None:
    daemon = procs.psserver("--grace", "2", "--max-wait", "300")
    # Worker 1 of 2 declares the job but has no values to send: its pull waits for worker 0's.
    client = psworker.connect(
        [daemon.address], worker_id=1, num_workers=2, mode="sync", timeout=120, retry_s=1
    )
    errors: list[Exception] = []
    with client:
        client.init({"w": np.zeros(4, np.float32)}, psworker.SGD(lr=0.1))

        def pull() -> None:
            try:
                client.pull()
            except Exception as exc:
                errors.append(exc)

        waiting = threading.Thread(target=pull)
        waiting.start()
        time.sleep(0.5)  # the pull is inside the shard's wait
        start = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        code = daemon.proc.wait(timeout=20)
        took = time.monotonic() - start
        waiting.join(10)
    assert code == 0 and took < 2 + 5, f"exit {code} after {took:.1f}s (grace 2 s)"
    assert not waiting.is_alive()
    assert errors and isinstance(errors[0], psworker.UnavailableError), errors
