"""Demo training throughput (samples/s) per mode against local, via ``psctl.main demo``."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time

from bench.report import Ratio, Table, median, print_table

MODES = ("local", "sync", "async", "ssp", "allreduce")
THROUGHPUT = re.compile(r"throughput\s+([0-9.]+) samples/s")
TIMEOUT_S = 300


def run_demo(mode: str, epochs: int) -> float | None:
    """samples/s from the demo's 'throughput' line; None when it failed."""
    with tempfile.TemporaryDirectory(prefix=f"bench_demo_{mode}_") as out:
        command = [
            sys.executable,
            "-m",
            "psctl.main",
            "demo",
            "--mode",
            mode,
            "--epochs",
            str(epochs),
            "--out",
            out,
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"demo {mode}: timed out after {TIMEOUT_S}s", file=sys.stderr)
            return None
    found = THROUGHPUT.search(done.stdout)
    if done.returncode != 0 or found is None:
        tail = (done.stdout + done.stderr)[-2000:]
        print(f"demo {mode}: exit {done.returncode}\n{tail}", file=sys.stderr)
        return None
    return float(found.group(1))


def measure(quick: bool, epochs: int = 2) -> Table:
    t0 = time.perf_counter()
    rounds = 1 if quick else 3
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    retried: list[str] = []
    # Round by round, every mode once per round: a busy spell on the machine hits all alike.
    for r in range(rounds):
        for mode in MODES:
            print(f"demo: round {r + 1}/{rounds}, --mode {mode} --epochs {epochs}", flush=True)
            rate = run_demo(mode, epochs)
            if rate is None:
                # One retry, reported: a flaky start should not blank the row, nor hide it.
                print(f"demo: --mode {mode} failed; retrying once", flush=True)
                retried.append(mode)
                rate = run_demo(mode, epochs)
            if rate is not None:
                runs[mode].append(rate)
    rates = {mode: median(r) if r else None for mode, r in runs.items()}
    local = rates["local"]
    rows = [[mode, rate, rate / local if rate and local else None] for mode, rate in rates.items()]
    return Table(
        name="demo",
        title=f"demo training (digits MLP), {epochs} epochs, samples/s, all workers together",
        columns=["mode", "samples/s", "vs local"],
        rows=rows,
        notes=[
            f"`python -m psctl.main demo --mode M --epochs {epochs}`: 2 shards and 2 workers "
            "(local: 1 process); throughput from its 'throughput' line (over the slowest "
            f"worker's training wall time); median of {rounds} interleaved round(s).",
            "A tiny model: this measures per-step overhead, not bandwidth.",
            *([f"failed once, retried: {', '.join(retried)}"] if retried else []),
        ],
        ratios=[
            Ratio("demo", f"{mode} samples/s", mode, "local", r[2], meaning="speed vs local")
            for mode, r in zip(rates, rows, strict=True)
            if mode != "local"
        ],
        plot=((0,), 1, "samples/s (higher is better)"),
        raw={"samples_per_s": rates, "runs": runs, "epochs": epochs, "retried": retried},
        elapsed_s=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one round instead of 3")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    print_table(measure(args.quick, args.epochs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
