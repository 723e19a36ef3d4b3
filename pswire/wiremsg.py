"""Tensor stream messages encoded and parsed by hand, byte-identical to protobuf.

Push/Init requests and Pull responses are almost all tensor bytes. protobuf's Python objects
copy those bytes three times on the way out (slice, message, serialize) and twice on the way
in. The functions below produce and read the very same wire format (proto3, fields in number
order, defaults omitted: byte-identical to SerializeToString, which a test checks) with one
copy out and none in: a parsed chunk's data is a memoryview into the received message.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from pscore.tables import RowSparse
from pswire.codec import DEFAULT_CHUNK_BYTES, indices_bytes, wire_bytes

_WIRE_VARINT, _WIRE_LEN = 0, 2
_BYTE = tuple(bytes((i,)) for i in range(256))
# whole_chunk_parts(at=...): tensor bytes start this aligned within their message, behind a
# padding field, reserved in ps.proto (TensorChunk, PushPullResponse) and skipped by readers.
ALIGN = 16
PAD_FIELD = 41


def _varint(value: int) -> bytes:
    if 0 <= value < 128:
        return _BYTE[value]
    if value < 0:
        value += 1 << 64  # int64: two's complement, ten bytes
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint((field << 3) | wire)


def len_field(field: int, payload: bytes) -> bytes:
    """One encoded length-delimited field."""
    return _tag(field, _WIRE_LEN) + _varint(len(payload)) + payload


def piece_parts(piece: np.ndarray | RowSparse) -> tuple[np.ndarray, np.ndarray | None, bool]:
    """(a pushed piece's values, a table's row ids or None, whether the values are bfloat16
    bit patterns: a uint16 piece is a compressed gradient, as no gradient is an integer)."""
    if isinstance(piece, RowSparse):
        return piece.values, piece.ids, piece.values.dtype == np.uint16
    return piece, None, piece.dtype == np.uint16


def encode_chunk_messages(
    name: str,
    array: np.ndarray,
    outer_field: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bfloat16: bool = False,
    trailer: bytes = b"",
    indices: np.ndarray | None = None,
) -> Iterator[bytes]:
    """Serialized messages each holding one TensorChunk of ``array`` in field ``outer_field``.

    ``trailer`` is appended to every message: fields after the chunk, already encoded (e.g. a
    PullResponse's clock). ``indices``: row ids of a row-sparse tensor (first chunk). Equal,
    byte for byte, to building the protobuf objects from ``tensor_to_chunks`` and serializing
    them.

    Raises:
        ValueError, InvalidRequestError: as ``tensor_to_chunks``.
    """
    ids = indices_bytes(indices) if indices is not None and len(indices) else b""
    for head, data in _chunk_fields(name, array, chunk_bytes, bfloat16):
        yield b"".join((*_chunk_parts(outer_field, head, data, ids), trailer))
        ids = b""  # first chunk only


def whole_chunk_parts(
    name: str,
    array: np.ndarray,
    outer_field: int,
    bfloat16: bool = False,
    indices: np.ndarray | None = None,
    at: int | None = None,
) -> list[bytes | memoryview]:
    """The pieces of one field ``outer_field`` holding ``array`` whole as one TensorChunk (the
    first message ``encode_chunk_messages`` would make with no chunk limit), not yet joined:
    the array's bytes are a view of it, so a message joining pieces of several tensors copies
    each byte once.

    ``at``: where the field starts in its message. The array's bytes then start at a multiple
    of ``ALIGN`` bytes from the message's start, behind a padding field (number
    ``PAD_FIELD``, which readers skip as an unknown field): a receiver decoding them in place
    gets an aligned array (numpy's BLAS and fast loops need one; bench/NOTES.md 19).

    Raises:
        ValueError, InvalidRequestError: as ``tensor_to_chunks``.
    """
    ids = indices_bytes(indices) if indices is not None and len(indices) else b""
    return whole_chunk(name, array, outer_field, bfloat16, ids, at)[0]


def whole_chunk(
    name: str,
    array: np.ndarray,
    outer_field: int,
    bfloat16: bool,
    ids: bytes,
    at: int | None,
) -> tuple[list[bytes | memoryview], int]:
    """``whole_chunk_parts`` with the row ids already as bytes, and the parts' total size:
    a message of many tensors is built in time linear in their number (each tensor's place
    is the running size, never a sum over what came before).

    Raises:
        ValueError, InvalidRequestError: as ``tensor_to_chunks``.
    """
    view, dtype, dims = wire_bytes(name, array, 1, bfloat16)
    size = len(view)
    if not ids:
        # Without row ids a tensor's framing depends on where it starts only modulo ALIGN:
        # looked up, it costs a small tensor a dict lookup instead of a dozen steps.
        key = (name, dtype, dims, outer_field, -1 if at is None or not size else at % ALIGN)
        frame = _FRAMES.get(key)
        if frame is None:
            outer, head, data_field, _, total = _framed(
                name, dtype, dims, size, outer_field, b"", at
            )
            frame = outer, head, data_field, total
            if len(_FRAMES) >= _MAX_HEADS:
                _FRAMES.clear()
            _FRAMES[key] = frame
        return [frame[0], frame[1], frame[2], view, b""], frame[3]
    outer, head, data_field, ids_field, total = _framed(
        name, dtype, dims, size, outer_field, ids, at
    )
    return [outer, head, data_field, view, ids_field], total


def _framed(
    name: str,
    dtype: str,
    dims: tuple[int, ...],
    size: int,
    outer_field: int,
    ids: bytes,
    at: int | None,
) -> tuple[bytes, bytes, bytes, bytes, int]:
    """``whole_chunk``'s parts but for the data (outer tag and length, head with its padding,
    data tag and length, row ids field), and the total size with the data."""
    head, data_field = _head(name, dtype, dims, size)
    ids_field = len_field(7, ids) if ids else b""
    inner = len(head) + len(data_field) + size + len(ids_field)
    tag = _OUTER_TAG.get(outer_field) or _tag(outer_field, _WIRE_LEN)
    if at is not None and size:
        before = at + len(head) + len(data_field) + len(tag)  # the data, but for the length
        if (before + _varint_size(inner)) % ALIGN:
            pad = _pad_size(before, inner)
            padded = _PADDING[pad] if pad < len(_PADDING) else padding(pad)
            head += padded
            inner += len(padded)
    outer = tag + _varint(inner)
    return outer, head, data_field, ids_field, len(outer) + inner


def _pad_size(before: int, inner: int) -> int:
    """The smallest padding that puts the data at a multiple of ``ALIGN``: ``before`` is where
    it starts but for the chunk's length varint, ``inner`` the chunk's length unpadded."""
    low = inner + _PAD_TAG_SIZE + 1  # the padded length with ``size`` 0
    if _varint_size(low) == _varint_size(low + ALIGN):
        # Every size below ALIGN pads by 3 + size bytes under a length varint of one size:
        # exactly one of them aligns, and it is the smallest that does.
        return -(before + _PAD_TAG_SIZE + 1 + _varint_size(low)) % ALIGN
    for size in range(2 * ALIGN):  # a length varint that grows with the padding
        pad = _PAD_TAG_SIZE + _varint_size(size) + size
        if (before + pad + _varint_size(inner + pad)) % ALIGN == 0:
            return size
    raise AssertionError("unreachable: one of 2 * ALIGN paddings aligns the data")


def padding(size: int) -> bytes:
    """A field of ``size`` zero bytes numbered ``PAD_FIELD``, which readers skip."""
    return len_field(PAD_FIELD, bytes(size))


_PAD_TAG_SIZE = len(_tag(PAD_FIELD, _WIRE_LEN))
_PADDING = tuple(padding(size) for size in range(2 * ALIGN))
_OUTER_TAG = {field: _tag(field, _WIRE_LEN) for field in (1, 2)}
_DATA_TAG = _tag(6, _WIRE_LEN)
# A TensorChunk's encoded fields 1-4 (name, dtype, shape, total bytes) and its data field's
# tag and length, by (name, dtype, shape): the same tensors travel every step, and building
# these bytes was most of a small tensor's encoding. Bounded: a stream of ever new names (a
# misbehaving peer) empties it rather than growing it.
_HEADS: dict[tuple[str, str, tuple[int, ...]], tuple[bytes, bytes]] = {}
_MAX_HEADS = 1 << 17
# A whole tensor's framing without row ids (outer tag and length, head with its padding, data
# tag and length; total size) by (name, dtype, shape, outer field, its start modulo ALIGN).
_FRAMES: dict[tuple[str, str, tuple[int, ...], int, int], tuple[bytes, bytes, bytes, int]] = {}


def _head(name: str, dtype: str, dims: tuple[int, ...], total: int) -> tuple[bytes, bytes]:
    """(fields 1-4 of a whole tensor's chunk, its data field's tag and length), encoded."""
    key = (name, dtype, dims)
    found = _HEADS.get(key)
    if found is None:
        head = len_field(1, name.encode()) if name else b""
        head += len_field(2, dtype.encode())
        if dims:
            head += len_field(3, b"".join(_varint(d) for d in dims))
        if total:
            head += _tag(4, _WIRE_VARINT) + _varint(total)
        found = head, _data_tag(total) if total else b""
        if len(_HEADS) >= _MAX_HEADS:
            _HEADS.clear()
        _HEADS[key] = found
    return found


def _data_tag(size: int) -> bytes:
    return _DATA_TAG + _varint(size)


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _chunk_parts(
    outer_field: int, head: bytes, data: memoryview, ids: bytes
) -> list[bytes | memoryview]:
    data_field = _data_tag(len(data)) if len(data) else b""
    ids_field = len_field(7, ids) if ids else b""
    inner_len = len(head) + len(data_field) + len(data) + len(ids_field)
    outer = _tag(outer_field, _WIRE_LEN) + _varint(inner_len)
    return [outer, head, data_field, data, ids_field]


def _chunk_fields(
    name: str, array: np.ndarray, chunk_bytes: int, bfloat16: bool
) -> Iterator[tuple[bytes, memoryview]]:
    """(fields 1-5 of a TensorChunk, encoded; its data as a view) for each chunk."""
    view, dtype, dims = wire_bytes(name, array, chunk_bytes, bfloat16)
    total = len(view)
    first = _head(name, dtype, dims, total)[0]
    offset = 0
    while True:
        end = min(offset + chunk_bytes, total)
        head = first if offset == 0 else _tag(5, _WIRE_VARINT) + _varint(offset)
        yield head, view[offset:end]
        offset = end
        if offset >= total:
            return


class WireChunk:
    """A parsed TensorChunk whose ``data`` is a view into the received message (no copy)."""

    __slots__ = ("data", "dtype", "indices", "name", "offset", "shape", "total_bytes")

    def __init__(self) -> None:
        self.name = ""
        self.dtype = ""
        self.shape: list[int] = []
        self.total_bytes = 0
        self.offset = 0
        self.data: memoryview | bytes = b""
        self.indices: memoryview | bytes = b""


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("message ends inside a varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than ten bytes")


def _int64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) for each field; skips nothing, checks every length."""
    for field, wire, value, _, _ in spans(buf):
        yield field, wire, value


def spans(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview, int, int]]:
    """(field number, wire type, value, where the field starts, where it ends) for each
    field; checks every length. A length-delimited value is a view of ``buf``."""
    pos = 0
    end = len(buf)
    while pos < end:
        start = pos
        key = buf[pos]
        if key < 0x80:  # one-byte keys and lengths: nearly all of them, read inline
            pos += 1
        else:
            key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire == _WIRE_LEN:
            if pos < end and buf[pos] < 0x80:
                size = buf[pos]
                pos += 1
            else:
                size, pos = _read_varint(buf, pos)
            if pos + size > end:
                raise ValueError("length-delimited field runs past the message")
            yield field, wire, buf[pos : pos + size], start, pos + size
            pos += size
        elif wire == _WIRE_VARINT:
            value, pos = _read_varint(buf, pos)
            yield field, wire, value, start, pos
        elif wire == 1:  # fixed64: not ours, skipped as protobuf would
            pos += 8
        elif wire == 5:  # fixed32
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if pos != end:
        raise ValueError("message ends inside a fixed-width field")


# A chunk field smaller than this is read by protobuf's parser, with its neighbours in one
# call (its bytes copied: cheap at this size); a larger one by ``parse_chunk`` without a copy.
# A step of 15,000 four-float tensors took 8 us per tensor read by hand, 1 us this way.
RUN_BYTES = 4096


class ChunkRuns:
    """The ``chunks`` fields of one message, in order, as they are met in ``spans``: each run
    of adjacent small ones parsed by protobuf in one call (``container``: a message whose
    field ``field`` is its repeated TensorChunk), each large one by ``parse_chunk``."""

    def __init__(self, buf: memoryview, container: Any) -> None:
        self.chunks: list[Any] = []
        self._buf = buf
        self._parse = container.FromString
        self._start = self._end = -1

    def add(self, value: memoryview, start: int, end: int) -> None:
        """Takes the chunk field at ``buf[start:end]``, whose body is ``value``.

        Raises:
            ValueError, protobuf's DecodeError: a malformed chunk (maybe on a later call).
        """
        if len(value) >= RUN_BYTES:
            self.finish()
            self.chunks.append(parse_chunk(value))
            return
        if start != self._end:  # not adjacent to the run: another field came between
            self.finish()
            self._start = start
        self._end = end

    def finish(self) -> list[Any]:
        """Parses the pending run; returns every chunk so far."""
        if self._start >= 0:
            self.chunks.extend(self._parse(self._buf[self._start : self._end]).chunks)
            self._start = self._end = -1
        return self.chunks


def parse_chunk(buf: memoryview) -> WireChunk:
    """Reads a TensorChunk as protobuf would (last value wins; packed or unpacked shape).

    Raises:
        ValueError: the bytes are not a valid TensorChunk.
    """
    chunk = WireChunk()
    for field, wire, value in _fields(buf):
        if field in (1, 2, 6, 7):
            if wire != _WIRE_LEN:
                raise ValueError(f"TensorChunk field {field} has wire type {wire}")
            assert isinstance(value, memoryview)
            if field == 6:
                chunk.data = value
            elif field == 7:
                chunk.indices = value
            else:
                text = bytes(value).decode("utf-8")  # raises like protobuf on bad UTF-8
                if field == 1:
                    chunk.name = text
                else:
                    chunk.dtype = text
        elif field == 3:
            if wire == _WIRE_LEN:
                assert isinstance(value, memoryview)
                pos = 0
                while pos < len(value):
                    dim, pos = _read_varint(value, pos)
                    chunk.shape.append(_int64(dim))
            elif wire == _WIRE_VARINT:
                assert isinstance(value, int)
                chunk.shape.append(_int64(value))
            else:
                raise ValueError(f"TensorChunk field 3 has wire type {wire}")
        elif field in (4, 5):
            if wire != _WIRE_VARINT:
                raise ValueError(f"TensorChunk field {field} has wire type {wire}")
            assert isinstance(value, int)
            if field == 4:
                chunk.total_bytes = value
            else:
                chunk.offset = value
    return chunk


def varint_field(field: int, value: int) -> bytes:
    """One encoded varint field (empty for 0, which proto3 omits)."""
    return _tag(field, _WIRE_VARINT) + _varint(value) if value else b""


def parse_message(data: bytes) -> Iterator[tuple[int, int, int | memoryview]]:
    """The fields of a serialized message (for the stream messages' own parsers)."""
    return _fields(memoryview(data))
