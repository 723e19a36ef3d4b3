"""Runs the benchmark suite against its peers: ``python -m bench [--quick] [--only NAME ...]``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from bench.report import (
    SUMMARY_COLUMNS,
    TARGET_COLUMNS,
    Table,
    environment,
    plot,
    print_table,
    render,
    summary_rows,
    target_rows,
)

# In this order: the wire first, then the pieces it is built from. bench.pushpull (100 MiB,
# in-process vs processes, chunk sweep) stays a separate diagnostic: python -m bench.pushpull.
SUITES = (
    "steps",
    "throughput",
    "latency",
    "manyvars",
    "allreduce",
    "demo",
    "apply",
    "memory",
    "sparse",
    "flight",
    "training",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, few iterations")
    parser.add_argument("--only", nargs="+", choices=SUITES, default=None, help="these suites")
    parser.add_argument("--out", default="out", help="folder for bench.json and bench.png")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    tables: list[Table] = []
    failed: dict[str, str] = {}
    for name in args.only or SUITES:
        print(f"== bench.{name}", flush=True)
        try:
            table = importlib.import_module(f"bench.{name}").measure(args.quick)
        except Exception as exc:  # one broken suite must not hide the others' numbers
            traceback.print_exc()
            failed[name] = f"{type(exc).__name__}: {exc}"
            continue
        print_table(table)
        tables.append(table)
    elapsed = time.perf_counter() - started

    print(f"\n## summary ({'--quick' if args.quick else 'default'}, {elapsed:.0f}s)")
    print(render(SUMMARY_COLUMNS, summary_rows(tables)))
    targets = target_rows(tables)
    print("\n## targets (issue 28's Must show): measured in this run")
    print(render(TARGET_COLUMNS, targets))
    for name, why in failed.items():
        print(f"FAILED bench.{name}: {why}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": args.quick,
        "environment": environment(),
        "elapsed_s": elapsed,
        "summary": [dict(zip(SUMMARY_COLUMNS, r, strict=True)) for r in summary_rows(tables)],
        "targets": [dict(zip(TARGET_COLUMNS, r, strict=True)) for r in targets],
        "tables": [t.to_json() for t in tables],
        "failed": failed,
    }
    (out / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {out / 'bench.json'}")
    if plot(tables, str(out / "bench.png")):
        print(f"wrote {out / 'bench.png'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
