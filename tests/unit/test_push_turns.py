"""``Shard.wait_turn``: a front end reads a sync push's bytes only once every lower worker of
the open round has pushed, so a round holds one push being read at a time. At once for other
rules, quorum rounds, rounds of two, other steps and calls the push will refuse; a lower
worker dropped (or
an elastic member gone) ends the wait; the wait ends on cancellation and on its deadline with
a message naming what it waits for. Unit level, on a Shard with an injected clock."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hand_clock import Clock

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import CallCancelledError, WaitTimeoutError

HEARTBEAT_S = 10.0
SPECS = (VarSpec("w", (3,), "float32"),)
START = {"w": np.zeros(3, np.float32)}


def shard_for(mode: str, workers: int, quorum: int = 0) -> tuple[Shard, Clock]:
    clock = Clock()
    shard = Shard(Limits(max_wait_s=10, heartbeat_timeout_s=HEARTBEAT_S), clock=clock)
    assert shard.init(0, Job(mode, 0, workers, SGD(lr=1.0), SPECS, "m", quorum=quorum), START)
    return shard, clock


def grad(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(3, value, np.float32)}


def waiting(shard: Shard, worker: int, step: int) -> tuple[threading.Thread, list[object]]:
    """``wait_turn`` on a thread of its own; the list gets "turn" or the exception."""
    out: list[object] = []

    def run() -> None:
        try:
            shard.wait_turn(worker, step, timeout=10)
            out.append("turn")
        except Exception as exc:  # the test reads it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_sync_push_waits_for_every_lower_worker_of_the_round() -> None:
    shard, clock = shard_for("sync", 3)
    shard.wait_turn(0, 0, timeout=0)  # worker 0's turn is always now
    two, got_two = waiting(shard, 2, 0)
    clock.wait_for_reader(two)  # in its wait
    assert shard.push(1, 0, grad(2)).applied  # straight to the shard: held (0 not in yet)
    assert got_two == [] and two.is_alive()  # 0 still to push
    assert shard.push(0, 0, grad(1)).applied
    two.join(5)
    assert got_two == ["turn"]
    assert shard.push(2, 0, grad(3)).applied
    assert float(shard.snapshot()["w"][0]) == -2.0  # the mean of 1, 2, 3


def test_other_rules_quorum_and_other_steps_never_wait() -> None:
    for mode in ("async", "ssp"):
        shard, _ = shard_for(mode, 3)
        shard.wait_turn(2, 0, timeout=0)
    shard, _ = shard_for("sync", 3, quorum=2)
    shard.wait_turn(2, 0, timeout=0)  # a quorum round is whichever pushes come first
    shard, _ = shard_for("sync", 3)
    assert shard.push(0, 0, grad(1)).applied and shard.push(1, 0, grad(1)).applied
    assert shard.push(2, 0, grad(1)).applied
    shard.wait_turn(2, 0, timeout=0)  # a retry of a closed step: the push says duplicate
    shard.wait_turn(2, 3, timeout=0)  # not the open round: the push's own wait decides
    shard.wait_turn(7, 1, timeout=0)  # no such worker: the push refuses it by name
    shard.wait_turn(2, 1, timeout=0, incarnation="earlier")  # the push refuses a restart


def test_a_round_of_two_never_waits_for_a_turn() -> None:
    # Two pushes are both held at the round's peak in either order: the wait saves nothing.
    shard, _ = shard_for("sync", 2)
    shard.wait_turn(1, 0, timeout=0)  # worker 0 has not pushed: no wait all the same
    assert shard.push(1, 0, grad(3)).applied  # held until worker 0's is in
    assert shard.push(0, 0, grad(1)).applied
    assert float(shard.snapshot()["w"][0]) == -2.0  # the mean of 1 and 3, in worker order
    # Three workers, one dropped: the open round is two (a third comes back as a held push).
    shard, clock = shard_for("sync", 3)
    for _ in range(3):  # worker 1 silent past the heartbeat timeout: dropped
        clock.now += HEARTBEAT_S / 2
        shard.heartbeat(0)
        shard.heartbeat(2)
    shard.wait_turn(2, 0, timeout=0)  # its wait drops worker 1, then 0 is not waited for
    assert 1 not in shard.status().live


def test_a_wait_for_a_turn_ends_on_its_deadline_naming_the_missing_worker() -> None:
    shard, _ = shard_for("sync", 3)
    with pytest.raises(WaitTimeoutError, match=r"its turn: push by worker 2 .*workers \[0, 1"):
        shard.wait_turn(2, 0, timeout=0)


def test_a_wait_for_a_turn_ends_when_the_caller_goes_away() -> None:
    shard, _ = shard_for("sync", 3)
    asked: list[float] = []

    def gone() -> bool:
        asked.append(time.monotonic())
        return len(asked) >= 3

    with pytest.raises(CallCancelledError, match="its turn"):
        shard.wait_turn(1, 0, timeout=10, cancelled=gone)
    assert len(asked) == 3  # asked every tick (a Flight call cannot wake the shard)


def test_a_lower_worker_dropped_ends_the_wait_and_the_round_keeps_worker_order() -> None:
    shard, clock = shard_for("sync", 3)
    one, got_one = waiting(shard, 1, 0)
    clock.wait_for_reader(one)
    for _ in range(3):  # worker 0 silent past the heartbeat timeout: dropped
        clock.now += HEARTBEAT_S / 2
        shard.heartbeat(1)
        shard.heartbeat(2)
    one.join(5)
    assert got_one == ["turn"] and 0 not in shard.status().live
    assert shard.push(2, 0, grad(3)).applied  # held in memory: 0 may come back
    assert shard.push(1, 0, grad(1)).applied  # the round closes: 1 then 2, in order
    assert float(shard.snapshot()["w"][0]) == -2.0
