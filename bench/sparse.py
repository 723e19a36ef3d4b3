"""Embedding tables: our sparse step against a torch RPC embedding server and a dense step.

One async worker trains a ``Table(1_000_000, 64)`` (float32, 256 MB) with SGD; a step pushes
one batch's gradient rows and reads a batch's rows. Peers in the same run, interleaved round
by round: a torch.distributed.rpc server holding the same table (``index_select`` for a pull,
``index_add_`` for an SGD push; bench/torchemb.py) over TCP and over TensorPipe's default
transport, and the table as one dense variable (whole-table push + pull per step). Then a sweep
over step sizes (256, 4,096, 65,536 ids) and dims (16, 64, 256).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

import psworker
from bench import peers, torchemb, torchps
from bench.report import Ratio, Table, check, median, print_table
from bench.timing import interleave
from pscore.optim import SGD
from pscore.rowstore import RowStore
from pscore.tables import TableSlice
from psworker import RowSparse
from psworker import Table as EmbeddingTable

NAME = "emb"
LR = 0.1
GRAD = 1e-4
WARMUP = 1
BATCHES = 8  # distinct batches of ids, drawn before any timing, used in turn

OURS_FUSED = "ours: push_pull (push + next rows)"
OURS_SEPARATE = "ours: pull_rows + push"
TORCH_TCP = "torch RPC TCP: pull + push"
TORCH_TCP_FUSED = "torch RPC TCP: fused"
TORCH_DEFAULT = "torch RPC default: pull + push"
DENSE = "dense: whole-table pull + push"
SYSTEMS = (OURS_FUSED, OURS_SEPARATE, TORCH_TCP, TORCH_TCP_FUSED, TORCH_DEFAULT, DENSE)
SWEEP_SYSTEMS = (OURS_FUSED, OURS_SEPARATE, TORCH_TCP, TORCH_TCP_FUSED)
PEER = TORCH_TCP  # the peer: the ratios are against it
OURS = (OURS_FUSED, OURS_SEPARATE)
COLUMNS = ["system", "ids", "dim", "shards", "ms", "min ms", "max ms", "pull ms", "push ms"]
COLUMNS += ["useful rows/s", "peer/ours"]


@dataclass(frozen=True)
class Config:
    """A ``num_rows`` x ``dim`` float32 table, ``batch`` distinct ids per step; ``rounds``
    interleaved rounds of ``reps`` steps each (the dense step: one per round)."""

    num_rows: int
    dim: int
    batch: int
    rounds: int
    reps: int

    @property
    def table_bytes(self) -> int:
        return 4 * self.num_rows * self.dim


MAIN = Config(num_rows=1_000_000, dim=64, batch=4096, rounds=9, reps=20)  # 256 MB table
SWEEP = (
    Config(1_000_000, 64, 256, rounds=7, reps=100),
    Config(1_000_000, 64, 65_536, rounds=5, reps=3),
    Config(1_000_000, 16, 4096, rounds=7, reps=20),
    Config(1_000_000, 256, 4096, rounds=5, reps=10),
)
QUICK = Config(num_rows=100_000, dim=64, batch=1024, rounds=5, reps=10)  # 25.6 MB table


@dataclass
class Phases:
    """Per-round mean seconds of a step and, for systems that pull then push, of each half."""

    step: list[float] = field(default_factory=list)
    pull: list[float] = field(default_factory=list)
    push: list[float] = field(default_factory=list)

    def record(self, steps: list[tuple[float, float]]) -> float:
        """Records one round's (pull s, push s) per step; returns the mean step."""
        mean = sum(a + b for a, b in steps) / len(steps)
        self.step.append(mean)
        self.pull.append(sum(a for a, _ in steps) / len(steps))
        self.push.append(sum(b for _, b in steps) / len(steps))
        return mean

    def timed(self) -> Phases:
        """Without the warm-up rounds that ``interleave`` does not time."""
        return Phases(self.step[WARMUP:], self.pull[WARMUP:], self.push[WARMUP:])


def batches(cfg: Config, count: int = BATCHES) -> list[np.ndarray]:
    """``count`` batches of ``cfg.batch`` distinct random ids, drawn before any timing, sorted
    as ``Embedding`` sends them (its forward asks for ``np.unique`` of the batch)."""
    rng = np.random.default_rng(0)
    return [np.sort(rng.choice(cfg.num_rows, cfg.batch, replace=False)) for _ in range(count)]


def connect(addresses: list[str], stack: contextlib.ExitStack) -> psworker.PSClient:
    """One async worker of a one-worker job, closed with ``stack``."""
    client = psworker.connect(addresses, worker_id=0, num_workers=1, mode="async")
    assert isinstance(client, psworker.PSClient)
    return stack.enter_context(client)


Round = Callable[[], float]


@contextlib.contextmanager
def ours(cfg: Config, n: int, fused: bool, workdir: Path, ph: Phases) -> Iterator[Round]:
    """``n`` shard daemons holding the table; a round is ``cfg.reps`` steps.

    Fused: each step is one ``push_pull`` per shard carrying this batch's gradient and asking
    for the next batch's rows. Otherwise ``pull_rows`` of the batch, then ``push``.
    """
    ids = batches(cfg)
    grad = np.full((cfg.batch, cfg.dim), GRAD, dtype=np.float32)
    table = EmbeddingTable(cfg.num_rows, cfg.dim, init="uniform", init_scale=0.01)
    with contextlib.ExitStack() as stack:
        addresses, _ = stack.enter_context(peers.shards(peers.SEPARATE, n, workdir))
        client = connect(addresses, stack)
        client.init({}, psworker.SGD(lr=LR), tables={NAME: table})
        turn = iter(range(1 << 40))
        rows = client.pull_rows(NAME, ids[0])

        def fused_round() -> float:
            nonlocal rows
            steps = []
            for _ in range(cfg.reps):
                t = next(turn)
                batch, after = ids[t % len(ids)], ids[(t + 1) % len(ids)]
                t0 = time.perf_counter()
                got = client.push_pull(  # type: ignore[call-arg]
                    {NAME: RowSparse(batch, grad)}, rows={NAME: after}
                )
                steps.append((0.0, time.perf_counter() - t0))
                rows = got[NAME]
                if rows.shape != (cfg.batch, cfg.dim):
                    raise RuntimeError(f"push_pull returned rows of shape {rows.shape}")
            return ph.record(steps)

        def separate_round() -> float:
            steps = []
            for _ in range(cfg.reps):
                batch = ids[next(turn) % len(ids)]
                t0 = time.perf_counter()
                got = client.pull_rows(NAME, batch)
                t1 = time.perf_counter()
                client.push({NAME: RowSparse(batch, grad)})
                steps.append((t1 - t0, time.perf_counter() - t1))
                if got.shape != (cfg.batch, cfg.dim):
                    raise RuntimeError(f"pull_rows returned {got.shape}")
            return ph.record(steps)

        yield fused_round if fused else separate_round


@contextlib.contextmanager
def torch_peer(cfg: Config, n: int, transport: str, calls: str, ph: Phases) -> Iterator[Round]:
    """The torch RPC embedding server with ``n`` table processes; a round is ``cfg.reps``
    steps timed in its trainer."""
    spec = torchemb.Spec(cfg.num_rows, cfg.dim, LR, GRAD, cfg.reps, n, transport, calls)
    with torchemb.embedding_server(spec, batches(cfg)) as step:
        yield lambda: ph.record(step())


@contextlib.contextmanager
def dense(cfg: Config, n: int, workdir: Path, ph: Phases) -> Iterator[Round]:
    """``n`` shard daemons holding the table as one dense variable (split by rows); a step
    pushes the whole table's gradient and pulls the whole table."""
    shape = (cfg.num_rows, cfg.dim)
    grad = np.full(shape, GRAD, dtype=np.float32)
    with contextlib.ExitStack() as stack:
        addresses, _ = stack.enter_context(peers.shards(peers.SEPARATE, n, workdir))
        client = connect(addresses, stack)
        client.init({NAME: np.zeros(shape, dtype=np.float32)}, psworker.SGD(lr=LR))

        def one() -> float:
            t0 = time.perf_counter()
            client.push({NAME: grad})
            t1 = time.perf_counter()
            rows = client.pull([NAME])[NAME]
            if rows.shape != shape:
                raise RuntimeError(f"pull returned {rows.shape}")
            return ph.record([(time.perf_counter() - t1, t1 - t0)])

        yield one


def start(
    system: str, cfg: Config, n: int, workdir: Path, ph: Phases, stack: contextlib.ExitStack
) -> Round:
    """Starts ``system`` on ``n`` shards; stopped with ``stack``."""
    if system in OURS:
        return stack.enter_context(ours(cfg, n, system == OURS_FUSED, workdir, ph))
    if system == DENSE:
        return stack.enter_context(dense(cfg, n, workdir, ph))
    transport = torchps.TCP if system in (TORCH_TCP, TORCH_TCP_FUSED) else torchps.DEFAULT
    calls = torchemb.FUSED if system == TORCH_TCP_FUSED else torchemb.SEPARATE
    return stack.enter_context(torch_peer(cfg, n, transport, calls, ph))


def run_group(
    cfg: Config, systems: list[tuple[str, int]]
) -> tuple[dict[tuple[str, int], Phases], float]:
    """Every (system, shards) of ``systems`` started, then timed interleaved round by round;
    (their phases, the 1-minute load average at the end)."""
    found: dict[tuple[str, int], Phases] = {key: Phases() for key in systems}
    with tempfile.TemporaryDirectory(prefix="bench_sparse_") as tmp, contextlib.ExitStack() as st:
        rounds = {f"{s} x{n}": start(s, cfg, n, Path(tmp), found[(s, n)], st) for s, n in systems}
        print(f"sparse: {cfg.batch} ids x {cfg.dim}, {cfg.rounds} rounds", flush=True)
        interleave(rounds, cfg.rounds, warmup=WARMUP)  # type: ignore[arg-type]
        load = _load()
    return {k: v.timed() for k, v in found.items()}, load


def _load() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


CREATE_ROUNDS = 9


def row_create_us(cfg: Config, rounds: int) -> tuple[float, list[float]]:
    """Microseconds per row that creating rows on first touch adds to a shard: its row
    store, in process, gathers ``cfg.batch`` ids never touched before, then the same ids
    again; the difference per row. (median, each round's)."""
    spec = TableSlice(NAME, cfg.dim, num_rows=cfg.num_rows, row_end=cfg.num_rows, seed=0)
    store = RowStore(spec, SGD(lr=LR))
    fresh = np.random.default_rng(1).permutation(cfg.num_rows)[: rounds * cfg.batch]
    per_round = []
    for r in range(rounds):
        ids = np.sort(fresh[r * cfg.batch : (r + 1) * cfg.batch])
        t0 = time.perf_counter()
        store.gather(ids)
        t1 = time.perf_counter()
        store.gather(ids)
        t2 = time.perf_counter()
        per_round.append(((t1 - t0) - (t2 - t1)) / cfg.batch * 1e6)
    return median(per_round), per_round


def table_rows(cfg: Config, found: dict[tuple[str, int], Phases]) -> list[list[object]]:
    """One row per (system, shards): median step, range, halves, useful rows/s, peer/ours."""
    out: list[list[object]] = []
    for (system, n), ph in found.items():
        med = median(ph.step)
        peer = found.get((PEER, n))
        ratio = median(peer.step) / med if peer is not None and system.startswith("ours") else None
        halves = system not in (OURS_FUSED, TORCH_TCP_FUSED)
        out.append(
            [
                system,
                cfg.batch,
                cfg.dim,
                n,
                med * 1e3,
                min(ph.step) * 1e3,
                max(ph.step) * 1e3,
                median(ph.pull) * 1e3 if halves else None,
                median(ph.push) * 1e3 if halves else None,
                cfg.batch / med,
                ratio,
            ]
        )
    return out


def ratio_of(
    found: dict[tuple[str, int], Phases], ours_key: tuple[str, int], peer_key: tuple[str, int]
) -> float | None:
    if ours_key not in found or peer_key not in found:
        return None
    return median(found[peer_key].step) / median(found[ours_key].step)


def measure(
    quick: bool,
    shard_counts: list[int] | None = None,
    systems: list[str] | None = None,
    sweep: bool | None = None,
) -> Table:
    """The main configuration (every system, 1 and 2 shards, one interleaved group), then
    the sweep (1 shard, and ours fused on 2) unless ``quick``."""
    t0 = time.perf_counter()
    cfg = QUICK if quick else MAIN
    chosen = [s for s in SYSTEMS if (systems is None or s in systems) and s != DENSE]
    counts = shard_counts or [1, 2]
    # The torch peers with 2 table processes only where they are the comparison's peer: each
    # group's processes share 2 cores.
    group = [(s, n) for s in chosen for n in counts if n == 1 or s in (*OURS, PEER)]
    found, load = run_group(cfg, group)
    loads = [load]
    best = OURS_FUSED if (OURS_FUSED, 1) in found else OURS_SEPARATE
    ratios = [
        Ratio(
            "sparse",
            f"{cfg.batch} ids of {cfg.num_rows} x {cfg.dim}, {n} shard(s), vs torch RPC TCP",
            best,
            PEER,
            ratio_of(found, (best, n), (PEER, n)),
            goal=">= 1.5" if n == 1 and not quick else "",
            met=None if quick or n != 1 else check(ratio_of(found, (best, n), (PEER, n)), ">= 1.5"),
            target="sparse vs torch embedding server" if n == 1 and not quick else "",
        )
        for n in counts
    ]
    ratios.append(
        Ratio(
            "sparse",
            f"{cfg.batch} ids: 2 shards vs 1 shard (ours)",
            f"{best} x2",
            f"{best} x1",
            ratio_of(found, (best, 2), (best, 1)),
            goal=">= 1.0" if not quick else "",
            met=None if quick else check(ratio_of(found, (best, 2), (best, 1)), ">= 1.0"),
        )
    )
    if systems is None or DENSE in systems:
        # Its own group: a dense step moves the whole table (seconds), few rounds.
        dense_cfg = Config(cfg.num_rows, cfg.dim, cfg.batch, rounds=3, reps=cfg.reps)
        more, load = run_group(dense_cfg, [(s, n) for s in (best, DENSE) for n in counts])
        loads.append(load)
        ratios += [
            Ratio(
                "sparse",
                f"{cfg.batch} ids, {n} shard(s), vs dense whole-table step",
                best,
                DENSE,
                ratio_of(more, (best, n), (DENSE, n)),
                meaning="useful rows/s, >1: sparse",
            )
            for n in counts
        ]
        found.update({k: v for k, v in more.items() if k[0] == DENSE})
    create, per_round = row_create_us(cfg, CREATE_ROUNDS)
    ratios.append(
        Ratio(
            "sparse",
            f"row created on first touch ({cfg.dim} floats, {cfg.batch} per call)",
            "RowStore.gather, first touch minus second",
            "-",
            create,
            meaning="us per row, lower is better",
            goal="" if quick else "<= 0.5",
            met=None if quick else check(create, "<= 0.5"),
            target="" if quick else "row create us/row",
        )
    )
    rows = table_rows(cfg, found)
    raw = {f"{cfg.batch}x{cfg.dim}/{s} x{n}": asdict(p) for (s, n), p in found.items()}
    if sweep if sweep is not None else not quick:
        for c in SWEEP:
            chosen = [s for s in SWEEP_SYSTEMS if systems is None or s in systems]
            group = [(s, 1) for s in chosen] + [(s, 2) for s in chosen if s == OURS_FUSED]
            got, load = run_group(c, group)
            loads.append(load)
            rows.extend(table_rows(c, got))
            raw.update({f"{c.batch}x{c.dim}/{s} x{n}": asdict(p) for (s, n), p in got.items()})
    return Table(
        name="sparse",
        title=f"{cfg.batch} of {cfg.num_rows} rows x {cfg.dim} float32 "
        f"({cfg.table_bytes / 1e6:.0f} MB), 1 worker, async SGD",
        columns=COLUMNS,
        rows=rows,
        notes=[
            "ours: Table(num_rows, dim) on `python -m psserver` daemons. push_pull: one "
            "message each way per shard on the open step stream, carrying this batch's "
            "RowSparse gradient and asking for the next batch's rows; pull_rows + push: a "
            "pull of the batch's rows, then a push of their gradient.",
            "torch RPC: bench/torchemb.py, a trainer and one process per table shard "
            "(contiguous row ranges), index_select for a pull and index_add_(alpha=-lr) "
            "for a push, rpc_async to every shard at once; TCP: TensorPipe uv + basic "
            "channel only; fused: one RPC per shard pushing this batch and returning the "
            "next batch's rows.",
            "dense: the table as one dense variable; a step pushes the whole gradient and "
            "pulls the whole table (what a worker without sparse support must do).",
            f"ms: median over rounds of the mean step in a round ({WARMUP} warm-up round "
            f"untimed); peer/ours: {PEER}'s median over ours, same group and shard count "
            "(>1: ours faster). Batches of distinct random ids, sorted as Embedding sends "
            "them, the same for every system. "
            f"1-minute load average after each group: {', '.join(f'{x:.1f}' for x in loads)}.",
            f"row created on first touch: {create:.2f} us per row (a shard's RowStore, in "
            f"process: gathering {cfg.batch} ids never touched before, minus gathering them "
            f"again; median of {CREATE_ROUNDS} fresh batches).",
        ],
        ratios=ratios,
        raw={
            "config": asdict(cfg),
            "row_create_us": per_round,
            "sweep": [asdict(c) for c in SWEEP],
            "times_s": raw,
        },
        elapsed_s=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sparse", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="100k rows, batch 1024, no sweep")
    parser.add_argument("--shards", type=int, nargs="+", default=None)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=None)
    parser.add_argument("--no-sweep", action="store_true", help="only the main configuration")
    args = parser.parse_args(argv)
    sweep = False if args.no_sweep else None
    print_table(measure(args.quick, args.shards, args.systems, sweep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
