"""Issue 16's spike: a ring all-reduce over Arrow Flight against gloo and our gRPC ring today.

Each rank runs a Flight server that takes its left neighbour's chunks on one DoPut stream kept
open for the whole run, and sends to its right neighbour on another. A received chunk is a
numpy view of gRPC's buffer: the reduce-scatter adds it straight into the rank's buffer, the
all-gather copies it in, and the same region of the buffer goes on to the right neighbour at
once (pipelined by chunk), built into a record batch without a copy.
"""

from __future__ import annotations

import contextlib
import queue
import struct
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pyarrow.flight as flight

from bench import allreduce
from bench.flight_proto import SCHEMA, as_batch
from psworker.ring.algorithm import RING_CHUNK_BYTES
from psworker.ring.ring import Ring, RingServer

MIB = 1 << 20
META = struct.Struct("<QII")  # (all-reduce number, ring step, chunk)
TIMEOUT_S = 120.0
OURS = "ours (psworker Ring, Flight since issue 28)"
FLIGHT = "Flight ring (prototype)"
GLOO = "gloo"


class _Inbox(flight.FlightServerBase):
    """Receives the left neighbour's chunks; hands them over in arrival order."""

    def __init__(self) -> None:
        super().__init__("grpc+tcp://127.0.0.1:0")
        self.chunks: queue.SimpleQueue[tuple[tuple[int, int, int], np.ndarray]] = (
            queue.SimpleQueue()
        )

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                return
            meta = META.unpack(chunk.app_metadata.to_pybytes())
            # A view of gRPC's received buffer; it lives as long as the array does.
            self.chunks.put((meta, chunk.data.column(0).to_numpy(zero_copy_only=True)))


class FlightRing:
    """Ring all-reduce (sum, in place) of float32 buffers over Flight, pipelined by chunk."""

    def __init__(self, rank: int, addresses: list[str], inbox: _Inbox) -> None:
        self.rank, self.world = rank, len(addresses)
        self.inbox = inbox
        right = addresses[(rank + 1) % self.world]
        self.client = flight.FlightClient(f"grpc+tcp://{right}")
        self.writer, _ = self.client.do_put(flight.FlightDescriptor.for_command(b"ring"), SCHEMA)
        self.outbox: queue.SimpleQueue[tuple[np.ndarray, bytes] | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self.sender = threading.Thread(target=self._send, daemon=True)
        self.sender.start()
        self.count = 0

    def _send(self) -> None:
        while (item := self.outbox.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
            else:
                self.writer.write_with_metadata(as_batch(item[0]), item[1])

    def allreduce(self, buffer: np.ndarray) -> None:
        """Sums ``buffer`` over the ranks, in place.

        Raises:
            RuntimeError: a chunk arrived out of order (a broken ring).
        """
        w, r, n = self.world, self.rank, self.count
        self.count += 1
        bounds = np.linspace(0, buffer.size, w + 1).round().astype(int)
        seg_elems = (bounds[1] - bounds[0]) or 1
        chunk = min(RING_CHUNK_BYTES // 4, max(MIB // 4, seg_elems // 4))

        def chunks(seg: int) -> list[np.ndarray]:
            lo, hi = int(bounds[seg]), int(bounds[seg + 1])
            return [buffer[a : min(a + chunk, hi)] for a in range(lo, hi, chunk)]

        for c, region in enumerate(chunks(r)):
            self.outbox.put((region, META.pack(n, 0, c)))
        last = 2 * w - 3
        for s in range(2 * w - 2):
            for c, region in enumerate(chunks((r - s - 1) % w)):
                meta, got = self.inbox.chunks.get(timeout=TIMEOUT_S)
                if meta != (n, s, c):
                    raise RuntimeError(f"rank {r}: got chunk {meta}, expected {(n, s, c)}")
                if s < w - 1:
                    np.add(region, got, out=region)
                else:
                    np.copyto(region, got)
                if s < last:
                    self.outbox.put((region, META.pack(n, s + 1, c)))
        # Sends go out of the caller's buffer without a copy: it is the caller's again only
        # once gRPC has taken the last of them (a write returns when gRPC is done with it).
        sent = threading.Event()
        self.outbox.put(sent)
        if not sent.wait(TIMEOUT_S):
            raise RuntimeError(f"rank {r}: sends not done in {TIMEOUT_S} s")

    def close(self) -> None:
        self.outbox.put(None)
        self.sender.join(TIMEOUT_S)
        with contextlib.suppress(flight.FlightError):
            self.writer.close()
        self.client.close()


def _rank_main(
    conn: Connection, rank: int, world: int, port: int, sizes: list[int], iters: int
) -> None:
    """Child process: our ring, the Flight ring and gloo on the same buffers, alternating."""
    server = RingServer("127.0.0.1:0")
    inbox = _Inbox()
    conn.send((server.address, f"127.0.0.1:{inbox.port}"))
    addresses = conn.recv()
    ring = Ring(rank, [a for a, _ in addresses], timeout=TIMEOUT_S, server=server)
    fring = FlightRing(rank, [b for _, b in addresses], inbox)
    (barrier, gloo_allreduce), dist = allreduce._gloo_ops(rank, world, port)
    systems = {
        OURS: lambda b: ring.allreduce(b, inplace=True),
        FLIGHT: fring.allreduce,
        GLOO: gloo_allreduce,
    }
    expected = world * (world + 1) / 2
    results: dict[int, dict[str, list[float]]] = {}
    try:
        for nbytes in sizes:
            source = np.full(nbytes // 4, rank + 1, dtype=np.float32)
            buffer = np.empty_like(source)
            times: dict[str, list[float]] = {name: [] for name in systems}
            for i in range(1 + iters):
                names = list(systems)
                names = names[i % 3 :] + names[: i % 3]
                for name in names:
                    np.copyto(buffer, source)
                    barrier()
                    t0 = time.perf_counter()
                    systems[name](buffer)
                    elapsed = time.perf_counter() - t0
                    if i:
                        times[name].append(elapsed)
                    if not np.all(buffer == expected):
                        raise RuntimeError(f"{name}: wrong sum on rank {rank}")
            results[nbytes] = times
        conn.send(results)
    finally:
        fring.close()
        ring.close()
        inbox.shutdown()
        dist.destroy_process_group()


def run_world(world: int, sizes: list[int], iters: int) -> dict[int, dict[str, list[float]]]:
    """Times the three systems at ``world`` ranks; per size, per system, the slowest rank's
    time of each iteration.

    Raises:
        RuntimeError: a rank died or reported nothing in time.
    """
    port = allreduce.free_port()
    pipes, procs = [], []
    for rank in range(world):
        parent, child = allreduce.SPAWN.Pipe()
        args = (child, rank, world, port, sizes, iters)
        procs.append(allreduce.SPAWN.Process(target=_rank_main, args=args, daemon=True))
        procs[-1].start()
        child.close()
        pipes.append(parent)

    def receive(rank: int, timeout: float) -> Any:
        if not pipes[rank].poll(timeout):
            raise RuntimeError(f"rank {rank} sent nothing within {timeout:g} s")
        try:
            return pipes[rank].recv()
        except EOFError:
            raise RuntimeError(f"rank {rank} died (exit {procs[rank].exitcode})") from None

    try:
        addresses = [receive(rank, allreduce.START_TIMEOUT_S) for rank in range(world)]
        for pipe in pipes:
            pipe.send(addresses)
        per_rank = [receive(rank, TIMEOUT_S * len(sizes) * (iters + 1)) for rank in range(world)]
    finally:
        for proc in procs:
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
    return {
        nbytes: {
            system: [max(ts) for ts in zip(*(r[nbytes][system] for r in per_rank), strict=True)]
            for system in per_rank[0][nbytes]
        }
        for nbytes in sizes
    }
