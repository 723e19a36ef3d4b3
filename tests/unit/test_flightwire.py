"""The Flight framing without a network: tensors through batches and back, manifest checks,
and every PSError through a Flight error and back to the same class and status."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from pscore.tables import RowSparse
from pswire import flightwire as fw
from pswire.codec import ChunkAssembler, float32_to_bfloat16
from pswire.errors import InvalidRequestError, PSError, TooLargeError, _subclasses
from pswire.proto import ps_pb2


class Loopback:
    """A Flight writer and reader in one: what is written is read back, in order."""

    def __init__(self) -> None:
        self.items: list[SimpleNamespace] = []

    def write_with_metadata(self, batch, meta: bytes) -> None:
        self.items.append(SimpleNamespace(data=batch, app_metadata=pa.py_buffer(meta)))

    def write_batch(self, batch) -> None:
        self.items.append(SimpleNamespace(data=batch, app_metadata=None))

    def write_metadata(self, meta: bytes) -> None:
        self.items.append(SimpleNamespace(data=None, app_metadata=pa.py_buffer(meta)))

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
    "large": np.arange(17_000, dtype=np.float32),  # over PACK_BYTES: batches of its own
}


def round_trip(tensors, piece_bytes: int, assembler: ChunkAssembler | None = None):
    """(the tensors back, how many messages the step took)."""
    entries, raws = fw.encode_tensors(tensors)
    pipe = Loopback()
    fw.write_step(pipe, b"header", list(raws.values()), piece_bytes)
    sent = len(pipe.items)
    first = pipe.read_chunk()
    assert first.app_metadata.to_pybytes() == b"header"
    got = fw.read_step(pipe, first.data, entries, assembler or ChunkAssembler(), "test")
    assert not pipe.items  # every batch consumed, none left over
    return got, sent


@pytest.mark.parametrize("piece_bytes", [13, 4096, 50_000, fw.PIECE_BYTES])
def test_tensors_survive_batches_of_any_size(piece_bytes: int) -> None:
    got, _ = round_trip(TENSORS, piece_bytes)
    for name, want in TENSORS.items():
        assert got[name].dtype == want.dtype.newbyteorder("<")
        np.testing.assert_array_equal(got[name], want)


def test_a_small_step_is_one_message_and_a_step_without_bytes_is_its_header() -> None:
    small = {k: v for k, v in TENSORS.items() if k != "large"}
    assert round_trip(small, fw.PIECE_BYTES)[1] == 1
    got, sent = round_trip({"empty": np.zeros(0, np.float32)}, fw.PIECE_BYTES)
    assert sent == 1 and got["empty"].shape == (0,)


def test_a_large_tensor_is_a_view_of_the_received_buffer() -> None:
    entries, raws = fw.encode_tensors({"w": np.ones(100_000, np.float32)})
    pipe = Loopback()
    fw.write_step(pipe, b"h", list(raws.values()), fw.PIECE_BYTES)
    first = pipe.read_chunk()
    got = fw.read_step(pipe, first.data, entries, ChunkAssembler(), "test")["w"]
    assert got.ctypes.data == first.data.column(0).buffers()[1].address  # no copy on receipt
    assert raws["w"].ctypes.data == first.data.column(0).buffers()[1].address  # nor on sending


@pytest.mark.parametrize("piece_bytes", [13, 50_000])
def test_a_step_written_over_time_reads_as_one_written_at_once(piece_bytes: int) -> None:
    # A streamed push: the header alone first, then the tensors a few at a time.
    entries, raws = fw.encode_tensors(TENSORS)
    pipe = Loopback()
    step = fw.StepWriter(pipe, b"header", piece_bytes)
    step.header()
    arrays = list(raws.values())
    for start in range(0, len(arrays), 3):
        step.write(arrays[start : start + 3])
    step.close()
    first = pipe.read_chunk()
    assert first.data is None and first.app_metadata.to_pybytes() == b"header"
    assert all(item.app_metadata is None for item in pipe.items)  # one header per step
    got = fw.read_step(pipe, first.data, entries, ChunkAssembler(), "test")
    for name, want in TENSORS.items():
        np.testing.assert_array_equal(got[name], want)


def test_a_manifest_entry_made_ahead_matches_the_tensors_own() -> None:
    for name, array in [("w", np.ones((3, 4), np.float32)), ("h", np.ones(5, np.float16))]:
        made = fw.manifest_entry(name, array.dtype.name, array.shape)
        assert made == fw.encode_tensor(name, array)[0]
    bits = float32_to_bfloat16(np.ones(6, np.float32))
    assert fw.manifest_entry("b", "bfloat16", (6,)) == fw.encode_tensor("b", bits)[0]
    with pytest.raises(InvalidRequestError, match="dtype"):
        fw.manifest_entry("x", "complex64", (2,))


def test_rows_and_bfloat16_keep_their_labels() -> None:
    ids = np.array([3, 1], np.int64)
    values = np.ones((2, 4), np.float32)
    bits = float32_to_bfloat16(np.full(5, 0.5, np.float32))
    entries, _ = fw.encode_tensors({"t": RowSparse(ids, values), "g": bits})
    assert [e.dtype for e in entries] == ["float32", "bfloat16"]
    assembler = ChunkAssembler()
    got, _ = round_trip({"t": RowSparse(ids, values), "g": bits}, 8, assembler)
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


@pytest.mark.parametrize(("chosen", "expected"), [("", "system"), ("mimalloc", "mimalloc")])
def test_arrows_pool_is_the_system_allocator_unless_the_process_chose_one(
    chosen: str, expected: str
) -> None:
    # mimalloc reserves ~1 GiB of address space at its first allocation: a worker capped with
    # RLIMIT_AS could not start a thread after it (tests/e2e/test_big_table.py).
    code = (
        "import pswire.flightwire, pyarrow as pa\n"
        "pa.allocate_buffer(1 << 20)\n"
        "print(pa.default_memory_pool().backend_name)\n"
    )
    env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": chosen}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
