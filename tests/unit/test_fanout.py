"""The fan-out's two-halves calls: every shard's wait in the calling thread, except a shard
whose call ended early, whose wait runs at once in the pool while an earlier one is pending."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from psworker.fanout import FanOut


def test_a_later_shards_early_end_is_handled_while_an_earlier_reply_is_pending() -> None:
    # Shard 0's reply comes only after shard 1's wait has run (as a sync step's reply may need
    # another worker, who waits for this worker's replay to the restarted shard 1).
    fan = FanOut(2)
    recovered = threading.Event()

    def start(shard: int) -> Callable[[], str]:
        if shard == 0:
            return lambda: "zero" if recovered.wait(10) else "waited out"
        return lambda: (recovered.set(), "one")[1]

    def ended(shard: int, fn: Callable[[], None]) -> None:
        assert shard == 1  # the first shard is waited for at once: no hook for it
        fn()  # its call ended before anyone read it (ABORTED at once)

    try:
        assert fan.settle_started(start, ended) == (["zero", "one"], [])
    finally:
        fan.close()


def test_without_an_early_end_every_wait_runs_in_the_calling_thread_in_shard_order() -> None:
    fan = FanOut(3)
    ran: list[tuple[int, int]] = []
    hooks: list[int] = []

    def start(shard: int) -> Callable[[], int]:
        def finish() -> int:
            ran.append((shard, threading.get_ident()))
            if shard == 1:
                raise ValueError("shard 1 refused")
            return shard

        return finish

    try:
        done, failed = fan.settle_started(start, lambda shard, fn: hooks.append(shard))
    finally:
        fan.close()
    assert done == [0, 2] and [(s, str(e)) for s, e in failed] == [(1, "shard 1 refused")]
    assert ran == [(s, threading.get_ident()) for s in range(3)]
    assert hooks == [1, 2]


def test_an_early_wait_that_fails_is_reported_under_its_shard() -> None:
    fan = FanOut(2)

    def start(shard: int) -> Callable[[], int]:
        def finish() -> int:
            if shard == 1:
                raise RuntimeError("restarted")
            return 0

        return finish

    try:
        done, failed = fan.settle_started(start, lambda shard, fn: fn())
    finally:
        fan.close()
    assert done == [0]
    assert [(s, type(e)) for s, e in failed] == [(1, RuntimeError)]
    with pytest.raises(RuntimeError, match="restarted"):
        raise failed[0][1]
