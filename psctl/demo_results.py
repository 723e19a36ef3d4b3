"""The demo's output folder: per-worker histories and wall times, worker 0's metrics, the plot."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MODEL_FILE = "model.pt"
METRICS_FILE = "metrics.json"
PLOT_FILE = "loss.png"
_LOSS_PATTERN = "loss-worker{}.json"


def loss_file(out: Path, worker: int) -> Path:
    return out / _LOSS_PATTERN.format(worker)


def write_losses(
    out: Path, worker: int, mode: str, losses: list[float], wall_s: float | None = None
) -> Path:
    """Writes one worker's per-step training loss and training wall time; returns the path."""
    path = loss_file(out, worker)
    tmp = path.with_suffix(".tmp")
    record = {"worker": worker, "mode": mode, "loss": losses, "wall_s": wall_s}
    tmp.write_text(json.dumps(record) + "\n")
    # Renamed into place, so a reader never sees half a history.
    os.replace(tmp, path)
    return path


def clear(out: Path) -> None:
    """Removes a previous run's results, so none of them is mistaken for this run's."""
    for path in [out / MODEL_FILE, out / METRICS_FILE, out / PLOT_FILE, *out.glob("loss-worker*")]:
        path.unlink(missing_ok=True)


def read_metrics(out: Path) -> dict[str, Any]:
    """Worker 0's figures (accuracy, wall time, samples/s...).

    Raises:
        FileNotFoundError: worker 0 wrote none.
    """
    result: dict[str, Any] = json.loads((out / METRICS_FILE).read_text())
    return result


def read_walls(out: Path, workers: int) -> list[float]:
    """Each worker's training wall time, in worker order.

    Raises:
        FileNotFoundError: a worker's history is missing.
        KeyError, TypeError: a history without a wall time.
    """
    return [float(json.loads(loss_file(out, w).read_text())["wall_s"]) for w in range(workers)]


def summary(
    metrics: dict[str, Any], walls: list[float], servers: int, total_s: float, out: Path, plot: Path
) -> str:
    """psctl demo's closing lines. The job took as long as its slowest worker, so that
    worker's wall time is reported, and the throughput is over it (worker 0's own figures in
    ``metrics`` may be shorter)."""
    slowest = max(range(len(walls)), key=walls.__getitem__)
    who = f"worker {slowest}, the slowest; fastest {min(walls):.2f}s" if len(walls) > 1 else ""
    shards = f"{servers} shard(s), " if servers else ""
    return (
        f"demo finished: mode {metrics['mode']}, {shards}{metrics['workers']} worker(s), "
        f"{metrics['epochs']} epochs ({metrics['steps_per_worker']} steps per worker)\n"
        f"  held-out accuracy  {metrics['accuracy']:.4f} ({metrics['held_out']} images)\n"
        f"  training wall time {walls[slowest]:.2f}s{f' ({who})' if who else ''}; "
        f"{total_s:.2f}s in all, with start-up\n"
        f"  throughput         {metrics['samples'] / walls[slowest]:.0f} samples/s "
        f"({metrics['samples']} samples, all workers)\n"
        f"  model              {out / MODEL_FILE}\n"
        f"  loss curves        {plot}"
    )


def plot_losses(out: Path, workers: int) -> Path:
    """Plots workers ``0..workers-1``'s loss curves (raw and smoothed) to ``loss.png``.

    Raises:
        FileNotFoundError: a worker's history is missing.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    histories = [json.loads(loss_file(out, w).read_text()) for w in range(workers)]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for h in histories:
        loss = h["loss"]
        line = ax.plot(range(1, len(loss) + 1), loss, alpha=0.25, linewidth=0.8)[0]
        ax.plot(
            range(1, len(loss) + 1),
            _smooth(loss),
            color=line.get_color(),
            label=f"worker {h['worker']}",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_yscale("log")
    mode = histories[0]["mode"] if histories else "?"
    ax.set_title(f"digits CNN, mode {mode}, {workers} worker(s)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / PLOT_FILE
    fig.savefig(path)
    plt.close(fig)
    return path


def _smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average, as TensorBoard smooths a noisy curve."""
    smoothed, avg = [], values[0] if values else 0.0
    for v in values:
        avg = weight * avg + (1 - weight) * v
        smoothed.append(avg)
    return smoothed
