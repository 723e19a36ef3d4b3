"""A torch training worker with ``DistributedOptimizer(overlap=True)`` for end-to-end tests, run
as ``python tests/e2e/overlap_worker.py``.

Its batches are fixed per step, so two fault-free runs end with bit-identical weights, and a
worker restarted at step k (it resumes where the shards say it is) ends as one that never
stopped. Its model (86K parameters, 344 KB) takes the shards' Flight data ports by default, so
from its second step each shard's push streams from backward. ``--stall-at k`` stops it between
backward() and step() of step k, every stream open with all but its last tensor sent, after
printing ``{"streaming": k, "shards": n}``: the test kills it there. ``--pause-at k`` stops
it (SIGSTOP to itself) at the same point after printing ``{"pausing": k}``: the test resumes
it (SIGCONT). ``--worker-id``/``--workers``: one of several workers (each its own batches).
It prints ``{"step": N}`` after each step, ``{"done": N}`` at the end, and writes its final
weights to ``--out`` (.npz).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time

import numpy as np
import torch

import psworker
from psworker.torch import DistributedOptimizer


def say(**what: int) -> None:
    print(json.dumps(what) + "\n", end="", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--addresses", required=True, help="shard addresses, comma-separated")
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--stall-at", type=int, default=-1)
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--worker-id", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks for a test's timeout
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    addresses = args.addresses.split(",")
    with psworker.connect(
        addresses,
        worker_id=args.worker_id,
        num_workers=args.workers,
        mode=args.mode,
        timeout=args.timeout,
    ) as client:
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = DistributedOptimizer(model, client, inner, overlap=True)
        say(ready=client.step)
        for t in range(client.step, args.steps):
            g = torch.Generator().manual_seed(t * 1000 + args.worker_id)
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if t == args.stall_at:
                streams = opt._overlap._streams if opt._overlap is not None else None
                say(streaming=t, shards=len(streams.shards) if streams is not None else 0)
                time.sleep(3600)  # until killed
            if t == args.pause_at:
                say(pausing=t)
                os.kill(os.getpid(), signal.SIGSTOP)  # until the test sends SIGCONT
            opt.step()
            say(step=t + 1)
        opt.synchronize()
        weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    np.savez(args.out, **weights)
    say(done=args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
