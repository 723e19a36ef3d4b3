"""DiLoCo against sync mode on examples/train_lm.py: 4 workers, 2 shards, the same samples.

``python -m bench.diloco [--quick] [--steps N] [--out out] [--plot docs/diloco.png]`` trains the
character LSTM six times, each on two fresh shard processes with four worker processes, every
job on the same number of samples (100 outer steps' worth by default): sync mode; DiLoCo with
H = 25 (AdamW inside, Nesterov SGD lr 0.7 momentum 0.9 on the shards); DiLoCo with worker 3
slowed 2x; asynchronous DiLoCo (delayed Nesterov, momentum 0.5) with worker 3 slowed 2x; the
same with dynamic local steps (DyLU); and that with the paper's momentum 0.9. Each mode's
inner lr is its own best (``LRS``: docs/diloco.md has the sweep). In the asynchronous runs
the slow worker takes half the steps of each fast one (4 x 2500 = 1429 + 3 x 2857), which is
what asynchrony is for.

Every worker is a device of fixed speed (``--pace``: each step takes 40 ms by default, the
slowed worker's 80 ms, a sleep making up what the compute did not take), so a slow worker is really
twice as slow and the fast ones are not slowed by the four processes sharing two cores: the
table says how many steps took longer than their pace.

The corpus (``--corpus``): ``stdlib`` (default), the docstrings of the standard library's
top-level modules (~0.9 MB), every tenth block of 1,024 characters held out for validation;
``builtins``, the example's own small corpus, whose validation windows overlap training ones
(a measure of memorisation).

``--net 100mbit`` measures instead the wall-clock time to sync mode's final perplexity over an
emulated link: every worker and shard in its own network namespace, each host's link shaped
to 100 Mbit/s both ways with tc tbf (as bench/training.py builds them; root only), a wider
LSTM (``--hidden``, default 256), sync for ``--steps`` (800) steps and DiLoCo for
``--diloco-steps`` (1200), both measured every outer step (evaluation time left out), DiLoCo
with outer SGD lr 1.0 momentum 0.7 (``--diloco-flags``).

It prints validation perplexity (the last worker to finish: its final pull holds every
worker's updates), bytes sent and received (the sum of every worker's ``psworker/bytes_sent``
and ``bytes_received``: what DistributedOptimizer reports per step), wall-clock seconds and
the load average, the ratios against sync and the issue's targets, and plots perplexity
against bytes sent.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.training import Hosts, netns_available, processes

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_lm.py"
WORKERS, SHARDS, H = 4, 2, 25
TIMEOUT_S = 1800
# Each mode's best peak lr on each corpus (sync, DiLoCo's inner): docs/diloco.md has the sweep.
LRS = {"stdlib": (3e-2, 1e-2), "builtins": (4e-2, 2e-2)}
NET_LRS = {"stdlib": (2e-2, 1e-2), "builtins": (2e-2, 1e-2)}  # --net: the wider LSTM's
PACE_S = 0.04
# The asynchronous runs' outer momentum (delayed Nesterov): 0.9 on top of the momentum that
# asynchrony itself adds overshoots (docs/diloco.md).
ASYNC_MOMENTUM = 0.5
# --net: the outer SGD the sweep found best for the wider LSTM (docs/diloco.md).
NET_OUTER = "--outer-lr 1.0 --outer-momentum 0.7"
ASYNC = f"asynchronous DiLoCo H={H} (momentum {ASYNC_MOMENTUM}), worker 3 slowed 2x"
DYLU = f"asynchronous DiLoCo H={H} + DyLU (momentum {ASYNC_MOMENTUM}), worker 3 slowed 2x"
EVAL_EVERY = 5 * H
# Streaming DiLoCo's settings: 5 fragments (one exchange every H/5 steps), each landing one
# inner step late, merged half and half with the local weights (the paper's alpha).
STREAMING = ("--fragments", "5", "--overlap-steps", "1", "--mix", "0.5")
STREAMING_LABEL = f"Streaming DiLoCo H={H}, 5 fragments, overlap 1 step, mix 0.5"


@dataclass(frozen=True)
class Run:
    """One training job: its mode's flags and each worker's steps and slowdown."""

    label: str
    flags: tuple[str, ...]
    steps: tuple[int, ...]
    slow: dict[int, float] = field(default_factory=dict)

    @property
    def asynchronous(self) -> bool:
        return "--outer-async" in self.flags


def skewed(steps: int) -> tuple[int, ...]:
    """Each worker's steps when worker 3 is half as fast: as many samples as ``steps`` each,
    the slow worker taking half of what each fast one takes."""
    slow = round(WORKERS * steps / (2 * WORKERS - 1))
    fast = (WORKERS * steps - slow) // (WORKERS - 1)
    return (fast,) * (WORKERS - 2) + (WORKERS * steps - slow - (WORKERS - 2) * fast, slow)


def runs(steps: int, common: tuple[str, ...] = (), corpus: str = "stdlib") -> list[Run]:
    """The seven jobs, each ``WORKERS * steps`` batches in all."""
    sync_lr, diloco_lr = LRS[corpus]
    diloco = (*common, "--mode", "diloco", "--local-steps", str(H), "--lr", str(diloco_lr))
    asynchronous = (*diloco, "--outer-async", "--outer-momentum", str(ASYNC_MOMENTUM))
    dylu = (*asynchronous, "--dynamic-local-steps")
    even = (steps,) * WORKERS
    slow = {WORKERS - 1: 2.0}
    return [
        Run("sync", (*common, "--mode", "sync", "--lr", str(sync_lr)), even),
        Run(f"DiLoCo H={H}", diloco, even),
        Run(STREAMING_LABEL, (*diloco, *STREAMING), even),
        Run(f"DiLoCo H={H}, worker 3 slowed 2x", diloco, even, slow),
        Run(ASYNC, asynchronous, skewed(steps), slow),
        Run(DYLU, dylu, skewed(steps), slow),
        Run(
            f"asynchronous DiLoCo H={H} + DyLU (the paper's momentum 0.9), worker 3 slowed 2x",
            (*diloco, "--outer-async", "--dynamic-local-steps"),
            skewed(steps),
            slow,
        ),
    ]


def stdlib_text(path: Path) -> Path:
    """Writes the docstrings of the standard library's top-level modules (module, classes,
    functions, in file and then tree order) to ``path``: a corpus every Python has, read
    without importing anything."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for source in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(source.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    path.write_text("\n".join(texts), encoding="utf-8")
    return path


def load() -> str:
    """The 1-, 5- and 15-minute load averages."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def train(
    run: Run, hosts: Hosts, example_args: tuple[str, ...], eval_every: int = 0
) -> dict[int, list[dict]]:
    """Each worker's figures (the example's ``figures`` lines), in order; worker 0's also
    every ``eval_every`` steps (one worker measures, so the others never wait for it while
    they measure; its own measuring is left out of its seconds).

    Raises:
        RuntimeError: a shard or worker failed or timed out (its output's tail in the message).
    """
    with tempfile.TemporaryDirectory(prefix="bench_diloco_") as tmp, processes() as procs:
        env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": tmp}
        addresses = [
            hosts.start_shard(WORKERS + j, Path(tmp) / f"shard{j}.port", env, procs, None)
            for j in range(SHARDS)
        ]
        env.update(PS_SHARDS=",".join(addresses), PS_NUM_WORKERS=str(WORKERS))
        workers = []
        for w in range(WORKERS):
            command = [
                *hosts.prefix(w),
                sys.executable,
                str(EXAMPLE),
                *run.flags,
                *example_args,
                "--steps",
                str(run.steps[w]),
                "--slow",
                str(run.slow.get(w, 1.0)),
                "--json",
                *(("--eval-every", str(eval_every)) if w == 0 and eval_every else ()),
            ]
            workers.append(
                subprocess.Popen(
                    command,
                    env={**env, **hosts.env(w), "PS_WORKER_ID": str(w)},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        procs.extend(workers)
        deadline = time.monotonic() + TIMEOUT_S
        out: dict[int, list[dict]] = {}
        for w, proc in enumerate(workers):
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


def summary(figures: dict[int, list[dict]], synchronous: bool = True) -> dict[str, float]:
    """The job's figures: the perplexity of the worker that finished last (its final pull
    came after every other worker's last push; in the synchronous modes every worker ends
    with the same weights), bytes and samples summed over the workers, and the seconds from
    when the last worker was ready to train to when the last one finished (evaluations left
    out): the workers' start-up (torch, the corpus) is no part of it; in a ``synchronous``
    job the others wait while worker 0 measures, so that time is left out too."""
    finals = {w: f[-1] for w, f in figures.items()}
    waited = finals[0].get("evaluating", 0.0) if synchronous else 0.0
    ends = {w: f["started_at"] + f["seconds"] - (waited if w else 0.0) for w, f in finals.items()}
    last = max(ends, key=lambda w: ends[w])
    return {
        "perplexity": finals[last]["perplexity"],
        "perplexity_mean": sum(f["perplexity"] for f in finals.values()) / len(finals),
        "bytes_sent": sum(f["bytes_sent"] for f in finals.values()),
        "bytes_received": sum(f["bytes_received"] for f in finals.values()),
        "seconds": ends[last] - max(f["started_at"] for f in finals.values()),
        "samples": sum(f["steps"] for f in finals.values()) * 16,
        "overruns": sum(f.get("overruns", 0) for f in finals.values()),
    }


def _draw(
    curves: dict[str, tuple[list[float], list[float]]],
    path: str,
    title: str,
    xlabel: str,
    log_x: bool,
    target: float | None = None,
) -> None:
    """One line per run (x, perplexity), worker 0's model; ``target``: a dashed level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, ".-", label=label)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="sync's final")
    if log_x:  # bytes span orders of magnitude
        ax.set_xscale("log")
    else:  # perplexity falls by orders of magnitude in the first seconds
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation perplexity (worker 0's model)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(results: dict[str, dict[int, list[dict]]], path: str, title: str) -> None:
    """Worker 0's validation perplexity against the bytes it sent (log scale)."""
    curves = {}
    for label, figures in results.items():
        curve = [f for f in figures[0] if f["bytes_sent"] > 0]  # worker 0's, after its first
        curves[label] = ([f["bytes_sent"] for f in curve], [f["perplexity"] for f in curve])
    xlabel = "bytes sent by worker 0 (psworker/bytes_sent, cumulative)"
    _draw(curves, path, title, xlabel, log_x=True)


def plot_time(results: dict[str, dict[str, Any]], target: float, path: str, title: str) -> None:
    """Worker 0's validation perplexity against its seconds (measuring left out), and the
    target: sync's final perplexity."""
    curves = {}
    for label, figures in results.items():
        curve = figures[0] if 0 in figures else figures["0"]
        curves[label] = ([f["seconds"] for f in curve], [f["perplexity"] for f in curve])
    xlabel = "seconds (worker 0, measuring left out)"
    _draw(curves, path, title, xlabel, log_x=False, target=target)


def verdicts(rows: dict[str, dict[str, float]]) -> list[str]:
    """The issue's targets, each with the numbers it is judged on."""
    sync, lines = rows["sync"], []
    dl = rows.get(f"DiLoCo H={H}")
    if dl:
        gap = dl["perplexity"] / sync["perplexity"] - 1
        fewer = sync["bytes_sent"] / max(dl["bytes_sent"], 1)
        met = gap <= 0.05 and fewer >= 12
        lines.append(
            f"DiLoCo H={H} vs sync: perplexity {gap:+.1%} (target <= +5%), {fewer:.1f}x fewer "
            f"bytes (target >= 12x): {'met' if met else 'NOT met'}"
        )
    slowed = rows.get(f"DiLoCo H={H}, worker 3 slowed 2x")
    for label in [r for r in rows if r.startswith("asynchronous")]:
        row = rows.get(label)
        if row and slowed:
            sooner = slowed["seconds"] / row["seconds"]
            gap = row["perplexity"] / slowed["perplexity"] - 1
            gap_sync = row["perplexity"] / sync["perplexity"] - 1
            met = sooner > 1 and gap <= 0.05
            lines.append(
                f"{label}: {sooner:.2f}x sooner than synchronous DiLoCo slowed alike, "
                f"perplexity {gap:+.1%} against it ({gap_sync:+.1%} against sync): "
                f"{'met' if met else 'NOT met'}"
            )
    return lines


def corpus_flags(corpus: str, folder: Path) -> tuple[str, ...]:
    """The example's flags for ``corpus`` (``stdlib``: its text written into ``folder``,
    which is made if need be)."""
    folder.mkdir(parents=True, exist_ok=True)
    if corpus == "stdlib":
        return ("--text", str(stdlib_text(folder / "stdlib.txt")))
    return ("--corpus", corpus)


def loopback(args: argparse.Namespace) -> int:
    steps = 3 * H if args.quick else args.steps
    folder = Path(args.out)
    common = corpus_flags(args.corpus, folder)
    example = ("--pace", str(args.pace))
    results: dict[str, dict[int, list[dict]]] = {}
    loads: dict[str, list[str]] = {}
    chosen = runs(steps, common, args.corpus)
    if args.only:
        chosen = [r for r in chosen if r.label == "sync" or any(o in r.label for o in args.only)]
    with Hosts(WORKERS + SHARDS, None) as hosts:
        for run in chosen:
            print(f"diloco bench: {run.label}, steps {run.steps}, load {load()}", flush=True)
            before = load()
            results[run.label] = train(run, hosts, example, EVAL_EVERY)
            loads[run.label] = [before, load()]
    rows = {
        run.label: {**summary(results[run.label], not run.asynchronous), "load": loads[run.label]}
        for run in chosen
    }
    base = rows["sync"]
    print(
        "| run | samples | validation perplexity | vs sync | bytes sent | sync / this "
        "| bytes received | seconds | paced steps over | load before / after |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, r in rows.items():
        print(
            f"| {label} | {r['samples']:.0f} | {r['perplexity']:.3f} | "
            f"{r['perplexity'] / base['perplexity'] - 1:+.1%} | {r['bytes_sent'] / 1e6:.1f} MB | "
            f"{base['bytes_sent'] / max(r['bytes_sent'], 1):.1f}x | "
            f"{r['bytes_received'] / 1e6:.1f} MB | {r['seconds']:.1f} | {r['overruns']:.0f} | "
            f"{' / '.join(r['load'])} |"
        )
    for line in verdicts(rows):
        print(line)
    (folder / "diloco.json").write_text(json.dumps({"rows": rows, "curves": results}, indent=1))
    target = args.plot or str(folder / "diloco.png")
    plot(results, target, f"char LSTM, {WORKERS} workers, {SHARDS} shards: sync vs DiLoCo H={H}")
    print(f"wrote {folder / 'diloco.json'} and {target}")
    return 0


def time_to(curve: list[dict], perplexity: float) -> float | None:
    """Seconds (evaluation left out) at the first measurement at or below ``perplexity``."""
    for f in curve:
        if f["perplexity"] <= perplexity:
            return float(f["seconds"])
    return None


def over_link(args: argparse.Namespace) -> int:
    if not netns_available():
        print("--net needs root, ip and tc (network namespaces)", file=sys.stderr)
        return 2
    folder = Path(args.out)
    common = (*corpus_flags(args.corpus, folder), "--hidden", str(args.hidden))
    steps = 2 * H if args.quick else args.steps
    diloco_steps = 4 * H if args.quick else args.diloco_steps
    sync_run = Run("sync", (*common, "--mode", "sync", "--lr", str(args.sync_lr)), (steps,) * 4)
    diloco_flags = (*common, "--mode", "diloco", "--local-steps", str(H))
    diloco_run = Run(
        f"DiLoCo H={H}",
        (*diloco_flags, "--lr", str(args.diloco_lr), *shlex.split(args.diloco_flags)),
        (diloco_steps,) * WORKERS,
    )
    streaming_run = Run(
        f"Streaming DiLoCo H={H}, {args.streaming_flags}",
        (*diloco_run.flags, *shlex.split(args.streaming_flags)),
        (diloco_steps,) * WORKERS,
    )
    results, rows = {}, {}
    with Hosts(WORKERS + SHARDS, args.net) as hosts:
        link = f"tbf {args.net} both ways on each host's link" + (
            ", netem delay" if hosts.delayed else ", no added delay (no netem here)"
        )
        for run in (sync_run, diloco_run, streaming_run):
            print(f"diloco bench ({link}): {run.label}, steps {run.steps}, load {load()}")
            before = load()
            results[run.label] = train(run, hosts, (), H)
            rows[run.label] = {**summary(results[run.label]), "load": [before, load()]}
    sync_curve, diloco_curve = results["sync"][0], results[diloco_run.label][0]
    target = sync_curve[-1]["perplexity"]
    sync_s = time_to(sync_curve, target)
    diloco_s = time_to(diloco_curve, target)
    streaming_s = time_to(results[streaming_run.label][0], target)
    print("| run | steps per worker | final perplexity | bytes sent | seconds | load |")
    print("|---|---|---|---|---|---|")
    for label, r in rows.items():
        print(
            f"| {label} | {r['samples'] / 16 / WORKERS:.0f} | {r['perplexity']:.3f} | "
            f"{r['bytes_sent'] / 1e6:.1f} MB | {r['seconds']:.1f} | {' / '.join(r['load'])} |"
        )
    ratio = sync_s / diloco_s if sync_s and diloco_s else math.nan
    print(
        f"time to sync's final perplexity {target:.3f} ({link}): sync {sync_s:.1f} s, DiLoCo "
        + (f"{diloco_s:.1f} s: {ratio:.2f}x (target >= 5x)" if diloco_s else "never reached it")
        + (
            f"; streaming DiLoCo {streaming_s:.1f} s: {sync_s / streaming_s:.2f}x"
            if sync_s and streaming_s
            else "; streaming DiLoCo never reached it"
        )
    )
    plot_time(
        results,
        target,
        str(folder / "diloco_net.png"),
        f"char LSTM (hidden {args.hidden}), {WORKERS} workers, {SHARDS} shards, "
        f"{args.net} links (tc tbf): time to sync's final perplexity",
    )
    (folder / "diloco_net.json").write_text(
        json.dumps(
            {"rows": rows, "curves": results, "target": target, "ratio": ratio, "link": link},
            indent=1,
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.diloco", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 outer steps (a smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="each worker's, if even")
    parser.add_argument("--corpus", choices=("stdlib", "builtins"), default="stdlib")
    parser.add_argument("--pace", type=float, default=PACE_S, help="seconds a step takes")
    parser.add_argument("--only", nargs="+", default=None, help="runs whose label has these")
    parser.add_argument("--out", default="out", help="folder for diloco.json")
    parser.add_argument("--plot", default=None, help="where to draw the plot (default: --out)")
    parser.add_argument("--net", default=None, help="e.g. 100mbit: time to sync's perplexity")
    parser.add_argument("--hidden", type=int, default=256, help="--net: the LSTM's width")
    parser.add_argument("--diloco-steps", type=int, default=None, help="--net: DiLoCo's steps")
    parser.add_argument("--sync-lr", type=float, default=None, help="--net: sync's lr")
    parser.add_argument("--diloco-lr", type=float, default=None, help="--net: DiLoCo's")
    parser.add_argument(
        "--diloco-flags",
        default=NET_OUTER,
        help=f'--net: more of DiLoCo\'s example flags (default "{NET_OUTER}")',
    )
    parser.add_argument(
        "--streaming-flags",
        default=" ".join(STREAMING),
        help=f'--net: Streaming DiLoCo\'s example flags (default "{" ".join(STREAMING)}")',
    )
    args = parser.parse_args(argv)
    if args.net:
        sync_lr, diloco_lr = NET_LRS[args.corpus]
        args.sync_lr = args.sync_lr or sync_lr
        args.diloco_lr = args.diloco_lr or diloco_lr
        args.steps = args.steps or 32 * H
        args.diloco_steps = args.diloco_steps or 48 * H
        return over_link(args)
    args.steps = args.steps or 100 * H
    return loopback(args)


if __name__ == "__main__":
    sys.exit(main())
