"""The shard's clock in unit tests: moved by hand (``clock.now += s``), and telling which
threads read it, so a test knows a call has reached its wait (a waiting call reads it)."""

from __future__ import annotations

import threading


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.readers: set[int] = set()
        self.read = threading.Condition()

    def __call__(self) -> float:
        with self.read:
            self.readers.add(threading.get_ident())
            self.read.notify_all()
        return self.now

    def wait_for_reader(self, thread: threading.Thread, timeout: float = 10.0) -> None:
        with self.read:
            assert self.read.wait_for(lambda: thread.ident in self.readers, timeout)
