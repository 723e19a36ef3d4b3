"""A DiLoCo training worker for end-to-end tests, run as ``python tests/e2e/diloco_worker.py``.

AdamW inner steps on a small model with dropout (so the random generator matters), batches
fixed per (worker, inner step): two fault-free runs end bit-identical, and a worker restarted
from its state (``--state-dir``) goes on at the inner step it resumed at (``client.step``).
``--stall-at k`` stops it before inner step k after printing ``{"stalled": k}``: the test
kills it there (``--stall-after k``: k steps after its first). ``--elastic MIN:MAX`` makes
the job elastic; ``--pace s`` sleeps ``s`` seconds
after each step. ``--keep-states`` copies its state file after every inner step that wrote
it, as ``<its name>-kept-<outer step>.pt`` beside it. It prints ``{"ready": inner step}`` once
connected, ``{"step": t, "crc": checksum}`` after each inner step (where two runs part, the
test names the step), ``{"done": outer step}`` at the end, and writes its model's and the
job's final weights to ``--out`` (.npz).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
import zlib

import numpy as np
import torch

import psworker
from psworker.torch import DistributedOptimizer


def say(**what: int) -> None:
    print(json.dumps(what) + "\n", end="", flush=True)


def crc(model: torch.nn.Module) -> int:
    """A checksum of the model's weights: where two runs part, a failing test names the step."""
    value = 0
    for tensor in model.state_dict().values():
        value = zlib.crc32(tensor.detach().numpy().tobytes(), value)
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--addresses", required=True, help="shard addresses, comma-separated")
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--overlap-steps", type=int, default=0)
    parser.add_argument("--mix", type=float, default=0.0)
    parser.add_argument("--state-dir", default=None)
    parser.add_argument("--keep-states", action="store_true")
    parser.add_argument("--stall-at", type=int, default=-1)
    parser.add_argument("--stall-after", type=int, default=-1, help="steps after the first")
    parser.add_argument("--elastic", default=None, help="MIN:MAX: an elastic job")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds slept per step")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(args.worker)  # the job starts from worker 0's weights
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(64, 4),
    )
    with psworker.connect(
        args.addresses.split(","),
        worker_id=args.worker,
        num_workers=args.workers,
        mode="diloco",
        local_steps=args.local_steps,
        fragments=args.fragments,
        overlap_steps=args.overlap_steps,
        mix=args.mix,
        worker_state_dir=args.state_dir,
        outer=psworker.SGD(lr=0.7, momentum=0.9, nesterov=True),
        timeout=60.0,
        elastic=args.elastic,
    ) as client:
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        opt = DistributedOptimizer(model, client, inner)
        say(ready=client.step)
        stall_at = args.stall_at
        if args.stall_after >= 0:  # an elastic joiner's first step is the job's, not 0
            stall_at = client.step + args.stall_after
        for t in range(client.step, args.steps):
            if t == stall_at:
                say(stalled=t)
                time.sleep(3600)  # until killed
            g = torch.Generator().manual_seed(1000 * args.worker + t)
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            before = client.outer.step
            opt.step()
            say(step=t, crc=crc(model))
            time.sleep(args.pace)
            state = client.state_file
            if args.keep_states and state is not None and client.outer.step != before:
                shutil.copy(state, state.with_name(f"{state.stem}-kept-{client.outer.step}.pt"))
        opt.synchronize()
        weights = {f"model/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
        weights.update({f"job/{k}": v for k, v in client.pull().items()})
        say(done=client.outer.step)
    np.savez(args.out, **weights)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
