"""A training step (push gradients, pull weights) against every peer, at the issue's sizes.

``python -m bench.steps`` (or ``python -m bench --only steps``). Four groups: 1,000 params on 1
shard, 1M on 1 and on 2 shards, 25M on 2 shards. In each group, interleaved round by round so
load from elsewhere on the machine hits them alike: ours (``psworker.connect`` +
``push_pull(grads, out=model)`` against ``python -m psserver`` daemons), the torch RPC
parameter server over TCP and over TensorPipe's default transport (bench/torchps.py), and raw
gRPC and raw TCP moving the same bytes each way with no parameter-server work (the limit).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import torchps
from bench.report import MB, Ratio, Table, check, median, print_table
from bench.throughput import FULL_SHAPES, RAW_GRPC, RAW_TCP, nbytes_of, ours_step, raw_steps
from bench.timing import Step, interleave

SMALL: dict[str, tuple[int, ...]] = {"w": (30, 30), "b": (100,)}  # 1,000 params
MID: dict[str, tuple[int, ...]] = {  # 1,001,152 params
    "embedding": (2500, 256),
    "fc1.weight": (512, 512),
    "fc1.bias": (512,),
    "fc2.weight": (192, 512),
    "fc2.bias": (192,),
}
OURS = "ours (push_pull, out=)"
TORCH_TCP = "torch RPC PS, TCP only"
TORCH_DEFAULT = "torch RPC PS, default transport"


@dataclass(frozen=True)
class Group:
    """One interleaved group: ``shapes`` on ``shards``; ``rounds`` (``quick_rounds`` with
    --quick; 0: left out); ``targets``: (target name, peer, goal) of the issue's Must show,
    each ratio the peer's median time over ours (> 1: ours faster)."""

    label: str
    shapes: dict[str, tuple[int, ...]]
    shards: int
    rounds: int
    quick_rounds: int
    targets: tuple[tuple[str, str, str], ...]


GROUPS = (
    Group(
        "1,000 params, 1 shard",
        SMALL,
        1,
        300,
        40,
        (("1,000 params vs torch default", TORCH_DEFAULT, ">= 1.2"),),
    ),
    Group(
        "1M params, 1 shard", MID, 1, 40, 8, (("1M 1 shard vs torch TCP", TORCH_TCP, ">= 0.75"),)
    ),
    Group(
        "1M params, 2 shards", MID, 2, 40, 8, (("1M 2 shards vs torch TCP", TORCH_TCP, ">= 1.0"),)
    ),
    Group(
        "25M params, 2 shards",
        FULL_SHAPES,
        2,
        8,
        0,  # --quick leaves it out: 25M on 2 cores takes minutes with every peer
        (
            ("25M 2 shards vs torch TCP", TORCH_TCP, ">= 1.5"),
            ("25M vs raw TCP", RAW_TCP, ">= 0.5"),
        ),
    ),
)


def measure_group(group: Group, rounds: int) -> dict[str, list[float]]:
    """Every system doing ``group``'s step, interleaved; seconds per step by system."""
    nbytes = nbytes_of(group.shapes)
    small = nbytes <= 64 * 1024
    with tempfile.TemporaryDirectory(prefix="bench_steps_") as tmp, contextlib.ExitStack() as st:
        steps: dict[str, Step] = {
            OURS: st.enter_context(
                ours_step(group.shapes, group.shards, Path(tmp), into_model=True)
            )
        }
        for name, transport in ((TORCH_TCP, torchps.TCP), (TORCH_DEFAULT, torchps.DEFAULT)):
            steps[name] = st.enter_context(torchps.torch_ps(group.shapes, group.shards, transport))
        steps.update(st.enter_context(raw_steps(nbytes, tcp=True)))
        print(f"steps: {group.label}, {len(steps)} systems, {rounds} rounds", flush=True)
        return interleave(steps, rounds, warmup=5 if small else 1)


def measure(quick: bool, labels: list[str] | None = None) -> Table:
    t0 = time.perf_counter()
    rows: list[list] = []
    ratios: list[Ratio] = []
    raw: dict[str, dict[str, list[float]]] = {}
    for group in GROUPS:
        rounds = group.quick_rounds if quick else group.rounds
        if not rounds or (labels is not None and group.label not in labels):
            continue
        times = raw[group.label] = measure_group(group, rounds)
        med = {k: median(v) for k, v in times.items()}
        nbytes = nbytes_of(group.shapes)
        for name, ts in times.items():
            shards = group.shards if name in (OURS, TORCH_TCP, TORCH_DEFAULT) else 1
            rows.append(
                [
                    group.label,
                    name,
                    shards,
                    2 * nbytes / med[name] / MB,
                    med[name] * 1e3,
                    min(ts) * 1e3,
                    max(ts) * 1e3,
                    med[name] / med[OURS] if name != OURS else None,
                ]
            )
        goals = {peer: (target, goal) for target, peer, goal in group.targets}
        for peer in (TORCH_TCP, TORCH_DEFAULT, RAW_GRPC, RAW_TCP):
            target, goal = goals.get(peer, ("", ""))
            r = med[peer] / med[OURS]
            ratios.append(
                Ratio(
                    "steps",
                    group.label,
                    OURS,
                    peer,
                    r,
                    goal=goal,
                    met=check(r, goal),
                    target=target,
                )
            )
    return Table(
        name="steps",
        title="one training step (push grads + pull weights), 1 worker, against every peer",
        columns=["group", "system", "shards", "MB/s", "median ms", "min ms", "max ms", "x ours"],
        rows=rows,
        notes=[
            "MB/s = 2 x model bytes / median step time; 'x ours': the system's median time over "
            "ours (> 1: ours faster). Each group's systems interleaved round by round.",
            "ours: psworker.connect(async) + push_pull(grads, out=model), SGD lr 1e-3, against "
            "`python -m psserver` daemons, each in its own process.",
            "torch RPC PS: a trainer and N PS processes, rpc_async(update_and_fetch) to each PS, "
            "SGD applied there (PyTorch's PS tutorial); TCP only: TensorPipe with "
            "_transports=['uv'], _channels=['basic'].",
            "raw gRPC / raw TCP: 1 server process moving the same bytes each way (gRPC: 4 MiB "
            "chunks streamed; TCP: sendall/recv_into), no parameter-server work: the limit.",
        ],
        ratios=ratios,
        plot=((0, 1), 3, "MB/s (higher is better); label: group, system"),
        raw={"times_s": raw},
        elapsed_s=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.steps", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1,000 and 1M params, few rounds")
    parser.add_argument(
        "--group", nargs="+", choices=[g.label for g in GROUPS], default=None, help="these only"
    )
    args = parser.parse_args(argv)
    print_table(measure(args.quick, args.group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
