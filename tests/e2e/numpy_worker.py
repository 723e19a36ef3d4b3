"""A numpy training worker for end-to-end tests, run as ``python tests/e2e/numpy_worker.py``.

Its gradients are fixed per (worker, step) and independent of the weights, so two fault-free
runs of the same job end with bit-identical weights (with two sync workers, whose sum is the
same in either order). It prints one JSON line per reported step (``{"step": N}``), then
``{"done": N}`` once it has left the job, and writes its final weights to ``--out`` (an .npz
file) when asked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import psworker
from pscore.optim import SGD


def model(floats: int, pieces: int) -> dict[str, np.ndarray]:
    """Initial values: ``floats`` float32 numbers in ``pieces`` variables, all the same seed."""
    rng = np.random.default_rng(7)
    sizes = [floats // pieces + (1 if i < floats % pieces else 0) for i in range(pieces)]
    return {f"v{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}


class Gradients:
    """A fixed gradient per (worker, step): the worker's own random direction times a step's
    random float32 factor (one multiply per step: cheap enough for a model of megabytes)."""

    def __init__(self, worker: int, shapes: dict[str, tuple[int, ...]]) -> None:
        rng = np.random.default_rng(1000 + worker)
        self.worker = worker
        self.base = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        factor = np.float32(np.random.default_rng(1_000_003 * self.worker + step).uniform(-1, 1))
        return {k: b * factor for k, b in self.base.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--addresses", required=True, help="shard addresses, comma-separated")
    parser.add_argument("--worker-id", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True)
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--steps", type=int, default=0, help="steps to train (0: --duration)")
    parser.add_argument("--duration", type=float, default=0.0, help="seconds to train")
    parser.add_argument("--floats", type=int, default=1000, help="model size in float32s")
    parser.add_argument("--pieces", type=int, default=2, help="variables the model has")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds of 'compute' per step")
    parser.add_argument("--fused", action="store_true", help="push_pull instead of pull, push")
    parser.add_argument("--report-every", type=int, default=1)
    parser.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat interval (s)")
    parser.add_argument("--timeout", type=float, default=60.0, help="each call's deadline (s)")
    parser.add_argument("--out", help="write the final weights here (.npz)")
    args = parser.parse_args(argv)
    values = model(args.floats, args.pieces)
    grads = Gradients(args.worker_id, {k: v.shape for k, v in values.items()})
    end = time.monotonic() + args.duration
    with psworker.connect(
        args.addresses.split(","),
        worker_id=args.worker_id,
        num_workers=args.num_workers,
        mode=args.mode,
        timeout=args.timeout,
        heartbeat_s=args.heartbeat,
    ) as client:
        client.init(values, SGD(lr=0.01, momentum=0.9))
        print(json.dumps({"ready": client.step}) + "\n", end="", flush=True)
        while (client.step < args.steps) if args.steps else (time.monotonic() < end):
            step = client.step
            if args.pace:
                time.sleep(args.pace)  # the step's compute
            if args.fused:
                client.push_pull(grads(step))
            else:
                client.pull()
                client.push(grads(step))
            if client.step % args.report_every == 0:
                print(json.dumps({"step": client.step}) + "\n", end="", flush=True)
        final = client.pull()
        if args.out:
            np.savez(args.out, **final)
        done = client.step
    # After the block: the client has left, so a test that stops the shards on this line finds
    # this worker gone (printed inside, a SIGTERM could save a checkpoint before the leave).
    print(json.dumps({"done": done}) + "\n", end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
