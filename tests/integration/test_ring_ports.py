"""A ring rank's port is its own: a second server (another job, a rank left over from an earlier
run) on a taken port is refused with an error naming the address, and the first keeps working."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from psworker.ring.ring import Ring, RingServer


def test_a_second_ring_server_on_a_taken_port_is_refused_by_address():
    first = RingServer("127.0.0.1:0")
    try:
        with pytest.raises(
            RuntimeError, match=f"could not bind {first.address}: is the port in use"
        ):
            RingServer(first.address)
    finally:
        first.stop(0)


def test_a_rank_on_a_taken_port_is_refused_and_the_ring_there_keeps_its_traffic():
    servers = [RingServer("127.0.0.1:0") for _ in range(2)]
    addresses = [s.address for s in servers]
    # A leftover rank 1 of another job tries to serve on rank 1's port of this ring.
    with pytest.raises(RuntimeError, match=f"could not bind {addresses[1]}"):
        Ring(1, addresses, timeout=10)
    rings: list[Ring | None] = [None, None]
    sums: list[np.ndarray | None] = [None, None]

    def run(rank: int) -> None:
        ring = rings[rank] = Ring(rank, addresses, server=servers[rank], timeout=10)
        sums[rank] = ring.allreduce(np.full(1000, rank + 1.0))

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        for s in sums:
            assert s is not None and np.array_equal(s, np.full(1000, 3.0))
    finally:
        for ring in rings:
            if ring is not None:
                ring.close()
