"""What a ring member is to the algorithm: the Peer protocol, message tags, the mailbox a
transport fills, and in-memory peers for tests."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from pswire.errors import PSError, WaitTimeoutError


class Tag(NamedTuple):
    """Names one message of a collective: ring step, buffer segment and sub-chunk within it."""

    step: int
    segment: int
    chunk: int


class Peer(Protocol):
    """One rank's links in a ring: it sends only to its right and receives only from its left.

    ``send_to_right`` must not block on the receiver (the pipeline relies on posting a send and
    reducing the next chunk meanwhile), so it may keep a view and encode it later. The
    algorithms below overwrite a sent slice only after receiving data that could not exist
    unless the right neighbour had already received that slice, so such views stay valid.
    ``recv_from_left`` returns the array the left neighbour sent under ``tag``, whatever order
    messages arrive in, or raises a ``PSError`` (``WaitTimeoutError`` after ``timeout`` seconds).
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def left(self) -> str:
        """The left neighbour, as error messages name it (e.g. "rank 2 at 10.0.0.3:7070")."""
        ...

    def send_to_right(self, tag: Tag, array: np.ndarray) -> None: ...

    def recv_from_left(self, tag: Tag, timeout: float) -> np.ndarray: ...


# -- a keyed mailbox: what a transport thread hands to the algorithm thread -----------------


@dataclass(frozen=True)
class Failure:
    """Why a ring cannot go on: the error to raise, and how much to trust it over others.

    ``weight`` orders competing explanations: a rank that only waited in vain for its left
    neighbour knows less than one further upstream that did the same (its silence explains
    ours), and both know less than a rank that saw a peer refuse or drop a connection.
    ``origin`` is the rank that detected it; ``detail`` its message before any forwarding.
    """

    error: PSError
    weight: int
    origin: int
    detail: str


class Mailbox:
    """Arrays filed under hashable keys, each key a FIFO; waits are bounded and can be failed.

    Thread-safe. Once ``fail`` is called every ``get`` raises the weightiest failure so far.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[Hashable, collections.deque[np.ndarray]] = {}
        self._failure: Failure | None = None
        self._ended: Failure | None = None  # nothing more will be filed (``end``)
        self._nbytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes filed and not yet taken."""
        return self._nbytes

    def put(self, key: Hashable, array: np.ndarray) -> None:
        with self._cond:
            self._items.setdefault(key, collections.deque()).append(array)
            self._nbytes += array.nbytes
            self._cond.notify_all()

    def fail(self, failure: Failure) -> bool:
        """Records a failure unless a weightier (or equal, earlier) one is already held.

        Returns:
            Whether this failure is now the one ``get`` raises.
        """
        with self._cond:
            if self._failure is not None and self._failure.weight >= failure.weight:
                return False
            self._failure = failure
            self._items.clear()  # nothing queued will be read again
            self._nbytes = 0
            self._cond.notify_all()
            return True

    def end(self, failure: Failure) -> None:
        """Nothing more will be filed (the sender closed its stream): what is filed stays
        readable, and a ``get`` of anything else raises ``failure``'s error at once instead of
        waiting out its timeout."""
        with self._cond:
            if self._ended is None:
                self._ended = failure
            self._cond.notify_all()

    @property
    def failure(self) -> Failure | None:
        with self._cond:
            return self._failure

    def wait_failure(self, weight: int, timeout: float) -> Failure | None:
        """Waits up to ``timeout`` s for a failure weightier than ``weight``; returns it or None."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._failure is None or self._failure.weight <= weight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._failure

    def get(self, key: Hashable, timeout: float) -> np.ndarray | None:
        """Takes the oldest array under ``key``, waiting up to ``timeout`` s; None on timeout.

        Raises:
            PSError: the mailbox was failed (the recorded error), or ended with nothing filed
                under ``key``.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._failure is not None:
                    raise self._failure.error
                queue = self._items.get(key)
                if queue:
                    array = queue.popleft()
                    self._nbytes -= array.nbytes
                    if not queue:
                        del self._items[key]
                    return array
                if self._ended is not None:
                    raise self._ended.error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def __len__(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._items.values())


class LocalPeer:
    """A ring member whose neighbours are threads of this process (for tests and reference).

    With ``copy=False`` a send passes a view, so a test sees it if an algorithm ever changes
    an array it has sent before the receiver read it (what a lazily encoding network peer
    relies on).
    """

    def __init__(self, rank: int, mailboxes: Sequence[Mailbox], copy: bool = True) -> None:
        self._rank = rank
        self._boxes = mailboxes
        self._copy = copy

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._boxes)

    @property
    def left(self) -> str:
        return f"rank {(self._rank - 1) % self.world_size}"

    def send_to_right(self, tag: Tag, array: np.ndarray) -> None:
        right = self._boxes[(self._rank + 1) % self.world_size]
        right.put(tag, array.copy() if self._copy else array)

    def recv_from_left(self, tag: Tag, timeout: float) -> np.ndarray:
        array = self._boxes[self._rank].get(tag, timeout)
        if array is None:
            raise WaitTimeoutError(
                f"rank {self._rank}: no data from {self.left} within {timeout:g} s "
                f"(step {tag.step}, segment {tag.segment}, chunk {tag.chunk})"
            )
        return array

    def fail(self, failure: Failure) -> None:
        """Fails this rank's pending and future receives (a test's stand-in for a dead peer)."""
        self._boxes[self._rank].fail(failure)


def local_peers(world_size: int, copy: bool = True) -> list[LocalPeer]:
    """A ring of ``world_size`` in-memory peers, one per thread, rank i at index i.

    Raises:
        ValueError: ``world_size`` < 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    boxes = [Mailbox() for _ in range(world_size)]
    return [LocalPeer(rank, boxes, copy) for rank in range(world_size)]
