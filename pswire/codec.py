"""A message's contents as the values both sides compute with: tensor chunks rebuilt as numpy
arrays (``ChunkAssembler``, no copy for a whole tensor), a push's gradients and its
``StepOptions``; bfloat16 both ways.

Chunks come from ``pswire.read`` (grpcio) or ``pswire.flightwire`` (Arrow Flight); what writes
them is ``pswire.write``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from pscore.checks import BFLOAT16, check_dtype, tensor_nbytes
from pscore.job import Grads
from pscore.optspec import NO_OPTIONS, StepOptions
from pscore.tables import RowSparse
from pswire.errors import InvalidRequestError, TooLargeError
from pswire.proto import ps_pb2

# 4 MiB chunks: on loopback a stream of MiB-sized messages moves ~4x the bytes/s of one huge
# unary message (bench/pushpull.py), and each message still costs ~0.6 ms of CPU in grpc Python
# beyond its bytes: 4 MiB beat 1 MiB by 12-23% with 2 shards on 2 cores (bench/NOTES.md 10).
DEFAULT_CHUNK_BYTES = 4 << 20

# What a worker may send gradients as: as they are, or float32 narrowed to 16 bits on the wire.
COMPRESSIONS = (None, "fp16", "bf16")


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
        self._in_place = False  # the tensor begun is decoded into its ``into`` array
        self._placed: set[str] = set()
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
            self._in_place = True
            return False
        data = chunk.data
        if chunk.offset or len(data) != nbytes:
            return False  # the offset is checked, and the bytes gathered, by ``add``
        # Whole tensor in one chunk: decode in place, zero copy; unless the bytes sit at an
        # address that is no multiple of the dtype's size (Flight's first batch of a step: its
        # body follows a header of any length), where one copy is cheaper than what numpy
        # does with unaligned data: no BLAS for the checks' dot (847 us against 18 us a MiB,
        # bench/NOTES.md 19) and a buffered copy inside every ufunc of the optimizer's step.
        array = np.frombuffer(data, dtype=dtype)
        if not array.flags.aligned:
            array = array.copy()
        self._complete(array if len(shape) == 1 else array.reshape(shape))
        return True

    def _complete(self, array: np.ndarray) -> None:
        assert self._name is not None
        if self._ids is not None:
            self.indices[self._name] = self._ids
            self._ids = None
        self._done[self._name] = bfloat16_to_float32(array) if self._bfloat16 else array
        if self._in_place:
            self._placed.add(self._name)
            self._in_place = False
        self._last = self._name
        self._name = None
        self._buffer = None

    def completed(self, name: str) -> np.ndarray:
        """Tensor ``name``, complete (its array as ``finish`` returns it)."""
        return self._done[name]

    def placed(self, name: str) -> bool:
        """Whether tensor ``name`` is complete, decoded straight into its ``into`` array."""
        return name in self._placed

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


# -- a push's gradients and options ---------------------------------------------------------


def read_stream(requests: Iterable[Any], assembler: ChunkAssembler, rpc: str) -> Any:
    """Reads a header-then-chunks stream (Init, Push); returns the header, every chunk fed to
    ``assembler``.

    Raises:
        InvalidRequestError: no header, a second one, a chunk before it, an empty message.
    """
    header = None
    for req in requests:
        kind = req.WhichOneof("body")
        if kind == "header":
            if header is not None:
                raise InvalidRequestError(f"{rpc} stream carries a second header")
            header = req.header
        elif kind == "chunk":
            if header is None:
                raise InvalidRequestError(f"{rpc} stream sends a chunk before its header")
            assembler.add(req.chunk)
        else:
            raise InvalidRequestError(f"{rpc} stream carries an empty message")
    if header is None:
        raise InvalidRequestError(f"{rpc} stream ended without a header")
    return header


def assembled_grads(assembler: ChunkAssembler) -> Grads:
    """The gradients a finished assembler holds: a table's rows with their ids as
    ``RowSparse``, dense tensors as arrays.

    Raises:
        InvalidRequestError: an incomplete tensor.
    """
    rows = assembler.indices
    return {k: RowSparse(rows[k], a) if k in rows else a for k, a in assembler.finish().items()}


def push_pull_grads(request: Any, max_bytes: int) -> Grads:
    """The gradients of a PushPullRequest, a protobuf object or one read by hand (every
    tensor whole).

    Raises:
        InvalidRequestError, TooLargeError: malformed or oversized tensors.
    """
    assembler = ChunkAssembler(max_bytes)
    for chunk in request.chunks:
        assembler.add(chunk)
    return assembled_grads(assembler)


def header_options(header: ps_pb2.PushHeader) -> StepOptions:
    """The ``StepOptions`` a PushHeader carries.

    Raises:
        InvalidRequestError: one group given twice.
    """
    if not header.values and not header.skip:
        return NO_OPTIONS
    values: dict[int, dict[str, float]] = {}
    for entry in header.values:
        if entry.group in values:
            raise InvalidRequestError(
                f"push from worker {header.worker_id} gives parameter group {entry.group}'s "
                "hyper-parameters twice"
            )
        values[entry.group] = dict(entry.params)
    return StepOptions(values, header.skip)
