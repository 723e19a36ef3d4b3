"""Ring addresses by rendezvous in a real TCPStore on 127.0.0.1: every rank learns every
other's ring server, the ring then all-reduces, and a rank that never comes is named."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from ports import free_port

from pswire.errors import WaitTimeoutError
from psworker.ring.client import AllReduceClient
from psworker.ring.rendezvous import RendezvousSettings, rendezvous_ring


@pytest.mark.timeout(120)
def test_ranks_find_each_other_and_all_reduce() -> None:
    port = free_port()
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            settings = RendezvousSettings("127.0.0.1", port, r, 3, timeout_s=60.0)
            server, peers, store = rendezvous_ring(settings)
            with AllReduceClient(r, peers, server=server, rendezvous=store, timeout=60.0) as c:
                results[r] = (peers, c.ring.allreduce(np.full(4, r + 1.0, np.float32)))
        except Exception as exc:  # reported below, with the rank
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]  # 0 comes last
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert sorted(results) == [0, 1, 2], results
    for r in range(3):
        assert not isinstance(results[r], Exception), results
    peers = [results[r][0] for r in range(3)]  # type: ignore[index]
    assert peers[0] == peers[1] == peers[2] and len(set(peers[0])) == 3
    for r in range(3):
        np.testing.assert_array_equal(results[r][1], np.full(4, 6.0, np.float32))  # type: ignore[index]


@pytest.mark.timeout(60)
def test_a_rank_that_never_comes_is_named() -> None:
    settings = RendezvousSettings("127.0.0.1", free_port(), 0, 2, timeout_s=2.0)
    with pytest.raises(WaitTimeoutError, match=r"still missing after 2 s: .*rank1"):
        rendezvous_ring(settings)
