"""A call run on every shard at once, one thread per shard."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from pswire.errors import ClientClosedError, PSError

T = TypeVar("T")


class FanOut:
    """Runs ``fn(shard)`` for every shard in parallel (inline when there is one)."""

    def __init__(self, shards: int) -> None:
        self.shards = shards
        self._pool = ThreadPoolExecutor(max_workers=shards, thread_name_prefix="ps")

    def each(self, fn: Callable[[int], T]) -> list[T]:
        """Every shard's result, in shard order; the first error (by shard) is raised."""
        if self.shards == 1:
            return [fn(0)]
        return [f.result() for f in self._submit(fn)]

    def settle(self, fn: Callable[[int], T]) -> tuple[list[T], list[tuple[int, Exception]]]:
        """Every shard's call run to its end: (the results, (shard, error) of those failed)."""
        futures = self._submit(fn)
        done: list[T] = []
        failed: list[tuple[int, Exception]] = []
        for shard, future in enumerate(futures):
            try:
                done.append(future.result())
            except Exception as exc:
                failed.append((shard, exc))
        return done, failed

    def _submit(self, fn: Callable[[int], T]) -> list[Future[T]]:
        try:
            return [self._pool.submit(fn, s) for s in range(self.shards)]
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
