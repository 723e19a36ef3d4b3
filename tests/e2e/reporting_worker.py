"""A numpy worker that reports its loss for ``psctl dashboard``, run as
``python tests/e2e/reporting_worker.py ADDRS WORKER_ID NUM_WORKERS SECONDS``.

It trains a least-squares model in ``sync`` mode for SECONDS, pacing each step, and calls
``psworker.report(client, loss=...)`` every step (``$PS_REPORT_DIR`` says where to).
"""

from __future__ import annotations

import sys
import time

import numpy as np

import psworker


def main() -> int:
    addresses, worker_id, num_workers, seconds = sys.argv[1:5]
    rng = np.random.default_rng(int(worker_id))
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = x @ np.arange(8, dtype=np.float32)
    with psworker.connect(
        addresses.split(","), worker_id=int(worker_id), num_workers=int(num_workers), mode="sync"
    ) as client:
        client.init({"w": np.zeros(8, np.float32)}, psworker.SGD(lr=0.05))
        w = client.pull()["w"]
        end = time.monotonic() + float(seconds)
        while time.monotonic() < end:
            error = x @ w - y
            psworker.report(client, loss=float(np.mean(error**2)))
            w = client.push_pull({"w": (x.T @ error / len(x)).astype(np.float32)})["w"]
            time.sleep(0.05)
        print(f"worker {worker_id} done at step {client.step}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
