"""Push+pull of a 25M-parameter model: ours vs a torch.distributed.rpc PS, raw gRPC, raw TCP."""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

import psworker
from bench import peers, pushpull, torchps
from bench.report import MB, Ratio, Table, check, median, print_table
from bench.timing import Step, interleave
from pswire.codec import DEFAULT_CHUNK_BYTES

# 25,007,404 float32 parameters, 64% of them in one embedding-like matrix.
FULL_SHAPES: dict[str, tuple[int, ...]] = {
    "embedding": (62_500, 256),
    "fc1.weight": (2048, 2048),
    "fc1.bias": (2048,),
    "fc2.weight": (2048, 2048),
    "fc2.bias": (2048,),
    "fc3.weight": (300, 2048),
    "fc3.bias": (300,),
}
# About a quarter of it for --quick: the same layout, 6.4M parameters.
QUICK_SHAPES: dict[str, tuple[int, ...]] = {
    "embedding": (15_625, 256),
    "fc1.weight": (1024, 1024),
    "fc1.bias": (1024,),
    "fc2.weight": (1024, 1024),
    "fc2.bias": (1024,),
    "fc3.weight": (300, 1024),
    "fc3.bias": (300,),
}
OURS = "ours"
TORCH_DEFAULT = "torch RPC PS, default transport"
TORCH_TCP = "torch RPC PS, TCP only"
RAW_GRPC = f"raw gRPC stream, {DEFAULT_CHUNK_BYTES >> 20} MiB chunks"
RAW_TCP = "raw TCP (ceiling)"


def nbytes_of(shapes: dict[str, tuple[int, ...]]) -> int:
    return 4 * sum(int(np.prod(s)) for s in shapes.values())


@contextlib.contextmanager
def ours_step(
    shapes: dict[str, tuple[int, ...]], shards: int, workdir: Path, into_model: bool = False
) -> Iterator[Step]:
    """Our client against ``shards`` daemons (``python -m psserver``), async, SGD: one
    ``push_pull`` per step (push every gradient, pull every weight, one round trip per shard),
    as ``DistributedOptimizer.step`` does; ``into_model``: the weights decoded into the
    model's arrays (``out=``), as ``DistributedOptimizer`` asks."""
    model = torchps.model_arrays(shapes)
    grads = {k: np.full_like(v, 1e-4) for k, v in model.items()}
    nbytes = nbytes_of(shapes)
    with contextlib.ExitStack() as stack:
        addresses, _ = stack.enter_context(peers.shards(peers.SEPARATE, shards, workdir))
        client = stack.enter_context(
            psworker.connect(addresses, worker_id=0, num_workers=1, mode="async")
        )
        client.init(model, psworker.SGD(lr=1e-3))

        def step() -> None:
            out = model if into_model else None
            got = sum(w.nbytes for w in client.push_pull(grads, out=out).values())
            if got != nbytes:
                raise RuntimeError(f"push_pull returned {got} bytes, expected {nbytes}")

        yield step


def both(push: Callable[[], None], pull: Callable[[], None]) -> Step:
    def step() -> None:
        push()
        pull()

    return step


@contextlib.contextmanager
def raw_steps(nbytes: int, tcp: bool) -> Iterator[dict[str, Step]]:
    """The same bytes each way over raw gRPC streaming (and raw TCP), servers in child processes."""
    chunk = DEFAULT_CHUNK_BYTES
    blob = np.random.default_rng(2).bytes(nbytes)
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(peers.raw_grpc_server(peers.SEPARATE, nbytes, chunk))
        m = pushpull.Measurement(RAW_GRPC, "raw-grpc-stream", peers.SEPARATE, 1, chunk, nbytes)
        steps: dict[str, Step] = {}
        push, pull = pushpull.open_raw_grpc(m, address, blob, stack)
        steps[RAW_GRPC] = both(push, pull)
        if tcp:
            address, stop = peers.start_child(peers.serve_tcp)
            stack.callback(stop)
            tm = pushpull.Measurement(RAW_TCP, "raw-tcp", peers.SEPARATE, 1, None, nbytes)
            tpush, tpull = pushpull.open_tcp(tm, address, blob, stack)
            steps[RAW_TCP] = both(tpush, tpull)
        yield steps


def measure(quick: bool, rounds: int | None = None, shard_counts: list[int] | None = None) -> Table:
    t0 = time.perf_counter()
    shapes = QUICK_SHAPES if quick else FULL_SHAPES
    rounds = rounds or (3 if quick else 8)
    shard_counts = shard_counts or ([1, 2] if quick else [1, 2, 4])
    nbytes = nbytes_of(shapes)
    params = nbytes // 4
    rows, ratios, raw = [], [], {}
    for n in shard_counts:
        # Each shard count is its own interleaved group, with its own raw peers, so a burst of
        # load on this noisy machine hits all the systems it compares.
        with tempfile.TemporaryDirectory(prefix="bench_tp_") as tmp, contextlib.ExitStack() as st:
            steps: dict[str, Step] = {OURS: st.enter_context(ours_step(shapes, n, Path(tmp)))}
            steps[TORCH_DEFAULT] = st.enter_context(torchps.torch_ps(shapes, n, torchps.DEFAULT))
            steps[TORCH_TCP] = st.enter_context(torchps.torch_ps(shapes, n, torchps.TCP))
            steps.update(st.enter_context(raw_steps(nbytes, tcp=True)))
            print(f"throughput: {n} shard(s), {len(steps)} systems, {rounds} rounds", flush=True)
            times = interleave(steps, rounds)
        med = {name: median(ts) for name, ts in times.items()}
        for name, ts in times.items():
            peer_shards = n if name in (OURS, TORCH_DEFAULT, TORCH_TCP) else 1
            rows.append(
                [
                    name,
                    peer_shards,
                    2 * nbytes / med[name] / MB,
                    med[name] * 1e3,
                    min(ts) * 1e3,
                    max(ts) * 1e3,
                    med[name] / med[OURS] if name != OURS else None,
                ]
            )
            raw[f"{n} shards/{name}"] = ts
        for peer, goal in ((TORCH_TCP, ">= 1.2"), (TORCH_DEFAULT, ""), (RAW_GRPC, ">= 0.8")):
            r = med[peer] / med[OURS]
            goal = goal if n == 2 and not quick else ""
            ratios.append(
                Ratio(
                    "throughput",
                    f"{params / 1e6:.1f}M params, {n} shard(s)",
                    OURS,
                    peer,
                    r,
                    goal=goal,
                    met=check(r, goal),
                )
            )
    return Table(
        name="throughput",
        title=f"push+pull of {params / 1e6:.2f}M float32 params ({nbytes / 1e6:.0f} MB), 1 worker",
        columns=["system", "shards", "MB/s", "ms/step", "min ms", "max ms", "peer/ours time"],
        rows=rows,
        notes=[
            "MB/s = 2 x model bytes per step / median step time; one step = push grads + pull "
            f"weights; median of {rounds} interleaved rounds after 1 warm-up.",
            "ours: psworker.connect(async, SGD) against `python -m psserver` daemons, "
            "client.push_pull: a streamed push, then a streamed pull per shard (a share over "
            f"{DEFAULT_CHUNK_BYTES >> 20} MiB; small ones are one unary PushPull).",
            "torch RPC PS: trainer + N PS processes; rpc_async(update_and_fetch) to every PS, "
            "SGD applied there, weights returned (1 fused RPC per PS), as in PyTorch's PS "
            "tutorial.",
            "  TCP only: TensorPipeRpcBackendOptions(_transports=['uv'], _channels=['basic']).",
            "raw peers: 1 server process, same bytes, no parameter-server work (1 'shard').",
            "peer/ours time: the peer's ms/step over ours; > 1: ours faster.",
        ],
        ratios=ratios,
        plot=((0, 1), 2, "MB/s (higher is better); label: system, shards"),
        raw={"shapes": {k: list(v) for k, v in shapes.items()}, "times_s": raw},
        elapsed_s=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="6.4M params, 1 and 2 shards")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--shards", type=int, nargs="+", default=None)
    args = parser.parse_args(argv)
    print_table(measure(args.quick, args.rounds, args.shards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
