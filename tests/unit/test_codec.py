"""Unit tests for pswire.codec: numpy arrays to tensor chunks and back, and stream validation."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pscore.checks import MAX_ELEMENTS, check_dtype, tensor_nbytes
from pswire.codec import ChunkAssembler, tensor_from_proto
from pswire.errors import InvalidRequestError, PSError, TooLargeError
from pswire.flightwire import Piece
from pswire.proto import ps_pb2
from pswire.write import tensor_to_chunks, tensor_to_proto

WIRE_DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8", "bool"]

shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)
arrays = st.sampled_from(WIRE_DTYPES).flatmap(lambda dt: hnp.arrays(np.dtype(dt), shapes))


def encode(name: str, array: np.ndarray, chunk_bytes: int) -> list[ps_pb2.TensorChunk]:
    return list(tensor_to_chunks(name, array, chunk_bytes))


def decode(chunks: list[ps_pb2.TensorChunk], max_bytes: int | None = None) -> dict:
    assembler = ChunkAssembler(max_bytes)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


def assert_identical(got: np.ndarray, want: np.ndarray) -> None:
    """Same dtype, same shape, same bytes (so NaN payloads and -0.0 count too)."""
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()


# --- round trips ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(array=arrays, data=st.data())
def test_chunked_round_trip_is_exact(array: np.ndarray, data: st.DataObject) -> None:
    chunk_bytes = data.draw(st.integers(1, array.nbytes + 3), label="chunk_bytes")
    chunks = encode("layer.weight", array, chunk_bytes)

    expected_count = max(1, math.ceil(array.nbytes / chunk_bytes))
    assert len(chunks) == expected_count
    assert [c.offset for c in chunks] == [i * chunk_bytes for i in range(expected_count)]
    assert all(len(c.data) <= chunk_bytes for c in chunks)
    assert sum(len(c.data) for c in chunks) == array.nbytes
    # Only the first chunk carries the header.
    first, rest = chunks[0], chunks[1:]
    assert (first.name, first.dtype, tuple(first.shape), first.total_bytes) == (
        "layer.weight",
        array.dtype.name,
        array.shape,
        array.nbytes,
    )
    assert all(not c.name and not c.dtype and not c.shape and not c.total_bytes for c in rest)

    out = decode(chunks)
    assert list(out) == ["layer.weight"]
    assert_identical(out["layer.weight"], array)


@settings(max_examples=100, deadline=None)
@given(array=arrays)
def test_proto_round_trip_is_exact(array: np.ndarray) -> None:
    chunk = tensor_to_proto("b", array)
    assert chunk.name == "b"
    assert len(chunk.data) == array.nbytes
    assert_identical(tensor_from_proto(chunk), array)


@settings(max_examples=60, deadline=None)
@given(
    tensors=st.lists(arrays, min_size=1, max_size=5),
    chunk_bytes=st.integers(1, 40),
)
def test_several_tensors_in_one_stream(tensors: list[np.ndarray], chunk_bytes: int) -> None:
    named = {f"v{i}": a for i, a in enumerate(tensors)}
    stream = [c for name, a in named.items() for c in encode(name, a, chunk_bytes)]
    out = decode(stream)
    assert list(out) == list(named)
    for name, array in named.items():
        assert_identical(out[name], array)


def test_scalar_keeps_its_empty_shape() -> None:
    # np.ascontiguousarray turns a 0-d array into shape (1,); the codec must not.
    values: list[Any] = [np.array(2.5, dtype=np.float32), np.float64(-1.0), np.array(True)]
    for value in values:
        (chunk,) = encode("s", value, 8)
        assert list(chunk.shape) == []
        out = tensor_from_proto(chunk)
        assert out.shape == ()
        assert out == value


def test_zero_size_tensor_is_one_empty_chunk() -> None:
    array = np.zeros((3, 0, 2), dtype=np.float32)
    (chunk,) = encode("empty", array, 4)
    assert chunk.total_bytes == 0 and chunk.data == b""
    assert_identical(decode([chunk])["empty"], array)


def test_non_contiguous_and_big_endian_inputs_decode_to_the_same_values() -> None:
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    transposed = base.T
    assert not transposed.flags.c_contiguous
    out = decode(encode("t", transposed, 16))["t"]
    np.testing.assert_array_equal(out, transposed)
    assert out.shape == (6, 4)

    big = base.astype(">f8")
    chunk = tensor_to_proto("big", big)
    assert chunk.dtype == "float64"
    assert chunk.data == base.astype("<f8").tobytes()
    got = tensor_from_proto(chunk)
    assert got.dtype == np.dtype("<f8")
    np.testing.assert_array_equal(got, base)


def test_encoding_copies_only_the_sent_slice() -> None:
    array = np.arange(10, dtype=np.int32)
    chunks = encode("x", array, 8)
    array[:] = -1  # later writes to the source must not change what was already encoded
    np.testing.assert_array_equal(decode(chunks)["x"], np.arange(10, dtype=np.int32))


def _root_base(array: np.ndarray) -> object:
    obj: object = array
    while isinstance(obj, np.ndarray) and obj.base is not None:
        obj = obj.base
    return obj


@pytest.mark.parametrize("via", ["tensor_from_proto", "assembler"])
def test_single_chunk_decode_is_zero_copy_and_read_only(via: str) -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    chunk = tensor_to_proto("w", array)
    out = tensor_from_proto(chunk) if via == "tensor_from_proto" else decode([chunk])["w"]
    assert not out.flags.owndata
    assert not out.flags.writeable
    # The data is the message's bytes object itself, not a numpy copy of it.
    root = _root_base(out)
    assert isinstance(root, bytes)
    assert root == chunk.data
    with pytest.raises(ValueError):
        out[0, 0] = 1.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_a_whole_tensor_at_an_unaligned_address_is_copied_to_aligned_memory(dtype: type) -> None:
    # Flight's first batch of a step puts its body after a header of any length: a view
    # there would take numpy's unaligned paths (no BLAS dot for the checks, buffered ufuncs).
    array = np.arange(100_000, dtype=dtype)
    raw = bytearray(1 + array.nbytes)
    raw[1:] = array.tobytes()
    data = memoryview(raw)[1:]
    assert not np.frombuffer(data, dtype=dtype).flags.aligned
    piece = Piece("w", np.dtype(dtype).name, (array.size,), array.nbytes, 0, data, b"")
    assembler = ChunkAssembler()
    assembler.add(piece)  # type: ignore[arg-type]
    out = assembler.finish()["w"]
    assert out.flags.aligned
    assert out.tobytes() == array.tobytes()
    # Aligned bytes are still decoded in place.
    raw[1:] = b"\0" * array.nbytes
    assert out.tobytes() == array.tobytes()
    backing = bytearray(array.tobytes())
    assembler = ChunkAssembler()
    piece = Piece(
        "w", np.dtype(dtype).name, (array.size,), array.nbytes, 0, memoryview(backing), b""
    )
    assembler.add(piece)  # type: ignore[arg-type]
    view = assembler.finish()["w"]
    backing[:8] = b"\xff" * 8
    assert view.tobytes()[:8] == b"\xff" * 8  # the received bytes themselves


def test_multi_chunk_decode_is_one_writable_buffer() -> None:
    array = np.arange(12, dtype=np.int64).reshape(3, 4)
    out = decode(encode("w", array, 10))["w"]
    assert out.flags.writeable
    assert out.flags.c_contiguous
    np.testing.assert_array_equal(out, array)


def test_pending_tracks_a_started_tensor() -> None:
    chunks = encode("w", np.arange(8, dtype=np.float32), 12)
    assembler = ChunkAssembler()
    assert not assembler.pending
    assembler.add(chunks[0])
    assert assembler.pending
    for c in chunks[1:]:
        assembler.add(c)
    assert not assembler.pending
    assert list(assembler.finish()) == ["w"]


def test_empty_stream_finishes_empty() -> None:
    assert ChunkAssembler().finish() == {}


def test_chunk_bytes_below_one_is_rejected_not_an_endless_loop() -> None:
    array = np.arange(4, dtype=np.float32)
    for bad in (0, -1):
        # islice bounds the damage if the generator were to loop forever.
        with pytest.raises(ValueError, match="chunk_bytes"):
            list(itertools.islice(tensor_to_chunks("w", array, bad), 100))


def test_encoding_an_unsupported_dtype_names_the_variable() -> None:
    with pytest.raises(InvalidRequestError, match=r"'z'.*complex64"):
        tensor_to_proto("z", np.zeros(3, dtype=np.complex64))


# --- tensor_nbytes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes"),
    [
        ("float32", (3, 4), 48),
        ("float16", (5,), 10),
        ("float64", (), 8),
        ("bool", (2, 3), 6),
        ("int64", (0, 7), 0),
        ("uint8", (0, 1 << 48), 0),
    ],
)
def test_tensor_nbytes(dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    assert tensor_nbytes("v", dtype, shape) == nbytes


def test_tensor_nbytes_limit() -> None:
    assert tensor_nbytes("v", "float32", (4,), limit=16) == 16
    with pytest.raises(TooLargeError, match=r"'v'.*16 bytes.*limit of 15"):
        tensor_nbytes("v", "float32", (4,), limit=15)


@pytest.mark.parametrize(
    "shape",
    [
        (1 << 24, 1 << 24, 2),
        (1 << 49,),
        # No elements, but numpy still refuses to build such a shape: reject it up front.
        (0, 1 << 62),
        (1 << 40, 0, 1 << 40),
    ],
)
def test_tensor_nbytes_rejects_absurd_dims(shape: tuple[int, ...]) -> None:
    with pytest.raises(InvalidRequestError, match="'v'"):
        tensor_nbytes("v", "uint8", shape)


def test_max_elements_boundary() -> None:
    assert tensor_nbytes("v", "uint8", (MAX_ELEMENTS,)) == MAX_ELEMENTS
    with pytest.raises(InvalidRequestError):
        tensor_nbytes("v", "uint8", (MAX_ELEMENTS + 1,))


def test_tensor_nbytes_rejects_negative_dims_and_unknown_dtypes() -> None:
    with pytest.raises(InvalidRequestError, match=r"'v'.*negative"):
        tensor_nbytes("v", "float32", (0, -3))
    with pytest.raises(InvalidRequestError, match=r"'v'.*'float8'"):
        tensor_nbytes("v", "float8", (3,))
    assert check_dtype("float32", "v") == np.dtype("<f4")


# --- malformed streams ---------------------------------------------------------------------

W = np.arange(12, dtype=np.float32).reshape(4, 3)  # 48 bytes: three 16-byte chunks


def w_chunks() -> list[ps_pb2.TensorChunk]:
    return encode("w", W, 16)


def header(name: str = "w", **fields: object) -> ps_pb2.TensorChunk:
    """A first chunk of ``W`` with some header fields overridden."""
    chunk = tensor_to_proto(name, W)
    for key, value in fields.items():
        if key == "shape":
            del chunk.shape[:]
            chunk.shape.extend(value)  # type: ignore[arg-type]
        else:
            setattr(chunk, key, value)
    return chunk


def _overlap() -> list[ps_pb2.TensorChunk]:
    c0, c1, _ = w_chunks()
    c1.offset = 8
    return [c0, c1]


def _extra_in_last() -> list[ps_pb2.TensorChunk]:
    c0, c1, c2 = w_chunks()
    c2.data += b"\x00"
    return [c0, c1, c2]


def _extra_after_end() -> list[ps_pb2.TensorChunk]:
    return [*w_chunks(), ps_pb2.TensorChunk(offset=48, data=b"\x00\x00")]


def _second_tensor_interrupts() -> list[ps_pb2.TensorChunk]:
    c0, c1, _ = w_chunks()
    return [c0, c1, *encode("v", W, 16)]


def _nameless_first() -> list[ps_pb2.TensorChunk]:
    c0, *rest = w_chunks()
    c0.name = ""
    return [c0, *rest]


MALFORMED: dict[str, tuple[Callable[[], list[ps_pb2.TensorChunk]], type[PSError], str]] = {
    "out of order": (lambda: [w_chunks()[i] for i in (0, 2, 1)], InvalidRequestError, "offset"),
    "missing chunk": (lambda: [w_chunks()[i] for i in (0, 2)], InvalidRequestError, "offset"),
    "overlapping": (_overlap, InvalidRequestError, "offset 8, expected 16"),
    "extra bytes in last chunk": (_extra_in_last, InvalidRequestError, "49 bytes"),
    "extra chunk after the end": (_extra_after_end, InvalidRequestError, "extra"),
    "truncated stream": (lambda: w_chunks()[:2], InvalidRequestError, "truncated.*32 of 48"),
    "truncated single chunk": (
        lambda: [header(data=W.tobytes()[:40])],
        InvalidRequestError,
        "truncated",
    ),
    "next tensor starts early": (_second_tensor_interrupts, InvalidRequestError, "truncated"),
    "repeated name": (lambda: w_chunks() + w_chunks(), InvalidRequestError, "twice"),
    "total_bytes too small": (lambda: [header(total_bytes=47)], InvalidRequestError, "47"),
    "total_bytes too large": (lambda: [header(total_bytes=96)], InvalidRequestError, "96"),
    "shape disagrees": (lambda: [header(shape=[4, 4])], InvalidRequestError, "64"),
    "negative dim": (lambda: [header(shape=[-4, -3])], InvalidRequestError, "negative"),
    "absurd dims": (
        lambda: [header(shape=[1 << 30, 1 << 30, 4])],
        InvalidRequestError,
        "elements",
    ),
    "unknown dtype": (lambda: [header(dtype="complex64")], InvalidRequestError, "complex64"),
    "empty dtype": (lambda: [header(dtype="")], InvalidRequestError, "dtype"),
    "over max_bytes": (w_chunks, TooLargeError, "limit of 47"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_stream_is_rejected_naming_the_variable(case: str) -> None:
    build, error, detail = MALFORMED[case]
    with pytest.raises(error, match=detail) as info:
        decode(build(), max_bytes=47 if case == "over max_bytes" else None)
    assert "'w'" in str(info.value)
    if error is InvalidRequestError:
        assert not isinstance(info.value, TooLargeError)


def test_chunk_without_a_name_cannot_start_a_stream() -> None:
    chunks = _nameless_first()
    with pytest.raises(InvalidRequestError, match="without a name"):
        decode(chunks)


def test_max_bytes_counts_the_whole_stream_and_fails_before_data_arrives() -> None:
    small = np.zeros(8, dtype=np.uint8)
    assembler = ChunkAssembler(max_bytes=12)
    for c in encode("a", small, 4):
        assembler.add(c)
    first_of_b = encode("b", small, 4)[0]
    # "a" (8 bytes) fits, "b" would reach 16: refused from its header alone.
    with pytest.raises(TooLargeError, match=r"16 bytes at variable 'b'.*limit of 12"):
        assembler.add(first_of_b)


def test_max_bytes_is_inclusive() -> None:
    out = decode(w_chunks(), max_bytes=48)
    np.testing.assert_array_equal(out["w"], W)


def test_tensor_from_proto_rejects_a_partial_chunk() -> None:
    first = w_chunks()[0]
    with pytest.raises(InvalidRequestError, match="'w' is truncated"):
        tensor_from_proto(first)


def test_assembler_decodes_into_given_arrays_when_they_fit() -> None:
    whole = np.zeros((6, 3), np.float32)
    into = {"w/part0of2": whole[:4], "w/part1of2": whole[4:], "odd": np.zeros(2, np.float64)}
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    b = -np.arange(6, dtype=np.float32).reshape(2, 3)
    c = np.ones(3, np.float64)  # the wrong shape for its target: decoded on its own
    assembler = ChunkAssembler(into=into)
    for name, array in (("w/part0of2", a), ("w/part1of2", b), ("odd", c)):
        for chunk in tensor_to_chunks(name, array, chunk_bytes=20):
            assembler.add(chunk)
    done = assembler.finish()
    assert np.array_equal(whole, np.concatenate([a, b]))
    assert np.shares_memory(done["w/part0of2"], whole) and np.shares_memory(
        done["w/part1of2"], whole
    )
    assert np.array_equal(done["odd"], c) and not into["odd"].any()


def test_all_finite_is_exact_for_large_arrays_and_huge_finite_values() -> None:
    from pscore.checks import all_finite

    a = np.zeros(1 << 17, np.float32)
    assert all_finite(a)
    for bad in (np.nan, np.inf, -np.inf):
        b = a.copy()
        b[12345] = bad
        assert not all_finite(b)
    huge = np.full(1 << 17, 3e38, np.float32)  # finite, but its dot product overflows
    assert all_finite(huge)
    assert all_finite(np.full(1 << 17, 1e300)) and not all_finite(np.full(3, np.nan))
