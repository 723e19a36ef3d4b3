"""What a shard tells an observer (the daemon's metrics) about the calls passing through it."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

import numpy as np

from pscore.tables import RowSparse


class Observer(Protocol):
    """Told what passes through a shard (``psserver.metrics.ShardMetrics`` counts it)."""

    def pushed(self, grads: Mapping[str, np.ndarray | RowSparse]) -> None: ...

    def pulled(self, arrays: Mapping[str, np.ndarray | RowSparse]) -> None: ...

    def waited(self, call: str, seconds: float) -> None: ...


@contextmanager
def observed(
    observer: Observer | None,
    call: str,
    grads: Mapping[str, np.ndarray | RowSparse] | None = None,
) -> Iterator[None]:
    """Tells ``observer`` about a push's gradients and the time the body takes (errors
    included: a wait that timed out is the one that most needs seeing)."""
    if observer is None:
        yield
        return
    if grads is not None:
        observer.pushed(grads)
    start = time.perf_counter()
    try:
        yield
    finally:
        observer.waited(call, time.perf_counter() - start)
