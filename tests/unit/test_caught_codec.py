"""Row ids against rows: the decoder refuses a row-sparse tensor whose id bytes are not exactly
one int64 per row of a 2-d tensor, on the protobuf and the hand-parsed path alike."""

from __future__ import annotations

import numpy as np
import pytest

from pswire.codec import ChunkAssembler, tensor_to_chunks
from pswire.errors import InvalidRequestError
from pswire.proto import ps_pb2
from pswire.stubs import stream_request_parser
from pswire.wiremsg import encode_chunk_messages

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
