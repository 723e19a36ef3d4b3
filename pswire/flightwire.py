"""Tensor bytes on Arrow Flight: the DoExchange framing both ends share, and errors both ways.

A data call is one Flight ``DoExchange`` whose descriptor command names the operation
(``PUSH_PULL``, ``PUSH``, ``PULL``) and that carries any number of steps in turn. A step is:

- from the worker, a metadata-only message holding the request's protobuf (``PushPullRequest``
  for a push, whose ``chunks`` are the tensors' manifest: name, dtype, shape, total_bytes and a
  table's row ids, with no data; ``PullRequest`` for a pull), then, for each manifest entry in
  order, one or more record batches of the tensor's bytes;
- from the shard, a metadata-only ``PushPullResponse`` (the push's result, the clock, the
  manifest of the weights sent back), then the weights' record batches the same way.

A record batch has one column of ``uint8``: a tensor's raw little-endian bytes, whatever its
dtype, built over the array's memory without a copy (``pa.py_buffer``); its app metadata is a
``TensorChunk`` holding the tensor's name and the byte offset of the batch. A received batch
is read as a view of the buffer gRPC received into; the shared ``ChunkAssembler`` checks and
assembles the pieces exactly as it does for the grpcio messages.

Errors: a ``PSError`` travels as the Flight error of its status where Flight has one
(UNAUTHENTICATED, DEADLINE_EXCEEDED, CANCELLED, UNAVAILABLE, INTERNAL), else as a
``FlightServerError`` (gRPC UNKNOWN); either way its ``extra_info`` carries the status name,
the class and the message, so the worker raises the very class the shard raised.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
from google.protobuf.message import DecodeError, Message

from pswire.codec import ChunkAssembler, indices_bytes, tensor_nbytes, wire_bytes
from pswire.errors import InvalidRequestError, PSError, TooLargeError, error_for_status
from pswire.proto import ps_pb2
from pswire.tables import RowSparse

log = logging.getLogger(__name__)

SCHEMA = pa.schema([pa.field("bytes", pa.uint8(), nullable=False)])
PUSH_PULL = b"ps.push_pull/1"
PUSH = b"ps.push/1"
PULL = b"ps.pull/1"
COMMANDS = (PUSH_PULL, PUSH, PULL)
# A record batch's largest body: the bench's sweep (bench/flight.py --piece-mib) found 1-4 MiB
# alike and 16 MiB slower (less overlap, larger buffers to fault in).
PIECE_BYTES = 4 << 20
_SEP = b"\x00"


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


def write_tensors(writer: Any, tensors: Mapping[str, np.ndarray], piece_bytes: int) -> None:
    """Writes each tensor's bytes (``encode_tensor``'s uint8 arrays) as record batches of at
    most ``piece_bytes`` each, at least one per tensor."""
    step = max(1, piece_bytes)
    for name, raw in tensors.items():
        for offset in range(0, max(1, raw.nbytes), step):
            meta = ps_pb2.TensorChunk(name=name, offset=offset).SerializeToString()
            writer.write_with_metadata(as_batch(raw[offset : offset + step]), meta)


def read_tensors(
    reader: Any, entries: Any, assembler: ChunkAssembler, where: str
) -> dict[str, np.ndarray]:
    """Reads the record batches of every manifest entry into ``assembler``; returns its arrays.

    Raises:
        InvalidRequestError: a batch of another tensor or offset, too many or too few bytes,
            or the stream ended mid-step.
    """
    for e in entries:
        received = 0
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                raise InvalidRequestError(
                    f"{where}: stream ended in variable '{e.name}' after {received} of "
                    f"{e.total_bytes} bytes"
                ) from None
            meta = parse(ps_pb2.TensorChunk, chunk.app_metadata, where)
            if meta.name != e.name:
                raise InvalidRequestError(
                    f"{where}: a batch of '{meta.name}' where '{e.name}' was due"
                )
            data = batch_bytes(chunk.data, where)
            first = received == 0
            # A Piece reads as a TensorChunk to the assembler (duck-typed, as WireChunk).
            piece: Any = Piece(
                e.name,
                e.dtype,
                e.shape,
                e.total_bytes,
                meta.offset,
                data,
                e.indices if first else b"",
            )
            assembler.add(piece)
            received += len(data)
            if received >= e.total_bytes:
                break
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
