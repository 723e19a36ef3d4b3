"""Tensor bytes on Arrow Flight: the DoExchange framing both ends share, and errors both ways.

A data call is one Flight ``DoExchange`` whose descriptor command names the operation
(``PUSH_PULL``, ``PUSH``, ``PULL``; ``STREAMED``: a push_pull whose tensors follow as
backward produces them; ``PIPELINED``: the same, its reply streaming back meanwhile) and that
carries any number of steps in turn. A step is a header and a byte stream:

- the header is the request's protobuf, as app metadata of the step's first message:
  ``PushPullRequest`` for a push, whose ``chunks`` are the tensors' manifest (name, dtype,
  shape, total_bytes and a table's row ids, no data), ``PullRequest`` for a pull; the shard's
  reply is a ``PushPullResponse`` (the push's result, the clock, the manifest of the weights);
- the byte stream is every manifest tensor's raw little-endian bytes, in manifest order, cut
  into record batches of one non-null ``uint8`` column: the first rides with the header, the
  rest carry no metadata. A large tensor travels in batches over its own memory (no copy,
  ``pa.py_buffer``); small tensors share one batch, so a small step is one message each way.

A small step (``STEP``) is framed otherwise: the step stream's own request and reply
(pswire/write.py, pswire/read.py) as the app metadata of one message each way.

A received batch is read as a view of the buffer gRPC received into; the shared
``ChunkAssembler`` checks and assembles each tensor's bytes exactly as it does for the grpcio
messages.

Errors: a ``PSError`` travels as the Flight error of its status where Flight has one
(UNAUTHENTICATED, DEADLINE_EXCEEDED, CANCELLED, UNAVAILABLE, INTERNAL), else as a
``FlightServerError`` (gRPC UNKNOWN); either way its ``extra_info`` carries the status name,
the class and the message, so the worker raises the very class the shard raised.
"""

from __future__ import annotations

import ctypes
import hmac
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
from google.protobuf.message import DecodeError, Message

from pscore.checks import tensor_nbytes
from pscore.tables import RowSparse
from pswire.codec import ChunkAssembler
from pswire.errors import (
    InvalidRequestError,
    PSError,
    TooLargeError,
    UnauthenticatedError,
    error_for_status,
)
from pswire.proto import ps_pb2
from pswire.security import TOKEN_HEADER, TOKEN_SCHEME, check_token
from pswire.write import indices_bytes, wire_bytes

log = logging.getLogger(__name__)

# Arrow's default pool (mimalloc) reserves ~1 GiB of address space at its first allocation: a
# worker or shard run under an address-space cap (ulimit -v, RLIMIT_AS) then cannot start a
# thread. Our batches wrap numpy memory or gRPC's buffers; what Arrow allocates itself is small,
# so the system allocator serves it (VmSize after a first allocation: 1.38 GB -> 0.33 GB). A
# process that chose its pool with $ARROW_DEFAULT_MEMORY_POOL keeps it.
if not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
    pa.set_memory_pool(pa.system_memory_pool())

SCHEMA = pa.schema([pa.field("bytes", pa.uint8(), nullable=False)])
PUSH_PULL = b"ps.push_pull/1"
# A push_pull streamed from backward (overlap=True), framed as PUSH_PULL: the shard reads it as
# it arrives, never holding it for its turn in a sync round (psserver/flight_service.py).
STREAMED = b"ps.push_pull_streamed/1"
# STREAMED, whose reply may stream back while the push still arrives: a sync round's next
# weights, each predicted as soon as every worker's gradient of it is in (psserver/pipeline.py).
# Such a reply's header carries no ``push``; after its tensors a trailer does (a message of
# metadata alone: a PushPullResponse with ``push`` and ``clock``). Where the shard cannot
# predict the round, the reply is STREAMED's.
PIPELINED = b"ps.push_pull_pipelined/1"
PUSH = b"ps.push/1"
PULL = b"ps.pull/1"
# A small step: the step stream's own messages (a PushPullRequest with its tensors' bytes
# inline, as pswire.write frames it, and the PushPullResponse) as the app metadata of one
# message each way, with no record batch: the shortest way a small model's step can travel
# (bench/NOTES.md entry 36).
STEP = b"ps.step/1"
COMMANDS = (PUSH_PULL, STREAMED, PIPELINED, PUSH, PULL, STEP)
# A record batch's largest body: the bench's sweep (bench/flight.py --piece-mib) found 1-4 MiB
# alike and 16 MiB slower (less overlap, larger buffers to fault in).
PIECE_BYTES = 4 << 20
# Tensors under this size share record batches (copied together): a message costs far more
# than copying a few KiB, and a small model's step is then one message each way.
PACK_BYTES = 64 << 10
_SEP = b"\x00"
# glibc's mallopt parameters, and what ``tune_malloc`` sets them to: blocks up to two batches
# come from the heap (larger ones, such as a model's arrays, are still mapped and unmapped
# alone), and up to 16 batches of free heap stay mapped for the next message.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MALLOC_MMAP_BYTES = 2 * PIECE_BYTES
MALLOC_TRIM_BYTES = 16 * PIECE_BYTES
_tuned: bool | None = None


def tune_malloc(environ: Mapping[str, str] | None = None) -> bool:
    """Keeps the blocks every Flight message passes through in glibc's heap, for the next
    message to reuse, instead of unmapped and faulted back in (whether it took effect).

    Receiving a message, gRPC reads the socket into buffers of up to a few MiB and Arrow
    copies a message that arrived in pieces into one; freed, glibc unmaps such blocks or trims
    them off its heaps, and the next message faults every page in again (and the kernel
    zeroes it). At 25M params a worker took 12,000-22,000 page faults per step, ~40 ms of its
    CPU (bench/NOTES.md entry 34). Process-wide, once: the worker's first Flight link, its
    ring server (all-reduce mode) and the shard daemon call it. Left alone without glibc,
    with ``$PS_TUNE_MALLOC=0``, or where the process chose these settings itself
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or ``GLIBC_TUNABLES`` naming
    either).
    """
    global _tuned
    if _tuned is None:
        _tuned = _malloc_ours(os.environ if environ is None else environ) and _mallopt(
            (_M_TRIM_THRESHOLD, MALLOC_TRIM_BYTES),  # first: setting either ends glibc's
            (_M_MMAP_THRESHOLD, MALLOC_MMAP_BYTES),  # own adjustment of both
        )
    return _tuned


def _malloc_ours(env: Mapping[str, str]) -> bool:
    """Whether ``tune_malloc`` may set glibc's thresholds: not switched off, not the user's."""
    if env.get("PS_TUNE_MALLOC", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    tunables = env.get("GLIBC_TUNABLES", "")
    names = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    return not any(n in env for n in names) and not any(
        t in tunables for t in ("mmap_threshold", "trim_threshold")
    )


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's ``mallopt`` of each (parameter, value) in turn; False without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  # glibc only
    except (OSError, AttributeError):
        return False
    return all(bool(libc.mallopt(param, value)) for param, value in settings)


class Piece(NamedTuple):
    """One received piece of a tensor, shaped as ``ChunkAssembler.add`` reads a chunk."""

    name: str
    dtype: str
    shape: Any
    total_bytes: int
    offset: int
    data: memoryview
    indices: bytes


# -- building and reading record batches --------------------------------------------------------


def as_batch(data: np.ndarray) -> pa.RecordBatch:
    """A record batch over ``data``'s bytes (C-contiguous), without a copy."""
    raw = data.reshape(-1).view(np.uint8)
    column = pa.Array.from_buffers(pa.uint8(), len(raw), [None, pa.py_buffer(raw)])
    return pa.RecordBatch.from_arrays([column], schema=SCHEMA)


def batch_bytes(batch: pa.RecordBatch | None, where: str) -> memoryview:
    """The bytes a received record batch carries, as a view of the received buffer.

    Raises:
        InvalidRequestError: no batch, or not one non-null uint8 column.
    """
    if batch is None:
        raise InvalidRequestError(f"{where}: expected a record batch of tensor bytes, got none")
    if batch.num_columns != 1 or batch.schema.field(0).type != pa.uint8():
        raise InvalidRequestError(
            f"{where}: a tensor batch has one uint8 column, got schema {batch.schema}"
        )
    column = batch.column(0)
    if column.null_count:
        raise InvalidRequestError(f"{where}: a tensor batch holds {column.null_count} nulls")
    values = column.buffers()[1]
    if values is None:
        return memoryview(b"")
    return memoryview(values)[column.offset : column.offset + len(column)]


def parse(message: type[Message], raw: Any, where: str) -> Any:
    """A protobuf message from a Flight message's app metadata.

    Raises:
        InvalidRequestError: missing or undecodable.
    """
    if raw is None:
        raise InvalidRequestError(f"{where}: expected a {message.__name__} header, got none")
    try:
        return message.FromString(raw.to_pybytes() if hasattr(raw, "to_pybytes") else raw)
    except DecodeError as exc:
        raise InvalidRequestError(f"{where}: undecodable {message.__name__}: {exc}") from None


def encode_tensor(name: str, array: np.ndarray, ids: np.ndarray | None = None) -> Any:
    """(a tensor's manifest entry: a TensorChunk without data, its bytes as a uint8 array
    viewing ``array`` where it is C-contiguous little-endian). A uint16 array is bfloat16 bits.

    Raises:
        InvalidRequestError: a dtype the wire does not carry.
    """
    view, dtype, shape = wire_bytes(name, array, 1, array.dtype == np.uint16)
    entry = ps_pb2.TensorChunk(name=name, dtype=dtype, shape=shape, total_bytes=len(view))
    if ids is not None:
        entry.indices = indices_bytes(ids)
    return entry, np.frombuffer(view, dtype=np.uint8)


def manifest_entry(name: str, dtype: str, shape: Sequence[int]) -> Any:
    """A tensor's manifest entry from its wire dtype and shape alone: a step streamed from
    backward announces its tensors before they exist.

    Raises:
        InvalidRequestError: a dtype the wire does not carry, or a bad shape.
    """
    dims = [int(d) for d in shape]
    nbytes = tensor_nbytes(name, dtype, dims)
    return ps_pb2.TensorChunk(name=name, dtype=dtype, shape=dims, total_bytes=nbytes)


def check_manifest(entries: Any, max_bytes: int | None, where: str) -> int:
    """Checks every tensor of a step before any of its bytes is read; returns the total bytes.

    Raises:
        InvalidRequestError: a bad dtype or shape, a size that does not match them, a name
            twice.
        TooLargeError: more bytes than ``max_bytes``.
    """
    total, seen = 0, set()
    for e in entries:
        if e.name in seen:
            raise InvalidRequestError(f"{where}: variable '{e.name}' appears twice in one step")
        seen.add(e.name)
        nbytes = tensor_nbytes(e.name, e.dtype, e.shape)
        if e.total_bytes != nbytes:
            raise InvalidRequestError(
                f"{where}: variable '{e.name}' declares {e.total_bytes} bytes but dtype "
                f"{e.dtype} and shape {tuple(e.shape)} make {nbytes}"
            )
        total += nbytes
        if max_bytes is not None and total > max_bytes:
            raise TooLargeError(
                f"{where}: request reaches {total} bytes at variable '{e.name}', over the "
                f"limit of {max_bytes}"
            )
    return total


# -- a step's tensors, both ways ----------------------------------------------------------------


Span = tuple[int, int, int]  # (index in a step's tensors, first byte, end byte)


def write_step(
    writer: Any,
    header: bytes,
    raws: Sequence[np.ndarray],
    piece_bytes: int,
    read: Callable[[list[Span]], np.ndarray] | None = None,
) -> None:
    """Writes one step: ``header`` (a serialized request or reply) riding on the first record
    batch, the tensors' bytes (``encode_tensor``'s uint8 arrays) as one stream in order.

    A tensor of at least ``PACK_BYTES`` goes out in batches of at most ``piece_bytes`` over its
    own memory (no copy); runs of smaller tensors are packed into one batch (one small copy),
    so a small model's step is a single message. A step without bytes is the header alone.

    ``read``: ``raws`` view memory that others change (a shard's live variables): each batch
    is ``read(spans)``, a new array holding those spans of ``raws`` taken just before it is
    written (under the shard's lock), so a few batches are copies at a time, never the whole
    step. gRPC may still hold a batch after ``write_batch`` returns, so a batch is never
    written from memory that changes.
    """
    step = StepWriter(writer, header, piece_bytes, read)
    step.write(raws)
    step.close()


class StepWriter:
    """One step written as its tensors come (``write_step`` writes them all at once): the
    header, then each call's tensors in manifest order, batched as ``write_step`` describes
    (a run of small tensors packed within one call), then ``close``. A step streamed from
    backward sends ``header()`` first and each gradient's bytes as backward produces it; the
    reader (``read_step``) cannot tell the difference."""

    def __init__(
        self,
        writer: Any,
        header: bytes,
        piece_bytes: int,
        read: Callable[[list[Span]], np.ndarray] | None = None,
    ) -> None:
        self._writer = writer
        self._meta: bytes | None = header
        self._piece = max(1, piece_bytes)
        self._read = read
        self._raws: list[np.ndarray] = []  # every tensor written so far: spans index it

    def header(self) -> None:
        """Sends the header now, alone (the tensors follow in later batches)."""
        if self._meta is not None:
            self._writer.write_metadata(self._meta)
            self._meta = None

    def write(self, raws: Sequence[np.ndarray]) -> None:
        """Writes ``raws`` (uint8 arrays, the next tensors of the manifest) in order; a run of
        small ones is packed into one batch, flushed before this returns."""
        pending: list[Span] = []  # small tensors waiting to be packed
        size = 0
        for raw in raws:
            i = len(self._raws)
            self._raws.append(raw)
            if not raw.nbytes:
                continue
            if raw.nbytes < PACK_BYTES:
                if size + raw.nbytes > self._piece:
                    self._send(pending)
                    pending, size = [], 0
                pending.append((i, 0, raw.nbytes))
                size += raw.nbytes
                continue
            self._send(pending)
            pending, size = [], 0
            for offset in range(0, raw.nbytes, self._piece):
                self._send([(i, offset, min(offset + self._piece, raw.nbytes))])
        self._send(pending)

    def close(self) -> None:
        """Ends the step: the header alone if no batch carried it."""
        self.header()

    def _send(self, spans: list[Span]) -> None:
        if not spans:
            return
        raws = self._raws
        if self._read is not None:
            data = self._read(spans)
        elif len(spans) == 1:
            i, start, end = spans[0]
            data = raws[i][start:end]
        else:
            data = np.concatenate([raws[i][start:end] for i, start, end in spans])
        if self._meta is None:
            self._writer.write_batch(as_batch(data))
        else:
            self._writer.write_with_metadata(as_batch(data), self._meta)
            self._meta = None


def read_step(
    reader: Any,
    first: Any,
    entries: Any,
    assembler: ChunkAssembler,
    where: str,
    placed: Callable[[str], None] | None = None,
    completed: Callable[[str, np.ndarray], None] | None = None,
) -> dict[str, np.ndarray]:
    """Reads a step's tensors, in manifest order, from the stream of record batches that
    began with ``first`` (the batch the header rode on, or None), into ``assembler``;
    ``completed(name, array)`` as each tensor is complete, then ``placed(name)`` if it is
    complete in its ``into`` array (the caller may use it while the rest still arrives).

    Raises:
        InvalidRequestError: the stream ended mid-step, bytes left over after the last
            tensor, or a later batch carrying metadata.
    """
    data = batch_bytes(first, where) if first is not None else memoryview(b"")
    for e in entries:
        received = 0
        while True:
            need = e.total_bytes - received
            if need and not data:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    raise InvalidRequestError(
                        f"{where}: stream ended in variable '{e.name}' after {received} of "
                        f"{e.total_bytes} bytes"
                    ) from None
                if chunk.app_metadata is not None and chunk.app_metadata.size:
                    raise InvalidRequestError(
                        f"{where}: a header arrived in '{e.name}' after {received} of "
                        f"{e.total_bytes} bytes"
                    )
                data = batch_bytes(chunk.data, where)
            take = data[:need]
            data = data[len(take) :]
            # A Piece reads as a TensorChunk to the assembler (duck-typed, as WireChunk).
            piece: Any = Piece(
                e.name,
                e.dtype,
                e.shape,
                e.total_bytes,
                received,
                take,
                e.indices if received == 0 else b"",
            )
            assembler.add(piece)
            received += len(take)
            if received >= e.total_bytes:
                if completed is not None:
                    completed(e.name, assembler.completed(e.name))
                if placed is not None and assembler.placed(e.name):
                    placed(e.name)
                break
    if data:
        raise InvalidRequestError(
            f"{where}: {len(data)} bytes left over after the step's last tensor"
        )
    return assembler.finish()


def encode_tensors(
    tensors: Mapping[str, np.ndarray | RowSparse],
) -> tuple[list[Any], dict[str, np.ndarray]]:
    """(the manifest, each tensor's bytes) of a step's tensors; a table's rows with their ids.

    Raises:
        InvalidRequestError: a dtype the wire does not carry.
    """
    entries, raws = [], {}
    for name, t in tensors.items():
        if isinstance(t, RowSparse):
            entry, raw = encode_tensor(name, t.values, t.ids)
        else:
            entry, raw = encode_tensor(name, t)
        entries.append(entry)
        raws[name] = raw
    return entries, raws


# -- errors ------------------------------------------------------------------------------------

_FLIGHT_ERROR = {
    "UNAUTHENTICATED": flight.FlightUnauthenticatedError,
    "DEADLINE_EXCEEDED": flight.FlightTimedOutError,
    "CANCELLED": flight.FlightCancelledError,
    "UNAVAILABLE": flight.FlightUnavailableError,
    "INTERNAL": flight.FlightInternalError,
}
_STATUS_OF = {cls: status for status, cls in _FLIGHT_ERROR.items()}


def to_flight_error(exc: BaseException, where: str) -> flight.FlightError:
    """The Flight error a shard raises for ``exc``: a PSError keeps its status and class (in
    ``extra_info``); anything else is INTERNAL with a sanitized message, traceback logged."""
    if isinstance(exc, flight.FlightError) and not isinstance(exc, PSError):
        return exc
    if not isinstance(exc, PSError):
        log.error("unexpected error in %s", where, exc_info=exc)
        exc = PSError(f"internal error in {where}: {type(exc).__name__}")
    status = exc.status
    cls = _FLIGHT_ERROR.get(status, flight.FlightServerError)
    info = _SEP.join((status.encode(), type(exc).__name__.encode(), str(exc).encode()))
    return cls(str(exc), extra_info=info)


def from_flight_error(exc: BaseException, where: str = "") -> PSError:
    """The worker's PSError for a failed Flight call, its status and class as the shard raised
    them (or, from Flight itself, the status its error class stands for)."""
    prefix = f"{where}: " if where else ""
    info = getattr(exc, "extra_info", None) or b""
    parts = info.split(_SEP, 2)
    if len(parts) == 3:
        status, name, message = (p.decode("utf-8", "replace") for p in parts)
        return error_for_status(status, prefix + message, name)
    status = next((s for c, s in _STATUS_OF.items() if isinstance(exc, c)), "UNKNOWN")
    if isinstance(exc, pa.ArrowInvalid):
        status = "INVALID_ARGUMENT"
    # Flight appends gRPC's debug context to the message: keep the first line.
    message = str(exc).split(". Detail:", 1)[0]
    return error_for_status(status, prefix + message)


def request_timeout(timeout_ms: int, margin_s: float) -> float | None:
    """The shard's wait for a step: the request's own deadline less a margin, or None."""
    return max(0.0, timeout_ms / 1000 - margin_s) if timeout_ms else None


class TokenCheck(flight.ServerMiddlewareFactory):
    """Refuses every call whose ``authorization: Bearer <token>`` header is missing or wrong,
    before the handler reads a byte (UNAUTHENTICATED), compared in constant time: the one
    token rule of every Flight server (a shard's data port, a ring rank). ``who`` names the
    server in the message (``server``, ``ring rank``); ``op`` the operation."""

    def __init__(self, token: str, who: str, op: str) -> None:
        super().__init__()
        self._expected = (TOKEN_SCHEME + check_token(token)).encode("ascii")
        self._who, self._op = who, op

    def start_call(self, info: Any, headers: Mapping[str, list[Any]]) -> None:
        values = headers.get(TOKEN_HEADER, [])
        given = values[0] if values else b""
        given = given.encode("utf-8", "replace") if isinstance(given, str) else bytes(given)
        # compare_digest whatever the length: timing must not leak the token.
        if not hmac.compare_digest(given, self._expected) or len(values) != 1:
            problem = (
                f"this {self._who} requires a token: pass token=... to psworker.connect, or "
                "set $PS_TOKEN / $PS_TOKEN_FILE"
                if not values
                else f"the token this call carries is not this {self._who}'s token"
            )
            log.warning("refused Flight %s: %s", info.method, problem)
            raise to_flight_error(UnauthenticatedError(problem), self._op)
