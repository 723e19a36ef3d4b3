"""Runs every benchmark in bench/: ``python -m bench [--quick]``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import bench


def benchmark_modules() -> list[str]:
    """Names of the modules in bench/ that define ``main(argv)``, in alphabetical order."""
    names = []
    for info in pkgutil.iter_modules(bench.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"bench.{info.name}")
        if callable(getattr(module, "main", None)):
            names.append(info.name)
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args(argv)
    failed = []
    for name in benchmark_modules():
        print(f"== bench.{name}", flush=True)
        module = importlib.import_module(f"bench.{name}")
        rc = module.main(["--quick"] if args.quick else [])
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
