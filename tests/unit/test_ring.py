"""Unit tests for psworker.ring: the algorithms over in-memory peers, and gradient buckets."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pswire import codec
from pswire.errors import (
    InvalidRequestError,
    PSError,
    ShapeMismatchError,
    UnknownVariableError,
    WaitTimeoutError,
)
from psworker.ring import algorithm as ring
from psworker.ring import buckets
from psworker.ring.algorithm import run_local
from psworker.ring.buckets import BucketPlan
from psworker.ring.peer import Failure, LocalPeer, Mailbox, Tag, local_peers

TIMEOUT = 10.0


def inputs(world: int, length: int, dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(length).astype(dtype) for _ in range(world)]


def allreduce_all(
    xs: list[np.ndarray], chunk_bytes: int = 64, copy: bool = True, **kw: object
) -> list[np.ndarray]:
    def body(peer: LocalPeer) -> np.ndarray:
        buffer = xs[peer.rank].copy()
        return ring.allreduce(peer, buffer, timeout=TIMEOUT, chunk_bytes=chunk_bytes, **kw)  # type: ignore[arg-type]

    return run_local(len(xs), body, copy=copy)


def assert_identical_on_all_ranks(results: list[np.ndarray]) -> None:
    """Replicas must agree to the bit, not just to a tolerance."""
    first = results[0]
    for r in results[1:]:
        assert r.dtype == first.dtype and r.shape == first.shape
        assert r.tobytes() == first.tobytes()


# -- all-reduce: sums --------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(
    world=st.integers(1, 8),
    length=st.integers(0, 300),
    chunk_bytes=st.integers(1, 200),
    dtype=st.sampled_from(["float32", "float64"]),
    copy=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_allreduce_equals_numpy_sum(
    world: int, length: int, chunk_bytes: int, dtype: str, copy: bool, seed: int
) -> None:
    xs = inputs(world, length, dtype, seed)
    # copy=False hands views to the receiver: a wrong result here means the algorithm changed
    # an array after sending it, which a lazily encoding network peer would put on the wire.
    results = allreduce_all(xs, chunk_bytes, copy=copy)
    stacked = np.stack(xs).astype(np.float64)
    want = np.sum(stacked, axis=0)
    # Summed in another order, each of the world - 1 additions rounds by at most eps times the
    # magnitudes summed so far; relative to the result itself, cancellation makes that unbounded
    # (hypothesis found 1.04e-6 for six float32 values summing to -0.0537).
    bound = world * np.finfo(dtype).eps * np.sum(np.abs(stacked), axis=0)
    assert len(results) == world
    for got in results:
        assert got.dtype == np.dtype(dtype) and got.shape == (length,)
        assert np.all(np.abs(got.astype(np.float64) - want) <= bound)
    assert_identical_on_all_ranks(results)


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_integer_valued_sums_are_exact(world: int, dtype: str) -> None:
    # Small integers add exactly in every order, so the ring must match the reference exactly,
    # for lengths below, at and off multiples of the world size.
    rng = np.random.default_rng(world)
    for length in sorted({0, 1, max(world - 1, 0), world, world + 1, 7 * world + 3, 1001}):
        xs = [rng.integers(-100, 100, length).astype(dtype) for _ in range(world)]
        results = allreduce_all(xs, chunk_bytes=16)
        want = np.sum(np.stack(xs).astype(np.float64), axis=0).astype(dtype)
        for got in results:
            np.testing.assert_array_equal(got, want)


def test_float16_is_accumulated_in_float32() -> None:
    # In float16, 2048 + 1 rounds back to 2048 (ties to even), so a float16 accumulator loses
    # every +1; float32 keeps them and the final rounding gives float16(2051) = 2052.
    world = 4
    xs = [np.full(10, 2048 if r == 0 else 1, dtype=np.float16) for r in range(world)]
    for got in allreduce_all(xs, chunk_bytes=8):
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, np.float16(2051.0))
        assert np.all(got == 2052)


@settings(max_examples=40, deadline=None)
@given(world=st.integers(2, 8), length=st.integers(1, 200), seed=st.integers(0, 2**32 - 1))
def test_float16_matches_float32_sum_rounded_once(world: int, length: int, seed: int) -> None:
    xs = inputs(world, length, "float16", seed)
    want = np.sum(np.stack(xs).astype(np.float32), axis=0).astype(np.float16)
    results = allreduce_all(xs, chunk_bytes=6)
    # A different float32 summation order may land on the other side of a float16 rounding
    # boundary: at most one float16 ulp apart.
    ulp = np.spacing(np.abs(want)).astype(np.float32)
    for got in results:
        assert np.all(np.abs(got.astype(np.float32) - want.astype(np.float32)) <= ulp)
    assert_identical_on_all_ranks(results)


def test_zero_length_and_single_rank_return_the_buffer_untouched() -> None:
    (peer,) = local_peers(1)
    buffer = np.arange(5, dtype=np.float32)
    assert ring.allreduce(peer, buffer) is buffer
    np.testing.assert_array_equal(buffer, np.arange(5, dtype=np.float32))
    results = allreduce_all([np.zeros(0, np.float32)] * 3)
    assert [r.shape for r in results] == [(0,)] * 3


# -- bfloat16 ------------------------------------------------------------------------------


SPECIAL_F32 = np.array(
    [0.0, -0.0, 1.0, 1.00390625, 1.005859375, 3.4e38, -3.4e38, 1e-40, -1e-45, np.inf, -np.inf],
    dtype=np.float32,
)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]))
def test_bfloat16_rounding_matches_torch(seed: int, scale: float) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    values = np.concatenate([SPECIAL_F32, (rng.standard_normal(500) * scale).astype(np.float32)])
    ours = codec.float32_to_bfloat16(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    # Widening is exact: what torch reads back from the bits is what we read back.
    np.testing.assert_array_equal(
        codec.bfloat16_to_float32(ours),
        torch.from_numpy(ours.view(np.int16)).view(torch.bfloat16).float().numpy(),
    )


def test_bfloat16_nan_stays_nan() -> None:
    values = np.array([np.nan, -np.nan, 1.0], dtype=np.float32)
    back = codec.bfloat16_to_float32(codec.float32_to_bfloat16(values))
    assert np.isnan(back[:2]).all() and back[2] == 1.0


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_bfloat16_allreduce_matches_torch_sum(world: int) -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(world)
    tensors = [torch.randn(517, generator=gen).to(torch.bfloat16) for _ in range(world)]
    bits = [t.view(torch.int16).numpy().view(np.uint16) for t in tensors]
    results = allreduce_all(bits, chunk_bytes=40, bfloat16=True)
    want = torch.stack([t.float() for t in tensors]).sum(0).to(torch.bfloat16).float().numpy()
    assert_identical_on_all_ranks(results)
    for got in results:
        assert got.dtype == np.uint16
        got_f32 = torch.from_numpy(got.view(np.int16)).view(torch.bfloat16).float().numpy()
        # One bfloat16 ulp (2**-7 relative) covers a float32 order difference at a boundary.
        np.testing.assert_allclose(got_f32, want, rtol=2**-7, atol=1e-30)


def test_bfloat16_integer_sums_are_exact() -> None:
    world = 5
    rng = np.random.default_rng(0)
    values = [rng.integers(-50, 50, 333).astype(np.float32) for _ in range(world)]
    results = allreduce_all([codec.float32_to_bfloat16(v) for v in values], bfloat16=True)
    want = np.sum(np.stack(values), axis=0)
    for got in results:
        np.testing.assert_array_equal(codec.bfloat16_to_float32(got), want)


# -- all-reduce: the pipeline --------------------------------------------------------------


class RecordingPeer:
    """Wraps a LocalPeer and logs every send and receive in order."""

    def __init__(self, inner: LocalPeer, log: list[tuple[int, str, Tag]], lock: threading.Lock):
        self._inner, self._log, self._lock = inner, log, lock
        self.rank, self.world_size, self.left = inner.rank, inner.world_size, inner.left

    def send_to_right(self, tag: Tag, array: np.ndarray) -> None:
        with self._lock:
            self._log.append((self.rank, "send", tag))
        self._inner.send_to_right(tag, array)

    def recv_from_left(self, tag: Tag, timeout: float) -> np.ndarray:
        got = self._inner.recv_from_left(tag, timeout)
        with self._lock:
            self._log.append((self.rank, "recv", tag))
        return got


def test_each_chunk_is_passed_on_as_soon_as_it_is_reduced() -> None:
    world, chunks_per_segment = 3, 4
    log: list[tuple[int, str, Tag]] = []
    lock = threading.Lock()
    length = world * chunks_per_segment * 2  # 2 float32 per 8-byte chunk

    def body(peer: LocalPeer) -> np.ndarray:
        buffer = np.ones(length, np.float32)
        return ring.allreduce(RecordingPeer(peer, log, lock), buffer, chunk_bytes=8)

    results = run_local(world, body)
    assert all(np.all(r == world) for r in results)
    events = [(kind, tag) for rank, kind, tag in log if rank == 0]
    # Rank 0 forwards chunk k of step 0 (as step 1) before it has received chunk k+1 of step
    # 0: sending one chunk overlaps reducing the next, rather than segment after segment.
    first_forward = events.index(("send", Tag(1, (0 - 1) % world, 0)))
    last_step0_recv = max(
        i for i, (kind, tag) in enumerate(events) if kind == "recv" and tag.step == 0
    )
    assert first_forward < last_step0_recv
    # And the all-gather of the first finished chunk starts before reduce-scatter has ended.
    first_gather = min(
        i for i, (kind, tag) in enumerate(events) if kind == "send" and tag.step == world - 1
    )
    last_scatter_recv = max(
        i for i, (kind, tag) in enumerate(events) if kind == "recv" and tag.step == world - 2
    )
    assert first_gather < last_scatter_recv
    sends = sum(1 for kind, _ in events if kind == "send")
    assert sends == 2 * (world - 1) * chunks_per_segment  # every segment chunk, each step


def test_segments_cover_the_buffer_and_differ_by_at_most_one() -> None:
    for length in [0, 1, 5, 8, 9, 1001]:
        for world in range(1, 9):
            bounds = ring.segment_bounds(length, world)
            sizes = np.diff(bounds)
            assert bounds[0] == 0 and bounds[-1] == length and len(sizes) == world
            assert sizes.min() >= 0 and sizes.max() - sizes.min() <= 1


# -- all-reduce: misuse and failures ------------------------------------------------------


def test_ranks_with_different_lengths_get_a_clear_error() -> None:
    xs = [np.ones(10, np.float32), np.ones(12, np.float32)]
    with pytest.raises(InvalidRequestError, match="same length and dtype"):
        allreduce_all(xs, chunk_bytes=1024)


def test_unsupported_or_unwritable_buffers_are_refused() -> None:
    (peer,) = local_peers(1)
    with pytest.raises(InvalidRequestError, match="int32"):
        ring.allreduce(peer, np.ones(4, np.int32))
    with pytest.raises(InvalidRequestError, match="uint16"):
        ring.allreduce(peer, np.ones(4, np.float32), bfloat16=True)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        ring.allreduce(peer, np.ones((4, 4), np.float32)[:, 0])
    frozen = np.ones(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ring.allreduce(peer, frozen)


def test_a_silent_neighbour_times_out_naming_it() -> None:
    peers = local_peers(3)
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        try:
            ring.allreduce(peers[rank], np.ones(30, np.float32), timeout=0.3)
        except PSError as exc:
            errors[rank] = exc

    # Rank 2 never joins: rank 0, its right neighbour, waits for it in vain.
    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert time.monotonic() - t0 < 5
    assert isinstance(errors[0], WaitTimeoutError)
    assert "no data from rank 2" in str(errors[0])
    assert isinstance(errors[1], WaitTimeoutError)  # rank 1 starves behind rank 0


def test_run_local_reports_the_first_failure() -> None:
    def body(peer: LocalPeer) -> np.ndarray:
        if peer.rank == 1:
            raise ShapeMismatchError("rank 1 is broken")
        return ring.allreduce(peer, np.ones(8, np.float32), timeout=5)

    t0 = time.monotonic()
    with pytest.raises(ShapeMismatchError, match="rank 1 is broken"):
        run_local(3, body)
    assert time.monotonic() - t0 < 4  # the others were failed, not left to time out


# -- broadcast -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 8),
    length=st.integers(0, 100),
    chunk_bytes=st.integers(1, 64),
    dtype=st.sampled_from(["float32", "float16", "int64", "bool", "uint16"]),
    data=st.data(),
)
def test_broadcast_copies_root_bytes_everywhere(
    world: int, length: int, chunk_bytes: int, dtype: str, data: st.DataObject
) -> None:
    root = data.draw(st.integers(0, world - 1), label="root")
    rng = np.random.default_rng(length)
    source = (
        rng.integers(0, 2, length).astype(dtype)
        if dtype == "bool"
        else (rng.standard_normal(length) * 100).astype(dtype)
    )

    def body(peer: LocalPeer) -> np.ndarray:
        mine = source.copy() if peer.rank == root else np.zeros(length, dtype)
        return ring.broadcast(peer, mine, root, timeout=TIMEOUT, chunk_bytes=chunk_bytes)

    for got in run_local(world, body):
        assert got.dtype == source.dtype and got.tobytes() == source.tobytes()


def test_broadcast_rejects_a_bad_root() -> None:
    (peer,) = local_peers(1)
    with pytest.raises(ValueError, match="root"):
        ring.broadcast(peer, np.ones(3), root=1)


# -- mailbox -------------------------------------------------------------------------------


def test_mailbox_is_fifo_per_key_and_times_out_with_none() -> None:
    box = Mailbox()
    box.put("a", np.array([1]))
    box.put("a", np.array([2]))
    assert box.get("a", 0.1)[0] == 1  # type: ignore[index]
    assert box.get("a", 0.1)[0] == 2  # type: ignore[index]
    t0 = time.monotonic()
    assert box.get("a", 0.05) is None
    assert time.monotonic() - t0 >= 0.05
    assert len(box) == 0


def test_mailbox_keeps_the_weightiest_failure_and_wakes_waiters() -> None:
    box = Mailbox()
    seen: list[BaseException] = []

    def wait() -> None:
        try:
            box.get("never", 10)
        except PSError as exc:
            seen.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    weak = Failure(WaitTimeoutError("weak"), 0, 1, "weak")
    strong = Failure(WaitTimeoutError("strong"), 2, 2, "strong")
    assert box.fail(weak)
    waiter.join(5)
    assert [str(e) for e in seen] == ["weak"]
    assert box.fail(strong)
    assert not box.fail(Failure(WaitTimeoutError("late"), 2, 3, "late"))  # ties: first wins
    assert not box.fail(weak)
    assert box.failure is strong
    assert box.wait_failure(2, 0.01) is None
    assert box.wait_failure(1, 0.01) is strong
    with pytest.raises(WaitTimeoutError, match="strong"):
        box.get("x", 1)


# -- buckets -------------------------------------------------------------------------------


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {
        "fc1.weight": ((64, 32), "float32"),
        "fc1.bias": ((32,), "float32"),
        "fc2.weight": ((32, 10), "float32"),
        "fc2.bias": ((10,), "float32"),
        "emb": ((100, 8), "float16"),
        "scale": ((), "float64"),
        "empty": ((0, 3), "float32"),
    }
    return {n: rng.standard_normal(s).astype(d) for n, (s, d) in shapes.items()}


@settings(max_examples=50, deadline=None)
@given(order=st.permutations(sorted(model())), bucket_bytes=st.integers(1, 20000))
def test_bucket_plan_ignores_dict_order_and_respects_the_cap(
    order: list[str], bucket_bytes: int
) -> None:
    tensors = model()
    shuffled = {name: tensors[name] for name in order}
    plan = BucketPlan.for_arrays(shuffled, bucket_bytes)
    assert plan == BucketPlan.for_arrays(tensors, bucket_bytes)
    assert sorted(plan.names) == sorted(tensors)
    for bucket in plan.buckets:
        assert len({tensors[s.name].dtype for s in bucket.slots}) == 1
        # Over the cap only when one tensor alone is larger (empty ones cost nothing).
        assert bucket.nbytes <= bucket_bytes or sum(s.size > 0 for s in bucket.slots) == 1
        offsets = [s.offset for s in bucket.slots]
        assert offsets == sorted(offsets) and sum(s.size for s in bucket.slots) == bucket.size


def test_default_plan_packs_a_small_model_into_one_bucket_per_dtype() -> None:
    plan = BucketPlan.for_arrays(model())
    assert buckets.DEFAULT_BUCKET_BYTES == 25 << 20
    assert sorted(b.dtype.name for b in plan.buckets) == ["float16", "float32", "float64"]


def test_flatten_then_unflatten_round_trips() -> None:
    tensors = model()
    plan = BucketPlan.for_arrays(tensors, bucket_bytes=3000)
    assert len(plan.buckets) > 3
    back = plan.unflatten(plan.flatten(tensors))
    assert sorted(back) == sorted(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        np.testing.assert_array_equal(back[name], tensor)


def test_bucketed_allreduce_equals_per_tensor_sums() -> None:
    world = 3
    per_rank = [model(seed) for seed in range(world)]
    plan = BucketPlan.for_arrays(per_rank[0], bucket_bytes=4096)

    def body(peer: LocalPeer) -> np.ndarray:
        buffers = plan.flatten(per_rank[peer.rank])
        for buffer in buffers:
            ring.allreduce(peer, buffer, timeout=TIMEOUT, chunk_bytes=256)
        summed = plan.unflatten(buffers)
        return np.concatenate([summed[n].reshape(-1).astype(np.float64) for n in sorted(summed)])

    want = {
        n: np.sum(np.stack([m[n].astype(np.float32) for m in per_rank]), axis=0)
        for n in per_rank[0]
    }
    flat_want = np.concatenate([want[n].reshape(-1).astype(np.float64) for n in sorted(want)])
    for got in run_local(world, body):
        np.testing.assert_allclose(got, flat_want, rtol=2e-3, atol=1e-2)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda t: t.pop("fc1.bias"), UnknownVariableError, "fc1.bias"),
        (lambda t: t.update(extra=np.ones(2, np.float32)), UnknownVariableError, "extra"),
        (lambda t: t.update(scale=np.ones(2)), ShapeMismatchError, "scale"),
        (lambda t: t.update(emb=np.ones((100, 8), np.float32)), InvalidRequestError, "emb"),
    ],
)
def test_flatten_names_the_tensor_that_does_not_fit(
    change: Callable[[dict[str, np.ndarray]], object], error: type[Exception], match: str
) -> None:
    tensors = model()
    plan = BucketPlan.for_arrays(tensors)
    change(tensors)
    with pytest.raises(error, match=match):
        plan.flatten(tensors)


def test_unflatten_checks_the_buffers() -> None:
    plan = BucketPlan.for_arrays(model())
    buffers = plan.flatten(model())
    with pytest.raises(InvalidRequestError, match="buffers"):
        plan.unflatten(buffers[:-1])
    buffers[0] = buffers[0][:-1]
    with pytest.raises(InvalidRequestError, match="bucket 0"):
        plan.unflatten(buffers)


# -- the mean in the ring, and buckets reused across steps ------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 6),
    length=st.integers(0, 200),
    chunk_bytes=st.integers(1, 100),
    dtype=st.sampled_from(["float32", "float64"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_divisor_gives_the_sum_divided_afterwards_bit_for_bit(
    world: int, length: int, chunk_bytes: int, dtype: str, seed: int
) -> None:
    xs = inputs(world, length, dtype, seed)
    sums = allreduce_all(xs, chunk_bytes)
    means = allreduce_all(xs, chunk_bytes, divisor=world)
    assert_identical_on_all_ranks(means)
    expected = (sums[0] / np.dtype(dtype).type(world)).astype(dtype)
    assert means[0].tobytes() == expected.tobytes()


def test_a_divisor_below_one_is_refused() -> None:
    (peer,) = local_peers(1)
    with pytest.raises(ValueError, match="divisor must be >= 1, got 0"):
        ring.allreduce(peer, np.ones(3), divisor=0)


def test_flatten_into_given_buffers_reuses_them() -> None:
    tensors = model()
    plan = BucketPlan.for_arrays(tensors, bucket_bytes=3000)
    out = plan.empty()
    got = plan.flatten(tensors, out=out)
    assert all(g is o for g, o in zip(got, out, strict=True))
    back = plan.unflatten(got)
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(back[name], tensor)
    with pytest.raises(InvalidRequestError, match="bucket 0"):
        plan.flatten(tensors, out=[out[0][:-1], *out[1:]])


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
def test_a_source_is_summed_out_of_place_bit_for_bit_and_left_unchanged(
    world: int, dtype: str
) -> None:
    bf16 = dtype == "bfloat16"
    xs = inputs(world, 103, "float32" if bf16 else dtype, world)
    if bf16:
        xs = [codec.float32_to_bfloat16(x) for x in xs]
    kept = [x.copy() for x in xs]
    in_place = allreduce_all(xs, 16, bfloat16=bf16, divisor=world)

    def body(peer: LocalPeer) -> np.ndarray:
        out = np.full_like(xs[peer.rank], 7)  # garbage: every element must be written
        return ring.allreduce(
            peer,
            out,
            timeout=TIMEOUT,
            chunk_bytes=16,
            bfloat16=bf16,
            divisor=world,
            source=xs[peer.rank],
        )

    out_of_place = run_local(world, body, copy=False)
    assert_identical_on_all_ranks(out_of_place)
    assert out_of_place[0].tobytes() == in_place[0].tobytes()
    for x, k in zip(xs, kept, strict=True):
        assert x.tobytes() == k.tobytes()


def test_a_source_of_another_size_is_refused() -> None:
    (peer,) = local_peers(1)
    with pytest.raises(ValueError, match="must match"):
        ring.allreduce(peer, np.ones(3), source=np.ones(4))


def test_flatten_with_sources_views_a_lone_tensor_instead_of_copying() -> None:
    tensors = {
        "big": np.arange(1000, dtype=np.float32).reshape(10, 100),
        "a": np.ones(3, np.float32),
    }
    plan = BucketPlan.for_arrays(tensors, bucket_bytes=1000)
    got = plan.flatten(tensors, out=plan.empty(), sources=True)
    lone = [g for g in got if g.size == 1000]
    assert len(lone) == 1 and np.shares_memory(lone[0], tensors["big"])
    np.testing.assert_array_equal(plan.unflatten(plan.flatten(tensors))["big"], tensors["big"])


# -- several buffers in one collective ---------------------------------------------------------


def _parts_for(rank: int, world: int, seed: int) -> list[ring.Part]:
    """Every kind of part: float16, bfloat16, float32 (out of place), float64, an empty one,
    and a divisor on some."""
    rng = np.random.default_rng(seed * 100 + rank)
    f32 = rng.standard_normal(37).astype(np.float32)
    return [
        ring.Part(rng.standard_normal(29).astype(np.float16), chunk_bytes=12),
        ring.Part(
            codec.float32_to_bfloat16(rng.standard_normal(41).astype(np.float32)),
            bfloat16=True,
            divisor=world,
            chunk_bytes=20,
        ),
        ring.Part(np.full_like(f32, 7), divisor=world, source=f32, chunk_bytes=16),
        ring.Part(np.zeros(0, np.float32)),
        ring.Part(rng.standard_normal(53), divisor=3, chunk_bytes=40),
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_allreduce_many_equals_each_buffer_summed_alone_bit_for_bit(world: int) -> None:
    def alone(peer: LocalPeer) -> list[np.ndarray]:
        out = []
        for p in _parts_for(peer.rank, world, world):
            out.append(
                ring.allreduce(
                    peer,
                    p.buffer,
                    timeout=TIMEOUT,
                    chunk_bytes=p.chunk_bytes,
                    bfloat16=p.bfloat16,
                    divisor=p.divisor,
                    source=p.source,
                )
            )
        return out

    def together(peer: LocalPeer) -> list[np.ndarray]:
        return ring.allreduce_many(peer, _parts_for(peer.rank, world, world), timeout=TIMEOUT)

    def in_turns(peer: LocalPeer) -> list[np.ndarray]:
        # The same collective run a part or two at a time, as overlap does.
        parts = _parts_for(peer.rank, world, world)
        out = ring.allreduce_many(peer, parts[:2], timeout=TIMEOUT)
        out += ring.allreduce_many(peer, parts[2:3], timeout=TIMEOUT, first=2)
        return out + ring.allreduce_many(peer, parts[3:], timeout=TIMEOUT, first=3)

    expected = run_local(world, alone)  # type: ignore[arg-type]
    for body in (together, in_turns):
        got = run_local(world, body, copy=False)  # type: ignore[arg-type]
        for rank in range(world):
            for a, b in zip(expected[rank], got[rank], strict=True):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_allreduce_many_checks_every_part_before_it_sends_anything() -> None:
    log: list[tuple[int, str, Tag]] = []
    lock = threading.Lock()
    (peer, _) = local_peers(2)
    good = ring.Part(np.ones(8, np.float32))
    for bad, message in [
        (ring.Part(np.ones(8, np.int32)), "float16, bfloat16, float32 or float64"),
        (ring.Part(np.ones(8), divisor=0), "divisor must be >= 1"),
        (ring.Part(np.ones(8), source=np.ones(9)), "must match"),
        (ring.Part(np.ones(8), chunk_bytes=0), "chunk_bytes must be >= 1"),
    ]:
        with pytest.raises((ValueError, InvalidRequestError), match=message):
            ring.allreduce_many(RecordingPeer(peer, log, lock), [good, bad])  # type: ignore[arg-type]
    assert log == []


def test_allreduce_many_tags_each_part_apart() -> None:
    log: list[tuple[int, str, Tag]] = []
    lock = threading.Lock()
    world = 3

    def body(peer: LocalPeer) -> list[np.ndarray]:
        parts = [ring.Part(np.ones(6, np.float32)), ring.Part(np.ones(3, np.float64))]
        return ring.allreduce_many(RecordingPeer(peer, log, lock), parts, first=4)  # type: ignore[arg-type]

    results = run_local(world, body)  # type: ignore[arg-type]
    assert all(np.all(a == world) for r in results for a in r)
    segments = {tag.segment for _, kind, tag in log if kind == "send"}
    # Part first+i tags segment s as (first + i) * world + s.
    assert segments == {4 * world + s for s in range(world)} | {5 * world + s for s in range(world)}


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_measured_part_reports_the_results_sum_of_squares_alike_on_every_rank(
    world: int, dtype: str
) -> None:
    xs = inputs(world, 1000, dtype, world)
    if world == 3:
        xs[0][7] = np.inf

    def body(peer: LocalPeer) -> list[float]:
        measure: list[float] = []
        part = ring.Part(xs[peer.rank].copy(), divisor=world, chunk_bytes=200, measure=measure)
        (result,) = ring.allreduce_many(peer, [part], timeout=TIMEOUT)
        return [*measure, float(np.dot(result.astype(np.float64), result))]

    got = run_local(world, body)  # type: ignore[arg-type]
    assert all(len(g) == 2 for g in got)
    assert len({g[0] for g in got}) == 1  # the same bits on every rank
    if world == 3:
        assert np.isinf(got[0][0])  # an inf in the result: not finite
    else:
        assert got[0][0] == pytest.approx(got[0][1], rel=1e-5)


def test_measure_is_refused_for_16_bit_parts() -> None:
    (peer,) = local_peers(1)
    with pytest.raises(ValueError, match="measure sums float32 or float64"):
        ring.allreduce_many(peer, [ring.Part(np.ones(4, np.float16), measure=[])])
