"""Hand-coded stream messages: byte-identical to protobuf's, and parsed back exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pswire.codec import ChunkAssembler, float32_to_bfloat16
from pswire.proto import ps_pb2
from pswire.read import parse_chunk, parse_pull_reply, stream_request_parser
from pswire.write import encode_chunk_messages, tensor_to_chunks, varint_field

DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"]
arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6))
)


@settings(max_examples=150, deadline=None)
@given(array=arrays, chunk=st.integers(1, 64), clock=st.integers(0, 2**40))
def test_messages_equal_protobuf_serialization_and_parse_back(array, chunk, clock):
    reference = [
        ps_pb2.PullResponse(chunk=c, clock=clock).SerializeToString()
        for c in tensor_to_chunks("v/part0of2", array, chunk)
    ]
    ours = list(
        encode_chunk_messages("v/part0of2", array, 1, chunk, trailer=varint_field(2, clock))
    )
    assert ours == reference
    pushes = [
        ps_pb2.PushRequest(chunk=c).SerializeToString() for c in tensor_to_chunks("v", array, chunk)
    ]
    assert list(encode_chunk_messages("v", array, 2, chunk)) == pushes

    assembler = ChunkAssembler()
    for message in ours:
        reply = parse_pull_reply(message)
        assert reply.clock == clock
        assembler.add(reply.chunk)
    (got,) = assembler.finish().values()
    assert got.dtype == array.dtype and got.shape == array.shape
    assert got.tobytes() == np.ascontiguousarray(array).tobytes()


def test_parsed_chunk_data_is_a_view_not_a_copy():
    (message,) = encode_chunk_messages("w", np.arange(6, dtype=np.float32), 2)
    request = stream_request_parser(ps_pb2.PushHeader)(message)
    assert request.WhichOneof("body") == "chunk"
    assert isinstance(request.chunk.data, memoryview)
    assert request.chunk.data.obj is message


def test_parser_matches_protobuf_on_headers_unknown_fields_and_unpacked_shapes():
    parse = stream_request_parser(ps_pb2.PushHeader)
    header = ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker_id=3, step=9)).SerializeToString()
    request = parse(header + b"\x98\x06\x01")  # plus unknown field 99 = 1: ignored
    assert request.kind == "header" and (request.header.worker_id, request.header.step) == (3, 9)
    # shape as unpacked varints (legal protobuf) and a negative dim (ten-byte varint)
    chunk = ps_pb2.TensorChunk(name="x", dtype="float32", shape=[-1, 2])
    unpacked = b"\x0a\x01x\x12\x07float32\x18" + (b"\xff" * 9 + b"\x01") + b"\x18\x02"
    assert ps_pb2.TensorChunk.FromString(unpacked) == chunk
    assert parse_chunk(memoryview(unpacked)).shape == [-1, 2]


@pytest.mark.parametrize(
    "junk",
    [b"\x12\x05abc", b"\x12\xff", b"\x0f", b"\x12\x02\x32\x09", b"\x00\x01", b"\x12\x01\x80"],
)
def test_malformed_bytes_raise_like_protobuf(junk):
    with pytest.raises(ValueError):
        stream_request_parser(ps_pb2.PushHeader)(junk)


def test_bfloat16_travels_as_its_own_dtype_and_arrives_as_float32():
    values = np.array([1.0, -2.5, 3.140625], np.float32)
    messages = list(encode_chunk_messages("g", float32_to_bfloat16(values), 2, bfloat16=True))
    request = stream_request_parser(ps_pb2.PushHeader)(messages[0])
    assert request.chunk.dtype == "bfloat16"
    assembler = ChunkAssembler()
    assembler.add(request.chunk)
    got = assembler.finish()["g"]
    assert got.dtype == np.float32 and np.array_equal(got, values)
