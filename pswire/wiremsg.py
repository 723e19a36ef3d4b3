"""Tensor stream messages encoded and parsed by hand, byte-identical to protobuf.

Push/Init requests and Pull responses are almost all tensor bytes. protobuf's Python objects
copy those bytes three times on the way out (slice, message, serialize) and twice on the way
in. The functions below produce and read the very same wire format (proto3, fields in number
order, defaults omitted: byte-identical to SerializeToString, which a test checks) with one
copy out and none in: a parsed chunk's data is a memoryview into the received message.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from pswire.codec import DEFAULT_CHUNK_BYTES, indices_bytes, wire_bytes

_WIRE_VARINT, _WIRE_LEN = 0, 2
# whole_chunk_parts(at=...): tensor bytes start this aligned within their message, behind a
# padding field, reserved in ps.proto (TensorChunk, PushPullResponse) and skipped by readers.
ALIGN = 16
PAD_FIELD = 41


def _varint(value: int) -> bytes:
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


def _len_field(field: int, payload: bytes) -> bytes:
    return _tag(field, _WIRE_LEN) + _varint(len(payload)) + payload


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
    ((head, data),) = _chunk_fields(name, array, max(1, array.nbytes), bfloat16)
    if at is None or not len(data):
        return _chunk_parts(outer_field, head, data, ids)
    plain = _chunk_parts(outer_field, head, data, ids)
    inner = sum(len(p) for p in plain[1:])
    before = at + len(plain[1]) + len(plain[2])  # where the data starts, but for the outer
    tag = len(_tag(outer_field, _WIRE_LEN))
    if (before + tag + _varint_size(inner)) % ALIGN == 0:
        return plain
    for size in range(2 * ALIGN):  # a padding field of ``size`` zeros: 3 + size bytes
        pad = _PAD_TAG_SIZE + _varint_size(size) + size
        if (before + pad + tag + _varint_size(inner + pad)) % ALIGN == 0:
            return _chunk_parts(outer_field, head + padding(size), data, ids)
    raise AssertionError("unreachable: one of 2 * ALIGN paddings aligns the data")


def padding(size: int) -> bytes:
    """A field of ``size`` zero bytes numbered ``PAD_FIELD``, which readers skip."""
    return _len_field(PAD_FIELD, bytes(size))


_PAD_TAG_SIZE = len(_tag(PAD_FIELD, _WIRE_LEN))


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _chunk_parts(
    outer_field: int, head: bytes, data: memoryview, ids: bytes
) -> list[bytes | memoryview]:
    data_field = _tag(6, _WIRE_LEN) + _varint(len(data)) if len(data) else b""
    ids_field = _len_field(7, ids) if ids else b""
    inner_len = len(head) + len(data_field) + len(data) + len(ids_field)
    outer = _tag(outer_field, _WIRE_LEN) + _varint(inner_len)
    return [outer, head, data_field, data, ids_field]


def _chunk_fields(
    name: str, array: np.ndarray, chunk_bytes: int, bfloat16: bool
) -> Iterator[tuple[bytes, memoryview]]:
    """(fields 1-5 of a TensorChunk, encoded; its data as a view) for each chunk."""
    view, dtype, dims = wire_bytes(name, array, chunk_bytes, bfloat16)
    total = len(view)
    first = b""
    if name:
        first += _len_field(1, name.encode())
    first += _len_field(2, dtype.encode())
    if dims:
        first += _len_field(3, b"".join(_varint(d) for d in dims))
    if total:
        first += _tag(4, _WIRE_VARINT) + _varint(total)
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
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire == _WIRE_VARINT:
            value, pos = _read_varint(buf, pos)
            yield field, wire, value
        elif wire == _WIRE_LEN:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("length-delimited field runs past the message")
            yield field, wire, buf[pos : pos + size]
            pos += size
        elif wire == 1:  # fixed64: not ours, skipped as protobuf would
            pos += 8
        elif wire == 5:  # fixed32
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if pos != len(buf):
        raise ValueError("message ends inside a fixed-width field")


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
