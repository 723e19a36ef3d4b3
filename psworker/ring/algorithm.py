"""Ring all-reduce and broadcast over an abstract ``Peer``: the algorithm, with no networking."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pswire.codec import bfloat16_to_float32, float32_to_bfloat16
from pswire.errors import (
    InvalidRequestError,
    PSError,
)
from psworker.ring.peer import Failure, LocalPeer, Peer, Tag, local_peers

DEFAULT_TIMEOUT_S = 30.0
# 4 MiB messages: over gRPC each message costs ~0.6 ms of CPU on top of its bytes (thread
# hand-offs on both ends), so 1 MiB chunks spent a third of a 4-rank all-reduce on messages;
# a 64 MiB buffer over 4 ranks still travels as 4 pipelined chunks per segment (bench/NOTES.md).
RING_CHUNK_BYTES = 4 << 20
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_BF16_BITS = np.dtype(np.uint16)
# A chunk is measured as it is written in pieces of this many elements (256 KiB of float32),
# each dotted while it is still in cache.
_MEASURE_PIECE = 1 << 16


def segment_bounds(length: int, world_size: int) -> np.ndarray:
    """Start offsets of ``world_size`` near-equal segments of ``length`` elements, then the end.

    Segment i is ``[b[i], b[i+1])``; sizes differ by at most one, and some are empty when
    ``length`` < ``world_size``.
    """
    return np.arange(world_size + 1, dtype=np.int64) * length // world_size


def _chunks(bounds: np.ndarray, segment: int, chunk: int) -> Iterator[tuple[int, int, int]]:
    lo, hi = int(bounds[segment]), int(bounds[segment + 1])
    for k, start in enumerate(range(lo, hi, chunk)):
        yield k, start, min(start + chunk, hi)


def _receive(peer: Peer, tag: Tag, timeout: float, count: int, dtype: np.dtype) -> np.ndarray:
    got = peer.recv_from_left(tag, timeout)
    if got.dtype != dtype or got.shape != (count,):
        raise InvalidRequestError(
            f"rank {peer.rank}: {peer.left} sent {got.size} elements of {got.dtype} for step "
            f"{tag.step}, segment {tag.segment}, chunk {tag.chunk}; expected {count} of {dtype}. "
            "Do all ranks pass buffers of the same length and dtype?"
        )
    return got


def _check_buffer(buffer: np.ndarray, writeable: bool) -> None:
    if buffer.ndim != 1 or not buffer.flags.c_contiguous:
        raise ValueError(
            f"the ring needs a contiguous 1-D buffer, got shape {buffer.shape} "
            f"(contiguous: {buffer.flags.c_contiguous}); use .reshape(-1) on a contiguous array"
        )
    if writeable and not buffer.flags.writeable:
        raise ValueError("the ring writes its result into the buffer, which is read-only")


def check_sum_dtype(dtype: np.dtype, bfloat16: bool = False) -> None:
    """Checks that ``allreduce`` can sum this dtype.

    Raises:
        InvalidRequestError: not float16/float32/float64, nor uint16 bits with ``bfloat16``.
    """
    if bfloat16:
        if dtype != _BF16_BITS:
            raise InvalidRequestError(f"bfloat16 buffers travel as uint16 bits, got {dtype}")
    elif dtype not in (_F16, _F32, _F64):
        raise InvalidRequestError(
            f"all-reduce sums float16, bfloat16, float32 or float64, got {dtype}"
        )


@dataclass(frozen=True)
class Part:
    """One buffer of ``allreduce_many``, with its own options (as ``allreduce``'s arguments).

    Each part keeps its own segments (``segment_bounds`` of its own length), so each element is
    summed in the same order as by ``allreduce`` of that buffer alone: the same bits.
    """

    buffer: np.ndarray
    bfloat16: bool = False
    divisor: int = 1
    source: np.ndarray | None = None
    chunk_bytes: int = RING_CHUNK_BYTES
    # When given (float32/float64 parts), the result's sum of squares is appended to it: each
    # piece dotted with itself as it is written (in cache, no pass of its own), the pieces'
    # sums added in the buffer's order, so every rank gets the same value. (A finite value
    # proves the result finite: the caller's checks need not read it again.)
    measure: list[float] | None = None


def allreduce(
    peer: Peer,
    buffer: np.ndarray,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    chunk_bytes: int = RING_CHUNK_BYTES,
    bfloat16: bool = False,
    divisor: int = 1,
    source: np.ndarray | None = None,
) -> np.ndarray:
    """Sums ``buffer`` over every rank of the ring, in place: reduce-scatter, then all-gather.

    The buffer is cut into ``world_size`` segments; after ``world_size - 1`` reduce-scatter steps
    rank r holds the full sum of segment r+1, and ``world_size - 1`` all-gather steps pass each
    finished segment around. Each segment travels in sub-chunks of about ``chunk_bytes``, and a
    sub-chunk is sent on as soon as it is reduced, so the send of one overlaps the reduction of
    the next and the two phases overlap too. float16 and bfloat16 are summed in float32 (partial
    sums travel as float32; finished segments in the buffer's own 16 bits); float32 and float64
    in their own precision. Every rank ends with identical bits. With ``divisor`` n the sum
    is divided by n (a mean with n = world size) by the rank that completes each segment, just
    before its all-gather: each rank divides 1/world of the buffer, and the result is the same
    bits as dividing the sum afterwards (``sum / dtype(n)``). With ``source`` this rank's
    values are read from it and the result written to ``buffer`` (out of place, at no extra
    pass: each element of ``buffer`` is written before it is read), so a caller's array needs
    no copy into a buffer first; ``source`` must not change until this returns.

    Args:
        peer: this rank's links; every rank must call with the same length, dtype and options.
        buffer: contiguous 1-D float16/float32/float64 array, or uint16 bfloat16 bit patterns
            with ``bfloat16=True``. Overwritten with the sum.
        timeout: seconds any single receive may wait.
        chunk_bytes: sub-chunk size in bytes of the accumulator dtype.
        bfloat16: ``buffer`` holds bfloat16 values as uint16 bit patterns.
        divisor: divide the sum by this (1: the plain sum).
        source: this rank's values, if not ``buffer``'s: same length and dtype, contiguous.

    Returns:
        ``buffer``, now holding the sum over ranks (divided by ``divisor``).

    Raises:
        ValueError: the buffer is not contiguous, 1-D and writeable, ``chunk_bytes`` < 1 or
            ``divisor`` < 1.
        InvalidRequestError: unsupported dtype, or a neighbour sent a chunk of another size or
            dtype (ranks disagree on the buffer).
        PSError: whatever the peer raises (``WaitTimeoutError`` for a silent neighbour).
    """
    part = Part(buffer, bfloat16, divisor, source, chunk_bytes)
    allreduce_many(peer, [part], timeout=timeout)
    return buffer


def allreduce_many(
    peer: Peer, parts: Sequence[Part], *, timeout: float = DEFAULT_TIMEOUT_S, first: int = 0
) -> list[np.ndarray]:
    """``allreduce`` of several buffers in one pass of the ring: each ring step passes every
    part's chunks before the next step, so the pipeline never drains between buffers, and a
    caller pays one collective's start and end for a step's buckets, flags and digest together.

    Each part is cut into its own segments and summed exactly as ``allreduce`` of it alone
    would (the same bits, whatever the other parts). Part ``first + i`` tags its segment ``s``
    as ``(first + i) * world_size + s``, so parts of one collective never share a tag, and a
    collective's parts may also be run a few at a time, in order (``first`` counts those
    already run): the same exchange and the same bits. Every rank must run them alike (all at
    once, or in the same turns): a rank that runs step s of every part before step s+1 waits
    for the next part's step s while a rank in turns waits for this part's step s+1. Every
    part is checked before anything is sent.

    Returns:
        Each part's buffer, now holding its sum (divided by its divisor), in ``parts``' order.

    Raises:
        As ``allreduce``, for any part.
    """
    world, rank = peer.world_size, peer.rank
    plans = [_Reduction(part, world, first + i) for i, part in enumerate(parts)]
    if world == 1:
        for plan in plans:
            plan.alone()
            plan.report()
        return [part.buffer for part in parts]
    last_step = 2 * world - 3
    # Reduce-scatter: step s receives segment r-s-1, adds it, and passes it on at step s+1.
    for plan in plans:
        for tag, lo, hi in plan.chunks(0, rank):
            peer.send_to_right(tag, plan.own[lo:hi])
    for step in range(world - 1):
        segment = (rank - step - 1) % world
        for plan in plans:
            acc, own = plan.acc, plan.own
            for tag, lo, hi in plan.chunks(step, segment):
                got = _receive(peer, tag, timeout, hi - lo, acc.dtype)
                np.add(own[lo:hi], got, out=acc[lo:hi])
                if step < world - 2:
                    peer.send_to_right(tag._replace(step=step + 1), acc[lo:hi])
                else:
                    # segment == r+1 is complete here: store it and start its all-gather at once.
                    plan.finish(tag, lo, hi)
                    peer.send_to_right(tag._replace(step=world - 1), plan.buffer[lo:hi])
    # All-gather: step world-1+j receives finished segment r-j and passes it on.
    for step in range(world - 1, last_step + 1):
        segment = (rank - (step - world + 1)) % world
        for plan in plans:
            buffer = plan.buffer
            for tag, lo, hi in plan.chunks(step, segment):
                plan.store(tag, lo, hi, _receive(peer, tag, timeout, hi - lo, buffer.dtype))
                if step < last_step:
                    peer.send_to_right(tag._replace(step=step + 1), buffer[lo:hi])
    for plan in plans:
        plan.report()
    return [part.buffer for part in parts]


class _Reduction:
    """One part's working state in ``allreduce_many``: its accumulator, its own values, its
    segments and chunk size, and its place among the collective's parts (its tags)."""

    def __init__(self, part: Part, world: int, index: int) -> None:
        """Checks the part (nothing is sent before every part passed).

        Raises:
            ValueError, InvalidRequestError: as ``allreduce``.
        """
        buffer = part.buffer
        _check_buffer(buffer, writeable=True)
        if part.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {part.chunk_bytes}")
        check_sum_dtype(buffer.dtype, part.bfloat16)
        if part.divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {part.divisor}")
        if part.measure is not None and (part.bfloat16 or buffer.dtype not in (_F32, _F64)):
            raise ValueError(f"measure sums float32 or float64 squares, not {buffer.dtype}")
        src = buffer
        if part.source is not None:
            _check_buffer(part.source, writeable=False)
            if part.source.shape != buffer.shape or part.source.dtype != buffer.dtype:
                raise ValueError(
                    f"source is {part.source.shape} {part.source.dtype}, the buffer "
                    f"{buffer.shape} {buffer.dtype}: they must match"
                )
            src = part.source
        self.buffer, self.src = buffer, src
        self.bfloat16, self.divisor = part.bfloat16, part.divisor
        self.acc: np.ndarray = buffer  # where partial sums are made
        self.own: np.ndarray = src  # this rank's values, in acc's dtype
        if world > 1 and buffer.size:
            if part.bfloat16:
                self.acc = self.own = bfloat16_to_float32(src)
            elif buffer.dtype == _F16:
                self.acc = self.own = src.astype(_F32)
        self.bounds = segment_bounds(buffer.size, world)
        self.chunk = max(1, part.chunk_bytes // self.acc.itemsize)
        self.world, self.index = world, index
        self.measure = part.measure
        # Each chunk's sum of squares, in the buffer's order (segment by segment, chunk by
        # chunk): every rank writes every chunk once, so every rank fills every entry.
        self._first: list[int] = []
        self._dots = np.zeros(0, np.float64)
        if self.measure is not None:
            sizes = np.diff(self.bounds)
            counts = -(-sizes // self.chunk)
            self._first = (np.cumsum(counts) - counts).tolist()
            self._dots = np.zeros(int(counts.sum()), np.float64)

    def alone(self) -> None:
        """A ring of one: the result is this rank's values (divided)."""
        buffer = self.buffer
        if self.src is not buffer:
            np.copyto(buffer, self.src)
        if self.divisor != 1 and buffer.size:
            _divide(buffer, 0, buffer.size, self.divisor, self.bfloat16)
        if self.measure is not None:
            for segment in range(self.world):
                for k, lo, hi in _chunks(self.bounds, segment, self.chunk):
                    self._dots[self._first[segment] + k] = _dot(buffer[lo:hi])

    def report(self) -> None:
        """Appends the result's sum of squares to ``measure`` (when asked)."""
        if self.measure is not None:
            with np.errstate(over="ignore", invalid="ignore"):
                self.measure.append(float(np.sum(self._dots)))

    def store(self, tag: Tag, lo: int, hi: int, got: np.ndarray) -> None:
        """Writes a finished chunk received in the all-gather (and measures it, a cache-sized
        piece at a time, as it is written)."""
        buffer = self.buffer
        if self.measure is None:
            buffer[lo:hi] = got
            return
        total = 0.0
        for start in range(lo, hi, _MEASURE_PIECE):
            end = min(start + _MEASURE_PIECE, hi)
            piece = buffer[start:end]
            piece[...] = got[start - lo : end - lo]
            total += _dot(piece)
        self._dots[self._first[tag.segment % self.world] + tag.chunk] = total

    def chunks(self, step: int, segment: int) -> Iterator[tuple[Tag, int, int]]:
        """``(tag, lo, hi)`` of each chunk of ``segment`` at ring step ``step``."""
        named = self.index * self.world + segment
        for k, lo, hi in _chunks(self.bounds, segment, self.chunk):
            yield Tag(step, named, k), lo, hi

    def finish(self, tag: Tag, lo: int, hi: int) -> None:
        """A completed chunk: divided, and stored in the buffer's own dtype (and measured)."""
        acc, buffer = self.acc, self.buffer
        if self.divisor != 1:
            np.divide(acc[lo:hi], acc.dtype.type(self.divisor), out=acc[lo:hi])
        if acc is not buffer:
            buffer[lo:hi] = float32_to_bfloat16(acc[lo:hi]) if self.bfloat16 else acc[lo:hi]
        if self.measure is not None:
            self._dots[self._first[tag.segment % self.world] + tag.chunk] = _dot(buffer[lo:hi])


def _dot(piece: np.ndarray) -> float:
    """``piece``'s sum of squares (inf or NaN when it holds a non-finite value)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.dot(piece, piece))


def _divide(buffer: np.ndarray, lo: int, hi: int, divisor: int, bfloat16: bool) -> None:
    """``buffer[lo:hi] /= divisor`` as ``allreduce`` divides (16-bit values in float32)."""
    if bfloat16:
        buffer[lo:hi] = float32_to_bfloat16(bfloat16_to_float32(buffer[lo:hi]) / _F32.type(divisor))
    elif buffer.dtype == _F16:
        buffer[lo:hi] = buffer[lo:hi].astype(_F32) / _F32.type(divisor)
    else:
        np.divide(buffer[lo:hi], buffer.dtype.type(divisor), out=buffer[lo:hi])


def broadcast(
    peer: Peer,
    buffer: np.ndarray,
    root: int = 0,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    chunk_bytes: int = RING_CHUNK_BYTES,
) -> np.ndarray:
    """Copies ``root``'s buffer into every rank's, in place, pipelined chunk by chunk.

    Bytes are copied as they are, so any dtype works (bit-identical replicas).

    Args:
        peer: this rank's links.
        buffer: contiguous 1-D array of the same length and dtype on every rank; written on
            all ranks but ``root``.
        root: the rank whose buffer every rank ends with.
        timeout: seconds any single receive may wait.
        chunk_bytes: bytes per message.

    Returns:
        ``buffer``.

    Raises:
        ValueError: bad buffer, ``root`` out of range or ``chunk_bytes`` < 1.
        InvalidRequestError: a neighbour sent a chunk of another size (ranks disagree).
        PSError: whatever the peer raises.
    """
    world, rank = peer.world_size, peer.rank
    _check_buffer(buffer, writeable=rank != root)
    if not 0 <= root < world:
        raise ValueError(f"root must be in [0, {world}), got {root}")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if world == 1:
        return buffer
    data = buffer.view(np.uint8)
    bounds = np.array([0, data.size], dtype=np.int64)
    forward = (rank + 1) % world != root
    for k, lo, hi in _chunks(bounds, 0, chunk_bytes):
        if rank != root:
            data[lo:hi] = _receive(peer, Tag(0, root, k), timeout, hi - lo, data.dtype)
        if rank == root or forward:
            peer.send_to_right(Tag(0, root, k), data[lo:hi])
    return buffer


def run_local(
    world_size: int, body: Callable[[LocalPeer], np.ndarray], copy: bool = True
) -> list[np.ndarray]:
    """Runs ``body(peer)`` for every rank of an in-memory ring, one thread each; rank order.

    Raises:
        PSError: the first rank's error when any rank failed (the others are failed with it so
            no thread is left waiting).
    """
    peers = local_peers(world_size, copy)
    results: list[np.ndarray | None] = [None] * world_size
    errors: list[BaseException] = []  # in the order they happened: the first is the cause
    lock = threading.Lock()

    def run(peer: LocalPeer) -> None:
        try:
            results[peer.rank] = body(peer)
        except BaseException as exc:
            with lock:
                errors.append(exc)
            error = exc if isinstance(exc, PSError) else PSError(f"rank {peer.rank}: {exc!r}")
            for other in peers:
                other.fail(Failure(error, 1, peer.rank, str(exc)))

    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in peers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]
