"""A numpy worker that takes everything from its launcher (``python tests/e2e/env_worker.py``).

``psworker.connect()`` gets no argument: the mode, the worker's id and count, the shards or the
ring all come from the environment (torchrun's, psctl local's, ...). Gradients are fixed per
(worker, step) as in ``numpy_worker``, so two fault-free runs of the same job end with
bit-identical weights. It prints ``{"ready": step}``, ``{"step": N}`` lines and ``{"done": N}``,
and writes its final weights to ``--out/worker{id}.npz`` when asked.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import time
from pathlib import Path

import numpy as np
from numpy_worker import Gradients, model

import psworker
from pscore.optim import SGD


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds of 'compute' per step")
    parser.add_argument("--floats", type=int, default=1000)
    parser.add_argument("--out", help="folder for worker{id}.npz, the final weights")
    args = parser.parse_args()
    # A test that finds this worker hung asks for every thread's stack (Lines.wait_for).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    values = model(args.floats, 2)
    with psworker.connect() as client:
        grads = Gradients(client.worker_id, {k: v.shape for k, v in values.items()})
        client.init(values, SGD(lr=0.01, momentum=0.9))
        print(json.dumps({"ready": client.step, "mode": client.mode}) + "\n", end="", flush=True)
        while client.step < args.steps:
            step = client.step
            if args.pace:
                time.sleep(args.pace)
            client.pull()
            client.push(grads(step))
            print(json.dumps({"step": client.step}) + "\n", end="", flush=True)
        final = client.pull()
        if args.out:
            path = Path(args.out) / f"worker{client.worker_id}.npz"
            np.savez(path, **final)
        print(json.dumps({"done": client.step}) + "\n", end="", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
