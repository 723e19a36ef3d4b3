"""PushPull messages, as protobuf objects when small and built and read by hand when large.

A table step carries a MiB of rows each way. protobuf's Python objects copy such a tensor's
bytes three times on the way out (the chunk's bytes, the append into the message, the
serialization) and once on the way in; the hand-coded form is the same wire format with one
copy out and none in (a chunk's data views the received message). Below ``SMALL_BYTES``
protobuf's C codec is faster than a field walk in Python (bench/NOTES.md 8), so small steps
keep it. Both forms read back into objects with the same attributes (``header``, ``chunks``,
``timeout_ms``, ``rows``; ``push``, ``chunks``, ``clock``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pscore.tables import RowSparse
from pswire.codec import indices_bytes, tensor_to_proto
from pswire.proto import ps_pb2
from pswire.wiremsg import (
    ALIGN,
    ChunkRuns,
    WireChunk,
    len_field,
    padding,
    piece_parts,
    spans,
    varint_field,
    whole_chunk,
)

SMALL_BYTES = 64 << 10
# PushPullRequest: header 1, chunks 2, timeout_ms 3, rows 40; PushPullResponse: push 1,
# chunks 2, clock 3.
_HEADER = _PUSH = 1
_CHUNKS = 2
_TIMEOUT = _CLOCK = 3
_ROWS = 40


class StepRequest:
    """A PushPullRequest read by hand: chunk data and row ids view the received message."""

    __slots__ = ("chunks", "header", "rows", "timeout_ms")

    def __init__(self) -> None:
        self.header = ps_pb2.PushHeader()
        self.chunks: list[WireChunk] = []
        self.timeout_ms = 0
        self.rows: list[RowAsk] = []


class RowAsk:
    """A RowQuery read by hand: ``ids`` views the received message."""

    __slots__ = ("ids", "table")

    def __init__(self) -> None:
        self.table = ""
        self.ids: memoryview | bytes = b""


class StepReply:
    """A PushPullResponse read by hand: chunk data views the received message."""

    __slots__ = ("chunks", "clock", "push")

    def __init__(self) -> None:
        self.push = ps_pb2.PushResponse()
        self.chunks: list[WireChunk] = []
        self.clock = 0


def _add_tensor(
    parts: list[bytes | memoryview], key: str, piece: np.ndarray | RowSparse, at: int, align: bool
) -> int:
    """Appends a piece (a table's rows with their ids) as one ``chunks`` field starting at
    byte ``at`` of its message, its data aligned there when ``align``; returns where the
    next field starts."""
    values, ids, bf16 = piece_parts(piece)
    raw = indices_bytes(ids) if ids is not None and len(ids) else b""
    more, size = whole_chunk(key, values, _CHUNKS, bf16, raw, at if align else None)
    parts += more
    return at + size


def request(
    header: ps_pb2.PushHeader,
    pieces: Mapping[str, np.ndarray | RowSparse],
    rows: Sequence[ps_pb2.RowQuery],
    timeout_ms: int,
) -> bytes | ps_pb2.PushPullRequest:
    """A PushPullRequest: the header, every piece whole, this step's ``timeout_ms`` and the
    table rows to read after the push."""
    if sum(p.nbytes for p in pieces.values()) < SMALL_BYTES:
        return request_message(header, pieces, rows, timeout_ms)
    parts: list[bytes | memoryview] = [len_field(_HEADER, header.SerializeToString())]
    at = len(parts[0])
    for key, piece in pieces.items():
        at = _add_tensor(parts, key, piece, at, align=True)
    parts.append(varint_field(_TIMEOUT, timeout_ms))
    parts += [len_field(_ROWS, q.SerializeToString()) for q in rows]
    return b"".join(parts)


def request_message(
    header: ps_pb2.PushHeader,
    pieces: Mapping[str, np.ndarray | RowSparse],
    rows: Sequence[ps_pb2.RowQuery],
    timeout_ms: int,
) -> ps_pb2.PushPullRequest:
    """``request`` as a protobuf object, whatever its size (a small step's form)."""
    message = ps_pb2.PushPullRequest(header=header, timeout_ms=timeout_ms, rows=rows)
    for key, piece in pieces.items():
        values, ids, bf16 = piece_parts(piece)
        message.chunks.append(tensor_to_proto(key, values, bf16, ids))
    return message


def parse_request(data: bytes) -> ps_pb2.PushPullRequest | StepRequest:
    """Reads a PushPullRequest (protobuf's parser when small).

    Raises:
        ValueError, protobuf's DecodeError: malformed bytes.
    """
    if len(data) < SMALL_BYTES:
        return ps_pb2.PushPullRequest.FromString(data)
    out = StepRequest()
    buf = memoryview(data)
    runs = ChunkRuns(buf, ps_pb2.PushPullRequest)
    for field, wire, value, start, end in spans(buf):
        if field == _CHUNKS and isinstance(value, memoryview):
            runs.add(value, start, end)
            continue
        if field == _TIMEOUT:
            if not isinstance(value, int):
                raise ValueError(f"PushPullRequest.timeout_ms has wire type {wire}")
            out.timeout_ms = value & 0xFFFFFFFF
            continue
        if field not in (_HEADER, _CHUNKS, _ROWS):
            continue  # unknown fields are ignored, as protobuf does
        if not isinstance(value, memoryview):
            raise ValueError(f"PushPullRequest field {field} has wire type {wire}")
        if field == _HEADER:
            out.header.MergeFromString(bytes(value))  # repeated: merged, as protobuf does
        else:
            out.rows.append(_parse_row_query(value))
    out.chunks = runs.finish()
    return out


def _parse_row_query(buf: memoryview) -> RowAsk:
    ask = RowAsk()
    for field, wire, value, _, _ in spans(buf):
        if field not in (1, 2):
            continue
        if not isinstance(value, memoryview):
            raise ValueError(f"RowQuery field {field} has wire type {wire}")
        if field == 1:
            ask.table = bytes(value).decode("utf-8")
        else:
            ask.ids = value
    return ask


class ReplyTensors:
    """A PushPull reply's tensors, encoded under the shard's lock (see ``reply_tensors``)."""

    __slots__ = ("chunks", "parts")

    def __init__(self) -> None:
        self.chunks: list[ps_pb2.TensorChunk] = []  # small replies
        self.parts: list[bytes | memoryview] = []  # large ones


def reply_tensors(arrays: Mapping[str, np.ndarray], owned: frozenset[str]) -> ReplyTensors:
    """The reply's tensors as a snapshot: each array's bytes copied once, except those named in
    ``owned`` (table rows gathered for this reply: already a copy), which are referenced."""
    out = ReplyTensors()
    if sum(a.nbytes for a in arrays.values()) < SMALL_BYTES:
        out.chunks = [tensor_to_proto(key, array) for key, array in arrays.items()]
        return out
    # The reply starts with the push's result, whose size is not known yet: each tensor's
    # data is aligned from where the tensors start, and ``reply`` pads the result to keep it.
    at = 0
    for key, array in arrays.items():
        parts, size = whole_chunk(key, array, _CHUNKS, False, b"", at)
        if key not in owned:
            parts[3] = bytes(parts[3])  # the data: copied while the shard's lock is held
        out.parts += parts
        at += size
    return out


def reply(
    push: ps_pb2.PushResponse, tensors: ReplyTensors, clock: int
) -> bytes | ps_pb2.PushPullResponse:
    """A PushPullResponse: the push's result, the tensors, the clock they were read at."""
    if not tensors.parts:
        return ps_pb2.PushPullResponse(push=push, chunks=tensors.chunks, clock=clock)
    head = len_field(_PUSH, push.SerializeToString())
    if len(head) % ALIGN:  # a padding field keeps the tensors' data aligned
        head += padding((-len(head) - len(padding(0))) % ALIGN)
    return b"".join([head, *tensors.parts, varint_field(_CLOCK, clock)])


def parse_reply(data: bytes) -> ps_pb2.PushPullResponse | StepReply:
    """Reads a PushPullResponse (protobuf's parser when small).

    Raises:
        ValueError, protobuf's DecodeError: malformed bytes.
    """
    if len(data) < SMALL_BYTES:
        return ps_pb2.PushPullResponse.FromString(data)
    out = StepReply()
    buf = memoryview(data)
    runs = ChunkRuns(buf, ps_pb2.PushPullResponse)
    for field, wire, value, start, end in spans(buf):
        if field == _CHUNKS and isinstance(value, memoryview):
            runs.add(value, start, end)
        elif field == _CLOCK:
            if not isinstance(value, int):
                raise ValueError(f"PushPullResponse.clock has wire type {wire}")
            out.clock = value
        elif field in (_PUSH, _CHUNKS):
            if not isinstance(value, memoryview):
                raise ValueError(f"PushPullResponse field {field} has wire type {wire}")
            if field == _PUSH:
                out.push.MergeFromString(bytes(value))
    out.chunks = runs.finish()
    return out
