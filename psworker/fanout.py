"""A call run on every shard at once, one thread per shard."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TypeVar

from pswire.errors import ClientClosedError, PSError

T = TypeVar("T")


class FanOut:
    """Runs ``fn(shard)`` for every shard in parallel (inline when there is one)."""

    def __init__(self, shards: int) -> None:
        self.shards = shards
        # A step's calls (``settle``, or ``settle_started``'s early waits) and the heartbeat
        # thread's each take up to shards - 1 threads at once: neither queues behind the other
        # (a recovering shard's wait can take a while). Threads start only when needed.
        self._pool = ThreadPoolExecutor(max_workers=2 * shards, thread_name_prefix="ps")

    def each(self, fn: Callable[[int], T]) -> list[T]:
        """Every shard's result, in shard order; the first error (by shard) is raised."""
        done, failed = self.settle(fn)
        if failed:
            raise failed[0][1]
        return done

    def settle(self, fn: Callable[[int], T]) -> tuple[list[T], list[tuple[int, Exception]]]:
        """Every shard's call run to its end: (the results, (shard, error) of those failed).

        Shard 0's call runs in the calling thread while the pool runs the others: one thread
        hand-off fewer per call (none with one shard)."""
        futures = self._submit(fn)
        outcomes: list[tuple[bool, T | Exception]] = []
        try:
            outcomes.append((True, fn(0)))
        except Exception as exc:
            outcomes.append((False, exc))
        for future in futures:
            try:
                outcomes.append((True, future.result()))
            except Exception as exc:
                outcomes.append((False, exc))
        done = [value for ok, value in outcomes if ok]
        failed = [(s, value) for s, (ok, value) in enumerate(outcomes) if not ok]
        return done, failed  # type: ignore[return-value]

    def settle_started(
        self,
        start: Callable[[int], Callable[[], T]],
        when_ended: Callable[[int, Callable[[], None]], None] | None = None,
    ) -> tuple[list[T], list[tuple[int, Exception]]]:
        """As ``settle``, for calls in two halves: ``start(shard)`` sends and returns what
        waits for the reply. Every shard is started, then each waited for in shard order, all
        in the calling thread: the shards work at once with no thread hand-off.

        ``when_ended(shard, fn)`` arranges for ``fn()`` to run once that shard's call ended
        early (an error: it restarted, or is unreachable). That shard's wait then runs at once
        in the pool, not after the shards before it: a shard that restarted is recovered
        (re-registered, pushes replayed) while another shard's reply is pending. Waiting in
        order instead deadlocks when that reply needs another worker's step, and that worker
        waits for this worker's replay to the restarted shard."""
        started: list[tuple[int, Callable[[], T]]] = []
        failed: list[tuple[int, Exception]] = []
        for shard in range(self.shards):
            try:
                started.append((shard, start(shard)))
            except Exception as exc:
                failed.append((shard, exc))
        lock = threading.Lock()
        claimed: dict[int, Future[T] | None] = {}  # shard -> run early in the pool (a future)

        def early(shard: int, finish: Callable[[], T]) -> None:
            with lock:
                if shard in claimed:
                    return  # the calling thread got to it first
                try:
                    claimed[shard] = self._pool.submit(finish)
                except RuntimeError:  # the client is closing: the calling thread runs it
                    return

        if when_ended is not None:
            for shard, finish in started[1:]:  # the first one is waited for at once anyway
                when_ended(shard, partial(early, shard, finish))
        done: list[T] = []
        for shard, finish in started:
            with lock:
                future = claimed.setdefault(shard, None)
            try:
                done.append(future.result() if future is not None else finish())
            except Exception as exc:
                failed.append((shard, exc))
        return done, sorted(failed, key=lambda f: f[0])

    def _submit(self, fn: Callable[[int], T]) -> list[Future[T]]:
        """Shards 1.. submitted to the pool."""
        try:
            return [self._pool.submit(fn, s) for s in range(1, self.shards)]
        except RuntimeError:  # shut down by another thread just now
            raise ClientClosedError("the client is closed: connect again") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def partial_failure(step: int, failed: list[tuple[int, Exception]], shards: int) -> PSError | None:
    """When some shards took a push and another refused it, the step is used up (those
    shards hold it): the error to raise, naming who applied it. None: every shard failed, or
    the failure is not a PSError (nothing to add)."""
    first = failed[0][1]
    if len(failed) == shards or not isinstance(first, PSError):
        return None
    took = sorted(set(range(shards)) - {s for s, _ in failed})
    return type(first)(
        f"{first} [step {step} was taken by shards {took} and refused by shards "
        f"{[s for s, _ in failed]}: the step is used up, the next push is step {step + 1}]"
    )
