"""A torch worker of a DiLoCo job that reports its loss for ``psctl dashboard``, run as
``python tests/e2e/diloco_reporting_worker.py ADDRS WORKER_ID NUM_WORKERS H STEPS PACE [WIDTH]``.

It trains an MLP (8 inputs, WIDTH hidden units, default 16) for STEPS inner steps of AdamW
(each at least PACE seconds), an outer step every H, calls ``opt.report(loss=...)`` every
step (``$PS_REPORT_DIR`` says where to), and prints one JSON line at the end: its inner and
outer steps and the bytes its outer steps moved.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import psworker
from psworker import DistributedOptimizer


def main() -> int:
    addresses, worker_id, num_workers, local_steps, steps, pace = sys.argv[1:7]
    width = int(sys.argv[7]) if len(sys.argv) > 7 else 16
    torch.manual_seed(int(worker_id))
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    with psworker.connect(
        addresses.split(","),
        worker_id=int(worker_id),
        num_workers=int(num_workers),
        mode="diloco",
        local_steps=int(local_steps),
    ) as client:
        opt = DistributedOptimizer(model, client, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for _ in range(int(steps)):
            began = time.monotonic()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.report(loss=loss)
            time.sleep(max(0.0, float(pace) - (time.monotonic() - began)))
        opt.synchronize()
        done = {
            "worker": int(worker_id),
            "step": client.step,
            "outer_step": client.outer.step,
            "bytes_sent": client.bytes_sent,
            "bytes_received": client.bytes_received,
        }
    print(json.dumps(done) + "\n", end="", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
