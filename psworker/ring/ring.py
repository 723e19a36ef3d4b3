"""The ring all-reduce between worker processes: a Flight ring port each, one stream rightwards."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

import numpy as np

from pswire.channel import MAX_MESSAGE_BYTES
from pswire.errors import (
    ClientClosedError,
    ConfigError,
    InvalidRequestError,
    PSError,
    WaitTimeoutError,
)
from pswire.proto import ring_pb2
from pswire.security import ClientSecurity
from psworker.ring import algorithm
from psworker.ring.flight_transport import CERTAIN, RightLink, RingServer
from psworker.ring.peer import Failure, Peer, Tag

__all__ = ["Ring", "RingServer"]

T = TypeVar("T")
DEFAULT_TIMEOUT_S = algorithm.DEFAULT_TIMEOUT_S
# A segment large enough travels in at least this many chunks, so sending one overlaps
# reducing the next; but no chunk shrinks below 1 MiB for it (each message costs CPU).
_PIPELINE_DEPTH = 4
_MIN_PIPELINE_CHUNK = 1 << 20


def pipeline_chunk(max_chunk: int, segment_bytes: int) -> int:
    """Chunk size for a segment: ``max_chunk``, or less to cut it into a few 1 MiB+ chunks."""
    return min(max_chunk, max(_MIN_PIPELINE_CHUNK, segment_bytes // _PIPELINE_DEPTH))


class _OpPeer:
    """One collective's links: tags carry the op number; sends queue on the ring's stream to
    the right neighbour; ``finish`` waits until the neighbour holds everything."""

    def __init__(self, owner: Ring, op: int) -> None:
        self._ring = owner
        self._op = op
        self.recv_timeout: WaitTimeoutError | None = None

    @property
    def rank(self) -> int:
        return self._ring.rank

    @property
    def world_size(self) -> int:
        return self._ring.world_size

    @property
    def left(self) -> str:
        return self._ring.describe(self._ring.left_rank)

    def send_to_right(self, tag: Tag, array: np.ndarray) -> None:
        assert self._ring._link is not None
        self._ring._link.send(self._op, tag, array)

    def recv_from_left(self, tag: Tag, timeout: float) -> np.ndarray:
        array = self._ring._server.mailbox.get((self._op, *tag), timeout)
        if array is None:
            self.recv_timeout = WaitTimeoutError(
                f"{self._ring.describe(self.rank)} got no data from {self.left} within "
                f"{timeout:g} s (collective {self._op}, step {tag.step}, segment {tag.segment}, "
                f"chunk {tag.chunk}); is that worker dead, stuck, or not in this collective?"
            )
            raise self.recv_timeout
        return array

    def abort(self, failure: Failure) -> None:
        """Tells the right neighbour this rank gave up, and why."""
        certain = failure.weight >= CERTAIN
        message = ring_pb2.RingAbort(
            status=failure.error.status,
            message=failure.detail,
            certain=certain,
            hops=0 if certain else failure.weight,
            origin=failure.origin,
        )
        assert self._ring._link is not None
        self._ring._link.send_abort(self._op, message)

    def finish(self, timeout: float) -> None:
        """Waits until the right neighbour acknowledges every chunk of this collective.

        Raises:
            WaitTimeoutError: the neighbour took nothing for ``timeout`` seconds.
            PSError: the stream failed (the neighbour is gone, or rejected a chunk).
        """
        if self._ring._link is not None:
            self._ring._link.flush(self._op, timeout)


class Collective:
    """One collective of a ``Ring`` (``Ring.open_collective``), whose parts may be summed a
    few at a time, in order, from one thread at a time; ``close`` ends it. A failure in any
    part settles it as ``Ring`` settles a collective (the neighbours told, the ring failed for
    good) and ends it; so does ``abort``, for a rank that must give up between parts.
    """

    def __init__(self, ring: Ring, peer: _OpPeer) -> None:
        self._ring = ring
        self._peer = peer
        self._parts = 0  # parts summed so far: the next part's index among the tags
        self._open = True
        self._ending = threading.Lock()  # ``abort`` may come from another thread

    @property
    def open(self) -> bool:
        return self._open

    def allreduce(self, parts: Sequence[algorithm.Part]) -> None:
        """Sums these parts, the collective's next ones (as ``Ring.allreduce_many``).

        Raises:
            As ``Ring.allreduce_many``; the collective is then ended.
        """
        world, chunk = self._ring.world_size, self._ring.chunk_bytes
        chunked = [
            dataclasses.replace(
                part, chunk_bytes=pipeline_chunk(chunk, part.buffer.nbytes // world)
            )
            for part in parts
        ]
        first, self._parts = self._parts, self._parts + len(chunked)
        timeout = self._ring.timeout
        self.run(lambda peer: algorithm.allreduce_many(peer, chunked, timeout=timeout, first=first))

    def run(self, body: Callable[[Peer], T]) -> T:
        """Runs one algorithm over this collective's links.

        Raises:
            ClientClosedError: the collective was ended.
            PSError: what the algorithm raised (or a better verdict from upstream).
        """
        if not self._open:
            raise ClientClosedError("this collective has ended")
        try:
            return body(self._peer)
        except Exception as exc:
            self._fail(exc)

    def close(self) -> None:
        """Waits until the right neighbour holds every chunk sent, then frees the ring.

        Raises:
            WaitTimeoutError, PSError: as ``RightLink.flush``.
        """
        if not self._open:
            return
        try:
            self._peer.finish(self._ring.timeout)
        except Exception as exc:
            self._fail(exc)
        self._end()

    def abort(self, error: Exception) -> None:
        """Gives up this collective (and the ring) with ``error``, telling the neighbours, so
        their waits end with it instead of timing out. Does nothing once ended. It may be
        called from another thread than the one running a part, which then fails with it."""
        if not self._open:
            return
        with contextlib.suppress(Exception):  # the caller raises its own error
            self._fail(error)

    def _fail(self, exc: Exception) -> NoReturn:
        """Settles the failure, ends the collective and raises the verdict."""
        ring = self._ring
        try:
            failure = ring._settle(self._peer, exc)
            ring._failure = failure
        finally:
            self._end()
        if failure.error is exc:
            raise exc
        raise failure.error from exc

    def _end(self) -> None:
        with self._ending:
            if self._open:
                self._open = False
                self._ring._lock.release()


class Ring:
    """A worker's place in a ring of workers that all-reduce over gRPC.

    Every worker builds one with its rank and the same address list (index = rank), then all
    call the same collectives in the same order. Every wait is bounded by ``timeout`` seconds;
    a dead or silent peer makes each rank raise an error naming it (rank and address) instead
    of hanging. After a failed collective the ring is unusable: close it and build another.
    Not thread-safe: one collective at a time per ring.
    """

    def __init__(
        self,
        rank: int,
        addresses: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        chunk_bytes: int = algorithm.RING_CHUNK_BYTES,
        server: RingServer | None = None,
        bind: str | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        """Starts (or takes over) this rank's server and connects to the right neighbour.

        ``security`` is this worker's TLS and token settings (``ClientSecurity.from_env``):
        its neighbour is called with them, and its own server (when the ring starts it) serves
        with ``security.peer_server()``: TLS with the same certificate, mutual when a CA is
        given, and the same token. None: plaintext, no token.

        Args:
            rank: this worker's index in ``addresses``.
            addresses: ``host:port`` of every worker's ring server, in rank order.
            timeout: seconds any one wait may take (connecting, receiving, delivering).
            chunk_bytes: the most bytes per message; a message's send overlaps the next one's
                reduction, so a smaller segment travels in a few chunks of at least 1 MiB.
            server: an already started server (needed when it bound port 0); the ring owns
                it from now on and stops it on close.
            bind: where to listen when no server is given; defaults to ``addresses[rank]``.

        Raises:
            ConfigError: bad rank, empty addresses, non-positive timeout, or chunk_bytes out of
                range.
            UnavailableError: the right neighbour accepted no connection within ``timeout``.
            RuntimeError: the server could not bind.
        """
        if not addresses:
            raise ConfigError("a ring needs at least one worker address")
        if not 0 <= rank < len(addresses):
            raise ConfigError(f"rank must be in [0, {len(addresses)}), got {rank}")
        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0, got {timeout}")
        if not 1 <= chunk_bytes <= MAX_MESSAGE_BYTES // 2:
            raise ConfigError(f"chunk_bytes must be in [1, {MAX_MESSAGE_BYTES // 2}]")
        self.rank = rank
        self.addresses = list(addresses)
        self.world_size = len(self.addresses)
        self.timeout = float(timeout)
        self.chunk_bytes = chunk_bytes
        # Long enough for a verdict from further upstream to overtake ours, short against timeout.
        self._grace = min(1.0, self.timeout / 4)
        self.security = security or ClientSecurity()
        if server is None:
            server = RingServer(bind or self.addresses[rank], security=self.security.peer_server())
        self._server = server
        self._server.attach(rank, self.world_size, self.describe, self.timeout)
        self._lock = threading.Lock()
        self._next_op = 0
        self._failure: Failure | None = None
        self._closed = False
        self._link: RightLink | None = None
        self._aborting = False  # a broken stream then must not displace the abort's verdict
        if self.world_size > 1:
            try:
                self._link = RightLink(
                    self.addresses[self.right_rank],
                    sender=rank,
                    right=self.describe(self.right_rank),
                    me=self.describe(rank),
                    timeout=self.timeout,
                    security=self.security,
                    on_failure=self._link_failed,
                )
            except BaseException:
                self._server.stop(0)
                raise

    # -- who is who --------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """Where this rank's server listens."""
        return self._server.address

    @property
    def left_rank(self) -> int:
        return (self.rank - 1) % self.world_size

    @property
    def right_rank(self) -> int:
        return (self.rank + 1) % self.world_size

    def describe(self, rank: int) -> str:
        """How errors name a rank: "rank 2 at 10.0.0.3:7070"."""
        if 0 <= rank < self.world_size:
            return f"rank {rank} at {self.addresses[rank]}"
        return f"rank {rank}"

    # -- collectives -------------------------------------------------------------------------

    def allreduce(
        self,
        array: np.ndarray,
        *,
        inplace: bool = False,
        bfloat16: bool = False,
        divisor: int = 1,
        source: np.ndarray | None = None,
    ) -> np.ndarray:
        """The sum of ``array`` over all ranks, divided by ``divisor`` (the world size for a
        mean: each rank divides the segment it completes, ``algorithm.allreduce``).

        Args:
            array: float16/float32/float64 of any shape, identical shape and dtype on every
                rank; or uint16 bfloat16 bit patterns with ``bfloat16=True``.
            inplace: write the sum into ``array`` (which must be C-contiguous and writeable)
                instead of a copy.
            bfloat16: ``array`` holds bfloat16 values as uint16 bit patterns.
            divisor: what the sum is divided by (1: the plain sum).
            source: this rank's values when they are not ``array``'s (same size and dtype,
                contiguous; unchanged until this returns): ``array`` only receives the result,
                with no copy of ``source`` into it first (use with ``inplace``).

        Returns:
            The sum (over ``divisor``), with ``array``'s shape and dtype; bit-identical on
            every rank.

        Raises:
            ValueError: ``inplace`` with an array that cannot be written in place.
            InvalidRequestError: unsupported dtype, or ranks disagree on shape or dtype.
            WaitTimeoutError, UnavailableError: a peer is silent or gone; the message names it.
        """
        arr = np.asarray(array)
        algorithm.check_sum_dtype(arr.dtype, bfloat16)
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor}")
        buffer = self._flat(arr, inplace)
        flat_source = None if source is None else np.asarray(source).reshape(-1)
        self.allreduce_many([algorithm.Part(buffer, bfloat16, divisor, flat_source)])
        return arr if inplace else buffer.reshape(arr.shape)

    def allreduce_many(self, parts: Sequence[algorithm.Part]) -> None:
        """Sums every part's flat buffer in place (each as ``allreduce(inplace=True)`` with
        the part's options would, bit for bit) in one collective: one start and one flush for
        all of them, and the pipeline kept full from one buffer to the next.

        Args:
            parts: ``algorithm.Part`` each: a contiguous, writeable 1-D buffer, and its
                ``bfloat16``, ``divisor`` and ``source``; ``chunk_bytes`` is the ring's (each
                part's segments cut into a few pipelined chunks, as ``allreduce``'s).

        Raises:
            ValueError, InvalidRequestError, WaitTimeoutError, UnavailableError: as
                ``allreduce``, for any part (checked before anything is sent).
        """
        collective = self.open_collective()
        collective.allreduce(parts)
        collective.close()

    def open_collective(self) -> Collective:
        """Starts a collective whose parts are summed a few at a time (``Collective``): the
        same exchange, tag for tag, as ``allreduce_many`` of all of them, so ranks may run one
        step's buckets as each is ready while another sums them all at once. Until its
        ``close`` the ring runs nothing else (another collective waits for it, up to
        ``timeout``).

        Raises:
            ClientClosedError: the ring was closed.
            PSError: the ring failed earlier.
            WaitTimeoutError: another collective held the ring for ``timeout`` seconds.
        """
        if not self._lock.acquire(timeout=self.timeout):
            raise WaitTimeoutError(
                f"{self.describe(self.rank)}: another collective held the ring for "
                f"{self.timeout:g} s"
            )
        try:
            self._check_usable()
            op = self._next_op
            self._next_op += 1
            self._server.current_op = op  # the server takes chunks of this and the next one
        except BaseException:
            self._lock.release()
            raise
        return Collective(self, _OpPeer(self, op))

    def broadcast(self, array: np.ndarray, root: int = 0, *, inplace: bool = False) -> np.ndarray:
        """``root``'s ``array`` on every rank, bit for bit (e.g. to start replicas identical).

        Args:
            array: any dtype and shape, identical on every rank (the content matters only on
                ``root``).
            root: the rank whose values win.
            inplace: overwrite ``array`` on the other ranks instead of returning a copy.

        Raises:
            ValueError: ``root`` out of range, or ``inplace`` with an unwritable array.
            InvalidRequestError: ranks disagree on the array's size.
            WaitTimeoutError, UnavailableError: a peer is silent or gone; the message names it.
        """
        if not 0 <= root < self.world_size:
            raise ValueError(f"root must be in [0, {self.world_size}), got {root}")
        arr = np.asarray(array)
        buffer = self._flat(arr, inplace)
        self._collective(
            lambda peer: algorithm.broadcast(
                peer,
                buffer,
                root,
                timeout=self.timeout,
                chunk_bytes=pipeline_chunk(self.chunk_bytes, buffer.nbytes),
            )
        )
        return arr if inplace else buffer.reshape(arr.shape)

    def barrier(self) -> None:
        """Returns once every rank has entered the barrier.

        Raises:
            InvalidRequestError: the ranks disagree on the world size.
            WaitTimeoutError, UnavailableError: a peer is silent or gone; the message names it.
        """
        count = self.allreduce(np.ones(1, dtype=np.float64))
        if count[0] != self.world_size:
            raise InvalidRequestError(
                f"barrier counted {count[0]:g} ranks, this rank expects {self.world_size}; do "
                "all workers use the same list of addresses?"
            )

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self, grace: float = 1.0) -> None:
        """Lets pending aborts reach the right neighbour, then stops the stream and server."""
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.close(grace)
        self._server.stop(grace)

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    @staticmethod
    def _flat(arr: np.ndarray, inplace: bool) -> np.ndarray:
        if not inplace:
            return np.array(arr, order="C", copy=True).reshape(-1)
        if not arr.flags.c_contiguous or not arr.flags.writeable:
            raise ValueError("inplace needs a C-contiguous, writeable array")
        return arr.reshape(-1)

    def _collective(self, body: Callable[[Peer], T]) -> T:
        collective = self.open_collective()
        result = collective.run(body)
        collective.close()
        return result

    def _check_usable(self) -> None:
        if self._closed:
            raise ClientClosedError("the ring is closed: this worker's client was closed")
        if self._failure is not None:
            cls = type(self._failure.error)
            raise cls(f"the ring failed earlier and cannot be used: {self._failure.error}")

    def _settle(self, peer: _OpPeer, exc: Exception) -> Failure:
        """Agrees on the best explanation of a failure and passes it to the right neighbour.

        A rank that merely waited in vain for its left neighbour may be one of several stalled
        behind the real culprit; it waits a short grace for a verdict from further upstream,
        which names the culprit, before raising.
        """
        mailbox = self._server.mailbox
        held = mailbox.failure
        if held is None or held.error is not exc:
            error = exc if isinstance(exc, PSError) else PSError(f"{exc!r}")
            weight = 0 if exc is peer.recv_timeout else CERTAIN
            mailbox.fail(Failure(error, weight, self.rank, str(error)))
        failure = mailbox.failure
        assert failure is not None
        if self._link is None:
            return failure
        self._aborting = True
        peer.abort(failure)
        deadline = time.monotonic() + self._grace
        while failure.weight < CERTAIN:
            better = mailbox.wait_failure(failure.weight, deadline - time.monotonic())
            if better is None:
                break
            failure = better
            peer.abort(failure)
        return failure

    def _link_failed(self, error: PSError) -> None:
        """The stream to the right neighbour broke: every wait of this rank fails at once."""
        if not self._aborting:
            self._server.mailbox.fail(Failure(error, CERTAIN, self.rank, str(error)))
