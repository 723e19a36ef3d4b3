"""A daemon's main thread waits for its SIGINT/SIGTERM handler without ever holding the stop
event's lock: a handler that interrupted ``Event.wait()`` while it held that lock would wait
for it forever in ``set()`` (a ``psserver`` given SIGINT just after it came up never
stopped)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from pswire.cli import wait_for_stop


class NeverWait(threading.Event):
    """An event whose ``wait`` fails: the main thread must only poll it."""

    def wait(self, timeout: float | None = None) -> bool:
        raise AssertionError("stop.wait() holds the lock the signal handler's set() takes")


@pytest.mark.timeout(20)
def test_the_main_thread_polls_the_event_its_signal_handler_sets() -> None:
    stop = NeverWait()
    previous = signal.signal(signal.SIGUSR1, lambda *_: stop.set())
    try:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        wait_for_stop(stop, poll_s=0.01)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert stop.is_set()
