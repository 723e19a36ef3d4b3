"""Runs in-process workers as threads, every one bounded, re-raising the first failure."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


def run_workers(targets: Iterable[Callable[[], None]], timeout: float = 120.0) -> None:
    """Starts each target in its own thread and waits for all of them.

    Raises:
        AssertionError: a thread was still running after ``timeout`` seconds.
        BaseException: the first error any target raised.
    """
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a worker thread did not finish in time"
    if errors:
        raise errors[0]
