"""The built-in demo worker: numpy softmax regression trained through the parameter servers."""

from __future__ import annotations

import argparse
import time

import numpy as np

import psworker

SAMPLES, FEATURES, CLASSES, HELD_OUT = 4000, 20, 3, 800


def make_dataset(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The same labelled points on every worker: labels from a random linear teacher."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    # A little noise on the teacher's scores keeps the classes from being perfectly separable.
    y = np.argmax(x @ teacher + 0.1 * rng.standard_normal((SAMPLES, CLASSES)), axis=1)
    return x, y


def loss_and_grads(
    weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean cross-entropy of softmax(x @ w + b) and its gradients."""
    logits = x @ weights["w"] + weights["b"]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = float(-np.log(p[rows, y] + 1e-12).mean())
    p[rows, y] -= 1.0
    p /= len(y)
    return loss, {"w": (x.T @ p).astype(np.float32), "b": p.sum(axis=0).astype(np.float32)}


def accuracy(weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(x @ weights["w"] + weights["b"], axis=1) == y))


def main(argv: list[str] | None = None) -> int:
    """Trains this worker's slice; worker 0 reports held-out accuracy. Returns 0."""
    parser = argparse.ArgumentParser(prog="python -m psworker.demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=100, help="steps per worker")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per worker step")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (same on all workers)")
    parser.add_argument("--log-every", type=int, default=20, help="steps between loss lines")
    args = parser.parse_args(argv)

    x, y = make_dataset(args.seed)
    x_train, y_train = x[:-HELD_OUT], y[:-HELD_OUT]
    x_test, y_test = x[-HELD_OUT:], y[-HELD_OUT:]
    with psworker.connect() as client:  # cluster, mode and staleness from the environment
        wid, n = client.worker_id, client.num_workers
        mine = np.array_split(np.arange(len(x_train)), n)[wid]
        rng = np.random.default_rng(args.seed + 1 + wid)
        initial = {
            "w": np.zeros((FEATURES, CLASSES), np.float32),
            "b": np.zeros(CLASSES, np.float32),
        }
        client.init(initial, psworker.SGD(lr=args.lr, momentum=0.9))
        print(
            f"worker {wid}/{n}: mode {client.mode}, {len(mine)} of {len(x_train)} training "
            f"samples, {len(client.addresses)} shards",
            flush=True,
        )
        start = time.perf_counter()
        for step in range(args.steps):
            batch = rng.choice(mine, size=args.batch_size, replace=False)
            weights = client.pull()
            loss, grads = loss_and_grads(weights, x_train[batch], y_train[batch])
            client.push(grads)
            if step % args.log_every == 0 or step == args.steps - 1:
                print(f"worker {wid} step {step} loss {loss:.4f}", flush=True)
        wall = time.perf_counter() - start
        samples = args.steps * args.batch_size
        print(
            f"worker {wid} done: {samples} samples in {wall:.2f}s, {samples / wall:.0f} samples/s",
            flush=True,
        )
        if wid == 0:
            final = client.pull()
            acc = accuracy(final, x_test, y_test)
            print(
                f"held-out accuracy {acc:.4f} on {len(y_test)} samples; wall time {wall:.2f}s; "
                f"~{n * samples / wall:.0f} samples/s over {n} workers",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
