"""What a table step's bytes cost on each transport: the step, and a dense step moving the same
bytes through our grpcio path, the Arrow Flight prototype and data port, and a raw gRPC echo.

``python -m bench.sparse_transport``: 4,096 rows of 64 float32 each way (1 MiB), 1 shard, all
interleaved round by round. Our table step minus our dense step at the same bytes is the row
work (ids, gather, scatter, checks); our dense step minus Flight's is what moving the data
plane to Flight would save the table step, as its rows would travel there too.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench import sparse
from bench.report import Table, median, print_table
from bench.timing import interleave

DENSE = "ours: dense push_pull, same bytes (grpcio)"
FLIGHT_OPEN = "Flight prototype, exchange kept open, same bytes"
FLIGHT_BUILT = "Flight data port as built, same bytes"
RAW_STREAM = "raw gRPC echo on an open stream, same bytes"
COLUMNS = ["system", "ms", "min ms", "max ms", "vs ours (table step)"]


@contextlib.contextmanager
def timed(make: contextlib.AbstractContextManager[Callable[[], object]], reps: int) -> Iterator:
    """A step that runs ``reps`` calls of ``make``'s callable and returns their mean seconds."""
    with make as call:

        def step() -> float:
            t0 = time.perf_counter()
            for _ in range(reps):
                call()
            return (time.perf_counter() - t0) / reps

        yield step


def measure(quick: bool = False, rounds: int = 9) -> Table:
    """The group above; needs pyarrow (the Flight systems) and torch (the peer)."""
    from bench import flight, flight_proto, flight_service
    from bench.latency import echo_steps

    t0 = time.perf_counter()
    cfg = sparse.Config(1_000_000, 64, 4096, rounds=3 if quick else rounds, reps=20)
    shapes: dict[str, tuple[int, ...]] = {"emb": (cfg.batch, cfg.dim)}
    nbytes = 4 * cfg.batch * cfg.dim
    phases = {key: sparse.Phases() for key in ((sparse.OURS_FUSED, 1), (sparse.PEER, 1))}
    with tempfile.TemporaryDirectory(prefix="bench_st_") as tmp, contextlib.ExitStack() as st:
        work = Path(tmp)
        steps = {
            f"{s} x1": sparse.start(s, cfg, 1, work, phases[(s, 1)], st)
            for s in (sparse.OURS_FUSED, sparse.PEER)
        }
        steps[DENSE] = st.enter_context(timed(flight.ours_step(shapes, 1, work), cfg.reps))
        piece = flight_proto.PIECE_BYTES
        proto = flight_proto.flight_step(shapes, 1, True, piece)
        steps[FLIGHT_OPEN] = st.enter_context(timed(proto, cfg.reps))
        built = flight_service.service_step(shapes, 1)
        steps[FLIGHT_BUILT] = st.enter_context(timed(built, cfg.reps))
        _, stream = st.enter_context(echo_steps(nbytes))
        steps[RAW_STREAM] = st.enter_context(timed(contextlib.nullcontext(stream), cfg.reps))
        print(f"sparse_transport: {cfg.rounds} rounds", flush=True)
        times = interleave(steps, cfg.rounds, warmup=sparse.WARMUP)  # type: ignore[arg-type]
    ours = median(times[f"{sparse.OURS_FUSED} x1"])
    rows = [
        [name, median(ts) * 1e3, min(ts) * 1e3, max(ts) * 1e3, median(ts) / ours]
        for name, ts in times.items()
    ]
    return Table(
        name="sparse_transport",
        title=f"{cfg.batch} rows x {cfg.dim} float32 each way (1 MiB), 1 shard",
        columns=COLUMNS,
        rows=rows,
        notes=[
            "ms: median over rounds of the mean of 20 steps; vs ours: time over our table "
            "step's (<1: faster). The dense systems push and pull one (4096, 64) variable, "
            "SGD; the Flight systems are bench/flight_proto.py and psserver/flight_service.py "
            f"(bench/NOTES.md 18). Load average at the end: {sparse._load():.1f}.",
        ],
        raw={"times_s": times},
        elapsed_s=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sparse_transport", description=__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    print_table(measure(rounds=args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
