"""Where each transport wins: push_pull over the Flight data port against the grpcio step
stream, same shard daemons, same run, interleaved, over step sizes from 1,000 parameters up.

``PYTHONPATH=. python -m bench.transport_sizes [--rounds N]``. Two clients of one async job
take turns: one moves tensors on Flight (the default: under ``GRPC_BELOW_BYTES`` a step in one
message each way on the data port's step exchange, from it record batches), the other has its
links' data port switched off, so it moves them on grpcio's step stream.
``PS_GRPC_BELOW_BYTES=0`` makes the first use record batches at every size: ``GRPC_BELOW_BYTES``
(psworker/session.py) is chosen from that table, the size below which batches are slower.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import numpy as np

import psworker
from bench import peers
from bench.report import median
from bench.timing import interleave

# Parameters per step (float32), one variable each: 4 KB to 16 MB each way.
SIZES = [1_000, 16_000, 64_000, 256_000, 1_000_000, 4_000_000]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--sizes", type=int, nargs="*", default=SIZES, help="parameters")
    args = parser.parse_args(argv)
    print(f"push_pull, async, {args.shards} shard(s), median of {args.rounds} interleaved rounds")
    print(f"{'params':>10} {'bytes':>10} {'flight ms':>10} {'grpc ms':>10} {'grpc/flight':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model = {"w": np.zeros(size, np.float32)}
            grads = {"w": np.full(size, 1e-6, np.float32)}
            with contextlib.ExitStack() as stack:
                addresses, _ = stack.enter_context(
                    peers.shards(peers.SEPARATE, args.shards, Path(tmp))
                )
                clients = [
                    stack.enter_context(
                        psworker.connect(addresses, worker_id=w, num_workers=2, mode="async")
                    )
                    for w in range(2)
                ]
                for c in clients:
                    c.init(model, psworker.SGD(lr=0.1))
                for link in clients[1].links:  # this one moves tensors on grpcio
                    if link.flight is not None:
                        link.flight.close()
                        link.flight = link.flight_steps = None
                outs = [{"w": np.empty(size, np.float32)} for _ in clients]

                def step(c: psworker.Client, o: dict[str, np.ndarray], g: dict) -> None:
                    c.push_pull(g, out=o)  # None: interleave times the call itself

                steps = {
                    name: (lambda c=c, o=o, g=grads: step(c, o, g))
                    for name, c, o in zip(("flight", "grpc"), clients, outs, strict=True)
                }
                times = interleave(steps, args.rounds, warmup=3)
            fl, gr = median(times["flight"]) * 1e3, median(times["grpc"]) * 1e3
            print(f"{size:>10,} {size * 4:>10,} {fl:>10.3f} {gr:>10.3f} {gr / fl:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
