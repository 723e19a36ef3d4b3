"""The run folder of a ``psctl local`` job: where it says what it runs, and how tools find it.

Every ``psctl local`` makes ``$TMPDIR/psctl-XXXX/`` and prints it at start. ``run.json`` holds
the job's shards, mode, workers and launcher pid; the launcher holds an exclusive ``flock`` on
``run.lock`` for as long as it runs. A job is live exactly while that lock is held: the kernel
drops it when the launcher exits, however it dies (kill -9 too), so a folder left behind, or a
pid reused by another process, never passes for a running job. ``psctl status`` (no address)
and ``psctl local add`` (no ``--run``) look here.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
PREFIX = "psctl-"


def write_json(path: Path, data: dict) -> None:
    """Writes JSON to ``path`` atomically (a reader sees all of it or nothing)."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(data))
    os.replace(part, path)


@dataclass(frozen=True)
class Run:
    """A live job found on this machine: its folder and what ``run.json`` says."""

    folder: Path
    info: dict[str, Any]

    @property
    def started(self) -> float:
        return float(self.info.get("started", 0.0))

    def describe(self) -> str:
        """One line naming the job: folder, launcher pid, mode, workers, shards."""
        info = self.info
        elastic = f", elastic {info['elastic']}" if info.get("elastic") else ""
        return (
            f"{self.folder} (psctl local pid {info.get('pid')}, mode {info.get('mode')}, "
            f"{info.get('workers')} worker(s){elastic}, shards {info.get('shards') or 'none'})"
        )


class RunFolder:
    """The launcher's side: creates the folder, holds its lock, publishes ``run.json``."""

    def __init__(self, parent: Path | None = None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        self._lock: IO[bytes] | None = open(self.path / LOCK_FILE, "wb")  # noqa: SIM115
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._info: dict[str, Any] = {"pid": os.getpid(), "started": time.time()}

    def publish(self, **info: Any) -> None:
        """Adds ``info`` to ``run.json`` (rewritten atomically)."""
        self._info.update(info)
        write_json(self.path / RUN_FILE, self._info)

    def remove(self) -> None:
        """Releases the lock and deletes the folder (the job is over)."""
        if self._lock is not None:
            self._lock.close()  # closing the descriptor releases the flock
            self._lock = None
        shutil.rmtree(self.path, ignore_errors=True)


def is_live(folder: Path) -> bool:
    """Whether a launcher still holds ``folder``'s lock (its job is running)."""
    try:
        with open(folder / LOCK_FILE, "rb") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False  # the lock is released when the file closes
    except OSError:
        return False


def read_run(folder: Path) -> Run | None:
    """The live job in ``folder``; None when it is not one (no lock held, no run.json)."""
    if not is_live(folder):
        return None
    try:
        info = json.loads((folder / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return Run(folder, info) if isinstance(info, dict) else None


def live_runs(parent: Path | None = None) -> list[Run]:
    """Every live job of this user under ``parent`` (default: ``$TMPDIR``), oldest first."""
    parent = Path(tempfile.gettempdir()) if parent is None else parent
    found = []
    for folder in parent.glob(f"{PREFIX}*"):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        run = read_run(folder)
        if run is not None:
            found.append(run)
    return sorted(found, key=lambda r: r.started)


def newest_run(parent: Path | None = None) -> Run:
    """The newest live job on this machine.

    Raises:
        ValueError: none is running.
    """
    runs = live_runs(parent)
    if not runs:
        where = parent or tempfile.gettempdir()
        raise ValueError(f"no psctl local job is running on this machine (looked in {where})")
    return runs[-1]
