"""Every ParameterServer message written, once: the field writers, a tensor's bytes and its
chunk framing, and each message the worker and the shard send.

One form per message: bytes built here, in protobuf's wire format (proto3, fields in number
order, defaults omitted), which protobuf's own parser and ``pswire.read`` both read: the
same bytes as protobuf's ``SerializeToString`` of the same message (tests check), except that
a step of ``SMALL_BYTES`` or more starts its tensors' data aligned behind a padding field
(``PAD_FIELD``, skipped by readers), so a receiver decoding them in place gets aligned arrays.
protobuf's Python objects would copy tensor bytes three times on the way out (slice, message,
serialize); here each byte is copied once, where the parts of a message are joined. A message
of many tensors is built in time linear in their number (bench/manyvars.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from pscore.checks import BFLOAT16, NUMPY_DTYPES, unsupported_dtype
from pscore.optspec import StepOptions
from pscore.tables import RowSparse
from pswire.codec import DEFAULT_CHUNK_BYTES
from pswire.proto import ps_pb2

# -- fields ------------------------------------------------------------------------------------

WIRE_VARINT, WIRE_LEN = 0, 2

_BYTE = tuple(bytes((i,)) for i in range(256))


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
    return _tag(field, WIRE_LEN) + _varint(len(payload)) + payload


def varint_field(field: int, value: int) -> bytes:
    """One encoded varint field (empty for 0, which proto3 omits)."""
    return _tag(field, WIRE_VARINT) + _varint(value) if value else b""


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


# PushPullRequest: header 1, chunks 2, timeout_ms 3, rows 40; PushPullResponse: push 1,
# chunks 2, clock 3; PushRequest, InitRequest, LoadStateRequest: header 1, chunk 2;
# PullResponse: chunk 1, clock 2.
HEADER = PUSH = 1
CHUNKS = 2
TIMEOUT = CLOCK = 3
ROWS = 40

# -- a tensor's bytes --------------------------------------------------------------------------

# bfloat16 has no numpy dtype: it travels as uint16 bit patterns and arrives widened to float32
# (exactly: bfloat16 is float32's top half). A numpy dtype's wire name, looked up per tensor.
_WIRE_NAME = {dt: name for name, dt in NUMPY_DTYPES.items() if name != BFLOAT16}
_WIRE_NAME[np.dtype("uint16")] = "uint16"  # bfloat16 bit patterns, before their label


def wire_bytes(
    name: str, array: np.ndarray, chunk_bytes: int, bfloat16: bool
) -> tuple[memoryview, str, tuple[int, ...]]:
    """(the array's little-endian bytes as a view, its wire dtype, its shape), validated.

    Raises:
        ValueError: ``chunk_bytes`` < 1, or ``bfloat16`` for a non-uint16 array.
        InvalidRequestError: the array's dtype is not a wire dtype.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    arr = np.asarray(array)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    dtype = _WIRE_NAME.get(arr.dtype)
    if bfloat16:
        if dtype != "uint16":
            raise ValueError(f"bfloat16 bit patterns are uint16, '{name}' is {arr.dtype}")
        dtype = BFLOAT16
    elif dtype is None or dtype == "uint16":  # uint16 travels only as bfloat16
        raise unsupported_dtype(arr.dtype.name, name)
    # memoryview's cast: a third of the time of reshape(-1).view(uint8).data (a small step
    # encodes thousands of tensors); it refuses zero-size shapes, which hold no bytes anyway.
    view = memoryview(arr).cast("B") if arr.size else memoryview(b"")  # type: ignore[arg-type]
    return view, dtype, arr.shape


def indices_bytes(indices: np.ndarray) -> bytes:
    return np.ascontiguousarray(indices, dtype="<i8").tobytes()


def tensor_to_chunks(
    name: str,
    array: np.ndarray,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bfloat16: bool = False,
    indices: np.ndarray | None = None,
) -> Iterator[ps_pb2.TensorChunk]:
    """Splits an array into wire chunks of at most ``chunk_bytes`` of data each.

    Only the slice being sent is copied into a message; the array itself is not duplicated.
    ``bfloat16``: the array holds bfloat16 bit patterns (uint16) and is labelled so.
    ``indices``: the row ids of a row-sparse tensor, carried by the first chunk.

    Raises:
        ValueError: ``chunk_bytes`` < 1.
        InvalidRequestError: the array's dtype is not a wire dtype.
    """
    view, dtype, dims = wire_bytes(name, array, chunk_bytes, bfloat16)
    total = len(view)
    shape = list(dims)
    offset = 0
    first = True
    while first or offset < total:
        end = min(offset + chunk_bytes, total)
        chunk = ps_pb2.TensorChunk(offset=offset, data=bytes(view[offset:end]))
        if first:
            chunk.name = name
            chunk.dtype = dtype
            chunk.shape.extend(shape)
            chunk.total_bytes = total
            if indices is not None:
                chunk.indices = indices_bytes(indices)
            first = False
        yield chunk
        offset = end


def tensor_to_proto(
    name: str, array: np.ndarray, bfloat16: bool = False, indices: np.ndarray | None = None
) -> ps_pb2.TensorChunk:
    """Encodes a whole array as a single chunk (small tensors only); arguments as
    ``tensor_to_chunks``, whose first chunk this equals."""
    view, dtype, dims = wire_bytes(name, array, 1, bfloat16)
    chunk = ps_pb2.TensorChunk(
        name=name, dtype=dtype, shape=dims, total_bytes=len(view), data=bytes(view)
    )
    if indices is not None:
        chunk.indices = indices_bytes(indices)
    return chunk


# -- a tensor's chunks, framed -----------------------------------------------------------------

# whole_chunk_parts(at=...): tensor bytes start this aligned within their message, behind a
# padding field, reserved in ps.proto (TensorChunk, PushPullResponse) and skipped by readers.
ALIGN = 16
PAD_FIELD = 41


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
    tag = _OUTER_TAG.get(outer_field) or _tag(outer_field, WIRE_LEN)
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


_PAD_TAG_SIZE = len(_tag(PAD_FIELD, WIRE_LEN))

_PADDING = tuple(padding(size) for size in range(2 * ALIGN))

_OUTER_TAG = {field: _tag(field, WIRE_LEN) for field in (1, 2)}

_DATA_TAG = _tag(6, WIRE_LEN)

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
            head += _tag(4, WIRE_VARINT) + _varint(total)
        found = head, _data_tag(total) if total else b""
        if len(_HEADS) >= _MAX_HEADS:
            _HEADS.clear()
        _HEADS[key] = found
    return found


def _data_tag(size: int) -> bytes:
    return _DATA_TAG + _varint(size)


def _chunk_parts(
    outer_field: int, head: bytes, data: memoryview, ids: bytes
) -> list[bytes | memoryview]:
    data_field = _data_tag(len(data)) if len(data) else b""
    ids_field = len_field(7, ids) if ids else b""
    inner_len = len(head) + len(data_field) + len(data) + len(ids_field)
    outer = _tag(outer_field, WIRE_LEN) + _varint(inner_len)
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
        head = first if offset == 0 else _tag(5, WIRE_VARINT) + _varint(offset)
        yield head, view[offset:end]
        offset = end
        if offset >= total:
            return


# -- the messages ------------------------------------------------------------------------------

# A step under this many bytes of tensors is written without alignment padding: its bytes are
# protobuf's own serialization of the message (small tensors gain nothing from alignment).
SMALL_BYTES = 64 << 10


def push_header(
    worker_id: int,
    step: int,
    incarnation: str | None,
    options: StepOptions | None,
    session: str = "",
    tensors: int = 0,
) -> ps_pb2.PushHeader:
    """A PushHeader, with ``options`` (hyper-parameter values, skip) when given, and the
    number of ``tensors`` a Push stream's chunks carry."""
    header = ps_pb2.PushHeader(
        worker_id=worker_id,
        step=step,
        incarnation=incarnation or "",
        session=session,
        tensors=tensors,
    )
    if options is not None:
        header.skip = options.skip
        for group, params in sorted(options.values.items()):
            if params:
                header.values.add(group=group, params=dict(params))
    return header


def push_stream(
    worker_id: int,
    step: int,
    pieces: Mapping[str, np.ndarray | RowSparse],
    chunk_bytes: int,
    incarnation: str | None = None,
    session: str = "",
    options: StepOptions | None = None,
) -> Iterator[bytes]:
    """A Push request stream: the header, then every piece as chunks (a table's rows with
    their ids).

    A uint16 piece is a gradient compressed to bfloat16 (no gradient is an integer).
    """
    header = push_header(worker_id, step, incarnation, options, session, len(pieces))
    yield len_field(HEADER, header.SerializeToString())
    for key, piece in pieces.items():
        array, ids, bf16 = piece_parts(piece)
        yield from encode_chunk_messages(key, array, CHUNKS, chunk_bytes, bf16, indices=ids)


def _add_tensor(
    parts: list[bytes | memoryview], key: str, piece: np.ndarray | RowSparse, at: int | None
) -> int:
    """Appends a piece (a table's rows with their ids) as one ``chunks`` field starting at
    byte ``at`` of its message (its data aligned there; ``None``: not aligned); returns the
    field's size."""
    values, ids, bf16 = piece_parts(piece)
    raw = indices_bytes(ids) if ids is not None and len(ids) else b""
    more, size = whole_chunk(key, values, CHUNKS, bf16, raw, at)
    parts += more
    return size


def request(
    header: ps_pb2.PushHeader,
    pieces: Mapping[str, np.ndarray | RowSparse],
    rows: Sequence[ps_pb2.RowQuery],
    timeout_ms: int,
) -> bytes:
    """A PushPullRequest: the header, every piece whole, this step's ``timeout_ms`` and the
    table rows to read after the push.

    Raises:
        InvalidRequestError: a piece's dtype is not a wire dtype.
    """
    parts: list[bytes | memoryview] = [len_field(HEADER, header.SerializeToString())]
    align = sum(p.nbytes for p in pieces.values()) >= SMALL_BYTES
    at = len(parts[0])
    for key, piece in pieces.items():
        at += _add_tensor(parts, key, piece, at if align else None)
    parts.append(varint_field(TIMEOUT, timeout_ms))
    parts += [len_field(ROWS, q.SerializeToString()) for q in rows]
    return b"".join(parts)


def push_pull_request(
    worker_id: int,
    step: int,
    pieces: Mapping[str, np.ndarray | RowSparse],
    incarnation: str | None = None,
    session: str = "",
    options: StepOptions | None = None,
) -> bytes:
    """A PushPullRequest with no row reads and no step timeout: the header and every piece."""
    header = push_header(worker_id, step, incarnation, options, session)
    return request(header, pieces, (), 0)


class ReplyTensors:
    """A PushPull reply's tensors, encoded under the shard's lock (see ``reply_tensors``)."""

    __slots__ = ("aligned", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []
        self.aligned = False  # the tensors' data aligned from where the tensors start


def reply_tensors(arrays: Mapping[str, np.ndarray], owned: frozenset[str]) -> ReplyTensors:
    """The reply's tensors as a snapshot: each array's bytes copied once, except those named in
    ``owned`` (table rows gathered for this reply: already a copy), which are referenced."""
    out = ReplyTensors()
    # The reply starts with the push's result, whose size is not known yet: each tensor's
    # data is aligned from where the tensors start, and ``reply`` pads the result to keep it.
    out.aligned = sum(a.nbytes for a in arrays.values()) >= SMALL_BYTES
    at = 0
    for key, array in arrays.items():
        parts, size = whole_chunk(key, array, CHUNKS, False, b"", at if out.aligned else None)
        if key not in owned:
            parts[3] = bytes(parts[3])  # the data: copied while the shard's lock is held
        out.parts += parts
        at += size
    return out


def reply(push: ps_pb2.PushResponse, tensors: ReplyTensors, clock: int) -> bytes:
    """A PushPullResponse: the push's result, the tensors, the clock they were read at."""
    head = len_field(PUSH, push.SerializeToString())
    if tensors.aligned and len(head) % ALIGN:  # a padding field keeps the data aligned
        head += padding((-len(head) - len(padding(0))) % ALIGN)
    return b"".join([head, *tensors.parts, varint_field(CLOCK, clock)])
