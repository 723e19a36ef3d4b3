"""The local-cluster launcher behind ``psctl``: start shards and workers, stream, stop them."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pscore.job import CLIENT_MODES, MODES
from psctl import admin
from psctl.children import (
    EXIT_SIGNAL_BASE,
    Child,
    PrefixedOutput,
    child_env,
    describe,
    exit_code,
    free_ports,
)
from psctl.local_add import AddRequests
from psctl.nodes import Layout, NodeError, Nodes, NodesConfig
from psctl.run_folder import RunFolder
from pswire.errors import ConfigError, PSError
from pswire.security import ClientSecurity
from psworker.elastic import parse_bounds

# "local" runs the one worker with no shards: the same script, the reference mode.
# "allreduce" runs no shards either: the workers form a ring at their TF_CONFIG addresses.
SHARDLESS_MODES = ("local", "allreduce")
LAUNCH_MODES = CLIENT_MODES
DEFAULT_TIMEOUT_S = 3600.0
DEFAULT_START_TIMEOUT_S = 60.0
DEFAULT_GRACE_S = 5.0
# ssp's bound for psctl local and psctl demo alike (0 would make ssp lock-step).
DEFAULT_STALENESS = 1
# Exit codes beside the workers' own: the shell's for "timed out" and for death by a signal.
EXIT_TIMEOUT = 124
_POLL_S = 0.05


@dataclass(frozen=True)
class LocalConfig:
    """One ``psctl local`` run: what to launch, how many of each, and every time limit."""

    command: tuple[str, ...]
    servers: int = 1
    workers: int = 1
    mode: str = "sync"
    staleness: int = DEFAULT_STALENESS
    timeout_s: float = DEFAULT_TIMEOUT_S
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    grace_s: float = DEFAULT_GRACE_S
    elastic: str | None = None  # "MIN:MAX": workers may be added and may fail (see LocalCluster)
    fresh: bool = False  # shards set their old checkpoints aside (psserver --fresh)
    export: str | None = None  # write the final model here once every worker succeeded
    nodes: NodesConfig | None = None  # one node of a multi-node job (psctl.nodes)

    def __post_init__(self) -> None:
        problems = []
        if self.export is not None and self.mode in SHARDLESS_MODES:
            problems.append(
                f"--export reads the final model from the shards; mode {self.mode} has none "
                "(save it from the training script)"
            )
        if self.nodes is not None:
            problems += self.nodes.refusals(self.mode, self.elastic)
        if self.elastic is not None:
            try:
                _, high = parse_bounds(self.elastic, "--elastic")
                if self.workers > high:
                    problems.append(f"--workers {self.workers} is over --elastic's MAX {high}")
            except ConfigError as exc:
                problems.append(str(exc))
            if self.mode not in MODES:
                problems.append(f"--elastic needs a parameter-server mode {MODES}, not {self.mode}")
        if not self.command:
            problems.append("give the worker command after --")
        if self.servers < 1 and self.mode not in SHARDLESS_MODES:
            problems.append(f"--servers must be >= 1, got {self.servers}")
        if self.workers < 1:
            problems.append(f"--workers must be >= 1, got {self.workers}")
        if self.mode == "local" and self.workers != 1:
            problems.append(f"--mode local runs one worker process, got --workers {self.workers}")
        if self.mode not in LAUNCH_MODES:
            problems.append(f"--mode must be one of {LAUNCH_MODES}, got {self.mode!r}")
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


class LocalCluster:
    """``N`` psserver daemons and ``M`` copies of a worker command on this machine.

    Like torchrun: the first worker to fail stops everything and its exit code is the result;
    when every worker succeeds the servers get SIGTERM and a grace period. Every wait has a
    deadline, and only processes started here are signalled, each by its PID.

    With ``elastic`` the job is an elastic one: a worker that fails is reported and the rest go
    on (the shards drop it after their heartbeat timeout); ``psctl local add`` starts more
    workers (``psctl.local_add``), each with a worker id this run has not used; the result is
    0 when some worker finished its training, else the first failure's code.
    """

    def __init__(
        self, config: LocalConfig, out: TextIO | None = None, output: PrefixedOutput | None = None
    ) -> None:
        self.config = config
        self._output: PrefixedOutput = output if output is not None else PrefixedOutput(out)
        self._exits: queue.Queue[tuple[Child, int]] = queue.Queue()
        self._servers: list[Child] = []
        self._workers: list[Child] = []
        self._signal: int | None = None
        self._shards: list[str] = []
        self._adds: AddRequests | None = None
        self._nodes: Nodes | None = None
        self._host = "127.0.0.1"  # where shards listen; a node's address towards node 0
        self._elastic = config.elastic  # the workers' "MIN:MAX" (from --nnodes on a node)

    def request_stop(self, signum: int) -> None:
        """Asks a running ``run`` to stop everything; safe to call from a signal handler."""
        # A plain assignment: a handler must not take locks the interrupted code may hold.
        self._signal = signum

    def run(self) -> int:
        """Launches the cluster, waits for the workers, stops everything; returns the exit code."""
        deadline = time.monotonic() + self.config.timeout_s
        folder = RunFolder()
        self.say(f"run folder {folder.path} (psctl status and psctl local add find the job there)")
        try:
            code = self._run(folder, deadline)
        finally:
            folder.remove()
        self.say(f"exit code {code}")
        return code

    def _run(self, folder: RunFolder, deadline: float) -> int:
        cfg = self.config
        try:
            layout = None
            if cfg.nodes is not None:
                self._nodes = Nodes(cfg.nodes, cfg.start_timeout_s, self._check_interrupt)
                self._host = self._nodes.bind_host
                job = {"mode": cfg.mode, "staleness": cfg.staleness, "workers": cfg.workers}
                self._nodes.agree(job)
            addresses = self._start_servers(folder.path, deadline)
            folder.publish(shards=addresses, mode=cfg.mode, workers=cfg.workers)
            if self._nodes is not None:
                layout = self._nodes.join(addresses, cfg.workers)
                addresses = layout.shards
                last = layout.first_worker + cfg.workers - 1
                self.say(
                    f"node {self._nodes.rank}: job shards {addresses}, this node's workers "
                    f"{layout.first_worker}..{last} of {layout.num_workers}"
                )
                self._nodes.start_beating()
            self._start_workers(addresses, layout)
            info: dict = {"shards": addresses, "elastic": self._elastic}
            if self._nodes is not None:
                info["node_rank"] = self._nodes.rank
            folder.publish(**info)
            if cfg.elastic is not None:
                self._adds = AddRequests(folder.path)
                self.say(f"elastic {cfg.elastic}: add workers with `psctl local add`")
            code = self._supervise(deadline)
            code = self._finish(code, deadline)
        except _Stop as stop:
            self.say(str(stop))
            code = stop.code
        except (NodeError, PSError, ConfigError) as exc:
            self.say(str(exc))
            code = 1
        finally:
            self._stop_all()
            if self._nodes is not None:
                self._nodes.close()
            self._output.close()
        return code

    def _finish(self, code: int, deadline: float) -> int:
        """Once this node's workers are done: waits for the other nodes its shards (or its
        store) may serve, exports the model (``--export``) while the shards still run, and
        (node 0) releases the other nodes' shards."""
        nodes = self._nodes
        if nodes is not None:
            nodes.settle(code, bool(self._servers), lambda: self._tick(deadline), self.say)
        if code == 0 and self.config.export is not None and (nodes is None or nodes.rank == 0):
            try:
                written = admin.export_state_dict(self._shards, self.config.export)
            except (PSError, OSError) as exc:
                code = 1
                self.say(f"--export {self.config.export} failed: {exc}")
            else:
                self.say(
                    f"exported the final model ({len(written.tensors)} tensors, shard clocks "
                    f"{written.clocks}) to {written.path}"
                )
        elif code == 0 and self.config.export is not None:
            self.say("node 0 exports the model (--export on other nodes is not used)")
        if nodes is not None:
            nodes.release(code == 0 and bool(self._servers), lambda: self._tick(deadline), self.say)
        return code

    def _tick(self, deadline: float) -> None:
        """One wait of a finishing node: interrupts and the run's deadline end it."""
        self._check_interrupt()
        if time.monotonic() >= deadline:
            raise _Stop(EXIT_TIMEOUT, f"timed out after {self.config.timeout_s:g}s")
        time.sleep(4 * _POLL_S)

    def say(self, message: str) -> None:
        self._output.say(message)

    # -- start ------------------------------------------------------------------------------

    def _start_servers(self, folder: Path, deadline: float) -> list[str]:
        cfg = self.config
        start_deadline = min(deadline, time.monotonic() + cfg.start_timeout_s)
        env = child_env()
        # Servers get their port from the flags; a TF_CONFIG meant for workers is not theirs.
        env.pop("TF_CONFIG", None)
        # Each waiting pull and push holds a server thread: leave room for every worker.
        threads = str(max(64, 4 * cfg.workers + 16))
        # Local and allreduce modes have no shards; nor has a node but 0 of an elastic job.
        servers = 0 if cfg.mode in SHARDLESS_MODES else cfg.servers
        if cfg.nodes is not None and cfg.nodes.elastic and cfg.nodes.node_rank != 0:
            if servers:
                self.say(
                    "starting no shards: in an elastic multi-node job they run on node 0, so "
                    "the model outlives any node that leaves"
                )
            servers = 0
        port_files = [folder / f"ps{i}.port" for i in range(servers)]
        checkpoints = env.get("PS_CHECKPOINT_DIR")
        for i, port_file in enumerate(port_files):
            argv = [sys.executable, "-m", "psserver", "--host", self._host, "--port", "0"]
            argv += ["--port-file", str(port_file), "--threads", threads]
            argv += ["--grace", str(cfg.grace_s)]
            if cfg.fresh:
                argv.append("--fresh")
            if checkpoints:
                # One folder per shard daemon (a second one in a folder is refused).
                env = {**env, "PS_CHECKPOINT_DIR": str(Path(checkpoints) / f"ps{i}")}
                self.say(f"ps{i} checkpoints to {env['PS_CHECKPOINT_DIR']}")
            self._servers.append(self._spawn(f"ps{i}", argv, env))
        ports = [
            self._read_port(s, f, start_deadline)
            for s, f in zip(self._servers, port_files, strict=True)
        ]
        addresses = [f"{self._host}:{p}" for p in ports]
        for child, address in zip(self._servers, addresses, strict=True):
            self._wait_serving(child, address, start_deadline)
            self.say(f"{child.name} serving at {address} (pid {child.proc.pid})")
        return addresses

    def _read_port(self, child: Child, port_file: Path, deadline: float) -> int:
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

    def _wait_serving(self, child: Child, address: str, deadline: float) -> None:
        request = health_pb2.HealthCheckRequest(service="")
        with ClientSecurity.from_env().channel(address) as channel:
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

    def _start_workers(self, ps: list[str], layout: Layout | None = None) -> None:
        cfg = self.config
        self._shards = ps
        first = layout.first_worker if layout is not None else 0
        total = layout.num_workers if layout is not None else cfg.workers
        if layout is not None and layout.elastic is not None:
            self._elastic = layout.elastic
        if self._elastic is not None:
            for i in range(cfg.workers):
                self._start_elastic_worker(first + i, total)
            return
        placeholders = [f"127.0.0.1:{port}" for port in free_ports(total)]
        for i in range(first, first + cfg.workers):
            env = child_env()
            if cfg.mode == "local":
                # No cluster at all: psworker.connect() then trains in this one process.
                env.pop("TF_CONFIG", None)
            elif cfg.mode == "allreduce" and cfg.nodes is not None and layout is not None:
                # The ring's addresses by rendezvous in the store node 0's launcher hosts.
                env.pop("TF_CONFIG", None)
                env.update(
                    MASTER_ADDR=cfg.nodes.host,
                    MASTER_PORT=str(cfg.nodes.port),
                    TORCHELASTIC_USE_AGENT_STORE="True",
                    TORCHELASTIC_RUN_ID=layout.job_id,
                )
            else:
                env["TF_CONFIG"] = json.dumps(
                    {
                        "cluster": {"ps": ps, "worker": placeholders},
                        "task": {"type": "worker", "index": i},
                    }
                )
            env["PS_MODE"] = cfg.mode
            env["PS_STALENESS"] = str(cfg.staleness)
            env["PS_WORKER_ID"] = str(i)
            env["PS_NUM_WORKERS"] = str(total)
            child = self._spawn(f"worker{i}", cfg.command, env)
            self.say(f"{child.name} started (pid {child.proc.pid})")
            self._workers.append(child)

    def _start_elastic_worker(self, i: int, count: int | None = None) -> Child:
        """Worker ``i`` of an elastic job: the shards in $PS_SHARDS, no TF_CONFIG."""
        cfg = self.config
        env = child_env()
        env.pop("TF_CONFIG", None)
        env.update(
            PS_SHARDS=",".join(self._shards),
            PS_ELASTIC=str(self._elastic),
            PS_MODE=cfg.mode,
            PS_STALENESS=str(cfg.staleness),
            PS_WORKER_ID=str(i),
            PS_NUM_WORKERS=str(count or cfg.workers),
        )
        child = self._spawn(f"worker{i}", cfg.command, env)
        self.say(f"{child.name} started (pid {child.proc.pid})")
        self._workers.append(child)
        return child

    def _add_workers(self, count: int) -> list[tuple[str, int]]:
        """``psctl local add``: ``count`` more workers, each with an id not used before (ids
        of failed workers only once every other id below MAX is taken).

        Raises:
            ValueError: not that many ids free below MAX.
        """
        _, high = parse_bounds(str(self.config.elastic))
        used = {int(c.name.removeprefix("worker")) for c in self._workers}
        running = {int(c.name.removeprefix("worker")) for c in self._workers if c.alive()}
        free = [i for i in range(high) if i not in used]
        free += [i for i in range(high) if i in used and i not in running]
        if count < 1 or count > len(free):
            raise ValueError(
                f"cannot add {count} worker(s): {len(running)} of at most {high} are running"
            )
        started = [self._start_elastic_worker(i) for i in free[:count]]
        return [(c.name, c.proc.pid) for c in started]

    def _spawn(self, name: str, argv: Sequence[str], env: dict[str, str]) -> Child:
        try:
            return Child(name, argv, env, self._output, self._exits)
        except OSError as exc:
            raise _Stop(1, f"could not start {name} ({argv[0]}): {exc}") from exc

    # -- run --------------------------------------------------------------------------------

    def _supervise(self, deadline: float) -> int:
        running = set(self._workers)
        failures: list[int] = []
        finished = 0
        while running:
            self._check_interrupt()
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Stop(EXIT_TIMEOUT, f"timed out after {self.config.timeout_s:g}s")
            if self._adds is not None:
                before = len(self._workers)
                self._adds.poll(self._add_workers)
                running.update(self._workers[before:])
            if self._nodes is not None:
                for line in self._nodes.check():
                    self.say(line)
            try:
                child, code = self._exits.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            # On Ctrl-C the whole process group gets SIGINT: a worker dying of it is the
            # interrupt's doing, not a failure to report as the worker's own.
            self._check_interrupt()
            if child in running:
                running.discard(child)
                if code != 0 and self._elastic is not None:
                    self.say(
                        f"{child.name} failed with {describe(code)}; the elastic job goes on "
                        "without it"
                    )
                    failures.append(code)
                    continue
                if code != 0:
                    raise _Stop(exit_code(code), f"{child.name} failed with {describe(code)}")
                finished += 1
                self.say(f"{child.name} finished")
            elif child in self._servers:
                raise _Stop(
                    exit_code(code) or 1,
                    f"{child.name} stopped with {describe(code)} while workers were running",
                )
        if failures and not finished:
            return exit_code(failures[0])
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
                self.say(f"{server.name} stopped with {describe(server.proc.returncode)}")


def run_local(
    config: LocalConfig, out: TextIO | None = None, output: PrefixedOutput | None = None
) -> int:
    """Runs a ``LocalCluster``, stopping it on SIGTERM/SIGINT; returns the exit code.

    Output goes to ``output`` when given, else prefixed to ``out`` (default stdout).
    """
    cluster = LocalCluster(config, out, output)
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
