"""The Flight framing without a network: tensors through batches and back, manifest checks,
and every PSError through a Flight error and back to the same class and status."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow.flight as flight
import pytest

from pswire import flightwire as fw
from pswire.codec import ChunkAssembler, float32_to_bfloat16
from pswire.errors import InvalidRequestError, PSError, TooLargeError, _subclasses
from pswire.proto import ps_pb2
from pswire.tables import RowSparse


class Loopback:
    """A Flight writer and reader in one: what is written is read back, in order."""

    def __init__(self) -> None:
        self.items: list[SimpleNamespace] = []

    def write_with_metadata(self, batch, meta: bytes) -> None:
        self.items.append(SimpleNamespace(data=batch, app_metadata=meta))

    def read_chunk(self) -> SimpleNamespace:
        if not self.items:
            raise StopIteration
        return self.items.pop(0)


TENSORS = {
    "f32": np.arange(24, dtype=np.float32).reshape(4, 6),
    "f64": np.linspace(0, 1, 5),
    "i64": np.arange(7, dtype=np.int64),
    "bool": np.array([True, False, True]),
    "empty": np.zeros((0, 3), np.float32),
    "scalar": np.array(2.5, np.float32),
    "strided": np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2],
    "big_endian": np.arange(3, dtype=">f4"),
}


@pytest.mark.parametrize("piece_bytes", [1, 7, 16, fw.PIECE_BYTES])
def test_tensors_survive_batches_of_any_size(piece_bytes: int) -> None:
    entries, raws = fw.encode_tensors(TENSORS)
    pipe = Loopback()
    fw.write_tensors(pipe, raws, piece_bytes)
    got = fw.read_tensors(pipe, entries, ChunkAssembler(), "test")
    assert not pipe.items  # every batch consumed, none left over
    for name, want in TENSORS.items():
        assert got[name].dtype == want.dtype.newbyteorder("<")
        np.testing.assert_array_equal(got[name], want)


def test_a_single_batch_tensor_is_a_view_of_the_received_buffer() -> None:
    entries, raws = fw.encode_tensors({"w": np.ones(1000, np.float32)})
    pipe = Loopback()
    fw.write_tensors(pipe, raws, fw.PIECE_BYTES)
    batch = pipe.items[0].data
    got = fw.read_tensors(pipe, entries, ChunkAssembler(), "test")["w"]
    assert got.ctypes.data == batch.column(0).buffers()[1].address  # no copy on receipt


def test_rows_and_bfloat16_keep_their_labels() -> None:
    ids = np.array([3, 1], np.int64)
    values = np.ones((2, 4), np.float32)
    bits = float32_to_bfloat16(np.full(5, 0.5, np.float32))
    entries, raws = fw.encode_tensors({"t": RowSparse(ids, values), "g": bits})
    assert [e.dtype for e in entries] == ["float32", "bfloat16"]
    pipe = Loopback()
    fw.write_tensors(pipe, raws, 8)
    assembler = ChunkAssembler()
    got = fw.read_tensors(pipe, entries, assembler, "test")
    np.testing.assert_array_equal(assembler.indices["t"], ids)
    np.testing.assert_array_equal(got["g"], np.full(5, 0.5, np.float32))  # widened


def entry(**fields) -> ps_pb2.TensorChunk:
    base = {"name": "w", "dtype": "float32", "shape": [2, 3], "total_bytes": 24}
    return ps_pb2.TensorChunk(**{**base, **fields})


@pytest.mark.parametrize(
    ("entries", "error", "message"),
    [
        ([entry(total_bytes=20)], InvalidRequestError, "declares 20 bytes"),
        ([entry(dtype="float8")], InvalidRequestError, "unsupported dtype"),
        ([entry(shape=[2, -3], total_bytes=0)], InvalidRequestError, "negative dim"),
        ([entry(), entry()], InvalidRequestError, "appears twice"),
        ([entry(), entry(name="v")], TooLargeError, "reaches 48 bytes at variable 'v'"),
    ],
)
def test_the_manifest_is_checked_before_any_byte(entries, error, message) -> None:
    with pytest.raises(error, match=message):
        fw.check_manifest(entries, 40, "test")


def test_a_batch_that_is_not_one_uint8_column_is_refused() -> None:
    import pyarrow as pa

    floats = pa.RecordBatch.from_arrays([pa.array([1.0, 2.0])], names=["x"])
    with pytest.raises(InvalidRequestError, match="one uint8 column"):
        fw.batch_bytes(floats, "test")
    nulls = pa.RecordBatch.from_arrays([pa.array([1, None], pa.uint8())], names=["bytes"])
    with pytest.raises(InvalidRequestError, match="1 nulls"):
        fw.batch_bytes(nulls, "test")


@pytest.mark.parametrize("cls", [c for c in _subclasses(PSError) if c is not PSError])
def test_every_error_class_and_status_survives_a_flight_error(cls) -> None:
    sent = cls("variable 'fc.weight' has shape (2, 3) on the server, push sent (3, 2)")
    wire = fw.to_flight_error(sent, "DoExchange")
    assert isinstance(wire, flight.FlightError)
    got = fw.from_flight_error(wire, "push_pull on shard 0")
    assert type(got) is cls
    assert got.status == cls.status
    assert str(got) == f"push_pull on shard 0: {sent}"


def test_an_unexpected_error_is_internal_and_sanitized() -> None:
    wire = fw.to_flight_error(KeyError("/secret/path"), "DoExchange")
    assert isinstance(wire, flight.FlightInternalError)
    got = fw.from_flight_error(wire)
    assert got.status == "INTERNAL" and "secret" not in str(got)


def test_flights_own_errors_map_to_their_status() -> None:
    got = fw.from_flight_error(flight.FlightUnavailableError("connection refused"))
    assert got.status == "UNAVAILABLE"
    assert fw.from_flight_error(flight.FlightTimedOutError("late")).status == "DEADLINE_EXCEEDED"
