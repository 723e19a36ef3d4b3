"""Embedding rows per second: pull_rows + push(RowSparse) of a batch vs a dense whole-table step."""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

import psworker
from bench import peers
from bench.report import Ratio, Table, median, print_table
from bench.timing import Step, interleave
from psworker import RowSparse
from psworker import Table as EmbeddingTable

NAME = "emb"
LR = 0.1
GRAD = 1e-4
SPARSE = "sparse: pull_rows + push(RowSparse)"
DENSE = "dense: pull + push of the whole table"
WARMUP = 1
COLUMNS = ["system", "op", "shards", "rows moved", "ms", "min ms", "max ms"]
COLUMNS += ["rows/s", "useful rows/s", "sparse/dense"]


@dataclass(frozen=True)
class Config:
    """A table of ``num_rows`` x ``dim`` float32 rows, ``batch`` distinct ids per step."""

    num_rows: int
    dim: int
    batch: int
    rounds: int  # interleaved rounds, each one dense step and ``reps`` sparse steps
    reps: int

    @property
    def table_bytes(self) -> int:
        return 4 * self.num_rows * self.dim


FULL = Config(num_rows=1_000_000, dim=64, batch=4096, rounds=5, reps=20)  # 256 MB table
QUICK = Config(num_rows=100_000, dim=64, batch=1024, rounds=5, reps=10)  # 25.6 MB table


@dataclass
class Phases:
    """Per-call seconds of each half of a step, recorded by the step itself."""

    pull: list[float] = field(default_factory=list)
    push: list[float] = field(default_factory=list)

    def timed(self) -> Phases:
        """The phases without the warm-up calls that ``interleave`` does not time."""
        return Phases(self.pull[WARMUP:], self.push[WARMUP:])


def batches(cfg: Config, count: int = 8) -> list[np.ndarray]:
    """``count`` batches of ``cfg.batch`` distinct random ids, drawn before any timing."""
    rng = np.random.default_rng(0)
    return [rng.choice(cfg.num_rows, cfg.batch, replace=False) for _ in range(count)]


def connect(addresses: list[str], stack: contextlib.ExitStack) -> psworker.PSClient:
    """One async worker of a one-worker job, closed with ``stack``."""
    client = psworker.connect(addresses, worker_id=0, num_workers=1, mode="async")
    assert isinstance(client, psworker.PSClient)
    return stack.enter_context(client)


@contextlib.contextmanager
def sparse_step(cfg: Config, n: int, workdir: Path, phases: Phases) -> Iterator[Step]:
    """``n`` shard daemons holding the table; a step is ``cfg.reps`` pulls and pushes of a batch
    of rows, and returns the mean seconds of one pull + push."""
    ids = batches(cfg)
    grad = np.full((cfg.batch, cfg.dim), GRAD, dtype=np.float32)
    table = EmbeddingTable(cfg.num_rows, cfg.dim, init="uniform", init_scale=0.01)
    with contextlib.ExitStack() as stack:
        addresses, _ = stack.enter_context(peers.shards(peers.SEPARATE, n, workdir))
        client = connect(addresses, stack)
        client.init({}, psworker.SGD(lr=LR), tables={NAME: table})
        turn = iter(range(1 << 40))

        def step() -> float:
            pull_s = push_s = 0.0
            for _ in range(cfg.reps):
                batch = ids[next(turn) % len(ids)]
                t0 = time.perf_counter()
                rows = client.pull_rows(NAME, batch)
                t1 = time.perf_counter()
                client.push({NAME: RowSparse(batch, grad)})
                push_s += time.perf_counter() - t1
                pull_s += t1 - t0
                if rows.shape != (cfg.batch, cfg.dim):
                    raise RuntimeError(f"pull_rows returned {rows.shape}")
            phases.pull.append(pull_s / cfg.reps)
            phases.push.append(push_s / cfg.reps)
            return (pull_s + push_s) / cfg.reps

        yield step


@contextlib.contextmanager
def dense_step(cfg: Config, n: int, workdir: Path, phases: Phases) -> Iterator[Step]:
    """``n`` shard daemons holding the table as one dense variable (split by rows); a step is
    a push of the whole table's gradient and a pull of the whole table."""
    shape = (cfg.num_rows, cfg.dim)
    grad = np.full(shape, GRAD, dtype=np.float32)
    with contextlib.ExitStack() as stack:
        addresses, _ = stack.enter_context(peers.shards(peers.SEPARATE, n, workdir))
        client = connect(addresses, stack)
        client.init({NAME: np.zeros(shape, dtype=np.float32)}, psworker.SGD(lr=LR))

        def step() -> float:
            t0 = time.perf_counter()
            client.push({NAME: grad})
            t1 = time.perf_counter()
            rows = client.pull([NAME])[NAME]
            t2 = time.perf_counter()
            if rows.shape != shape:
                raise RuntimeError(f"pull returned {rows.shape}")
            phases.push.append(t1 - t0)
            phases.pull.append(t2 - t1)
            return t2 - t0

        yield step


def ops(ph: Phases) -> dict[str, list[float]]:
    """Per-round seconds of each operation: pull, push, and the two together."""
    return {
        "pull": ph.pull,
        "push": ph.push,
        "pull+push": [a + b for a, b in zip(ph.pull, ph.push, strict=True)],
    }


def table_rows(cfg: Config, n: int, sparse: Phases, dense: Phases) -> list[list[object]]:
    """One row per operation; 'useful' rows are the batch's, whatever the step moves."""
    peer = {op: median(ts) for op, ts in ops(dense).items()}
    out: list[list[object]] = []
    for label, moved, ph in ((SPARSE, cfg.batch, sparse), (DENSE, cfg.num_rows, dense)):
        for op, ts in ops(ph).items():
            med = median(ts)
            ratio = peer[op] / med if ph is sparse else None
            out.append(
                [
                    label.split(":")[0],
                    op,
                    n,
                    moved,
                    med * 1e3,
                    min(ts) * 1e3,
                    max(ts) * 1e3,
                    moved / med,
                    cfg.batch / med,
                    ratio,
                ]
            )
    return out


def measure(quick: bool, shard_counts: list[int] | None = None) -> Table:
    """Both jobs for each shard count (default 1 and 2), interleaved; one table, one ratio each."""
    t0 = time.perf_counter()
    cfg = QUICK if quick else FULL
    rows: list[list[object]] = []
    ratios: list[Ratio] = []
    raw: dict[str, list[float]] = {}
    for n in shard_counts or [1, 2]:
        sparse, dense = Phases(), Phases()
        with (
            tempfile.TemporaryDirectory(prefix="bench_sparse_") as tmp,
            contextlib.ExitStack() as st,
        ):
            steps: dict[str, Step] = {
                SPARSE: st.enter_context(sparse_step(cfg, n, Path(tmp), sparse)),
                DENSE: st.enter_context(dense_step(cfg, n, Path(tmp), dense)),
            }
            print(f"sparse: {n} shard(s), {cfg.rounds} rounds", flush=True)
            times = interleave(steps, cfg.rounds, warmup=WARMUP)
        sparse, dense = sparse.timed(), dense.timed()
        rows.extend(table_rows(cfg, n, sparse, dense))
        ratio = median(times[DENSE]) / median(times[SPARSE])
        ratios.append(
            Ratio(
                "sparse",
                f"sparse step vs dense whole-table step, {n} shard(s)",
                SPARSE,
                DENSE,
                ratio,
                meaning="useful rows/s, >1: sparse",
            )
        )
        raw.update({f"{n} shards/{k}": v for k, v in times.items()})
    mb = cfg.table_bytes / 1e6
    return Table(
        name="sparse",
        title=f"{cfg.batch} of {cfg.num_rows} rows x {cfg.dim} float32 ({mb:.0f} MB), 1 worker",
        columns=COLUMNS,
        rows=rows,
        notes=[
            f"sparse: Table({cfg.num_rows}, {cfg.dim}) on the shards; a step pulls the rows of "
            f"{cfg.batch} distinct random ids (pull_rows) and pushes their gradient "
            f"(RowSparse). Each timed round runs {cfg.reps} steps; ms = their mean.",
            "dense: the same table as one dense variable (split by rows across the shards); a "
            "step pushes the whole gradient and pulls the whole table, which is what a worker "
            "without sparse support must do to read and train any batch.",
            "rows/s = rows moved (each way) / median time; useful rows/s = the batch's rows / "
            "median time; sparse/dense = dense median time / sparse median time for the same "
            f"op = useful rows/s ratio. Median of {cfg.rounds} interleaved rounds after "
            f"{WARMUP} warm-up; shards: `python -m psserver` daemons; async, SGD.",
        ],
        ratios=ratios,
        raw={"config": asdict(cfg), "times_s": raw},
        elapsed_s=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sparse", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="100k rows, batch 1024")
    parser.add_argument("--shards", type=int, nargs="+", default=None)
    args = parser.parse_args(argv)
    print_table(measure(args.quick, args.shards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
