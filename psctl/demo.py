"""The built-in demo worker: a small CNN learns scikit-learn's handwritten digits via the SDK."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import psworker
from psctl import demo_results
from psctl.progress import Reporter
from psworker.torch import DistributedOptimizer

DEFAULT_OUT = "out/demo"
TENSORBOARD_DIR = "tensorboard"  # under --out: one folder of event files per worker
DEFAULT_EPOCHS = 8
BATCH_SIZE = 32
HELD_OUT_FRACTION = 0.2


class DigitsCNN(nn.Module):
    """Three 3x3 conv layers and a linear classifier for 1x8x8 images (~15k parameters)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 4x4 -> 2x2
        )
        self.classifier = nn.Linear(32 * 2 * 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The digits (1797 8x8 images shipped inside scikit-learn) as (train, held-out).

    The split is stratified by class and fixed by ``seed``, so every worker builds the same
    sets; pixels are standardised with the training set's mean and standard deviation.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.float32)[:, None]  # (N, 1, 8, 8), values 0..16
    labels = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=HELD_OUT_FRACTION, stratify=labels, random_state=seed
    )
    mean, std = float(x_train.mean()), float(x_train.std())

    def dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy((x - mean) / std), torch.from_numpy(y))

    return dataset(x_train, y_train), dataset(x_test, y_test)


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset) -> float:
    """Fraction of ``data`` that ``model`` classifies correctly."""
    model.eval()
    x, y = data.tensors
    correct = (model(x).argmax(dim=1) == y).sum().item()
    model.train()
    return correct / len(y)


def summary_writer(out: Path, worker_id: int) -> Any:
    """A TensorBoard writer into ``out/tensorboard/worker<id>`` (this worker's earlier event
    files removed), or None when the ``tensorboard`` package is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    folder = out / TENSORBOARD_DIR / f"worker{worker_id}"
    for old in folder.glob("events.out.tfevents.*"):
        old.unlink()
    return SummaryWriter(log_dir=str(folder))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m psctl.demo",
        description="Train the digits CNN as one worker of the job in $TF_CONFIG/$PS_MODE "
        "(run it with `psctl demo`; alone it trains in mode local).",
    )
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="passes over the data")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="samples per step")
    parser.add_argument("--lr", type=float, default=0.02, help="SGD learning rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--seed", type=int, default=0, help="split, init and shuffle seed")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder [default %(default)s]")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Trains this worker's shard of the digits; worker 0 evaluates and saves. Returns 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be >= 1")
    # Workers share the machine's cores; one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = load_data(args.seed)
    loader = DataLoader(train, batch_size=args.batch_size)
    model = DigitsCNN()
    loss_fn = nn.CrossEntropyLoss()

    with psworker.connect() as client:  # cluster and mode from $TF_CONFIG / $PS_MODE
        writer = summary_writer(out, client.worker_id)
        opt = DistributedOptimizer(
            model, client, psworker.SGD(lr=args.lr, momentum=args.momentum), writer=writer
        )
        batches = psworker.shard(loader, client, seed=args.seed)
        wid, n = client.worker_id, client.num_workers
        total = args.epochs * len(batches)
        print(
            f"worker {wid}/{n}: mode {client.mode}, {len(batches)} batches of "
            f"{args.batch_size} per epoch, {args.epochs} epochs",
            flush=True,
        )
        progress = Reporter(wid, total)
        losses: list[float] = []
        samples = 0
        start = time.perf_counter()
        for _ in batches.epochs(args.epochs):  # an elastic job's joiner: the epochs left
            for x, y in batches:
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                opt.report(loss=losses[-1])  # TensorBoard, and psctl dashboard's loss chart
                samples += len(y)
                progress.update(len(losses), losses[-1], samples)
        wall = time.perf_counter() - start
        if writer is not None:
            writer.close()

    demo_results.write_losses(out, wid, client.mode, losses, wall)
    print(f"worker {wid} done: {samples} samples in {wall:.2f}s", flush=True)
    if wid != 0:
        return 0
    acc = accuracy(model, held_out)
    # shard() gives every worker the same number of samples, so the job saw n times ours.
    job_samples = n * samples
    torch.save(model.state_dict(), out / demo_results.MODEL_FILE)
    metrics = {
        "accuracy": acc,
        "held_out": len(held_out),
        "wall_s": wall,
        "samples": job_samples,
        "samples_per_s": job_samples / wall,
        "workers": n,
        "mode": client.mode,
        "epochs": args.epochs,
        "steps_per_worker": len(losses),
    }
    (out / demo_results.METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")
    print(
        f"held-out accuracy {acc:.4f} on {len(held_out)} samples; wall time {wall:.2f}s; "
        f"{job_samples / wall:.0f} samples/s over {n} workers",
        flush=True,
    )
    if n == 1:
        # Alone, this worker's history is the whole job's; with more, psctl plots after all end.
        demo_results.plot_losses(out, workers=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
