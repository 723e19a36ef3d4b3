"""Issue 16's spike: push_pull on Arrow Flight against ours today, the torch RPC PS, raw gRPC
and raw TCP; a Flight ring against gloo; a Flight shard's peak memory. Same run, interleaved.

``python -m bench.flight`` (or ``python -m bench --only flight``). Every system of a group runs
one step in turn, round by round, so load from elsewhere on the machine hits them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import psworker
from bench import flight_proto, flight_ring, flight_service, memory, peers, torchps
from bench.latency import STREAM_ECHO, echo_steps
from bench.report import Ratio, Table, check, median, print_table
from bench.steps import MID, SMALL
from bench.throughput import FULL_SHAPES, RAW_GRPC, RAW_TCP, nbytes_of, raw_steps
from bench.timing import Step, interleave

OURS = "ours today (push_pull, out=)"
FLIGHT_CALL = "Flight DoExchange, new call per step"
FLIGHT_OPEN = "Flight DoExchange, exchange kept open"
FLIGHT_BUILT = "Flight data port as built (docs/flight.md)"
TORCH_TCP = "torch RPC PS, TCP only"
TORCH_DEFAULT = "torch RPC PS, default transport"
# (label, shapes, shards, rounds, quick rounds, the goals for Flight against the peers)
GROUPS = [
    ("1,000 params, 1 shard", SMALL, 1, 300, 60, {TORCH_DEFAULT: ">= 1.5"}),
    ("1M params, 1 shard", MID, 1, 40, 10, {TORCH_TCP: ">= 0.8"}),
    ("1M params, 2 shards", MID, 2, 40, 10, {TORCH_TCP: ">= 1.0"}),
    ("25M params, 2 shards", FULL_SHAPES, 2, 8, 3, {TORCH_TCP: ">= 1.3"}),
]
RING_MIB = 64


@contextlib.contextmanager
def ours_step(shapes: dict[str, tuple[int, ...]], shards: int, workdir: Path) -> Iterator[Step]:
    """Our client against ``shards`` psserver daemons, async, SGD, ``push_pull(out=model)``."""
    model = torchps.model_arrays(shapes)
    grads = {k: np.full_like(v, 1e-4) for k, v in model.items()}
    with contextlib.ExitStack() as stack:
        addresses, _ = stack.enter_context(peers.shards(peers.SEPARATE, shards, workdir))
        client = stack.enter_context(
            psworker.connect(addresses, worker_id=0, num_workers=1, mode="async")
        )
        client.init(model, psworker.SGD(lr=1e-3))
        nbytes = nbytes_of(shapes)

        def step() -> None:
            got = client.push_pull(grads, out=model)
            if sum(w.nbytes for w in got.values()) != nbytes:
                raise RuntimeError("push_pull returned the wrong number of bytes")

        yield step


def measure_group(
    shapes: dict[str, tuple[int, ...]], shards: int, rounds: int, piece: int
) -> dict[str, list[float]]:
    """One interleaved group: every system doing a push+pull step of ``shapes``."""
    nbytes = nbytes_of(shapes)
    small = nbytes <= 64 * 1024
    with tempfile.TemporaryDirectory(prefix="bench_fl_") as tmp, contextlib.ExitStack() as st:
        steps: dict[str, Step] = {OURS: st.enter_context(ours_step(shapes, shards, Path(tmp)))}
        for name, keep in ((FLIGHT_CALL, False), (FLIGHT_OPEN, True)):
            steps[name] = st.enter_context(flight_proto.flight_step(shapes, shards, keep, piece))
        steps[FLIGHT_BUILT] = st.enter_context(flight_service.service_step(shapes, shards))
        steps[TORCH_TCP] = st.enter_context(torchps.torch_ps(shapes, shards, torchps.TCP))
        steps[TORCH_DEFAULT] = st.enter_context(torchps.torch_ps(shapes, shards, torchps.DEFAULT))
        steps.update(st.enter_context(raw_steps(nbytes, tcp=True)))
        if small:
            steps[STREAM_ECHO] = st.enter_context(echo_steps(nbytes))[1]
        return interleave(steps, rounds, warmup=5 if small else 1)


def flight_memory(quick: bool) -> tuple[dict[str, int], int]:
    """(a Flight shard's VmHWM/VmRSS/idle after init + 3 steps with SGD momentum, the state)."""
    shapes = memory.QUICK_SHAPES if quick else FULL_SHAPES
    model = torchps.model_arrays(shapes)
    grads = {k: np.full_like(v, 1e-4) for k, v in model.items()}
    with flight_proto.flight_shards(shapes, 1, momentum=0.9) as (addresses, probes):
        client = flight_proto.FlightClientPS(addresses, model, grads, open_exchange=True)
        try:
            for _ in range(memory.PUSHES):
                client.step()
            return probes[0](), 2 * nbytes_of(shapes)
        finally:
            client.close()


def measure(quick: bool, piece: int = flight_proto.PIECE_BYTES, ring: bool = True) -> Table:
    """The spike's table: each group's systems, then the ring and memory rows."""
    t0 = time.perf_counter()
    rows: list[list] = []
    ratios: list[Ratio] = []
    raw: dict[str, dict[str, list[float]]] = {}
    groups = GROUPS[:3] if quick else GROUPS
    for label, shapes, shards, rounds, quick_rounds, goals in groups:
        n = quick_rounds if quick else rounds
        print(f"flight: {label}, {n} rounds", flush=True)
        times = measure_group(shapes, shards, n, piece)
        raw[label] = times
        med = {k: median(v) for k, v in times.items()}
        best = min(FLIGHT_CALL, FLIGHT_OPEN, key=med.__getitem__)
        for name, ts in times.items():
            rows.append(
                [
                    label,
                    name,
                    med[name] * 1e3,
                    min(ts) * 1e3,
                    max(ts) * 1e3,
                    med[name] / med[OURS],
                    med[name] / med[best],
                ]
            )
        for ours in (OURS, FLIGHT_CALL, FLIGHT_OPEN, FLIGHT_BUILT):
            for peer in (TORCH_TCP, TORCH_DEFAULT, RAW_GRPC, RAW_TCP):
                r = med[peer] / med[ours]
                goal = goals.get(peer, "") if ours == best else ""
                ratios.append(Ratio("flight", label, ours, peer, r, goal=goal, met=check(r, goal)))
        if "1,000" in label:
            ms = med[best] * 1e3
            ratios.append(
                Ratio("flight", label, best, "0.2 ms", 0.2 / ms, goal=">= 1.0", met=ms <= 0.2)
            )
    if ring:
        worlds = [2] if quick else [2, 4]
        for world in worlds:
            print(f"flight: ring, {world} ranks, {RING_MIB} MiB", flush=True)
            got = flight_ring.run_world(world, [RING_MIB << 20], 3 if quick else 7)[RING_MIB << 20]
            label = f"ring all-reduce {RING_MIB} MiB x {world}"
            raw[label] = got
            med = {k: median(v) for k, v in got.items()}
            for name, ts in got.items():
                rows.append(
                    [label, name, med[name] * 1e3, min(ts) * 1e3, max(ts) * 1e3, None, None]
                )
            goal = {2: "<= 1.2", 4: "<= 1.3"}[world]
            for ours in (flight_ring.OURS, flight_ring.FLIGHT):
                r = med[ours] / med[flight_ring.GLOO]
                g = goal if ours == flight_ring.FLIGHT else ""
                ratios.append(
                    Ratio("flight", label, ours, "gloo", r, "time, <1: ours faster", g, check(r, g))
                )
    print("flight: memory", flush=True)
    shard, state = flight_memory(quick)
    ours_shard, ours_idle, _ = memory._shard_peak(
        memory.QUICK_SHAPES if quick else FULL_SHAPES, "async", 1
    )
    for name, hwm in (("Flight shard", shard["VmHWM"]), ("ours today", ours_shard["VmHWM"])):
        label = f"shard peak RSS, MiB (state {state >> 20} MiB)"
        rows.append([label, name, hwm / (1 << 20), None, None, hwm / state, None])
    for name, idle in (("Flight shard", shard["idle"]), ("ours today", ours_idle)):
        rows.append(["shard idle RSS before init, MiB", name, idle / (1 << 20)] + [None] * 4)
        g = "<= 1.5" if name == "Flight shard" else ""
        ratios.append(
            Ratio(
                "flight",
                "shard peak RSS / state",
                name,
                "-",
                hwm / state,
                "lower is better",
                g,
                check(hwm / state, g),
            )
        )
    return Table(
        name="flight",
        title="issue 16 spike: push_pull over Arrow Flight vs ours today and the peers",
        columns=["group", "system", "median ms", "min ms", "max ms", "x ours", "x Flight best"],
        rows=rows,
        notes=[
            "push_pull: 1 worker, async, SGD lr 1e-3, each system's shards in their own processes; "
            "'x ours'/'x Flight best': this system's median time over theirs (>1: slower).",
            "ours: psworker.connect + push_pull(grads, out=model) against `python -m psserver`. "
            "Flight: bench/flight_proto.py, a record batch per piece of <= "
            f"{piece >> 20} MiB, zero-copy both ways, replies copied into the model's arrays. "
            "As built: psserver/flight_service.py + psworker/flight_link.py (exchange kept "
            "open, whole step received, then one Shard.push_pull, reply from a snapshot copy).",
            "torch RPC PS as bench/throughput.py; raw peers: 1 server process moving the same "
            "bytes (gRPC: 4 MiB chunks streamed each way; TCP: sendall/recv_into).",
            "ring: median slowest-rank time, the three systems alternating in the same "
            "processes; memory rows: peak MiB, and in 'x ours' peak / (variables + momentum), "
            "SGD momentum 0.9, "
            "1 shard, init + 3 steps (ours: `python -m psserver`, bench/memory.py's worker).",
        ],
        ratios=ratios,
        raw={"times_s": raw, "flight_shard": shard, "ours_shard": ours_shard},
        elapsed_s=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flight", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1,000 and 1M params, 2 ranks")
    parser.add_argument("--piece-mib", type=int, default=flight_proto.PIECE_BYTES >> 20)
    parser.add_argument("--no-ring", action="store_true", help="skip the ring rows")
    args = parser.parse_args(argv)
    table = measure(args.quick, args.piece_mib << 20, not args.no_ring)
    print_table(table)
    from bench.report import SUMMARY_COLUMNS, render, summary_rows

    print(render(SUMMARY_COLUMNS, summary_rows([table])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
