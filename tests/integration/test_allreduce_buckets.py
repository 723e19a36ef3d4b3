"""Mode allreduce's step over real rings: the gradients travel in a fixed plan of buckets (the
reverse of init's order), sent all at once or bucket by bucket from backward (start_bucket)
with the same bits; misuse is an error on every rank, never a hang or a different step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import psworker
from pscore import job as job_module
from pswire.errors import (
    ClientClosedError,
    ConfigError,
    HyperParameterMismatchError,
    InvalidRequestError,
    PSError,
    WaitTimeoutError,
)
from psworker.ring.client import AllReduceClient
from psworker.ring.ring import RingServer

SHAPES = {"a.w": (40, 3), "a.b": (40,), "b.w": (3, 50), "b.b": (3,), "c.w": (64,)}
STEPS = 4


def on_ranks(
    world: int, body: Callable[[int, AllReduceClient], Any], timeout: float = 20
) -> tuple[dict[int, Any], dict[int, BaseException]]:
    """``body(rank, client)`` on ``world`` ranks (one thread each, real Flight rings)."""
    servers = [RingServer("127.0.0.1:0") for _ in range(world)]
    peers = [s.address for s in servers]
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        try:
            client = AllReduceClient(
                rank, peers, server=servers[rank], timeout=timeout, bucket_bytes=700
            )
            with client:
                results[rank] = body(rank, client)
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results, errors


def start(client: AllReduceClient, shapes: dict[str, tuple[int, ...]] = SHAPES) -> None:
    rng = np.random.default_rng(0)
    values = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    optimizers = [psworker.SGD(lr=0.1, momentum=0.9), psworker.Adam(lr=0.01)]
    groups = {n: int(n.startswith("b")) for n in shapes}
    client.init(values, optimizers, groups=groups)


def grads_of(rank: int, step: int) -> dict[str, np.ndarray]:
    """Rank- and step-dependent gradients; "b.b" has none on rank 1 at odd steps."""
    rng = np.random.default_rng(1000 * rank + step)
    out = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    if rank == 1 and step % 2:
        del out["b.b"]
    return out


def train(mode: str) -> Callable[[int, AllReduceClient], dict[str, np.ndarray]]:
    """Trains STEPS steps: "serial" (push alone), "turns" (push in turns, nothing started),
    "overlap" (every bucket started before push, as backward's hooks do), "some" (only the
    first bucket started)."""

    def body(rank: int, client: AllReduceClient) -> dict[str, np.ndarray]:
        start(client)
        if mode != "serial":
            client.reduce_in_turns()
        for step in range(STEPS):
            grads = grads_of(rank, step)
            buckets = client.gradient_buckets()
            count = {"serial": 0, "turns": 0, "overlap": len(buckets), "some": 1}[mode]
            for index in range(count):
                client.start_bucket(index, {n: grads[n] for n in buckets[index] if n in grads})
            client.push(grads)
        return client.pull()

    return body


def test_the_plan_is_the_reverse_of_inits_order_in_capped_buckets():
    results, errors = on_ranks(1, lambda r, c: (start(c), c.gradient_buckets())[1])
    assert not errors
    # 700 bytes: c.w (256 B) and b.b (12 B) fit; b.w (600 B) does not; a.b and a.w (640 B).
    assert results[0] == [["c.w", "b.b"], ["b.w"], ["a.b", "a.w"]]


@pytest.mark.parametrize("world", [2, 3])
def test_buckets_sent_from_backward_give_the_same_bits_as_one_push(world):
    serial, errors = on_ranks(world, train("serial"))
    assert not errors
    for mode in ("turns", "overlap", "some"):
        got, errors = on_ranks(world, train(mode))
        assert not errors, errors
        for rank in range(world):
            for name, value in serial[rank].items():
                assert got[rank][name].tobytes() == value.tobytes(), (mode, rank, name)
    for rank in range(1, world):
        for name, value in serial[0].items():
            assert serial[rank][name].tobytes() == value.tobytes()
    assert not np.array_equal(serial[0]["a.w"], got[0]["a.w"] * 0)  # it trained


def test_buckets_start_in_order_and_only_in_turns():
    def body(rank: int, client: AllReduceClient) -> None:
        start(client)
        grads = grads_of(rank, 0)
        with pytest.raises(ConfigError, match="in turns"):
            client.start_bucket(0, grads)
        client.reduce_in_turns()
        with pytest.raises(ConfigError, match="bucket 1 started while bucket 0 is the next"):
            client.start_bucket(1, grads)

    _, errors = on_ranks(2, body)
    assert not errors


def test_a_gradient_that_appears_after_its_bucket_left_fails_every_rank_at_once():
    def body(rank: int, client: AllReduceClient) -> None:
        start(client)
        client.reduce_in_turns()
        grads = grads_of(rank, 0)
        first = client.gradient_buckets()[0]
        sent = {n: grads[n] for n in first if n != "b.b" or rank != 0}
        client.start_bucket(0, sent)
        client.push(grads)  # rank 0 now has b.b, which its bucket carried as zeros

    _, errors = on_ranks(3, body, timeout=60)
    assert isinstance(errors[0], ConfigError)
    assert "['b.b'] appeared or went after their bucket (bucket 0) left" in str(errors[0])
    # The others learn it from rank 0's abort (rank 2 perhaps from rank 0's port closing
    # first), not by waiting out their 60 s timeout.
    assert isinstance(errors[1], PSError) and "appeared or went" in str(errors[1])
    assert isinstance(errors[2], PSError) and not isinstance(errors[2], WaitTimeoutError)


def test_ranks_that_list_the_variables_in_another_order_are_told_before_applying():
    def body(rank: int, client: AllReduceClient) -> dict[str, np.ndarray]:
        shapes = {"x": (8,), "y": (8,)} if rank == 0 else {"y": (8,), "x": (8,)}
        client.init({n: np.ones(s, np.float32) for n, s in shapes.items()}, psworker.SGD(lr=0.1))
        client.push({"x": np.ones(8, np.float32), "y": np.ones(8, np.float32)})
        return client.pull()

    _, errors = on_ranks(2, body)
    for rank in (0, 1):
        assert isinstance(errors[rank], HyperParameterMismatchError)
        assert "gradient buckets (init's order of the variables)" in str(errors[rank])


def test_a_nan_gradient_is_refused_on_every_rank_before_anything_changes():
    def body(rank: int, client: AllReduceClient) -> dict[str, np.ndarray]:
        start(client)
        before = client.pull()
        grads = grads_of(rank, 0)
        if rank == 1:
            grads["b.w"][1, 2] = np.nan  # a lone tensor in its bucket: measured by the ring
        with pytest.raises(InvalidRequestError, match=r"'b\.w': gradient has 1 non-finite"):
            client.push(grads)
        after = client.pull()
        assert all(np.array_equal(before[n], after[n]) for n in before)
        return after

    _, errors = on_ranks(2, body)
    assert not errors, errors


def test_the_step_trusts_the_rings_measure_of_a_lone_mean(monkeypatch):
    seen: list[tuple[str, bool]] = []
    real = job_module.check_tensor

    def spy(name: str, *args: Any) -> float | None:
        seen.append((name, args[-1]))
        return real(name, *args)

    monkeypatch.setattr(job_module, "check_tensor", spy)
    _, errors = on_ranks(1, train("serial"))
    assert not errors
    # b.w is alone in its bucket: the ring measured it; c.w shares one: the checks measure it.
    assert set(seen) >= {("b.w", True), ("c.w", False)}
    assert ("b.w", False) not in seen


def test_a_closed_client_refuses_buckets():
    def body(rank: int, client: AllReduceClient) -> None:
        start(client)
        client.reduce_in_turns()
        client.close()
        with pytest.raises(ClientClosedError):
            client.start_bucket(0, grads_of(rank, 0))
        with pytest.raises(ClientClosedError):
            client.push(grads_of(rank, 0))

    _, errors = on_ranks(1, body)
    assert not errors, errors
