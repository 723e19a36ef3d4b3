"""Training through real gRPC shards: sync matches one process, ssp is bounded, async converges."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from workers import run_workers

import psworker
from pscore.optim import SGD, Adam, Optimizer

FEATURES, CLASSES = 12, 3


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    true_w = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    y = np.argmax(x @ true_w + 0.1 * rng.standard_normal((n, CLASSES)), axis=1)
    return x, y


def init_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(42)
    return {
        "w": (0.1 * rng.standard_normal((FEATURES, CLASSES))).astype(np.float32),
        "b": np.zeros(CLASSES, np.float32),
    }


def softmax_grads(
    weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
) -> tuple[dict[str, np.ndarray], float]:
    logits = x @ weights["w"] + weights["b"]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    p[np.arange(len(y)), y] -= 1
    p /= len(y)
    return {"w": (x.T @ p).astype(np.float32), "b": p.sum(axis=0).astype(np.float32)}, loss


@pytest.mark.parametrize("optimizer", [SGD(lr=0.5, momentum=0.9), Adam(lr=0.05)])
def test_sync_three_workers_equals_single_process_on_combined_batch(shards, optimizer: Optimizer):
    workers, batch, steps = 3, 16, 50
    servers = shards(2)
    addrs = [s.address for s in servers]
    x, y = make_data(workers * batch * steps)
    results: dict[int, dict[str, np.ndarray]] = {}

    def worker(i: int) -> None:
        # split_bytes=64 forces "w" to be cut across both shards: the split path is exercised.
        with psworker.connect(
            addrs, worker_id=i, num_workers=workers, mode="sync", split_bytes=64, timeout=30
        ) as client:
            client.init(init_weights(), optimizer)
            for t in range(steps):
                lo = (t * workers + i) * batch
                grads, _ = softmax_grads(client.pull(), x[lo : lo + batch], y[lo : lo + batch])
                client.push(grads)
            results[i] = client.pull()

    run_workers([lambda i=i: worker(i) for i in range(workers)])

    ref = init_weights()
    slots = {k: optimizer.make_state(v) for k, v in ref.items()}
    for t in range(steps):
        lo = t * workers * batch
        grads, _ = softmax_grads(ref, x[lo : lo + workers * batch], y[lo : lo + workers * batch])
        for k in ref:
            optimizer.apply(ref[k], grads[k], slots[k])
    for i in range(workers):
        for k in ref:
            rel = np.abs(results[i][k] - ref[k]).max() / np.abs(ref[k]).max()
            assert rel < 1e-5, f"worker {i} variable {k}: relative error {rel}"
    assert servers[0].shard.status().clock == steps


def test_ssp_never_lets_a_worker_run_more_than_s_steps_ahead(shards):
    workers, staleness, steps = 3, 2, 25
    addrs = [s.address for s in shards(2)]
    x, y = make_data(2048)
    # Upper bound on each worker's finished steps: recorded *before* its push is sent, so a
    # reader that sees a value below c - s knows that worker truly had not finished c - s steps.
    finished_upper = [0] * workers
    lock = threading.Lock()
    leads: list[int] = []
    violations: list[str] = []
    delays = {0: 0.0, 1: 0.0, 2: 0.03}  # worker 2 is slow: injected delay per step

    def worker(i: int) -> None:
        with psworker.connect(
            addrs, worker_id=i, num_workers=workers, mode="ssp", staleness=staleness, timeout=30
        ) as client:
            client.init(init_weights(), SGD(lr=0.1))
            for c in range(steps):
                weights = client.pull()  # the gate: starting step c+1 having finished c
                with lock:
                    slowest = min(finished_upper)
                    leads.append(c - slowest)
                    if c - slowest > staleness:
                        violations.append(f"worker {i} started step {c} while min was {slowest}")
                time.sleep(delays[i])
                grads, _ = softmax_grads(weights, x[c * 8 : c * 8 + 8], y[c * 8 : c * 8 + 8])
                with lock:
                    finished_upper[i] = c + 1
                client.push(grads)

    run_workers([lambda i=i: worker(i) for i in range(workers)])
    assert not violations, violations[:5]
    # The fast workers did run ahead: this is bounded staleness, not lock-step.
    assert max(leads) >= 1


def test_async_converges_on_a_convex_problem(shards):
    workers, steps = 2, 120
    addrs = [s.address for s in shards(2)]
    x, y = make_data(4096, seed=1)
    losses: dict[int, list[float]] = {0: [], 1: []}

    def worker(i: int) -> None:
        rng = np.random.default_rng(i)
        with psworker.connect(addrs, worker_id=i, num_workers=workers, mode="async") as client:
            client.init(init_weights(), SGD(lr=0.5, momentum=0.5))
            for _ in range(steps):
                idx = rng.integers(0, len(x), 64)
                grads, _ = softmax_grads(client.pull(), x[idx], y[idx])
                client.push(grads)
            _, loss = softmax_grads(client.pull(), x, y)
            losses[i].append(loss)

    _, initial = softmax_grads(init_weights(), x, y)
    run_workers([lambda i=i: worker(i) for i in range(workers)])
    final = max(losses[0][-1], losses[1][-1])
    assert final < 0.5 * initial, (initial, final)
    assert final < 0.35


def test_sync_pull_times_out_naming_the_missing_worker(shards):
    (server,) = shards(1)
    with psworker.connect([server.address], worker_id=0, num_workers=2, timeout=2.0) as client:
        client.init(init_weights(), SGD(lr=0.1))
        client.push({k: np.zeros_like(v) for k, v in init_weights().items()})
        start = time.monotonic()
        with pytest.raises(psworker.WaitTimeoutError, match=r"waiting for workers \[1\]"):
            client.pull()
        assert time.monotonic() - start < 10


def test_duplicate_push_is_acknowledged_and_not_applied_again(shards):
    (server,) = shards(1)
    with psworker.connect([server.address], worker_id=0, num_workers=1, mode="async") as client:
        client.init(init_weights(), SGD(lr=1.0))
        ones = {k: np.ones_like(v) for k, v in init_weights().items()}
        assert client.push(ones, step=0) is True
        after_first = client.pull()
        assert client.push(ones, step=0) is False
        after_retry = client.pull()
    for k in after_first:
        np.testing.assert_array_equal(after_first[k], after_retry[k])
        np.testing.assert_allclose(after_first[k], init_weights()[k] - 1.0)
    assert server.shard.status().pushes_duplicate == 1
