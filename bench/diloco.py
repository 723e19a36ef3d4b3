"""DiLoCo against sync mode on examples/train_lm.py: 4 workers, 2 shards, the same samples.

``python -m bench.diloco [--quick] [--out out] [--plot docs/diloco.png]`` trains the character
LSTM on the builtins corpus four times, each on two fresh in-process shards with four worker
processes: sync mode; DiLoCo with H = 25 (AdamW inside, Nesterov SGD lr 0.7 momentum 0.9 on the
shards); DiLoCo with worker 3 slowed 2x; asynchronous DiLoCo (delayed Nesterov) with worker 3
slowed 2x. Every run trains on the same number of samples (21 outer steps of 25 per worker by
default): in the asynchronous run the slow worker takes half the steps of each fast one
(300 + 3 x 600 = 4 x 525), which is what asynchrony is for. It prints validation perplexity
(mean over the workers' final models), bytes sent and received (the sum of every worker's
``psworker/bytes_sent`` and ``bytes_received``: what DistributedOptimizer reports per step)
and wall-clock seconds, the ratios against sync, and plots perplexity against bytes sent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from psserver.server import start_server
from psserver.shard import Shard

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_lm.py"
WORKERS, SHARDS, H = 4, 2, 25
TIMEOUT_S = 900


@dataclass(frozen=True)
class Run:
    """One training job: its mode's flags and each worker's steps and slowdown."""

    label: str
    flags: tuple[str, ...]
    steps: tuple[int, ...]
    slow: dict[int, float] = field(default_factory=dict)


def runs(steps: int) -> list[Run]:
    """The four jobs, each ``WORKERS * steps`` batches in all."""
    diloco = ("--mode", "diloco", "--local-steps", str(H))
    even = (steps,) * WORKERS
    # Equal samples: the slow worker takes half the steps of each fast one (8/7 and 4/7 of
    # ``steps``, rounded to whole outer steps; the fast ones take what is left).
    slow_share = max(H, round(4 * steps / (2 * WORKERS - 1) / H) * H)
    fast_share = (WORKERS * steps - slow_share) // (WORKERS - 1)
    skewed = (fast_share,) * (WORKERS - 1) + (WORKERS * steps - (WORKERS - 1) * fast_share,)
    return [
        Run("sync", ("--mode", "sync"), even),
        Run(f"diloco H={H}", diloco, even),
        Run(f"diloco H={H}, worker 3 slowed 2x", diloco, even, {3: 2.0}),
        Run(
            f"async diloco H={H}, worker 3 slowed 2x", (*diloco, "--outer-async"), skewed, {3: 2.0}
        ),
    ]


def train(run: Run) -> dict[int, list[dict]]:
    """Each worker's per-epoch figures (the example's ``figures`` lines).

    Raises:
        RuntimeError: a worker failed or timed out (its output's tail in the message).
    """
    servers = [start_server(Shard()) for _ in range(SHARDS)]
    procs: list[subprocess.Popen[str]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench_diloco_") as folder:
            env = {
                **os.environ,
                "PS_SHARDS": ",".join(s.address for s in servers),
                "PS_NUM_WORKERS": str(WORKERS),
                "PYTHONPATH": str(REPO),
                "TMPDIR": folder,
            }
            for w in range(WORKERS):
                command = [
                    sys.executable,
                    str(EXAMPLE),
                    *run.flags,
                    "--corpus",
                    "builtins",
                    "--steps",
                    str(run.steps[w]),
                    "--slow",
                    str(run.slow.get(w, 1.0)),
                    "--json",
                ]
                procs.append(
                    subprocess.Popen(
                        command,
                        env={**env, "PS_WORKER_ID": str(w)},
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
            deadline = time.monotonic() + TIMEOUT_S
            out: dict[int, list[dict]] = {}
            for w, proc in enumerate(procs):
                try:
                    text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired as exc:
                    raise RuntimeError(f"{run.label}: worker {w} timed out") from exc
                if proc.returncode != 0:
                    raise RuntimeError(
                        f"{run.label}: worker {w} exit {proc.returncode}\n{text[-3000:]}"
                    )
                lines = [ln for ln in text.splitlines() if ln.startswith("figures ")]
                out[w] = [json.loads(ln.split(" ", 1)[1]) for ln in lines]
            return out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for server in servers:
            server.stop(grace=0.5)


def summary(figures: dict[int, list[dict]]) -> dict[str, float]:
    finals = [f[-1] for f in figures.values()]
    return {
        "perplexity": sum(f["perplexity"] for f in finals) / len(finals),
        "bytes_sent": sum(f["bytes_sent"] for f in finals),
        "bytes_received": sum(f["bytes_received"] for f in finals),
        "seconds": max(f["seconds"] for f in finals),
        "samples": sum(f["steps"] for f in finals) * 16,
    }


def plot(results: dict[str, dict[int, list[dict]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, figures in results.items():
        curve = figures[0]  # worker 0's: its bytes sent so far, its validation perplexity
        ax.plot(
            [f["bytes_sent"] for f in curve], [f["perplexity"] for f in curve], "o-", label=label
        )
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent by worker 0 (psworker/bytes_sent, cumulative)")
    ax.set_ylabel("validation perplexity (worker 0, each epoch)")
    ax.set_title(f"char LSTM, {WORKERS} workers, {SHARDS} shards: sync vs DiLoCo H={H}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.diloco", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 outer steps (a smoke run)")
    parser.add_argument("--steps", type=int, default=21 * H, help="each worker's, if even")
    parser.add_argument("--out", default="out", help="folder for diloco.json")
    parser.add_argument("--plot", default=None, help="where to draw the plot (default: --out)")
    args = parser.parse_args(argv)
    steps = 3 * H if args.quick else args.steps
    results: dict[str, dict[int, list[dict]]] = {}
    for run in runs(steps):
        print(f"diloco bench: {run.label}, steps {run.steps}", flush=True)
        results[run.label] = train(run)
    rows = {label: summary(figures) for label, figures in results.items()}
    base = rows["sync"]
    print(
        "| run | samples | validation perplexity | vs sync | bytes sent | sync / this "
        "| bytes received | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, r in rows.items():
        print(
            f"| {label} | {r['samples']:.0f} | {r['perplexity']:.3f} | "
            f"{r['perplexity'] / base['perplexity'] - 1:+.1%} | {r['bytes_sent'] / 1e6:.1f} MB | "
            f"{base['bytes_sent'] / max(r['bytes_sent'], 1):.1f}x | "
            f"{r['bytes_received'] / 1e6:.1f} MB | {r['seconds']:.1f} |"
        )
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "diloco.json").write_text(json.dumps({"rows": rows, "curves": results}, indent=1))
    target = args.plot or str(folder / "diloco.png")
    plot(results, target)
    print(f"wrote {folder / 'diloco.json'} and {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
