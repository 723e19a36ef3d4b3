"""The ``psworker`` command: run a training entry point as one worker of a cluster."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from pscore.job import CLIENT_MODES
from pswire import cli, envnames
from pswire.cluster import ClusterSpec
from pswire.errors import ConfigError
from psworker.elastic import parse_bounds
from psworker.launchers import resolve_identity, shard_addresses


def build_parser() -> argparse.ArgumentParser:
    """The ``psworker`` parser; every flag has a PS_* environment twin."""
    parser = argparse.ArgumentParser(
        prog="psworker", description="Run training code as a worker of a parameter-server job."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run module:function, a module, or a script as this cluster's worker",
        description=(
            "Works out this worker's id and the shards from its launcher (--shards, "
            "$PS_SHARDS_FILE, --cluster/$TF_CONFIG; $PS_WORKER_ID, TF_CONFIG's task, torchrun's "
            "or a PyTorchJob's $RANK/$WORLD_SIZE, Slurm's $SLURM_PROCID/$SLURM_NTASKS), exports "
            "them as $PS_SHARDS, $PS_WORKER_ID, $PS_NUM_WORKERS (and $TF_CONFIG when given), "
            "the mode as $PS_MODE/$PS_STALENESS and --elastic as $PS_ELASTIC, then runs TARGET "
            "in this process: module:function is called with no arguments (an int it returns "
            "is the exit code), a module runs like `python -m`, a .py file like `python "
            "file.py`. ARGS become sys.argv[1:]."
        ),
    )
    cli.add(
        run,
        "--cluster",
        env="PS_CLUSTER",
        help="TF_CONFIG JSON or a file holding it; unset: $TF_CONFIG as it is",
    )
    cli.add(
        run,
        "--shards",
        env="PS_SHARDS",
        help="shard addresses host:port,host:port (else $PS_SHARDS_FILE or the cluster's ps)",
    )
    cli.add(
        run,
        "--elastic",
        env="PS_ELASTIC",
        metavar="MIN:MAX",
        help="an elastic job: workers join and leave while it runs; it trains with >= MIN",
    )
    cli.add(
        run,
        "--mode",
        env="PS_MODE",
        choices=CLIENT_MODES,
        help="consistency mode of the job (local: one process, no cluster needed)",
    )
    cli.add(
        run,
        "--staleness",
        env="PS_STALENESS",
        type=int,
        help="ssp: how many steps a worker may run ahead of the slowest",
    )
    run.add_argument(
        "target", metavar="TARGET", help="module:function, module, or path/to/script.py"
    )
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for TARGET")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``psworker`` / ``python -m psworker``; returns the exit code."""
    envnames.warn_unknown(who="psworker")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.staleness is not None and args.staleness < 0:
        parser.error(f"--staleness must be >= 0, got {args.staleness}")
    try:
        # The target first: a misspelt script is the user's first problem, whatever the cluster.
        check_target(args.target)
        if args.mode == "local":
            # One process, no shards: psworker.connect() gives a LocalClient.
            os.environ.update(PS_MODE="local", PS_WORKER_ID="0", PS_NUM_WORKERS="1")
        else:
            export_job(args.cluster, args.mode, args.staleness, args.shards, args.elastic)
        return run_target(args.target, args.args)
    except _NoTarget as exc:
        parser.error(str(exc))
    except ValueError as exc:  # the cluster, before anything ran
        parser.error(str(exc))


class _NoTarget(ConfigError):
    """Raised when TARGET names no script, module or function (before any of it runs)."""


def check_target(target: str) -> None:
    """Checks that ``target`` exists without running it: a file, or an importable module.

    Raises:
        ConfigError: no such script or module.
    """
    if target.endswith(".py") or os.sep in target:
        if not Path(target).is_file():
            raise _NoTarget(f"no such script: {target!r} (from {os.getcwd()})")
        return
    # As `python -m` does, so `psworker run mymodule:main` finds mymodule.py in the current
    # folder even when started as a console script, whose sys.path[0] is its bin folder.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = target.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        raise _NoTarget(
            f"no module named {module!r} (from {os.getcwd()}); TARGET is module:function, "
            "a module, or path/to/script.py"
        )


def export_job(
    cluster: str | None,
    mode: str | None,
    staleness: int | None,
    shards: str | None = None,
    elastic: str | None = None,
) -> ClusterSpec:
    """Puts the job into the environment ``psworker.connect()`` reads; returns the cluster as
    this worker sees it (its shards, its id as the task index).

    The shards come from ``shards``, $PS_SHARDS_FILE or the cluster spec; this worker's id and
    the count from its launcher (``psworker.launchers``). A spec without a task (Kubernetes:
    one spec for every pod) names this worker by another launcher, else by
    ``pswire.cluster.task_index_from_env`` ($PS_TASK_INDEX, $JOB_COMPLETION_INDEX); the
    exported TF_CONFIG then carries that task.

    Raises:
        ValueError: no shards anywhere, a malformed spec, one naming a non-worker task,
            launchers that disagree, or no worker id for a job of several.
    """
    text = cluster
    if text is not None and not text.strip().startswith("{"):
        path = Path(text.strip())
        if not path.is_file():
            raise ValueError(f"--cluster {text!r} is neither JSON nor a readable file")
        text = path.read_text()
    env = dict(os.environ)
    if text is not None:
        env["TF_CONFIG"] = text
    if shards:
        env["PS_SHARDS"] = shards
    found = shard_addresses(None, env)
    if found is None:
        raise ValueError(
            "no cluster: pass --shards (or $PS_SHARDS), $PS_SHARDS_FILE, or --cluster (or "
            "$PS_CLUSTER) or set $TF_CONFIG"
        )
    bounds = parse_bounds(elastic, "--elastic") if elastic else None
    identity = resolve_identity(None, None, env)
    spec = ClusterSpec.load(text, role=None)
    workers = identity.num_workers or 1
    raw = (text if text is not None else _tf_config_text()) if spec is not None else "{}"
    has_task = bool(json.loads(raw).get("task"))
    if spec is not None and has_task:
        if spec.task_type != "worker":
            raise ValueError(
                f"the cluster spec names a {spec.task_type!r} task; psworker runs workers"
            )
        if not 0 <= spec.task_index < max(len(spec.workers), 1):
            raise ValueError(
                f"the cluster spec names worker {spec.task_index} but lists {len(spec.workers)}"
            )
    several = workers > 1 or (bounds is not None and bounds[1] > 1)
    if identity.worker_id is None and several:
        raise ValueError(
            "no worker id: set $PS_WORKER_ID or TF_CONFIG's task, or launch with torchrun, "
            f"srun or a PyTorchJob ({identity.count_source or '--elastic'} says there are "
            "several workers)"
        )
    worker = identity.worker_id or 0
    if spec is not None:
        spec = ClusterSpec(spec.ps, spec.workers, "worker", worker)
        # The JSON itself, not a path: TF-style code in the entry point reads it as JSON, and
        # it names this worker's task (derived, when the spec had none).
        os.environ["TF_CONFIG"] = raw if has_task else spec.to_json()
    else:
        spec = ClusterSpec(tuple(found[0]), (), "worker", worker)
    os.environ["PS_SHARDS"] = ",".join(found[0])
    os.environ["PS_WORKER_ID"] = str(worker)
    os.environ["PS_NUM_WORKERS"] = str(workers)
    if bounds is not None:
        os.environ["PS_ELASTIC"] = f"{bounds[0]}:{bounds[1]}"
    if mode is not None:
        os.environ["PS_MODE"] = mode
    if staleness is not None:
        os.environ["PS_STALENESS"] = str(staleness)
    return spec


def _tf_config_text() -> str:
    """$TF_CONFIG's JSON (it may name a file instead), for checking what it says."""
    text = os.environ.get("TF_CONFIG", "").strip()
    return text if text.startswith("{") else Path(text).read_text()


def run_target(target: str, args: list[str]) -> int:
    """Runs ``target`` in this process with ``sys.argv = [target, *args]``; returns its code.

    Raises:
        ConfigError: the function does not exist (call ``check_target`` first for the script
            or module). Whatever the target raises (``SystemExit`` included) propagates.
    """
    sys.argv = [target, *args]
    if target.endswith(".py") or Path(target).is_file():
        # As `python script.py` does: the script's folder comes first on the import path.
        sys.path.insert(0, str(Path(target).resolve().parent))
        runpy.run_path(target, run_name="__main__")
        return 0
    module_name, sep, attr = target.partition(":")
    if not sep:
        runpy.run_module(module_name, run_name="__main__", alter_sys=True)
        return 0
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise _NoTarget(f"{target}: {module_name} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{target} is a {type(obj).__name__}, not a function")
    result = obj()
    # bool is an int, but True/False returned from a training function are not exit codes.
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
