"""Result tables of the suite: printing, the ratios summary, the JSON file and the plot."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MB = 1e6  # decimal MB/s, like the DESIGN.md figures


@dataclass
class Ratio:
    """One comparison for the summary: ours against a peer measured in the same run.

    ``ratio`` is oriented so that above 1 means ours is better (faster, more per second), except
    where ``meaning`` says otherwise (memory: our peak over what we must hold).
    """

    suite: str
    comparison: str
    ours: str
    peer: str
    ratio: float | None
    meaning: str = "speed, >1: ours faster"
    goal: str = ""  # e.g. ">= 1.2" from issue 7's "Must show"; empty: no target
    met: bool | None = None
    target: str = ""  # the name in TARGETS this ratio measures; empty: none


@dataclass
class Table:
    """One suite's result: a printed table, its ratios and (for throughput tables) a plot."""

    name: str
    title: str
    columns: list[str]
    rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    # (row label columns, value column, axis label): the plot draws one bar per row.
    plot: tuple[tuple[int, ...], int, str] | None = None
    raw: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Table:
        data = dict(data)
        if data.get("plot"):
            cols, value, unit = data["plot"]
            data["plot"] = (tuple(cols), value, unit)
        return cls(**data)


def check(ratio: float | None, goal: str) -> bool | None:
    """Whether ``ratio`` meets a goal written as '>= x' or '<= x'."""
    if ratio is None or not goal:
        return None
    op, value = goal.split()
    return ratio >= float(value) if op == ">=" else ratio <= float(value)


def median(values: list[float]) -> float:
    return statistics.median(values)


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:.3g}"
    return str(value)


def render(columns: list[str], rows: list[list[Any]]) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    # Text columns are left-aligned, numbers right-aligned.
    left = [i == 0 or any(isinstance(r[i], str) for r in rows) for i in range(len(columns))]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(columns)]
    # The first column is a label: left-aligned; numbers right-aligned.
    line = "  ".join(
        h.ljust(w) if left[i] else h.rjust(w)
        for i, (h, w) in enumerate(zip(columns, widths, strict=True))
    )
    out = [line, "-" * len(line)]
    for r in cells:
        out.append(
            "  ".join(
                c.ljust(w) if left[i] else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(out)


def print_table(table: Table) -> None:
    print(f"\n## {table.name}: {table.title}")
    print(render(table.columns, table.rows))
    for note in table.notes:
        print(f"  {note}")
    print(f"  ({table.elapsed_s:.0f}s)", flush=True)


SUMMARY_COLUMNS = ["suite", "comparison", "ours", "peer", "ratio", "meaning", "goal", "met"]


def summary_rows(tables: list[Table]) -> list[list[Any]]:
    rows = []
    for t in tables:
        for r in t.ratios:
            met = {None: "", True: "yes", False: "NO"}[r.met]
            rows.append([r.suite, r.comparison, r.ours, r.peer, r.ratio, r.meaning, r.goal, met])
    return rows


@dataclass(frozen=True)
class Target:
    """One "Must show" line of the issue the suite is run for: ``name`` (as the suites set
    ``Ratio.target``), the ``goal`` on the ratio, what it means, and where it comes from."""

    name: str
    goal: str
    meaning: str
    suite: str
    # For suites that do not set ``Ratio.target``: (comparison, ours, peer) of the ratio.
    match: tuple[str, str, str] | None = None


# Issue 28's Must show, in its order (docs/benchmarks.md's targets table comes from this).
TARGETS = (
    Target("1M 1 shard vs torch TCP", ">= 0.75", "speed, >1: ours faster", "steps"),
    Target("1M 2 shards vs torch TCP", ">= 1.0", "speed, >1: ours faster", "steps"),
    Target("25M 2 shards vs torch TCP", ">= 1.5", "speed, >1: ours faster", "steps"),
    Target("25M vs raw TCP", ">= 0.5", "speed, >1: ours faster", "steps"),
    Target("1,000 params vs torch default", ">= 1.2", "speed, >1: ours faster", "steps"),
    # The grpcio step stream as it is before the Flight switch: no suite runs both paths yet.
    Target("1,000 params vs today's step stream", ">= 1.0", "speed, >1: ours faster", "-"),
    Target(
        "ring 64 MiB, 2 workers vs gloo",
        "<= 1.3",
        "time, <1: ours faster (the SDK's push in allreduce mode)",
        "allreduce",
        ("2 workers, 64 MiB", "sdk push", "gloo"),
    ),
    Target(
        "ring 64 MiB, 4 workers vs gloo",
        "<= 1.5",
        "time, <1: ours faster (the SDK's push in allreduce mode)",
        "allreduce",
        ("4 workers, 64 MiB", "sdk push", "gloo"),
    ),
    Target(
        "ring through the SDK vs the bare ring, 2 workers",
        "<= 1.1",
        "time, SDK push / bare",
        "allreduce",
        ("2 workers, 64 MiB", "sdk push", "bare ring"),
    ),
    Target(
        "ring through the SDK vs the bare ring, 4 workers",
        "<= 1.1",
        "time, SDK push / bare",
        "allreduce",
        ("4 workers, 64 MiB", "sdk push", "bare ring"),
    ),
    Target("sparse vs torch embedding server", ">= 1.5", "speed, >1: ours faster", "sparse"),
    Target("row create us/row", "<= 0.5", "us per row created, lower is better", "sparse"),
    Target("apply SGD momentum vs torch.optim", ">= 0.8", "speed, >1: ours faster", "apply"),
    Target("apply Adam vs torch.optim", ">= 0.8", "speed, >1: ours faster", "apply"),
    Target("shard peak RSS / state", "<= 1.5", "lower is better", "memory"),
)
TARGET_COLUMNS = ["target", "measured", "goal", "result", "suite", "meaning"]


def target_rows(tables: list[Table]) -> list[list[Any]]:
    """One row per target: the ratio measured in this run (the last one, when a suite gives
    several), its goal and met / MISSED, or "not measured" (its suite was not run, was left
    out by --quick, or no suite measures it yet)."""
    found: dict[str, Ratio] = {}
    for table in tables:
        for r in table.ratios:
            if r.target:
                found[r.target] = r
            for t in TARGETS:
                if (
                    t.match is not None
                    and t.suite == r.suite
                    and t.match
                    == (
                        r.comparison,
                        r.ours,
                        r.peer,
                    )
                ):
                    found[t.name] = r
    rows = []
    for t in TARGETS:
        r = found.get(t.name)
        met = check(r.ratio, t.goal) if r is not None else None
        result = {None: "not measured", True: "met", False: "MISSED"}[met]
        rows.append([t.name, r.ratio if r else None, t.goal, result, t.suite, t.meaning])
    return rows


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    for name in ("numpy", "grpc", "torch"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    return env


def plot(tables: list[Table], path: str) -> bool:
    """One horizontal bar chart per table that has a ``plot``; False when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a server or in CI
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    drawn = [t for t in tables if t.plot is not None and t.rows]
    if not drawn:
        return False
    sizes = [len(t.rows) for t in drawn]
    fig, axes = plt.subplots(
        len(drawn),
        1,
        figsize=(10, 1.0 + 0.3 * sum(sizes) + 0.9 * len(drawn)),
        gridspec_kw={"height_ratios": [n + 2 for n in sizes]},
        squeeze=False,
    )
    for ax, t in zip(axes[:, 0], drawn, strict=True):
        assert t.plot is not None
        label_cols, value_col, unit = t.plot
        rows = [r for r in t.rows if isinstance(r[value_col], float | int)]
        labels = [", ".join(str(r[c]) for c in label_cols) for r in rows]
        values = [float(r[value_col]) for r in rows]
        # Positions, not labels, on the axis: the same system recurs (once per shard count).
        ys = list(range(len(rows)))
        # Ours in blue, whichever label column names the system (the first, or after a group).
        ours = [any(str(r[c]).startswith("ours") for c in label_cols) for r in rows]
        colors = ["tab:blue" if o else "tab:gray" for o in ours]
        ax.barh(ys, values, color=colors)
        ax.set_yticks(ys, labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values) * 1.15)
        ax.set_xlabel(unit, fontsize=8)
        ax.set_title(f"{t.name}: {t.title}", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        for y, v in zip(ys, values, strict=True):
            ax.text(v, y, f" {fmt(v)}", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """Redraws the plot from a bench.json: ``python -m bench.report out/bench.json out/x.png``."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m bench.report BENCH_JSON PNG", file=sys.stderr)
        return 2
    report = json.loads(Path(args[0]).read_text())
    tables = [Table.from_json(t) for t in report["tables"]]
    return 0 if plot(tables, args[1]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
