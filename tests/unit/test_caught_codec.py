"""Row ids against rows: the decoder refuses a row-sparse tensor whose id bytes are not exactly
one int64 per row of a 2-d tensor, on the protobuf and the hand-parsed path alike."""

from __future__ import annotations

import numpy as np
import pytest

from pscore.checks import check_tensor
from pswire.codec import ChunkAssembler, bfloat16_to_float32, float32_to_bfloat16
from pswire.errors import InvalidRequestError, ShapeMismatchError
from pswire.proto import ps_pb2
from pswire.read import stream_request_parser
from pswire.write import encode_chunk_messages, tensor_to_chunks, tensor_to_proto

ROWS = np.arange(12, dtype=np.float32).reshape(3, 4)
IDS = np.array([5, 9, 2], dtype=np.int64)


def chunk(values: np.ndarray, indices: bytes) -> ps_pb2.TensorChunk:
    whole = values.tobytes()
    return ps_pb2.TensorChunk(
        name="e",
        dtype="float32",
        shape=list(values.shape),
        total_bytes=len(whole),
        data=whole,
        indices=indices,
    )


def test_one_id_per_row_decodes() -> None:
    assembler = ChunkAssembler()
    assembler.add(chunk(ROWS, IDS.tobytes()))
    assert np.array_equal(assembler.finish()["e"], ROWS)
    assert assembler.indices["e"].tolist() == IDS.tolist()


@pytest.mark.parametrize(
    ("values", "indices"),
    [
        (ROWS, IDS[:2].tobytes()),  # a row without an id
        (ROWS, np.append(IDS, 7).tobytes()),  # an id without a row
        (ROWS, IDS.tobytes()[:-4]),  # not a whole number of int64s
        (ROWS, IDS.tobytes() + b"\0\0\0\0"),
        (ROWS, IDS.astype(np.int32).tobytes()),  # int32 ids: 4 bytes a row
        (ROWS.reshape(-1), np.arange(12, dtype=np.int64).tobytes()),  # ids for a 1-d tensor
        (ROWS.reshape(3, 2, 2), IDS.tobytes()),  # ids for a 3-d tensor
    ],
    ids=["fewer", "more", "short", "long", "int32", "1-d", "3-d"],
)
def test_id_bytes_that_do_not_match_the_rows_are_refused(
    values: np.ndarray, indices: bytes
) -> None:
    with pytest.raises(InvalidRequestError, match=r"table 'e': \d+ bytes of row ids"):
        ChunkAssembler().add(chunk(values, indices))


@pytest.mark.parametrize("extra", [-1, 1])
def test_the_hand_parsed_stream_refuses_them_too(extra: int) -> None:
    ids = np.arange(3 + extra, dtype=np.int64)
    messages = list(encode_chunk_messages("e", ROWS, 2, 16, indices=ids))
    assert len(messages) > 1  # the ids ride the first of several chunks
    parse = stream_request_parser(ps_pb2.PushHeader)
    assembler = ChunkAssembler()
    with pytest.raises(InvalidRequestError, match=r"table 'e': .* bytes of row ids"):
        for message in messages:
            parsed = parse(message).chunk
            assert parsed is not None
            assembler.add(parsed)


def test_ids_for_the_rows_of_a_chunked_tensor_decode() -> None:
    assembler = ChunkAssembler()
    for c in tensor_to_chunks("e", ROWS, 16, indices=IDS):
        assembler.add(c)
    assert np.array_equal(assembler.finish()["e"], ROWS)
    assert assembler.indices["e"].tolist() == IDS.tolist()


# -- the rest of the codec's contract that mutation testing found loose ---------------------------


def test_check_tensor_names_what_is_wrong() -> None:
    good = np.zeros((2, 3), np.float32)
    check_tensor("w", (2, 3), "float32", good, "push")
    with pytest.raises(
        InvalidRequestError, match=r"'w' has dtype float32 on the server, push sent"
    ):
        check_tensor("w", (2, 3), "float32", good.astype(np.float64), "push")
    with pytest.raises(
        ShapeMismatchError, match=r"'w' has shape \(3, 2\) on the server, push sent"
    ):
        check_tensor("w", (3, 2), "float32", good, "push")
    bad = good.copy()
    bad[0, 0], bad[1, 2] = np.nan, np.inf
    with pytest.raises(InvalidRequestError, match=r"'w': push has 2 non-finite values"):
        check_tensor("w", (2, 3), "float32", bad, "push")
    check_tensor("n", (2,), "int64", np.array([-1, 2**62], np.int64), "push")  # ints: any value
    with pytest.raises(InvalidRequestError, match="unsupported dtype 'complex64'"):
        check_tensor("c", (2,), "complex64", np.zeros(2, np.complex64), "push")


def bf16(bits: int) -> int:
    """float32 bit pattern -> the bfloat16 bits float32_to_bfloat16 gives."""
    value = np.array([bits], np.uint32).view(np.float32)
    return int(float32_to_bfloat16(value)[0])


@pytest.mark.parametrize(
    ("f32_bits", "bf16_bits"),
    [
        (0x3F800000, 0x3F80),  # 1.0
        (0xBF800000, 0xBF80),  # -1.0
        (0x3F807FFF, 0x3F80),  # just under half way: down
        (0x3F808001, 0x3F81),  # just over: up
        (0x3F808000, 0x3F80),  # exactly half way, even below: stays
        (0x3F818000, 0x3F82),  # exactly half way, odd below: up to even
        (0x3F828000, 0x3F82),
        (0x7F7FFFFF, 0x7F80),  # the largest float32 rounds to infinity
        (0x7F800000, 0x7F80),  # infinity stays
        (0x00010000, 0x0001),  # a subnormal
        (0x7FC00001, 0x7FC0),  # NaNs become the one quiet NaN
        (0xFFFFFFFF, 0x7FC0),
    ],
)
def test_bfloat16_rounds_to_nearest_even(f32_bits: int, bf16_bits: int) -> None:
    assert bf16(f32_bits) == bf16_bits


def test_bfloat16_takes_any_float_input_and_widens_back_exactly() -> None:
    wide = np.array([1.0, -2.5, 0.1, 3.0e38], np.float64)  # read as its float32 values
    bits = float32_to_bfloat16(wide)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, float32_to_bfloat16(wide.astype(np.float32)))
    assert bits.tolist()[:3] == [0x3F80, 0xC020, 0x3DCD]
    assert bfloat16_to_float32(np.array([0x3F80, 0xC020], np.uint16)).tolist() == [1.0, -2.5]
    assert bfloat16_to_float32(np.array([0x3F80, 0xC020], np.uint16)).dtype == np.float32


@pytest.mark.torch
def test_bfloat16_rounding_is_torchs() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=100_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = values[np.isfinite(values)]
    theirs = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(float32_to_bfloat16(values), theirs.view(np.uint16))


def test_wire_encoders_label_bfloat16_and_carry_row_ids() -> None:
    bits = float32_to_bfloat16(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32))
    first = next(iter(tensor_to_chunks("e", bits, 4, bfloat16=True, indices=IDS[:2])))
    whole = tensor_to_proto("e", bits, bfloat16=True, indices=IDS[:2])
    for message in (first, whole):
        assert (message.dtype, message.indices) == ("bfloat16", IDS[:2].tobytes())
    assembler = ChunkAssembler()
    assembler.add(whole)
    np.testing.assert_array_equal(assembler.finish()["e"], [[1.0, 2.0], [3.0, 4.0]])
    assert assembler.indices["e"].tolist() == IDS[:2].tolist()
    chunks = list(tensor_to_chunks("e", ROWS, 16, indices=IDS))
    assert [bool(c.indices) for c in chunks] == [True, False, False]  # first chunk only
    with pytest.raises(InvalidRequestError, match="variable 'grad_w'"):
        list(tensor_to_chunks("grad_w", np.zeros(2, np.complex64)))
    with pytest.raises(InvalidRequestError, match="variable 'grad_w'"):
        tensor_to_proto("grad_w", np.zeros(2, np.uint16))  # uint16 only as bfloat16


def test_large_arrays_take_the_fast_finiteness_check_to_the_same_answer() -> None:
    big = np.ones((300, 300), np.float32)  # 90,000 elements: over the fast path's threshold
    check_tensor("big", (300, 300), "float32", big, "push")
    huge = np.full((300, 300), 1e30, np.float32)  # finite, but its dot overflows
    check_tensor("big", (300, 300), "float32", huge, "push")
    for bad in (np.nan, np.inf):
        broken = big.copy()
        broken[150, 7] = bad
        with pytest.raises(InvalidRequestError, match="push has 1 non-finite values"):
            check_tensor("big", (300, 300), "float32", broken, "push")


def test_encoders_normalise_what_they_are_given() -> None:
    big_endian = np.array([1.5, -2.0], dtype=">f4")
    message = tensor_to_proto("x", big_endian)
    assert message.dtype == "float32" and message.data == np.array([1.5, -2.0], "<f4").tobytes()
    narrow_ids = tensor_to_proto("e", ROWS[:2], indices=np.array([5, 9], np.int32))
    assert message.total_bytes == 8 and narrow_ids.indices == IDS[:2].tobytes()
    with pytest.raises(ValueError, match=r"^bfloat16 bit patterns are uint16, 'x' is float32$"):
        tensor_to_proto("x", np.ones(2, np.float32), bfloat16=True)
    with pytest.raises(InvalidRequestError, match="variable 'c' has unsupported dtype"):
        check_tensor("c", (2,), "complex64", np.zeros(2, np.complex64), "push")


def test_malformed_streams_are_named_for_what_is_wrong() -> None:
    with pytest.raises(InvalidRequestError, match=r"^tensor chunk without a name starts a tensor$"):
        ChunkAssembler().add(ps_pb2.TensorChunk(data=b"1234"))
    first, second, *_ = tensor_to_chunks("e", ROWS, 16, indices=IDS)
    second.indices = IDS.tobytes()
    assembler = ChunkAssembler()
    assembler.add(first)
    with pytest.raises(
        InvalidRequestError,
        match=r"^table 'e': row ids in a chunk at byte offset 16; they belong in the tensor's "
        r"first chunk only$",
    ):
        assembler.add(second)
    with pytest.raises(
        InvalidRequestError,
        match=r"expected a 2-d tensor and 8 bytes \(one int64 id\) per row$",
    ):
        ChunkAssembler().add(chunk(ROWS, IDS.tobytes()[:8]))
