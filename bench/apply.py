"""Shard apply rate: parameters updated per second by Shard.push, no network, vs numpy and torch."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np

from bench.report import Ratio, Table, check, median, print_table
from bench.throughput import FULL_SHAPES, QUICK_SHAPES, nbytes_of
from bench.timing import interleave
from pscore.job import Job, VarSpec
from pscore.optim import SGD, Adam, Optimizer
from psserver.shard import Shard

LR = 1e-3
MOMENTUM = 0.9


def shard_step(shapes: dict[str, tuple[int, ...]], optimizer: Optimizer) -> Callable[[], None]:
    """A Shard holding ``shapes`` (async, 1 worker); each call pushes one step's gradients."""
    rng = np.random.default_rng(0)
    values = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
    grads = {k: np.full(s, 1e-4, dtype=np.float32) for k, s in shapes.items()}
    job = Job(
        mode="async",
        staleness=0,
        num_workers=1,
        optimizer=optimizer,
        variables=tuple(VarSpec(k, tuple(s), "float32") for k, s in shapes.items()),
        model_digest="bench",
    )
    shard = Shard()
    shard.register_worker(0, 1)
    shard.init(0, job, values)
    step = iter(range(1 << 40))  # a repeated step number would be skipped as a duplicate

    def push() -> None:
        if not shard.push(0, next(step), grads, timeout=60.0).applied:
            raise RuntimeError("Shard.push did not apply the gradient")

    return push


def cpu_timed(step: Callable[[], None], into: list[float]) -> Callable[[], None]:
    """``step``, appending the process CPU seconds of each call (warm-up calls too) to ``into``."""

    def timed() -> None:
        c0 = time.process_time()
        step()
        into.append(time.process_time() - c0)

    return timed


def numpy_axpy(shapes: dict[str, tuple[int, ...]]) -> Callable[[], None]:
    """The floor: p -= lr * g per variable, plain SGD with no momentum and no checks."""
    params = {k: np.zeros(s, dtype=np.float32) for k, s in shapes.items()}
    grads = {k: np.full(s, 1e-4, dtype=np.float32) for k, s in shapes.items()}
    lr = np.float32(LR)

    def step() -> None:
        for k, p in params.items():
            p -= lr * grads[k]

    return step


def torch_optim(shapes: dict[str, tuple[int, ...]], kind: str) -> Callable[[], None] | None:
    """torch.optim.SGD(momentum) or Adam on CPU tensors of the same shapes; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    params = [torch.zeros(s, requires_grad=True) for s in shapes.values()]
    for p in params:
        p.grad = torch.full(p.shape, 1e-4)
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
        if kind == "sgd"
        else torch.optim.Adam(params, lr=LR)
    )

    def step() -> None:
        with torch.no_grad():
            opt.step()

    return step


def measure(quick: bool, rounds: int | None = None) -> Table:
    t0 = time.perf_counter()
    shapes = QUICK_SHAPES if quick else FULL_SHAPES
    rounds = rounds or (5 if quick else 10)
    params = nbytes_of(shapes) // 4
    steps = {
        "ours Shard.push, SGD momentum 0.9": shard_step(shapes, SGD(lr=LR, momentum=MOMENTUM)),
        "ours Shard.push, Adam": shard_step(shapes, Adam(lr=LR)),
        "numpy p -= lr*g (plain SGD)": numpy_axpy(shapes),
    }
    for kind, name in (("sgd", "torch.optim.SGD momentum 0.9"), ("adam", "torch.optim.Adam")):
        step = torch_optim(shapes, kind)
        if step is not None:
            steps[name] = step
    print(f"apply: {len(steps)} systems, {rounds} rounds", flush=True)
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    times = interleave({k: cpu_timed(f, cpu[k]) for k, f in steps.items()}, rounds, warmup=2)
    med = {k: median(v) for k, v in times.items()}
    rows = [[k, params / med[k] / 1e6, med[k] * 1e3, median(cpu[k][2:]) * 1e3] for k in times]
    ours_sgd, ours_adam = "ours Shard.push, SGD momentum 0.9", "ours Shard.push, Adam"
    ratios = [
        Ratio(
            "apply",
            "SGD momentum vs bare axpy",
            ours_sgd,
            "numpy p -= lr*g",
            med["numpy p -= lr*g (plain SGD)"] / med[ours_sgd],
        ),
    ]
    for peer, ours, target in (
        ("torch.optim.SGD momentum 0.9", ours_sgd, "apply SGD momentum vs torch.optim"),
        ("torch.optim.Adam", ours_adam, "apply Adam vs torch.optim"),
    ):
        if peer in med:
            r = med[peer] / med[ours]
            goal = "" if quick else ">= 0.8"
            ratios.append(
                Ratio(
                    "apply",
                    target.removeprefix("apply ").split(" vs ")[0],
                    ours,
                    peer.removesuffix(" momentum 0.9"),
                    r,
                    goal=goal,
                    met=check(r, goal),
                    target="" if quick else target,  # the figure is at 25M
                )
            )
    return Table(
        name="apply",
        title=f"optimizer step on {params / 1e6:.1f}M float32 params, in-process, no network",
        columns=["system", "M params/s", "ms/step", "CPU ms/step"],
        rows=rows,
        notes=[
            f"median of {rounds} interleaved steps after 2 warm-up. Shard.push includes its "
            "checks, the lock and the consistency policy (async, 1 worker).",
            "The numpy row does less work (no momentum buffer): a floor for memory bandwidth.",
            "CPU ms/step: the process's CPU time (every thread: torch's intra-op threads, our "
            "optimizer threads), median: what a step costs a loaded machine.",
        ],
        ratios=ratios,
        plot=((0,), 1, "M params updated / s (higher is better)"),
        raw={"times_s": times, "cpu_s": cpu},
        elapsed_s=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.apply", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="6.4M params, 5 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    print_table(measure(args.quick, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
