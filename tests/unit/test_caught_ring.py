"""The ring algorithm's edges a mutation run showed untested: broadcast's defaults and which
ranks must be able to write, the errors' texts, and run_local's results."""

from __future__ import annotations

import numpy as np
import pytest

from pswire.errors import InvalidRequestError, PSError
from psworker.ring import algorithm as ring
from psworker.ring.algorithm import run_local
from psworker.ring.peer import LocalPeer, local_peers

TIMEOUT = 5.0


def test_broadcast_defaults_to_rank_zero() -> None:
    def body(peer: LocalPeer) -> np.ndarray:
        mine = np.full(5, float(peer.rank + 1), np.float32)
        return ring.broadcast(peer, mine, timeout=TIMEOUT)

    for got in run_local(3, body):
        np.testing.assert_array_equal(got, np.ones(5, np.float32))


def test_broadcast_needs_only_the_receivers_buffers_writable() -> None:
    def body(peer: LocalPeer) -> np.ndarray:
        mine = np.full(4, 7.0 if peer.rank == 1 else 0.0)
        if peer.rank == 1:
            mine.flags.writeable = False  # the root only reads its buffer
        return ring.broadcast(peer, mine, 1, timeout=TIMEOUT)

    for got in run_local(3, body):
        np.testing.assert_array_equal(got, np.full(4, 7.0))
    (peer, _) = local_peers(2)
    frozen = np.zeros(4)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ring.broadcast(peer, frozen, root=1, timeout=TIMEOUT)


def test_chunk_sizes_below_one_byte_are_refused_with_the_value() -> None:
    (peer,) = local_peers(1)
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1, got 0"):
        ring.broadcast(peer, np.ones(3), chunk_bytes=0)
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1, got -4"):
        ring.allreduce(peer, np.ones(3), chunk_bytes=-4)


class Recording:
    """A rank's peer that writes down every message it sends: (tag, dtype, elements)."""

    def __init__(self, inner: LocalPeer, sent: list) -> None:
        self._inner, self.sent = inner, sent
        self.rank, self.world_size, self.left = inner.rank, inner.world_size, inner.left

    def send_to_right(self, tag, array: np.ndarray) -> None:
        self.sent.append((self.rank, tag, array.dtype, array.size))
        self._inner.send_to_right(tag, array)

    def recv_from_left(self, tag, timeout: float) -> np.ndarray:
        return self._inner.recv_from_left(tag, timeout)


def recorded(world: int, body) -> tuple[list[np.ndarray], list]:
    sent: list = []
    return run_local(world, lambda peer: body(Recording(peer, sent))), sent


def test_float16_partial_sums_travel_as_float32_and_finished_segments_as_float16() -> None:
    length = 12
    results, sent = recorded(
        3, lambda p: ring.allreduce(p, np.full(length, 0.5, np.float16), timeout=TIMEOUT)
    )
    for got in results:
        assert got.dtype == np.float16 and (got == 1.5).all()
    reduce_scatter = [dtype for _, tag, dtype, _ in sent if tag.step < 2]
    all_gather = [dtype for _, tag, dtype, _ in sent if tag.step >= 2]
    assert set(reduce_scatter) == {np.dtype(np.float32)}
    assert set(all_gather) == {np.dtype(np.float16)}


def test_a_chunk_smaller_than_an_element_sends_one_element_per_message() -> None:
    results, sent = recorded(
        2, lambda p: ring.allreduce(p, np.arange(4, dtype=np.float32), chunk_bytes=1)
    )
    assert {size for *_, size in sent} == {1}
    for got in results:
        np.testing.assert_array_equal(got, 2 * np.arange(4))


def test_broadcast_stops_before_it_comes_back_to_the_root() -> None:
    root = 2

    def body(peer) -> np.ndarray:
        mine = np.full(3, 9.0) if peer.rank == root else np.zeros(3)
        return ring.broadcast(peer, mine, root, timeout=TIMEOUT)

    results, sent = recorded(4, body)
    assert all((got == 9.0).all() for got in results)
    assert sorted(rank for rank, *_ in sent) == [0, 2, 3]  # rank 1 (left of the root) does not


def test_the_dtypes_it_sums() -> None:
    for dtype in (np.float16, np.float32, np.float64):
        ring.check_sum_dtype(np.dtype(dtype))  # bfloat16 is off unless asked for
    ring.check_sum_dtype(np.dtype(np.uint16), bfloat16=True)
    with pytest.raises(InvalidRequestError, match="sums float16, bfloat16, float32 or float64"):
        ring.check_sum_dtype(np.dtype(np.uint16))


def test_run_local_raises_the_first_error_and_fails_the_others_with_it() -> None:
    seen: dict[int, BaseException] = {}

    def body(peer: LocalPeer) -> np.ndarray:
        if peer.rank == 1:
            raise RuntimeError("boom")
        try:
            return ring.allreduce(peer, np.ones(6, np.float32), timeout=TIMEOUT)
        except PSError as exc:
            seen[peer.rank] = exc
            raise

    with pytest.raises(RuntimeError, match="boom"):
        run_local(3, body)
    assert sorted(seen) == [0, 2]
    for exc in seen.values():
        assert str(exc) == "rank 1: RuntimeError('boom')"


def test_run_local_passes_a_ps_error_on_to_the_others_as_it_is() -> None:
    seen: dict[int, BaseException] = {}
    broken = InvalidRequestError("rank 1 is broken")

    def body(peer: LocalPeer) -> np.ndarray:
        if peer.rank == 1:
            raise broken
        try:
            return ring.allreduce(peer, np.ones(6, np.float32), timeout=TIMEOUT)
        except PSError as exc:
            seen[peer.rank] = exc
            raise

    with pytest.raises(InvalidRequestError, match="rank 1 is broken"):
        run_local(3, body)
    assert sorted(seen) == [0, 2] and all(exc is broken for exc in seen.values())


def test_the_ring_says_what_ranks_must_agree_on() -> None:
    def body(peer: LocalPeer) -> np.ndarray:
        return ring.allreduce(peer, np.ones(10 + 2 * peer.rank, np.float32), timeout=TIMEOUT)

    with pytest.raises(
        InvalidRequestError, match=r"Do all ranks pass buffers of the same length and dtype\?$"
    ):
        run_local(2, body)
    (peer,) = local_peers(1)
    frozen = np.ones(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(
        ValueError, match=r"^the ring writes its result into the buffer, which is read-only$"
    ):
        ring.allreduce(peer, frozen)
