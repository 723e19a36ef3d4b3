"""Issue 16's spike: a parameter server on Arrow Flight DoExchange (prototype, bench only).

A Flight server process holds its rows of every variable and applies SGD to each record batch
of gradients as it arrives, answering it at once with the piece's new weights. The client
builds each batch from a view of the caller's gradient (``pa.py_buffer``: no copy), keeps
``WINDOW`` pieces in flight per shard, and decodes each reply (a numpy view of the received
buffer) straight into the caller's weight arrays (one copy, the one it must make).
"""

from __future__ import annotations

import contextlib
import struct
import threading
from collections.abc import Iterator
from concurrent import futures
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from bench import peers, torchps

SCHEMA = pa.schema([("v", pa.float32())])
PIECE_BYTES = 4 << 20  # largest record batch each way; swept by `python -m bench.flight --piece`
LR = 1e-3
MOMENTUM = 0.9
META = struct.Struct("<IQ")  # (variable index, element offset in this shard's rows)


def as_batch(flat: np.ndarray) -> pa.RecordBatch:
    """A one-column float32 record batch over ``flat``'s memory (no copy)."""
    array = pa.Array.from_buffers(pa.float32(), len(flat), [None, pa.py_buffer(flat)])
    return pa.RecordBatch.from_arrays([array], schema=SCHEMA)


def row_parts(shape: tuple[int, ...], shards: int) -> list[tuple[int, int]]:
    """Row ranges of a variable over ``shards`` (as torch.tensor_split does; scalars whole)."""
    rows = shape[0] if shape else 1
    bounds = np.linspace(0, rows, shards + 1).round().astype(int) if rows >= shards else None
    if bounds is None:
        return [(0, rows)] + [(rows, rows)] * (shards - 1)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(shards)]


def shard_part(a: np.ndarray, part: tuple[int, int]) -> np.ndarray:
    """The flat view of rows ``part`` of ``a`` (contiguous: rows of a C-order array)."""
    return (a[part[0] : part[1]] if a.ndim else a.reshape(1)).reshape(-1)


def pieces(flat: np.ndarray, piece_elems: int) -> Iterator[tuple[int, np.ndarray]]:
    for off in range(0, len(flat), piece_elems):
        yield off, flat[off : off + piece_elems]


# -- the server --------------------------------------------------------------------------------


class FlightPS(flight.FlightServerBase):
    """Holds this shard's rows of every variable; SGD per received piece, weights sent back."""

    def __init__(self, values: list[np.ndarray], momentum: float) -> None:
        super().__init__("grpc+tcp://127.0.0.1:0")
        self.values = values
        self.momentum = momentum
        self.buffers = [np.zeros_like(v) for v in values] if momentum else []
        self.lock = threading.Lock()

    def do_exchange(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        writer.begin(SCHEMA)
        scratch = np.empty(PIECE_BYTES // 4, dtype=np.float32)
        for chunk in reader:
            index, off = META.unpack(chunk.app_metadata.to_pybytes())
            grad = chunk.data.column(0).to_numpy(zero_copy_only=True)
            n = len(grad)
            w = self.values[index][off : off + n]
            tmp = scratch[:n] if n <= len(scratch) else np.empty(n, np.float32)
            with self.lock:
                if self.momentum:
                    buf = self.buffers[index][off : off + n]
                    buf *= self.momentum
                    buf += grad
                    grad = buf
                np.multiply(grad, -LR, out=tmp)
                w += tmp
                # Flight sends the batch from w's memory; the write returns once gRPC is done
                # with it (one worker here: nothing else writes w meanwhile).
                writer.write_with_metadata(as_batch(w), chunk.app_metadata)


def _serve(
    conn: Connection, shapes: dict[str, tuple[int, ...]], shard: int, shards: int, momentum: float
) -> None:
    """Child process: one Flight PS shard with rows ``shard`` of the bench model."""
    # torchps.model_arrays' values, one variable at a time: the peak must not count a whole
    # model this process never holds once it serves.
    rng = np.random.default_rng(0)
    values = []
    for shape in shapes.values():
        whole = rng.standard_normal(shape, dtype=np.float32)
        values.append(shard_part(whole, row_parts(whole.shape, shards)[shard]).copy())
        del whole
    idle = peers_status()
    server = FlightPS(values, momentum)
    conn.send((f"127.0.0.1:{server.port}", idle))
    try:
        with contextlib.suppress(EOFError):
            while conn.recv():  # a request for the peak RSS, or None to stop
                conn.send(peers_status())
    finally:
        server.shutdown()


def peers_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


# -- the client --------------------------------------------------------------------------------


class FlightClientPS:
    """push_pull of the whole model against Flight PS shards; ``out=`` semantics."""

    def __init__(
        self,
        addresses: list[str],
        model: dict[str, np.ndarray],
        grads: dict[str, np.ndarray],
        open_exchange: bool,
        piece_bytes: int = PIECE_BYTES,
    ) -> None:
        n = len(addresses)
        self.clients = [flight.FlightClient(f"grpc+tcp://{a}") for a in addresses]
        self.open_exchange = open_exchange
        self.piece_elems = piece_bytes // 4
        self.grads = grads
        self.out = model  # the caller's arrays: the weights land here
        self.parts = {k: row_parts(a.shape, n) for k, a in model.items()}
        self.streams: list[tuple[Any, Any] | None] = [None] * n
        self.pool = futures.ThreadPoolExecutor(max_workers=n) if n > 1 else None
        self.readers = futures.ThreadPoolExecutor(max_workers=n)

    def _open(self, shard: int) -> tuple[Any, Any]:
        writer, reader = self.clients[shard].do_exchange(flight.FlightDescriptor.for_command(b"s"))
        writer.begin(SCHEMA)
        return writer, reader

    def _shard_step(self, shard: int) -> int:
        stream = self.streams[shard] or self._open(shard)
        if self.open_exchange:
            self.streams[shard] = stream
        writer, reader = stream
        outs: list[np.ndarray] = []
        sends: list[tuple[np.ndarray, bytes]] = []
        for index, (name, grad) in enumerate(self.grads.items()):
            part = self.parts[name][shard]
            outs.append(shard_part(self.out[name], part))
            for off, g in pieces(shard_part(grad, part), self.piece_elems):
                sends.append((g, META.pack(index, off)))

        def read(count: int) -> None:
            for _ in range(count):
                chunk = reader.read_chunk()
                index, off = META.unpack(chunk.app_metadata.to_pybytes())
                got = chunk.data.column(0).to_numpy(zero_copy_only=True)
                np.copyto(outs[index][off : off + len(got)], got)

        if len(sends) == 1:  # one piece: no thread hand-off
            writer.write_with_metadata(as_batch(sends[0][0]), sends[0][1])
            read(1)
        else:
            # Replies are read while pieces are still being written: gRPC's flow control
            # would stall a writer whose peer is blocked sending it replies nobody reads.
            reading = self.readers.submit(read, len(sends))
            for g, meta in sends:
                writer.write_with_metadata(as_batch(g), meta)
            reading.result()
        if not self.open_exchange:
            writer.done_writing()
            with contextlib.suppress(StopIteration):
                reader.read_chunk()
            writer.close()
        return len(sends)

    def step(self) -> None:
        if self.pool is None:
            self._shard_step(0)
        else:
            list(self.pool.map(self._shard_step, range(len(self.clients))))

    def close(self) -> None:
        for stream in self.streams:
            if stream is not None:
                stream[0].done_writing()
                with contextlib.suppress(StopIteration, flight.FlightError):
                    stream[1].read_chunk()
                stream[0].close()
        for c in self.clients:
            c.close()
        if self.pool is not None:
            self.pool.shutdown()
        self.readers.shutdown()


@contextlib.contextmanager
def flight_shards(
    shapes: dict[str, tuple[int, ...]], shards: int, momentum: float = 0.0
) -> Iterator[tuple[list[str], list[Any]]]:
    """``shards`` Flight PS processes; yields their addresses and a peak-RSS probe per shard."""
    with contextlib.ExitStack() as stack:
        addresses, probes = [], []
        for s in range(shards):
            parent, child = peers.SPAWN.Pipe()
            proc = peers.SPAWN.Process(
                target=_serve, args=(child, shapes, s, shards, momentum), daemon=True
            )
            proc.start()
            child.close()
            if not parent.poll(peers.START_TIMEOUT_S):
                proc.kill()
                raise RuntimeError("Flight PS shard sent no address")
            address, idle = parent.recv()

            def stop(parent: Connection = parent, proc: Any = proc) -> None:
                with contextlib.suppress(OSError):
                    parent.send(None)
                proc.join(10.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5.0)

            def probe(parent: Connection = parent, idle: dict = idle) -> dict[str, int]:
                parent.send(True)
                return {**parent.recv(), "idle": idle["VmRSS"]}

            stack.callback(stop)
            addresses.append(address)
            probes.append(probe)
        yield addresses, probes


@contextlib.contextmanager
def flight_step(
    shapes: dict[str, tuple[int, ...]], shards: int, open_exchange: bool, piece_bytes: int
) -> Iterator[Any]:
    """A step callable: push_pull of the bench model over Flight, into the model's arrays."""
    model = torchps.model_arrays(shapes)
    grads = {k: np.full_like(v, 1e-4) for k, v in model.items()}
    with flight_shards(shapes, shards) as (addresses, _):
        client = FlightClientPS(addresses, model, grads, open_exchange, piece_bytes)
        try:
            yield client.step
        finally:
            client.close()
