"""A worker of an elastic sync job for the end-to-end tests, and the single-process reference.

Run as a script under any launcher (torchrun, Slurm's variables, $PS_WORKER_ID): the shards
come from $PS_SHARDS, the bounds from $PS_ELASTIC, the id from the launcher. Workers 0 and 1
found the job; a joiner (--join) waits until both have opened step GROW_AT - 1 (files in
--out), joins (so it trains from GROW_AT on every shard), and leaves cleanly after step
SHRINK_AT - 1. Each worker's batch at a step is fixed by (worker, step); the model is a linear
regression whose gradient the worker computes at the weights it pulled.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import psworker
from pscore.optim import SGD

STEPS, GROW_AT, SHRINK_AT = 12, 4, 9
FEATURES, OUTPUTS, BATCH = 5, 3, 8


def init_values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {
        "w": rng.standard_normal((FEATURES, OUTPUTS)).astype(np.float32),
        "b": np.zeros(OUTPUTS, np.float32),
    }


def batch(worker: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([worker, step, 5])
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    y = rng.standard_normal((BATCH, OUTPUTS)).astype(np.float32)
    return x, y


def gradient(weights: dict[str, np.ndarray], worker: int, step: int) -> dict[str, np.ndarray]:
    """d/dweights of the mean squared error on this worker's batch at ``step``."""
    x, y = batch(worker, step)
    err = (x @ weights["w"] + weights["b"] - y) * np.float32(2.0 / y.size)
    return {"w": (x.T @ err).astype(np.float32), "b": err.sum(0).astype(np.float32)}


def optimizer() -> SGD:
    return SGD(lr=0.05, momentum=0.9)


def members_at(step: int) -> list[int]:
    return [0, 1, 2] if GROW_AT <= step < SHRINK_AT else [0, 1]


def reference() -> dict[str, np.ndarray]:
    """One process (mode local): each step, the mean gradient of that step's members at the
    current weights, summed in worker order as the shards do."""
    with psworker.connect(mode="local") as local:
        local.init(init_values(), optimizer())
        weights = local.pull()
        for step in range(STEPS):
            members = members_at(step)
            total = {k: np.zeros_like(v) for k, v in weights.items()}
            for w in members:
                for k, g in gradient(weights, w, step).items():
                    total[k] += g
            local.push({k: v / np.float32(len(members)) for k, v in total.items()})
            weights = local.pull()
        return weights


def wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--join", action="store_true")
    args = parser.parse_args()
    out: Path = args.out
    if args.join:
        wait_for(out / "ready-0")
        wait_for(out / "ready-1")
    client = psworker.connect(timeout=60)
    me = client.worker_id
    client.init(init_values(), optimizer())
    steps = []
    with client:
        if args.join:
            (out / "joined").write_text(str(client.step))
        weights = client.pull()  # a joiner's: the job's weights once step GROW_AT - 1 closes
        last = SHRINK_AT if args.join else STEPS
        while client.step < last:
            step = client.step
            if step == GROW_AT - 1 and not args.join:
                (out / f"ready-{me}").write_text("")  # we have read at GROW_AT - 1
                wait_for(out / "joined")
            weights = client.push_pull(gradient(weights, me, step))
            steps.append(step)
    np.savez(out / f"final-{me}.npz", **weights)
    joined_at = getattr(client, "joined_at", None)
    (out / f"steps-{me}.json").write_text(json.dumps({"steps": steps, "joined_at": joined_at}))


if __name__ == "__main__":
    main()
