"""All-reduce time of gloo, our bare Flight ring and the SDK's ``push``, same processes, same run.

Each rank is a worker that ``psctl local --mode allreduce`` starts, as a training script would
be: it connects with ``psworker.connect()`` (the SDK's ring on the ports psctl hands out),
initialises one float32 variable of the buffer's size with SGD at lr 0 (so the step applies
nothing and ``push`` times the SDK's communication path: buckets, the agreement digest, the
averaging, the local step's checks), and joins a gloo group. Every iteration times, in rotating
order and each after a barrier: gloo's ``all_reduce`` of the buffer, the SDK's own ``Ring``
summing the buffer in place (the bare ring), and ``client.push({"w": grad})``. A collective
takes as long as its slowest rank; the table shows the medians over iterations and the ratios
SDK/gloo and SDK/bare ring.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow

from bench.torchps import free_port
from psworker.ring.algorithm import RING_CHUNK_BYTES

MIB = 1 << 20
GB = 1e9  # bandwidth in decimal GB/s
DEFAULT_JSON = "out/bench_allreduce.json"
WORLDS = (2, 4)
SIZES_MIB = (64,)
START_TIMEOUT_S = 120.0
OP_TIMEOUT_S = 120.0
# fork() after grpc has started its threads can deadlock the child; spawn starts clean.
SPAWN = multiprocessing.get_context("spawn")
RING = "ring"
SDK = "sdk"
GLOO = "gloo"
SYSTEMS = (GLOO, RING, SDK)
# Issue 28's targets at 64 MiB: SDK time / gloo's by world size, and SDK / bare ring.
SDK_OVER_GLOO_GOAL = {2: 1.3, 4: 1.5}
SDK_OVER_RING_GOAL = 1.10


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

    def ratio(self, system: str, peer: str) -> float | None:
        """``system``'s median time over ``peer``'s (above 1: ``system`` is slower)."""
        a, b = self.median(system), self.median(peer)
        return a / b if a and b else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"world_size": self.world, "bytes": self.nbytes}
        for system in SYSTEMS:
            out[f"{system}_median_s"] = self.median(system)
            out[f"{system}_algbw_gbps"] = self.gbps(system)
            out[f"{system}_s"] = self.times.get(system, [])
        out["sdk_over_gloo"] = self.ratio(SDK, GLOO)
        out["sdk_over_ring"] = self.ratio(SDK, RING)
        out["ring_over_gloo"] = self.ratio(RING, GLOO)
        return out


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


# -- one rank: a worker under psctl local, timing the three systems interleaved --------------


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


def rank_main(out: Path, sizes: list[int], iters: int, warmup: int, gloo_port: int | None) -> None:
    """A worker under ``psctl local``: times gloo, the bare ring and the SDK's push, rotating
    their order every iteration, and writes its times to ``out/rank<i>.json``.

    Raises:
        RuntimeError: a sum came out wrong.
    """
    import psworker

    client = psworker.connect(mode="allreduce", timeout=OP_TIMEOUT_S)
    rank, world = client.worker_id, client.num_workers
    assert isinstance(client, psworker.AllReduceClient)
    ring = client.ring
    dist = None
    gloo: Ops | None = None
    if gloo_port is not None:
        gloo, dist = _gloo_ops(rank, world, gloo_port)
    expected = world * (world + 1) / 2
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for nbytes in sizes:
            name = f"w{nbytes}"
            client.init({name: np.zeros(nbytes // 4, np.float32)}, psworker.SGD(lr=0.0))
            grad = np.full(nbytes // 4, rank + 1, dtype=np.float32)
            buffer = np.empty_like(grad)
            systems: dict[str, Callable[[], object]] = {
                RING: functools.partial(ring.allreduce, buffer, inplace=True),
                SDK: functools.partial(client.push, {name: grad}),
            }
            if gloo is not None:
                systems[GLOO] = functools.partial(gloo[1], buffer)
            times: dict[str, list[float]] = {system: [] for system in systems}
            order = list(systems)
            for i in range(warmup + iters):
                for system in order[i % len(order) :] + order[: i % len(order)]:
                    np.copyto(buffer, grad)
                    ring.barrier()  # every rank starts the timed op together
                    t0 = time.perf_counter()
                    systems[system]()
                    elapsed = time.perf_counter() - t0
                    if i >= warmup:
                        times[system].append(elapsed)
                    if system != SDK and not np.all(buffer == expected):
                        raise RuntimeError(f"{system}: wrong sum on rank {rank}, not {expected}")
            results[str(nbytes)] = times
        (out / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        client.close()
        if dist is not None:
            dist.destroy_process_group()


def run_world(world: int, sizes: list[int], iters: int, warmup: int, gloo: bool) -> list[Row]:
    """Runs ``world`` workers under ``psctl local --mode allreduce`` and gathers their times.

    Raises:
        RuntimeError: psctl local failed or a rank reported nothing.
    """
    with tempfile.TemporaryDirectory(prefix="bench-allreduce-") as folder:
        out = Path(folder)
        command = [
            sys.executable,
            "-m",
            "psctl",
            "local",
            "--workers",
            str(world),
            "--mode",
            "allreduce",
            "--",
            sys.executable,
            "-m",
            "bench.allreduce",
            "--rank-out",
            str(out),
            "--sizes-mib",
            *(str(n // MIB) for n in sizes),
            "--iters",
            str(iters),
            "--warmup",
            str(warmup),
        ]
        if gloo:
            command += ["--gloo-port", str(free_port())]
        else:
            command += ["--no-gloo"]
        env = dict(os.environ, PS_RUN_DIR=str(out / "run"))
        budget = START_TIMEOUT_S + OP_TIMEOUT_S * len(sizes) * (iters + warmup)
        done = subprocess.run(command, env=env, timeout=budget, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"psctl local exited with {done.returncode}: {' '.join(command)}")
        per_rank = []
        for rank in range(world):
            path = out / f"rank{rank}.json"
            if not path.exists():
                raise RuntimeError(f"rank {rank} wrote no results ({path})")
            per_rank.append(json.loads(path.read_text()))
    rows = []
    for nbytes in sizes:
        row = Row(world, nbytes)
        for system in per_rank[0][str(nbytes)]:
            # A collective takes as long as its slowest rank.
            per_iter = zip(*(r[str(nbytes)][system] for r in per_rank), strict=True)
            row.times[system] = [max(ts) for ts in per_iter]
        rows.append(row)
    return rows


# -- driver ----------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ms(value: float | None) -> str:
    return _fmt(value and value * 1e3, ".1f")


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    print()
    print(
        f"float32 all-reduce, median of {args.iters} interleaved iterations after {args.warmup} "
        "warm-up, slowest rank's time, each rank a worker under psctl local --mode allreduce; "
        "sdk = client.push (SGD lr 0), ring = the SDK's Ring summing in place (Flight)"
    )
    head = (
        f"{'world':>5}{'buffer':>9}{'gloo ms':>10}{'ring ms':>10}{'sdk ms':>10}"
        f"{'ring/gloo':>11}{'sdk/gloo':>10}{'sdk/ring':>10}"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        print(
            f"{row.world:>5}{f'{row.nbytes // MIB} MiB':>9}{_ms(row.median(GLOO)):>10}"
            f"{_ms(row.median(RING)):>10}{_ms(row.median(SDK)):>10}"
            f"{_fmt(row.ratio(RING, GLOO), '.2f'):>11}{_fmt(row.ratio(SDK, GLOO), '.2f'):>10}"
            f"{_fmt(row.ratio(SDK, RING), '.2f'):>10}"
        )
    print(
        "time ratios (above 1: slower). Issue 28's targets at 64 MiB: sdk/gloo <= "
        f"{SDK_OVER_GLOO_GOAL[2]} with 2 workers, <= {SDK_OVER_GLOO_GOAL[4]} with 4; "
        f"sdk/ring <= {SDK_OVER_RING_GOAL}."
    )


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "pyarrow": pyarrow.__version__,
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
    parser.add_argument("--quick", action="store_true", help="1 MiB, 2 workers, 3 iterations")
    parser.add_argument("--worlds", type=int, nargs="+", default=None)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=None)
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    parser.add_argument("--no-gloo", action="store_true", help="skip the torch gloo peer")
    parser.add_argument("--json", default=DEFAULT_JSON, help=f"output path ({DEFAULT_JSON})")
    # Set by run_world for the workers psctl local starts.
    parser.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sizes_mib is None:
        args.sizes_mib = [1] if args.quick else list(SIZES_MIB)
    if args.worlds is None:
        args.worlds = [2] if args.quick else list(WORLDS)
    if args.iters is None:
        args.iters = 3 if args.quick else 5
    if args.iters < 1 or args.warmup < 0 or min(args.worlds) < 1 or min(args.sizes_mib) < 1:
        parser.error("--iters, --worlds and --sizes-mib must be >= 1, --warmup >= 0")
    sizes = [mib * MIB for mib in args.sizes_mib]
    if args.rank_out is not None:
        rank_main(Path(args.rank_out), sizes, args.iters, args.warmup, args.gloo_port)
        return 0
    gloo = not args.no_gloo and torch_available()
    if not gloo and not args.no_gloo:
        print("note: torch is not installed; measuring ours alone", file=sys.stderr)

    t0 = time.perf_counter()
    rows: list[Row] = []
    for world in args.worlds:
        print(f"world size {world}: {len(sizes)} sizes", flush=True)
        rows += run_world(world, sizes, args.iters, args.warmup, gloo)
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
        "chunk_bytes": RING_CHUNK_BYTES,
        "peer": "torch.distributed.all_reduce, gloo backend" if gloo else None,
        "environment": environment(),
        "total_s": elapsed,
        "rows": [row.to_json() for row in rows],
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


def measure(quick: bool) -> Any:
    """The suite's table (bench/__main__.py): 64 MiB at 2 and 4 workers; quick: 1 MiB, 2."""
    from bench.report import Ratio, Table, check

    t0 = time.perf_counter()
    worlds = [2] if quick else list(WORLDS)
    sizes = [MIB] if quick else [s * MIB for s in SIZES_MIB]
    iters = 3 if quick else 5
    gloo = torch_available()
    rows: list[Row] = []
    for world in worlds:
        print(f"allreduce: world {world}, {len(sizes)} sizes, {iters} iterations", flush=True)
        rows += run_world(world, sizes, iters, 1, gloo)
    table_rows, ratios = [], []
    for row in rows:
        label = f"{row.world} workers, {row.nbytes // MIB} MiB"
        table_rows.append(
            [
                label,
                *(t and t * 1e3 for t in (row.median(GLOO), row.median(RING), row.median(SDK))),
                row.ratio(SDK, GLOO),
                row.ratio(SDK, RING),
            ]
        )
        big = row.nbytes == 64 * MIB
        goal = f"<= {SDK_OVER_GLOO_GOAL[row.world]}" if big and row.world in (2, 4) else ""
        ratios.append(
            Ratio(
                "allreduce",
                label,
                "sdk push",
                "gloo",
                row.ratio(SDK, GLOO),
                meaning="time, <1: ours faster",
                goal=goal,
                met=check(row.ratio(SDK, GLOO), goal),
            )
        )
        goal = f"<= {SDK_OVER_RING_GOAL}" if big else ""
        ratios.append(
            Ratio(
                "allreduce",
                label,
                "sdk push",
                "bare ring",
                row.ratio(SDK, RING),
                meaning="time, <1: the SDK faster",
                goal=goal,
                met=check(row.ratio(SDK, RING), goal),
            )
        )
    return Table(
        name="allreduce",
        title="float32 all-reduce: gloo vs our bare Flight ring vs the SDK's push (lr 0)",
        columns=["config", "gloo ms", "ring ms", "sdk ms", "sdk/gloo time", "sdk/ring time"],
        rows=table_rows,
        notes=[
            f"median of {iters} interleaved iterations after 1 warm-up, slowest rank's time, "
            "each rank a worker under psctl local --mode allreduce."
        ],
        ratios=ratios,
        plot=None,
        raw={"rows": [r.to_json() for r in rows]},
        elapsed_s=time.perf_counter() - t0,
    )


if __name__ == "__main__":
    sys.exit(main())
