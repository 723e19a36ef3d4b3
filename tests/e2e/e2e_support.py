"""Helpers for end-to-end tests: launching daemons, waiting for them, checking PIDs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ports import free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30.0


def child_env(**extra: str) -> dict[str, str]:
    """This environment without PS_* or TF_CONFIG (so the host's settings cannot leak in),
    with the repository importable and unbuffered output, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_") and k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def health_status(address: str, timeout: float, wait: bool = True) -> int:
    """The grpc.health.v1 status of ``address``.

    With ``wait``, a server not yet listening gets until ``timeout`` to come up; without it,
    the first failed connection attempt fails the call.

    Raises:
        grpc.RpcError: no answer (within ``timeout``).
    """
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout, wait_for_ready=wait
        )
    return int(reply.status)


SERVING = health_pb2.HealthCheckResponse.SERVING


def pid_runs(pid: int, marker: str) -> bool:
    """Whether ``pid`` is a live (not zombie) process whose command line contains ``marker``.

    The marker guards against a recycled PID: only a process we launched carries it.
    """
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return marker in cmdline and state != "Z"


def pause(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until the kernel shows it stopped (state T): the signal takes
    effect asynchronously, and a call made before it does may still be answered."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout}s of SIGSTOP")
        time.sleep(0.005)


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class Processes:
    """Starts subprocesses for a test and kills whatever of them is left at its end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[subprocess.Popen[str]] = []
        self.adopted: list[tuple[int, str]] = []

    def start(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        stderr: int = subprocess.STDOUT,
    ) -> subprocess.Popen[str]:
        """Launches ``args`` with stdout in a text pipe and stderr merged into it (or to the
        file descriptor ``stderr``)."""
        proc = subprocess.Popen(
            list(args),
            env=child_env() if env is None else env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        self.started.append(proc)
        return proc

    def run(
        self,
        args: Sequence[str],
        timeout: float,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> tuple[int, str]:
        """Runs ``args`` to completion within ``timeout``; returns (exit code, output)."""
        proc = self.start(args, env, cwd)
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out

    def adopt(self, pid: int, marker: str) -> None:
        """Also reap ``pid`` (started indirectly, e.g. by psctl) if it still runs ``marker``."""
        self.adopted.append((pid, marker))

    def psserver(
        self, *flags: str, env: dict[str, str] | None = None, port_file: Path | None = None
    ) -> Daemon:
        """Starts ``python -m psserver`` on 127.0.0.1, waits for its port file and SERVING."""
        if port_file is None:
            port_file = self.tmp_path / f"ps{len(self.started)}.port"
            flags = ("--port-file", str(port_file), *flags)
        args = [sys.executable, "-m", "psserver", "--host", "127.0.0.1", *flags]
        proc = self.start(args, env)
        port = wait_port_file(proc, port_file, START_TIMEOUT_S)
        assert health_status(f"127.0.0.1:{port}", START_TIMEOUT_S) == SERVING
        return Daemon(proc, port)

    def metered_psserver(self, *flags: str, tries: int = 3) -> tuple[Daemon, int]:
        """Starts ``psserver`` with ``--metrics-port`` on a free port; the daemon and that port.

        The port is free when picked but can be taken before the daemon binds it (another job
        on this machine): the daemon then exits naming "Address already in use", and this
        starts it again on another port, up to ``tries`` times.
        """
        for attempt in range(tries):
            port = free_port()
            try:
                return self.psserver("--metrics-port", str(port), *flags), port
            except AssertionError as exc:
                if "Address already in use" not in str(exc) or attempt == tries - 1:
                    raise
        raise AssertionError("unreachable: the last try raises")

    def reap(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
            if proc.stdout is not None:
                proc.stdout.close()
        for pid, marker in self.adopted:
            if pid_runs(pid, marker):
                os.kill(pid, signal.SIGKILL)


def wait_port_file(proc: subprocess.Popen[str], path: Path, timeout: float) -> int:
    """Polls for the port a daemon writes once it serves, failing fast if it exits first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"daemon exited with {proc.returncode} before serving:\n{out}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no port file {path} within {timeout}s")
        time.sleep(0.02)
    return int(path.read_text())


def rss_bytes(pid: int) -> int:
    """The resident memory of ``pid`` (VmRSS in /proc/PID/status), in bytes; Linux only."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid} (a zombie?)")


class Lines:
    """Drains a process's output in a thread (a full pipe would block it), keeps its lines and
    reads the JSON ones that ``numpy_worker.py`` prints. The scripts print each JSON line in one
    write (``print(line + "\\n", end="")``): unbuffered, ``print``'s own newline is a second
    write, and a warning from another thread on the shared stderr could land between the two."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def text(self, last: int = 4000) -> str:
        with self.changed:
            return "\n".join(self.lines)[-last:]

    def latest(self, key: str) -> int | None:
        """The last value printed under ``key`` in a JSON line, None before any."""
        with self.changed:
            for line in reversed(self.lines):
                if line.startswith("{") and f'"{key}"' in line:
                    return int(json.loads(line)[key])
        return None

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Waits until ``predicate()`` holds; fails (with the output) after ``timeout`` or
        when the process ends first."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                # Whether the process had ended (and its output been read) before the predicate
                # is asked: then the predicate saw everything (was: a predicate on the exit
                # itself, false just before the process ended, failed the wait).
                ended = self.proc.poll() is not None and not self._thread.is_alive()
                if predicate():
                    return
                left = deadline - time.monotonic()
                if left <= 0 or ended:
                    self.changed.release()
                    try:
                        self._ask_for_stacks()
                    finally:
                        self.changed.acquire()
                    raise AssertionError(f"no {what} within {timeout}s:\n{self.text()}")
                self.changed.wait(min(left, 0.5))

    def _ask_for_stacks(self) -> None:
        """A process still running past its wait: SIGUSR1 asks a worker that registered
        ``faulthandler`` for it (env_worker.py) to print every thread's stack, so the failure
        shows where it hangs (a process without the handler ends, as it is failing anyway)."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGUSR1)
        time.sleep(1.0)

    def finish(self, out: Path, timeout: float = 120) -> dict[str, Any]:
        """Waits for ``{"done": ...}`` and a clean exit; the arrays the worker saved to
        ``out`` (.npz)."""
        import numpy as np

        self.wait_for(lambda: self.latest("done") is not None, timeout, "the end of training")
        assert self.proc.wait(timeout=30) == 0, self.text()
        with np.load(out) as saved:
            return {k: saved[k].copy() for k in saved.files}


NUMPY_WORKER = str(Path(__file__).with_name("numpy_worker.py"))
OVERLAP_WORKER = str(Path(__file__).with_name("overlap_worker.py"))


def numpy_worker(
    procs: Processes,
    addresses: Sequence[str],
    worker_id: int,
    num_workers: int,
    *flags: str,
    env: dict[str, str] | None = None,
) -> Lines:
    """Starts ``numpy_worker.py`` (see there for ``flags``; ``env`` as ``Processes.start``)
    and reads its output."""
    args = [sys.executable, NUMPY_WORKER, "--addresses", ",".join(addresses)]
    args += ["--worker-id", str(worker_id), "--num-workers", str(num_workers), *flags]
    return Lines(procs.start(args, env))


def pipelined_replies(metrics: list[str], outcome: str) -> float:
    """The shards' ``psserver_pipelined_replies_total{outcome=...}``, summed."""
    total = 0.0
    for url in metrics:
        with urllib.request.urlopen(url, timeout=10) as page:
            for line in page.read().decode().splitlines():
                if line.startswith(f'psserver_pipelined_replies_total{{outcome="{outcome}"'):
                    total += float(line.rsplit(" ", 1)[1])
    return total
