"""``psctl``: launch a local cluster like torchrun, train the demo, show the shards' status."""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pswire import cli
from pswire.channel import insecure_channel
from pswire.cluster import ClusterSpec
from pswire.errors import PSError
from psworker.client import MODES
from psworker.client import status as shard_status

DEFAULT_TIMEOUT_S = 3600.0
DEFAULT_START_TIMEOUT_S = 60.0
DEFAULT_GRACE_S = 5.0
# Exit codes beside the workers' own: the shell's for "timed out" and for death by a signal.
EXIT_TIMEOUT = 124
EXIT_SIGNAL_BASE = 128
_POLL_S = 0.05


@dataclass(frozen=True)
class LocalConfig:
    """One ``psctl local`` run: what to launch, how many of each, and every time limit."""

    command: tuple[str, ...]
    servers: int = 1
    workers: int = 1
    mode: str = "sync"
    staleness: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    grace_s: float = DEFAULT_GRACE_S

    def __post_init__(self) -> None:
        problems = []
        if not self.command:
            problems.append("give the worker command after --")
        if self.servers < 1:
            problems.append(f"--servers must be >= 1, got {self.servers}")
        if self.workers < 1:
            problems.append(f"--workers must be >= 1, got {self.workers}")
        if self.mode not in MODES:
            problems.append(f"--mode must be one of {MODES}, got {self.mode!r}")
        if self.staleness < 0:
            problems.append(f"--staleness must be >= 0, got {self.staleness}")
        for name, value in (
            ("--timeout", self.timeout_s),
            ("--start-timeout", self.start_timeout_s),
        ):
            if not value > 0:
                problems.append(f"{name} must be > 0 seconds, got {value}")
        if not self.grace_s >= 0:
            problems.append(f"--grace must be >= 0 seconds, got {self.grace_s}")
        if problems:
            raise ValueError("; ".join(problems))


class _Stop(Exception):
    """Ends a local run early with an exit code; the message says why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Child:
    """One launched process, its output pumped line by line under a prefix."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str],
        out: TextIO,
        lock: threading.Lock,
        exits: queue.Queue[tuple[_Child, int]],
    ) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            list(argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._out, self._lock, self._exits = out, lock, exits
        self._reader = threading.Thread(target=self._pump, name=f"out-{name}", daemon=True)
        self._waiter = threading.Thread(target=self._wait, name=f"wait-{name}", daemon=True)
        self._reader.start()
        self._waiter.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        prefix = f"[{self.name}] "
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            with self._lock:
                self._out.write(prefix + line + "\n")
                self._out.flush()
        self.proc.stdout.close()

    def _wait(self) -> None:
        self._exits.put((self, self.proc.wait()))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def finish_output(self, timeout: float) -> None:
        """Waits for the rest of the output (bounded: a grandchild may hold the pipe open)."""
        self._reader.join(timeout)


class LocalCluster:
    """``N`` psserver daemons and ``M`` copies of a worker command on this machine.

    Like torchrun: the first worker to fail stops everything and its exit code is the result;
    when every worker succeeds the servers get SIGTERM and a grace period. Every wait has a
    deadline, and only processes started here are signalled, each by its PID.
    """

    def __init__(self, config: LocalConfig, out: TextIO | None = None) -> None:
        self.config = config
        self._out = out if out is not None else sys.stdout
        self._lock = threading.Lock()
        self._exits: queue.Queue[tuple[_Child, int]] = queue.Queue()
        self._servers: list[_Child] = []
        self._workers: list[_Child] = []
        self._signal: int | None = None

    def request_stop(self, signum: int) -> None:
        """Asks a running ``run`` to stop everything; safe to call from a signal handler."""
        # A plain assignment: a handler must not take locks the interrupted code may hold.
        self._signal = signum

    def run(self) -> int:
        """Launches the cluster, waits for the workers, stops everything; returns the exit code."""
        deadline = time.monotonic() + self.config.timeout_s
        with tempfile.TemporaryDirectory(prefix="psctl-") as tmp:
            try:
                addresses = self._start_servers(Path(tmp), deadline)
                self._start_workers(addresses)
                code = self._supervise(deadline)
            except _Stop as stop:
                self.say(str(stop))
                code = stop.code
            finally:
                self._stop_all()
        self.say(f"exit code {code}")
        return code

    def say(self, message: str) -> None:
        with self._lock:
            self._out.write(f"[psctl] {message}\n")
            self._out.flush()

    # -- start ------------------------------------------------------------------------------

    def _start_servers(self, folder: Path, deadline: float) -> list[str]:
        cfg = self.config
        start_deadline = min(deadline, time.monotonic() + cfg.start_timeout_s)
        env = _child_env()
        # Servers get their port from the flags; a TF_CONFIG meant for workers is not theirs.
        env.pop("TF_CONFIG", None)
        # Each waiting pull and push holds a server thread: leave room for every worker.
        threads = str(max(64, 4 * cfg.workers + 16))
        port_files = [folder / f"ps{i}.port" for i in range(cfg.servers)]
        for i, port_file in enumerate(port_files):
            argv = [sys.executable, "-m", "psserver", "--host", "127.0.0.1", "--port", "0"]
            argv += ["--port-file", str(port_file), "--threads", threads]
            argv += ["--grace", str(cfg.grace_s)]
            self._servers.append(self._spawn(f"ps{i}", argv, env))
        ports = [
            self._read_port(s, f, start_deadline)
            for s, f in zip(self._servers, port_files, strict=True)
        ]
        addresses = [f"127.0.0.1:{p}" for p in ports]
        for child, address in zip(self._servers, addresses, strict=True):
            self._wait_serving(child, address, start_deadline)
            self.say(f"{child.name} serving at {address} (pid {child.proc.pid})")
        return addresses

    def _read_port(self, child: _Child, port_file: Path, deadline: float) -> int:
        while True:
            self._check_interrupt()
            if port_file.exists():
                text = port_file.read_text().strip()
                # psserver renames a complete file into place, so text is never half a number.
                return int(text)
            if not child.alive():
                raise _Stop(1, f"{child.name} exited with code {child.proc.returncode} at start")
            if time.monotonic() >= deadline:
                raise _Stop(1, f"{child.name} wrote no port file within the start timeout")
            time.sleep(_POLL_S)

    def _wait_serving(self, child: _Child, address: str, deadline: float) -> None:
        request = health_pb2.HealthCheckRequest(service="")
        with insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                self._check_interrupt()
                if not child.alive():
                    raise _Stop(
                        1, f"{child.name} exited with code {child.proc.returncode} at start"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Stop(1, f"{child.name} at {address} was not SERVING in time")
                try:
                    # Short tries, so a signal or a dead server is noticed between them.
                    reply = stub.Check(request, timeout=min(left, 1.0), wait_for_ready=True)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass  # not up yet; the deadline above bounds the retries
                time.sleep(_POLL_S)

    def _start_workers(self, ps: list[str]) -> None:
        cfg = self.config
        placeholders = [f"127.0.0.1:{port}" for port in _free_ports(cfg.workers)]
        for i in range(cfg.workers):
            env = _child_env()
            env["TF_CONFIG"] = json.dumps(
                {
                    "cluster": {"ps": ps, "worker": placeholders},
                    "task": {"type": "worker", "index": i},
                }
            )
            env["PS_MODE"] = cfg.mode
            env["PS_STALENESS"] = str(cfg.staleness)
            env["PS_WORKER_ID"] = str(i)
            env["PS_NUM_WORKERS"] = str(cfg.workers)
            child = self._spawn(f"worker{i}", cfg.command, env)
            self.say(f"{child.name} started (pid {child.proc.pid})")
            self._workers.append(child)

    def _spawn(self, name: str, argv: Sequence[str], env: dict[str, str]) -> _Child:
        try:
            return _Child(name, argv, env, self._out, self._lock, self._exits)
        except OSError as exc:
            raise _Stop(1, f"could not start {name} ({argv[0]}): {exc}") from exc

    # -- run --------------------------------------------------------------------------------

    def _supervise(self, deadline: float) -> int:
        running = set(self._workers)
        while running:
            self._check_interrupt()
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Stop(EXIT_TIMEOUT, f"timed out after {self.config.timeout_s:g}s")
            try:
                child, code = self._exits.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            # On Ctrl-C the whole process group gets SIGINT: a worker dying of it is the
            # interrupt's doing, not a failure to report as the worker's own.
            self._check_interrupt()
            if child in running:
                running.discard(child)
                if code != 0:
                    raise _Stop(_exit_code(code), f"{child.name} failed with {_describe(code)}")
                self.say(f"{child.name} finished")
            elif child in self._servers:
                raise _Stop(
                    _exit_code(code) or 1,
                    f"{child.name} stopped with {_describe(code)} while workers were running",
                )
        return 0

    def _check_interrupt(self) -> None:
        if self._signal is not None:
            name = signal.Signals(self._signal).name
            raise _Stop(EXIT_SIGNAL_BASE + self._signal, f"{name} received; stopping")

    # -- stop -------------------------------------------------------------------------------

    def _stop_all(self) -> None:
        children = self._workers + self._servers
        for child in children:
            if child.alive():
                child.proc.terminate()
        deadline = time.monotonic() + self.config.grace_s
        for child in children:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{child.name} did not stop within {self.config.grace_s:g}s; killing")
                child.proc.kill()
                try:
                    child.proc.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    self.say(f"{child.name} (pid {child.proc.pid}) survived SIGKILL for 10s")
        for child in children:
            child.finish_output(timeout=2.0)
        for server in self._servers:
            if server.proc.returncode not in (0, None):
                self.say(f"{server.name} stopped with {_describe(server.proc.returncode)}")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The cluster psctl builds is the only one its children may see; a PS_CLUSTER left in the
    # caller's shell would override it in `psworker run`.
    env.pop("PS_CLUSTER", None)
    # Children's output goes through a pipe; unbuffered, their lines appear as they happen.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _free_ports(count: int) -> list[int]:
    """Ports free right now, for the workers' placeholder addresses (nothing binds them)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: death by signal N is 128 + N."""
    return EXIT_SIGNAL_BASE - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


# -- status ---------------------------------------------------------------------------------


def health(address: str, timeout: float) -> str:
    """The grpc.health.v1 status name of the server at ``address``, or ``UNREACHABLE``."""
    with insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError:
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def shard_report(address: str, timeout: float) -> dict[str, Any]:
    """One shard's health and status as plain data; ``error`` says why a part is missing."""
    report: dict[str, Any] = {"address": address, "health": health(address, timeout)}
    if report["health"] == "UNREACHABLE":
        report["error"] = f"no answer from {address} within {timeout:g}s"
        return report
    try:
        reply = shard_status([address], timeout)[0]
    except PSError as exc:
        report["error"] = str(exc)
        return report
    job = reply.job if reply.HasField("job") else None
    report.update(
        error=None,
        initialized=reply.initialized,
        mode=job.mode if job else None,
        staleness=job.staleness if job else None,
        num_workers=job.num_workers if job else None,
        optimizer=(
            {"name": job.optimizer.name, **dict(sorted(job.optimizer.params.items()))}
            if job
            else None
        ),
        clock=reply.clock,
        num_variables=len(job.variables) if job else 0,
        variables=[
            {"name": v.name, "dtype": v.dtype, "shape": list(v.shape)}
            for v in (job.variables if job else [])
        ],
        total_bytes=reply.total_bytes,
        pushes_applied=reply.pushes_applied,
        pushes_duplicate=reply.pushes_duplicate,
        workers=[
            {
                "worker_id": w.worker_id,
                "clock": w.clock,
                "seconds_since_heartbeat": round(w.seconds_since_heartbeat, 3),
            }
            for w in reply.workers
        ],
    )
    return report


def format_reports(reports: list[dict[str, Any]]) -> str:
    """A summary table of the shards, then each shard's workers."""
    rows = []
    for i, r in enumerate(reports):
        if r.get("error"):
            rows.append([str(i), r["address"], r["health"], "-", "-", "-", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                str(i),
                r["address"],
                r["health"],
                "yes" if r["initialized"] else "no",
                r["mode"] or "-",
                "-" if r["staleness"] is None else str(r["staleness"]),
                str(r["clock"]),
                str(r["num_variables"]),
                _bytes(r["total_bytes"]),
                f"{r['pushes_applied']} (+{r['pushes_duplicate']} dup)",
            ]
        )
    headers = ["SHARD", "ADDRESS", "HEALTH", "INIT", "MODE", "STALENESS", "CLOCK", "VARS"]
    lines = _table([*headers, "BYTES", "PUSHES"], rows)
    for i, r in enumerate(reports):
        lines.append("")
        if r.get("error"):
            lines.append(f"shard {i} ({r['address']}): {r['error']}")
            continue
        if not r["workers"]:
            lines.append(f"shard {i} ({r['address']}): no workers registered")
            continue
        lines.append(f"shard {i} ({r['address']}) workers:")
        worker_rows = [
            [str(w["worker_id"]), str(w["clock"]), f"{w['seconds_since_heartbeat']:.1f}s ago"]
            for w in r["workers"]
        ]
        lines += ["  " + line for line in _table(["WORKER", "CLOCK", "LAST SEEN"], worker_rows)]
    return "\n".join(lines)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c) for c in col) for col in zip(headers, *rows, strict=True)]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


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
            "first worker to fail stops the rest and its exit code is psctl's."
        ),
    )
    _add_cluster_flags(local, servers=1, workers=1, staleness=0)
    local.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD", help="worker command")

    demo = commands.add_parser(
        "demo",
        help="train the built-in numpy softmax-regression demo on a local cluster",
        description="Runs `psctl local` with the demo (python -m psworker.demo) as the workers.",
    )
    _add_cluster_flags(demo, servers=2, workers=2, staleness=1)
    demo.add_argument("--steps", type=int, default=100, help="steps per worker [default 100]")

    status = commands.add_parser(
        "status",
        help="show shards, variables, workers and clocks",
        description="Asks each shard for its health and status.",
    )
    cli.add(
        status,
        "--cluster",
        env="PS_CLUSTER",
        help="TF_CONFIG JSON or file whose cluster.ps lists the shards, when no ADDR is given "
        "(else $TF_CONFIG)",
    )
    status.add_argument("addresses", nargs="*", metavar="ADDR", help="shard host:port")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds per shard [default 5]")
    return parser


def _add_cluster_flags(
    parser: argparse.ArgumentParser, servers: int, workers: int, staleness: int
) -> None:
    parser.add_argument(
        "--servers", type=int, default=servers, help=f"parameter-server shards [default {servers}]"
    )
    parser.add_argument(
        "--workers", type=int, default=workers, help=f"worker processes [default {workers}]"
    )
    cli.add(parser, "--mode", env="PS_MODE", choices=MODES, default="sync", help="consistency mode")
    cli.add(
        parser,
        "--staleness",
        env="PS_STALENESS",
        type=int,
        default=staleness,
        help="ssp: steps a worker may run ahead of the slowest",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds before everything is killed [default {DEFAULT_TIMEOUT_S:g}]",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=DEFAULT_START_TIMEOUT_S,
        help=f"seconds for the shards to serve [default {DEFAULT_START_TIMEOUT_S:g}]",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_S,
        help=f"seconds processes get after SIGTERM before SIGKILL [default {DEFAULT_GRACE_S:g}]",
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``psctl`` / ``python -m psworker.ctl``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "status":
        return _status(parser, args)
    if args.command == "demo":
        if args.steps < 1:
            parser.error(f"--steps must be >= 1, got {args.steps}")
        command = [sys.executable, "-m", "psworker.demo", "--steps", str(args.steps)]
    else:
        command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        config = LocalConfig(
            command=tuple(command),
            servers=args.servers,
            workers=args.workers,
            mode=args.mode,
            staleness=args.staleness,
            timeout_s=args.timeout,
            start_timeout_s=args.start_timeout,
            grace_s=args.grace,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return run_local(config)


def run_local(config: LocalConfig, out: TextIO | None = None) -> int:
    """Runs a ``LocalCluster``, stopping it on SIGTERM/SIGINT; returns the exit code."""
    cluster = LocalCluster(config, out)
    if threading.current_thread() is not threading.main_thread():
        return cluster.run()  # signal handlers can only be installed from the main thread
    previous = {
        signum: signal.signal(signum, lambda num, frame: cluster.request_stop(num))
        for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        return cluster.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _status(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    addresses = list(args.addresses)
    if not addresses:
        try:
            spec = ClusterSpec.load(args.cluster)
        except ValueError as exc:
            parser.error(str(exc))
        if spec is None:
            parser.error("give shard addresses, --cluster, or set $TF_CONFIG")
        addresses = list(spec.ps)
    if not addresses:
        parser.error("the cluster spec lists no parameter servers (cluster.ps)")
    reports = [shard_report(a, args.timeout) for a in addresses]
    if args.json:
        print(json.dumps({"shards": reports}, indent=2))
    else:
        print(format_reports(reports))
    healthy = all(not r.get("error") and r["health"] == "SERVING" for r in reports)
    return 0 if healthy else 1


if __name__ == "__main__":
    raise SystemExit(main())
