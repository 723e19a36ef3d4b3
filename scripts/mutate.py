"""`make mutate`: mutation testing of the core modules with mutmut, each against its own tests.

Reads scripts/mutate.toml: groups of modules, each with the test files that cover them, and
the surviving mutants accepted with a reason. Each group runs as one `mutmut run` in a fresh
copy of the tree under build/mutate/<group> (so the worktree is never touched and groups do
not share mutmut's state); mutmut runs each mutant against only those of the group's tests
that executed the mutated function. Then this script adds up the groups, writes
build/mutate/report.md (score per module, every survivor with its diff and its reason) and
exits 1 when the score is under --min-score or a survivor has no reason.

    python scripts/mutate.py                  # every group, 2 mutants at a time
    python scripts/mutate.py optim codec      # some groups
    python scripts/mutate.py --report-only    # re-read the last run's results
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "scripts" / "mutate.toml"
PACKAGES = ["pswire", "pscore", "psserver", "psworker", "psctl"]
# A mutant counts as caught when a test failed, hung past its timeout, or crashed the run.
CAUGHT = {"killed", "timeout", "segfault", "caught by type check"}
# Not tried at all (mutmut stopped before them): left out of the score, and reported.
UNTRIED = {"not checked", "skipped", "check was interrupted by user"}


@dataclass
class Tally:
    caught: int = 0
    missed: int = 0  # survived, no test ran its function, or suspicious
    untried: int = 0
    survivors: list[tuple[str, str]] = field(default_factory=list)  # (name, status)

    @property
    def tried(self) -> int:
        return self.caught + self.missed

    def score(self) -> float:
        return 100.0 * self.caught / self.tried if self.tried else 100.0


def status_of(code: int | None) -> str:
    from mutmut.stats import status_by_exit_code  # type: ignore[import-not-found]

    return str(status_by_exit_code[code])


def tree_files() -> list[str]:
    """The worktree's files as git sees them (tracked, plus new files not ignored)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=REPO,
            check=True,
            capture_output=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        out = "\0".join(
            str(p.relative_to(REPO)) for d in [*PACKAGES, "tests"] for p in (REPO / d).rglob("*")
        )
    keep = (*PACKAGES, "tests/", "pyproject.toml", "conftest.py")
    return [f for f in out.split("\0") if f.startswith(keep) and (REPO / f).is_file()]


def prepare(group: str, spec: dict, root: Path, jobs_timeout: int) -> Path:
    """A fresh copy of the tree for one group, with mutmut's settings in its pyproject."""
    where = root / group
    if where.exists():
        shutil.rmtree(where)
    for rel in tree_files():
        dest = where / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest)
    missing = [t for t in spec["tests"] if not (where / t.split("::")[0]).exists()]
    if missing:
        raise SystemExit(f"group {group}: test files {missing} do not exist")
    settings = {
        "source_paths": PACKAGES,
        "only_mutate": spec["mutate"],
        "pytest_add_cli_args_test_selection": spec["tests"],
        # A mutant that makes a wait hang is caught by the per-test timeout, not by the
        # default 120 s one; no cache dir in the copies.
        "pytest_add_cli_args": [
            "-p",
            "no:cacheprovider",
            f"--timeout={spec.get('test_timeout', jobs_timeout)}",
        ],
        # "fork" forks each mutant from the process that ran the tests once (and runs the
        # fastest tests first); a group whose tests start gRPC servers says "forkserver":
        # grpc is not fork-safe after use, so its mutants fork from a clean server.
        "process_isolation": spec.get("isolation", "fork"),
    }
    with open(where / "pyproject.toml", "a", encoding="utf-8") as f:
        f.write("\n[tool.mutmut]\n")
        for key, value in settings.items():
            f.write(f"{key} = {json.dumps(value)}\n")
    return where


def run_group(where: Path, jobs: int) -> tuple[int, float]:
    start = time.monotonic()
    with open(where / "mutmut.log", "w", encoding="utf-8") as log:
        rc = subprocess.call(
            [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)],
            cwd=where,
            stdout=log,
            stderr=subprocess.STDOUT,
            # One OpenMP thread: torch forked after use hangs in a parallel region otherwise,
            # and the mutants run side by side anyway.
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"},
        )
    return rc, time.monotonic() - start


def collect(where: Path) -> dict[str, Tally]:
    """Per mutated module: what became of each mutant (from mutmut's .meta files)."""
    out: dict[str, Tally] = {}
    for meta in sorted((where / "mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text(encoding="utf-8")).get("exit_code_by_key", {})
        if not codes:
            continue
        module = meta.relative_to(where / "mutants").as_posix().removesuffix(".meta")
        tally = out.setdefault(module, Tally())
        for name, code in sorted(codes.items()):
            status = status_of(code)
            if status in CAUGHT:
                tally.caught += 1
            elif status in UNTRIED:
                tally.untried += 1
            else:
                tally.missed += 1
                tally.survivors.append((name, status))
    return out


def _function(lines: list[str], name: str) -> list[str]:
    """The lines of ``def name(`` in mutmut's mutated file, up to its end."""
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith(f"def {name}(")), None)
    if start is None:
        return []
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    if not lines[start].rstrip().endswith(":"):  # a signature over several lines: to its ")"
        while end < len(lines) and not lines[end].startswith(" " * indent + ")"):
            end += 1
        end += 1
    while end < len(lines) and (
        not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent
    ):
        end += 1
    return [ln.replace(name, "") for ln in lines[start:end]]


def diff_of(where: Path, module: str, name: str) -> str:
    """The mutant as a diff of its function: from the copies mutmut keeps in its file."""
    lines = (where / "mutants" / module).read_text(encoding="utf-8").splitlines()
    local = name.rsplit(".", 1)[-1]  # e.g. xǁShardǁpush__mutmut_3 or x_make_policy__mutmut_7
    base = local.rsplit("__mutmut_", 1)[0]
    diff = difflib.unified_diff(
        _function(lines, base + "__mutmut_orig"), _function(lines, local), lineterm="", n=0
    )
    return "\n".join(ln for ln in diff if not ln.startswith(("---", "+++", "@@")))


def report(
    root: Path, results: dict[str, dict[str, Tally]], reasons: dict[str, str], walls: dict
) -> tuple[float, list[str]]:
    """Writes report.md; returns (the overall score, the survivors that have no reason)."""
    total = Tally()
    rows, details, unexplained = [], [], []
    for group, modules in results.items():
        for module, t in sorted(modules.items()):
            total.caught += t.caught
            total.missed += t.missed
            total.untried += t.untried
            rows.append(
                f"| {module} | {t.tried} | {t.caught} | {t.missed} | {t.untried} | "
                f"{t.score():.1f}% |"
            )
            for name, status in t.survivors:
                reason = reasons.get(name)
                if reason is None:
                    unexplained.append(name)
                details.append(
                    f"### `{name}` ({status})\n\n{reason or 'NO REASON RECORDED'}\n\n"
                    f"```diff\n{diff_of(root / group, module, name)}\n```\n"
                )
    stale = sorted(
        set(reasons) - {n for m in results.values() for t in m.values() for n, _ in t.survivors}
    )
    head = [
        "# Mutation testing (make mutate)",
        "",
        f"Score: **{total.score():.1f}%** caught ({total.caught} of {total.tried} mutants tried;"
        f" {total.untried} not tried). Wall time per group (s): "
        + ", ".join(f"{g} {w:.0f}" for g, w in walls.items())
        + f"; {sum(walls.values()):.0f} in all.",
        "",
        "| module | mutants | caught | missed | not tried | score |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "## Survivors",
        "",
    ]
    if stale:
        details.append("Reasons recorded for mutants that did not survive: " + ", ".join(stale))
    (root / "report.md").write_text("\n".join(head + details) + "\n", encoding="utf-8")
    return total.score(), unexplained


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("groups", nargs="*", help="groups of scripts/mutate.toml (default all)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--min-score", type=float, default=90.0)
    parser.add_argument("--test-timeout", type=int, default=60, help="per test, seconds")
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "mutate")
    parser.add_argument("--report-only", action="store_true", help="re-read the last run")
    parser.add_argument("--config", type=Path, default=CONFIG)
    args = parser.parse_args(argv)
    try:
        import mutmut  # noqa: F401
    except ImportError:
        parser.error("mutmut is not installed: pip install -e '.[dev]'")
    config = tomllib.loads(args.config.read_text(encoding="utf-8"))
    groups = args.groups or list(config["groups"])
    unknown = sorted(set(groups) - set(config["groups"]))
    if unknown:
        parser.error(
            f"unknown groups {unknown}; scripts/mutate.toml has {sorted(config['groups'])}"
        )
    args.workdir.mkdir(parents=True, exist_ok=True)
    walls: dict[str, float] = {}
    results: dict[str, dict[str, Tally]] = {}
    for group in groups:
        if not args.report_only:
            where = prepare(group, config["groups"][group], args.workdir, args.test_timeout)
            print(f"mutate: {group} ...", flush=True)
            rc, walls[group] = run_group(where, args.jobs)
            (where / "wall_s.txt").write_text(f"{walls[group]:.1f}\n", encoding="utf-8")
            if rc != 0:
                print(f"mutate: mutmut failed in {group} (rc {rc}); see {where / 'mutmut.log'}")
                return 2
        results[group] = collect(args.workdir / group)
        recorded = args.workdir / group / "wall_s.txt"
        if group not in walls and recorded.exists():  # --report-only: the run's own time
            walls[group] = float(recorded.read_text(encoding="utf-8"))
        for module, t in sorted(results[group].items()):
            print(f"  {module}: {t.caught}/{t.tried} caught ({t.score():.1f}%)", flush=True)
    score, unexplained = report(args.workdir, results, config.get("survivors", {}), walls)
    took = f" in {sum(walls.values()) / 60:.1f} min" if walls else ""
    print(
        f"mutate: score {score:.1f}% (minimum {args.min_score}%){took}; "
        f"{args.workdir / 'report.md'}"
    )
    if unexplained:
        print(f"mutate: {len(unexplained)} survivors without a reason in scripts/mutate.toml:")
        print("\n".join(f"  {n}" for n in unexplained))
    # The gate: enough caught, and every mutant that survives is there for a stated reason.
    return 0 if score >= args.min_score and not unexplained else 1


if __name__ == "__main__":
    sys.exit(main())
