"""The processes a launcher starts: each child with its output pumped line by line under its
``[name]`` prefix, the environment it gets, and how its exit reads as a shell would say it."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import TextIO

from psworker.launchers import LAUNCHER_VARIABLES

# Death by signal N is exit code 128 + N, as a shell reports it.
EXIT_SIGNAL_BASE = 128


class PrefixedOutput:
    """Where a run's output goes: each line under its process's ``[name]`` prefix (``[psctl]``
    for the launcher's own), whole lines only, though children's readers write at once.

    Subclasses may render lines differently (``psctl.progress.ProgressOutput``).
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stdout
        self.lock = threading.Lock()

    def line(self, name: str, text: str) -> None:
        with self.lock:
            self.write(f"[{name}] {text}")

    def say(self, message: str) -> None:
        self.line("psctl", message)

    def close(self) -> None:
        """Called once every child's output has been read; nothing to release here."""

    def write(self, text: str) -> None:
        """Writes one line; the caller holds ``lock``."""
        self._stream.write(text + "\n")
        self._stream.flush()


class Child:
    """One launched process, its output pumped line by line to the run's output."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str],
        output: PrefixedOutput,
        exits: queue.Queue[tuple[Child, int]],
    ) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            list(argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._output, self._exits = output, exits
        self._reader = threading.Thread(target=self._pump, name=f"out-{name}", daemon=True)
        self._waiter = threading.Thread(target=self._wait, name=f"wait-{name}", daemon=True)
        self._reader.start()
        self._waiter.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            self._output.line(self.name, raw.decode(errors="replace").rstrip("\r\n"))
        self.proc.stdout.close()

    def _wait(self) -> None:
        self._exits.put((self, self.proc.wait()))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def finish_output(self, timeout: float) -> None:
        """Waits for the rest of the output (bounded: a grandchild may hold the pipe open)."""
        self._reader.join(timeout)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The cluster psctl builds is the only one its children may see; a PS_CLUSTER left in the
    # caller's shell would override it in `psworker run`.
    env.pop("PS_CLUSTER", None)
    # Nor may an outer launcher's (torchrun's, Slurm's): they would conflict with ours.
    for name in LAUNCHER_VARIABLES:
        env.pop(name, None)
    # Children's output goes through a pipe; unbuffered, their lines appear as they happen.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def free_ports(count: int) -> list[int]:
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


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: death by signal N is 128 + N."""
    return EXIT_SIGNAL_BASE - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"
