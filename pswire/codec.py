"""The one place that converts between numpy arrays and protobuf tensor chunks."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np

from pswire.errors import InvalidRequestError, ShapeMismatchError, TooLargeError
from pswire.proto import ps_pb2

# 4 MiB chunks: on loopback a stream of MiB-sized messages moves ~4x the bytes/s of one huge
# unary message (bench/pushpull.py), and each message still costs ~0.6 ms of CPU in grpc Python
# beyond its bytes: 4 MiB beat 1 MiB by 12-23% with 2 shards on 2 cores (bench/NOTES.md 10).
DEFAULT_CHUNK_BYTES = 4 << 20
# What a worker may send gradients as: as they are, or float32 narrowed to 16 bits on the wire.
COMPRESSIONS = (None, "fp16", "bf16")
# Dims whose product exceeds this are nonsense whatever the memory (2**48 elements).
MAX_ELEMENTS = 1 << 48
DTYPES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"}
)
# bfloat16 has no numpy dtype: it travels as uint16 bit patterns and arrives widened to float32
# (exactly: bfloat16 is float32's top half).
BFLOAT16 = "bfloat16"
# Looked up, not built, per tensor: a small step's whole budget is a few hundred microseconds,
# and numpy's dtype constructor and ``dtype.name`` cost microseconds each.
_NUMPY_DTYPE = {
    name: np.dtype("uint16" if name == BFLOAT16 else name).newbyteorder("<") for name in DTYPES
}
_WIRE_NAME = {dt: name for name, dt in _NUMPY_DTYPE.items() if name != BFLOAT16}
_WIRE_NAME[np.dtype("uint16")] = "uint16"  # bfloat16 bit patterns, before their label


def check_dtype(dtype: str, name: str) -> np.dtype:
    """Returns the little-endian numpy dtype for a wire dtype name.

    Raises:
        InvalidRequestError: the name is not a supported dtype.
    """
    dt = _NUMPY_DTYPE.get(dtype)
    if dt is None:
        raise _unsupported(dtype, name)
    return dt


def _unsupported(dtype: str, name: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"variable '{name}' has unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}"
    )


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widens bfloat16 bit patterns (uint16) to float32 exactly: they are float32's top half."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def float32_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """Rounds float32 to bfloat16 bit patterns (uint16) to nearest even, as torch does.

    Overflow rounds to infinity; any NaN becomes the quiet NaN 0x7FC0 (torch's vectorised path
    gives other NaN bits, equally NaN).
    """
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit, then truncating, is round-half-to-even. It can
    # wrap only for NaN bit patterns, which are replaced below.
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded).astype(np.uint16)


def tensor_nbytes(name: str, dtype: str, shape: Iterable[int], limit: int | None = None) -> int:
    """Byte size of a tensor, validating every dim.

    Raises:
        InvalidRequestError: unknown dtype, a negative dim, or an absurd element count.
        TooLargeError: the tensor is larger than ``limit`` bytes.
    """
    dt = check_dtype(dtype, name)
    dims = tuple(map(int, shape))
    if dims and min(dims) < 0:
        raise InvalidRequestError(f"variable '{name}' has a negative dim in shape {dims}")
    count = math.prod(dims)
    # Zero dims are skipped: (0, 2**62) holds no elements, but numpy still refuses the shape.
    if (count or math.prod(d for d in dims if d)) > MAX_ELEMENTS:
        raise InvalidRequestError(
            f"variable '{name}' has shape {dims}: dims multiply past {MAX_ELEMENTS} elements"
        )
    nbytes = count * dt.itemsize
    if limit is not None and nbytes > limit:
        raise TooLargeError(
            f"variable '{name}' of shape {dims} is {nbytes} bytes, over the limit of {limit}"
        )
    return nbytes


def all_finite(array: np.ndarray) -> bool:
    """Whether a float array holds no NaN or Inf. A large, aligned float32/float64 array is
    first dotted with itself (one BLAS pass, no temporary): a finite result proves it; a NaN
    or Inf anywhere, or finite values large enough to overflow, fall through to the exact
    check. (Unaligned data, such as a tensor decoded in place from a message, would take
    numpy's non-BLAS loop: 847 us against 18 us for 1 MiB, bench/NOTES.md 19.)"""
    if (
        array.size >= 1 << 16
        and array.dtype in (np.float32, np.float64)
        and array.flags.aligned
        and array.flags.c_contiguous
    ):
        flat = array.reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(np.dot(flat, flat)):
                return True
    return bool(np.isfinite(array).all())


def sum_squares(array: np.ndarray) -> float:
    """The sum of squares of a float array (one BLAS pass, no temporary): inf or NaN when it
    holds a non-finite value or values large enough to overflow it; 0 for other dtypes. A
    finite result proves every value finite (the optimizer's checks measure with it)."""
    if array.dtype.kind != "f":
        return 0.0
    flat = array.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.dot(flat, flat))


# Many small float32 arrays (up to BATCH_ELEMENTS each, at least BATCH_ARRAYS of them) are
# checked for NaN/Inf in one pass over their concatenation: a step of 15,000 four-float
# variables spent most of its checks in per-array numpy calls.
BATCH_ARRAYS = 64
BATCH_ELEMENTS = 4096


def batched(array: np.ndarray) -> bool:
    """Whether ``array`` is checked with others (a small, non-empty float32 array)."""
    return array.dtype == np.float32 and 0 < array.size <= BATCH_ELEMENTS


def all_finite_together(arrays: Iterable[object]) -> bool:
    """Whether the ``batched`` arrays among ``arrays`` (anything else is skipped) hold no NaN
    or Inf, checked at once. False when they are too few to batch, or when some value is not
    finite: the caller then checks each array alone (and names the one that fails)."""
    batch = [a for a in arrays if isinstance(a, np.ndarray) and batched(a)]
    return len(batch) >= BATCH_ARRAYS and all_finite(np.concatenate(batch, axis=None))


def check_tensor(
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    array: np.ndarray,
    what: str,
    finite: bool = False,
) -> None:
    """Checks ``array`` against a variable's declared shape and dtype, and for NaN/Inf
    (unless ``finite``: already known, e.g. from ``all_finite_together``).

    Raises:
        InvalidRequestError: wrong dtype or non-finite floats.
        ShapeMismatchError: wrong shape.
    """
    if array.dtype != check_dtype(dtype, name):
        raise InvalidRequestError(
            f"variable '{name}' has dtype {dtype} on the server, {what} sent {array.dtype}"
        )
    if tuple(array.shape) != tuple(shape):
        raise ShapeMismatchError(
            f"variable '{name}' has shape {tuple(shape)} on the server, {what} sent "
            f"{tuple(array.shape)}"
        )
    if not finite and array.dtype.kind == "f" and not all_finite(array):
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        raise InvalidRequestError(
            f"variable '{name}': {what} has {bad} non-finite values (NaN or Inf)"
        )


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
        raise _unsupported(arr.dtype.name, name)
    # memoryview's cast: a third of the time of reshape(-1).view(uint8).data (a small step
    # encodes thousands of tensors); it refuses zero-size shapes, which hold no bytes anyway.
    view = memoryview(arr).cast("B") if arr.size else memoryview(b"")  # type: ignore[arg-type]
    return view, dtype, arr.shape


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


def indices_bytes(indices: np.ndarray) -> bytes:
    return np.ascontiguousarray(indices, dtype="<i8").tobytes()


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


def tensor_from_proto(chunk: ps_pb2.TensorChunk) -> np.ndarray:
    """Decodes a single-chunk tensor without copying (the result is read-only).

    Raises:
        InvalidRequestError: the chunk does not hold the whole tensor or its size is wrong.
    """
    assembler = ChunkAssembler()
    assembler.add(chunk)
    (_name, array), *_ = assembler.finish().items()
    return array


class ChunkAssembler:
    """Rebuilds named arrays from a stream of chunks, validating as it goes.

    A tensor's data is written straight into one preallocated buffer, so memory holds at most
    one copy of each tensor beyond the message in flight. A single-chunk tensor is decoded with
    ``numpy.frombuffer`` and no copy at all.

    Raises (from ``add``/``finish``):
        InvalidRequestError: chunks out of order, overlapping, truncated, a repeated name, or a
            byte count that does not match dtype and shape.
        TooLargeError: the stream declares more bytes than ``max_bytes``.
    """

    def __init__(
        self,
        max_bytes: int | None = None,
        into: Mapping[str, np.ndarray] | None = None,
        reserve: Callable[[int], None] | None = None,
    ) -> None:
        """``into``: arrays to decode tensors of those names straight into (when dtype and
        shape match and the array is writable and C-contiguous), e.g. the rows of a split
        variable's full array, so no second copy joins the pieces. ``reserve(n)`` is told of
        each tensor's bytes before they arrive (it raises to refuse them)."""
        self._max_bytes = max_bytes
        self._reserve = reserve
        self._into = into or {}
        self._declared = 0
        self._done: dict[str, np.ndarray] = {}
        self._name: str | None = None
        self._dtype: np.dtype | None = None
        self._shape: tuple[int, ...] = ()
        self._buffer: np.ndarray | None = None
        self._total = 0
        self._received = 0
        self._last: str | None = None
        self._bfloat16 = False
        self._ids: np.ndarray | None = None
        # Row ids of the row-sparse tensors (those whose first chunk carried indices).
        self.indices: dict[str, np.ndarray] = {}

    def add(self, chunk: ps_pb2.TensorChunk) -> None:
        """Takes the next chunk of the stream."""
        if self._name is None:
            if self._start(chunk):
                return  # a whole tensor in one chunk, decoded
        elif chunk.name and chunk.name != self._name:
            raise InvalidRequestError(
                f"variable '{self._name}' is truncated: got {self._received} of {self._total} "
                f"bytes before a chunk of '{chunk.name}' began"
            )
        elif chunk.indices:
            raise InvalidRequestError(
                f"table '{self._name}': row ids in a chunk at byte offset {chunk.offset}; they "
                "belong in the tensor's first chunk only"
            )
        assert self._name is not None
        data = chunk.data
        if chunk.offset != self._received:
            raise InvalidRequestError(
                f"variable '{self._name}': chunk at byte offset {chunk.offset}, expected "
                f"{self._received} (chunks out of order or missing)"
            )
        end = self._received + len(data)
        if end > self._total:
            raise InvalidRequestError(
                f"variable '{self._name}': chunks carry {end} bytes, more than its "
                f"{self._total} bytes"
            )
        if self._buffer is None:
            self._buffer = np.empty(self._total, dtype=np.uint8)
        self._buffer[self._received : end] = np.frombuffer(data, dtype=np.uint8)
        self._received = end
        if self._received == self._total:
            assert self._dtype is not None
            self._complete(self._buffer.view(self._dtype).reshape(self._shape))

    def _start(self, chunk: ps_pb2.TensorChunk) -> bool:
        """Begins a tensor with its first chunk; whether that chunk held all of it (then it is
        decoded in place, with no copy, unless it has an ``into`` array to go to)."""
        name = chunk.name
        if not name:
            if self._last is not None:
                raise InvalidRequestError(
                    f"variable '{self._last}' is complete but a chunk without a name follows "
                    f"at byte offset {chunk.offset} with {len(chunk.data)} bytes (extra bytes)"
                )
            raise InvalidRequestError("tensor chunk without a name starts a tensor")
        if name in self._done:
            raise InvalidRequestError(f"variable '{name}' appears twice in one request")
        shape = tuple(chunk.shape)
        dtype_name = chunk.dtype
        dtype, nbytes = _spec(name, dtype_name, shape)
        if chunk.total_bytes != nbytes:
            raise InvalidRequestError(
                f"variable '{name}' declares {chunk.total_bytes} bytes but dtype {dtype_name} "
                f"and shape {shape} make {nbytes}"
            )
        self._declared += nbytes
        if self._max_bytes is not None and self._declared > self._max_bytes:
            raise TooLargeError(
                f"request reaches {self._declared} bytes at variable '{name}', over the limit "
                f"of {self._max_bytes}"
            )
        if self._reserve is not None:
            self._reserve(nbytes)
        self._name = name
        self._bfloat16 = bfloat16 = dtype_name == BFLOAT16
        self._dtype = dtype
        self._shape = shape
        self._ids = _row_ids(name, chunk.indices, shape) if chunk.indices else None
        self._total = nbytes
        self._received = 0
        target = self._into.get(name) if self._into else None
        if (
            target is not None
            and not bfloat16
            and target.dtype == dtype
            and target.shape == shape
            and target.flags.c_contiguous
            and target.flags.writeable
        ):
            self._buffer = target.reshape(-1).view(np.uint8)
            return False
        data = chunk.data
        if chunk.offset or len(data) != nbytes:
            return False  # the offset is checked, and the bytes gathered, by ``add``
        # Whole tensor in one chunk: decode in place, zero copy.
        array = np.frombuffer(data, dtype=dtype)
        self._complete(array if len(shape) == 1 else array.reshape(shape))
        return True

    def _complete(self, array: np.ndarray) -> None:
        assert self._name is not None
        if self._ids is not None:
            self.indices[self._name] = self._ids
            self._ids = None
        self._done[self._name] = bfloat16_to_float32(array) if self._bfloat16 else array
        self._last = self._name
        self._name = None
        self._buffer = None

    @property
    def pending(self) -> bool:
        """True while a tensor has started and not all its bytes arrived."""
        return self._name is not None

    def finish(self) -> dict[str, np.ndarray]:
        """Returns the completed arrays by name.

        Raises:
            InvalidRequestError: the stream ended in the middle of a tensor.
        """
        if self._name is not None:
            raise InvalidRequestError(
                f"variable '{self._name}' is truncated: stream ended after {self._received} of "
                f"{self._total} bytes"
            )
        return self._done


# Dtypes and shapes already validated, with their numpy dtype and byte size: the same few
# travel every step, and validating one took as long as decoding a small tensor. Bounded like
# the encoder's heads: ever new shapes empty it rather than grow it.
_SPECS: dict[tuple[str, tuple[int, ...]], tuple[np.dtype, int]] = {}
_MAX_SPECS = 1 << 16


def _spec(name: str, dtype: str, shape: tuple[int, ...]) -> tuple[np.dtype, int]:
    """(the numpy dtype, the byte size) of a tensor a chunk declares.

    Raises:
        InvalidRequestError: as ``tensor_nbytes``, naming ``name``.
    """
    key = (dtype, shape)
    found = _SPECS.get(key)
    if found is None:
        found = check_dtype(dtype, name), tensor_nbytes(name, dtype, shape)
        if len(_SPECS) >= _MAX_SPECS:
            _SPECS.clear()
        _SPECS[key] = found
    return found


def _row_ids(name: str, raw: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
    """The int64 row ids a row-sparse tensor's first chunk carries, checked against its shape.

    Raises:
        InvalidRequestError: not one int64 id per row of a 2-d tensor.
    """
    if len(shape) != 2 or len(raw) != 8 * shape[0]:
        raise InvalidRequestError(
            f"table '{name}': {len(raw)} bytes of row ids for rows of shape {shape}; expected "
            "a 2-d tensor and 8 bytes (one int64 id) per row"
        )
    ids = np.frombuffer(raw, dtype="<i8")
    return ids if ids.flags.aligned else ids.copy()  # 8 bytes a row: cheap, and sorts faster
