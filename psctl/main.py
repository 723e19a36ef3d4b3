"""``psctl``: launch a local cluster like torchrun, train the demo, show the shards' status."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from psctl import (
    admin,
    certs,
    dashboard_server,
    demo_results,
    local_add,
    nodes,
    run_folder,
    status_view,
)
from psctl.launch import (
    DEFAULT_GRACE_S,
    DEFAULT_STALENESS,
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    LAUNCH_MODES,
    SHARDLESS_MODES,
    LocalConfig,
    run_local,
)
from psctl.progress import ProgressOutput
from pswire import cli, envnames
from psworker import launchers

DEMO_OUT = "out/demo"


# -- commands -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``psctl`` parser with its ``local``, ``demo`` and ``status`` subcommands."""
    parser = argparse.ArgumentParser(prog="psctl", description="Parameter-server cluster tool.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    local = commands.add_parser(
        "local",
        help="launch N shards and M workers on this machine (like torchrun)",
        description=(
            "Starts --servers psserver daemons on 127.0.0.1, then --workers copies of CMD, each "
            "with TF_CONFIG, PS_MODE, PS_STALENESS, PS_WORKER_ID and PS_NUM_WORKERS set. The "
            "first worker to fail stops the rest and its exit code is psctl's. --mode local "
            "starts no shards and one worker without TF_CONFIG; --mode allreduce no shards. "
            "With $PS_CHECKPOINT_DIR set, shard i checkpoints to its subfolder psI. With "
            "--elastic MIN:MAX the workers get $PS_SHARDS and $PS_ELASTIC instead of TF_CONFIG, "
            "a failed worker does not stop the rest, and `psctl local add` starts more (a "
            "command named add runs as `psctl local -- add`). At start it prints its run "
            "folder, where `psctl status` and `psctl local add` find the job. With --nnodes, "
            "several launchers (one per machine) form one job: node 0 hosts the rendezvous at "
            "--rdzv, the job's shards are every node's, node i's workers take the next ids."
        ),
    )
    _add_cluster_flags(local, servers=1, workers=1)
    cli.add(
        local,
        "--elastic",
        env="PS_ELASTIC",
        metavar="MIN:MAX",
        help="an elastic job: workers may fail or be added (psctl local add) while it runs",
    )
    cli.add(
        local,
        "--fresh",
        env="PS_FRESH",
        action="store_true",
        help="start a new job on $PS_CHECKPOINT_DIR: each shard moves its old checkpoints "
        "into a subfolder before-fresh-<time> (kept, never deleted) instead of resuming",
    )
    cli.add(
        local,
        "--export",
        env="PS_EXPORT",
        metavar="PATH",
        help="once every worker succeeded, write the final model (as psctl export) before "
        "stopping the shards",
    )
    _add_node_flags(local)
    local.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD", help="worker command")

    demo = commands.add_parser(
        "demo",
        help="train a small CNN on scikit-learn's handwritten digits on a local cluster",
        description=(
            "Runs `psctl local` with the demo worker (python -m psctl.demo): each worker "
            "trains on its shard of the digits, with a progress bar per worker (plain lines "
            "when stderr is not a terminal). Then prints held-out accuracy, wall time and "
            "samples/s, and writes the model (model.pt) and loss curves (loss.png) to --out. "
            "--mode local trains in one process with no shards."
        ),
    )
    _add_cluster_flags(demo, servers=2, workers=2)
    cli.add(
        demo, "--epochs", env="PS_DEMO_EPOCHS", type=int, default=8, help="passes over the data"
    )
    cli.add(
        demo, "--seed", env="PS_DEMO_SEED", type=int, default=0, help="split, init, shuffle seed"
    )
    cli.add(demo, "--out", env="PS_DEMO_OUT", default=DEMO_OUT, help="output folder")

    status = commands.add_parser(
        "status",
        help="show shards, variables, workers and clocks",
        description=(
            "Asks each shard for its health and status. With no ADDR, --cluster, $PS_SHARDS, "
            "$PS_SHARDS_FILE or $TF_CONFIG: the newest psctl local job running on this "
            "machine (its run folder)."
        ),
        epilog=admin.SECURITY_EPILOG,
    )
    admin.add_target_flags(status, timeout=5.0)
    cli.add(
        status,
        "--watch",
        env="PS_STATUS_WATCH",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C, or until the local job ends",
    )
    cli.add(
        status,
        "--json",
        env="PS_STATUS_JSON",
        action="store_true",
        default=False,
        help="print JSON instead of tables",
    )
    admin.add_parsers(commands)
    certs.add_parser(commands)
    dashboard_server.add_parser(commands)
    return parser


def _add_cluster_flags(parser: argparse.ArgumentParser, servers: int, workers: int) -> None:
    cli.add(
        parser,
        "--servers",
        env="PS_SERVERS",
        type=int,
        default=servers,
        help="parameter-server shards (none in modes local and allreduce)",
    )
    # None: the command's default, or 1 in mode local (where any other count is refused).
    cli.add(
        parser,
        "--workers",
        env="PS_WORKERS",
        type=int,
        default=None,
        help=f"worker processes; unset: {workers}, or 1 in mode local",
    )
    parser.set_defaults(default_workers=workers)
    cli.add(
        parser,
        "--mode",
        env="PS_MODE",
        choices=LAUNCH_MODES,
        default="sync",
        help="consistency mode",
    )
    cli.add(
        parser,
        "--staleness",
        env="PS_STALENESS",
        type=int,
        default=DEFAULT_STALENESS,
        help="ssp: steps a worker may run ahead of the slowest",
    )
    cli.add(
        parser,
        "--timeout",
        env="PS_RUN_TIMEOUT",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds before everything is killed",
    )
    cli.add(
        parser,
        "--start-timeout",
        env="PS_START_TIMEOUT",
        type=float,
        default=DEFAULT_START_TIMEOUT_S,
        help="seconds for the shards to serve",
    )
    cli.add(
        parser,
        "--grace",
        env="PS_GRACE",
        type=float,
        default=DEFAULT_GRACE_S,
        help="seconds processes get after SIGTERM before SIGKILL",
    )


def _add_node_flags(parser: argparse.ArgumentParser) -> None:
    cli.add(
        parser,
        "--nnodes",
        env="PS_NNODES",
        metavar="N|MIN:MAX",
        help="launchers (nodes) in the job; MIN:MAX is elastic: shards on node 0 only, nodes "
        "may join and leave",
    )
    cli.add(parser, "--node-rank", env="PS_NODE_RANK", type=int, default=0, help="this node")
    cli.add(
        parser,
        "--rdzv",
        env="PS_RDZV",
        metavar="HOST:PORT",
        help="node 0's rendezvous store (node 0 hosts it; the others connect)",
    )
    cli.add(
        parser,
        "--join-timeout",
        env="PS_JOIN_TIMEOUT",
        type=float,
        default=nodes.DEFAULT_JOIN_TIMEOUT_S,
        help="seconds to wait for the other nodes",
    )
    cli.add(
        parser,
        "--node-timeout",
        env="PS_NODE_TIMEOUT",
        type=float,
        default=nodes.DEFAULT_NODE_TIMEOUT_S,
        help="seconds of silence after which a node counts as gone",
    )


def _nodes_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> nodes.NodesConfig | None:
    if args.nnodes is None:
        if args.rdzv is not None or args.node_rank:
            parser.error("--rdzv and --node-rank need --nnodes")
        return None
    if args.rdzv is None:
        parser.error("--nnodes needs --rdzv HOST:PORT (node 0's address and a free port)")
    try:
        return nodes.NodesConfig(
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv=args.rdzv,
            join_timeout_s=args.join_timeout,
            node_timeout_s=args.node_timeout,
        )
    except ValueError as exc:
        parser.error(str(exc))


def build_add_parser() -> argparse.ArgumentParser:
    """The ``psctl local add`` parser."""
    parser = argparse.ArgumentParser(
        prog="psctl local add",
        description=(
            "Starts more workers in a running `psctl local --elastic` job: its launcher starts "
            "them (output, supervision and shutdown as for the first ones), each with a worker "
            "id the run has not used. Prints each worker's name and pid."
        ),
    )
    cli.add(
        parser,
        "--run",
        env="PS_RUN_DIR",
        help="the run's folder (its launcher prints it as `run folder ...`); unset: the one "
        "elastic job running here (refused, listing them, when there are several)",
    )
    cli.add(parser, "--count", env="PS_ADD_COUNT", type=int, default=1, help="workers to add")
    cli.add(
        parser,
        "--timeout",
        env="PS_ADD_TIMEOUT",
        type=float,
        default=local_add.DEFAULT_ADD_TIMEOUT_S,
        help="seconds to wait for the launcher to answer",
    )
    return parser


def _local_add(argv: list[str]) -> int:
    parser = build_add_parser()
    args = parser.parse_args(argv)
    try:
        folder = local_add.find_run(args.run)
        started = local_add.request_add(folder, args.count, args.timeout)
    except (ValueError, OSError) as exc:
        print(f"psctl local add: {exc}", file=sys.stderr)
        return 1
    for name, pid in started:
        print(f"{name} started (pid {pid})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``psctl`` / ``python -m psctl.main``; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    envnames.warn_unknown(who="psctl")
    if argv[:2] == ["local", "add"]:
        return _local_add(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "certs":
        return _to_a_reader(lambda: certs.run(args))
    if args.command in admin.COMMANDS:
        return _to_a_reader(lambda: admin.main(parser, args))
    if args.command == "status":
        return _to_a_reader(lambda: _status(parser, args))
    if args.command == "dashboard":
        return dashboard_server.run(parser, args)
    if args.command == "demo":
        return _demo(parser, args)
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return run_local(_local_config(parser, args, command))


def _to_a_reader(command: Callable[[], int]) -> int:
    """Runs a command whose output is for a reader; one that stops reading early (``psctl
    status | head -3``) ends it quietly with 0: it took what it wanted, and nothing failed
    here (no traceback, no error exit under ``set -o pipefail``)."""
    try:
        return command()
    except BrokenPipeError:
        # The interpreter flushes stdout once more at exit: into nothing, not the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _local_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace, command: list[str]
) -> LocalConfig:
    if getattr(args, "fresh", False) and not os.environ.get("PS_CHECKPOINT_DIR"):
        parser.error("--fresh sets aside the checkpoints in $PS_CHECKPOINT_DIR, which is unset")
    workers = args.workers
    if workers is None:
        workers = 1 if args.mode == "local" else args.default_workers
    try:
        return LocalConfig(
            command=tuple(command),
            servers=args.servers,
            workers=workers,
            mode=args.mode,
            staleness=args.staleness,
            timeout_s=args.timeout,
            start_timeout_s=args.start_timeout,
            grace_s=args.grace,
            elastic=getattr(args, "elastic", None),
            fresh=getattr(args, "fresh", False),
            export=getattr(args, "export", None),
            nodes=_nodes_config(parser, args) if hasattr(args, "nnodes") else None,
        )
    except ValueError as exc:
        parser.error(str(exc))


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    missing = [m for m in ("torch", "sklearn", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        parser.error(
            f"the demo needs {', '.join(missing)}: install torch and the demo extra "
            "(pip install -e '.[demo]'), or run `bash scripts/dev.sh demo`"
        )
    if args.mode in SHARDLESS_MODES:
        args.servers = 0  # one process, or workers averaging among themselves: no shards
    out = Path(args.out).resolve()
    command = [sys.executable, "-m", "psctl.demo", "--epochs", str(args.epochs)]
    command += ["--seed", str(args.seed), "--out", str(out)]
    config = _local_config(parser, args, command)
    out.mkdir(parents=True, exist_ok=True)
    demo_results.clear(out)
    output = ProgressOutput(sys.stdout, sys.stderr)
    started = time.perf_counter()
    code = run_local(config, output=output)
    if code != 0:
        return code
    try:
        metrics = demo_results.read_metrics(out)
        plot = out / demo_results.PLOT_FILE
        if config.workers > 1:  # a lone worker plotted its own history
            plot = demo_results.plot_losses(out, config.workers)
        walls = demo_results.read_walls(out, config.workers)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"psctl demo: the workers succeeded but left no complete results in {out}: {exc}")
        return 1
    total = time.perf_counter() - started
    print("\n" + demo_results.summary(metrics, walls, config.servers, total, out, plot), flush=True)
    return 0


def _status(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    run = None
    try:
        env_says = launchers.shard_addresses() is not None
    except ValueError:
        env_says = True  # malformed: admin.shard_addresses reports it
    if args.addresses or args.cluster is not None or env_says:
        addresses = admin.shard_addresses(parser, args)
    else:
        try:
            run = run_folder.newest_run()
        except ValueError as exc:
            parser.error(f"{exc}; give shard addresses, --cluster, $PS_SHARDS, or $TF_CONFIG")
        addresses = list(run.info.get("shards") or [])
        if not addresses:
            parser.error(f"the newest job, {run.describe()}, has no shards (mode allreduce?)")
    if args.watch is not None and not args.watch > 0:
        parser.error(f"--watch must be > 0 seconds, got {args.watch}")
    try:
        return _show_status(parser, args, addresses, run)
    except KeyboardInterrupt:  # Ctrl-C ends --watch
        return 0


def _show_status(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    addresses: list[str],
    run: run_folder.Run | None,
) -> int:
    """Prints the status once, or (--watch) again every interval until the job ends."""
    render = status_view.render_json if args.json else status_view.render_table
    while True:
        try:
            health, statuses = status_view.gather(addresses, args.timeout)
        except ValueError as exc:  # unreadable PS_TLS_* files or a bad PS_TOKEN
            parser.error(str(exc))
        header = f"job: {run.describe()}\n" if run is not None and not args.json else ""
        if args.watch is not None and sys.stdout.isatty():
            print("\x1b[H\x1b[2J", end="")  # clear the terminal: a live view
        print(header + render(addresses, statuses, health), flush=True)
        code = 0 if status_view.all_serving(health, statuses) else 1
        if args.watch is None:
            return code
        time.sleep(args.watch)
        if run is not None and not run_folder.is_live(run.folder):
            print(f"the job in {run.folder} has ended", flush=True)
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
