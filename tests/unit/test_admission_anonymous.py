"""Admission's per-peer cap on anonymous request streams, with an injected clock: only streams
that sent nothing for over the grace count, per peer host, the oldest past the cap cancelled;
a stream that named itself is never touched by the rule."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from psserver.admission import (
    ANONYMOUS_GRACE_S,
    ANONYMOUS_STREAMS_PER_PEER,
    Admission,
    peer_host,
)


class Context:
    """The two things Admission asks of a gRPC servicer context."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self.cancelled = False

    def peer(self) -> str:
        return self._peer

    def cancel(self) -> None:
        self.cancelled = True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def silent(stop: threading.Event) -> Iterator[Any]:
    stop.wait(10)
    yield from ()


def open_stream(
    admission: Admission, context: Context, requests: Iterator[Any]
) -> threading.Thread:
    """A server thread reading the stream's first message, as a servicer does."""
    started = threading.Event()

    def read() -> None:
        watched = admission._watched(requests, context)  # type: ignore[arg-type]
        started.set()
        next(watched, None)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    started.wait(5)
    return thread


def wait_anonymous(admission: Admission, count: int) -> None:
    for _ in range(500):
        if len(admission._anonymous) == count:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{len(admission._anonymous)} anonymous streams, expected {count}")


def test_peer_host_drops_the_port_only():
    assert peer_host("ipv4:10.0.0.3:5123") == "ipv4:10.0.0.3"
    assert peer_host("ipv6:[::1]:5123") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


def test_only_a_peers_streams_silent_past_the_grace_and_over_the_cap_are_cancelled():
    clock = Clock()
    admission = Admission(threads=64, clock=clock)
    stop = threading.Event()
    try:
        attacker = [Context(f"ipv4:10.0.0.9:{4000 + i}") for i in range(5)]
        other = [Context(f"ipv4:10.0.0.7:{5000 + i}") for i in range(ANONYMOUS_STREAMS_PER_PEER)]
        for i, context in enumerate(attacker + other):
            clock.now = float(i)  # opened one second apart, attacker's first
            open_stream(admission, context, silent(stop))
        wait_anonymous(admission, len(attacker) + len(other))
        named = Context("ipv4:10.0.0.9:6000")  # a worker on the attacker's host
        open_stream(admission, named, iter([object()]))  # its first message came at once
        clock.now = 100.0
        admission.expire(clock.now)
        kept = len(attacker) - ANONYMOUS_STREAMS_PER_PEER
        # The attacker's oldest are cancelled, its newest kept; the other peer is within the cap.
        assert [c.cancelled for c in attacker] == [True] * kept + [False] * (len(attacker) - kept)
        assert not any(c.cancelled for c in other) and not named.cancelled
        # Within the grace nothing is cancelled, however many.
        fresh = [Context(f"ipv4:10.0.0.8:{7000 + i}") for i in range(5)]
        for context in fresh:
            open_stream(admission, context, silent(stop))
        clock.now += ANONYMOUS_GRACE_S / 2
        admission.expire(clock.now)
        assert not any(c.cancelled for c in fresh)
    finally:
        stop.set()


@pytest.mark.parametrize("threads", [16, 128])
def test_the_cap_leaves_most_long_call_threads_to_workers(threads):
    assert Admission(threads).long_limit // 4 >= ANONYMOUS_STREAMS_PER_PEER
