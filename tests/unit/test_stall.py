"""Stall warnings: who a wait is for, read from the shards' statuses, and the watch's cadence
(0: off)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from pswire.proto import ps_pb2
from psworker.stall import StallWatch, describe_stall


def status(live: list[int], clocks: dict[int, tuple[int, float]], initialized: bool = True):
    st = ps_pb2.StatusResponse(initialized=initialized, live_workers=live)
    for w, (clock, silent) in clocks.items():
        st.workers.add(worker_id=w, clock=clock, seconds_since_heartbeat=silent)
    return st


def test_the_missing_workers_are_those_behind_the_step_with_their_longest_silence() -> None:
    a = status([0, 1, 2], {0: (4, 0.1), 1: (3, 12.0), 2: (4, 0.2)})
    b = status([0, 1, 2], {0: (4, 0.1), 1: (3, 13.5), 2: (4, 0.2)})
    assert describe_stall([a, b], need=4, worker=0) == "worker 1 (silent 14s, 3 steps finished)"
    # A dropped worker (not live) is not waited for; a shard that did not answer is named.
    c = status([0, 2], {0: (4, 0.1), 1: (3, 40.0), 2: (4, 0.2)})
    assert describe_stall([c, None], need=4, worker=0) == (
        "no worker (every live worker has finished; a shard is slow), "
        "shards [1], whose status did not answer"
    )
    # A live worker the shard never heard from has no entry in its workers' table.
    assert describe_stall([status([0, 1], {0: (1, 0.0)})], 1, 0) == (
        "worker 1 (never heard from, 0 steps finished)"
    )
    elastic = status([0], {0: (1, 0.0)})
    elastic.job.min_workers = 2
    assert describe_stall([elastic], 1, 0) == "members: the elastic job needs 2 and has 1"
    assert describe_stall([status([0], {}, initialized=False)], -1, 1) == (
        "worker 0 to initialise the variables"
    )


def test_a_long_wait_warns_every_period_and_a_short_one_never(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[float] = []

    def probe(timeout: float) -> list[ps_pb2.StatusResponse | None]:
        calls.append(timeout)
        return [status([0, 1], {0: (3, 0.0), 1: (2, 9.0)})]

    watch = StallWatch(0.1, 0, probe)
    with caplog.at_level(logging.WARNING, logger="psworker.stall"):
        with watch.waiting("step 2", 3):
            deadline = time.monotonic() + 10
            while len(calls) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
        with watch.waiting("step 3", 4):
            pass  # over at once: nothing to say
        seen = len(calls)
        time.sleep(0.3)
    watch.close()
    assert seen >= 2 and len(calls) == seen  # no probe once the wait ended
    assert "worker 0: step 2 has waited" in caplog.text
    assert "for worker 1 (silent 9s, 2 steps finished)" in caplog.text
    assert "step 3" not in caplog.text


@pytest.mark.parametrize("need", [None, 5])
def test_zero_or_a_call_that_never_waits_starts_nothing(need: int | None) -> None:
    calls: list[float] = []
    watch = StallWatch(0.0 if need is not None else 0.05, 0, lambda t: calls.append(t) or [])
    with watch.waiting("step 4", need):
        time.sleep(0.3)
    assert calls == []
    assert not any(t.name.startswith("ps-stall") for t in threading.enumerate())
