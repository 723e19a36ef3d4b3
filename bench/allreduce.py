"""All-reduce time of our gRPC ring against torch.distributed gloo, same processes, same run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from psworker.ring.algorithm import RING_CHUNK_BYTES
from psworker.ring.ring import Ring, RingServer

MIB = 1 << 20
GB = 1e9  # bandwidth in decimal GB/s
DEFAULT_JSON = "out/bench_allreduce.json"
WORLDS = (2, 4)
SIZES_MIB = (1, 16, 64)
START_TIMEOUT_S = 120.0
OP_TIMEOUT_S = 120.0
# fork() after grpc has started its threads can deadlock the child; spawn starts clean.
SPAWN = multiprocessing.get_context("spawn")
OURS = "ours"
GLOO = "gloo"


@dataclass
class Row:
    """Per-iteration times of one (world size, buffer size): the slowest rank's, per system."""

    world: int
    nbytes: int
    times: dict[str, list[float]] = field(default_factory=dict)

    def median(self, system: str) -> float | None:
        got = self.times.get(system)
        return statistics.median(got) if got else None

    def gbps(self, system: str) -> float | None:
        t = self.median(system)
        return self.nbytes / t / GB if t else None

    @property
    def ratio(self) -> float | None:
        """Our algorithm bandwidth over gloo's (above 1: we are faster)."""
        ours, gloo = self.gbps(OURS), self.gbps(GLOO)
        return ours / gloo if ours and gloo else None

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world,
            "bytes": self.nbytes,
            "ours_median_s": self.median(OURS),
            "gloo_median_s": self.median(GLOO),
            "ours_algbw_gbps": self.gbps(OURS),
            "gloo_algbw_gbps": self.gbps(GLOO),
            "ratio_ours_over_gloo": self.ratio,
            "ours_s": self.times.get(OURS, []),
            "gloo_s": self.times.get(GLOO, []),
        }


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def free_port() -> int:
    """A loopback port free a moment ago (for gloo's TCP store, which cannot report one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- one rank: a child process running both systems, interleaved ---------------------------


Ops = tuple[Callable[[], object], Callable[[np.ndarray], object]]  # (barrier, in-place all-reduce)


def _gloo_ops(rank: int, world: int, port: int) -> tuple[Ops, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=OP_TIMEOUT_S),
    )

    def allreduce(buffer: np.ndarray) -> None:
        dist.all_reduce(torch.from_numpy(buffer))  # shares memory: sums in place, like ours

    return (dist.barrier, allreduce), dist


def _rank_main(
    conn: Connection,
    rank: int,
    world: int,
    gloo_port: int | None,
    sizes: list[int],
    iters: int,
    warmup: int,
    chunk_bytes: int,
) -> None:
    """Child process: times both systems on the same buffers, alternating every iteration."""
    server = RingServer("127.0.0.1:0")
    conn.send(server.address)
    addresses = conn.recv()
    ring = Ring(rank, addresses, timeout=OP_TIMEOUT_S, chunk_bytes=chunk_bytes, server=server)
    systems: dict[str, Ops] = {
        OURS: (ring.barrier, lambda buffer: ring.allreduce(buffer, inplace=True))
    }
    dist = None
    if gloo_port is not None:
        systems[GLOO], dist = _gloo_ops(rank, world, gloo_port)
    expected = world * (world + 1) / 2
    results: dict[int, dict[str, list[float]]] = {}
    try:
        for nbytes in sizes:
            source = np.full(nbytes // 4, rank + 1, dtype=np.float32)
            buffer = np.empty_like(source)
            times: dict[str, list[float]] = {name: [] for name in systems}
            for i in range(warmup + iters):
                for name, (barrier, allreduce) in systems.items():
                    np.copyto(buffer, source)
                    barrier()  # every rank starts the timed op together
                    t0 = time.perf_counter()
                    allreduce(buffer)
                    elapsed = time.perf_counter() - t0
                    if i >= warmup:
                        times[name].append(elapsed)
                    if not np.all(buffer == expected):
                        raise RuntimeError(f"{name}: wrong sum on rank {rank}, expected {expected}")
            results[nbytes] = times
        conn.send(results)
    finally:
        ring.close()
        if dist is not None:
            dist.destroy_process_group()


def run_world(
    world: int, sizes: list[int], iters: int, warmup: int, chunk_bytes: int, gloo: bool
) -> list[Row]:
    """Starts ``world`` rank processes, wires them up, and gathers their timings.

    Raises:
        RuntimeError: a rank died or reported nothing in time.
    """
    port = free_port() if gloo else None
    pipes, procs = [], []
    for rank in range(world):
        parent, child = SPAWN.Pipe()
        args = (child, rank, world, port, sizes, iters, warmup, chunk_bytes)
        proc = SPAWN.Process(target=_rank_main, args=args, daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)

    def receive(rank: int, timeout: float) -> Any:
        if not pipes[rank].poll(timeout):
            raise RuntimeError(f"rank {rank} sent nothing within {timeout:g} s")
        try:
            return pipes[rank].recv()
        except EOFError:
            raise RuntimeError(f"rank {rank} died (exit code {procs[rank].exitcode})") from None

    try:
        addresses = [receive(rank, START_TIMEOUT_S) for rank in range(world)]
        for pipe in pipes:
            pipe.send(addresses)
        budget = START_TIMEOUT_S + OP_TIMEOUT_S * len(sizes) * (iters + warmup)
        per_rank = [receive(rank, budget) for rank in range(world)]
    finally:
        for proc in procs:
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
    rows = []
    for nbytes in sizes:
        row = Row(world, nbytes)
        for system in per_rank[0][nbytes]:
            # A collective takes as long as its slowest rank.
            per_iter = zip(*(r[nbytes][system] for r in per_rank), strict=True)
            row.times[system] = [max(ts) for ts in per_iter]
        rows.append(row)
    return rows


# -- driver ----------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    print()
    print(
        f"float32 all-reduce (sum), median of {args.iters} iterations after {args.warmup} "
        f"warm-up, each rank a process, ours with {args.chunk_bytes // 1024} KiB chunks; "
        "timed after a barrier; algbw = buffer bytes / time, GB = 1e9 bytes"
    )
    head = (
        f"{'world':>5}{'buffer':>9}{'ours ms':>10}{'gloo ms':>10}"
        f"{'ours GB/s':>11}{'gloo GB/s':>11}{'ours/gloo':>11}"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        ours, gloo = row.median(OURS), row.median(GLOO)
        print(
            f"{row.world:>5}{f'{row.nbytes // MIB} MiB':>9}"
            f"{_fmt(ours and ours * 1e3, '.1f'):>10}{_fmt(gloo and gloo * 1e3, '.1f'):>10}"
            f"{_fmt(row.gbps(OURS), '.3f'):>11}{_fmt(row.gbps(GLOO), '.3f'):>11}"
            f"{_fmt(row.ratio, '.2f'):>11}"
        )
    print("ours/gloo: our algorithm bandwidth over gloo's (below 1: gloo is faster).")


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    if torch_available():
        import torch

        env["torch"] = torch.__version__
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.allreduce", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 MiB only, 3 iterations")
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=None)
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    parser.add_argument("--chunk-bytes", type=int, default=RING_CHUNK_BYTES)
    parser.add_argument("--no-gloo", action="store_true", help="skip the torch gloo peer")
    parser.add_argument("--json", default=DEFAULT_JSON, help=f"output path ({DEFAULT_JSON})")
    args = parser.parse_args(argv)
    if args.sizes_mib is None:
        args.sizes_mib = [1] if args.quick else list(SIZES_MIB)
    if args.iters is None:
        args.iters = 3 if args.quick else 5
    if args.iters < 1 or args.warmup < 0 or min(args.worlds) < 1 or min(args.sizes_mib) < 1:
        parser.error("--iters, --worlds and --sizes-mib must be >= 1, --warmup >= 0")
    gloo = not args.no_gloo and torch_available()
    if not gloo and not args.no_gloo:
        print("note: torch is not installed; measuring ours alone", file=sys.stderr)

    t0 = time.perf_counter()
    rows: list[Row] = []
    sizes = [mib * MIB for mib in args.sizes_mib]
    for world in args.worlds:
        print(f"world size {world}: {len(sizes)} sizes", flush=True)
        rows += run_world(world, sizes, args.iters, args.warmup, args.chunk_bytes, gloo)
    elapsed = time.perf_counter() - t0
    print_table(rows, args)
    print(f"total {elapsed:.0f}s")

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "bench": "allreduce",
        "command": " ".join(["python -m bench.allreduce", *(argv or sys.argv[1:])]),
        "iterations": args.iters,
        "warmup": args.warmup,
        "chunk_bytes": args.chunk_bytes,
        "peer": "torch.distributed.all_reduce, gloo backend" if gloo else None,
        "environment": environment(),
        "total_s": elapsed,
        "rows": [row.to_json() for row in rows],
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def measure(quick: bool) -> Any:
    """The suite's table (bench/__main__.py): 1/16/64 MiB at 2 and 4 workers; quick: 1 MiB, 2."""
    from bench.report import Ratio, Table, check

    t0 = time.perf_counter()
    worlds = [2] if quick else list(WORLDS)
    sizes = [MIB] if quick else [s * MIB for s in SIZES_MIB]
    iters = 3 if quick else 5
    gloo = torch_available()
    rows: list[Row] = []
    for world in worlds:
        print(f"allreduce: world {world}, {len(sizes)} sizes, {iters} iterations", flush=True)
        rows += run_world(world, sizes, iters, 1, RING_CHUNK_BYTES, gloo)
    table_rows, ratios = [], []
    for row in rows:
        ours, peer = row.median(OURS), row.median(GLOO)
        time_ratio = ours / peer if ours and peer else None
        label = f"{row.world} workers, {row.nbytes // MIB} MiB"
        table_rows.append(
            [
                label,
                ours and ours * 1e3,
                peer and peer * 1e3,
                row.gbps(OURS),
                row.gbps(GLOO),
                time_ratio,
            ]
        )
        goal = "<= 1.5" if row.world == 4 and row.nbytes == 64 * MIB else ""
        ratios.append(
            Ratio(
                "allreduce",
                label,
                "ring",
                "gloo",
                time_ratio,
                meaning="time, <1: ours faster",
                goal=goal,
                met=check(time_ratio, goal),
            )
        )
    return Table(
        name="allreduce",
        title="float32 all-reduce (sum): our gRPC ring vs torch.distributed gloo",
        columns=["config", "ours ms", "gloo ms", "ours GB/s", "gloo GB/s", "ours/gloo time"],
        rows=table_rows,
        notes=[
            f"median of {iters} iterations after 1 warm-up, slowest rank's time, each rank a "
            "process; algbw = buffer bytes / time, GB = 1e9 bytes."
        ],
        ratios=ratios,
        plot=None,
        raw={"rows": [r.to_json() for r in rows]},
        elapsed_s=time.perf_counter() - t0,
    )
